"""Pipeline x data parallel on this machine: 2 stages x 1 replica, 1 stage x 2 replicas and 2 x 2, measured and simulated.

Every configuration trains the same global batch (``--microbatches`` microbatches of the model's
example size: mlp-deep 8 x 8 rows, gpt-base 8 x 2 sequences), each replica taking its share, with
gloo and one thread per rank (``OMP_NUM_THREADS=1``). The plans are compiled and profiled once, in
this process (``--profile``, 3 runs per layer), and every rank loads them.

Per configuration, in one process group: the machine is calibrated (the p2p link; compute
contention with every rank busy, which on 2 cores and 4 ranks is the time-sharing; the dp group's
all-reduce); then every schedule's step is timed in turn (A B A B ...; the max over ranks, median
over ``--iters`` after ``--warmup``), and one more step per schedule gives each rank's all-reduce
events: the seconds it waited for its gradients' sum after its last compute action (exposed).
The hidden fraction is 1 - exposed / the all-reduce's own time (the calibrated ring for the
rank's gradient bytes, measured with the ranks otherwise idle), summed over ranks, in two senses:
"by own rank" counts as exposed what a rank waits past its own last compute action; "in the step"
only what it waits past every rank's last compute action (what lengthens the step). Waiting
includes waiting for the other replica to finish its own W, which the ring's time does not. The simulator gets the profiled
costs with the same calibrations (``Calibration.apply``, ``AllReduceCalibration.apply``) and
``dp``, and each stage's optimizer step as a memory-bound pass over its parameters (SGD: 3 bytes
per parameter byte at the plan's ``device_mem_bw``, ``Costs.with_optimizer``); with more ranks
than cores (2 x 2 here) F, B and W also time-share the cores (``Costs.cores``). Its step is its
makespan (the loss's all-reduce, a few bytes, is outside it).

    python benchmarks/dp_scaling.py [--models mlp-deep gpt-base] [--iters 8] [--warmup 2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIGS = ((2, 1), (1, 2), (2, 2))  # (pipeline ranks, replicas)
SCHEDULES = ("1f1b", "zb-h1")


def _timed(fn: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed) * 1e3


def worker(rank: int, world: int, init: str, name: str, plan_dir: str, pp: int, dp: int, m: int, iters: int,
           warmup: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    import fxpipe
    from fxpipe import models
    from fxpipe.cli.rank_common import synthetic_batch
    from fxpipe.calibration.runtime_costs import calibrate, calibrate_allreduce
    from fxpipe.runtime.executor import PipelineRuntime
    from fxpipe.schedules.generators import generate
    from fxpipe.schedules.simulate import Costs, simulate

    zoo = models.build(name)
    inputs, target = synthetic_batch(zoo, m)  # the global batch: m microbatches, m / dp per replica
    cal = calibrate()
    runtimes: dict[str, Any] = {}
    for sched_name in SCHEDULES:
        pipe = fxpipe.load(plan_dir)
        pipe.build_backward(tuple(x.tensor_split(m)[0] for x in inputs))
        sched = generate(sched_name, pp, m // dp, Costs.from_plan(pipe.plan))
        runtimes[sched_name] = PipelineRuntime(pipe, sched, zoo.loss_fn,
                                               optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-4))
    rt0 = next(iter(runtimes.values()))
    ar = calibrate_allreduce(group=rt0.mesh.get_group("dp")) if dp > 1 else None
    plan = rt0.pipe.plan
    costs = cal.apply(dataclasses.replace(Costs.from_plan(plan), dp=dp)).with_optimizer("sgd", plan.options.device_mem_bw)
    if ar is not None:
        costs = ar.apply(costs)
    cores = os.cpu_count() or 1
    # More ranks than cores: F, B and W time-share them (Costs.cores; the calibration's contention factor, the
    # fastest of a few rounds, misses it).
    shared = dataclasses.replace(costs, cores=cores) if world > cores else costs
    times: dict[str, list[float]] = {k: [] for k in runtimes}
    for it in range(warmup + iters):
        for key, rt in runtimes.items():
            t = _timed(lambda rt=rt: rt.step(inputs, target))
            if it >= warmup:
                times[key].append(t)
    result: dict[str, Any] = {}
    for key, rt in runtimes.items():
        step_ms = _timed(lambda rt=rt: rt.step(inputs, target))
        sim = simulate(rt.schedule, shared)
        unshared = simulate(rt.schedule, costs).makespan * 1e3
        mine: dict[str, Any] = {"step_ms": step_ms}
        if rt.sync is not None:  # perf_counter is one clock for every process of this machine
            t0 = rt.sync.start
            nbytes = sum(e.nbytes for e in rt.sync.events)
            own = ar.allreduce(nbytes) if ar is not None else 0.0
            mine.update(grad_bytes=nbytes, allreduce_ms=own * 1e3, last_compute=t0 + rt.events[-1][2],
                        waits=[(t0 + e.wait_start, t0 + e.wait_end) for e in rt.sync.events],
                        launched_ms=[e.launched * 1e3 for e in rt.sync.events])
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        if dp > 1:
            # Exposed: the all-reduce waits past the rank's own last compute (rank), or past every rank's (step).
            step_end = max(r["last_compute"] for r in every)
            total = sum(r["allreduce_ms"] for r in every) / 1e3
            for r in every:
                r["exposed_ms"] = sum(b - max(a, r["last_compute"]) for a, b in r["waits"] if b > r["last_compute"]) * 1e3
                r["exposed_step_ms"] = sum(b - max(a, step_end) for a, b in r["waits"] if b > step_end) * 1e3
            hidden = {"hidden": 1.0 - sum(r["exposed_ms"] for r in every) / 1e3 / total if total else 1.0,
                      "step_hidden": 1.0 - sum(r["exposed_step_ms"] for r in every) / 1e3 / total if total else 1.0}
        else:
            hidden = {"hidden": None, "step_hidden": None}
        result[key] = {"median_ms": statistics.median(times[key]), "simulated_ms": sim.makespan * 1e3,
                       "simulated_without_time_sharing_ms": unshared, "cores": cores,
                       "simulated_optimizer_ms": max(r.optimizer_s for r in sim.ranks) * 1e3,
                       "measured": hidden,
                       "simulated": {"hidden": sim.hidden_fraction, "step_hidden": sim.step_hidden_fraction}
                       if dp > 1 else None,
                       "simulated_allreduce_ms": sim.allreduce_s * 1e3, "per_rank": every}
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"model": name, "pp": pp, "dp": dp, "world": world, "microbatches": m,
                       "batch": int(inputs[0].shape[0]), "calibration": cal.to_json(),
                       "allreduce_calibration": ar.to_json() if ar is not None else None, "schedules": result}, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="*", default=["mlp-deep", "gpt-base"])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=None, help="Write every configuration's results here (JSON).")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import fxpipe
    from fxpipe import models
    from fxpipe.cli.rank_common import synthetic_batch

    m = args.microbatches
    rows, every = [], []
    for name in args.models:
        tmp = tempfile.mkdtemp()
        zoo = models.build(name)
        inputs, _ = synthetic_batch(zoo, m)
        mb = tuple(x.tensor_split(m)[0] for x in inputs)
        plans = {}
        for pp in sorted({pp for pp, _ in CONFIGS}):
            plans[pp] = os.path.join(tmp, f"plan{pp}")
            fxpipe.save(fxpipe.compile(__import__("copy").deepcopy(zoo.model), mb, stages=pp, profile=True,
                                       profile_runs=3), plans[pp])
        for pp, dp in CONFIGS:
            out = os.path.join(tmp, f"result-{pp}x{dp}.json")
            init = f"file://{tmp}/pg-{pp}x{dp}"
            mp.spawn(worker, args=(pp * dp, init, name, plans[pp], pp, dp, m, args.iters, args.warmup, out),
                     nprocs=pp * dp)
            with open(out) as f:
                res = json.load(f)
            every.append(res)
            for sched, r in res["schedules"].items():
                sim = r["simulated"] or {}
                rows.append((name, f"{pp} x {dp}", sched, r["median_ms"], r["simulated_ms"],
                             r["simulated_ms"] / r["median_ms"], r["measured"]["hidden"], sim.get("hidden"),
                             r["measured"]["step_hidden"], sim.get("step_hidden")))
            print(f"{name} {pp}x{dp}: " + ", ".join(f"{s} {r['median_ms']:.1f} ms (sim {r['simulated_ms']:.1f})"
                                                   for s, r in res["schedules"].items()), file=sys.stderr)
    from tabulate import tabulate

    print(tabulate(rows, headers=["model", "stages x replicas", "schedule", "measured ms", "simulated ms",
                                  "sim / measured", "hidden by own rank", "(simulated)", "hidden in the step",
                                  "(simulated)"],
                   floatfmt=".3g", tablefmt="github"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(every, f, indent=1)


if __name__ == "__main__":
    main()
