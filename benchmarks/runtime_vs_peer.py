"""One exported plan, two runtimes: torch.distributed.pipelining's ``_PipelineScheduleRuntime`` and fxpipe's, side by
side in one process group (gloo, 1 thread per rank).

Rank 0 compiles the model into one stage per rank and records each schedule; every rank then loads the very same plan
twice: ``fxpipe.torch_schedule`` (the exported stage modules, the schedule from its CSV) and fxpipe's
``PipelineRuntime``. Both train the same batch in the same microbatches with SGD, so the comparison measures the
runtimes, not the partitions or the orders. Every iteration runs each (runtime, schedule) once in turn (A B A B ...)
so machine drift cancels; the step time is the max over the ranks, the median over the iterations. The first step's
losses of the two runtimes are reported too (they must agree: same plan, same batch).

    python benchmarks/runtime_vs_peer.py [--models mlp-deep gpt-base] [--ranks 2 4] [--schedules 1f1b zb-h1]
                                         [--microbatches 8] [--iters 10] [--warmup 2]
"""

from __future__ import annotations

import argparse
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


def _timed(fn: Any) -> float:
    """ms of ``fn`` on every rank, started together: the slowest rank's."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed) * 1e3


def _batch(zoo: Any, m: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """m microbatches shaped like the model's example batch, from a fixed seed (the same on every rank)."""
    gen = torch.Generator().manual_seed(1234)

    def draw(t: torch.Tensor) -> torch.Tensor:
        shape = (t.shape[0] * m, *t.shape[1:])
        if t.is_floating_point():
            return torch.randn(shape, generator=gen, dtype=t.dtype)
        return torch.randint(0, int(t.max()) + 1, shape, generator=gen, dtype=t.dtype)

    return tuple(draw(x) for x in zoo.example_inputs), draw(zoo.example_target)


def worker(rank: int, world: int, init: str, name: str, schedules: list[str], m: int, iters: int, warmup: int,
           tmp: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    import fxpipe
    from fxpipe import models
    from fxpipe.api import set_schedule
    from fxpipe.runtime.executor import PipelineRuntime

    zoo = models.build(name)
    inputs, target = _batch(zoo, m)
    plans = {s: os.path.join(tmp, f"plan-{s}") for s in schedules}
    if rank == 0:  # one compile: the schedules share the cuts
        pipe = fxpipe.compile(zoo.model, tuple(x.tensor_split(m)[0] for x in inputs), stages=world)
        for s in schedules:
            set_schedule(pipe, s, m)
            fxpipe.save(pipe, plans[s], overwrite=True)
    dist.barrier()
    runners: dict[str, Any] = {}
    first_loss: dict[str, float] = {}
    for s in schedules:
        stages, schedule = fxpipe.torch_schedule(plans[s], rank, world, zoo.loss_fn)
        first, last = any(st.is_first for st in stages), any(st.is_last for st in stages)
        params = [p for st in stages for p in st.submod.parameters()]
        opt = torch.optim.SGD(params, lr=1e-4) if params else None

        def torch_step(schedule: Any = schedule, opt: Any = opt, first: bool = first, last: bool = last,
                       key: str = f"torch {s}") -> None:
            losses: list[torch.Tensor] = []
            schedule.step(*(inputs if first else ()), target=target if last else None, losses=losses)
            if last and key not in first_loss:
                first_loss[key] = float(sum(losses).detach()) / len(losses)
            if opt is not None:
                opt.step()
                opt.zero_grad()

        rt = PipelineRuntime(fxpipe.load(plans[s]), None, zoo.loss_fn,
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-4), timeout=timedelta(seconds=300))

        def fxpipe_step(rt: Any = rt, key: str = f"fxpipe {s}") -> None:
            loss = float(rt.step(inputs, target))
            first_loss.setdefault(key, loss)

        runners[f"torch {s}"] = torch_step
        runners[f"fxpipe {s}"] = fxpipe_step
    times: dict[str, list[float]] = {k: [] for k in runners}
    for it in range(warmup + iters):
        for key, fn in runners.items():
            t = _timed(fn)
            if it >= warmup:
                times[key].append(t)
    losses: list[dict[str, float]] = [{}] * world
    dist.all_gather_object(losses, first_loss)
    if rank == 0:
        merged = {k: v for d in losses for k, v in d.items()}
        with open(out, "w") as f:
            json.dump({"model": name, "ranks": world, "microbatches": m, "batch": int(inputs[0].shape[0]),
                       "median_ms": {k: statistics.median(v) for k, v in times.items()},
                       "all_ms": times, "first_loss": merged}, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="*", default=["mlp-deep", "gpt-base"])
    parser.add_argument("--ranks", nargs="*", type=int, default=[2, 4])
    parser.add_argument("--schedules", nargs="*", default=["1f1b", "zb-h1"])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=None, help="where the results go as JSON (default: benchmarks/results/"
                        "runtime_vs_peer/<date-time>.json); they are printed too")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    rows = []
    for name in args.models:
        for world in args.ranks:
            tmp = tempfile.mkdtemp()
            out = os.path.join(tmp, "result.json")
            mp.spawn(worker, args=(world, f"file://{tmp}/pg", name, args.schedules, args.microbatches, args.iters,
                                   args.warmup, tmp, out), nprocs=world)
            with open(out) as f:
                res = json.load(f)
            med = res["median_ms"]
            res["fxpipe_over_torch"] = {s: med[f"fxpipe {s}"] / med[f"torch {s}"] for s in args.schedules}
            rows.append(res)
            print(json.dumps({k: v for k, v in res.items() if k != "all_ms"}), file=sys.stderr)
    text = json.dumps(rows, indent=2)
    out_path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "runtime_vs_peer",
                                        time.strftime("%Y-%m-%d-%H%M") + ".json")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        f.write(text + "\n")
    print(text)
    print(f"wrote {out_path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
