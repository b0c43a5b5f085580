"""Simulated VGG-16 and gpt-base at 4, 8 and 16 ranks: per-layer strategies against data parallelism,
SplitBrain and pipelines, in one cost model.

Every candidate is P pipeline stages (P a power of two dividing the ranks d) on groups of g = d / P ranks,
each stage with one configuration per layer (``planning.strategies``: ``stage_graph`` cuts the stage out
with its ``recv`` input and ``send`` sink, ``build_graph`` on g ranks). One formula for all of them:

    stage s per microbatch:  t_s = (compute_s + transfers_s) / m  +  send_s / (g m bandwidth) + latency   (s < P-1)
    step                  =  (m + P - 1) x max_s t_s  +  max_s sync_s                                (GPipe fill + drain)

so P = 1 is compute + transfers + sync of the whole batch. Gradients are synced in buckets over layers, as
``StrategyRuntime(bucket_layers=True)`` does: the search costs each layer's share of a bucket
(``build_graph(bucket_layers=True)``), and every candidate's sync is then counted exactly, ``ceil`` of the
25 MiB buckets per sync group (``bucketed_sync``; ``--per-layer-sync``: each layer's gradients on their own,
the runtime's default). Rows: ``dp`` (P = 1, every layer batch-split, each layer's gradients all-reduced on
their own), ``dp (DDP buckets)`` (the same, gradients in 25 MiB buckets over all layers, as DDP and
fxpipe's pipeline x dp do: fewer latencies), ``dp (search's model)`` (dp as the search costs it: equal to
DDP's when the buckets are counted exactly),
``splitbrain-K`` (P = 1, the preset; the best K), ``search`` (P = 1, ``solve``), ``pipeline`` (P = d, one
rank per stage), ``pipeline x dp`` (the best P with every stage batch-split) and ``hybrid`` (the best P with
every stage's strategy searched); the chosen one is the fastest. Cuts: for each P, the valid single-tensor
cut points nearest to equal shares of compute. Bytes: what one rank receives per step (the largest over
stages): ``traffic_per_layer`` plus the activations it receives from the previous stage.

Models: VGG-16 (ImageNet, on meta, ``strategy_graph``: one layer per fx node), global batch 128; gpt-base
(``fxpipe.models.gpt`` "base": 8 blocks, d = 256, seq 128; ``torch.fx`` cannot trace it, so its layers are
written here from its config: per block ln_1 + qkv (one matmul: LayerNorm folded into the matmul that reads
it), attention (elementwise over heads), proj, the residual add, ln_2 + fc, gelu, proj, add; embedding and
head as matmuls), global batch 64 sequences. Compute: 3 x FLOPs / 1e11 for matmuls, 2 x bytes / 1e10 for
the rest (the plan defaults, one CPU core; ``--device-flops 1e14 --device-mem-bw 1e12`` for a GPU-class
rank); link 10 GB/s, 10 us per step (state yours with --bandwidth / --latency); all-to-all available (NCCL).

    python benchmarks/strategy_hybrid.py --out benchmarks/results/strategy_hybrid/cpu_core.json
    python benchmarks/strategy_hybrid.py --device-flops 1e14 --device-mem-bw 1e12 \
        --out benchmarks/results/strategy_hybrid/gpu_class.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

from fxpipe.errors import OptionError
from fxpipe.planning.cost import allreduce_seconds
from fxpipe.models import gpt, vgg
from fxpipe.passes.strategy_graph import strategy_graph
from fxpipe.planning.strategies import (
    LayerSpec,
    sync_collectives,
    build_graph,
    data_parallel,
    solve,
    splitbrain,
    stage_graph,
    strategy_rows,
    traffic_per_layer,
)

F32 = 4
FLOPS, MEM_BW = 1e11, 1e10  # set by main() from --device-flops / --device-mem-bw


def vgg16(batch: int) -> tuple[tuple[LayerSpec, ...], tuple[tuple[int, int], ...]]:
    with torch.device("meta"):
        model = vgg.make_model("16")
    g = strategy_graph(model, (torch.empty(batch, 3, 224, 224, device="meta"),), device_flops=FLOPS,
                       device_mem_bw=MEM_BW)
    return g.specs, g.edges


def gpt_base(batch: int) -> tuple[tuple[LayerSpec, ...], tuple[tuple[int, int], ...]]:
    c = gpt.SIZES["base"].config
    seq = gpt.SIZES["base"].seq_len
    tokens, d = batch * seq, c.n_embd
    act = tokens * d * F32
    specs: list[LayerSpec] = [LayerSpec("tokens", out_bytes=tokens * 8, kind="input")]
    edges: list[tuple[int, int]] = []

    def add(spec: LayerSpec, *inputs: int) -> int:
        specs.append(spec)
        edges.extend((i, len(specs) - 1) for i in inputs)
        return len(specs) - 1

    def matmul(name: str, fan_in: int, fan_out: int, src: int, ln: bool = False) -> int:
        params = (fan_in * fan_out + fan_out + (2 * fan_in if ln else 0)) * F32
        seconds = 3 * 2 * tokens * fan_in * fan_out / FLOPS
        return add(LayerSpec(name, seconds, params, tokens * fan_out * F32, tokens * fan_in * F32, "matmul",
                             bias_bytes=fan_out * F32), src)

    def elementwise(name: str, out: float, *src: int, seconds: float | None = None) -> int:
        t = 2 * 2 * out / MEM_BW if seconds is None else seconds
        return add(LayerSpec(name, t, 0.0, out, out, "elementwise"), *src)

    x = add(LayerSpec("wte", 2 * act / MEM_BW, c.vocab_size * d * F32, act, 0.0, "matmul"), 0)
    for b in range(c.n_layer):
        qkv = matmul(f"h{b}.ln_1+qkv", d, 3 * d, x, ln=True)
        attn = elementwise(f"h{b}.attn", act, qkv, seconds=3 * 4 * batch * seq * seq * d / FLOPS)
        proj = matmul(f"h{b}.proj", d, d, attn)
        x = elementwise(f"h{b}.add_1", act, proj, x)
        fc = matmul(f"h{b}.ln_2+fc", d, 4 * d, x, ln=True)
        gelu = elementwise(f"h{b}.gelu", 4 * act, fc)
        proj2 = matmul(f"h{b}.mlp_proj", 4 * d, d, gelu)
        x = elementwise(f"h{b}.add_2", act, proj2, x)
    head = matmul("ln_f+head", d, c.vocab_size, x, ln=True)
    add(LayerSpec("loss", kind="loss"), head)
    return tuple(specs), tuple(edges)


def cut_points(specs: Any, edges: Any) -> list[int]:
    """Indices i where a stage may end before layer i: every edge crossing i leaves from layer i - 1."""
    return [i for i in range(2, len(specs) - 1) if all(u == i - 1 for u, v in edges if u < i <= v)]


def balanced_cuts(specs: Any, edges: Any, stages: int) -> list[int] | None:
    points = cut_points(specs, edges)
    seconds = [s.seconds for s in specs]
    total = math.fsum(seconds)
    prefix = [math.fsum(seconds[:i]) for i in range(len(specs) + 1)]
    cuts: list[int] = []
    for k in range(1, stages):
        options = [p for p in points if p > (cuts[-1] if cuts else 0)]
        if len(options) < stages - k:
            return None
        best = min(options[:len(options) - (stages - k - 1)], key=lambda p: abs(prefix[p] - total * k / stages))
        cuts.append(best)
    return cuts


def bucketed_sync(specs: Any, degrees: Any, args: argparse.Namespace) -> float:
    """A stage's gradient sync as ``StrategyRuntime(bucket_layers=True)`` runs it: each sync group's gradients in
    one buffer cut into 25 MiB buckets (``ceil`` of them, where the search's per-layer cost counts fractions;
    groups told apart by their size), BatchNorm statistics all-reduced on their own."""
    groups: dict[int, float] = {}
    stats = 0.0
    for spec, d in zip(specs, degrees):
        collectives = sync_collectives(spec, d)
        k = 2 if spec.stat_bytes and collectives else 0
        for b, n in collectives[:len(collectives) - k]:
            groups[n] = groups.get(n, 0.0) + b
        stats += math.fsum(allreduce_seconds(b, n, args.bandwidth, args.latency)
                           for b, n in collectives[len(collectives) - k:])
    return stats + math.fsum(allreduce_seconds(t, n, args.bandwidth, args.latency) for n, t in groups.items())


def candidate(specs: Any, edges: Any, ranks: int, stages: int, how: str, args: argparse.Namespace,
              group: int = 2, bucket: bool = True) -> dict[str, Any] | None:
    g = ranks // stages
    cuts = balanced_cuts(specs, edges, stages) if stages > 1 else []
    if cuts is None:
        return None
    bounds = list(zip([0, *cuts], [*cuts, len(specs)]))
    per_mb, syncs, received = [], [], []
    configs: list[str] = []
    for s, (lo, hi) in enumerate(bounds):
        sub, sub_edges, index = stage_graph(specs, edges, lo, hi)
        graph = build_graph(sub, sub_edges, g, bandwidth=args.bandwidth, latency=args.latency, bucket_layers=bucket)
        try:
            strategy = (data_parallel(graph) if how == "dp" else splitbrain(graph, sub, min(group, g)) if how == "sb"
                        else solve(graph))
        except OptionError:  # a preset needs a configuration the layer's dims do not split evenly (1000 classes / 16)
            return None
        total = strategy_rows(graph, sub, strategy).rows[-1]
        compute, sync, transfer = total[2], total[3], total[4]
        degrees = [graph.layers[v].configs[c].degrees for v, c in enumerate(strategy.choice)]
        inbound = specs[lo - 1].out_bytes / g if lo > 0 else 0.0
        received.append(math.fsum(traffic_per_layer(sub, sub_edges, degrees)) + inbound)
        send = specs[hi - 1].out_bytes / g if hi < len(specs) else 0.0
        m = args.microbatches
        per_mb.append((compute + transfer) / m + ((send / m / args.bandwidth + args.latency) if send else 0.0))
        syncs.append(bucketed_sync(sub, degrees, args) if bucket else sync)
        configs += [n for n, i in zip(strategy.names(graph), index) if i >= 0]
    step = (args.microbatches + stages - 1) * max(per_mb) + max(syncs)
    return {"stages": stages, "group": g, "step_s": step, "bytes_per_rank": max(received), "cuts": cuts,
            "configs": sorted(set(configs))}


def _dp_graph(specs: Any, edges: Any, ranks: int, args: argparse.Namespace) -> tuple[Any, Any, Any]:
    graph = build_graph(specs, edges, ranks, bandwidth=args.bandwidth, latency=args.latency)
    return graph, specs, data_parallel(graph)


def rows_for(specs: Any, edges: Any, ranks: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    powers = [2 ** k for k in range(ranks.bit_length()) if ranks % 2 ** k == 0]
    rows = [{"row": "dp", **candidate(specs, edges, ranks, 1, "dp", args, bucket=False)}]  # type: ignore[dict-item]
    # DDP's buckets: one all-reduce per 25 MiB of gradients over all layers, not one (or more) per layer.
    params = math.fsum(sp.param_bytes for sp in specs)
    bucketed = dict(rows[0], row="dp (DDP buckets)")
    layer_sync = math.fsum(strategy_rows(*_dp_graph(specs, edges, ranks, args)).rows[-1][3:4])
    bucketed["step_s"] = rows[0]["step_s"] - layer_sync + allreduce_seconds(params, ranks, args.bandwidth, args.latency)
    rows.append(bucketed)
    if args.per_layer_sync:  # the rows below as before: each layer's gradients all-reduced on their own
        rows.append({"row": "search", **candidate(specs, edges, ranks, 1, "auto", args, bucket=False)})  # type: ignore[dict-item]
        return rows_rest(specs, edges, ranks, args, rows, powers, bucket=False)
    rows.append({"row": "dp (search's model)", **candidate(specs, edges, ranks, 1, "dp", args)})  # type: ignore[dict-item]
    return rows_rest(specs, edges, ranks, args, rows, powers)


def rows_rest(specs: Any, edges: Any, ranks: int, args: argparse.Namespace, rows: list[dict[str, Any]],
              powers: list[int], bucket: bool = True) -> list[dict[str, Any]]:
    sb = [dict(c, row=f"splitbrain-{k}") for k in powers if k > 1
          and (c := candidate(specs, edges, ranks, 1, "sb", args, k, bucket)) is not None]
    rows.append(min(sb, key=lambda r: r["step_s"]))
    if bucket:
        rows.append({"row": "search", **candidate(specs, edges, ranks, 1, "auto", args)})  # type: ignore[dict-item]
    pipe = candidate(specs, edges, ranks, ranks, "auto", args, bucket=bucket)
    if pipe is not None:
        rows.append({"row": "pipeline", **pipe})
    pdp = [c for p in powers if 1 < p < ranks and (c := candidate(specs, edges, ranks, p, "dp", args, bucket=bucket))]
    if pdp:
        rows.append({"row": "pipeline x dp", **min(pdp, key=lambda r: r["step_s"])})
    hybrid = [c for p in powers if (c := candidate(specs, edges, ranks, p, "auto", args, bucket=bucket))]
    rows.append({"row": "hybrid", **min(hybrid, key=lambda r: r["step_s"])})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", nargs="+", type=int, default=[4, 8, 16])
    parser.add_argument("--bandwidth", type=float, default=10e9)
    parser.add_argument("--latency", type=float, default=10e-6)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--device-flops", type=float, default=1e11, help="FLOP/s per rank (1e11: one CPU core)")
    parser.add_argument("--device-mem-bw", type=float, default=1e10, help="bytes/s per rank")
    parser.add_argument("--per-layer-sync", action="store_true", help="every candidate all-reduces each layer's "
                        "gradients on their own (the strategy runtime's default) instead of in buckets over layers")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    global FLOPS, MEM_BW
    FLOPS, MEM_BW = args.device_flops, args.device_mem_bw
    print(f"compute {FLOPS:.3g} FLOP/s and {MEM_BW:.3g} B/s per rank; link {args.bandwidth / 1e9:g} GB/s, "
          f"{1e6 * args.latency:g} us per step")
    models = {"vgg-16 (batch 128)": vgg16(128), "gpt-base (batch 64 x 128 tokens)": gpt_base(64)}
    results: dict[str, Any] = {}
    verdicts = []
    for name, (specs, edges) in models.items():
        for ranks in args.ranks:
            rows = rows_for(specs, edges, ranks, args)
            results[f"{name} @ {ranks}"] = rows
            print(f"\n{name} on {ranks} ranks ({args.microbatches} microbatches)")
            print(f"  {'candidate':16} {'P x g':>7} {'step ms':>9} {'MB/rank':>9}  configurations")
            for r in rows:
                print(f"  {r['row']:16} {r['stages']:>3} x {r['group']:<3} {1e3 * r['step_s']:9.2f} "
                      f"{r['bytes_per_rank'] / 1e6:9.2f}  {' '.join(r['configs'][:8])}")
            by = {r["row"]: r for r in rows}
            best = by["hybrid"]
            search = by["search"]
            for other in [r for r in rows if r["row"].startswith("dp") or r["row"].startswith("splitbrain")]:
                ok = search["step_s"] <= other["step_s"] * (1 + 1e-12)
                verdicts.append(ok)
                print(f"  {'PASS' if ok else 'FAIL'}: search {1e3 * search['step_s']:.2f} ms <= {other['row']} "
                      f"{1e3 * other['step_s']:.2f} ms")
            for other in [r for r in rows if r["row"] != "hybrid" and r["row"] != "search"]:
                ok = best["step_s"] <= other["step_s"] * (1 + 1e-12)
                verdicts.append(ok)
                print(f"  {'PASS' if ok else 'FAIL'}: hybrid {1e3 * best['step_s']:.2f} ms <= {other['row']} "
                      f"{1e3 * other['step_s']:.2f} ms ({other['step_s'] / best['step_s']:.2f}x)")
            fewer = best["bytes_per_rank"] < by["dp"]["bytes_per_rank"]
            print(f"  {'PASS' if fewer else 'FAIL'}: hybrid moves {best['bytes_per_rank'] / 1e6:.2f} MB per rank, dp "
                  f"{by['dp']['bytes_per_rank'] / 1e6:.2f} MB")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"results": results, "bandwidth": args.bandwidth, "latency": args.latency,
                                        "microbatches": args.microbatches, "device_flops": FLOPS,
                                        "device_mem_bw": MEM_BW}, indent=1))


if __name__ == "__main__":
    main()
