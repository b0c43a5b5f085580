"""``fxpipe run``: ranks started by torch's elastic agent train the plan like one process; failures name the rank."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fxpipe.calibration.threads import rank_cpus
from tests._helpers import fxpipe_cli, ok, one_line_error, plan_fixture, reference_losses, saved_checkpoints
from tests.runtime._dist_worker import payload

plan = plan_fixture("gpt-tiny", "--stages", "2", "--schedule", "zb-h1", "--microbatches", "4")


def test_run_trains_like_one_process_and_reports(plan: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXPIPE_CALIBRATION", "on")  # the ranks measure the link they ran on (the plan stays fixed)
    trace = tmp_path / "measured.json"
    doc = json.loads(ok(fxpipe_cli("run", plan, "--nproc", "2", "--steps", "3", "--json", "--trace", trace)).stdout)
    assert doc["schema"] == "fxpipe.run/v1" and doc["schedule"] == "zb-h1" and doc["microbatches"] == 4
    assert doc["losses"] == pytest.approx(reference_losses(3), rel=1e-5)
    assert doc["step_ms_median"] > 0 and doc["samples_per_s"] > 0 and doc["simulated_step_ms"] > 0
    assert doc["simulated_without_runtime_costs"] is False  # an uncalibrated plan has none to leave out
    cal = doc["calibration"]  # what the simulation charged: the link and both contentions, measured on the ranks
    assert cal["latency"] >= 0 and cal["bandwidth"] > 0 and cal["contention"] > 0 and cal["memory_contention"] > 0
    assert f"{cal['memory_contention']:.3f}x" in cal["summary"]
    assert len(doc["peak_rss_mib_per_rank"]) == 2 and all(x > 0 for x in doc["peak_rss_mib_per_rank"])
    # Each rank on CPUs of its own where the machine has one for each (--pin-ranks, on by default)
    assert doc["cpus_per_rank"] == [list(rank_cpus(r, 2)) for r in range(2)]
    # Memory per stage: what the ranks kept between actions is what the schedule's simulation holds (the
    # model and the runtime count the same storages; tests/runtime/test_memory_tracking.py per schedule).
    measured, simulated = doc["peak_held_bytes_per_stage"], doc["simulated_held_bytes_per_stage"]
    assert len(measured) == 2 and all(s > 0 for s in simulated)
    assert all(abs(got / sim - 1) <= 0.15 for got, sim in zip(measured, simulated)), (measured, simulated)
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(1 for e in events if e.get("ph") == "X" and e.get("cat") in ("F", "B", "W")) == 2 * 4 * 3
    # Both ranks on one clock: stage 1's F of a microbatch starts after stage 0's started, stage 0's B after stage
    # 1's (not after it ended: an action's event ends after its sends, and the core it yields to may run the
    # receiver's action meanwhile; _on_one_clock's own test checks the shift exactly)
    at = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e.get("tid") == 0}
    for mb in range(4):
        assert at[f"1F{mb}"][0] > at[f"0F{mb}"][0] and at[f"0B{mb}"][0] > at[f"1B{mb}"][0], (mb, at)
    # Each stage's kinds of action, per microbatch, measured (steps 2 and 3) beside what the simulation charged
    actions = {(a["stage"], a["action"]): a for a in doc["actions"]}
    assert set(actions) == {(s, k) for s in (0, 1) for k in ("F", "B", "W")}
    assert all(a["measured_ms"] > 0 and a["simulated_ms"] >= 0 for a in actions.values())
    assert all(actions[s, "F"]["simulated_ms"] > 0 for s in (0, 1))
    # The schedule replayed on those measured times (both ranks' tables gathered): each rank is busy at least its
    # stage's measured F + B + W for each of the 4 microbatches
    busy = [4 * sum(actions[s, k]["measured_ms"] for k in ("F", "B", "W")) for s in (0, 1)]
    assert doc["replayed_step_ms"] >= max(busy) * (1 - 1e-9), (doc["replayed_step_ms"], busy)


def test_a_failed_rank_is_named(plan: Path) -> None:
    line = one_line_error(fxpipe_cli("run", plan, "--nproc", "2", "--steps", "3", "--timeout", "10",
                                     "--fail-rank", "1"))
    assert "rank 1 failed: RuntimeError: injected failure on rank 1 at step 1" in line


def test_a_killed_rank_is_named(plan: Path) -> None:
    """Rank 1 is SIGKILLed right after its first compute of step 1: it leaves no error file, torchrun stops
    rank 0 (if rank 0 has not already given up waiting for it), and the run still names rank 1, from torchrun's
    exit codes (no hang: the ranks wait at most their --timeout of 10 s)."""
    line = one_line_error(fxpipe_cli("run", plan, "--nproc", "2", "--steps", "3", "--timeout", "10",
                                     "--kill-rank", "1"))
    assert line.startswith("error: rank 1 died (killed by signal 9, SIGKILL"), line
    assert "without an error report; the other ranks stopped" in line, line


def test_resume_continues_exactly(plan: Path, tmp_path: Path) -> None:
    """Resume is bit-exact, falls back past a newest step whose bytes changed at the same size (saying so in
    one line), and --overwrite replaces only the checkpoints."""
    ckpt = tmp_path / "ckpt"
    straight = json.loads(ok(fxpipe_cli("run", plan, "--nproc", "2", "--steps", "4", "--checkpoint-dir", ckpt,
                                        "--keep-checkpoints", "4", "--json")).stdout)["losses"]
    assert sorted(p.name for p in ckpt.iterdir()) == [".fxpipe.lock", *(f"step_00000{k}" for k in range(1, 5))]
    for late in ("step_000003", "step_000004"):  # as if the run had stopped after step 2
        shutil.rmtree(ckpt / late)
    resumed = json.loads(ok(fxpipe_cli("run", plan, "--nproc", "2", "--steps", "3", "--checkpoint-dir", ckpt,
                                       "--resume", "always", "--json")).stdout)["losses"]
    assert resumed == [straight[2]]  # bit for bit: the same float
    data = ckpt / "step_000003" / "__1_0.distcp"
    damaged = bytearray(data.read_bytes())  # the newest step's tensors changed at the same size (10 KB XORed)
    for i in range(len(damaged) // 4, min(len(damaged), len(damaged) // 4 + 10_000)):
        damaged[i] ^= 0x5A
    data.write_bytes(bytes(damaged))
    result = ok(fxpipe_cli("run", plan, "--nproc", "2", "--steps", "4", "--checkpoint-dir", ckpt, "--resume", "always",
                           "--json", "--keep-checkpoints", "2"))
    assert json.loads(result.stdout)["losses"] == straight[2:4]  # from the good step 2, not the damaged step 3
    assert result.stderr.splitlines() == ["note: step_000003 is corrupt (__1_0.distcp does not match the checksum "
                                          "recorded when it was written); resuming from step_000002"]
    assert sorted(p.name for p in ckpt.iterdir()) == [".fxpipe.lock", "step_000003", "step_000004"]
    # Without --resume or --overwrite the directory is refused; --overwrite keeps the user's own files.
    (ckpt / "NOTES.txt").write_text("mine")
    line = one_line_error(fxpipe_cli("run", plan, "--nproc", "2", "--steps", "1", "--checkpoint-dir", ckpt))
    assert line == (f"error: --checkpoint-dir {ckpt} is not empty (it holds NOTES.txt, step_000003, step_000004); pass "
                    "--resume always (or auto) to continue from its newest checkpoint, --overwrite to replace its "
                    "checkpoints, or another --checkpoint-dir")
    ok(fxpipe_cli("run", plan, "--nproc", "2", "--steps", "1", "--checkpoint-dir", ckpt, "--overwrite", "--json"))
    assert sorted(p.name for p in ckpt.iterdir()) == [".fxpipe.lock", "NOTES.txt", "step_000001"]
    assert (ckpt / "NOTES.txt").read_text() == "mine"


def test_resuming_with_more_steps_follows_the_longer_schedule(plan: Path, tmp_path: Path) -> None:
    """Training on with a larger --steps (what docs/cli.md recommends): the resumed steps' learning rates are the
    longer run's cosine at those steps, not the saved run's (whose last lr is 0, its end)."""
    ckpt = tmp_path / "ckpt"
    flags = ("--lr", "0.01", "--lr-schedule", "cosine", "--warmup-steps", "2", "--checkpoint-dir", ckpt, "--json")
    first = json.loads(ok(fxpipe_cli("run", plan, "--nproc", "2", "--steps", "4", *flags)).stdout)
    on = json.loads(ok(fxpipe_cli("run", plan, "--nproc", "2", "--steps", "6", "--resume", "always", *flags)).stdout)

    def cosine(k: int, total: int) -> float:  # Hugging Face's get_cosine_schedule_with_warmup, written out
        return 0.01 * (k / 2 if k < 2 else 0.5 * (1 + math.cos(math.pi * (k - 2) / (total - 2))))

    torch.testing.assert_close(first["lrs"], [cosine(k, 4) for k in range(4)], rtol=1e-6, atol=0)
    assert on["first_step"] == 4 and len(on["lrs"]) == 2
    torch.testing.assert_close(on["lrs"], [cosine(4, 6), cosine(5, 6)], rtol=1e-6, atol=0)  # 0.005, 0.00146


def test_a_users_entry_named_like_a_step_is_never_renamed(plan: Path, tmp_path: Path) -> None:
    """A file of the user's named step_000001 in the checkpoint directory: the run stops in one line when it would
    save that step, and the file is untouched (it was renamed aside before, with a warning no one saw)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "step_000001").write_text("mine")
    line = one_line_error(fxpipe_cli("run", plan, "--nproc", "2", "--steps", "1", "--checkpoint-dir", ckpt,
                                     "--resume", "auto"))
    assert "step_000001 is not a directory, and fxpipe did not write it; move it out of the checkpoint" in line, line
    assert (ckpt / "step_000001").read_text() == "mine" and not (ckpt / ".step_000001.replaced").exists()


def test_resuming_with_another_kind_of_optimizer_is_one_line(plan: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ok(fxpipe_cli("run", plan, "--nproc", "2", "--steps", "1", "--checkpoint-dir", ckpt, "--momentum", "0.9"))
    line = one_line_error(fxpipe_cli("run", plan, "--nproc", "2", "--steps", "2", "--checkpoint-dir", ckpt,
                                     "--resume", "always", "--optimizer", "adamw"))
    assert "the checkpoint's optimizer is sgd and this run's is adamw" in line, line


def test_checkpoint_options_are_checked_before_any_rank_starts(plan: Path, tmp_path: Path,
                                                              no_rank_starts: list[list[str]]) -> None:
    ckpt = saved_checkpoints(tmp_path / "ckpt", range(1, 4))
    assert "the newest checkpoint in" in one_line_error(fxpipe_cli("run", plan, "--steps", "3", "--checkpoint-dir",
                                                                   ckpt,
                                                                   "--resume", "always"))
    line = one_line_error(fxpipe_cli("run", plan, "--steps", "2", "--checkpoint-dir", ckpt, "--resume", "always"))
    assert line == (f"error: the newest checkpoint in {ckpt} is of step 3, and --steps 2 (counted from the start of "
                    "training) asks for no more; pass --steps 4 or more to train further")
    empty = tmp_path / "empty"
    assert one_line_error(fxpipe_cli("run", plan, "--checkpoint-dir", empty, "--resume", "always")) == (
        f"error: no complete checkpoint in {empty} ({empty} does not exist); start without --resume")
    assert one_line_error(fxpipe_cli("run", plan, "--resume", "always")) == (
        "error: --resume always needs --checkpoint-dir")
    assert "pass one of them" in one_line_error(fxpipe_cli("run", plan, "--checkpoint-dir", ckpt, "--resume",
                                                           "always", "--overwrite"))
    # A pickle payload in place of .metadata, then of every file of every step: one line, no code run.
    ran = tmp_path / "code-ran"
    (ckpt / "step_000003" / ".metadata").write_bytes(payload(ran))
    line = one_line_error(fxpipe_cli("run", plan, "--steps", "5", "--checkpoint-dir", ckpt, "--resume", "always"))
    assert line == (f"error: {ckpt}/step_000003/.metadata refers to posix.system, which DCP's metadata never does; it "
                    f"was not loaded (it could run code); remove {ckpt}/step_000003 to resume from the step before")
    for file in ckpt.glob("step_*/*"):
        file.write_bytes(payload(ran).ljust(file.stat().st_size, b"\0"))
    line = one_line_error(fxpipe_cli("run", plan, "--steps", "5", "--checkpoint-dir", ckpt, "--resume", "always"))
    assert line.startswith(f"error: no complete checkpoint in {ckpt} (step_000003 is corrupt (") and not ran.exists()


@pytest.mark.parametrize(("args", "expected"), [
    (["--nproc", "3"], "zb-h1 runs this plan's 2 stages on 2 ranks, not 3; use --nproc 2"),
    (["--nproc", "2", "--schedule", "nope"], "unknown schedule 'nope'"),
    (["--nproc", "2", "--schedule", "interleaved-1f1b"], "use --nproc 1"),
])
def test_a_schedule_that_does_not_fit_is_refused_before_any_rank_starts(plan: Path, args: list[str], expected: str,
                                                                         no_rank_starts: list[list[str]]) -> None:
    assert expected in one_line_error(fxpipe_cli("run", plan, *args, "--steps", "1"))


def test_a_wrong_host_setting_is_refused_before_any_rank_starts(plan: Path, no_rank_starts: list[list[str]]) -> None:
    assert one_line_error(fxpipe_cli("run", plan, "--send-yield", "2", "--steps", "1")) == (
        "error: Invalid value for '--send-yield': '2' is not one of 'auto', 'on', 'off'; see fxpipe run --help")
    assert one_line_error(fxpipe_cli("run", plan, "--gloo-loop-nice", "20", "--steps", "1")).startswith(
        "error: Invalid value for '--gloo-loop-nice': Input should be less than or equal to 19")


def test_the_host_settings_are_flags_of_the_launcher_and_options_of_the_ranks() -> None:
    """fxpipe run's host settings are its flags (today's defaults), handed to the ranks in their configuration, not
    through the environment."""
    from typer.testing import CliRunner

    from fxpipe.calibration.host import HostTuning
    from fxpipe.cli.main import app

    shown = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"}).stdout
    for flag in ("--pin-ranks", "--no-pin-ranks", "--gloo-loop-nice", "--send-yield", "--keep-freed-memory",
                 "--no-keep-freed-memory"):
        assert flag in shown, flag
    from fxpipe.cli.run_config import RunConfig

    assert RunConfig().host_tuning() == HostTuning.for_runs()  # the flags' defaults: the tuning runs want
    tuned = RunConfig().replace(pin_ranks=False, gloo_loop_nice=7, send_yield="on", keep_freed_memory=False)
    assert tuned.host_tuning() == HostTuning(gloo_loop_nice=7, send_yield="on")  # the ranks apply what they read


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python 3.11's")
def test_a_folder_named_fxpipe_in_the_working_directory_does_not_shadow_the_package(
        batched_w_run: dict[str, object]) -> None:
    # torchrun starts each rank with `python -m`, which puts the working directory first on sys.path; a folder
    # named fxpipe there (no __init__.py) was imported as a namespace package instead of an editable install's
    # fxpipe, and every rank failed. The ranks run with PYTHONSAFEPATH=1 (Python 3.11+: no working directory).
    # (batched_w_run's launch: started in a working directory holding a folder named fxpipe, with --no-pin-ranks:
    # the ranks are left where the system puts them)
    assert len(batched_w_run["losses"]) == 3  # type: ignore[arg-type]
    assert batched_w_run["cpus_per_rank"] == [[], []]


@pytest.mark.parametrize(("args", "expected"), [
    (["--device", "tpu"], "error: Invalid value for '--device': 'tpu' is not one of 'cpu', 'cuda'; see fxpipe run "
                          "--help"),
    (["--cuda-graphs"], "error: --cuda-graphs replays the stages as CUDA graphs, and the ranks train on the CPU; pass "
                        "--device cuda with it, or leave --cuda-graphs off"),
    (["--device", "cpu", "--cuda-graphs"], "error: --cuda-graphs replays the stages as CUDA graphs, and the ranks "
                                           "train on the CPU; pass --device cuda with it, or leave --cuda-graphs off"),
    (["--device", "cuda", "--cuda-graphs", "--schedule", "async-1f1b"],
     "error: --cuda-graphs replays synchronous schedules' stages; async-1f1b reads weight versions that change "
     "between calls: use a synchronous schedule (e.g. --schedule 1f1b) or leave --cuda-graphs off"),
    (["--device", "cuda", "--cuda-graphs", "--codegen", "inductor"],
     "error: --cuda-graphs replays the eager stage graphs; with --codegen inductor Inductor recompiles inside the "
     "capture and it fails: use --codegen eager, or leave --cuda-graphs off"),
    (["--device", "cuda"], f"error: this machine has no CUDA device torch can use (torch {torch.__version__}); use "
                           "--device cpu"),
])
def test_device_options_are_refused_before_any_rank_starts(plan: Path, args: list[str], expected: str,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           no_rank_starts: list[list[str]]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same refusals on a machine with a GPU
    assert one_line_error(fxpipe_cli("run", plan, *args, "--steps", "1")) == expected


@pytest.fixture(scope="module")
def batched_w_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """``compile --schedule batched-w`` on mlp-tiny, then one run of 3 steps (its --json report), shared by the two
    tests that read it: started in a working directory holding a folder named fxpipe (Python 3.11+), with
    --no-pin-ranks."""
    tmp = tmp_path_factory.mktemp("batched-w")
    out = tmp / "plan"
    # the schedule as the plan records it (compile --schedule), which run takes when given none
    ok(fxpipe_cli("compile", "mlp-tiny", "--stages", "2", "--out", out, "--schedule", "batched-w", "--microbatches",
                  "8"))
    cwd = tmp / "cwd"
    cwd.mkdir()
    if sys.version_info >= (3, 11):  # PYTHONSAFEPATH is Python 3.11's
        (cwd / "fxpipe").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        return json.loads(ok(fxpipe_cli("run", out, "--nproc", "2", "--steps", "3", "--json", "--no-pin-ranks")).stdout)


def test_batched_w_runs_each_stage_s_w_once_and_says_so(batched_w_run: dict[str, object]) -> None:
    """``compile --schedule batched-w`` on mlp-tiny, then run: trains like one process, and each stage's Ws ran as one
    call per batch
    of 4 microbatches (8 microbatches: two batches), with its measured time against the 4 one by one (what the
    simulated step charges)."""
    doc: dict[str, Any] = batched_w_run
    assert doc["schedule"] == "batched-w" and doc["microbatches"] == 8
    assert doc["losses"] == pytest.approx(reference_losses(3, m=8, model="mlp-tiny"), rel=1e-5)
    assert sorted(doc["batched_w"]) == ["0", "1"]
    for how in doc["batched_w"].values():
        assert how.startswith("batched over 4 microbatches ("), how


def test_ranks_on_one_machine_share_its_clock_in_the_trace() -> None:
    from fxpipe.cli.run_cmd import _on_one_clock

    ranks = [{"rank": 0, "host": "a", "step_started": 10.0, "events": [["0F0", 0.0, 1.0]]},
             {"rank": 1, "host": "a", "step_started": 10.5, "events": [["1F0", 0.75, 1.5]]}]
    assert _on_one_clock(ranks) == {0: [("0F0", 0.0, 1.0)], 1: [("1F0", 1.25, 2.0)]}
    # two machines: no clock in common, each rank's own step start
    ranks[1]["host"] = "b"
    assert _on_one_clock(ranks) == {0: [["0F0", 0.0, 1.0]], 1: [["1F0", 0.75, 1.5]]}


def test_a_calibrated_plan_simulated_without_its_runtime_costs_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan estimated with calibrated rates whose runtime costs this machine has not cached (another machine, thread
    count or calibration version: plan_overheads gives None) is simulated without them, and fxpipe run says so."""
    from types import SimpleNamespace

    from fxpipe.cli.rank import runtime_costs_missing
    from fxpipe.cli.run_cmd import RUNTIME_COSTS_MISSING

    calibrated = SimpleNamespace(options=SimpleNamespace(compute=object()))
    fixed = SimpleNamespace(options=SimpleNamespace(compute=None))
    monkeypatch.setenv("FXPIPE_CALIBRATION", "on")
    assert runtime_costs_missing(calibrated, None)
    assert not runtime_costs_missing(calibrated, object())  # found: simulated with them
    assert not runtime_costs_missing(fixed, None)  # the fixed cost model never had them
    monkeypatch.setenv("FXPIPE_CALIBRATION", "off")
    assert not runtime_costs_missing(calibrated, None)  # calibration off: left out on purpose
    assert "fxpipe compile" in RUNTIME_COSTS_MISSING and "runtime's fixed costs" in RUNTIME_COSTS_MISSING


def test_recompute_stage_trains_the_same_and_holds_less(plan: Path) -> None:
    """``--recompute stage`` (issue 42): one launch under 1F1B, every stage recomputing: the one-process losses, and
    each stage's measured peak held bytes equal to the memory model's and below what it holds without recomputing."""
    from fxpipe.plan_dir import read_plan
    from fxpipe.planning.cost import held_peaks
    from fxpipe.schedules.auto import plan_schedule
    from fxpipe.schedules.simulate import Costs

    doc = json.loads(ok(fxpipe_cli("run", plan, "--nproc", "2", "--steps", "2", "--schedule", "1f1b",
                                   "--recompute", "stage", "--json")).stdout)
    assert doc["schedule"] == "1f1b" and doc["recompute"] == [0, 1], doc["recompute_note"]
    assert doc["losses"] == pytest.approx(reference_losses(2), rel=1e-5)
    p = read_plan(plan)
    acts = [(a.stage, a.kind.value) for r in plan_schedule(p, "1f1b", 4).ranks for a in r]
    costs = Costs.from_plan(p)
    without = held_peaks(acts, costs.held_fb, costs.held_bw)
    assert doc["simulated_held_bytes_per_stage"] == [int(x) for x in held_peaks(acts, costs.recomputing([0, 1]).held_fb,
                                                                                   costs.held_bw)]
    assert doc["peak_held_bytes_per_stage"] == doc["simulated_held_bytes_per_stage"]  # measured on the ranks
    assert all(got < before for got, before in zip(doc["peak_held_bytes_per_stage"], without)), (doc, without)


@pytest.mark.parametrize("args, expected", [
    (["--recompute", "some"], "Invalid value for '--recompute': 'some' is not one of 'none', 'stage', 'auto'"),
    (["--schedule", "async-1f1b", "--recompute", "stage"], "async-1f1b is asynchronous, and its phases read weight"),
])
def test_recompute_is_checked_before_any_rank_starts(plan: Path, args: list[str], expected: str,
                                                     no_rank_starts: list[list[str]]) -> None:
    assert expected in one_line_error(fxpipe_cli("run", plan, *args))
