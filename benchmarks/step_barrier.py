"""The step's barrier: K steps back to back with ``rt.step`` (each waits for the loss's all-reduce over every rank)
against ``rt.step_async`` (the loss summed in flight, read after the K steps), and SGD's for-each step on or off;
2 ranks, gloo, 1 thread each, interleaved blocks (A B C A B C ...) so machine drift cancels.

    python benchmarks/step_barrier.py [--models mlp-deep gpt-base] [--schedules 1f1b zb-h1] [--microbatches 8]
                                      [--steps 8] [--iters 6] [--out benchmarks/results/step_barrier/step_barrier.json]

Each block is timed on every rank from a barrier to its last step's end (its losses read); the block's time is the
slowest rank's, per step the block over K.
"""

from __future__ import annotations

import argparse
import copy
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


def worker(rank: int, init: str, name: str, schedules: list[str], m: int, k: int, iters: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=300))
    import fxpipe
    from fxpipe import models
    from fxpipe.cli.rank_common import synthetic_batch
    from fxpipe.runtime.executor import PipelineRuntime
    from fxpipe.schedules.generators import generate
    from fxpipe.schedules.simulate import Costs

    zoo = models.build(name)
    inputs, target = synthetic_batch(zoo, m)
    mb = tuple(x.tensor_split(m)[0] for x in inputs)
    plan_dir = os.path.join(os.path.dirname(out), "plan")
    if rank == 0:
        fxpipe.save(fxpipe.compile(copy.deepcopy(zoo.model), mb, stages=2), plan_dir)
    dist.barrier()
    runs: dict[str, Any] = {}
    for sched_name in schedules:
        pipe = fxpipe.load(plan_dir)
        pipe.build_backward(mb)
        rt = PipelineRuntime(pipe, generate(sched_name, 2, m, Costs.from_plan(pipe.plan)), zoo.loss_fn,
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-4, momentum=0.9, foreach=False))

        def barrier_each(rt: Any = rt) -> None:
            for _ in range(k):
                rt.step(inputs, target)

        def in_flight(rt: Any = rt, foreach: bool = False) -> None:
            for opt in rt.optimizers.values():
                for group in opt.param_groups:
                    group["foreach"] = foreach
            pending = [rt.step_async(inputs, target) for _ in range(k)]
            for p in pending:
                p.wait()
            for opt in rt.optimizers.values():
                for group in opt.param_groups:
                    group["foreach"] = False

        runs[f"{sched_name} barrier each step"] = barrier_each
        runs[f"{sched_name} no barrier"] = in_flight
        runs[f"{sched_name} no barrier, foreach SGD"] = lambda rt=rt: in_flight(rt, True)
    for fn in runs.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {key: [] for key in runs}
    for _ in range(iters):
        for key, fn in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[key].append(float(elapsed) * 1e3 / k)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["mlp-deep", "gpt-base"])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zb-h1"])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = {}
    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "times.json")
            init = f"file://{os.path.join(tmp, 'init')}"
            mp.spawn(worker, args=(init, name, args.schedules, args.microbatches, args.steps, args.iters, out),
                     nprocs=2, join=True)
            with open(out) as f:
                times = json.load(f)
        rows = {key: {"median_ms_per_step": round(statistics.median(v), 3), "all": [round(x, 3) for x in v]}
                for key, v in times.items()}
        results[name] = rows
        print(f"\n{name}, 2 ranks, {args.microbatches} microbatches, {args.steps} steps per block, "
              f"{args.iters} blocks each (median ms per step)")
        for sched in args.schedules:
            base = rows[f"{sched} barrier each step"]["median_ms_per_step"]
            for key in (f"{sched} barrier each step", f"{sched} no barrier", f"{sched} no barrier, foreach SGD"):
                ms = rows[key]["median_ms_per_step"]
                print(f"  {key:40s} {ms:9.3f}  {ms / base:6.3f}x")
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"argv": sys.argv[1:], "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
