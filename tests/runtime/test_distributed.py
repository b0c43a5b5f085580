"""The runtime over torch.distributed (gloo, separate processes): every schedule trains exactly like one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fxpipe.schedules.generators import GENERATORS
from tests._helpers import (
    BATCH_MIX,
    MODELS,
    assert_ranks_ok,
    check_saved,
    interleaved_case,
    launch_ranks,
    schedule_case,
    shared_case,
    tag_blind_cases,
    train_reference,
    with_plans,
)

# The training cases of each world size share one launch, made once per session (tests/_helpers.py: shared_launch,
# which test_replicas.py's cases share too); each test checks its own case's files.


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("model", MODELS)
def test_every_schedule_trains_like_one_process(model: str, ranks: int) -> None:
    """mlp, gpt (tied weights), resnet (BatchNorm), and skip-tied: the embedding's output skips
    stages to the head, which is tied to it across ranks."""
    check_saved(shared_case(ranks, f"schedules-{model}"), ranks, schedule_case(model, ranks))


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_synchronous_schedule_trains_tag_blind(ranks: int) -> None:
    """One tag for every message of a pair, matched first in, first out, as NCCL does: every synchronous schedule
    trains like one process, so each rank posts its receives in its senders' order (fxpipe.runtime.lower)."""
    from fxpipe.schedules.generators import generate

    synchronous = {name for name in GENERATORS if generate(name, 4, 4).synchronous}
    cases = {name: cfg for name, cfg in tag_blind_cases(ranks).items() if name.startswith("tag-blind")}
    ran = {s for cfg in cases.values() for s in cfg["schedules"]}
    assert synchronous | {"auto"} <= ran  # a new synchronous schedule joins SCHEDULES, and so this test
    for name, cfg in cases.items():
        check_saved(shared_case(ranks, name), ranks, cfg)


def test_a_perturbed_order_trains_wrong_tag_blind_and_right_with_tags() -> None:
    """Rank 1 posts its first two receives swapped (after the lowering's check): with tags nothing changes; without,
    each lands in the other's buffer and training goes wrong, so the tag-blind test can fail."""
    cases = tag_blind_cases(2)
    check_saved(shared_case(2, "perturbed-tags"), 2, cases["perturbed-tags"])
    cfg = cases["perturbed-tag-blind"]
    losses, _ = train_reference(cfg["model"], cfg["microbatches"], cfg["steps"])
    for rank in range(2):
        saved = torch.load(shared_case(2, "perturbed-tag-blind") / f"1f1b-rank{rank}.pt", weights_only=False)
        assert saved["losses"][0] != pytest.approx(losses[0], rel=1e-6)


# How each stage of the 2-stage plans runs batched-w's Ws (4 microbatches: two batches of 2): 2 microbatches at once,
# or per microbatch and why.
BATCHED_W = {
    "mlp-tiny": ["batched over 2 microbatches"] * 2,
    "skip-tied": ["batched over 2 microbatches"] * 2,
    # a traced attention's views hold the microbatch's size: the stage cannot be traced for 2 at once
    "gpt-tiny": ["per microbatch: the stage does not run on 2 microbatches at once"] * 2,
    # BatchNorm's W reads each microbatch's own mean and variance, which no concatenation combines
    "resnet-tiny": ["per microbatch: an input its W keeps the shape of differs between microbatches"] * 2,
    # stage 0's W backpropagates through x - x.mean(0): the first batched call's check catches it
    "batch-mix": ["per microbatch: its W over 2 microbatches is not the sum of the per-microbatch W's",
                  "batched over 2 microbatches"],
}


@pytest.mark.parametrize("model", sorted(BATCHED_W))
def test_batched_w_runs_one_w_per_stage_where_that_is_the_sum(model: str) -> None:
    """batched-w on 2 ranks trains like one process (``_check_saved``), and each stage's W ran as expected: one call
    per batch of 2 microbatches where the stage traces at 2 microbatches and its W is a sum over them, else per
    microbatch, with the reason."""
    case = "batched-w-batch-mix" if model == "batch-mix" else f"schedules-{model}"
    out = shared_case(2, case)
    cfg = BATCH_MIX if model == "batch-mix" else schedule_case(model, 2)
    check_saved(out, 2, {**cfg, "schedules": ["batched-w"]})
    how: dict[int, str] = {}
    for rank in range(2):
        how.update(torch.load(out / f"batched-w-rank{rank}.pt", weights_only=False)["batched_w"])
    assert sorted(how) == [0, 1]
    for s, expected in enumerate(BATCHED_W[model]):
        assert how[s].startswith(expected), (s, how[s])


@pytest.mark.parametrize("model", ["gpt-tiny", "resnet-tiny"])
def test_interleaved_on_four_ranks(model: str) -> None:
    """8 stages cut between nodes: some stages only transpose, view or flatten their input, and
    their gradients must still reach the stages before them (split_backward once dropped them)."""
    check_saved(shared_case(4, f"interleaved-{model}"), 4, interleaved_case(model))


def test_a_failing_rank_stops_the_others_with_a_clear_error(tmp_path: Path) -> None:
    results = launch_ranks(tmp_path, 2, {"model": "mlp-tiny", "schedules": ["1f1b"], "microbatches": 4, "steps": 3,
                                    "fail_rank": 1})
    assert results[1].returncode != 0 and "boom on rank 1" in results[1].stderr
    assert results[0].returncode != 0
    assert "rank 0 waited for" in results[0].stderr and "from rank 1" in results[0].stderr


def test_ranks_that_build_different_runtimes_are_refused_before_any_message(tmp_path: Path) -> None:
    """Rank 1 generates its schedule with 8 microbatches, rank 0 with 4 (a script started apart, or a search run on
    each rank from its own timings): both refuse at construction in one line naming the other rank, where before
    they posted different messages and waited on each other until the timeout."""
    results = launch_ranks(tmp_path, 2, {"model": "mlp-tiny", "schedules": ["1f1b"], "microbatches": 4, "steps": 1,
                                         "skew_rank": 1, "refused": True})
    assert_ranks_ok(results)
    for rank, other, m in ((0, 1, 4), (1, 0, 8)):
        line = (tmp_path / f"1f1b-refused-rank{rank}.txt").read_text()
        assert line == (f"OptionError: rank {other} built its PipelineRuntime with another schedule than rank {rank} "
                        f"(1f1b: 2 stages, {m} microbatches on 2 ranks); every rank must pass the same plan, schedule "
                        "and options"), line


def test_resume_is_bit_exact(tmp_path: Path) -> None:
    straight, resumed, ckpt = tmp_path / "a", tmp_path / "b", tmp_path / "ckpt"
    straight.mkdir(), resumed.mkdir()
    base = with_plans(2, {"model": "gpt-tiny", "schedules": ["zb-h1"], "microbatches": 4})
    assert all(r.returncode == 0 for r in launch_ranks(straight, 2, {**base, "steps": 3}))
    assert all(r.returncode == 0 for r in launch_ranks(resumed, 2, {**base, "steps": 2, "checkpoint": str(ckpt),
                                                                 "checkpoint_after": 2}))
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000002"]  # no partial save left
    assert sorted(p.name for p in (ckpt / "step_000002").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "fxpipe-checkpoint.json"]
    assert all(r.returncode == 0 for r in launch_ranks(resumed, 2, {**base, "steps": 3, "resume": str(ckpt)}))
    for rank in range(2):
        a = torch.load(straight / f"zb-h1-rank{rank}.pt", weights_only=False)["state"]["params"]
        b = torch.load(resumed / f"zb-h1-rank{rank}.pt", weights_only=False)["state"]["params"]
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name
