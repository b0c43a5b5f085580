"""Each local rank on a CPU of its own (``fxpipe run --pin-ranks``, fxpipe.calibration.threads.pin_local_rank) against ranks the
system places: ``fxpipe run`` of each model on 2 ranks, unpinned and pinned in turn (A B A B ..., starting with each
in turn, so the machine's drift hits both alike), side by side in one run.

    python benchmarks/pin_ranks.py [--models mlp-tiny gpt-tiny gpt-small mlp-deep gpt-base] [--pairs 3]
                                   [--out benchmarks/results/pin_ranks/FILE.json]

Each model is compiled once (``fxpipe compile MODEL --stages 2``, calibration as the user's cache has it) and run
``--pairs`` times each way (``fxpipe run DIR --steps N --json``). Per run: the median step (every step but the first)
and the fastest; per model: pinned / unpinned of the median of the runs' median steps, and each way's median step
over its fastest (how widely its steps spread), and the run's simulated step over its measured one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = {"mlp-tiny": 40, "gpt-tiny": 40, "gpt-small": 40, "mlp-small": 40, "mlp-deep": 20, "gpt-base": 10}


def fxpipe(args: list[str], env: dict[str, str]) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-m", "fxpipe.cli.main", *args], env=env, capture_output=True, text=True,
                          timeout=900, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp-tiny", "gpt-tiny", "gpt-small", "mlp-deep", "gpt-base"],
                        choices=list(STEPS))
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for model in args.models:
        runs: dict[str, list[dict[str, float]]] = {"0": [], "1": []}
        with tempfile.TemporaryDirectory() as tmp:
            plan = str(Path(tmp) / "plan")
            fxpipe(["compile", model, "--stages", "2", "--out", plan, "--json"], dict(os.environ))
            for pair in range(args.pairs):
                for pin in ("0", "1") if pair % 2 == 0 else ("1", "0"):
                    doc = fxpipe(["run", plan, "--steps", str(STEPS[model]), "--json",
                                  "--pin-ranks" if pin == "1" else "--no-pin-ranks"], dict(os.environ))
                    steps = doc["step_ms"][1:]
                    runs[pin].append({"median_ms": doc["step_ms_median"], "fastest_ms": min(steps),
                                      "simulated_ms": doc["simulated_step_ms"], "cpus": doc["cpus_per_rank"]})
        off, on = (statistics.median(r["median_ms"] for r in runs[k]) for k in ("0", "1"))
        row = {"model": model, "steps": STEPS[model], "runs": runs, "unpinned_ms": off, "pinned_ms": on,
               "pinned_over_unpinned": on / off,
               "spread": {k: statistics.median(r["median_ms"] / r["fastest_ms"] for r in runs[k]) for k in runs},
               "sim_over_measured": {k: statistics.median(r["simulated_ms"] / r["median_ms"] for r in runs[k])
                                     for k in runs},
               "when": time.strftime("%Y-%m-%d %H:%M:%S")}
        rows.append(row)
        print(f"{model:10s} unpinned {off:9.2f} ms | pinned {on:9.2f} ms | pinned / unpinned {on / off:.3f} | "
              f"median / fastest step {row['spread']['0']:.2f} -> {row['spread']['1']:.2f} | sim / measured "
              f"{row['sim_over_measured']['0']:.3f} -> {row['sim_over_measured']['1']:.3f} | runs "
              f"{[round(r['median_ms'], 2) for r in runs['0']]} -> {[round(r['median_ms'], 2) for r in runs['1']]}",
              flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
