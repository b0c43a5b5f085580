"""``fxpipe run``'s ranks from the outside: start them under torchrun, follow their steps, name the rank that failed.

The ranks run ``python -m fxpipe.cli.rank`` and leave their reports in one directory: ``rank{R}.json``
(a result), ``rank{R}.error`` (one line saying why it stopped) and ``progress`` (rank 0's finished
steps). A rank that died by a signal leaves neither report; torchrun's failure summary has its exit
code. :func:`diagnose` turns all of that into the one line that names the rank to look at.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RANK_MODULE = "fxpipe.cli.rank"  # the program every rank runs
_STEP_LINE = re.compile(r"^step (\d+) loss (\S+) ms (\S+)$")


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
class RankFailure:
    """Why a run failed: the rank to look at (None when no report names one) and the line that says so."""

    rank: int | None
    message: str


def torchrun_command(plan_dir: Path, out_dir: Path, nproc: int, *, steps: int, lr: float, timeout: float,
                     schedule: str | None = None, microbatches: int | None = None,
                     checkpoint_dir: Path | None = None, resume: bool = False, fail_rank: int = -1,
                     kill_rank: int = -1) -> list[str]:
    """The command line that starts ``nproc`` ranks of :data:`RANK_MODULE` on this machine, reporting to ``out_dir``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", RANK_MODULE, str(plan_dir), "--out", str(out_dir), "--steps", str(steps),
           "--lr", str(lr), "--timeout", str(timeout), "--fail-rank", str(fail_rank),
           "--kill-rank", str(kill_rank)]
    for flag, value in (("--schedule", schedule), ("--microbatches", microbatches),
                        ("--checkpoint-dir", checkpoint_dir)):
        if value is not None:
            cmd += [flag, str(value)]
    if resume:
        cmd.append("--resume")
    return cmd


def parse_step(line: str) -> StepDone | None:
    """A progress line ``step K loss L ms T`` (as ``fxpipe.cli.rank`` writes it), or None for any other line."""
    match = _STEP_LINE.match(line.strip())
    if match is None:
        return None
    try:
        return StepDone(int(match.group(1)), float(match.group(2)), float(match.group(3)))
    except ValueError:
        return None


def run_ranks(cmd: list[str], progress: Path, on_step: Callable[[StepDone], None]) -> subprocess.CompletedProcess[str]:
    """Run torchrun to the end, calling ``on_step`` for each step rank 0 finishes (a line in ``progress``).

    The ranks run with one thread each (``OMP_NUM_THREADS=1``); torchrun's stdout and stderr come back
    in the result (its failure summary is in stderr).
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as errf:
        proc = subprocess.Popen(cmd, stdout=out, stderr=errf, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        shown = 0
        done = threading.Event()
        while not done.wait(0.2):
            if proc.poll() is not None:
                done.set()
            lines = progress.read_text().splitlines() if progress.exists() else []
            for line in lines[shown:]:
                step = parse_step(line)
                if step is not None:
                    on_step(step)
            shown = len(lines)
        out.seek(0)
        errf.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), errf.read())


def rank_errors(out_dir: Path) -> dict[int, str]:
    """Each rank's one-line error report, by rank (an empty file, from a rank stopped while writing it, is left out)."""
    errors = {int(p.stem[4:]): p.read_text().strip() for p in out_dir.glob("rank*.error")}
    return {rank: why for rank, why in errors.items() if why}


def finished_ranks(out_dir: Path) -> set[int]:
    """The ranks that wrote a result."""
    return {int(p.stem[4:]) for p in out_dir.glob("rank*.json")}


def rank_results(out_dir: Path, nproc: int) -> list[dict[str, Any]]:
    """Every rank's result, in rank order."""
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def died_ranks(torchrun_stderr: str, reported: Collection[int]) -> list[DiedRank]:
    """The ranks torchrun's failure summary lists that wrote neither a result nor an error (``reported``),
    sorted by rank, those torchrun itself stopped (SIGTERM, once another rank failed) last.

    >>> died_ranks("  rank      : 1 (local_rank: 1)\\n  exitcode  : -9 (pid: 7)\\n", reported=())
    [DiedRank(rank=1, how='killed by signal 9, SIGKILL: often the out-of-memory killer', terminated=False)]
    """
    died = []
    for rank, code in re.findall(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", torchrun_stderr):
        rank, code = int(rank), int(code)
        if rank in reported or code == 0:
            continue
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = "unknown signal"
            how = f"killed by signal {-code}, {name}" + (": often the out-of-memory killer" if -code == 9 else "")
        else:
            how = f"exit code {code}"
        died.append((code == -signal.SIGTERM, rank, how))
    return [DiedRank(rank, how, term) for term, rank, how in sorted(set(died))]


def diagnose(returncode: int, torchrun_stderr: str, errors: Mapping[int, str],
             finished: Collection[int]) -> RankFailure | None:
    """The rank to blame for a failed run, or None when every rank finished (exit code 0, no error report).

    The root cause is a rank that died without a word (a signal, ``os._exit``: torchrun's summary has
    its exit code) or failed by itself, not one that gave up waiting for it (its error says "waited
    for"), nor one torchrun stopped (SIGTERM) because another had failed.
    """
    if returncode == 0 and not errors:
        return None
    died = died_ranks(torchrun_stderr, set(errors) | set(finished))
    first = sorted(errors.items(), key=lambda kv: ("waited for" in kv[1], kv[0]))
    alone = [kv for kv in first if "waited for" not in kv[1]]
    if died and (not died[0].terminated or not alone):
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
    tail = (torchrun_stderr.strip().splitlines() or ["no output"])[-1]
    return RankFailure(None, f"the ranks exited with code {returncode} without a report ({tail[:200]}); "
                             "re-run to see the ranks' output")
