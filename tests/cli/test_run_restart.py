"""A restartable job: one ``fxpipe run`` survives a killed rank (torchrun restarts every rank, which resume from the
newest checkpoint) and ends with the losses of an unbroken run, which its own ``config.toml`` reproduces. Two
launches of mlp-tiny's 2 ranks, 4 steps, shared by every check here."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from tests._helpers import MLP_PLAN, fxpipe_cli, ok, one_line_error, plan_fixture, reference_losses

tomllib = pytest.importorskip("tomllib")  # Python 3.11: --config reads TOML with it
plan = plan_fixture(*MLP_PLAN)
STEPS = 4
FIELDS = {"step", "loss", "lr", "grad_norm", "step_ms", "samples_per_s", "tokens_per_s", "peak_memory_mib", "memory"}


def _metrics(log_dir: Path) -> list[dict[str, object]]:
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]  # every line valid JSON


def test_a_killed_rank_restarts_resumes_and_ends_like_an_unbroken_run(plan: Path, tmp_path: Path) -> None:
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    # Rank 1 is SIGKILLed in step 4 (its first attempt only), after the checkpoint of step 2: torchrun restarts both
    # ranks, which resume from step 2 (--resume auto) and train steps 3 and 4 again.
    killed = ok(fxpipe_cli("run", plan, "--nproc", "2", "--steps", STEPS, "--checkpoint-dir", ckpt,
                           "--checkpoint-every", "2", "--resume", "auto", "--max-restarts", "1", "--kill-rank", "1",
                           "--fault-step", "3", "--timeout", "30", "--log-dir", logs, "--json"))
    doc = json.loads(killed.stdout)
    assert doc["restarts"] == 1 and doc["first_step"] == 2 and len(doc["losses"]) == 2
    assert "note: torchrun restarted the ranks 1 time (--max-restarts); attempt 0: rank 0: " in killed.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == [".fxpipe.lock", "step_000002", "step_000004"]  # every 2, last
    lines = _metrics(logs)
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))  # each step once: the killed attempt's 3 dropped
    for m in lines:
        assert set(m) == FIELDS and m["step_ms"] > 0 and m["samples_per_s"] > 0  # type: ignore[operator]
        assert len(m["peak_memory_mib"]) == 2 and all(x > 0 for x in m["peak_memory_mib"])  # type: ignore[arg-type]
        assert m["memory"] == "rss" and m["tokens_per_s"] is None  # mlp-tiny's inputs are not token ids
    losses = [m["loss"] for m in lines]
    assert losses[2:] == doc["losses"]
    assert losses == pytest.approx(reference_losses(STEPS, m=4, model="mlp-tiny"), rel=1e-5)

    # The job again from its config.toml, into fresh directories (flags override the file), with no rank killed
    # (fault injection is no config key): the same losses, bit for bit, in one attempt.
    config = logs / "config.toml"
    again_logs, again_ckpt = tmp_path / "again-logs", tmp_path / "again-ckpt"
    again = json.loads(ok(fxpipe_cli("run", "--config", config, "--log-dir", again_logs, "--checkpoint-dir",
                                     again_ckpt)).stdout)
    assert again["restarts"] == 0 and again["first_step"] == 0
    assert again["losses"] == losses
    assert [m["loss"] for m in _metrics(again_logs)] == losses
    first, second = (tomllib.loads(p.read_text()) for p in (config, again_logs / "config.toml"))
    assert first["logging"].pop("log-dir") != second["logging"].pop("log-dir")
    assert first["checkpoint"].pop("checkpoint-dir") != second["checkpoint"].pop("checkpoint-dir")
    assert first == second


def test_config_toml_runs_again_as_written_from_another_directory(plan: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A run given relative --loss and --data files writes them absolute in its config.toml; ``--config
    LOGDIR/config.toml`` from another working directory, into that same log directory, trains the same losses bit
    for bit, and the first run's metrics.jsonl is kept beside the new one as metrics.1.jsonl."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    (work / "mine.py").write_text("import torch\n\n\ndef loss(out, target):\n"
                                  "    return torch.nn.functional.cross_entropy(out, target) * 0.5\n")
    monkeypatch.chdir(work)
    first = json.loads(ok(fxpipe_cli("run", plan, "--nproc", "2", "--steps", 2, "--loss", "mine.py:loss",
                                     "--log-dir", "logs", "--json")).stdout)
    config = tomllib.loads((work / "logs" / "config.toml").read_text())
    assert config["training"]["loss"] == f"{work / 'mine.py'}:loss"
    monkeypatch.chdir(elsewhere)
    again = json.loads(ok(fxpipe_cli("run", "--config", work / "logs" / "config.toml")).stdout)
    assert again["losses"] == first["losses"]
    kept = [json.loads(line)["loss"] for line in (work / "logs" / "metrics.1.jsonl").read_text().splitlines()]
    assert kept == first["losses"] and [m["loss"] for m in _metrics(work / "logs")] == again["losses"]


DROPOUT_FILE = '''
import torch


def build():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(32, 4))
    return model.train(), (torch.randn(4, 16),)


def loss(out, target):
    return torch.nn.functional.cross_entropy(out, target)
'''


def test_seed_makes_dropout_repeatable_and_resumable(tmp_path: Path) -> None:
    """--seed seeds each step's random ops (dropout) by step and rank: the same command line twice gives the same
    losses, another seed others, and a run resumed from step 2's checkpoint the unbroken run's."""
    (tmp_path / "drop.py").write_text(DROPOUT_FILE)
    ok(fxpipe_cli("compile", f"{tmp_path / 'drop.py'}:build", "--stages", "2", "--out", tmp_path / "plan"))

    def run(*extra: object) -> list[float]:
        return json.loads(ok(fxpipe_cli("run", tmp_path / "plan", "--steps", 4, "--loss",
                                        f"{tmp_path / 'drop.py'}:loss",
                                        "--json", *extra)).stdout)["losses"]

    first = run("--checkpoint-dir", tmp_path / "ckpt", "--keep-checkpoints", 4)
    assert run() == first and run("--seed", 1) != first
    for late in ("step_000003", "step_000004"):
        shutil.rmtree(tmp_path / "ckpt" / late)
    assert run("--checkpoint-dir", tmp_path / "ckpt", "--resume", "always") == first[2:]
    line = one_line_error(fxpipe_cli("run", tmp_path / "plan", "--steps", 5, "--loss", f"{tmp_path / 'drop.py'}:loss",
                                     "--checkpoint-dir", tmp_path / "ckpt", "--resume", "always", "--seed", 1))
    assert "the checkpoint of step 4 was trained with --seed 0, and this run has --seed 1" in line, line


NAN_DATA = '''
import torch


def batches(ctx):  # step 3's inputs are NaN (ctx.start: a resumed run's first step)
    gen = torch.Generator().manual_seed(0)
    steps = [(torch.randn(ctx.batch_size, 16, generator=gen), torch.randint(0, 4, (ctx.batch_size,), generator=gen))
             for _ in range(5)]
    steps[2] = (torch.full_like(steps[2][0], float("nan")), steps[2][1])
    return steps
'''


def test_a_nan_loss_stops_the_run_and_the_last_finite_checkpoint_stays(tmp_path: Path) -> None:
    """NaN inputs at step 3, a checkpoint every step, one kept: the run stops at step 3 in one line, step 2's
    checkpoint is the one left (never pruned for a non-finite step), and a resume from it trains finite losses."""
    (tmp_path / "drop.py").write_text(DROPOUT_FILE)
    (tmp_path / "nan.py").write_text(NAN_DATA)
    ok(fxpipe_cli("compile", f"{tmp_path / 'drop.py'}:build", "--stages", "2", "--out", tmp_path / "plan"))
    args = ["run", tmp_path / "plan", "--loss", f"{tmp_path / 'drop.py'}:loss", "--data",
            f"{tmp_path / 'nan.py'}:batches",
            "--checkpoint-dir", tmp_path / "ckpt", "--keep-checkpoints", 1]
    line = one_line_error(fxpipe_cli(*args, "--steps", 4))
    assert "NonFiniteError: step 3's loss is nan: training stopped there, and no checkpoint holds that step" in line
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".fxpipe.lock", "step_000002"]
    (tmp_path / "fine.py").write_text(NAN_DATA.replace('float("nan")', "0.0"))
    args[5] = f"{tmp_path / 'fine.py'}:batches"
    resumed = json.loads(ok(fxpipe_cli(*args, "--steps", 4, "--resume", "always", "--json")).stdout)
    assert resumed["first_step"] == 2 and all(math.isfinite(x) for x in resumed["losses"])


def test_skip_nonfinite_skips_the_step_s_update_and_says_so(tmp_path: Path) -> None:
    """The same NaN inputs at step 3 with --skip-nonfinite: the run goes on to step 4 with finite weights (its loss
    finite), metrics.jsonl marks step 3 skipped (and only it), and step 3's checkpoint is written from the weights
    of step 2, which the skipped update left as they were."""
    (tmp_path / "drop.py").write_text(DROPOUT_FILE)
    (tmp_path / "nan.py").write_text(NAN_DATA)
    ok(fxpipe_cli("compile", f"{tmp_path / 'drop.py'}:build", "--stages", "2", "--out", tmp_path / "plan"))
    doc = json.loads(ok(fxpipe_cli("run", tmp_path / "plan", "--loss", f"{tmp_path / 'drop.py'}:loss", "--data",
                                   f"{tmp_path / 'nan.py'}:batches", "--steps", 4, "--skip-nonfinite",
                                   "--checkpoint-dir", tmp_path / "ckpt", "--log-dir", tmp_path / "logs",
                                   "--json")).stdout)
    losses = doc["losses"]
    assert math.isnan(losses[2]) and all(math.isfinite(x) for i, x in enumerate(losses) if i != 2), losses
    lines = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [line.get("skipped", False) for line in lines] == [False, False, True, False]
    assert lines[2]["grad_norm"] is None and lines[3]["grad_norm"] is not None
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir())[-1] == "step_000004"
