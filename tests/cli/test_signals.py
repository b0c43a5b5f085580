"""``fxpipe run`` under signals: SIGTERM and SIGINT stop every rank within seconds and leave no temporary
files; a rank stopped with SIGSTOP is named as unresponsive, not as killed for memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._helpers import MLP_PLAN, plan_fixture

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds rank processes in /proc")


plan = plan_fixture(*MLP_PLAN)


def start_run(plan: Path, tmp: Path, *args: str) -> subprocess.Popen[str]:
    """``fxpipe run PLAN --steps 100000`` in a session of its own, its temporary files under ``tmp``, with SIGINT's
    default action: a suite started in the background (``cmd &`` in a script) runs with SIGINT ignored, which
    children inherit, and a Python started that way keeps ignoring it (as it should: nohup and shells rely on it)."""
    return subprocess.Popen([sys.executable, "-m", "fxpipe.cli.main", "run", str(plan), "--steps", "100000",
                             "--json", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)}, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def first_step(proc: subprocess.Popen[str], tmp: Path, timeout: float = 120.0) -> Path:
    """The run's report directory, once rank 0 has finished a step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        for progress in tmp.glob("fxpipe-run-*/progress"):
            if progress.read_text().strip():
                return progress.parent
        time.sleep(0.1)
    raise AssertionError("no step finished")


def processes_of(out_dir: Path) -> dict[int, str]:
    """The run's live processes (torchrun and the ranks): those whose ``TMPDIR``, which
    fxpipe run sets for them, is the run's report directory ``out_dir``: pid -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"TMPDIR={out_dir}".encode() in env and state not in ("Z", "X"):
            found[int(entry.name)] = cmdline
    return found


def rank_pid(out_dir: Path, rank: int) -> int:
    """The process of ``rank``, from the pid file it writes as it starts."""
    pid = int((out_dir / f"rank{rank}.pid").read_text())
    assert pid in processes_of(out_dir), f"rank {rank}'s process {pid} is not the run's"
    return pid


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_every_rank_and_removes_the_temporary_files(plan: Path, tmp_path: Path,
                                                                   sig: signal.Signals) -> None:
    proc = start_run(plan, tmp_path)
    try:
        out_dir = first_step(proc, tmp_path)
        ranks = processes_of(out_dir)
        # torch's elastic agent (fxpipe.cli.launch) and its 2 ranks, forked from it: 3 processes of one command line
        assert len(ranks) == 3 and all(" -m fxpipe.cli.launch " in c for c in ranks.values()), ranks
        assert {rank_pid(out_dir, r) for r in (0, 1)} < set(ranks)
        sent = time.monotonic()
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=50)
        took = time.monotonic() - sent
        assert proc.returncode == 128 + sig, stderr
        assert "Traceback" not in stderr
        # Stopped by the signal, not by the ranks giving up: the run's --timeout (60 s) never ran out. No tighter bound
        # holds on a loaded machine (a rank's exit there took 9 s).
        print(f"{sig.name}: every rank stopped and fxpipe exited {took:.2f} s after the signal")
        assert processes_of(out_dir) == {}  # not a rank, not torchrun
        assert not any(_alive(pid) for pid in ranks)
        assert list(tmp_path.iterdir()) == []  # the report directory, torchrun's logs and all
    finally:
        kill_run(proc, tmp_path)


def test_a_stopped_rank_is_named_unresponsive_within_seconds(plan: Path, tmp_path: Path) -> None:
    """The default --timeout (60 s) stays: the launcher sees the rank's state (T) and ends the run after 2 s."""
    proc = start_run(plan, tmp_path)
    try:
        out_dir = first_step(proc, tmp_path)
        os.kill(rank_pid(out_dir, 1), signal.SIGSTOP)
        stopped = time.monotonic()
        _, stderr = proc.communicate(timeout=90)
        took = time.monotonic() - stopped
        assert proc.returncode == 2, stderr
        lines = stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: rank 1 was unresponsive"), stderr
        assert "out-of-memory" not in stderr
        print(f"a stopped rank was named {took:.2f} s after SIGSTOP")
        assert took < 30, f"took {took:.1f} s"  # 2 s of being stopped, not the 60 s --timeout nor torchrun's 30 s
        assert processes_of(out_dir) == {}
        assert list(tmp_path.iterdir()) == []
    finally:
        kill_run(proc, tmp_path)


@pytest.mark.parametrize("sig, when", [(signal.SIGINT, "at once"), (signal.SIGINT, "importing torch"),
                                       (signal.SIGTERM, "importing torch"), (signal.SIGINT, "torchrun starting")])
def test_a_signal_at_any_moment_stops_the_run_cleanly(plan: Path, tmp_path: Path, sig: signal.Signals,
                                                      when: str) -> None:
    """From fxpipe run's first instant: it exits by the signal (its default action, or 128 + signal after its
    cleanup), with no traceback nor C++ terminate, no process of the run left and no temporary file."""
    proc = start_run(plan, tmp_path)
    try:
        if when == "importing torch":  # torch's libraries mapped: past Python's own start-up, whatever the load
            deadline = time.monotonic() + 120
            while not _maps_torch(proc.pid) and time.monotonic() < deadline:
                assert proc.poll() is None, proc.communicate()
                time.sleep(0.005)
        elif when == "torchrun starting":  # the instant a child appears: torchrun, before its ranks
            deadline = time.monotonic() + 120
            while not run_processes(proc.pid, tmp_path) - {proc.pid} and time.monotonic() < deadline:
                assert proc.poll() is None, proc.communicate()
                time.sleep(0.01)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode in (-sig, 128 + sig), (proc.returncode, stderr)
        assert "Traceback" not in stderr and "terminate called" not in stderr, stderr  # C++ std::terminate
        deadline = time.monotonic() + 10  # ranks that saw their launcher go leave within a second
        while run_processes(-1, tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert {pid: _described(pid) for pid in run_processes(-1, tmp_path)} == {}
        assert list(tmp_path.iterdir()) == []
    finally:
        kill_run(proc, tmp_path)


def _maps_torch(pid: int) -> bool:
    """Whether process ``pid`` has mapped torch's C++ library (it is inside ``import torch``, or past it). A signal
    sent earlier, while CPython itself starts, is CPython's to handle (a fatal error in ``init_sys_streams``)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def test_killing_the_launcher_takes_its_ranks_down(plan: Path, tmp_path: Path) -> None:
    """``kill -9`` of fxpipe run: torchrun gets SIGTERM (PR_SET_PDEATHSIG) and the ranks, which watch the
    launcher, leave within about a second (its report directory stays: nothing ran to remove it)."""
    proc = start_run(plan, tmp_path)
    try:
        out_dir = first_step(proc, tmp_path)
        ranks = processes_of(out_dir)
        assert len(ranks) >= 3, ranks
        proc.kill()
        proc.wait(timeout=10)
        killed = time.monotonic()
        while processes_of(out_dir) and time.monotonic() - killed < 30:
            time.sleep(0.1)
        took = time.monotonic() - killed
        print(f"every rank and torchrun were gone {took:.2f} s after fxpipe run was killed")
        assert processes_of(out_dir) == {}, "ranks outlived their launcher"
    finally:
        kill_run(proc, tmp_path)


def _described(pid: int) -> str:
    """A process's command line, state and process group, for a failure's message."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        state, _ppid, pgrp = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:3]
    except OSError:
        return "gone"
    return f"{cmdline} (state {state}, group {pgrp})"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _stat(pid: int) -> tuple[str, int] | None:
    """``(state, parent pid)`` of a process from ``/proc``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1])


def run_processes(root: int, tmp: Path) -> set[int]:
    """Every live process of the run started by :func:`start_run`: ``root``'s descendants (by parent pid), and any
    process whose ``TMPDIR`` lies in ``tmp`` (fxpipe run, torchrun and the ranks all inherit one there; a rank whose
    parents died is no longer ``root``'s descendant, but keeps its environment)."""
    children: dict[int, list[int]] = {}
    found: set[int] = set()
    prefix = str(tmp).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        stat = _stat(pid)
        if stat is None or stat[0] in ("Z", "X"):
            continue
        children.setdefault(stat[1], []).append(pid)
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(v.startswith(b"TMPDIR=" + prefix) for v in env):
            found.add(pid)
    todo, seen = [root], set()
    while todo:
        pid = todo.pop()
        if pid not in seen and _stat(pid) is not None:
            seen.add(pid)
            todo.extend(children.get(pid, []))
    return found | seen


def kill_run(proc: subprocess.Popen[str], tmp: Path) -> None:
    """SIGKILL whatever is left of the run, whether or not the test passed: fxpipe run's session (``proc`` leads
    it), and each process of :func:`run_processes` with its process group (torchrun and every rank lead their own
    session), never this test's own group. Repeated until none is left (a process may start one meanwhile)."""
    own = os.getpgrp()
    for _ in range(10):
        pids = run_processes(proc.pid, tmp) if proc.poll() is None else run_processes(-1, tmp)
        if not pids:
            break
        for pid in pids:
            try:
                pgid = os.getpgid(pid)
                if pgid != own:
                    os.killpg(pgid, signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        proc.poll()  # reap fxpipe run itself
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def one_stage() -> Path:
    from tests._helpers import cli_plan

    return cli_plan("mlp-tiny", "--stages", "1")


def test_a_run_whose_every_rank_is_busy_is_stopped_after_the_timeout(one_stage: Path, tmp_path: Path) -> None:
    """The loss never returns on the ranks (the launcher's own check of it passes): no rank waits on a peer, so
    none gives up by itself; the launcher sees no heartbeat move and stops the run, naming where each rank was."""
    from tests._helpers import fxpipe_cli, one_line_error

    (tmp_path / "spin.py").write_text("import os\n\n\ndef loss(out, target):\n    while 'RANK' in os.environ:\n"
                                      "        pass\n    return out.float().mean()\n")
    line = one_line_error(fxpipe_cli("run", one_stage, "--nproc", 1, "--steps", 2, "--timeout", 2,
                                     "--loss", f"{tmp_path / 'spin.py'}:loss"))
    assert line.startswith("error: no rank made progress for 7 s (--timeout 2 s, and 5 more) (rank 0: step 1)"), line


def test_a_loss_that_never_returns_in_the_launcher_s_check_is_one_line(one_stage: Path, tmp_path: Path) -> None:
    from tests._helpers import fxpipe_cli, one_line_error

    (tmp_path / "spin.py").write_text("def loss(out, target):\n    while True:\n        pass\n")
    line = one_line_error(fxpipe_cli("run", one_stage, "--steps", 1, "--timeout", 1,
                                     "--loss", f"{tmp_path / 'spin.py'}:loss"))
    assert "did not return within --timeout 1 s (the launcher's check" in line, line
