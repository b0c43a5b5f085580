"""Simulated speedup S(P) and efficiency S(P)/P of every stage count P = 1..8, at 4P microbatches, and the count
``--stages auto`` picks under each objective (estimated costs, the plan's default link).

    python benchmarks/stage_count.py [--out benchmarks/results/stage_count/stage_count.json]

For each model the partition at P is the exact minimiser of the pipeline step model (fxpipe.planning.stage_count),
its step simulated under 1F1B; S(P) = m x one device's microbatch (F+B+W) / simulated step, with m = 4P.
vgg-16 and gpt-base are built on meta tensors (no weights allocated), mlp-deep on CPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from fxpipe.api import PassControl, run_compile
from fxpipe.plan import DEFAULTS, CompileOptions
from fxpipe.targets import resolve

MODELS = (("gpt-base", "meta"), ("vgg-16", "meta"), ("mlp-deep", "cpu"))
OBJECTIVES = ("fastest", "efficiency:0.7", "speedup:3")


def table(name: str, device: str, objective: str) -> dict[str, object]:
    target = resolve(name, device=device, dtype=torch.float32)
    started = time.perf_counter()
    compiled = run_compile(target.model, target.example_inputs, CompileOptions(stage_objective=objective, max_stages=8),
                           example_kwargs=target.example_kwargs, model_name=name,
                           control=PassControl(stop_after="partition-stages"))
    seconds = time.perf_counter() - started
    report = next(r for r in compiled.reports if r.title.startswith("partition-stages: stage count"))
    rows = [dict(zip(report.columns, row)) for row in report.rows]
    chosen = next(r["stages"] for r in rows if r[""] == "chosen")
    return {"model": name, "device": device, "objective": objective, "chosen": chosen, "compile_s": round(seconds, 2),
            "rows": [{"stages": r["stages"], "cuts": r["cuts"], "microbatches": r["microbatches"],
                      "simulated_step_ms": r["simulated step ms"], "model_step_ms": r["model step ms"],
                      "speedup": r["speedup"], "efficiency": r["efficiency"]} for r in rows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    DEFAULTS.microbatches_per_stage = 4  # the 4P microbatches at every count
    results = [table(name, device, objective) for name, device in MODELS for objective in OBJECTIVES]
    for res in results:
        if res["objective"] != "fastest":
            continue
        print(f"\n{res['model']} ({res['device']}): chosen P = {res['chosen']} (fastest)")
        print("| P | cuts | S(P) | S(P)/P | simulated step ms | model step ms |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in res["rows"]:
            mark = " **chosen**" if r["stages"] == res["chosen"] else ""
            print(f"| {r['stages']}{mark} | {r['cuts']} | {r['speedup']:.2f} | {r['efficiency']:.2f} | "
                  f"{r['simulated_step_ms']:.1f} | {r['model_step_ms']:.1f} |")
    print("\npicks: " + "; ".join(f"{r['model']} {r['objective']} -> {r['chosen']}" for r in results))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"microbatches_per_stage": 4, "schedule": "1f1b", "results": results},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
