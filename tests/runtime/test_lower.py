"""Lowering a plan and a schedule to per-rank programs: every message is sent once and received once."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fxpipe.errors import LoweringError
from fxpipe.runtime.lower import BACKWARD, FORWARD, check_programs, lower
from fxpipe.schedules.generators import generate
from fxpipe.schedules.simulate import Costs
from tests._helpers import zoo_pipe as _pipe


@pytest.mark.parametrize("name", ["mlp-tiny", "gpt-tiny", "resnet-tiny", "skip-tied"])
@pytest.mark.parametrize(("schedule", "stages", "ranks"), [("1f1b", 4, 4), ("zb-h2", 2, 2),
                                                           ("interleaved-1f1b", 4, 2), ("interleaved-1f1b", 8, 4)])
def test_every_send_has_its_receive(name: str, schedule: str, stages: int, ranks: int) -> None:
    if name == "skip-tied" and stages > 4:
        pytest.skip("skip-tied has 6 layers")
    pipe = _pipe(name, stages)
    sched = generate(schedule, stages, 2 * ranks, Costs.from_plan(pipe.plan))
    programs = [lower(pipe, sched, r) for r in range(ranks)]
    check_programs(programs)
    for p in programs:
        # Each value crosses to a rank once per microbatch, whichever of its stages read it.
        forward = [(m.name, m.mb, m.dst) for m in p.sends if m.direction == FORWARD]
        assert len(forward) == len(set(forward))
        # A rank's compute is exactly its schedule's compute, in order.
        assert [op.action for op in p.ops] == [a for a in sched.ranks[p.rank] if a.kind.name in ("F", "B", "W", "BW")]
        for op in p.ops:
            assert all(m.stage == op.action.stage for m in op.sends)
            assert all(m.direction == (FORWARD if op.action.kind.name == "F" else BACKWARD) for m in op.recvs)


def test_a_skip_connection_goes_straight_to_its_reader() -> None:
    pipe = _pipe("skip-tied", 4)
    sched = generate("gpipe", 4, 2, Costs.from_plan(pipe.plan))
    programs = [lower(pipe, sched, r) for r in range(4)]
    skip = [m for p in programs for m in p.sends if m.direction == FORWARD and m.src == 0 and m.dst == 3]
    assert skip, "the embedding's output should go from rank 0 to rank 3 directly"
    grads = [m for p in programs for m in p.sends if m.direction == BACKWARD and m.src == 3 and m.dst == 0]
    assert {m.name for m in grads} == {m.name for m in skip}


def test_check_programs_catches_a_missing_receive_and_a_shape_mismatch() -> None:
    pipe = _pipe("mlp-tiny", 2)
    sched = generate("1f1b", 2, 4, Costs.from_plan(pipe.plan))
    programs = [lower(pipe, sched, r) for r in range(2)]
    op = next(op for op in programs[1].ops if op.recvs)
    lost = op.recvs.pop()
    with pytest.raises(LoweringError, match="never receives"):
        check_programs(programs)
    op.recvs.append(dataclasses.replace(lost, shape=(*lost.shape, 2)))
    with pytest.raises(LoweringError, match="received as"):
        check_programs(programs)
    op.recvs[-1] = dataclasses.replace(lost, dtype=torch.float16)
    with pytest.raises(LoweringError, match="received as"):
        check_programs(programs)
