"""Per-layer strategies measured on the DTensor runtime against the calibrated cost model, on 2 and 4 gloo ranks.

For each model and rank count: pure data parallelism, the SplitBrain preset (group 2) and the searched
strategy, each trained on the same float32 batch; the median step time (max over ranks) against the
strategy's cost (compute + host + sync + transfers, in sequence), which the search also minimizes:

- **compute** from ``strategy_graph(compute=calibrate_compute())``: this machine's GEMM rate for Linear
  layers, its convolution rate and per-call time for convolutions, its memory bandwidth for the rest (one
  thread, measured before the ranks start, cached); with more ranks than cores the ranks share them, so
  compute is scaled by ranks / cores;
- **link**: ``calibrate_allreduce`` over the same ranks (latency per ring step, bandwidth);
- **host** (``planning.strategies.HostCosts``): what the runtime costs beyond both, per layer, per layer
  with parameters, per redistribute, per gradient all-reduce and per step, fitted on the same ranks just
  before (``measure_host``): chains of tiny layers (nothing to compute, a few bytes to move) of 4 and 36
  layers in six forms (ReLU and Linear data-parallel, Linear alternating batch and column splits, BatchNorm,
  convolutions, convolutions with BatchNorm2d), each trained like the models; the cost model is linear in the
  five host costs, so they are the non-negative least-squares fit (relative error) of its prediction to the
  twelve measured steps.

The runs of one measurement (the eight probes; a model's three strategies) take turns, one step each,
so a change in the machine's load reaches all of them alike.

    OMP_NUM_THREADS=1 python benchmarks/strategy_measured.py --out benchmarks/results/strategy_measured/measured.json

``--profiles DIR``: each node's compute is instead what ``DIR/cpu-<model>-nodes.json`` measured on this machine at
a rank's share of the batch (``profile_layers.py --nodes``: each node's forward + backward alone, taken in proportion
so that they sum to the whole model's plain forward + backward measured beside them): per node, the calibrated
estimate scaled to it (``profiled``), which the search then minimizes; ``calibrated_s`` keeps the calibrated model's
cost of the same strategy.

``--beside`` (with ``--profiles``): the profile's compute is scaled by what the ranks measure beside each other (plain
PyTorch's forward + backward on a rank's share, every rank at once, against the profile's whole model timed alone)
instead of by ranks / cores: on this machine two ranks on two cores already contend (memory, the hypervisor), and four
share them at more than twice the cost.

``--bucket-layers``: the models' runtimes all-reduce each sync group's gradients in 25 MiB buckets over its
layers (``StrategyRuntime(bucket_layers=True)``) and the model costs them so (the probes are unchanged: they
fit the cost of one gradient all-reduce).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fxpipe.models import resnet, vgg
from fxpipe.calibration.compute import calibrate_compute, describe
from fxpipe.passes.strategy_graph import strategy_graph
from fxpipe.plan import ComputeRates
from fxpipe.planning.strategies import (
    Degrees,
    HostCosts,
    LayerGraph,
    LayerSpec,
    Strategy,
    build_graph,
    data_parallel,
    solve,
    splitbrain,
    strategy_cost,
    strategy_rows,
    traffic_per_layer,
)
from fxpipe.calibration.runtime_costs import calibrate_allreduce
from fxpipe.runtime.strategy import StrategyRuntime

MODELS = {"vgg-small": (vgg, "small"), "resnet-small": (resnet, "small")}
PROBES = (("relu", "dp"), ("linear", "dp"), ("linear", "sc"), ("norm", "dp"), ("conv", "dp"), ("convnorm", "dp"))
PROBE_LAYERS = (4, 36)
HOST_FIELDS = tuple(f.name for f in dataclasses.fields(HostCosts))


# --- the host-cost probe ---------------------------------------------------------------------------


def probe_model(kind: str, layers: int) -> nn.Sequential:
    """``layers`` tiny layers of ``kind`` between a first and a last Linear (16 features: nothing to compute); the
    convolutional kinds on 1 x 4 x 4 images, 3 x 3 convolutions of 2 channels (``convnorm``: each second layer a
    BatchNorm2d), flattened into the last Linear."""
    if kind in ("conv", "convnorm"):
        body = [nn.BatchNorm2d(2) if kind == "convnorm" and i % 2 else nn.Conv2d(2, 2, 3, padding=1)
                for i in range(layers)]
        return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), *body, nn.Flatten(), nn.Linear(2 * 16, 10))
    make = {"relu": nn.ReLU, "linear": lambda: nn.Linear(16, 16), "norm": lambda: nn.BatchNorm1d(16)}[kind]
    return nn.Sequential(nn.Linear(16, 16), *(make() for _ in range(layers)), nn.Linear(16, 10))


def probe_degrees(specs: Sequence[LayerSpec], world: int, mode: str) -> list[Degrees]:
    """``dp``: every layer batch-split; ``sc``: the compute layers alternate batch and column splits (every edge
    moves: an all-gather or a reduce-scatter each way)."""
    out = []
    for i, spec in enumerate(specs):
        column = mode == "sc" and spec.kind not in ("input", "loss") and i % 2 == 1
        out.append(Degrees(column=world) if column else Degrees(sample=world))
    return out


def choice_of(graph: LayerGraph, degrees: Sequence[Degrees]) -> tuple[int, ...]:
    return tuple(next(c for c, cfg in enumerate(layer.configs) if cfg.degrees == d)
                 for layer, d in zip(graph.layers, degrees))


def time_steps(runs: Sequence[tuple[StrategyRuntime, torch.Tensor, torch.Tensor]], iters: int,
               warmup: int) -> list[float]:
    """Each run's median step of ``iters`` after ``warmup``, the slowest rank's (collective). The runs take turns,
    one step each, so a change in the machine's load reaches all of them alike."""
    opts = [torch.optim.SGD(rt.parameters(), lr=0.01, momentum=0.9) for rt, _, _ in runs]
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(warmup + iters):
        for (rt, x, t), opt, mine in zip(runs, opts, times):
            dist.barrier()
            start = time.perf_counter()
            rt.train_step(x, t, opt)
            mine.append(time.perf_counter() - start)
    medians = torch.tensor([statistics.median(m[warmup:]) for m in times], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return medians.tolist()


def shared(specs: Sequence[LayerSpec], share: float) -> tuple[LayerSpec, ...]:
    """``specs`` with their compute stretched by ``share`` (ranks / cores: the ranks take turns on the cores)."""
    return tuple(dataclasses.replace(s, seconds=s.seconds * share, fixed_seconds=s.fixed_seconds * share)
                 for s in specs)


def profiled(specs: Sequence[LayerSpec], nodes: Sequence[str], doc: dict[str, Any], share_batch: int,
             world: int) -> tuple[LayerSpec, ...]:
    """``specs`` (fx nodes ``nodes``) with each node's compute scaled so that its data-parallel share on ``world``
    ranks (``seconds / world + fixed_seconds``) is the profile's measured seconds at ``share_batch``, the profile's
    nodes taken in proportion to sum to its whole model's measured forward + backward. A node the estimate gives no
    compute (a view) keeps none: what it costs to dispatch is ``HostCosts.node``'s."""
    key = str(share_batch)
    if key not in doc["seconds"]:
        raise SystemExit(f"error: the profile of {doc['model']} has batches {sorted(doc['seconds'])}, not a rank's "
                         f"share {share_batch}; run profile_layers.py --nodes --batches {share_batch}")
    measured = doc["seconds"][key]
    scale = doc["model_seconds"][key] / sum(measured.values())
    out = []
    for spec, name in zip(specs, nodes):
        estimate = spec.seconds / world + spec.fixed_seconds
        ratio = measured.get(name, 0.0) * scale / estimate if estimate > 0 else 1.0
        out.append(dataclasses.replace(spec, seconds=spec.seconds * ratio, fixed_seconds=spec.fixed_seconds * ratio))
    return tuple(out)


def fit_host(rows: Sequence[tuple[float, Sequence[float], float]]) -> HostCosts:
    """Non-negative least squares, relative: ``measured ≈ base + Σ_j a_j h_j`` over ``(base, a, measured)`` rows."""
    active = list(range(len(HOST_FIELDS)))
    while True:
        a = torch.tensor([[r[1][j] / r[2] for j in active] for r in rows], dtype=torch.float64)
        b = torch.tensor([(r[2] - r[0]) / r[2] for r in rows], dtype=torch.float64)
        h = torch.linalg.lstsq(a, b.unsqueeze(1)).solution.squeeze(1).tolist()
        if min(h) >= 0 or not active:
            break
        active.pop(min(range(len(h)), key=lambda i: h[i]))  # the most negative term is zero; fit the others
        if not active:
            h = []
            break
    values = dict.fromkeys(HOST_FIELDS, 0.0)
    values.update({HOST_FIELDS[j]: v for j, v in zip(active, h)})
    return HostCosts(**values)


def measure_host(world: int, link: Any, rates: ComputeRates, share: float, iters: int, warmup: int,
                 timeout: timedelta | None = None) -> tuple[HostCosts, list[dict[str, Any]]]:
    """Fit ``HostCosts`` on the probe chains (collective: every rank calls it)."""
    rows, report, runs = [], [], []
    for kind, mode in PROBES:
        for layers in PROBE_LAYERS:
            torch.manual_seed(0)
            net = probe_model(kind, layers)
            shape = (1, 4, 4) if kind.startswith("conv") else (16,)
            x, t = torch.randn(4 * world, *shape), torch.randint(0, 10, (4 * world,))
            g = strategy_graph(net, (x,), compute=rates)
            specs = shared(g.specs, share)
            degrees = probe_degrees(specs, world, mode)

            def cost(host: HostCosts) -> float:
                graph = build_graph(specs, g.edges, world, bandwidth=link.bandwidth, latency=link.latency,
                                    alltoall=False, host=host)
                return strategy_cost(graph, choice_of(graph, degrees))

            base = cost(HostCosts())
            unit = [cost(HostCosts(**{f: 1.0})) - base for f in HOST_FIELDS]
            runs.append((StrategyRuntime(g.module, g.nodes, g.specs, degrees, timeout=timeout), x, t))
            report.append({"probe": f"{kind}-{mode}", "layers": layers, "base_s": base,
                           "per_unit": dict(zip(HOST_FIELDS, unit))})
    for r, measured in zip(report, time_steps(runs, iters, warmup)):
        r["measured_s"] = measured
        rows.append((r["base_s"], [r["per_unit"][f] for f in HOST_FIELDS], measured))
    host = fit_host(rows)
    for r, (base, unit, _) in zip(report, rows):
        r["fitted_s"] = base + sum(u * getattr(host, f) for u, f in zip(unit, HOST_FIELDS))
    return host, report


# --- the models ------------------------------------------------------------------------------------


def rank0s(graph: LayerGraph, strategy: Strategy) -> Strategy:
    """Rank 0's ``strategy`` on every rank (collective). Each rank costs the graph from the same measurements, but
    a least-squares fit can differ in the last bit by process, and the search has exact ties (two choices of equal
    cost): ranks that broke one differently ran different collectives and hung (StrategyRuntime now refuses them)."""
    choice = torch.tensor(strategy.choice, dtype=torch.int64)
    dist.broadcast(choice, 0)
    mine = tuple(int(c) for c in choice)
    return strategy if mine == strategy.choice else dataclasses.replace(strategy, choice=mine,
                                                                         cost=strategy_cost(graph, mine))


def eager_seconds(net: nn.Module, x: torch.Tensor, t: torch.Tensor, iters: int, warmup: int) -> float:
    """The median forward + backward of a copy of ``net`` on one rank's share of the batch in plain PyTorch, the
    slowest rank's (collective; every rank runs it at once, sharing the cores as the runtime does)."""
    net = copy.deepcopy(net).train()
    times = []
    for _ in range(warmup + iters):
        dist.barrier()
        start = time.perf_counter()
        nn.functional.cross_entropy(net(x), t).backward()
        times.append(time.perf_counter() - start)
    mine = torch.tensor(statistics.median(times[warmup:]), dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine)


def worker(rank: int, world: int, init: str, args: argparse.Namespace, rates: ComputeRates, out: str) -> None:
    torch.set_num_threads(1)
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timeout)
    link = calibrate_allreduce()
    share = max(1.0, world / (os.cpu_count() or 1))
    host, probes = measure_host(world, link, rates, share, args.probe_iters, args.warmup, timeout)
    rows = []
    for model in args.models:
        family, size = MODELS[model]
        torch.manual_seed(0)
        net = family.make_model(size)
        side = family.SIZES[size].image_size
        x = torch.randn(args.batch, 3, side, side)
        t = torch.randint(0, 10, (args.batch,))
        g = strategy_graph(net, (x,), compute=rates)
        calibrated = shared(g.specs, share)
        specs = calibrated
        local = eager_seconds(net, x[: args.batch // world], t[: args.batch // world], args.iters, args.warmup)
        beside = share
        if args.profiles:
            doc = json.loads((args.profiles / f"cpu-{model}-nodes.json").read_text())
            specs = profiled(g.specs, g.nodes, doc, args.batch // world, world)
            # the ranks computing at once, measured: plain PyTorch on every rank together against the profile alone
            beside = local / doc["model_seconds"][str(args.batch // world)] if args.beside else share
            specs = shared(specs, beside)
        bare_compute = sum(s.seconds / world + s.fixed_seconds for s in specs)
        bucket = args.bucket_layers
        graph = build_graph(specs, g.edges, world, bandwidth=link.bandwidth, latency=link.latency, alltoall=False,
                            host=host, bucket_layers=bucket)
        bare = build_graph(specs, g.edges, world, bandwidth=link.bandwidth, latency=link.latency, alltoall=False,
                           bucket_layers=bucket)
        mine, runs = [], []
        cases = [("dp", data_parallel(graph), graph, bucket), ("splitbrain-2", splitbrain(graph, g.specs, 2), graph, bucket),
                 ("auto", rank0s(graph, solve(graph)), graph, bucket)]
        if args.also_bucketed_dp and not bucket:
            other = build_graph(specs, g.edges, world, bandwidth=link.bandwidth, latency=link.latency, alltoall=False,
                                host=host, bucket_layers=True)
            cases.append(("dp, buckets", data_parallel(other), other, True))
        for name, strategy, graph, buckets in cases:
            degrees = [graph.layers[v].configs[c].degrees for v, c in enumerate(strategy.choice)]
            total = strategy_rows(graph, specs, strategy).rows[-1]
            runs.append((StrategyRuntime(g.module, g.nodes, g.specs, degrees, bucket_layers=buckets, timeout=timeout),
                         x, t))
            moved = sum(traffic_per_layer(g.specs, g.edges, degrees, alltoall=False))
            mine.append({"model": model, "ranks": world, "strategy": name, "configs": list(strategy.names(graph)),
                         "predicted_s": strategy.cost, "bytes_per_rank": moved,
                         "compute_s": total[2], "sync_s": total[3], "transfer_s": total[4],
                         "bare_model_s": strategy_cost(bare, strategy.choice),
                         "eager_local_s": local, "dp_compute_s": bare_compute, "compute_scale": beside,
                         "calibrated_s": strategy_cost(build_graph(calibrated, g.edges, world, bandwidth=link.bandwidth,
                                                                   latency=link.latency, alltoall=False, host=host,
                                                                   bucket_layers=buckets), strategy.choice),
                         "calibrated_dp_compute_s": sum(s.seconds / world + s.fixed_seconds for s in calibrated)})
        for row, measured in zip(mine, time_steps(runs, args.iters, args.warmup)):
            rows.append({**row, "measured_s": measured})
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows, "link": {"bandwidth": link.bandwidth, "latency": link.latency},
                                         "host": dataclasses.asdict(host), "probes": probes, "share": share}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--probe-iters", type=int, default=10, help="steps timed per host-cost probe")
    parser.add_argument("--bucket-layers", action="store_true", help="the models' runtimes sync gradients in "
                        "buckets over layers (StrategyRuntime(bucket_layers=True)), and the model costs them so")
    parser.add_argument("--also-bucketed-dp", action="store_true", help="also run dp with gradients bucketed over "
                        "layers, in turn with the others (the row 'dp, buckets')")
    parser.add_argument("--cached-compute", action="store_true", help="take calibrate_compute's cached rates "
                        "instead of measuring them now (under the same conditions as the steps)")
    parser.add_argument("--profiles", type=Path, default=None, help="per-node compute measured by profile_layers.py "
                        "--nodes (DIR/cpu-<model>-nodes.json) instead of the calibrated rates'")
    parser.add_argument("--beside", action="store_true", help="with --profiles: scale the profile's compute by what "
                        "the ranks' plain forward + backward measures, all ranks at once, against the profile's whole "
                        "model alone (the cores' sharing measured), instead of by ranks / cores")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a rank waits for a collective before "
                        "it fails (a hung strategy ends the run instead of stalling it)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rates, cached = calibrate_compute(threads=1, cache=args.cached_compute)  # measured now: the cache may be a loaded machine's
    print(describe(rates, cached=cached))
    load = [os.getloadavg()]
    started = time.perf_counter()
    results: dict[int, dict[str, Any]] = {}
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            mp.spawn(worker, args=(world, f"file://{tmp}/pg", args, rates, out), nprocs=world)
            results[world] = json.loads(Path(out).read_text())
    load.append(os.getloadavg())
    rows = [r for got in results.values() for r in got["rows"]]
    print(f"{'model':14} {'ranks':>5} {'strategy':13} {'predicted ms':>12} {'measured ms':>11} {'pred/meas':>9} "
          f"{'MB/rank':>8} {'bare model ms':>13}")
    for r in rows:
        print(f"{r['model']:14} {r['ranks']:>5} {r['strategy']:13} {1e3 * r['predicted_s']:12.1f} "
              f"{1e3 * r['measured_s']:11.1f} {r['predicted_s'] / r['measured_s']:9.2f} "
              f"{r['bytes_per_rank'] / 1e6:8.2f} {1e3 * r['bare_model_s']:13.1f}")
    print("compute alone (dp): model's ms vs plain PyTorch forward + backward on a rank's share of the batch: "
          + "; ".join(f"{r['model']} @ {r['ranks']}: {1e3 * r['dp_compute_s']:.1f} vs {1e3 * r['eager_local_s']:.1f}"
                      for r in rows if r["strategy"] == "dp"))
    for world, got in results.items():
        link, host = got["link"], got["host"]
        print(f"{world} ranks: link {link['bandwidth'] / 1e9:.2f} GB/s, {1e6 * link['latency']:.1f} us per step; host "
              + ", ".join(f"{k} {1e6 * v:.0f} us" for k, v in host.items())
              + f"; compute x{got['share']:g}")
        for p in got["probes"]:
            print(f"  probe {p['probe']:12} {p['layers']:>3} layers: measured {1e3 * p['measured_s']:7.2f} ms, "
                  f"fitted {1e3 * p['fitted_s']:7.2f} ms")
        for model in args.models:
            mine = [r for r in got["rows"] if r["model"] == model]
            pick = min(mine, key=lambda r: r["predicted_s"])
            fastest = min(mine, key=lambda r: r["measured_s"])
            print(f"  {model}: predicted fastest {pick['strategy']}, measured fastest {fastest['strategy']} "
                  f"({pick['measured_s'] / fastest['measured_s'] - 1:+.1%} for the pick)")
    if args.profiles:
        print("the calibrated model (no profile) of the same strategies, ms: " + "; ".join(
            f"{r['model']} @ {r['ranks']} {r['strategy']}: {1e3 * r['calibrated_s']:.1f}" for r in rows))
    print(f"took {time.perf_counter() - started:.0f} s")
    print("load average (1, 5, 15 min) before and after: " + "; ".join(" ".join(f"{v:.2f}" for v in x) for x in load))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows, "runs": {str(k): {kk: v for kk, v in got.items() if kk != "rows"}
                                                                for k, got in results.items()},
                                        "compute": dataclasses.asdict(rates), "load": load, "argv": sys.argv,
                                        "seconds": time.perf_counter() - started},
                                       indent=1))


if __name__ == "__main__":
    main()
