"""Wall seconds from ``fxpipe run``'s start to its first step, and to its end, for a plan as a user runs it.

The command is the user's: ``fxpipe compile MODEL --stages S --out P`` once per tree, then ``fxpipe run P --nproc N
--steps K`` ``--reps`` times. The first step is over when rank 0 writes its first progress line (the run's report
directory lies under a ``TMPDIR`` of this script's, which it polls every 20 ms); the step's own milliseconds come
from the run's ``--json``, so start-up = first step's end - its milliseconds. CPU-seconds count every process the run
started (this script is their child subreaper and reaps them all).

Several trees (``--trees OLD NEW``: git checkouts, each run with ``PYTHONPATH`` at it) are measured in turn within
each repetition, so that a machine whose load drifts moves them alike; the table gives each tree's median and min.

    python benchmarks/startup.py --reps 5
    git worktree add /tmp/before <commit> && python benchmarks/startup.py --trees /tmp/before . --reps 5
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate


def _reap() -> None:
    """Wait for the orphans reparented here (processes whose parents exited first), so that their CPU time counts."""
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(tree: Path, plan: Path, nproc: int, steps: int, env: dict[str, str]) -> dict[str, float]:
    """One ``fxpipe run``: seconds to the end of its first step and to its end, the first step's own seconds, and
    the CPU-seconds of every process it started."""
    with tempfile.TemporaryDirectory(prefix="fxpipe-startup-") as tmp:
        cmd = [sys.executable, "-m", "fxpipe.cli.main", "run", str(plan), "--nproc", str(nproc), "--steps",
               str(steps), "--json"]
        cpu = _cpu()
        start = time.monotonic()
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        with open(out, "w") as out_f, open(err, "w") as err_f:  # files, not pipes: nothing read while it runs
            proc = subprocess.Popen(cmd, cwd=tree, env={**env, "PYTHONPATH": str(tree), "TMPDIR": tmp}, stdout=out_f,
                                    stderr=err_f)
        first = None
        while proc.poll() is None:
            if first is None and any(p.read_text().strip() for p in Path(tmp).glob("fxpipe-run-*/progress")):
                first = time.monotonic() - start
            time.sleep(0.02)
        total = time.monotonic() - start
        _reap()
        stdout, stderr = out.read_text(), err.read_text()
        if proc.returncode:
            raise SystemExit(f"fxpipe run in {tree} failed ({proc.returncode}):\n{stderr[-3000:]}")
        doc = json.loads(stdout)
        step_s = doc["step_ms"][0] / 1e3
        first = total if first is None else first
        return {"first": first, "step": step_s, "startup": first - step_s, "total": total, "cpu": _cpu() - cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", type=Path, default=[Path(__file__).resolve().parents[1]],
                        help="checkouts of fxpipe to measure, in turn (default: this one)")
    parser.add_argument("--model", default="gpt-base")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="also write every measurement here")
    args = parser.parse_args()
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    trees = [t.resolve() for t in args.trees]
    runs: dict[Path, list[dict[str, float]]] = {t: [] for t in trees}
    with tempfile.TemporaryDirectory(prefix="fxpipe-startup-plans-") as plans:
        plan_of = {}
        for k, tree in enumerate(trees):
            plan_of[tree] = Path(plans) / f"plan{k}"
            start = time.monotonic()
            subprocess.run([sys.executable, "-m", "fxpipe.cli.main", "compile", args.model, "--stages",
                            str(args.stages), "--out", str(plan_of[tree])], cwd=tree,
                           env={**env, "PYTHONPATH": str(tree)}, check=True, stdout=subprocess.DEVNULL)
            print(f"{tree}: compiled {args.model} into {args.stages} stages in {time.monotonic() - start:.1f} s",
                  file=sys.stderr)
        for rep in range(args.reps):
            for tree in trees:
                runs[tree].append(run_once(tree, plan_of[tree], args.nproc, args.steps, env))
                got = runs[tree][-1]
                print(f"rep {rep + 1} {tree}: first step at {got['first']:.2f} s (start-up {got['startup']:.2f} s), "
                      f"end at {got['total']:.2f} s, {got['cpu']:.1f} CPU-s", file=sys.stderr)
    rows = []
    for tree, got in runs.items():
        def both(key: str, got: list[dict[str, float]] = got) -> str:
            values = [g[key] for g in got]
            return f"{statistics.median(values):.2f} ({min(values):.2f})"
        rows.append((str(tree), both("startup"), both("first"), both("total"), both("cpu")))
    print(f"fxpipe run <{args.model}, {args.stages} stages> --nproc {args.nproc} --steps {args.steps}: median (min) of "
          f"{args.reps}")
    print(tabulate(rows, headers=("tree", "start-up s", "first step s", "total s", "CPU-s"), tablefmt="github"))
    if args.json is not None:
        args.json.write_text(json.dumps({str(t): g for t, g in runs.items()}, indent=1))


if __name__ == "__main__":
    main()
