"""Per-pair order: without tags (NCCL, or gloo tag-blind) the k-th message A sends B is the k-th receive B posts
from A. The lowering derives every rank's posting order from its senders' and refuses programs that disagree."""

from __future__ import annotations

import dataclasses

import pytest

from fxpipe.errors import LoweringError
from fxpipe.runtime.lower import Message, RankProgram, check_pair_order, lower_all
from fxpipe.schedules.generators import GENERATORS, generate
from fxpipe.schedules.simulate import Costs
from tests._helpers import zoo_pipe

# (model, stages): one stage per rank on 2 and 4 ranks, and two per rank (interleaved) on 2 and 4 ranks
PIPES = [("mlp-tiny", 2), ("gpt-tiny", 4), ("gpt-tiny", 8)]


def _programs(model: str, stages: int, schedule: str, m: int) -> list[RankProgram]:
    pipe = zoo_pipe(model, stages)
    return lower_all(pipe, generate(schedule, stages, m, Costs.from_plan(pipe.plan)))


@pytest.mark.parametrize(("model", "stages"), PIPES)
def test_every_schedule_lowers_in_one_order_per_pair(model: str, stages: int) -> None:
    """Every generator (asynchronous too), at several microbatch counts: lower_all checks the order itself; here the
    posting order is also a permutation of the receives, each posted no later than the op that reads it."""
    checked = 0
    for name in GENERATORS:
        interleaved = name == "interleaved-1f1b"
        if interleaved != (stages == 8) and not (interleaved and stages == 4):
            continue
        ranks = stages // 2 if interleaved else stages
        for m in sorted({1, 2, ranks, 2 * ranks + 1, 3 * ranks}):
            if interleaved and m % ranks:
                continue
            programs = _programs(model, stages, name, m)
            assert len(programs) == ranks
            for p in programs:
                assert sorted(x.tag for x in p.posts) == sorted(x.tag for x in p.receives)
                place = {x.tag: n for n, x in enumerate(p.posts)}
                posted_by = 0  # every receive of ops 0..k is among the first posts
                for op in p.ops:
                    posted_by = max([posted_by, *(place[x.tag] + 1 for x in op.recvs)])
                    assert all(place[x.tag] < posted_by for x in op.recvs)
                for q in programs:  # the property itself, pair by pair
                    if q.rank != p.rank:
                        sent = [x.tag for x in q.sends if x.dst == p.rank]
                        assert sent == [x.tag for x in p.posts if x.src == q.rank]
            checked += 1
    assert checked >= (2 if stages == 8 else 5)  # the loop ran (8 stages: interleaved alone)


def test_interleaved_needs_the_derived_order() -> None:
    """interleaved-1f1b's receives, in the order its ops read them, differ from their senders' order: posting them as
    read would break a tag-blind pair; the derived order is what makes the schedule run under NCCL."""
    programs = _programs("gpt-tiny", 8, "interleaved-1f1b", 4)  # 4 ranks, two stages each
    assert any([x.tag for x in p.receives] != [x.tag for x in p.posts] for p in programs)
    read_order = [_with_posts(p, p.receives) for p in programs]
    with pytest.raises(LoweringError, match=r"^ranks \d -> \d disagree on their message \d+: rank \d sends "):
        check_pair_order(read_order)


def _with_posts(p: RankProgram, posts: list[Message]) -> RankProgram:
    return dataclasses.replace(p, posts=list(posts))


def test_a_perturbed_order_is_refused_with_the_pair_and_message() -> None:
    """Swap two of rank 0's sends to rank 1 (a program changed after lowering): one line names the pair and the
    first message they disagree on."""
    programs = _programs("mlp-tiny", 2, "1f1b", 4)
    check_pair_order(programs)
    ops = [op for op in programs[0].ops if op.sends]
    ops[0].sends, ops[1].sends = ops[1].sends, ops[0].sends
    with pytest.raises(LoweringError) as info:
        check_pair_order(programs)
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith("ranks 0 -> 1 disagree on their message 1: rank 0 sends ")
    assert "microbatch 1" in line.split(", rank 1 posts")[0] and "microbatch 0" in line.split(", rank 1 posts")[1]
    # the receiver's side perturbed instead
    ops[0].sends, ops[1].sends = ops[1].sends, ops[0].sends
    posts = programs[1].posts
    posts[0], posts[1] = posts[1], posts[0]
    with pytest.raises(LoweringError, match="^ranks 0 -> 1 disagree on their message 1"):
        check_pair_order(programs)
    # a receive missing at the end
    posts[0], posts[1] = posts[1], posts[0]
    last = posts.pop()
    with pytest.raises(LoweringError, match=r"rank 1 posts its receive for nothing"):
        check_pair_order(programs)
    posts.append(last)
    check_pair_order(programs)


def test_fxpipe_run_takes_nccl_only_where_every_rank_has_a_gpu_of_its_own() -> None:
    from fxpipe.cli.rank import process_group_backend

    assert process_group_backend("cuda", 2, 2) == "nccl"
    assert process_group_backend("cuda", 8, 4) == "nccl"
    assert process_group_backend("cuda", 1, 2) == "gloo"  # two ranks on one GPU: NCCL refuses, gloo stages
    assert process_group_backend("cuda", 0, 1) == "gloo"
    assert process_group_backend("cpu", 8, 2) == "gloo"


def test_the_channel_reads_the_backend_of_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group started without a backend runs gloo for CPU tensors and NCCL for CUDA ones."""
    import torch

    from fxpipe.runtime import channel

    monkeypatch.setattr(channel.dist, "get_backend", lambda: "cpu:gloo,cuda:nccl")
    assert channel.backend_of(torch.device("cuda", 1)) == "nccl"
    assert channel.backend_of(torch.device("cpu")) == "gloo"
    monkeypatch.setattr(channel.dist, "get_backend", lambda: "gloo")
    assert channel.backend_of(torch.device("cuda", 0)) == "gloo"
