"""``fxpipe run``'s ranks from the outside: start them under torchrun, follow their steps, name the rank that failed.

The ranks run ``python -m fxpipe.cli.rank`` and leave their reports in one directory of this node
(each node of a multi-node run has its own): ``rank{R}.json`` (a result), ``rank{R}.error`` (one
line saying why it stopped), ``progress`` (the node's first rank's finished steps) and, on the node
that holds rank 0, ``results.json`` (every rank's result, gathered). A rank that died by a signal
leaves neither report; torchrun's failure summary has its exit code. :func:`diagnose` turns all of
that into the one line that names the rank to look at, or says that the nodes never met
(:class:`Rendezvous`: where they meet, torchrun's multi-node options).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]  # psutil ships no type information

RANK_MODULE = "fxpipe.cli.rank"  # the program every rank runs
LAUNCH_MODULE = "fxpipe.cli.launch"  # torchrun, its ranks forked from one process that imported torch once
RESULTS = "results.json"  # every rank's result, written by rank 0 (on the node that holds it)
PARAMS = "params.pt"  # every stage's final weights (replica 0's), written by rank 0 for a held-out score
DEFAULT_MASTER_PORT = 29500  # torchrun's
_STEP_LINE = re.compile(r"^step (\d+) loss (\S+) ms (\S+)$")
# What torchrun's agent raises when the nodes never all meet (static TCPStore, or c10d rendezvous).
_RDZV_FAILURE = re.compile(r"^\S*?(RendezvousTimeoutError|RendezvousConnectionError|RendezvousClosedError|"
                           r"DistStoreError|DistNetworkError)\b:?\s*(.*)$", re.M)


@dataclass(frozen=True)
class Rendezvous:
    """Where the nodes of a run meet: torchrun's multi-node options.

    One node and no address is ``--standalone`` (torchrun picks a free port on this machine). With
    ``master_addr`` it is torchrun's static rendezvous (``--node-rank`` fixes which ranks this node
    starts: ``node_rank x nproc`` onwards), with ``endpoint`` the c10d one (ranks in the order nodes
    join; ``run_id`` names the run). Either way a node waits at most ``timeout`` seconds for the others.
    """

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    endpoint: str | None = None
    run_id: str = "fxpipe"
    timeout: float = 300.0

    @property
    def standalone(self) -> bool:
        return self.nnodes == 1 and self.master_addr is None and self.endpoint is None

    def torchrun_args(self) -> list[str]:
        """torchrun's options for this rendezvous."""
        if self.standalone:
            return ["--standalone"]
        seconds = max(1, math.ceil(self.timeout))
        if self.endpoint is not None:
            return [f"--nnodes={self.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={self.endpoint}",
                    f"--rdzv-id={self.run_id}", f"--rdzv-conf=join_timeout={seconds},read_timeout={seconds}"]
        return [f"--nnodes={self.nnodes}", f"--node-rank={self.node_rank}", f"--master-addr={self.master_addr}",
                f"--master-port={self.master_port or DEFAULT_MASTER_PORT}", f"--rdzv-conf=timeout={seconds}"]

    def where(self) -> str:
        """The options that say where the nodes meet, as the user wrote them."""
        if self.endpoint is not None:
            return f"--rdzv-endpoint {self.endpoint}"
        return f"--master-addr {self.master_addr} --master-port {self.master_port or DEFAULT_MASTER_PORT}"


@dataclass(frozen=True)
class StepDone:
    """A step rank 0 finished: its number (from 1), loss and milliseconds."""

    step: int
    loss: float
    ms: float


@dataclass(frozen=True)
class DiedRank:
    """A rank that ended without a report: its exit as words, and whether torchrun itself stopped it
    (SIGTERM, sent to the others once one rank failed)."""

    rank: int
    how: str
    terminated: bool


@dataclass(frozen=True)
class RanksExit:
    """How torchrun ended: its exit code and output, and the ranks whose processes were stopped (SIGSTOP,
    a debugger) when the run ended (such a rank cannot answer its peers, nor exit when told)."""

    returncode: int
    stdout: str
    stderr: str
    stopped: frozenset[int] = frozenset()
    local: frozenset[int] = frozenset()  # the ranks seen running on this node
    stalled: tuple[tuple[int, str], ...] | None = None  # (rank, what it did) when no rank moved on for --timeout


@dataclass(frozen=True)
class RankFailure:
    """Why a run failed: the rank to look at (None when no report names one) and the line that says so."""

    rank: int | None
    message: str
    after_results: bool = False  # every failing rank had written its result: the run's results are complete


def torchrun_command(rank_argv: Sequence[str | os.PathLike[str]], nproc: int, *, rendezvous: Rendezvous | None = None,
                     max_restarts: int = 0) -> list[str]:
    """The command line that starts ``nproc`` ranks of :data:`RANK_MODULE` (given ``rank_argv``) on this machine:
    torchrun's options and elastic agent, each rank forked from one process that imported torch once
    (:mod:`fxpipe.cli.launch`). With a multi-node ``rendezvous`` they join the other nodes' ranks in one world.
    With ``max_restarts``, torchrun's elastic agent restarts every rank when one fails, that many times at most."""
    meet = (rendezvous or Rendezvous()).torchrun_args()
    restart = [f"--max-restarts={max_restarts}"] if max_restarts else []
    return [sys.executable, "-m", LAUNCH_MODULE, *meet, *restart, f"--nproc-per-node={nproc}",
            "-m", RANK_MODULE, *map(str, rank_argv)]


def restart_env(max_restarts: int) -> dict[str, str]:
    """torchrun's environment for restarts: the rendezvous store is not shared with the ranks, so each attempt's
    rank 0 hosts a new one. A shared store keeps the last attempt's keys, and gloo would read a dead rank's
    address from them."""
    return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if max_restarts else {}


RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # torchrun's: 0 in the first attempt, k after k restarts
EARLIER = ".attempt"  # rank{R}.error of attempt k is kept as rank{R}.error.attempt{k} when the ranks restart


def restarts(out_dir: Path, results: list[dict[str, Any]] | None) -> str | None:
    """A line on the restarts torchrun made (the ranks' restart count, and why each earlier attempt stopped as
    its ranks reported it), or None when the run went through in one attempt."""
    earlier = sorted(out_dir.glob(f"rank*.error{EARLIER}*"), key=lambda p: (int(p.name.rsplit(EARLIER, 1)[1]),
                                                                          int(p.name[4:p.name.index(".")])))
    count = max([int(r.get("restarts", 0)) for r in results or ()]  # the last attempt's count, else the reports'
                + [int(p.name.rsplit(EARLIER, 1)[1]) + 1 for p in earlier], default=0)
    if not count and not earlier:
        return None
    said = "; ".join(f"attempt {p.name.rsplit(EARLIER, 1)[1]}: rank {p.name[4:p.name.index('.')]}: "
                     f"{p.read_text().strip()}" for p in earlier[:4])
    return (f"torchrun restarted the ranks {count} time{'s' * (count != 1)} (--max-restarts)"
            + (f"; {said}" if said else "") + "; each attempt went on from the newest checkpoint it found "
            "(--resume auto) or from step 0")


def keep_earlier_error(out_dir: Path, rank: int) -> None:
    """A restarted rank (``TORCHELASTIC_RESTART_COUNT`` > 0) keeps its previous attempt's error report under
    another name, so that the launcher does not take it for this attempt's."""
    attempt = int(os.environ.get(RESTART_COUNT, "0") or 0)
    stale = out_dir / f"rank{rank}.error"
    if attempt and stale.exists():
        os.replace(stale, out_dir / f"rank{rank}.error{EARLIER}{attempt - 1}")


def parse_step(line: str) -> StepDone | None:
    """A progress line ``step K loss L ms T`` (as ``fxpipe.cli.rank`` writes it), or None for any other line."""
    match = _STEP_LINE.match(line.strip())
    if match is None:
        return None
    try:
        return StepDone(int(match.group(1)), float(match.group(2)), float(match.group(3)))
    except ValueError:
        return None


LAUNCHER_PID = "FXPIPE_LAUNCHER_PID"  # the ranks watch this process, and leave when it is gone
class Heartbeat:
    """A rank's sign of progress, for the launcher (:func:`stalled`): ``rank{R}.beat`` in the run's directory,
    its text what the rank is doing, its mtime when the rank last moved on. :meth:`phase` marks a step of set-up
    (or of training); a daemon thread touches the file each ``every`` seconds in which :meth:`watch`'s reading
    changed (the runtime's finished actions). A rank busy inside one operator, or in a loop of a user's function,
    never moves it."""

    def __init__(self, out_dir: Path, rank: int, every: float = 1.0) -> None:
        self.path = out_dir / f"rank{rank}.beat"
        self.doing = "starting"
        self._reading: Callable[[], object] | None = None
        self.phase("starting")
        threading.Thread(target=self._follow, args=(every,), daemon=True, name="fxpipe-heartbeat").start()

    def phase(self, doing: str) -> None:
        self.doing = doing
        try:  # the file is made once (__init__); later phases never make it again in a directory the launcher removed
            with open(self.path, "w" if doing == "starting" else "r+", encoding="utf-8") as f:
                f.write(doing)
                f.truncate()
        except OSError:  # the run's directory is gone: the launcher has ended the run
            pass

    def watch(self, reading: Callable[[], object]) -> None:
        self._reading = reading

    def _follow(self, every: float) -> None:
        last: object = None
        while True:
            time.sleep(every)
            reading = self._reading
            now = reading() if reading is not None else None
            if reading is not None and now != last:
                last = now
                try:
                    os.utime(self.path)
                except OSError:
                    pass


def stalled(out_dir: Path, started: float, timeout: float, now: float,
            first: float | None = None) -> tuple[tuple[int, str], ...] | None:
    """Each rank's last word, (rank, what it was doing), when none has moved on (:class:`Heartbeat`) for ``timeout``
    seconds since ``started`` (``first`` seconds while a rank is starting or setting up: importing torch, tracing,
    nodes meeting, each of which may take minutes on a loaded machine; all times on ``time.time()``'s clock; ``()``:
    no rank has started); else None. Every rank busy at once (a loop in every rank's graph or function) is what this
    catches: a rank that waits for a busy one gives up by itself, at ``--timeout``."""
    beats: list[tuple[int, str, float]] = []
    for path in out_dir.glob("rank*.beat"):
        try:
            beats.append((int(path.name[4:-5]), path.read_text()[:200], path.stat().st_mtime))
        except (OSError, ValueError):
            continue
    latest = max([started, *(t for _, _, t in beats)])
    setting_up = not beats or any(not doing.startswith("step") for _, doing, _ in beats)
    if now - latest < (first if setting_up and first is not None else timeout):
        return None
    return tuple(sorted((rank, doing) for rank, doing, _ in beats))


STOPPED_S = 2.0  # a rank stopped (SIGSTOP) this long ends the run: it cannot answer its peers


def die_with_parent() -> None:
    """In torchrun's process, before it runs: SIGTERM when fxpipe run dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing, and the ranks' own watch on fxpipe run still ends them)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


@contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held back, and delivered when this ends: around starting torchrun (so that the ``try``
    that stops it is entered first) and around importing torch (whose C++ initialisation aborts with
    ``terminate`` when a KeyboardInterrupt crosses it)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def run_ranks(cmd: list[str], progress: Path, on_step: Callable[[StepDone], None], *,
              grace: float = 3.0, stopped_s: float = STOPPED_S, env: Mapping[str, str] | None = None,
              stall_s: float | None = None, first_s: float | None = None) -> RanksExit:
    """Run torchrun to the end, calling ``on_step`` for each step rank 0 finishes (a line in ``progress``).

    The ranks run with one thread each (``OMP_NUM_THREADS=1``) and keep their temporary files in
    ``progress``'s directory; torchrun's stdout and stderr come back
    in the result (its failure summary is in stderr). However this returns or raises (SIGTERM, Ctrl-C,
    an error), no rank outlives it: torchrun runs in a session of its own, and each rank it starts in another, so
    a signal to this process reaches none of them; :func:`stop_tree` stops torchrun and every rank seen.
    A rank stopped (SIGSTOP) for ``stopped_s`` seconds, or while another has reported an error, cannot
    let the run finish: it is stopped then, not at the ranks' --timeout nor after torchrun's own 30 s
    wait. fxpipe run killed outright (SIGKILL) takes torchrun (``PR_SET_PDEATHSIG``) and the ranks
    (which watch it, see ``fxpipe.cli.rank``) down with it. ``env`` adds to torchrun's environment. When no rank
    has moved on (:func:`stalled`) for ``stall_s`` seconds (``first_s`` before any has started), the run is stopped,
    and the result says where each was.
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as errf:
        seen: dict[int, float] = {}  # every rank process seen: pid -> start time (a pid can be reused)
        local: dict[int, int | None] = {}  # pid -> the RANK it runs (None: torchrun's own processes)
        stopped: set[int] = set()
        since: dict[int, float] = {}  # rank -> when it was first seen stopped
        shown = 0
        hung: tuple[tuple[int, str], ...] | None = None
        launched = time.time()
        with signals_held():  # a Ctrl-C now arrives inside the try below, which stops torchrun
            # TMPDIR: torchrun's own log directory (and any rank's temporary file) go inside the run's report
            # directory, which the caller removes, instead of staying behind in /tmp.
            launch_env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(progress.parent),
                          LAUNCHER_PID: str(os.getpid()),
                          # `python -m` puts the working directory first on sys.path, where a folder named fxpipe
                          # would shadow an editable install (3.11+ honours it)
                          "PYTHONSAFEPATH": "1", **(env or {})}
            proc = subprocess.Popen(cmd, stdout=out, stderr=errf, text=True, start_new_session=True,
                                    preexec_fn=die_with_parent if sys.platform == "linux" else None, env=launch_env)
        try:
            while proc.poll() is None:
                seen.update(descendants(proc.pid))
                pids = rank_pids(progress.parent)
                for pid in seen:
                    if local.get(pid) is None:  # not known yet: a rank writes its pid file as it starts
                        local[pid] = pids.get(pid)
                stopped = {r for r in map(pids.get, _stopped(seen)) if r is not None}
                now = time.monotonic()
                since = {r: since.get(r, now) for r in stopped}
                if stopped and (any(progress.parent.glob("rank*.error"))
                                or now - min(since.values()) >= stopped_s):
                    break
                if stall_s is not None:
                    hung = stalled(progress.parent, launched, stall_s, time.time(), first_s)
                    if hung is not None:
                        break
                time.sleep(0.2)
                lines = progress.read_text().splitlines() if progress.exists() else []
                for line in lines[shown:]:
                    step = parse_step(line)
                    if step is not None:
                        on_step(step)
                shown = len(lines)
        finally:
            stop_tree(proc, seen, grace)
        lines = progress.read_text().splitlines() if progress.exists() else []
        for line in lines[shown:]:
            step = parse_step(line)
            if step is not None:
                on_step(step)
        out.seek(0)
        errf.seek(0)
        return RanksExit(proc.returncode, out.read(), errf.read(), frozenset(stopped),
                         frozenset(r for r in local.values() if r is not None), hung)


def stop_tree(proc: Any, seen: Mapping[int, float], grace: float) -> None:
    """Stop ``proc`` (torchrun, a session leader) and its ranks: SIGTERM (and SIGCONT, so a stopped rank
    gets it) to torchrun's group and to each rank's, then SIGKILL whatever still runs after ``grace``
    seconds, in torchrun's group too once torchrun has gone (see :func:`group_members`). Signals that
    arrive meanwhile are held off, so a second Ctrl-C cannot leave ranks behind."""
    main = threading.current_thread() is threading.main_thread()
    held = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        procs = {**seen, **descendants(proc.pid)} if proc.poll() is None else dict(seen)
        alive = {pid: start for pid, start in procs.items() if _running(pid, start)}
        if proc.poll() is None or alive or group_members(proc.pid):
            for sig in (signal.SIGTERM, signal.SIGCONT):
                _signal_group(proc.pid, sig)
                for pid in alive:
                    _signal_group(pid, sig)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and (proc.poll() is None or group_members(proc.pid) or
                                                   any(_running(p, s) for p, s in alive.items())):
                time.sleep(0.05)
            for pid, start in alive.items():
                if _running(pid, start):
                    _signal_group(pid, signal.SIGKILL)
            if proc.poll() is None or group_members(proc.pid):
                _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)


def group_members(pgid: int) -> set[int]:
    """The live processes of the process group ``pgid`` besides its leader.

    torchrun's group can outlive torchrun: a process it started that ignores SIGTERM (as multiprocessing's resource
    tracker does) stays in it, orphaned, where no descendant scan finds it."""
    found = set()
    for proc in psutil.process_iter():
        try:
            if proc.pid != pgid and os.getpgid(proc.pid) == pgid and proc.status() not in _GONE:
                found.add(proc.pid)
        except (psutil.Error, OSError):  # gone meanwhile, or not ours to read
            continue
    return found


def _signal_group(pid: int, sig: int) -> None:
    """``sig`` to the process group led by ``pid`` (torchrun and each rank lead their own), else to ``pid``."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


_GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
_STOPPED = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)  # SIGSTOP; a debugger


def _status(pid: int, start: float) -> str | None:
    """The state of process ``pid`` if it is the one that started at ``start`` (a pid can be reused), else None."""
    try:
        proc = psutil.Process(pid)
        return proc.status() if proc.create_time() == start else None
    except psutil.Error:
        return None


def _stopped(procs: Mapping[int, float]) -> list[int]:
    """The processes of ``procs`` (pid -> start time) that are stopped (SIGSTOP, or a debugger)."""
    return [pid for pid, start in procs.items() if _status(pid, start) in _STOPPED]


def rank_pids(out_dir: Path) -> dict[int, int]:
    """pid -> RANK, from the files ``rank{R}.pid`` each rank writes as it starts (fxpipe.cli.rank)."""
    found: dict[int, int] = {}
    for path in out_dir.glob("rank*.pid"):
        try:
            found[int(path.read_text())] = int(path.name[4:-4])
        except (OSError, ValueError):  # being written, or not one of ours
            continue
    return found


def _running(pid: int, start: float) -> bool:
    """Whether the process ``pid`` that started at ``start`` still runs (a zombie has finished)."""
    status = _status(pid, start)
    return status is not None and status not in _GONE


def descendants(root: int) -> dict[int, float]:
    """Every live descendant of ``root``, as pid -> start time."""
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return {}
    found: dict[int, float] = {}
    for child in children:
        try:
            if child.status() not in _GONE:
                found[child.pid] = child.create_time()
        except psutil.Error:  # gone meanwhile
            continue
    return found


def rank_errors(out_dir: Path) -> dict[int, str]:
    """Each rank's one-line error report, by rank (an empty file, from a rank stopped while writing it, is left out)."""
    errors = {int(p.stem[4:]): p.read_text().strip() for p in out_dir.glob("rank*.error")}
    return {rank: why for rank, why in errors.items() if why}


WARNINGS = "rank{}.warnings"  # one line per warning a rank raised (record_warnings), read by rank_warnings


def record_warnings(out_dir: Path, rank: int) -> None:
    """In a rank process (fxpipe's own): a warning raised by fxpipe or the user's code (not by torch or another
    library, which the launcher's own process would show) becomes a line of ``out_dir/rank{rank}.warnings``, where
    the launcher reads it; a rank's stderr is torchrun's and reaches no one."""
    import sysconfig
    import warnings

    path = out_dir / WARNINGS.format(rank)
    libraries = tuple(os.path.realpath(p) for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"]})
    ours = os.path.realpath(os.path.dirname(os.path.dirname(__file__)))

    def show(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        where = os.path.realpath(filename)
        if where.startswith(libraries) and not where.startswith(ours):
            return
        text = str(message).strip().splitlines()
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(f"{category.__name__}: {text[0][:300] if text else ''}\n")
        except OSError:
            pass

    warnings.showwarning = show

    class _Relay(logging.Handler):  # fxpipe's own notes at WARNING and above (its module loggers), the same way
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage().strip().splitlines()
            try:
                with open(path, "a", encoding="utf-8") as f:
                    f.write(f"{record.levelname.title()}: {text[0][:300] if text else ''}\n")
            except OSError:
                pass

    logger = logging.getLogger("fxpipe")
    logger.addHandler(_Relay(logging.WARNING))
    logger.propagate = False  # a rank's stderr is torchrun's: the relay is where the note goes


def rank_warnings(out_dir: Path) -> list[str]:
    """The ranks' warnings, each once with the ranks that raised it: ``UserWarning: ... (ranks 0, 1)``."""
    seen: dict[str, list[int]] = {}
    for path in sorted(out_dir.glob("rank*.warnings")):
        try:
            rank = int(path.name[4:].split(".")[0])
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()[:100]
        except (ValueError, OSError):
            continue
        for line in lines:
            seen.setdefault(line, [])
            if rank not in seen[line]:
                seen[line].append(rank)
    return [f"{line} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, sorted(r)))})" for line, r in seen.items()]


def finished_ranks(out_dir: Path) -> set[int]:
    """The ranks that wrote a result."""
    return {int(p.stem[4:]) for p in out_dir.glob("rank*.json")}


def rank_results(out_dir: Path) -> list[dict[str, Any]] | None:
    """Every rank's result, in rank order, as rank 0 gathered them; None on a node that does not hold rank 0."""
    path = out_dir / RESULTS
    return json.loads(path.read_text()) if path.exists() else None


def died_ranks(torchrun_stderr: str, reported: Collection[int]) -> list[DiedRank]:
    """The ranks torchrun's failure summary lists that wrote neither a result nor an error (``reported``),
    sorted by rank, those torchrun itself stopped (SIGTERM, once another rank failed) last.

    >>> died_ranks("  rank      : 1 (local_rank: 1)\\n  exitcode  : -9 (pid: 7)\\n", reported=())
    [DiedRank(rank=1, how='killed by signal 9, SIGKILL: often the out-of-memory killer', terminated=False)]

    A rank torchrun itself had to SIGKILL ("Unable to shutdown process PID via SIGTERM") was not
    killed for memory: it did not answer SIGTERM, so it was stopped (SIGSTOP) or hung.
    """
    forced = {int(pid) for pid in re.findall(r"Unable to shutdown process (\d+) via", torchrun_stderr)}
    died = []
    for rank, code, pid in re.findall(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)(?:\s*\(pid:\s*(\d+)\))?",
                                      torchrun_stderr):
        rank, code = int(rank), int(code)
        if rank in reported or code == 0:
            continue
        if code == -signal.SIGKILL and pid and int(pid) in forced:
            how = "unresponsive: it ignored torchrun's SIGTERM and was SIGKILLed, so it was stopped (SIGSTOP) or hung"
        elif code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = "unknown signal"
            how = f"killed by signal {-code}, {name}" + (": often the out-of-memory killer" if -code == 9 else "")
        else:
            how = f"exit code {code}"
        died.append((code == -signal.SIGTERM, rank, how))
    return [DiedRank(rank, how, term) for term, rank, how in sorted(set(died))]


def rendezvous_failure(torchrun_stderr: str, rendezvous: Rendezvous) -> RankFailure | None:
    """The line for a node whose torchrun gave up waiting for the other nodes (no rank ever started), or None."""
    match = _RDZV_FAILURE.search(torchrun_stderr)
    if match is None or rendezvous.standalone:
        return None
    what = f"{match.group(1)}: {match.group(2).strip()}".rstrip(": ")[:200]
    nodes = rendezvous.nnodes
    if re.search(r"EADDRINUSE|address already in use", torchrun_stderr, re.I):
        if rendezvous.endpoint is not None:
            where, fix = f"--rdzv-endpoint {rendezvous.endpoint}", "another port in --rdzv-endpoint"
        else:
            port = rendezvous.master_port or DEFAULT_MASTER_PORT
            where, fix = f"--master-port {port} on {rendezvous.master_addr}", "another --master-port"
        return RankFailure(None, f"the port of {where} is already in use by another program, so this node could "
                                 f"not open the meeting point; pass {fix} (the same on every node), or stop what "
                                 "holds it")
    if rendezvous.endpoint is not None:
        same, host = "--nnodes, --rdzv-endpoint and --rdzv-id", rendezvous.endpoint
    else:
        same = "--nnodes, --master-addr and --master-port (--node-rank 0 on the machine at --master-addr)"
        host = f"{rendezvous.master_addr}:{rendezvous.master_port or DEFAULT_MASTER_PORT}"
    return RankFailure(None, f"this node waited up to {rendezvous.timeout:g} s at {rendezvous.where()} and the "
                             f"{nodes} nodes never all met ({what}); start fxpipe run on all {nodes} nodes with the "
                             f"same {same}, check that {host} is reachable from every node, or raise --rdzv-timeout")


def stall_failure(hung: Collection[tuple[int, str]], timeout: float, grace: float) -> RankFailure:
    """The line for a run stopped because no rank moved on for ``timeout`` + ``grace`` seconds (:func:`stalled`)."""
    where = ", ".join(f"rank {rank}: {doing}" for rank, doing in hung) or "no rank had started"
    return RankFailure(min((r for r, _ in hung), default=None),
                       f"no rank made progress for {timeout + grace:g} s (--timeout {timeout:g} s, and {grace:g} more) "
                       f"({where}), so the ranks were stopped: a loop in the "
                       "plan's graphs or in --loss/--data code that does not end, or one action slower than --timeout; "
                       "check them, or raise --timeout")


def diagnose(returncode: int, torchrun_stderr: str, errors: Mapping[int, str],
             finished: Collection[int], stopped: Collection[int] = (), *,
             rendezvous: Rendezvous | None = None, local: Collection[int] = ()) -> RankFailure | None:
    """The rank to blame for a failed run, or None when every rank finished (exit code 0, no error report).

    The root cause is a rank that died without a word (a signal, ``os._exit``: torchrun's summary has
    its exit code) or failed by itself, not one that gave up waiting for it (its error says "waited
    for"), nor one torchrun stopped (SIGTERM) because another had failed. A rank whose process was
    ``stopped`` (SIGSTOP) when the run ended comes first: it is alive but cannot answer. With several
    nodes (``rendezvous``), a node whose ranks never started waited for the others in vain, and a rank
    that is not one of this node's (``local``) is said to be on another node.
    """
    failure = _diagnose(returncode, torchrun_stderr, errors, finished, stopped)
    if failure is None or rendezvous is None or rendezvous.standalone:
        return failure
    if not errors and not finished and not local:
        return rendezvous_failure(torchrun_stderr, rendezvous) or failure
    if failure.rank is not None and local and failure.rank not in local and failure.rank not in errors:
        return RankFailure(failure.rank, f"{failure.message} (rank {failure.rank} ran on another node: its "
                                         "fxpipe run says more)")
    return failure


def _diagnose(returncode: int, torchrun_stderr: str, errors: Mapping[int, str],
              finished: Collection[int], stopped: Collection[int] = ()) -> RankFailure | None:
    if returncode == 0 and not errors:
        return None
    if stopped:
        rank = min(stopped)
        waiting = len([r for r in errors if r != rank])
        return RankFailure(rank, f"rank {rank} was unresponsive: its process was stopped (SIGSTOP, a debugger or job "
                                 "control), so it could not answer its peers"
                           + (f" ({waiting} reported waiting for it)" if waiting else "")
                           + "; the ranks were stopped")
    died = died_ranks(torchrun_stderr, set(errors) | set(finished))
    closing = [d for d in died_ranks(torchrun_stderr, set(errors)) if d.rank in finished and not d.terminated]
    if closing and not died and not errors:
        first_closing = closing[0]
        return RankFailure(first_closing.rank, f"rank {first_closing.rank} exited ({first_closing.how}) after writing "
                                               "its result, while closing the process group; the results are complete",
                           after_results=True)
    first = sorted(errors.items(), key=lambda kv: ("waited for" in kv[1], kv[0]))
    alone = [kv for kv in first if "waited for" not in kv[1]]
    # A rank torchrun stopped (SIGTERM) is blamed only when no rank said anything: a report, even one that
    # waited, names the cause better (on another node, torchrun stops the ranks that were waiting for it).
    if died and (not died[0].terminated or not errors):
        return RankFailure(died[0].rank, f"rank {died[0].rank} died ({died[0].how}) without an error report; the "
                                         "other ranks stopped"
                           + (f" ({len(errors)} reported waiting for it)" if errors else ""))
    if alone:
        rank, why = alone[0]
        return RankFailure(rank, f"rank {rank} failed: {why}; the other ranks stopped"
                           + (f" ({len(errors) - 1} reported waiting for it)" if len(errors) > 1 else ""))
    if first:
        rank, why = first[0]
        named = re.search(r"\brank (\d+) ", why)
        culprit = int(named.group(1)) if named else None
        return RankFailure(culprit, f"rank {culprit if culprit is not None else '?'} failed without an error "
                                    f"report; rank {rank} reported: {why}")
    # torchrun's last words: its error line if it gave one, never a line of its summary's ===== frame.
    lines = [ln.strip() for ln in torchrun_stderr.splitlines() if ln.strip().strip("=-")]
    errors_said = [ln for ln in lines if re.search(r"(Error|Exception)\b", ln)]
    tail = (errors_said or lines or ["no output"])[-1]
    return RankFailure(None, f"the ranks exited with code {returncode} without a report ({tail[:200]}); "
                             "re-run to see the ranks' output")
