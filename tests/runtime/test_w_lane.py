"""``w_lane``: each W on a second thread of its CPU rank (LayerPipe's W apart from B) trains exactly as one lane does.

Three stages on one rank in this process, so the lane's W's run while the main thread computes other stages' F and B;
the W's of a lane run in the schedule's order, so every gradient adds up in the same order and the parameters after
three steps are bit for bit those of one lane (which tests/runtime/test_distributed.py holds to eager training).
"""

from __future__ import annotations

import copy
import functools
import json
import threading

import pytest
import torch

import fxpipe
from fxpipe import models
from fxpipe.cli.rank_common import synthetic_batch
from fxpipe.errors import OptionError
from fxpipe.schedules.generators import one_rank

M = 4


@functools.cache
def _compiled(name: str) -> tuple[models.ZooModel, fxpipe.Pipeline]:
    zoo = models.build(name, dtype=torch.float64)
    return zoo, fxpipe.compile(copy.deepcopy(zoo.model), zoo.example_inputs, stages=3)


def _train(name: str, defer_w: bool, **options: object) -> tuple[list[float], dict[str, torch.Tensor], object]:
    from fxpipe.runtime import PipelineRuntime

    zoo, pipe = _compiled(name)
    rt = PipelineRuntime(copy.deepcopy(pipe), one_rank(3, M, defer_w=defer_w), zoo.loss_fn, optimizer="sgd",
                         **options)  # type: ignore[arg-type]
    inputs, target = synthetic_batch(zoo, M)
    losses = [float(rt.step(inputs, target)) for _ in range(3)]
    params = {f"{s}.{n}": p.detach().clone() for s in rt.mine for n, p in rt.stages[s].module.named_parameters()}
    return losses, params, rt


@pytest.mark.parametrize("defer_w", [True, False], ids=["zb-gpipe", "gpipe-one-rank"])
@pytest.mark.parametrize("name", ["mlp-tiny", "gpt-tiny"])
def test_ws_on_a_second_lane_train_exactly_as_on_one(world1: None, name: str, defer_w: bool) -> None:
    ran_on: set[str] = set()
    from fxpipe.runtime import executor

    run = executor.PipelineRuntime._lane_weight

    def spy(self, *args):  # type: ignore[no-untyped-def]
        ran_on.add(threading.current_thread().name)
        return run(self, *args)

    one_losses, one_params, _ = _train(name, defer_w)
    executor.PipelineRuntime._lane_weight = spy  # type: ignore[method-assign]
    try:
        losses, params, rt = _train(name, defer_w, w_lane=True)
    finally:
        executor.PipelineRuntime._lane_weight = run  # type: ignore[method-assign]
    assert losses == one_losses and losses[-1] != losses[0]
    for key, value in one_params.items():
        torch.testing.assert_close(params[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    assert ran_on and all(n.startswith("fxpipe-w") for n in ran_on)  # every W on the lane's thread
    assert not [t for t in threading.enumerate() if t.name.startswith("fxpipe-w")]  # none kept between steps
    kinds = [a.kind.value for a, _, _ in rt.events]  # type: ignore[attr-defined]
    assert kinds.count("W") == 3 * M and sorted(t0 for _, t0, _ in rt.events) == [t0 for _, t0, _ in rt.events]  # type: ignore[attr-defined]


def test_what_a_second_lane_cannot_run_is_refused_in_one_line(world1: None) -> None:
    from fxpipe.runtime import PipelineRuntime

    zoo, pipe = _compiled("mlp-tiny")
    with pytest.raises(OptionError, match="clipping and fp16 read every gradient's norm: run it without --w-lane"):
        PipelineRuntime(copy.deepcopy(pipe), one_rank(3, M), zoo.loss_fn, w_lane=True, clip_grad_norm=1.0)


def test_fxpipe_run_with_a_second_lane_trains_like_one_process() -> None:
    from tests._helpers import MLP_PLAN, cli_plan, fxpipe_cli, ok, reference_losses

    doc = json.loads(ok(fxpipe_cli("run", cli_plan(*MLP_PLAN), "--nproc", "2", "--steps", "3", "--w-lane",
                                   "--json")).stdout)
    assert doc["losses"] == pytest.approx(reference_losses(3, model="mlp-tiny"), rel=1e-5)


@pytest.mark.parametrize(("args", "words"), [
    (("--schedule", "async-1f1b"), "an asynchronous schedule's update after each W would race the next F"),
    (("--clip-grad-norm", "1"), "clipping and fp16 read every gradient's norm"),
    (("--dp", "2"), "replicas sum each bucket's gradients as its last W ends"),
])
def test_fxpipe_run_refuses_what_a_second_lane_cannot_run_before_any_rank_starts(
        no_rank_starts: list[list[str]], args: tuple[str, ...], words: str) -> None:
    from tests._helpers import MLP_PLAN, cli_plan, fxpipe_cli, one_line_error

    line = one_line_error(fxpipe_cli("run", cli_plan(*MLP_PLAN), "--steps", "2", "--w-lane", *args))
    assert line == (f"error: --w-lane runs each W on a second thread of a CPU rank, and here {words}: "
                    "run it without --w-lane")
