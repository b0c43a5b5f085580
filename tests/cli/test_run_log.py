"""``fxpipe run --config`` and ``--log-dir`` in this process: the TOML writer, the config file's checks and precedence,
the log directory's refusals, the per-step log's lines, and the restart report. No rank starts here; the launches
that train are in test_run_restart.py."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from fxpipe.cli import ranks, run_log
from fxpipe.cli.config import keyed_params, toml_value
from fxpipe.errors import RankFailedError
from tests._helpers import MLP_PLAN, fxpipe_cli, one_line_error, plan_fixture

tomllib = pytest.importorskip("tomllib")  # Python 3.11: --config reads TOML with it
plan = plan_fixture(*MLP_PLAN)

_values = st.one_of(st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=True),
                    st.text(st.characters(blacklist_categories=("Cs",)), max_size=20))


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.from_regex(r"[a-z][a-z0-9-]{0,12}", fullmatch=True), _values, max_size=6))
def test_the_toml_writer_reads_back_as_written(values: dict[str, Any]) -> None:
    back = tomllib.loads("".join(f"{k} = {toml_value(v)}\n" for k, v in values.items()))
    assert set(back) == set(values)
    for key, value in values.items():
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(back[key])
        else:
            assert back[key] == value and type(back[key]) is type(value), key


def test_a_none_is_a_comment_and_other_types_are_refused() -> None:
    from fxpipe.cli.run_config import RunConfig

    text = RunConfig(plan_dir=Path('a b/"c"')).replace(trace=None, steps=3).to_toml("test")
    doc = tomllib.loads(text)
    assert doc["training"]["steps"] == 3 and doc["plan-dir"] == 'a b/"c"'
    assert "# trace: not set" in text and text.startswith(run_log.MARK)
    with pytest.raises(TypeError, match="no TOML form for list"):
        toml_value([1])


@pytest.mark.parametrize(("text", "expected"), [
    ("stepz = 3", "unknown key 'stepz'; the keys are fxpipe run's flags without the dashes (--print-config "
                  "shows them)"),
    ("[training]\nlr = 0.1", "unknown key [training] 'lr'; lr is in [optimizer]"),  # in another section's table
    ("checkpoint_every = 2", "unknown key 'checkpoint_every'; write it checkpoint-every"),
    ("kill-rank = 1", "unknown key 'kill-rank'"),  # hidden fault injection is no key
    ('steps = "3"', 'steps = "3" is a string; steps takes an integer'),
    ("steps = 0", "steps = 0: Input should be greater than or equal to 1"),
    ("pin-ranks = 1", "pin-ranks = 1 is an integer; pin-ranks takes true or false"),
    ("lr = true", "lr = true is true or false; lr takes a number"),
    ("data = [1]", "data = [1] is a TOML list; data takes a string"),
    ("steps = [", "is not TOML ("),
])
def test_a_bad_config_file_is_one_line(plan: Path, tmp_path: Path, text: str, expected: str,
                                       no_rank_starts: list[list[str]]) -> None:
    config = tmp_path / "run.toml"
    config.write_text(text + "\n")
    line = one_line_error(fxpipe_cli("run", plan, "--config", config))
    assert line.startswith(f"error: --config '{config}'") and expected in line, line


def test_flags_override_the_config_file_and_config_toml_holds_the_final_values(
        plan: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--steps on the command line wins over the file's; the file's other keys (flat, or in their section's table)
    reach the ranks' configuration; the plan directory may come from the file; DIR/config.toml, written before the
    ranks start, holds every option's final value, in sections."""
    started: list[dict[str, Any]] = []

    def stop(cmd: list[str], *args: Any, **kwargs: Any) -> Any:
        started.append(json.loads(Path(cmd[cmd.index("--out") - 1]).read_text()))
        raise RankFailedError("stopped before any rank started")

    monkeypatch.setattr(ranks, "run_ranks", stop)
    config = tmp_path / "run.toml"
    config.write_text(f'plan-dir = "{plan}"\nsteps = 9\nseed = 5\n[checkpoint]\ncheckpoint-every = 2\n'
                      f'resume = "auto"\ncheckpoint-dir = "{tmp_path / "ck"}"\n')
    logs = tmp_path / "logs"
    result = fxpipe_cli("run", "--config", config, "--steps", "4", "--log-dir", logs)
    assert result.exit_code == 2 and result.stderr.splitlines()[-1] == "error: stopped before any rank started"
    ranks_config = started[0]["config"]
    assert (ranks_config["steps"], ranks_config["seed"], ranks_config["checkpoint_every"],
            ranks_config["resume"]) == (4, 5, 2, "auto")
    written = tomllib.loads((logs / "config.toml").read_text())
    assert written["training"]["steps"] == 4 and written["training"]["seed"] == 5
    assert written["checkpoint"]["checkpoint-every"] == 2
    assert written["plan-dir"] == os.path.abspath(plan) and written["logging"]["log-dir"] == os.path.abspath(logs)
    # resolved, not left to a default: the ranks, replicas, microbatches, schedule and learning rate
    assert (written["launch"]["nproc"], written["launch"]["dp"], written["training"]["microbatches"],
            written["training"]["schedule"], written["optimizer"]["lr"]) == (2, 1, 4, "zb-h1", 0.01)
    flat = {k: v for key, value in written.items() for k, v in (value.items() if isinstance(value, dict)
                                                                else [(key, value)])}
    assert "config" not in flat and "fail-rank" not in flat
    assert set(flat) <= set(keyed_params(_run_command()))  # every key reads back (test_run_restart.py runs it again)


def _run_command() -> Any:
    import typer.main

    from fxpipe.cli.main import app

    return typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]


def test_the_log_and_resume_options_are_checked_before_any_rank_starts(plan: Path, tmp_path: Path,
                                                                      no_rank_starts: list[list[str]]) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "metrics.jsonl").write_text("")
    assert one_line_error(fxpipe_cli("run", plan, "--log-dir", logs)) == (
        f"error: --log-dir '{logs}' holds the metrics.jsonl of an earlier run; choose another --log-dir, or resume "
        "that run (--checkpoint-dir with --resume auto) to continue its log")
    (logs / "metrics.jsonl").unlink()
    (logs / "config.toml").write_text("steps = 3\n")  # the user's own
    assert "holds a config.toml that fxpipe run did not write" in one_line_error(fxpipe_cli("run", plan, "--log-dir",
                                                                                           logs))
    refused = fxpipe_cli("run", plan, "--resume", "sometimes")
    assert refused.exit_code == 2 and "'sometimes'isnotoneof'never','auto','always'" in "".join(
        c for c in refused.stderr if c not in " \n│")
    assert one_line_error(fxpipe_cli("run", plan, "--resume", "auto")) == "error: --resume auto needs --checkpoint-dir"
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    (ckpt / "NOTES.txt").write_text("mine")  # auto with no complete checkpoint starts fresh beside it: allowed
    assert "pass one of them" in one_line_error(fxpipe_cli("run", plan, "--checkpoint-dir", ckpt, "--resume", "auto",
                                                           "--overwrite"))


def test_a_config_names_the_data_and_loss_files_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "mine.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert run_log.absolute_spec("text:notes.txt") == f"text:{tmp_path / 'notes.txt'}"
    assert run_log.absolute_spec("hf:notes.txt") == f"hf:{tmp_path / 'notes.txt'}"
    assert run_log.absolute_spec("mine.py:batches") == f"{tmp_path / 'mine.py'}:batches"
    for kept in ("text:stdlib", "digits", "synthetic", "hf:someone/dataset", "package.module:batches", None):
        assert run_log.absolute_spec(kept) == kept


def test_the_step_table_counts_from_one_and_shows_lr_and_grad_norm_where_they_say_something() -> None:
    from fxpipe.cli.run_cmd import step_rows

    doc = {"losses": [2.0, 1.5], "lrs": [0.01, 0.005], "grad_norms": [3.0, 2.5]}
    assert step_rows(doc, [100.0, 50.0], 8, first=4) == (
        ("step", "loss", "lr", "grad norm", "step ms", "samples/s"),
        ((5, 2.0, 0.01, 3.0, 100.0, 80.0), (6, 1.5, 0.005, 2.5, 50.0, 160.0)))
    plain = {"losses": [2.0], "lrs": [0.01], "grad_norms": [None]}  # a constant lr, no clipping: neither column
    assert step_rows(plain, [100.0], 8, first=0) == (("step", "loss", "step ms", "samples/s"),
                                                      ((1, 2.0, 100.0, 80.0),))


def test_the_old_resume_flag_is_named() -> None:
    from fxpipe.cli.main import _old_resume_flag

    assert _old_resume_flag(["run", "plan", "--resume"]) and _old_resume_flag(["run", "p", "--resume", "--json"])
    assert not _old_resume_flag(["run", "plan", "--resume", "auto"]) and not _old_resume_flag(["compile", "x"])


def test_each_finished_step_is_one_line_and_a_resumed_log_keeps_each_step_once(tmp_path: Path) -> None:
    """One rank, no process group: the lines are valid JSON with every field; a log resumed from step 2 drops the
    lines a killed attempt wrote after it."""
    log = run_log.StepLog(tmp_path, rank=0, world=1, device=None, samples=8, tokens=8 * 16, first=0)
    for step, ms in ((1, 4.0), (2, 2.0), (3, 8.0)):
        log.write(step, 1.0 / step, 0.01, None, log.share(ms))
    log.close()
    lines = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [1, 2, 3]
    first = lines[0]
    assert first["loss"] == 1.0 and first["lr"] == 0.01 and first["grad_norm"] is None and first["step_ms"] == 4.0
    assert first["samples_per_s"] == 8 / 4e-3 and first["tokens_per_s"] == 8 * 16 / 4e-3
    assert len(first["peak_memory_mib"]) == 1 and first["peak_memory_mib"][0] > 0 and first["memory"] == "rss"
    again = run_log.StepLog(tmp_path, rank=0, world=1, device=None, samples=8, tokens=None, first=2)
    again.write(3, 0.5, float("nan"), 2.0, again.share(1.0))
    lines = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(ln["step"], ln["loss"]) for ln in lines] == [(1, 1.0), (2, 0.5), (3, 0.5)]
    assert lines[-1]["lr"] is None and lines[-1]["grad_norm"] == 2.0 and lines[-1]["tokens_per_s"] is None
    # another rank writes nothing; without --log-dir nothing is shared
    run_log.StepLog(tmp_path / "other", rank=1, world=2, device=None, samples=8, tokens=None, first=0)
    assert not (tmp_path / "other").exists()
    assert run_log.StepLog(None, rank=0, world=1, device=None, samples=8, tokens=None, first=0).share(1.0) is None


def test_tokens_are_counted_for_token_id_inputs_only() -> None:
    from fxpipe.plan import TensorSpec

    assert run_log.token_ids(TensorSpec("idx", (2, 16), "int64"))
    assert not run_log.token_ids(TensorSpec("x", (2, 16), "float32"))
    assert not run_log.token_ids(TensorSpec("labels", (2,), "int64"))


def test_restarts_are_reported_with_each_earlier_attempt_s_errors(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    assert ranks.restarts(tmp_path, [{"restarts": 0}]) is None
    (tmp_path / "rank1.error").write_text("RuntimeError: boom")
    monkeypatch.setenv(ranks.RESTART_COUNT, "0")
    ranks.keep_earlier_error(tmp_path, 1)  # the first attempt: its own report stays
    assert (tmp_path / "rank1.error").exists()
    monkeypatch.setenv(ranks.RESTART_COUNT, "1")
    ranks.keep_earlier_error(tmp_path, 1)
    assert ranks.rank_errors(tmp_path) == {} and (tmp_path / "rank1.error.attempt0").exists()
    assert ranks.restarts(tmp_path, [{"restarts": 1}, {"restarts": 1}]) == (
        "torchrun restarted the ranks 1 time (--max-restarts); attempt 0: rank 1: RuntimeError: boom; each attempt "
        "went on from the newest checkpoint it found (--resume auto) or from step 0")
    assert ranks.restarts(tmp_path, None).startswith("torchrun restarted the ranks 1 time")  # the last attempt failed
    cmd = ranks.torchrun_command(["run.json"], 2, max_restarts=2)
    assert "--max-restarts=2" in cmd[:cmd.index("-m", 3)] and ranks.restart_env(2) and not ranks.restart_env(0)


@pytest.mark.parametrize(("make", "expected"), [
    (lambda p: os.mkfifo(p), "is not a regular file (a FIFO, device or socket)"),
    (lambda p: p.symlink_to("/dev/zero"), "is not a regular file (a FIFO, device or socket)"),
    (lambda p: p.write_text("a" + "[" * 100_000 + "]" * 100_000 + "\n"), "line 1 is 200,001 characters"),
    (lambda p: p.write_text("a = " + "[\n" * 40 + "1" + "]" * 40 + "\n"), "nests brackets 40 deep"),
    (lambda p: p.write_text(".".join(["k"] * 50_000) + " = 1\n"), "line 1 is 100,003 characters"),
    (lambda p: p.write_bytes(b"# " + b"x" * (2 << 20)), "more than the 1,048,576 fxpipe reads"),
], ids=["fifo", "dev-zero", "deep-line", "deep", "dotted-key", "huge"])
def test_a_config_file_is_read_bounded(plan: Path, tmp_path: Path, make: Any, expected: str,
                                       no_rank_starts: list[list[str]]) -> None:
    """What the config file is, and how deep and long, is checked before TOML parses it: no hang on a FIFO, no
    endless read of a device, no recursion or quadratic parse; one line each."""
    config = tmp_path / "run.toml"
    make(config)
    line = one_line_error(fxpipe_cli("run", plan, "--config", config))
    assert expected in line, line


def test_the_log_directory_is_never_written_through_a_link(plan: Path, tmp_path: Path,
                                                         no_rank_starts: list[list[str]]) -> None:
    """A metrics.jsonl or config.toml that is a link (dangling, or to a device) is refused before any rank starts;
    the config is written through fxpipe.files (a temporary file of its own, renamed), and a StepLog appends and
    rewrites metrics.jsonl only as a regular file."""
    outside = tmp_path / "outside.txt"
    outside.write_text("the user's\n")
    for name, target in (("metrics.jsonl", tmp_path / "nowhere"), ("metrics.jsonl", Path("/dev/zero")),
                         ("config.toml", outside)):
        logs = tmp_path / f"logs-{name}-{target.name}"
        logs.mkdir()
        (logs / name).symlink_to(target)
        line = one_line_error(fxpipe_cli("run", plan, "--log-dir", logs, "--resume", "auto", "--checkpoint-dir",
                                         tmp_path / "ckpt"))
        assert "link" in line or "did not write" in line, line
    assert outside.read_text() == "the user's\n" and not (tmp_path / "nowhere").exists()
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / ".config.toml.tmp").symlink_to(outside)  # the old temporary name: no longer opened
    run_log.write_config(logs, f"{run_log.MARK}\nsteps = 3\n")
    assert outside.read_text() == "the user's\n" and (logs / "config.toml").read_text().startswith(run_log.MARK)
    (logs / "metrics.jsonl").symlink_to(outside)
    with pytest.raises(Exception, match="not a regular file|symbolic link"):
        run_log.StepLog(logs, rank=0, world=1, device=None, samples=1, tokens=None, first=1)
    assert outside.read_text() == "the user's\n"
