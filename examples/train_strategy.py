"""Per-layer parallel strategies (OptCNN's search, or SplitBrain's preset) on DTensor: one process per rank.

    torchrun --standalone --nproc-per-node 4 examples/train_strategy.py --model vgg-small --strategy auto
    torchrun --standalone --nproc-per-node 4 examples/train_strategy.py --strategy splitbrain --group 2
    torchrun --standalone --nproc-per-node 4 examples/train_strategy.py --stages 2 --cut flatten

Every rank traces the same zoo model (``strategy_graph``: one layer per fx node), builds the layer
graph on its group of ranks (a power of two) and picks the same strategy: ``auto`` (the search),
``splitbrain`` (convolutions data-parallel, fully connected layers sharded in groups of
``--group``) or ``dp``. Rank 0 prints the per-layer table (configuration, compute, sync, transfer
in, memory per rank), then ``step K loss L`` per step. With ``--stages 2 --cut NODE`` the model
is two pipeline stages (cut after NODE) of world/2 ranks each, each stage's strategy searched on
its own graph, ``--microbatches`` in GPipe order.

The data is a stand-in for yours: images labelled by a fixed random linear "teacher", the same on
every rank (the batch is the whole batch on every rank; each layer takes its share).
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from fxpipe.models import resnet, vgg
from fxpipe.passes.strategy_graph import strategy_graph
from fxpipe.planning.strategies import build_graph, data_parallel, solve, splitbrain, stage_graph, strategy_rows
from fxpipe.render import render_text
from fxpipe.report import Report
from fxpipe.runtime.strategy import StrategyOptions, StrategyRuntime

FAMILIES = {"vgg": vgg, "resnet": resnet}


def pick(specs, edges, ranks, args):  # type: ignore[no-untyped-def]
    graph = build_graph(specs, edges, ranks, bandwidth=args.bandwidth, latency=args.latency, alltoall=False)
    if args.strategy == "dp":
        strategy = data_parallel(graph)
    elif args.strategy == "splitbrain":
        strategy = splitbrain(graph, specs, min(args.group, ranks))
    else:
        strategy = solve(graph)
    return graph, strategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg-small", help="vgg-tiny, vgg-small, resnet-tiny, resnet-small")
    parser.add_argument("--strategy", choices=["auto", "splitbrain", "dp"], default="auto")
    parser.add_argument("--group", type=int, default=2, help="SplitBrain's group of ranks for the FC layers")
    parser.add_argument("--stages", type=int, choices=[1, 2], default=1)
    parser.add_argument("--cut", default="flatten", help="with --stages 2: the node the first stage ends with")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--bandwidth", type=float, default=1.5e9, help="bytes/s between ranks, for the search")
    parser.add_argument("--latency", type=float, default=1e-4, help="seconds per collective step, for the search")
    args = parser.parse_args()
    if args.model.split("-", 1)[0] not in FAMILIES or "-" not in args.model:
        parser.error(f"--model {args.model}: this example trains the zoo's CNNs (vgg-SIZE, resnet-SIZE); for other "
                     "models use fxpipe compile --strategy and fxpipe run")

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    family_name, size = args.model.split("-", 1)
    family = FAMILIES[family_name]
    torch.manual_seed(0)
    model = family.make_model(size)
    side = family.SIZES[size].image_size
    classes = family.SIZES[size].num_classes
    x = torch.randn(args.batch, 3, side, side)
    teacher = torch.randn(3 * side * side, classes)
    target = (x.flatten(1) @ teacher).argmax(1)

    g = strategy_graph(model, (x,))
    ranks = world // args.stages
    degrees = [None] * len(g.specs)
    tables = []
    bounds = [(0, len(g.specs))]
    if args.stages == 2:
        cut = g.nodes.index(args.cut) + 1
        bounds = [(0, cut), (cut, len(g.specs))]
    for lo, hi in bounds:
        specs, edges, index = stage_graph(g.specs, g.edges, lo, hi)
        graph, strategy = pick(specs, edges, ranks, args)
        tables.append(strategy_rows(graph, specs, strategy))
        for i, c in enumerate(strategy.choice):
            if index[i] >= 0:
                degrees[index[i]] = graph.layers[i].configs[c].degrees
    if rank == 0:
        for table in tables:
            print(render_text(Report(*table)))
    pipelined = StrategyOptions(stages=(args.cut,), microbatches=args.microbatches)
    rt = StrategyRuntime(g.module, g.nodes, g.specs, degrees, options=pipelined if args.stages == 2 else StrategyOptions())
    opt = torch.optim.SGD(rt.parameters(), lr=args.lr, momentum=0.9)
    for step in range(args.steps):
        loss = rt.train_step(x, target, opt)
        if rank == 0:
            print(f"step {step} loss {loss:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
