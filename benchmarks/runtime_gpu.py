"""fxpipe's distributed runtime on one GPU: 2 ranks over gloo, with the per-rank breakdown of a step.

Both ranks share the one GPU (NCCL refuses two ranks on one device), so messages go through
pinned host memory on a communication stream (``fxpipe.runtime.channel``). Each (model,
schedule) trains the zoo model's example batch times the microbatch count for --warmup + --iters
steps, SGD; a step is timed from a barrier to ``torch.cuda.synchronize()`` after ``rt.step``.
The breakdown is the runtime's own record of one more step (host clock): time inside its
actions (F, B, W: on a GPU, launching kernels), waiting for messages, between actions, and after
the last action; and the same step's kernel time (torch.profiler, CUDA activity). Side by side in
rank 0's process, on the same batch: the whole model eager, and ``backend="fxpipe"`` (2 stages,
the same microbatches, one process, CUDA graphs) so the three can be read as one table.

    python benchmarks/runtime_gpu.py [--models gpt-medium mlp-large] [--schedules 1f1b zb-h1] [--microbatches 4]
                                     [--codegens eager inductor] [--cuda-graphs off on]
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


def _kernel_ms(step: Any) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(float(getattr(e, "self_device_time_total", 0.0) or 0.0) for e in prof.key_averages()) / 1e3


def _single_process(name: str, m: int, warmup: int, iters: int) -> dict[str, Any]:
    """Eager and backend="fxpipe" on rank 0's GPU, the same batch, one process."""
    from fxpipe import models
    from fxpipe.cli.rank_common import synthetic_batch

    zoo = models.build(name, device="cuda")
    inputs, target = synthetic_batch(zoo, m)
    inputs, target = tuple(x.cuda() for x in inputs), target.cuda()
    out: dict[str, Any] = {}
    for method in ("eager", "backend"):
        torch._dynamo.reset()
        model = copy.deepcopy(zoo.model)
        fn = model if method == "eager" else torch.compile(model, backend="fxpipe",
                                                            options={"stages": 2, "microbatches": m})
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(fn: Any = fn, opt: Any = opt) -> None:
            zoo.loss_fn(fn(*inputs), target).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        times = []
        for i in range(warmup + iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        out[method] = {"median_ms": statistics.median(times), "kernel_ms": _kernel_ms(step)}
    return out


def _rank(rank: int, init: str, args: argparse.Namespace, out: str) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=900))
    import fxpipe
    from fxpipe import models
    from fxpipe.cli.rank_common import synthetic_batch
    from fxpipe.runtime import PipelineRuntime

    rows = []
    for name in args.models:
        torch.manual_seed(0)
        zoo = models.build(name, device="cuda")
        pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2, verify_each=False)
        inputs, target = synthetic_batch(zoo, args.microbatches)
        for schedule, codegen, graphs in [(s, c, g) for s in args.schedules for c in args.codegens
                                          for g in args.cuda_graphs]:
            t_start = time.perf_counter()
            rt = PipelineRuntime(pipe, schedule=schedule, loss_fn=zoo.loss_fn, microbatches=args.microbatches,
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01), device="cuda", codegen=codegen,
                                 timeout=timedelta(seconds=900), cuda_graphs=graphs == "on")

            def step(rt: Any = rt) -> None:
                rt.step(inputs, target)
                torch.cuda.synchronize()

            times = []
            first_s = 0.0
            for i in range(args.warmup + args.iters):
                if i == 1:
                    first_s = time.perf_counter() - t_start  # runtime built and one step run (compiles, if any)
                torch.cuda.synchronize()
                dist.barrier()
                t0 = time.perf_counter()
                step()
                t = (time.perf_counter() - t0) * 1e3
                if i >= args.warmup:
                    times.append(t)
            dist.barrier()
            t0 = time.perf_counter()
            step()
            t = (time.perf_counter() - t0) * 1e3
            by_kind: dict[str, float] = {}
            for action, a0, a1 in rt.events:
                by_kind[action.kind.value] = by_kind.get(action.kind.value, 0.0) + (a1 - a0) * 1e3
            compute = sum(by_kind.values())
            waits = sum(a1 - a0 for _, a0, a1 in rt.waits) * 1e3
            span = rt.events[-1][2] * 1e3
            dist.barrier()
            kernel = _kernel_ms(step)
            mine = {"step_ms": round(t, 3), "actions_ms": {k: round(v, 3) for k, v in by_kind.items()},
                    "waiting_ms": round(waits, 3), "between_actions_ms": round(span - compute - waits, 3),
                    "after_last_action_ms": round(t - span, 3), "kernel_ms": round(kernel, 3),
                    "median_step_ms": round(statistics.median(times), 3), "first_step_s": round(first_s, 1)}
            every: list[Any] = [None, None]
            dist.all_gather_object(every, mine)
            rows.append({"model": name, "schedule": schedule, "codegen": codegen, "cuda_graphs": graphs,
                         "fallbacks": None if rt.graph_set is None else rt.graph_set.fallbacks,
                         "microbatches": args.microbatches,
                         "batch": int(inputs[0].shape[0]), "per_rank": every,
                         "median_step_ms": max(r["median_step_ms"] for r in every)})
            del rt
        dist.barrier()
        if rank == 0:
            single = _single_process(name, args.microbatches, args.warmup, args.iters)
            for r in rows:
                if r["model"] == name:
                    r["single_process"] = single
        dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt-medium", "mlp-large"])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zb-h1"])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--codegens", nargs="+", default=["eager"], help="eager and/or inductor (fxpipe run --codegen)")
    parser.add_argument("--cuda-graphs", nargs="+", default=["off", "on"], choices=["off", "on"],
                        help="PipelineRuntime(cuda_graphs=...): the stage graphs captured per call slot")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: CUDA is not available here; run on a GPU machine")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(_rank, args=(f"file://{tmp}/init", args, out), nprocs=2)
        with open(out) as f:
            rows = json.load(f)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; 2 ranks on one GPU over gloo")
    print("| model | batch | schedule | codegen | graphs | m | step ms (max of ranks' medians) | eager ms | backend ms | "
          "rank: actions F/B/W/BW ms, waiting, between, after, kernel ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        single = r.get("single_process", {})
        ranks = "; ".join(
            f"r{i}: " + "/".join(str(p["actions_ms"].get(k, 0)) for k in ("F", "B", "W", "BW"))
            + f", {p['waiting_ms']}, {p['between_actions_ms']}, {p['after_last_action_ms']}, {p['kernel_ms']}"
            for i, p in enumerate(r["per_rank"]))
        print(f"| {r['model']} | {r['batch']} | {r['schedule']} | {r['codegen']} | {r['cuda_graphs']} | {r['microbatches']} | {r['median_step_ms']} | "
              f"{round(single.get('eager', {}).get('median_ms', float('nan')), 3)} | "
              f"{round(single.get('backend', {}).get('median_ms', float('nan')), 3)} | {ranks} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
