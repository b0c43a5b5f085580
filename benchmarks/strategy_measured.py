"""Per-layer strategies measured on the DTensor runtime against the cost model, on 2 and 4 gloo ranks.

For each model and rank count: pure data parallelism, the SplitBrain preset (group 2) and the searched
strategy, each trained on the same float32 batch; the median step time (max over ranks) against the
strategy's cost (compute + sync + transfers, in sequence) on a link calibrated over the ranks
(``calibrate_allreduce``), compute from the FLOP/byte estimates ``strategy_graph`` makes with the plan
defaults (``--profile``-free, "one busy core": issue 15 calibrates compute to the machine). With more
ranks than cores the ranks share them: the predicted compute is scaled by ranks / cores.

    OMP_NUM_THREADS=1 python benchmarks/strategy_measured.py --out benchmarks/results/strategy_measured/measured.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fxpipe.models import resnet, vgg
from fxpipe.passes.strategy_graph import strategy_graph
from fxpipe.planning.strategies import build_graph, data_parallel, solve, splitbrain, traffic_per_layer
from fxpipe.runtime.calibrate import calibrate_allreduce
from fxpipe.runtime.strategy import StrategyRuntime

MODELS = {"vgg-small": (vgg, "small"), "resnet-small": (resnet, "small")}


def worker(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    link = calibrate_allreduce()
    cores = os.cpu_count() or 1
    rows = []
    for model in args.models:
        family, size = MODELS[model]
        torch.manual_seed(0)
        net = family.make_model(size)
        side = family.SIZES[size].image_size
        x = torch.randn(args.batch, 3, side, side)
        t = torch.randint(0, 10, (args.batch,))
        g = strategy_graph(net, (x,), profile_runs=args.profile_runs)
        graph = build_graph(g.specs, g.edges, world, bandwidth=link.bandwidth, latency=link.latency, alltoall=False)
        for name, strategy in (("dp", data_parallel(graph)), ("splitbrain-2", splitbrain(graph, g.specs, 2)),
                               ("auto", solve(graph))):
            degrees = [graph.layers[v].configs[c].degrees for v, c in enumerate(strategy.choice)]
            compute = sum(graph.layers[v].configs[c].compute for v, c in enumerate(strategy.choice))
            share = max(1.0, world / cores)
            predicted = strategy.cost + compute * (share - 1.0)
            rt = StrategyRuntime(g.module, g.nodes, g.specs, degrees)
            opt = torch.optim.SGD(rt.parameters(), lr=0.01, momentum=0.9)
            times = []
            for i in range(args.warmup + args.iters):
                dist.barrier()
                start = time.perf_counter()
                rt.train_step(x, t, opt)
                times.append(time.perf_counter() - start)
            mine = torch.tensor(statistics.median(times[args.warmup:]))
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            moved = sum(traffic_per_layer(g.specs, g.edges, degrees, alltoall=False))
            rows.append({"model": model, "ranks": world, "strategy": name, "configs": list(strategy.names(graph)),
                         "predicted_s": predicted, "measured_s": float(mine), "bytes_per_rank": moved})
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows, "link": {"bandwidth": link.bandwidth,
                                                                "latency": link.latency}}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile-runs", type=int, default=0, help="time each node's forward this many times "
                        "(one thread) for the compute costs, instead of FLOP estimates")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    links = {}
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            mp.spawn(worker, args=(world, f"file://{tmp}/pg", args, out), nprocs=world)
            got = json.loads(Path(out).read_text())
        rows += got["rows"]
        links[world] = got["link"]
    print(f"{'model':14} {'ranks':>5} {'strategy':13} {'predicted ms':>12} {'measured ms':>11} {'sim/meas':>8} "
          f"{'MB/rank':>8}")
    for r in rows:
        print(f"{r['model']:14} {r['ranks']:>5} {r['strategy']:13} {1e3 * r['predicted_s']:12.1f} "
              f"{1e3 * r['measured_s']:11.1f} {r['predicted_s'] / r['measured_s']:8.2f} {r['bytes_per_rank'] / 1e6:8.2f}")
    for world, link in links.items():
        print(f"link over {world} ranks: {link['bandwidth'] / 1e9:.2f} GB/s, {1e6 * link['latency']:.1f} us per step")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows, "links": links, "argv": sys.argv}, indent=1))


if __name__ == "__main__":
    main()
