"""LayerPipe (Unnikrishnan & Parhi, 2021) against PipeDream, in the paper's own comparison, simulated.

PipeDream: ``async-1f1b`` (1F1B's order, no flush, each stage's backward one fused B+W action: weight
stashing). LayerPipe: ``layerpipe-async`` (the same order with B and W split, each W one backward
slot after its B: the delayed weight gradient; the input gradient leaves for the stage before as
soon as B ends), on the partitioner DP's best contiguous partition for the stage count and link, and,
where fxpipe compiled the model (the roofline rows), also with the inter-layer moves the partitioner
plans (``plan_stages(moves=...)``, what ``fxpipe compile --balance-backward`` runs: an activation's
derivative at a cut runs in the next stage's B). A stream of 16 x stages microbatches. Per-layer costs:
the committed profiles (benchmarks/profiles/, through paper_profiles, so papers.py's --profiles and
--compute-scale apply) and fxpipe's FLOP/byte roofline at ``GPU_FLOPS``, ``GPU_MEM_BW`` for full-size
models (modelled, kept in results/paper_layers/). Links from profiles/links.json.

    python benchmarks/paper_layerpipe.py [--quick] [--measure]   (--measure recompiles results/paper_layers/)

Departures: the paper assigns layer tasks (F, the two halves of the input gradient, the weight
gradient) to processors freely; here W stays on its stage's rank, in the rank's order.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

sys.path.insert(0, str(HERE))
import paper_profiles  # noqa: E402  (the committed profiles and links.json, as papers.py sets them)
import paper_verdicts  # noqa: E402
import papers_measured  # noqa: E402


def _links() -> dict[str, tuple[float, float]]:
    """Link models: name -> (bytes per second, seconds of latency per message), from ``profiles/links.json``."""
    names = {"nvlink": "NVLink", "pcie4": "PCIe 4 x16", "25gbe": "25 GbE"}
    return {f"{names.get(k, k)} ({v['bandwidth'] / 1e9:.0f} GB/s)": (float(v["bandwidth"]), float(v["latency"]))
            for k, v in paper_profiles.links().items()}


LINKS = _links()
# A GPU-class device (H100-like, sustained, not peak): what the zoo's FLOP and byte counts are timed at.
GPU_FLOPS = 300e12
GPU_MEM_BW = 2.0e12
STAGES = (4, 7, 8, 9)
# Costs of two kinds: the committed profiles (benchmarks/profiles/, measured per layer; papers.py --profiles and
# --compute-scale apply), and fxpipe's FLOP/byte roofline at GPU_FLOPS / GPU_MEM_BW for (zoo model, microbatch
# rows) at full size (VGG-16 at 224^2, ResNet-50, a GPT), kept in results/paper_layers/. VGG is the paper's kind.
PROFILED = ("vgg-16-512", "resnet-small", "gpt-small")
QUICK_PROFILED = ("vgg-16-512",)
MODELS = (("vgg-16", 32), ("resnet-50", 32), ("gpt-base", 8))
QUICK_MODELS = (("vgg-16", 32),)


LAYERS = HERE / "results" / "paper_layers"


def layer_table(model: str, rows: int, write: bool = False) -> list[dict[str, Any]]:
    """Per layer of zoo ``model`` (``rows`` rows a microbatch): F, B, W seconds at ``GPU_FLOPS``/``GPU_MEM_BW``, the
    bytes its output sends over the cut after it, its saved and parameter bytes, and the activation derivatives that
    may move across the cut after it (``movable``: [name, seconds]). fxpipe's own numbers (a compile with one stage
    per layer, on the meta device), read from ``results/paper_layers/``; ``write`` recompiles and rewrites them."""
    path = LAYERS / f"{model}-{rows}.json"
    if path.exists() and not write:
        layers: list[dict[str, Any]] = json.loads(path.read_text())["layers"]
        if all("movable" in x for x in layers):
            return layers
    import importlib

    import torch

    import fxpipe
    from fxpipe import models

    importlib.import_module("fxpipe.passes.partition_stages")
    ps = sys.modules["fxpipe.passes.partition_stages"]
    seen: dict[str, Any] = {}
    plain = ps.movable_derivatives

    def keep(gm: Any, stats: Any) -> Any:  # the partitioner's own list of what may move, per cut
        seen["movable"] = plain(gm, stats)
        return seen["movable"]

    zoo = models.build(model, device="meta", batch_size=rows)
    opts = {"verify_each": False, "device_flops": GPU_FLOPS, "device_mem_bw": GPU_MEM_BW}
    ps.movable_derivatives = keep
    try:
        with torch.device("meta"):
            n = len(fxpipe.compile(zoo.model, zoo.example_inputs, stages=1, **opts).plan.layers)
            plan = fxpipe.compile(zoo.model, zoo.example_inputs, stages=n, balance_backward=True, **opts).plan
    finally:
        ps.movable_derivatives = plain
    movable = [*seen["movable"], []]
    out = [{"name": layer.name, "f": layer.f, "b": layer.b, "w": layer.w, "send_bytes": st.send_bytes,
            "saved_bytes": float(layer.saved_bytes), "param_bytes": float(layer.param_bytes),
            "movable": [[v, float(t)] for v, t in movable[i]]}
           for i, (layer, st) in enumerate(zip(plan.layers, plan.stages))]
    if write:
        LAYERS.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"model": model, "rows": rows, "gpu_flops": GPU_FLOPS, "gpu_mem_bw": GPU_MEM_BW,
                                    "layers": out}, indent=1) + "\n")
    return out


def stage_costs(layers: list[dict[str, Any]], stages: int, bandwidth: float, latency: float,
                microbatches: int, planner: str = "step") -> Any:
    """The Costs of the contiguous partition of ``layers`` into ``stages`` that fxpipe's partitioner DP
    (``planning.stage_count.best_partition``) finds fastest on this link: PipeDream's best partition. ``planner``
    "bottleneck": ``plan_stages``' least-bottleneck partition (what ``fxpipe compile --stages P`` plans), "moves": the
    partition and inter-layer moves ``plan_stages(moves=...)`` plans together (``--balance-backward``; the first
    stage moves nothing out: its inputs take no gradient); for both, (Costs, derivatives moved)."""
    from fxpipe.planning.cost import transfer_time
    from fxpipe.planning.stage_count import best_partition
    from fxpipe.planning.stage_dp import Moves, plan_stages
    from fxpipe.schedules.simulate import Costs

    times = [x["f"] + x["b"] + x["w"] for x in layers]
    moved: tuple[tuple[int, str, float], ...] = ()
    if planner != "step":
        movable = [[(str(v), float(t)) for v, t in x.get("movable", [])] for x in layers[:-1]]
        plan = plan_stages(times, stages, cut_bytes=[x["send_bytes"] for x in layers[:-1]], bandwidth=bandwidth,
                           latency=latency, moves=Moves(movable, first=False) if planner == "moves" else None)
        bounds, moved = plan.bounds, plan.moves
    else:
        cuts = [transfer_time(x["send_bytes"], bandwidth=bandwidth, latency=latency) for x in layers[:-1]]
        found = best_partition(times, cuts, stages, microbatches)
        assert found is not None
        bounds = found[0]
    spans = list(zip(bounds, bounds[1:]))

    def total(key: str, i: int, j: int) -> float:
        return float(sum(x[key] for x in layers[i:j]))

    # stage 0 sends no input gradient: its B (activation gradients inside it) serves only its W
    f = tuple(total("f", i, j) for i, j in spans)
    b = [0.0 if i == 0 else total("b", i, j) for i, j in spans]
    for cut, _, seconds in moved:  # the derivative runs in the B of the stage starting at the cut
        k = list(bounds).index(cut)
        b[k - 1] -= seconds
        b[k] += seconds
    w = tuple(total("w", i, j) + (total("b", i, j) if i == 0 else 0.0) for i, j in spans)
    send = tuple(layers[j - 1]["send_bytes"] if j < len(layers) else 0.0 for _, j in spans)
    held = tuple(total("saved_bytes", i, j) for i, j in spans)
    grads = tuple(total("param_bytes", i, j) for i, j in spans)
    costs = Costs(f, tuple(max(x, 0.0) for x in b), w, send, held, held, latency, bandwidth, grad_bytes=grads,
                  allreduce_latency=latency, allreduce_bandwidth=bandwidth)
    return (costs, len(moved)) if planner != "step" else costs


def profile_table(model: str) -> tuple[list[dict[str, float]], str]:
    """The committed profile of ``model`` as :func:`layer_table`'s rows (compute scaled as papers.py says), and
    where it came from."""
    prof = paper_profiles.load(model)
    f, b, w = prof.field("f"), prof.field("b"), prof.field("w")
    cuts = prof.cut_bytes + [0.0]
    out = [{"name": x["name"], "f": f[i], "b": b[i], "w": w[i], "send_bytes": cuts[i],
            "saved_bytes": float(x["saved_bytes"]), "param_bytes": float(x["param_bytes"])}
           for i, x in enumerate(prof.doc["layers"])]
    return out, f"{prof.source}: {prof.device}, microbatch {prof.doc['microbatch']}"


def tables(quick: bool, write: bool = False) -> list[tuple[str, list[dict[str, Any]], str]]:
    """(model, per-layer rows, source) for the profiled models and the roofline ones."""
    out = [(m, *profile_table(m)) for m in (QUICK_PROFILED if quick else PROFILED)]
    out += [(m, layer_table(m, r, write), f"roofline at {GPU_FLOPS / 1e12:.0f} TFLOP/s, {GPU_MEM_BW / 1e12:.1f} TB/s, "
             f"microbatch {r} (modelled)") for m, r in (QUICK_MODELS if quick else MODELS)]
    return out


def rows(models: list[tuple[str, list[dict[str, Any]], str]], stages: tuple[int, ...] = STAGES,
         links: dict[str, tuple[float, float]] | None = None) -> list[dict[str, Any]]:
    from fxpipe.schedules.generators import generate
    from fxpipe.schedules.simulate import simulate

    out = []
    for model, layers, source in models:
        for p in stages:
            if p > len(layers):
                continue
            m = 16 * p
            for link, (bandwidth, latency) in (links or LINKS).items():
                costs = stage_costs(layers, p, bandwidth, latency, m)
                pd = simulate(generate("async-1f1b", p, m), costs)
                lp = simulate(generate("layerpipe-async", p, m), costs)
                # a bound, not a simulation of two streams: W entirely hidden behind the next B or F
                hidden = simulate(generate("layerpipe-async", p, m), dataclasses.replace(costs, w=(0.0,) * p))
                row = {"model": model, "source": source, "stages": p, "link": link, "pd": m / pd.makespan,
                       "lp": m / lp.makespan, "bound": m / hidden.makespan, "lpm": None, "moved": None,
                       "pd_bytes": sum(r.bytes_sent for r in pd.ranks) / m,
                       "lp_bytes": sum(r.bytes_sent for r in lp.ranks) / m}
                if any(x.get("movable") for x in layers):
                    # the compile's own planner, without and with the moves: PipeDream on the first, LayerPipe on both
                    plain, _ = stage_costs(layers, p, bandwidth, latency, m, planner="bottleneck")
                    moved_costs, moved = stage_costs(layers, p, bandwidth, latency, m, planner="moves")
                    row["pd2"] = m / simulate(generate("async-1f1b", p, m), plain).makespan
                    row["lp2"] = m / simulate(generate("layerpipe-async", p, m), plain).makespan
                    row["lpm"] = m / simulate(generate("layerpipe-async", p, m), moved_costs).makespan
                    row["moved"] = moved
                out.append(row)
    return out


def best_gain(r: dict[str, Any]) -> float:
    """LayerPipe's gain over PipeDream in a row, each on its partition: on PipeDream's, or, where the compile's planner
    ran, LayerPipe with the inter-layer moves against PipeDream on that planner's partition without them; the
    larger."""
    gain = r["lp"] / r["pd"] - 1
    return max(gain, r["lpm"] / r["pd2"] - 1) if r.get("lpm") is not None else gain


def graded(data: list[dict[str, Any]]) -> list[float]:
    """The gains the verdict grades: :func:`best_gain` of every row at 7-9 stages."""
    return [best_gain(r) for r in data if 7 <= r["stages"] <= 9]


def table(data: list[dict[str, Any]]) -> str:
    lines = ["| model | stages | link | PipeDream steps/s | LayerPipe steps/s | speedup | compile's partition: PipeDream / "
             "LayerPipe / LayerPipe + inter-layer moves steps/s (derivatives moved) | speedup with moves | bound: W "
             "costing nothing | MB sent per step (PD / LP) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data:
        moved = "-" if r["lpm"] is None else f"{r['pd2']:.1f} / {r['lp2']:.1f} / {r['lpm']:.1f} ({r['moved']})"
        gain = "-" if r["lpm"] is None else f"{r['lpm'] / r['pd2'] - 1:+.1%}"
        lines.append(f"| {r['model']} | {r['stages']} | {r['link']} | {r['pd']:.1f} | {r['lp']:.1f} | "
                     f"{r['lp'] / r['pd'] - 1:+.1%} | {moved} | {gain} | {r['bound'] / r['pd'] - 1:+.1%} | "
                     f"{r['pd_bytes'] / 1e6:.2f} / {r['lp_bytes'] / 1e6:.2f} |")
    lines += ["", "At 7-9 stages (the paper's range), LayerPipe (with moves where planned) over PipeDream:", ""]
    for kind in ("profiled", "roofline"):
        mine = [r for r in data if ("roofline" in r["source"]) == (kind == "roofline") and 7 <= r["stages"] <= 9]
        if not mine:
            continue
        gains = graded(mine)
        bound = [r["bound"] / r["pd"] - 1 for r in mine]
        moves = [r["lpm"] / r["lp2"] - 1 for r in mine if r["lpm"] is not None]
        lines.append(f"- {kind} costs: average {statistics.mean(gains):+.1%}, best {max(gains):+.1%}; the bound with W "
                     f"costing nothing: average {statistics.mean(bound):+.1%}, best {max(bound):+.1%}"
                     + (f"; LayerPipe with the inter-layer moves against without, on the compile's planner: {min(moves):+.1%} "
                        f"to {max(moves):+.1%}" if moves else ""))
    return "\n".join(lines)


def verdict(data: list[dict[str, Any]]) -> str:
    parts = paper_verdicts.layerpipe(graded(data))
    same = all(abs(r["pd_bytes"] - r["lp_bytes"]) <= 1e-9 * max(1.0, r["pd_bytes"]) for r in data)
    line = paper_verdicts.sentence(paper_verdicts.LAYERPIPE, parts, "+.1%",
                                   "every row at 7-9 stages above, profiled and roofline, simulated")
    why = (" In one stream per stage both schedules run F+B+W per microbatch, so LayerPipe gains only what W off "
           "the backward's path saves in the fill and drain; the bound column (W costing nothing: not a simulated "
           "schedule) is the most a second stream for W could add. The same bytes cross each cut under both schedules, so 'less communication' "
           "is not reproduced." if same else " Communication differs between the two schedules.")
    return line + why


def main(quick: bool = False, measure: bool = False) -> str:
    """The table as markdown; ``measure`` recompiles the roofline models' per-layer tables (results/paper_layers/)
    and rewrites them; otherwise nothing is written."""
    models = tables(quick, write=measure and not quick)
    data = rows(models)
    sources = "\n".join(f"- {m}: {src}" for m, _, src in models)
    head = ("## LayerPipe against PipeDream (simulated; 16 x stages microbatches streamed; PipeDream's best "
            f"contiguous partition per link)\n\nCosts per layer:\n\n{sources}\n\nThe inter-layer moves need the "
            "compiled graph (which derivatives may cross a cut): the roofline rows have it, the profiled rows do not "
            "('-'); the bound column is LayerPipe with W costing nothing, not a simulated schedule.\n\n")
    doc = papers_measured.load("layerpipe")
    measured = (papers_measured.layerpipe_table(doc) if doc else
                "No configuration of this table is measured on this machine yet (`python benchmarks/papers_measured.py "
                "--paper layerpipe` measures PipeDream and LayerPipe at 2 and 4 stages).")
    return head + table(data) + "\n\n" + verdict(data) + "\n\n" + measured + "\n"


if __name__ == "__main__":
    print(main(quick="--quick" in sys.argv[1:], measure="--measure" in sys.argv[1:]))
