"""One rank of the per-layer strategy tests: every case of ``cfg`` on the DTensor runtime, results to JSON.

Run by tests/runtime/test_strategy_runtime.py as ``python _strategy_worker.py RANK WORLD INIT OUTDIR CFG``. Each
case builds the zoo model in float64, traces it with ``strategy_graph``, picks the strategy (``auto``: the
search, ``splitbrain``: the preset with group 2, ``dp``), trains 3 SGD-with-momentum steps with collectives
counted, and writes (rank 0) the losses, the full gradients of every step, the final parameters and buffers
(``torch.save``), and per layer the bytes and all-reduces the counter saw and the cost model predicted. Then
the pipelined cases, and on 4 ranks the nesting gap that stays open (``run_nesting_gap``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.errors import OptionError
from fxpipe.models import resnet, vgg
from fxpipe.passes.strategy_graph import strategy_graph
from fxpipe.planning.strategies import (
    Degrees,
    build_graph,
    data_parallel,
    edge_transfers,
    solve,
    splitbrain,
    stage_graph,
    sync_collectives,
    traffic_per_layer,
)
from fxpipe.runtime.strategy import StrategyRuntime

BATCH = 8
STEPS = 3


def example(model: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    family = {"vgg-tiny": vgg, "resnet-tiny": resnet}[model]
    net = family.make_model("tiny").double()
    x = torch.randn(BATCH, 3, 32, 32, dtype=torch.float64)
    return net, x, torch.randint(0, 10, (BATCH,))


def run_case(world: int, case: dict[str, Any], out: Path) -> dict[str, Any]:
    net, x, target = example(case["model"])
    g = strategy_graph(net, (x,))
    graph = build_graph(g.specs, g.edges, world, bandwidth=1e9, latency=1e-4, alltoall=False)
    strategy = {"auto": lambda: solve(graph), "dp": lambda: data_parallel(graph),
                "splitbrain": lambda: splitbrain(graph, g.specs, 2)}[case["strategy"]]()
    degrees = [graph.layers[v].configs[c].degrees for v, c in enumerate(strategy.choice)]
    rt = StrategyRuntime(g.module, g.nodes, g.specs, degrees)
    opt = torch.optim.SGD(rt.parameters(), lr=0.05, momentum=0.9)
    losses, grads, records = [], [], []
    for _ in range(STEPS):
        with rt.count() as counter:
            losses.append(rt.train_step(x, target, opt))
        records = counter.records  # the last step's (every step issues the same)
        grads.append(rt.full_grads())
    params, buffers = rt.full_parameters(), rt.full_buffers()
    predicted = traffic_per_layer(g.specs, g.edges, degrees, alltoall=False)
    actual: dict[str, float] = {}
    reduces: dict[str, int] = {}
    for r in records:
        actual[r.layer] = actual.get(r.layer, 0.0) + r.nbytes
    name = f"{case['model']}-{case['strategy']}"
    if dist.get_rank() == 0:
        torch.save({"grads": grads, "params": params, "buffers": buffers}, out / f"{name}.pt")
    moves = [0] * len(g.specs)  # transfers that move bytes, forward and backward, into each layer
    for u, v in g.edges:
        moves[v] += sum(t.nbytes > 0 for t in edge_transfers(g.specs[u], degrees[u], g.specs[v], degrees[v],
                                                              alltoall=False))
    layers = {}
    for node, spec, d, p, m in zip(g.nodes, g.specs, degrees, predicted, moves):
        mine = [r for r in records if r.layer == node]
        reduces[node] = len(mine)
        layers[node] = {"config": d.name, "predicted": p, "actual": actual.get(node, 0.0),
                        "predicted_count": len(sync_collectives(spec, d)) + m, "count": len(mine)}
    return {"name": name, "losses": losses, "configs": strategy.names(graph), "layers": layers,
            "reordered": [n for n, layer in rt.layers.items() if layer.order is not None],
            "loss_value": actual.get("(loss value)", 0.0),
            "unlabelled": sum(r.nbytes for r in records if r.layer not in layers and r.layer != "(loss value)"),
            "counts": counter.counts(),
            "groups": {"".join(map(str, perm)): [rt.view(perm).get_group(i).group_name for i in range(len(perm))]
                       for perm in itertools.permutations(range(rt.mesh.ndim))}}


def stage_traffic(specs: Any, edges: Any, degrees: Any, microbatches: int) -> list[tuple[float, int]]:
    """Per layer of a stage's graph, the bytes a rank receives per step and the collectives that move them, with
    ``microbatches`` microbatches: every transfer and statistics all-reduce once per microbatch (a transfer
    carries its share of the batch: the step's bytes are the whole batch's), the gradients once per step."""
    out = []
    for v, (spec, d) in enumerate(zip(specs, degrees)):
        nbytes, count = 0.0, 0
        for u, w in edges:
            if w == v:
                moves = edge_transfers(specs[u], degrees[u], spec, d, alltoall=False)
                nbytes += sum(t.nbytes for t in moves)
                count += microbatches * sum(t.nbytes > 0 for t in moves)
        grads = sync_collectives(dataclasses.replace(spec, stat_bytes=0.0), d)
        stats = sync_collectives(spec, d)[len(grads):]
        nbytes += sum(2 * (g - 1) / g * b for b, g in grads) + microbatches * sum(2 * (g - 1) / g * b for b, g in stats)
        out.append((nbytes, count + len(grads) + microbatches * len(stats)))
    return out


def pipelined_name(case: dict[str, Any]) -> str:
    return f"{case['model']}-pipelined-{case['schedule']}-{case['microbatches']}"


def run_pipelined(world: int, case: dict[str, Any], out: Path) -> dict[str, Any]:
    """Stages cut after ``case["cut"]`` on groups of world / 2 ranks, each stage's strategy searched on its own
    graph (``stage_graph``), ``case["microbatches"]`` microbatches in the order of ``case["schedule"]``; each
    stage's first rank saves, per layer, the bytes and collectives its collectives counter saw against
    ``stage_traffic``."""
    net, x, target = example(case["model"])
    g = strategy_graph(net, (x,))
    group = world // 2
    cut = g.nodes.index(case["cut"]) + 1
    degrees: list[Any] = [None] * len(g.specs)
    configs, stages = [], []
    for lo, hi in ((0, cut), (cut, len(g.specs))):
        specs, edges, index = stage_graph(g.specs, g.edges, lo, hi)
        graph = build_graph(specs, edges, group, bandwidth=1e9, latency=1e-4, alltoall=False)
        strategy = solve(graph)
        configs += [name for name, orig in zip(strategy.names(graph), index) if orig >= 0]
        chosen = [graph.layers[i].configs[c].degrees for i, c in enumerate(strategy.choice)]
        stages.append((specs, edges, index, chosen))
        for i, d in enumerate(chosen):
            if index[i] >= 0:
                degrees[index[i]] = d
    rt = StrategyRuntime(g.module, g.nodes, g.specs, degrees, stages=[case["cut"]],
                         microbatches=case["microbatches"], schedule=case["schedule"])
    opt = torch.optim.SGD(rt.parameters(), lr=0.05, momentum=0.9)
    losses, grads, records = [], [], []
    for _ in range(STEPS):
        with rt.count() as counter:
            losses.append(rt.train_step(x, target, opt))
        records = counter.records  # the last step's
        grads.append(rt.full_grads())
    name = pipelined_name(case)
    specs, edges, index, chosen = stages[rt.pp_rank]
    labels = [g.nodes[o] if o >= 0 else "(send)" if s.kind == "loss" else s.name for s, o in zip(specs, index)]
    layers = {}
    for label, d, (nbytes, count) in zip(labels, chosen, stage_traffic(specs, edges, chosen, case["microbatches"])):
        mine = [r for r in records if r.layer == label]
        layers[label] = {"config": d.name, "predicted": nbytes, "actual": sum(r.nbytes for r in mine),
                         "predicted_count": count, "count": len(mine)}
    unlabelled = sum(r.nbytes for r in records if r.layer not in layers and r.layer != "(loss value)")
    whole = {"grads": grads, "params": rt.full_parameters(), "buffers": rt.full_buffers(),  # collectives: all ranks
             "layers": layers, "unlabelled": unlabelled}
    if rt.mesh.get_rank() == rt.mesh.mesh.flatten()[0].item():  # one rank per stage writes its stage
        torch.save(whole, out / f"{name}-stage{rt.pp_rank}.pt")
    return {"name": name, "losses": losses, "configs": configs, "layers": {}, "loss_value": 0.0, "unlabelled": 0.0,
            "counts": {}}


class TwoBranches(torch.nn.Module):
    """``fc(flatten(relu(a(x)) + relu(b(x))))``: two convolutions joined by an add."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Conv2d(4, 8, 3, padding=1, bias=False)
        self.b = torch.nn.Conv2d(4, 8, 3, padding=1, bias=False)
        self.fc = torch.nn.Linear(8 * 4 * 4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(torch.relu(self.a(x)) + torch.relu(self.b(x)), 1))


def run_nesting_gap() -> dict[str, Any]:
    """The nesting gap that stays open (4 ranks, a hand-picked strategy): ``b`` is s2c2 into a c4 ReLU, whose blocks
    must nest the other way round (an elementwise layer cannot reorder them), and the add joins it with the
    base-ordered c4 branch of ``a``; one step's bytes and collectives per layer against the model."""
    torch.manual_seed(0)
    net, x, target = TwoBranches().double(), torch.randn(8, 4, 4, 4, dtype=torch.float64), torch.randint(0, 4, (8,))
    g = strategy_graph(net, (x,))
    degrees = [Degrees(sample=2, column=2) if n == "b" else Degrees(sample=4) if n in ("x", "fc", "output")
               else Degrees(column=4) for n in g.nodes]
    rt = StrategyRuntime(g.module, g.nodes, g.specs, degrees)
    opt = torch.optim.SGD(rt.parameters(), lr=0.05)
    with rt.count() as counter:
        rt.train_step(x, target, opt)
    predicted = traffic_per_layer(g.specs, g.edges, degrees, alltoall=False)
    layers = {n: {"config": d.name, "predicted": p, "actual": sum(r.nbytes for r in counter.records if r.layer == n)}
              for n, d, p in zip(g.nodes, degrees, predicted)}
    return {"name": "nesting-gap", "layers": layers, "views": {n: list(layer.perm) for n, layer in rt.layers.items()}}


def group_timeouts(model: str, timeout: timedelta) -> dict[str, Any]:
    """What each process group a runtime made with ``timeout`` waits for a collective, in seconds (its mesh views'
    dims and its sync groups)."""
    net, x, _ = example(model)
    g = strategy_graph(net, (x,))
    rt = StrategyRuntime(g.module, g.nodes, g.specs, [Degrees(sample=dist.get_world_size())] * len(g.nodes),
                         timeout=timeout)
    groups = [rt.view(p).get_group(i) for p in itertools.permutations(range(rt.mesh.ndim)) for i in range(rt.mesh.ndim)]
    groups += [g for g in rt._groups.values() if g is not None]
    return {"name": "timeouts", "seconds": sorted({g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                                                   for g in groups})}


def disagreeing(model: str) -> dict[str, Any]:
    """The error each rank gets when the last rank passes another configuration for one convolution, or another
    microbatch count (the ranks would post different collectives and wait on each other)."""
    net, x, _ = example(model)
    g = strategy_graph(net, (x,))
    world, rank = dist.get_world_size(), dist.get_rank()
    conv = next(i for i, s in enumerate(g.specs) if s.kind == "matmul")
    degrees = [Degrees(sample=world)] * len(g.nodes)
    errors = []
    for config, microbatches in (({conv: Degrees(sample=world // 2, column=2)}, 1), ({}, 1 + (rank == world - 1))):
        mine = [config.get(i, d) if rank == world - 1 else d for i, d in enumerate(degrees)]
        try:
            StrategyRuntime(g.module, g.nodes, g.specs, mine, microbatches=microbatches)
        except OptionError as exc:
            errors.append(str(exc))
        else:
            errors.append("")
    return {"name": "disagreeing", "node": g.nodes[conv], "errors": errors}


def main(rank: int, world: int, init: str, outdir: str, cfg: dict[str, Any]) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    out = Path(outdir)
    results = [run_case(world, case, out) for case in cfg["cases"]]
    results += [run_pipelined(world, case, out) for case in cfg.get("pipelined", [])]
    results += [run_nesting_gap()] if cfg.get("nesting_gap") else []
    results += [group_timeouts("vgg-tiny", timedelta(seconds=17))] if cfg.get("nesting_gap") else []
    results += [disagreeing("vgg-tiny")]
    if rank == 0:
        (out / "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], json.loads(sys.argv[5]))
    from _leave import leave  # this script's own directory is on sys.path

    leave()
