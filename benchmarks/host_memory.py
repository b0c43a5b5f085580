"""Whole steps with freed memory kept in the rank processes (``fxpipe.calibration.host_memory``) and with glibc's defaults.

    python benchmarks/host_memory.py --models resnet-50 resnet-small mlp-deep gpt-base --rounds 3 --out F.json

Each model is compiled once (2 stages, the fixed cost model: the plan is the same for both settings), then
``fxpipe run PLAN --steps N --json`` runs with ``--no-keep-freed-memory`` and ``--keep-freed-memory`` in turn, the order
alternating each round. Per run: the median step (the run's ``step_ms_median``) and the page faults of the run's
processes (``RUSAGE_CHILDREN`` around it: the launcher and its ranks, start-up included). A second run with more
steps gives the faults per step (the difference over the extra steps). The ratio is kept / default.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

FXPIPE = [str(Path(sys.executable).with_name("fxpipe"))]  # the console script beside this interpreter
STEPS = {"resnet-50": 4, "vgg-16": 3, "gpt-base": 8, "mlp-deep": 12}


def _run(plan: Path, steps: int, keep: str) -> tuple[float, int]:
    flag = "--keep-freed-memory" if keep == "1" else "--no-keep-freed-memory"
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
    out = subprocess.run([*FXPIPE, "run", str(plan), "--steps", str(steps), "--json", flag], capture_output=True,
                         text=True, check=True)
    faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before
    return float(json.loads(out.stdout)["step_ms_median"]), faults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet-50", "resnet-small", "mlp-deep", "gpt-base"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            plan = Path(tmp) / model
            subprocess.run([*FXPIPE, "compile", model, "--stages", "2", "--out", str(plan)], check=True,
                           capture_output=True, env={**os.environ, "FXPIPE_CALIBRATION": "off"})
            steps = STEPS.get(model, 20)
            runs: dict[str, list[tuple[float, int]]] = {"0": [], "1": []}
            for r in range(args.rounds):
                for keep in (("0", "1") if r % 2 == 0 else ("1", "0")):
                    runs[keep].append(_run(plan, steps, keep))
            per_step = {keep: (_run(plan, 2 * steps, keep)[1] - statistics.median(f for _, f in runs[keep])) / steps
                        for keep in ("0", "1")}
            row = {"model": model, "steps": steps,
                   "step_ms": {k: [round(ms, 2) for ms, _ in v] for k, v in runs.items()},
                   "faults_per_run": {k: [f for _, f in v] for k, v in runs.items()},
                   "faults_per_step": {k: round(v) for k, v in per_step.items()}}
            row["ratio"] = round(statistics.median(ms for ms, _ in runs["1"]) /
                                 statistics.median(ms for ms, _ in runs["0"]), 3)
            rows.append(row)
            print(f"{model:13s} default {row['step_ms']['0']} ms, kept {row['step_ms']['1']} ms: ratio {row['ratio']}; "
                  f"faults per step {row['faults_per_step']['0']} -> {row['faults_per_step']['1']}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
