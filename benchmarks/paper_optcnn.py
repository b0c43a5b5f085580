"""OptCNN (Jia et al.): throughput and bytes moved of the searched per-layer strategy, against data parallelism
and layer-wise model parallelism, for vgg-16, resnet and an Inception-like network at 4, 8 and 16 simulated GPUs.

The strategies are costed by OptCNN's own cost model (``fxpipe.planning.strategies``: compute per configuration,
parameter sync, transfers between layouts, summed), on the profile's strategy graph (one layer per fx node, global
batch 64) with the profile's measured compute:

- **data parallelism**: every layer splits the batch over all d devices;
- **model parallelism**: every layer that can splits its output channels over all d devices (a Linear or
  convolution column split; a layer with too few channels splits them as far as they go and the batch the rest);
- **OptCNN**: the search (node and edge elimination, exact under the model).

Throughput is samples per second (batch / modelled step); bytes are what one device receives per step (transfers
both ways and gradient all-reduces). The table is the cost model's only. What this machine measured is
``benchmarks/strategy_measured.py``'s committed runs (vgg-small and resnet-small at 2 and 4 gloo ranks: dp, SplitBrain
and the search's pick, in the search's calibrated model against the measured step); the second table sets them side
by side (model / measured, within 20% or not). ``strategy_measured.py`` measures them again (minutes).
"""

from __future__ import annotations

import json
from pathlib import Path

from tabulate import tabulate

import paper_profiles
from fxpipe.planning.strategies import (Degrees, LayerSpec, Strategy, build_graph, data_parallel, solve,
                                        strategy_cost, traffic_per_layer)

MODELS = ("vgg-16-4096", "resnet-small", "inception-small")
RANKS = (4, 8, 16)
LINK = "pcie4"
MEASURED = tuple(Path(__file__).parent / "results" / "strategy_measured" / f for f in ("measured.json",
                                                                                      "measured_repeat.json"))


def _specs(p: paper_profiles.Profile) -> tuple[list[LayerSpec], list[tuple[int, int]]]:
    if not p.doc.get("specs"):
        raise ValueError(f"{p.source} has no strategy graph")
    specs = [LayerSpec(**s) for s in p.specs]
    return specs, [(u, v) for u, v in p.doc["edges"]]


def model_parallel(graph, d: int) -> Strategy:  # type: ignore[no-untyped-def]
    """Per layer the configuration with the largest channel (column) degree, the batch taking the rest of d."""
    choice = []
    for layer in graph.layers:
        ok = [(c, cfg.degrees) for c, cfg in enumerate(layer.configs) if cfg.degrees is not None
              and cfg.degrees.row == 1 and cfg.degrees.spatial == 1 and cfg.degrees.product == d]
        c, _ = max(ok, key=lambda t: (t[1].column, -t[1].sample))
        choice.append(c)
    return Strategy(tuple(choice), strategy_cost(graph, choice), "model-parallel", len(graph.layers))


def rows_for(p: paper_profiles.Profile, d: int, link: dict) -> list[tuple]:
    specs, edges = _specs(p)
    batch = p.doc["strategy_batch"]
    graph = build_graph(specs, edges, d, bandwidth=link["bandwidth"], latency=link["latency"], optimizer="sgd",
                        spatial=False)
    out = []
    base = None
    for label, s in (("data parallel", data_parallel(graph)), ("model parallel", model_parallel(graph, d)),
                     ("OptCNN search", solve(graph))):
        degrees = [graph.layers[v].configs[c].degrees or Degrees() for v, c in enumerate(s.choice)]
        moved = sum(traffic_per_layer(specs, edges, degrees))
        if base is None:
            base = (s.cost, moved)
        out.append((p.model, d, label, round(s.cost * 1e3, 3), round(batch / s.cost, 1), round(base[0] / s.cost, 2),
                    round(moved / 2**20, 2), round(moved / base[1], 3) if base[1] else 0.0))
    return out


HEADERS = ("model", "GPUs", "strategy", "step ms", "samples/s", "x dp", "MiB received", "bytes / dp")


def verdict(rows: list[tuple]) -> str:
    groups = {(r[0], r[1]): [x for x in rows if (x[0], x[1]) == (r[0], r[1])] for r in rows}
    faster = sum(g[2][4] >= max(g[0][4], g[1][4]) * (1 - 1e-9) for g in groups.values())
    strictly = sum(g[2][4] > g[0][4] * 1.01 for g in groups.values())
    fewer = sum(g[2][6] < g[0][6] for g in groups.values())
    n = len(groups)
    word = "reproduced" if strictly == n and fewer == n else "partly" if strictly or fewer else "not"
    return (f"**Verdict: {word}** (in the cost model). The search is at least as fast as both baselines in {faster} of "
            f"{n} cases (by construction: it is exact under the model both are costed by), more than 1% faster than "
            f"data parallelism in {strictly}, and moves fewer bytes than data parallelism in {fewer}. The paper's "
            "claim is measured throughput on 16 P100s; here the measured check is only at 2 and 4 CPU ranks, where the "
            "pick was data parallelism or 2-6% slower than it (benchmarks/RESULTS.md, 'Strategies measured').")


def measured_rows(paths: tuple[Path, ...] = MEASURED) -> list[tuple]:
    """Per measured configuration (model, ranks, strategy): the search's model of the step against the measured
    step, in each committed run (run 1 first), and whether every run is within 20%; also the model's compute alone
    against plain PyTorch's forward + backward on a rank's share of the batch (where the shortfall is)."""
    runs = [json.loads(p.read_text())["rows"] for p in paths if p.exists()]
    out = []
    for i, r in enumerate(runs[0] if runs else []):
        same = [run[i] for run in runs]
        ratios = [paper_profiles.model_over_measured(x["predicted_s"], x["measured_s"]) for x in same]
        out.append((r["model"], r["ranks"], r["strategy"], round(r["predicted_s"] * 1e3, 1),
                    round(r["measured_s"] * 1e3, 1), " / ".join(f"{x:.2f}" for x in ratios),
                    "yes" if all(paper_profiles.within(x["predicted_s"], x["measured_s"]) for x in same) else "no",
                    f"{r['dp_compute_s'] * 1e3:.1f} / {r['eager_local_s'] * 1e3:.1f}", _share(r)))
    return out


MEASURED_HEADERS = ("model", "ranks", "strategy", "model ms (run 1)", "measured ms (run 1)",
                    "model / measured (runs 1 / 2)", "within 20%", "dp compute: model / PyTorch ms",
                    "compute shortfall / gap")


def _share(r: dict) -> object:
    """How much of the step the model misses (measured - model) the compute term's shortfall (plain PyTorch's
    forward + backward on a rank's share - the model's compute for it) accounts for."""
    gap = r["measured_s"] - r["predicted_s"]
    return round((r["eager_local_s"] - r["dp_compute_s"]) / gap, 2) if gap > 0 else "-"


def measured_verdict(rows: list[tuple], paths: tuple[Path, ...] = MEASURED) -> str:
    if not rows:
        return "No measured configuration is committed (run benchmarks/strategy_measured.py)."
    off = [r for r in rows if r[6] != "yes"]
    ratios = [float(x) for r in rows for x in r[5].split(" / ")]
    shares = [r[8] for r in off if r[8] != "-"]
    loads = [json.loads(p.read_text()).get("load") for p in paths if p.exists()]
    load = [x for run in loads if run for pair in run for x in pair]
    shared = (f" the runs shared this 2-core machine with other work (load average {min(load):.1f}-{max(load):.1f} "
              "around them), which the model's compute (scaled by ranks / cores only) does not see;") if load else ""
    return (f"Model against measured: {min(ratios):.2f}-{max(ratios):.2f}; within 20% in {len(rows) - len(off)} of "
            f"{len(rows)} configurations (in every run), not within 20% in "
            f"{', '.join(f'{r[0]} {r[1]} ranks {r[2]}' for r in off) or 'none'}. The model under-predicts"
            f"{' in every row' if max(ratios) < 1 else ''}:{shared} and on resnet-small its compute (each layer's "
            "FLOPs at the calibrated rates) is well under what plain PyTorch's forward + backward takes on a rank's "
            "share (BatchNorm and small convolutions cost more than the roofline says)"
            + (f"; that shortfall is {min(shares):.0%}-{max(shares):.0%} of the gap in the rows not within 20% (last "
               "column), the rest lies outside compute (the host costs and the link, fitted on small probes under "
               "that load, or what no term models)"
               if shares else "") + ". Not fixed "
            "here: the search's calibrated model (fxpipe.planning.strategies with benchmarks/strategy_measured.py's "
            "calibration) would need per-layer measured compute, as the paper's own table above takes from the "
            "profiles, and a rerun on an otherwise idle machine.")


def main(quick: bool = False) -> str:
    models = MODELS[:1] if quick else MODELS
    ranks = RANKS[:1] if quick else RANKS
    link = paper_profiles.links()[LINK]
    rows, sources = [], []
    for name in models:
        p = paper_profiles.load(name)
        sources.append(f"{p.source} ({p.device})")
        for d in ranks:
            rows.extend(rows_for(p, d, link))
    table = tabulate(rows, headers=HEADERS, tablefmt="github")
    measured = measured_rows()
    cited = ", ".join(str(p.relative_to(Path(__file__).parent.parent)) for p in MEASURED if p.exists())
    return (f"## OptCNN (Jia, Lin, Qi, Aiken): per-layer parallelism at {', '.join(map(str, ranks))} GPUs\n\n"
            f"OptCNN's cost model on {LINK} ({link['what']}), global batch 64, SGD; profiles: {', '.join(sources)} "
            f"(compute scaled to the profile's measurement).\n\n{table}\n\n{verdict(rows)}\n\n"
            f"Measured here (committed: {cited or 'none'}; float32, global batch 32, SGD momentum, median step "
            f"of 8 on 2-core CPU gloo ranks; the search's calibrated cost model, not the profiles):\n\n"
            f"{tabulate(measured, headers=MEASURED_HEADERS, tablefmt='github')}\n\n{measured_verdict(measured)}\n")
