"""CPU-seconds to start and run ``fxpipe run``'s ranks: torchrun (a fresh Python per rank) against fxpipe's agent
(ranks forked from one server that imported torch, AOTAutograd and the rank program once).

Both start the same rank program with the same arguments (``fxpipe.cli.ranks.torchrun_command``; the baseline
swaps the agent for ``torch.distributed.run``). This process is the child subreaper of everything they start, and
waits for every process, so ``RUSAGE_CHILDREN`` counts them all: the agent or torchrun, the fork server, each rank.
Runs alternate between the two launchers; the table gives the median of ``--reps``.

    python benchmarks/launch_cost.py [--models mlp-tiny gpt-tiny] [--ranks 2 4] [--reps 3]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

from fxpipe.cli.ranks import torchrun_command


def _cpu_of(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """CPU-seconds of ``cmd`` and every process it started (all reaped here), and its wall seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.monotonic() - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} failed:\n{proc.stderr[-2000:]}")
    while True:  # orphans (the fork server) were reparented here: reap them so that their time counts
        try:
            os.wait()
        except ChildProcessError:
            break
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp-tiny", "gpt-tiny"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FXPIPE_CALIBRATION": "off", "PYTHONSAFEPATH": "1"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="fxpipe-launch-") as tmp:
        for model in args.models:
            for n in args.ranks:
                plan = Path(tmp) / f"{model}-{n}"
                subprocess.run([sys.executable, "-m", "fxpipe.cli.main", "compile", model, "--stages", str(n),
                                "--out", str(plan)], env=env, check=True, stdout=subprocess.DEVNULL)
                times: dict[str, list[tuple[float, float]]] = {"torchrun": [], "agent": []}
                for rep in range(args.reps):
                    for how in ("torchrun", "agent"):
                        out = Path(tmp) / f"out-{model}-{n}-{how}-{rep}"
                        out.mkdir()
                        cmd = torchrun_command([plan, "--out", out, "--steps", args.steps, "--timeout", 120.0], n)
                        if how == "torchrun":
                            cmd[cmd.index("fxpipe.cli.agent")] = "torch.distributed.run"
                        times[how].append(_cpu_of(cmd, {**env, "TMPDIR": str(out)}))
                cpu = {h: statistics.median(c for c, _ in t) for h, t in times.items()}
                wall = {h: statistics.median(w for _, w in t) for h, t in times.items()}
                rows.append((model, n, f"{cpu['torchrun']:.1f}", f"{cpu['agent']:.1f}",
                             f"{cpu['agent'] / cpu['torchrun']:.2f}", f"{wall['torchrun']:.1f}", f"{wall['agent']:.1f}"))
    print(tabulate(rows, headers=("model", "ranks", "torchrun CPU-s", "agent CPU-s", "agent / torchrun",
                                  "torchrun wall s", "agent wall s"), tablefmt="github"))


if __name__ == "__main__":
    main()
