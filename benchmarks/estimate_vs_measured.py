"""Estimated costs against the machine: every zoo family at its tiny, small and benchmark sizes, compiled at 2 stages
without --profile (fixed device model, and this machine's calibrated compute), run on 2 ranks by ``fxpipe run``;
the simulated step against the measured one.

    python benchmarks/estimate_vs_measured.py                       # every case, both ways
    python benchmarks/estimate_vs_measured.py --models gpt-tiny --calibration on --steps 6
    python benchmarks/estimate_vs_measured.py --calibration on --repeat 3   # each plan run 3 times: the median run
    python benchmarks/estimate_vs_measured.py --calibration on --repeat 3 --fresh-calibration  # calibrated per case

Each case: ``fxpipe compile MODEL --stages 2 --out DIR --json`` with ``FXPIPE_CALIBRATION`` off or on, then
``fxpipe run DIR --steps N --json`` (2 ranks, gloo, 1 thread each). ``simulated_step_ms`` is the run's own: the
plan's F, B and W times scheduled with the link and contention ``fxpipe run`` measures on the ranks; ``measured``
is ``step_ms_median`` (every step but the first, which faults in the buffers). The ratio is simulated / measured;
the issue's goal is every case within 25% without --profile. Results are appended per case to
``benchmarks/results/estimate_vs_measured/results.json`` (the load average before and after each run is kept: the
machine is shared), and the table is printed from every case there.

``--fresh-calibration`` calibrates anew for each case (its own ``XDG_CACHE_HOME``, so compile measures the compute
rates and the runtime's costs, and the run reads those): this machine's speed drifts by tens of percent over
minutes (five calibrations in a row: typical GEMM 128-167 GFLOP/s, per-op host time 14.5-20.0 us), so one cached
calibration taken in a fast or slow minute moves every case's ratio together. Without it, the user's cache is used
as a user's compile would use it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "estimate_vs_measured"
MODELS = ("mlp-tiny", "mlp-small", "mlp-deep", "vgg-tiny", "vgg-small", "vgg-16", "resnet-tiny", "resnet-small",
          "resnet-50", "gpt-tiny", "gpt-small", "gpt-base")
# Steps for the benchmark sizes (the rest: --steps). A run's first few steps are slower than its steady state (5 ms
# steps of mlp-tiny took 17, 8, 7, 6, 12, 10, 16, 5, 5, 4, 4 ms), so the tiny and small sizes take 40 by default.
BIG = {"vgg-16": 3, "resnet-50": 4, "gpt-base": 10, "mlp-deep": 20}
GOAL = 0.25


def fxpipe(args: list[str], env: dict[str, str], timeout: float) -> dict[str, object]:
    cmd = [sys.executable, "-m", "fxpipe.cli.main", *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_case(model: str, calibration: str, steps: int, timeout: float, repeat: int = 1,
             fresh: bool = False) -> dict[str, object]:
    env = {**os.environ, "FXPIPE_CALIBRATION": calibration}
    with tempfile.TemporaryDirectory() as tmp:
        if fresh:  # compile calibrates now, into a cache of its own, and the run reads the same one
            env["XDG_CACHE_HOME"] = str(Path(tmp) / "cache")
        plan_dir = Path(tmp) / "plan"
        t0 = time.perf_counter()
        compiled = fxpipe(["compile", model, "--stages", "2", "--out", str(plan_dir), "--json"], env, timeout)
        compile_s = time.perf_counter() - t0
        plan = json.loads((plan_dir / "plan.json").read_text())["plan"]
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        runs = [fxpipe(["run", str(plan_dir), "--steps", str(steps), "--json"], env, timeout) for _ in range(repeat)]
        run_s = time.perf_counter() - t0
    # With --repeat, the same plan run again: each run calibrates the link anew and the machine's speed moves by
    # tens of percent between runs here, so the case's ratio is the median of the runs' ratios, with their range.
    by_ratio = sorted((float(r["simulated_step_ms"]) / float(r["step_ms_median"]), k)  # type: ignore[arg-type]
                      for k, r in enumerate(runs))
    ratios = [ratio for ratio, _ in by_ratio]
    ran = runs[by_ratio[len(runs) // 2][1]]
    simulated, measured = float(ran["simulated_step_ms"]), float(ran["step_ms_median"])  # type: ignore[arg-type]
    return {
        "model": model, "calibration": calibration, "steps": steps,
        "compile": f"FXPIPE_CALIBRATION={calibration} fxpipe compile {model} --stages 2 --out DIR --json"
                   + (" (calibrated for this case)" if fresh else ""),
        "fresh_calibration": fresh,
        "run": f"fxpipe run DIR --steps {steps} --json" + (f" ({repeat} runs)" if repeat > 1 else ""),
        "ratios": [round(r, 3) for r in ratios],
        "calibration_line": compiled.get("calibration"),
        "compute": plan["options"].get("compute"),
        "stages_fbw_ms": [[round(s["f"] * 1e3, 4), round(s["b"] * 1e3, 4), round(s["w"] * 1e3, 4)] for s in plan["stages"]],
        "bounds": [s["first_layer"] for s in plan["stages"]] + [plan["stages"][-1]["end_layer"]],
        "microbatches": ran["microbatches"], "schedule": ran["schedule"],
        "simulated_step_ms": round(simulated, 3), "measured_step_ms": round(measured, 3),
        "step_ms": [round(float(x), 3) for x in ran["step_ms"]],  # type: ignore[union-attr]
        # each stage's action kinds, measured (the run's median per action) against the plan's simulated time: where a
        # case's miss lies, in the compute estimate or in the schedule's waits
        "actions": ran.get("actions"),
        "run_calibration": ran.get("calibration"),  # the link and contentions the run's simulation charged
        "ratio": round(simulated / measured, 3), "within_goal": abs(simulated / measured - 1) <= GOAL,  # the median run
        "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
        "compile_s": round(compile_s, 1), "run_s": round(run_s, 1),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def table(cases: list[dict[str, object]]) -> str:
    lines = ["| model | calibration | schedule, m | simulated ms | measured ms (median) | sim / measured | within 25% | load "
             "| fastest step ms | sim / fastest | measured at | every run's sim / measured |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in cases:
        steps = [float(x) for x in c["step_ms"]][1:] or [float(c["measured_step_ms"])]  # type: ignore[union-attr]
        lines.append(f"| {c['model']} | {c['calibration']} | {c['schedule']}, {c['microbatches']} | "
                     f"{c['simulated_step_ms']:.2f} | {c['measured_step_ms']:.2f} | {c['ratio']:.3f} | "
                     f"{'yes' if c['within_goal'] else 'no'} | {c['load_before']}-{c['load_after']} | "
                     f"{min(steps):.2f} | {float(c['simulated_step_ms']) / min(steps):.3f} | {c['when']} | "
                     f"{', '.join(f'{r:.3f}' for r in c.get('ratios', [c['ratio']]))} |")  # type: ignore[attr-defined]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--calibration", choices=("off", "on", "both"), default="both")
    parser.add_argument("--steps", type=int, default=40, help="steps for the tiny and small sizes")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each compiled plan; the median run's ratio counts")
    parser.add_argument("--fresh-calibration", action="store_true",
                        help="calibrate anew for each case (its own cache) instead of using the user's cached one")
    parser.add_argument("--out", type=Path, default=OUT / "results.json")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cases: list[dict[str, object]] = json.loads(args.out.read_text()) if args.out.exists() else []
    modes = ("off", "on") if args.calibration == "both" else (args.calibration,)
    for model in args.models:
        for mode in modes:
            try:
                case = run_case(model, mode, BIG.get(model, args.steps), args.timeout, args.repeat,
                                args.fresh_calibration)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(f"{model} {mode}: failed: {exc}", flush=True)
                continue
            cases = [c for c in cases if (c["model"], c["calibration"]) != (model, mode)] + [case]
            args.out.write_text(json.dumps(cases, indent=1))
            print(f"{model:13s} {mode:3s} simulated {case['simulated_step_ms']:9.2f} ms measured "
                  f"{case['measured_step_ms']:9.2f} ms ratio {case['ratio']:.3f} (runs {case['ratios']}) "
                  f"load {case['load_before']}", flush=True)
    order = {m: i for i, m in enumerate(MODELS)}
    cases.sort(key=lambda c: (order.get(str(c["model"]), 99), str(c["calibration"])))
    text = table(cases)
    (args.out.parent / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
