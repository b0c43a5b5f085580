"""``--plan auto`` against the machine: mlp-deep and gpt-base planned for 2 and 4 devices, run by ``fxpipe run``;
the planner's simulated step and the run's against the measured one (issue 15: within 15%).

    python benchmarks/plan_auto_vs_measured.py                 # every case
    python benchmarks/plan_auto_vs_measured.py --models gpt-base --devices 4

Each case: ``fxpipe compile MODEL --plan auto --devices N --out DIR --json`` (calibrated compute, no --profile),
then ``fxpipe run DIR --steps S --json`` on the plan's stages x replicas ranks (gloo, 1 thread each). "planner" is
the chosen candidate's simulated step in the compile's table (``--cores auto`` by default: the plan's ranks share
this machine's cores, as they do in the run; ``--cores none`` plans as if each rank had a core of its own); "run" is the run's ``simulated_step_ms`` (the plan's
costs with the runtime's calibrated fixed costs, the link and contention measured on the ranks, the dp all-reduce,
the optimizer step, and ``Costs.cores`` when ranks outnumber cores); measured is ``step_ms_median``. Results are
appended per case to ``benchmarks/results/plan_auto_vs_measured/results.json`` with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from estimate_vs_measured import fxpipe  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "plan_auto_vs_measured"
STEPS = {"mlp-deep": 20, "gpt-base": 10}  # a run's first steps are slower than its steady state
GOAL = 0.15


def run_case(model: str, devices: int, steps: int, timeout: float, cores: str | None) -> dict[str, object]:
    env = {**os.environ, "FXPIPE_CALIBRATION": "on"}
    with tempfile.TemporaryDirectory() as tmp:
        plan_dir = Path(tmp) / "plan"
        shared = ["--cores", cores] if cores else []
        compiled = fxpipe(["compile", model, "--plan", "auto", "--devices", str(devices), *shared, "--out",
                           str(plan_dir), "--json"], env, timeout)
        reports = compiled["reports"]
        table = next(r for r in reports if str(r["title"]).startswith("plan auto: candidates"))  # type: ignore[index]
        cols = table["columns"]
        chosen = next(row for row in table["rows"] if row[-1] == "chosen")
        planner = float(chosen[cols.index("simulated step ms")])
        schedule = chosen[cols.index("schedule")]
        # Once split-backward knows each stage's batched-W fraction, the chosen plan may be batched-w instead
        # (api.batch_plan_ws): its own table then has the recorded schedule and its simulated step.
        batched = next((r for r in reports if str(r["title"]).startswith("plan auto: batched W")), None)  # type: ignore[union-attr]
        if batched is not None:
            row = next(row for row in batched["rows"] if row[-1] == "chosen")
            schedule, planner = row[0], float(row[2])
        load_before = os.getloadavg()[0]
        ran = fxpipe(["run", str(plan_dir), "--steps", str(steps), "--json"], env, timeout)
    simulated, measured = float(ran["simulated_step_ms"]), float(ran["step_ms_median"])  # type: ignore[arg-type]
    return {
        "model": model, "devices": devices, "steps": steps,
        "compile": f"FXPIPE_CALIBRATION=on fxpipe compile {model} --plan auto --devices {devices} "
                   + (f"--cores {cores} " if cores else "") + "--out DIR --json",
        "cores": cores,
        "run": f"fxpipe run DIR --steps {steps} --json", "calibration_line": compiled.get("calibration"),
        "stages": chosen[cols.index("stages")], "dp": chosen[cols.index("dp")],
        "schedule": schedule, "microbatches": chosen[cols.index("microbatches")],
        "ranks": ran["ranks"], "planner_step_ms": planner, "simulated_step_ms": round(simulated, 3),
        "measured_step_ms": round(measured, 3), "step_ms": [round(float(x), 3) for x in ran["step_ms"]],  # type: ignore[union-attr]
        "ratio": round(simulated / measured, 3), "planner_ratio": round(planner / measured, 3),
        "within_goal": abs(simulated / measured - 1) <= GOAL,
        "run_calibration": ran.get("calibration"),  # the link and contentions the run's simulation charged
        "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(STEPS))
    parser.add_argument("--devices", nargs="*", type=int, default=[2, 4])
    parser.add_argument("--cores", default="auto",
                        help="compile --cores: the runs share this machine's cores (auto); 'none' plans without it")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=OUT / "results.json")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cases: list[dict[str, object]] = json.loads(args.out.read_text()) if args.out.exists() else []
    for model in args.models:
        for devices in args.devices:
            case = run_case(model, devices, STEPS.get(model, 6), args.timeout,
                            None if args.cores == "none" else args.cores)
            cases = [c for c in cases if (c["model"], c["devices"]) != (model, devices)] + [case]
            args.out.write_text(json.dumps(cases, indent=1))
            print(json.dumps(case), flush=True)
    lines = ["| model | devices | plan (stages x dp, schedule, m) | planner ms | run's simulated ms | measured ms | "
             "run sim / measured | within 15% | load |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in sorted(cases, key=lambda c: (str(c["model"]), int(c["devices"]))):  # type: ignore[call-overload]
        lines.append(f"| {c['model']} | {c['devices']} | {c['stages']} x {c['dp']}, {c['schedule']}, {c['microbatches']} "
                     f"| {c['planner_step_ms']:.1f} | {c['simulated_step_ms']:.1f} | {c['measured_step_ms']:.1f} | "
                     f"{c['ratio']:.3f} | {'yes' if c['within_goal'] else 'no'} | {c['load_before']}-{c['load_after']} |")
    (args.out.parent / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
