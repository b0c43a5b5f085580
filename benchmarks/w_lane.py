"""W on a second lane (``PipelineRuntime(w_lane=True)``, ``fxpipe run --w-lane``) against one lane, on one rank.

    python benchmarks/w_lane.py [--model resnet-small] [--stages 3] [--microbatches 4] [--steps 12] [--rounds 3]

One rank in this process runs every stage (the one-rank schedules: zb-gpipe defers each W to after the next B,
gpipe-one-rank runs it at once), so the rank's own waits are none and its second lane can only use a core the main
thread leaves free. Methods, interleaved round by round, median step of each: one lane on 1 thread, two lanes on 1
thread each (the lane's W on the second core), and one lane on 2 intra-op threads (the second core given to every op
instead). Nothing else should run on the machine.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist

import fxpipe
from fxpipe import models
from fxpipe.cli.rank_common import synthetic_batch
from fxpipe.runtime import PipelineRuntime
from fxpipe.schedules.generators import one_rank


def _median_step(pipe: fxpipe.Pipeline, zoo: models.ZooModel, schedule: str, m: int, steps: int, threads: int,
                 w_lane: bool) -> float:
    torch.set_num_threads(threads)
    rt = PipelineRuntime(copy.deepcopy(pipe), one_rank(pipe.num_stages, m, defer_w=schedule == "zb-gpipe"),
                         zoo.loss_fn, optimizer="sgd", w_lane=w_lane)
    inputs, target = synthetic_batch(zoo, m)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        rt.step(inputs, target)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="resnet-small")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    zoo = models.build(args.model)
    pipe = fxpipe.compile(copy.deepcopy(zoo.model), zoo.example_inputs, stages=args.stages)
    methods = {"one lane, 1 thread": (1, False), "two lanes, 1 thread each": (1, True),
               "one lane, 2 threads": (2, False)}
    print(f"{args.model}, {args.stages} stages on one rank, {args.microbatches} microbatches, median of "
          f"{args.steps - 1} steps per run, {args.rounds} interleaved rounds")
    print("| schedule | method | median step ms per round | against one lane, 1 thread |")
    print("| --- | --- | --- | --- |")
    for schedule in ("zb-gpipe", "gpipe-one-rank"):
        got: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(args.rounds):
            for name, (threads, lane) in methods.items():
                got[name].append(_median_step(pipe, zoo, schedule, args.microbatches, args.steps, threads, lane))
        base = statistics.median(got["one lane, 1 thread"])
        for name, values in got.items():
            print(f"| {schedule} | {name} | {', '.join(f'{v:.1f}' for v in values)} "
                  f"| {statistics.median(values) / base:.2f}x |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
