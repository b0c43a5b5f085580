"""A yield after each send (``fxpipe run --send-yield``, fxpipe.calibration.threads.send_yields): with and without,
2 ranks, gloo, 1 thread each, gloo's socket threads at nice 19 as the runtime runs them.

1. **One message.** The sender computes (matmuls) for 2 ms, posts a 64 B or 256 KiB ``isend`` through the runtime's
   ``Channel`` and computes on for 4 ms; the receiver posted its ``irecv`` ahead and waits. One-way time: from the
   post to the receiver's ``wait`` returning, on the clock both processes share (one machine). Also the idle
   ping-pong the calibration measures (``calibrate.channel_one_way``).
2. **Whole steps.** One ``PipelineRuntime`` per model, blocks of K steps with the yield on and off in turn (A B A B
   ...), so machine drift cancels; per step the block's slowest rank over K.

    python benchmarks/send_yield.py [--models mlp-tiny gpt-tiny mlp-deep gpt-base] [--iters 10]
                                    [--out benchmarks/results/send_yield/FILE.json]
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

PLANS = {"mlp-tiny": ("1f1b", 4, 10), "gpt-tiny": ("1f1b", 4, 10), "mlp-deep": ("zb-h2", 8, 3),
         "gpt-base": ("zb-h2", 8, 2)}  # model: (schedule, microbatches, steps per block)
TRIPS = 40


def _compute(a: torch.Tensor, seconds: float) -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        torch.mm(a, a)


def one_way(rank: int, numel: int, yield_after: bool) -> tuple[float, list[float]]:
    """(the idle ping-pong's one-way seconds, each busy-sender trip's one-way seconds); collective on 2 ranks."""
    from fxpipe.calibration.runtime_costs import channel_one_way
    from fxpipe.runtime.channel import Channel

    ch = Channel(torch.device("cpu"), yield_after_send=yield_after)
    idle = channel_one_way(rank, numel=numel, yield_after_send=True)  # as fxpipe run's ranks send (--send-yield auto)

    def failed(exc: Exception, *_: object) -> BaseException:
        return exc

    a, buf, trips = torch.randn(128, 128), torch.randn(numel), []
    for trip in range(TRIPS + 4):
        src = trip % 2
        dist.barrier()
        if rank == src:
            _compute(a, 0.002)
            stamp = time.perf_counter()
            ch.send(buf, 1 - rank, 9)
            _compute(a, 0.004)
        else:
            ch.wait(ch.recv((numel,), torch.float32, 1 - rank, 9), failed)
            stamp = time.perf_counter()
        ch.flush(failed)
        both = [torch.zeros(1, dtype=torch.float64) for _ in range(2)]
        dist.all_gather(both, torch.tensor([stamp], dtype=torch.float64))
        if trip >= 4:
            trips.append(float(both[1 - src]) - float(both[src]))
    return idle, trips


def worker(rank: int, init: str, models_: list[str], iters: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=300))
    import fxpipe
    from fxpipe import models
    from fxpipe.cli.rank_common import synthetic_batch
    from fxpipe.runtime.executor import PipelineRuntime
    from fxpipe.calibration.threads import lower_gloo_loops
    from fxpipe.schedules.generators import generate
    from fxpipe.schedules.simulate import Costs

    lower_gloo_loops(19)
    result: dict[str, Any] = {"message": {}, "steps": {}}
    for numel in (16, 65536):
        for on in (False, True):
            idle, trips = one_way(rank, numel, on)
            result["message"][f"{numel * 4} B, yield {'on' if on else 'off'}"] = {
                "idle_us": round(idle * 1e6, 1), "busy_sender_us": [round(t * 1e6, 1) for t in trips]}
    for name in models_:
        schedule, m, k = PLANS[name]
        zoo = models.build(name)
        inputs, target = synthetic_batch(zoo, m)
        mb = tuple(x.tensor_split(m)[0] for x in inputs)
        plan_dir = os.path.join(os.path.dirname(out), f"plan-{name}")
        if rank == 0:
            fxpipe.save(fxpipe.compile(copy.deepcopy(zoo.model), mb, stages=2), plan_dir)
        dist.barrier()
        pipe = fxpipe.load(plan_dir)
        pipe.build_backward(mb)
        from fxpipe.calibration.host import HostTuning

        rt = PipelineRuntime(pipe, generate(schedule, 2, m, Costs.from_plan(pipe.plan)), zoo.loss_fn,
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-4), host=HostTuning.for_runs())
        default = rt.channel.yield_after_send  # what fxpipe run's ranks run by default (--send-yield auto)
        times: dict[str, list[float]] = {"off": [], "on": []}
        for it in range(iters + 1):
            for key in ("off", "on") if it % 2 == 0 else ("on", "off"):
                rt.channel.yield_after_send = key == "on"
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(k):
                    rt.step(inputs, target)
                elapsed = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if it > 0:  # the first round warms up
                    times[key].append(float(elapsed) * 1e3 / k)
        result["steps"][name] = {"schedule": schedule, "microbatches": m, "steps_per_block": k, "default": default,
                                 "ms": times}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(PLANS), choices=list(PLANS))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(f"file://{os.path.join(tmp, 'init')}", args.models, args.iters, out), nprocs=2,
                 join=True)
        with open(out) as f:
            result = json.load(f)
    print("one message, sender computing after the post (us): idle ping-pong | busy sender median, p75")
    for key, row in result["message"].items():
        trips = sorted(row["busy_sender_us"])
        print(f"  {key:24s} {row['idle_us']:8.1f} | {statistics.median(trips):8.1f} {trips[3 * len(trips) // 4]:8.1f}")
    print("whole steps (ms per step, median over blocks): off | on | on / off | blocks where on is faster | default")
    for name, row in result["steps"].items():
        off, on = row["ms"]["off"], row["ms"]["on"]
        faster = sum(a < b for a, b in zip(on, off))
        print(f"  {name:9s} {row['schedule']:6s} {statistics.median(off):9.2f} | {statistics.median(on):9.2f} | "
              f"{statistics.median(on) / statistics.median(off):6.3f} | {faster} of {len(on)} | "
              f"{'on' if row['default'] else 'off'}")
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"argv": sys.argv[1:], "when": time.strftime("%Y-%m-%d %H:%M"), **result}, f, indent=1)


if __name__ == "__main__":
    main()
