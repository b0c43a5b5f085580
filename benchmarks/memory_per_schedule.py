"""Peak memory per stage under every schedule: simulated (the plan's F->B and B->W bytes) vs measured in the runtime (issue 15).

Each model is compiled (default dtype, the zoo's example batch as one microbatch) into 2 and 4
stages; every schedule the runtime runs is generated for it with ``--microbatches`` microbatches
and run by the reference executor (every stage in this process, in the schedule's order: a stage's
actions run in its rank's order under ``fxpipe run`` too, so it holds the same) with the executor
core's ``HeldBytes`` on. Per stage:

- measured: the peak bytes kept between actions for a microbatch's later ones (F's saved tensors
  until B, what W reads until W), each storage once, parameters not counted;
- simulated: the same peak as the schedule's simulation holds the plan's ``held_fb`` / ``held_bw``
  (``fxpipe.planning.cost.held_peaks``, the simulator's accounting per stage); under ``stash`` also
  one copy of the stage's parameters per distinct weight version its microbatches in flight read,
  under ``predict`` one while a phase that predicts runs (``fxpipe.schedules.versions.held_peaks_with_versions``);
- closed form: ``fxpipe.planning.cost.activation_memory`` (what the partitioner uses).

async-1f1b runs on the models without tied weights (mlp-deep), with ``stale`` weights (what the
model counts), ``stash`` (which also keeps the snapshot each microbatch's F read until its W) and
``predict`` (a prediction only while the phase that reads it runs), with momentum SGD.

    python benchmarks/memory_per_schedule.py [--models gpt-small mlp-deep] [--stages 2 4] [--microbatches 8]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

import fxpipe
from fxpipe import models
from fxpipe.errors import FxpipeError
from fxpipe.planning.cost import activation_memory, held_peaks
from fxpipe.schedules.versions import held_peaks_with_versions
from fxpipe.runtime.reference import ReferenceExecutor
from fxpipe.schedules.auto import plan_schedule
from fxpipe.schedules.simulate import Costs

SYNCHRONOUS = ("gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "layerpipe")
MIB = 2.0**20


def microbatches(zoo: Any, m: int) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """m microbatches as the runtime makes them: row views of one batch (the zoo's example repeated)."""
    batch = [torch.cat([x] * m) + 0 for x in zoo.example_inputs]
    parts = [x.tensor_split(m) for x in batch]
    targets = torch.cat([zoo.example_target] * m).tensor_split(m)
    return [(tuple(p[i] for p in parts), targets[i]) for i in range(m)]


def run_one(pipe: Any, zoo: Any, name: str, m: int, weights: str | None) -> dict[str, Any]:
    costs = Costs.from_plan(pipe.plan)
    sched = plan_schedule(pipe.plan, name, m)
    ex = ReferenceExecutor(pipe, zoo.loss_fn, track_memory=True)
    t0 = time.perf_counter()
    if weights is None:
        ex.run_schedule(sched, microbatches(zoo, m))
    else:
        ex.run_async(sched, microbatches(zoo, m), lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
                     weights=weights)  # momentum: predict extrapolates along it
    seconds = time.perf_counter() - t0
    if weights is not None:  # besides the activations, the copies of the weights the policy keeps
        simulated = held_peaks_with_versions(sched, weights, costs.held_fb, costs.held_bw, costs.grad_bytes)
    else:
        simulated = held_peaks(((a.stage, a.kind.value) for acts in sched.ranks for a in acts), costs.held_fb,
                               costs.held_bw)
    try:
        closed: list[float | None] = list(activation_memory(name, m, costs.held_fb, costs.held_bw))
    except FxpipeError:
        closed = [None] * len(simulated)
    return {"schedule": name + (f" ({weights})" if weights else ""), "ranks": sched.num_ranks, "seconds": seconds,
            "measured": list(ex.peak_held_bytes), "simulated": [float(x) for x in simulated], "closed_form": closed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt-small", "mlp-deep"])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/memory_per_schedule"))
    args = parser.parse_args()
    torch.manual_seed(0)
    start = time.perf_counter()
    runs: list[dict[str, Any]] = []
    rows = []
    for model_name in args.models:
        for p in args.stages:
            zoo = models.build(model_name)
            pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=p)
            names: list[tuple[str, str | None]] = [(n, None) for n in SYNCHRONOUS]
            if not pipe.shared_params:
                names += [("async-1f1b", "stale"), ("async-1f1b", "stash"), ("async-1f1b", "predict")]
            for name, weights in names:
                r = run_one(pipe, zoo, name, args.microbatches, weights)
                r.update(model=model_name, stages=p, microbatches=args.microbatches)
                runs.append(r)
                ratios = [got / sim if sim else (1.0 if got == 0 else float("inf"))
                          for got, sim in zip(r["measured"], r["simulated"])]
                r["ratio"] = ratios
                for s, (got, sim, closed, ratio) in enumerate(zip(r["measured"], r["simulated"], r["closed_form"],
                                                                 ratios)):
                    rows.append((model_name, p, r["schedule"], s, round(got / MIB, 3), round(sim / MIB, 3),
                                 round(closed / MIB, 3) if closed is not None else "", round(ratio, 3)))
                print(f"{model_name} {p} stages {r['schedule']}: ratios {[round(x, 3) for x in ratios]} "
                      f"({r['seconds']:.1f} s)", flush=True)
    headers = ("model", "stages", "schedule", "stage", "measured MiB", "simulated MiB", "closed form MiB",
               "measured / simulated")
    table = tabulate(rows, headers=headers, tablefmt="github")
    worst = max((abs(x - 1), r["model"], r["stages"], r["schedule"]) for r in runs for x in r["ratio"])
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"schema": "fxpipe.bench.memory_per_schedule/v1", "torch": torch.__version__, "machine": platform.machine(),
           "microbatches": args.microbatches, "runs": runs, "worst_ratio_off_by": worst[0],
           "worst": {"model": worst[1], "stages": worst[2], "schedule": worst[3]},
           "seconds": time.perf_counter() - start}
    (args.out / "results.json").write_text(json.dumps(doc, indent=1))
    (args.out / "table.md").write_text(table + "\n")
    print(table)
    print(f"worst |measured / simulated - 1|: {worst[0]:.4f} ({worst[1]}, {worst[2]} stages, {worst[3]}); "
          f"{time.perf_counter() - start:.0f} s; wrote {args.out}")


if __name__ == "__main__":
    main()
