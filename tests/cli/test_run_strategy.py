"""``fxpipe run`` of a plan with a per-layer strategy: the ranks rebuild the zoo model, trace it, take each node's
recorded configuration and train on DTensor; the losses are one process's on the whole batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fxpipe import models
from fxpipe.cli.rank_common import synthetic_batch
from fxpipe.errors import PlanFileError
from fxpipe.plan import StrategyRecord, StrategyStage
from fxpipe.plan_dir import read_plan
from tests._helpers import fxpipe_cli, import_file, ok, one_line_error


def _one_process_losses(name: str, batch: int, steps: int, lr: float, microbatches: int = 1,
                        adamw: bool = False) -> list[float]:
    """One process on the whole batch, taken ``microbatches`` at a time (BatchNorm's statistics are each
    microbatch's), the loss their mean over the batch; SGD, or AdamW with weight decay 0.01."""
    zoo = models.build(name, dtype=torch.float64, batch_size=batch, seed=0)
    (x,), target = synthetic_batch(zoo, 1)
    opt = (torch.optim.AdamW(zoo.model.parameters(), lr=lr, weight_decay=0.01) if adamw
           else torch.optim.SGD(zoo.model.parameters(), lr=lr))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(zoo.loss_fn(zoo.model(xi), ti) * (xi.shape[0] / batch)
                   for xi, ti in zip(x.tensor_split(microbatches), target.tensor_split(microbatches)))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize(("name", "ranks", "strategy", "adamw"),
                         [("vgg-tiny", 2, "auto", False), ("resnet-tiny", 4, "splitbrain", True)])
def test_a_strategy_plan_trains_like_one_process(tmp_path: Path, name: str, ranks: int, strategy: str,
                                                 adamw: bool) -> None:
    plan = tmp_path / "plan"
    ok(fxpipe_cli("compile", name, "--stages", "1", "--dp", str(ranks), "--strategy", strategy, "--dtype", "float64",
                  "--batch-size", str(2 * ranks), "--out", plan))
    lr = 0.01 if adamw else 0.05
    optimizer = ("--optimizer", "adamw", "--weight-decay", "0.01") if adamw else ()
    doc = json.loads(ok(fxpipe_cli("run", plan, "--steps", "3", "--lr", str(lr), *optimizer, "--json")).stdout)
    assert doc["ranks"] == ranks and doc["schedule"].startswith(f"strategy {strategy} (")
    torch.testing.assert_close(doc["losses"], _one_process_losses(name, 2 * ranks, 3, lr, adamw=adamw), rtol=1e-9,
                               atol=1e-12)
    assert doc["losses"][-1] < doc["losses"][0]


def test_what_a_strategy_plan_cannot_run_is_refused_before_any_rank_starts(tmp_path: Path,
                                                                            no_rank_starts: list[list[str]]) -> None:
    plan = tmp_path / "plan"
    ok(fxpipe_cli("compile", "vgg-tiny", "--stages", "1", "--dp", "2", "--strategy", "dp", "--out", plan))
    line = one_line_error(fxpipe_cli("run", plan, "--steps", "2", "--schedule", "async-1f1b"))
    assert "async-1f1b is asynchronous, and a per-layer strategy trains synchronously" in line
    line = one_line_error(fxpipe_cli("run", plan, "--steps", "2", "--device", "cuda"))
    assert line == ("error: --device cuda runs pipeline plans; this plan's per-layer strategy (dp) trains on the CPU "
                    "(DTensor over gloo): use --device cpu")


def test_a_record_that_does_not_fit_the_trace_is_refused(tmp_path: Path) -> None:
    plan = tmp_path / "plan"
    ok(fxpipe_cli("compile", "vgg-tiny", "--stages", "1", "--dp", "2", "--strategy", "dp", "--out", plan))
    doc = json.loads((plan / "plan.json").read_text())
    doc["plan"]["strategy"]["nodes"][3][0] = "not_a_node"
    (plan / "plan.json").write_text(json.dumps(doc))
    line = one_line_error(fxpipe_cli("run", plan, "--steps", "1"))
    assert "the plan's strategy does not fit this model's trace (node" in line, line


@pytest.fixture(scope="module")
def pipelined_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``fxpipe compile --stages 2 --dp 2 --strategy auto``: cut where the plan cuts, each stage searched on its own
    graph (float64, batch 8, 2 microbatches recorded); compiled once for the runs below."""
    plan = tmp_path_factory.mktemp("pipelined") / "plan"
    text = ok(fxpipe_cli("compile", "vgg-tiny", "--stages", "2", "--dp", "2", "--strategy", "auto", "--microbatches",
                         "2", "--dtype", "float64", "--batch-size", "8", "--out", plan, "--plain")).stdout
    assert "strategy auto (elimination) for stage 0 of 2 (x..features_5) on 2 ranks, batch 8" in text
    assert "strategy auto (elimination) for stage 1 of 2 (features_6..output) on 2 ranks, batch 8" in text
    return plan


def test_a_pipelined_strategy_plan_records_its_stages(pipelined_plan: Path) -> None:
    record = read_plan(pipelined_plan).strategy
    assert record is not None and record.cuts == ("features_5",)  # the plan's stage 0 ends with layer features.5
    assert record.ranks == 2 and record.microbatches == 2 and record.world == 4
    assert any(c != "s2" for _, c in record.nodes)  # the search split beyond the batch somewhere
    inspected = ok(fxpipe_cli("inspect", pipelined_plan, "--plain")).stdout
    assert "strategy auto (elimination) in 2 stages x 2 ranks, 2 microbatches (gpipe)" in inspected
    assert "for stage 1 of 2 (features_6..output)" in inspected  # the per-stage tables are kept in the plan


@pytest.mark.parametrize(("flags", "schedule", "microbatches"), [
    ((), "gpipe", 2),  # the plan's own: GPipe over the recorded microbatches
    (("--schedule", "1f1b", "--microbatches", "4"), "1f1b", 4),
    (("--schedule", "zb-h1", "--microbatches", "2"), "zb-h1", 2),
], ids=["gpipe", "1f1b-4", "zb-h1-2"])
def test_a_pipelined_strategy_plan_trains_like_one_process(pipelined_plan: Path, flags: tuple[str, ...],
                                                           schedule: str, microbatches: int) -> None:
    """``fxpipe run`` trains the 2 x 2 plan on 4 gloo ranks under each synchronous schedule, the microbatches given
    at run time or recorded, like one process taking the same microbatches of the whole batch (float64; losses of
    3 steps: the later ones follow from every parameter's gradient)."""
    doc = json.loads(ok(fxpipe_cli("run", pipelined_plan, "--steps", "3", "--lr", "0.05", "--json", *flags)).stdout)
    assert doc["ranks"] == 4 and doc["mesh"]["ranks"] == [[0, 1], [2, 3]] and doc["microbatches"] == microbatches
    assert doc["schedule"] == f"strategy auto (elimination) in 2 stages, {schedule}"
    torch.testing.assert_close(doc["losses"], _one_process_losses("vgg-tiny", 8, 3, 0.05, microbatches=microbatches),
                               rtol=1e-9, atol=1e-12)
    assert doc["losses"][-1] < doc["losses"][0]


def test_microbatches_that_do_not_split_the_batch_over_a_stage_are_refused(pipelined_plan: Path,
                                                                           no_rank_starts: list[list[str]]) -> None:
    line = one_line_error(fxpipe_cli("run", pipelined_plan, "--steps", "1", "--microbatches", "3"))
    assert "--microbatches 3 cuts the plan's 8-row batch over 2 ranks a stage unevenly" in line, line


def test_a_pipelined_record_that_does_not_cut_the_trace_is_refused() -> None:
    """What each rank checks before building the runtime (no launch): a cut inside a residual block (two tensors
    cross it) and microbatches the ranks cannot split evenly are one PlanFileError each."""
    from fxpipe.cli.rank_strategy import _check_stages
    from fxpipe.passes.strategy_graph import strategy_graph

    zoo = models.build("resnet-tiny", batch_size=8, seed=0)
    g = strategy_graph(zoo.model, zoo.example_inputs)
    inside = "layer1_0_conv1"  # a block's first convolution: the block's skip (downsample) crosses the cut too
    at = g.nodes.index(inside)
    record = StrategyRecord("dp", 2, 2, "data-parallel", 1.0, tuple((n, "s2") for n in g.nodes),
                            stages=(StrategyStage(g.nodes[0], inside, "data-parallel", 1.0),
                                    StrategyStage(g.nodes[at + 1], g.nodes[-1], "data-parallel", 1.0)),
                            microbatches=2)
    assert record.problems() == []
    with pytest.raises(PlanFileError, match="do not cut this model's trace where one tensor crosses"):
        _check_stages(record, g, 8)
    cut = g.nodes.index("layer1_0_relu_2")  # the block's output: one tensor crosses
    fine = StrategyRecord("dp", 2, 2, "data-parallel", 1.0, record.nodes, microbatches=4, stages=(
        StrategyStage(g.nodes[0], g.nodes[cut], "data-parallel", 1.0),
        StrategyStage(g.nodes[cut + 1], g.nodes[-1], "data-parallel", 1.0)))
    _check_stages(fine, g, 8)
    with pytest.raises(PlanFileError, match="unevenly"):
        _check_stages(fine, g, 12)


USER_DATA = '''
import torch


def batches(ctx):  # the global batch (every rank of a strategy plan reads all of it), a different one each step
    gen = torch.Generator().manual_seed(ctx.seed)
    return [(torch.randn(ctx.batch_size, 3, 32, 32, generator=gen, dtype=torch.float64),
             torch.randint(0, 10, (ctx.batch_size,), generator=gen)) for _ in range(6)]


def loss(out, target):
    return torch.nn.functional.cross_entropy(out, target, label_smoothing=0.1)
'''


def _user_reference(tmp_path: Path, steps: int, microbatches: int) -> tuple[list[float], list[float]]:
    """One process: vgg-tiny as compiled (float64, batch 8), the user's batches and loss, each batch taken in the
    plan's microbatches, AdamW (weight decay 0.01), the global gradient norm clipped to 0.5 by torch."""
    from fxpipe.data import DataContext

    module = import_file(tmp_path / "mine.py", "strategy_user_data")
    zoo = models.build("vgg-tiny", dtype=torch.float64, batch_size=8, seed=0)
    made = module.batches(DataContext(0, True, True, 0, 1, 1, 8, 0, 0, steps, ()))
    params = list(zoo.model.parameters())
    opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)
    losses, norms = [], []
    for k in range(steps):
        x, target = made[k % len(made)]
        opt.zero_grad()
        loss = sum(module.loss(zoo.model(xi), ti) * (xi.shape[0] / 8)
                   for xi, ti in zip(x.tensor_split(microbatches), target.tensor_split(microbatches)))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, 0.5)))
        opt.step()
        losses.append(float(loss.detach()))
    return losses, norms


def test_a_pipelined_strategy_plan_trains_on_user_data_and_resumes(pipelined_plan: Path, tmp_path: Path) -> None:
    """vgg-tiny, --strategy auto, 2 stages x 2 ranks: a user's data function and loss, AdamW, the global gradient
    norm clipped, a checkpoint every 2 steps; a rank failing in step 4 restarts the ranks, which resume from step 2 and
    end with one process's losses and norms (float64)."""
    (tmp_path / "mine.py").write_text(USER_DATA)
    flags = ["--data", f"{tmp_path / 'mine.py'}:batches", "--loss", f"{tmp_path / 'mine.py'}:loss", "--optimizer",
             "adamw", "--weight-decay", 0.01, "--clip-grad-norm", 0.5, "--checkpoint-dir", tmp_path / "ckpt",
             "--checkpoint-every", 2, "--resume", "auto", "--timeout", 30, "--log-dir", tmp_path / "log", "--json"]
    doc = json.loads(ok(fxpipe_cli("run", pipelined_plan, "--steps", 5, "--max-restarts", 1, "--fail-rank", 1,
                                   "--fault-step", 3, *flags)).stdout)
    assert doc["restarts"] == 1 and doc["first_step"] == 2
    losses, norms = _user_reference(tmp_path, 5, 2)
    assert max(norms) > 0.5  # the clip acted
    lines = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5]
    torch.testing.assert_close([m["loss"] for m in lines], losses, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close([m["grad_norm"] for m in lines], norms, rtol=1e-9, atol=1e-12)
