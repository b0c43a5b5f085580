"""Where each paper's headline holds: its metric swept over compute speed against link bandwidth (and the other axes
its claim depends on), by fxpipe's own simulator and cost models, graded cell by cell by paper_verdicts' thresholds.

Compute speed is the committed CPU profiles' compute divided by a scale (the same bytes): 1 is this machine (one
thread); ``H100_SCALE`` is an H100 SXM's published dense BF16 peak (989 TFLOP/s) over this machine's measured fp32
convolution rate (one thread, ``CPU_FLOPS``), so the H100 rows are modelled at published peak, not measured, and
optimistic (every layer at peak; bytes left at fp32). Links are published peaks one way: NVLink 4 (H100 SXM,
450 GB/s), PCIe 5 x16 (63 GB/s), 100 GbE (12.5 GB/s), 25 GbE (3.125 GB/s), and this machine's gloo over loopback as
measured (strategy_measured.py's calibrate_allreduce at 2 ranks). A cell reads the metric and R (the headline's
number met), P (half its gain: "partly"), or N (neither).

    python benchmarks/papers.py --regimes [--plot]
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import paper_profiles
import paper_verdicts

CPU_FLOPS = 93.9e9
"""This machine's fp32 convolution rate, one thread (benchmarks/results/strategy_measured/measured.json,
``compute.conv_flops``: 93.9 GFLOP/s)."""
H100_FLOPS = 989e12
"""H100 SXM, dense BF16 tensor-core peak (NVIDIA's published datasheet figure)."""
H100_SCALE = H100_FLOPS / CPU_FLOPS
SCALES: tuple[tuple[str, float], ...] = (("this CPU (1x)", 1.0), ("10x", 10.0), ("100x", 100.0), ("1000x", 1e3),
                                          ("H100 at 30% of peak", 0.3 * H100_SCALE), ("H100 peak", H100_SCALE))
LINKS: tuple[tuple[str, float, float], ...] = (
    ("gloo here (1.05 GB/s)", 1.05e9, 263e-6), ("25 GbE (3.1 GB/s)", 3.125e9, 25e-6),
    ("100 GbE (12.5 GB/s)", 12.5e9, 10e-6), ("PCIe 5 x16 (63 GB/s)", 63e9, 10e-6),
    ("NVLink 4 (450 GB/s)", 450e9, 5e-6))
NAMED = {"this CPU with gloo here (profiled)": (0, 0), "H100 + NVLink 4 (modelled)": (5, 4),
         "H100 + PCIe 5 (modelled)": (5, 3), "H100 + 100 GbE (modelled)": (5, 2), "H100 + 25 GbE (modelled)": (5, 1)}
MARK = {"reproduced": "R", "partly": "P", "not reproduced": "N"}


@dataclasses.dataclass
class Grid:
    """One paper's sweep: the metric per (compute scale, link), its word per cell, and extra tables."""

    paper: str
    metric: str
    claim: str
    values: list[list[float]]
    words: list[list[str]]
    fmt: str
    extra: str = ""
    seconds: float = 0.0


def _scaled(scale: float) -> Any:
    """A context that divides every profiled compute time by ``scale`` (paper_profiles.COMPUTE_SCALE)."""
    class _Ctx:
        def __enter__(self) -> None:
            self.old = paper_profiles.COMPUTE_SCALE
            paper_profiles.COMPUTE_SCALE = scale

        def __exit__(self, *exc: object) -> None:
            paper_profiles.COMPUTE_SCALE = self.old

    return _Ctx()


def _sweep(cell: Callable[[float, str, float, float], tuple[float, str]]) -> tuple[list[list[float]], list[list[str]]]:
    values, words = [], []
    for _, scale in SCALES:
        row = [cell(scale, name, bw, lat) for name, bw, lat in LINKS]
        values.append([v for v, _ in row])
        words.append([w for _, w in row])
    return values, words


def render(g: Grid) -> str:
    head = "| compute \\ link | " + " | ".join(name for name, _, _ in LINKS) + " |"
    lines = [f"### {g.paper}: {g.metric}", "", f"Claim: {g.claim}.", "", head, "|" + " --- |" * (len(LINKS) + 1)]
    for (label, _), vals, words in zip(SCALES, g.values, g.words):
        cells = " | ".join(f"{format(v, g.fmt)} {MARK[w]}" for v, w in zip(vals, words))
        lines.append(f"| {label} | {cells} |")
    held = [f"{SCALES[i][0]} / {LINKS[j][0]}" for i in range(len(SCALES)) for j in range(len(LINKS))
            if g.words[i][j] == "reproduced"]
    half = [f"{SCALES[i][0]} / {LINKS[j][0]}" for i in range(len(SCALES)) for j in range(len(LINKS))
            if g.words[i][j] == "partly"]
    lines += ["", f"- Holds (R) in {len(held)} of {len(SCALES) * len(LINKS)} cells"
              + (f": {'; '.join(held)}" if held else "") + ".",
              f"- Half the gain (P) in {len(half)}" + (f": {'; '.join(half)}" if half else "")
              + "; elsewhere it fails."]
    lines += [f"- {name}: {format(g.values[i][j], g.fmt)} ({g.words[i][j]})" for name, (i, j) in NAMED.items()]
    if g.extra:
        lines += ["", g.extra]
    lines += ["", f"({g.seconds:.1f} s)"]
    return "\n".join(lines)


# --- the five sweeps ---------------------------------------------------------------------------------------------


def layerpipe(quick: bool = False) -> Grid:
    """LayerPipe's gain over PipeDream at 8 stages, 128 microbatches, vgg-16-512's profile (the paper's kind)."""
    import paper_layerpipe as lp

    started = time.perf_counter()

    def gain(model: str, scale: float, bw: float, lat: float, p: int, m_per: int = 16) -> float:
        with _scaled(scale):
            layers, _ = lp.profile_table(model)
        from fxpipe.schedules.generators import generate
        from fxpipe.schedules.simulate import simulate

        m = m_per * p
        costs = lp.stage_costs(layers, p, bw, lat, m)
        return (simulate(generate("async-1f1b", p, m), costs).makespan
                / simulate(generate("layerpipe-async", p, m), costs).makespan - 1)

    def cell(scale: float, _: str, bw: float, lat: float) -> tuple[float, str]:
        g = gain("vgg-16-512", scale, bw, lat, 8)
        return g, paper_verdicts.grade([paper_verdicts.Part("gain", g, 0.25)])

    values, words = _sweep(cell)
    extra = []
    if not quick:
        lines = ["Stages and microbatches (the per-cell claim is the paper's average, +25%), at two named points:", "",
                 "| model | stages | microbatches per stage | this CPU, gloo here | H100 peak + NVLink 4 (modelled) |",
                 "| --- | --- | --- | --- | --- |"]
        for model in ("vgg-16-512", "gpt-small"):
            for p in (4, 8):
                for m_per in (2, 16):
                    a = gain(model, 1.0, *LINKS[0][1:], p, m_per)
                    b = gain(model, H100_SCALE, *LINKS[4][1:], p, m_per)
                    lines.append(f"| {model} | {p} | {m_per} | {a:+.1%} | {b:+.1%} |")
        extra = lines
    return Grid("LayerPipe", "gain over PipeDream, vgg-16-512 profile, 8 stages, 128 microbatches (simulated)",
                "LayerPipe >= +25% over PipeDream (the paper's average; its best is +80%)", values, words, "+.1%",
                "\n".join(extra), time.perf_counter() - started)


def spectrain(quick: bool = False) -> Grid:
    """SpecTrain's samples/s over data parallelism's, 4 stages against 4 replicas, vgg-16-4096's profile."""
    import paper_layerpipe as lp
    from fxpipe.schedules.generators import generate
    from fxpipe.schedules.simulate import simulate

    started = time.perf_counter()
    stages, m = 4, 4

    def ratio(model: str, scale: float, bw: float, lat: float) -> float:
        with _scaled(scale):
            layers, _ = lp.profile_table(model)
        one = dataclasses.replace(lp.stage_costs(layers, 1, bw, lat, m), dp=stages)
        dp = simulate(generate("1f1b", 1, m), one).makespan / (stages * m)
        n = 16 * stages
        st = simulate(generate("async-1f1b", stages, n), lp.stage_costs(layers, stages, bw, lat, n)).makespan / n
        return dp / st

    def cell(scale: float, _: str, bw: float, lat: float) -> tuple[float, str]:
        r = ratio("vgg-16-4096", scale, bw, lat)
        return r, paper_verdicts.grade(paper_verdicts.spectrain([r]))

    values, words = _sweep(cell)
    extra = ""
    if not quick:
        lines = ["Model size (parameters against compute), at two named points:", "",
                 "| model | this CPU, gloo here | H100 peak + 25 GbE (modelled) | H100 peak + NVLink 4 (modelled) |",
                 "| --- | --- | --- | --- |"]
        for model in ("vgg-16-4096", "vgg-16-512", "gpt-small"):
            lines.append(f"| {model} | {ratio(model, 1.0, *LINKS[0][1:]):.2f}x | "
                         f"{ratio(model, H100_SCALE, *LINKS[1][1:]):.2f}x | "
                         f"{ratio(model, H100_SCALE, *LINKS[4][1:]):.2f}x |")
        extra = "\n".join(lines)
    return Grid("SpecTrain", "samples/s over data parallelism's, 4 stages against 4 replicas, vgg-16-4096 profile "
                "(simulated)", "SpecTrain up to 8.91x data parallelism on 4 GPUs", values, words, ".2f", extra,
                time.perf_counter() - started)


def optcnn(quick: bool = False) -> Grid:
    """The search's throughput over data parallelism's at 16 ranks (OptCNN's cost model), best of vgg-16-4096 and
    inception-small."""
    import paper_optcnn

    started = time.perf_counter()
    models = ("vgg-16-4096",) if quick else ("vgg-16-4096", "inception-small")

    def cell(scale: float, _: str, bw: float, lat: float) -> tuple[float, str]:
        best = 0.0
        with _scaled(scale):
            for name in models:
                rows = paper_optcnn.rows_for(paper_profiles.load(name), 16, {"bandwidth": bw, "latency": lat})
                best = max(best, rows[2][4] / rows[0][4])
        return best, paper_verdicts.grade(paper_verdicts.optcnn([best]))

    values, words = _sweep(cell)
    extra = ""
    if not quick:
        lines = ["Ranks and model (search over data parallelism, cost model), at two named points:", "",
                 "| model | ranks | this CPU, gloo here | H100 peak + NVLink 4 (modelled) |",
                 "| --- | --- | --- | --- |"]
        for name in ("vgg-16-4096", "resnet-small", "inception-small"):
            for d in (4, 8, 16):
                got = []
                for scale, (_, bw, lat) in ((1.0, LINKS[0]), (H100_SCALE, LINKS[4])):
                    with _scaled(scale):
                        rows = paper_optcnn.rows_for(paper_profiles.load(name), d, {"bandwidth": bw, "latency": lat})
                    got.append(f"{rows[2][4] / rows[0][4]:.2f}x")
                lines.append(f"| {name} | {d} | {got[0]} | {got[1]} |")
        extra = "\n".join(lines)
    return Grid("OptCNN", f"search over data parallelism, 16 ranks, global batch 64, best of {', '.join(models)} "
                "(cost model)",
                "the layer-wise strategy >= 1.4x data parallelism (PAPERS.md 2b's recollection, unverified)", values,
                words, ".2f", extra, time.perf_counter() - started)


def splitbrain(quick: bool = False) -> Grid:
    """SplitBrain's modelled speedup / ranks at 16 ranks (K = 4) over the compute-link grid, graded with the model
    state it saves on VGG-16 at 32x32 (4096 head); and the saving over head width, image size and K."""
    import paper_splitbrain as sb

    started = time.perf_counter()
    mem = sb.memory_rows("vgg-16-4096", (4,), measured={})
    saved = float(mem[0][9].rstrip("%")) / 100

    def cell(scale: float, name: str, bw: float, lat: float) -> tuple[float, str]:
        with _scaled(scale):
            row = sb.throughput_rows("vgg-16-4096", name, (1, 16), {"bandwidth": bw, "latency": lat})[-1]
        return row[8], paper_verdicts.grade(paper_verdicts.splitbrain(saved, row[8]))

    values, words = _sweep(cell)
    extra = ""
    if not quick:
        lines = [f"The grid grades speedup / ranks together with the model state saved at K = 4 on VGG-16 at 32x32 "
                 f"with the 4096-wide head ({saved:.0%}; the claim: 67%). Model state saved against data parallelism "
                 "(cost model) over the classifier's size:", "",
                 "| VGG-16 image side | head width | classes | K = 2 | K = 4 | K = 8 |",
                 "| --- | --- | --- | --- | --- | --- |"]
        for side, width, classes in ((32, 512, 10), (32, 4096, 10), (64, 4096, 10), (224, 4096, 1000)):
            lines.append(f"| {side} | {width} | {classes} | " + " | ".join(
                f"{x:.1%}" for x in _saved(side, width, classes, (2, 4, 8))) + " |")
        lines += ["", "Speedup / ranks at 16 ranks, SplitBrain (K = 4) against data parallelism, at the named points "
                  "(cost model):", "", "| setup | SplitBrain | data parallelism |", "| --- | --- | --- |"]
        for name, (i, j) in NAMED.items():
            with _scaled(SCALES[i][1]):
                row = sb.throughput_rows("vgg-16-4096", LINKS[j][0], (1, 16),
                                         {"bandwidth": LINKS[j][1], "latency": LINKS[j][2]})[-1]
            lines.append(f"| {name} | {row[8]:.2f} | {row[6] / 16:.2f} |")
        extra = "\n".join(lines)
    return Grid("SplitBrain", "modelled speedup / ranks at 16 ranks (K = 4), vgg-16-4096 profile, global batch 64; "
                "graded with the model state saved", "up to 67% memory saved with near-linear speedup (>= 0.8 per "
                "rank)", values, words, ".2f", extra, time.perf_counter() - started)


def _saved(side: int, width: int, classes: int, groups: Sequence[int]) -> list[float]:
    """Model state saved by SplitBrain over dp per K, VGG-16 at ``side`` with a ``width``-wide head (meta device)."""
    import torch

    import paper_splitbrain as sb
    from fxpipe.models.vgg import _VGG16, VGG
    from fxpipe.passes.strategy_graph import strategy_graph
    from fxpipe.planning.strategies import build_graph, data_parallel, splitbrain

    with torch.device("meta"):
        model = VGG(_VGG16, image_size=side, fc_width=width, num_classes=classes, dropout=0.0)
        x = torch.empty(sb.MEASURE_BATCH, 3, side, side)
    g = strategy_graph(model, (x,))
    out = []
    for k in groups:
        graph = build_graph(list(g.specs), list(g.edges), k, bandwidth=1e10, latency=1e-5, optimizer="momentum",
                            spatial=False)
        dp = sb._memory(list(g.specs), graph, data_parallel(graph).choice)[0]
        split = sb._memory(list(g.specs), graph, splitbrain(graph, list(g.specs), k,
                                                            min_param_bytes=sb.SHARD_ABOVE).choice)[0]
        out.append(1 - split / dp)
    return out


def akintoye(quick: bool = False) -> Grid:
    """Merging's S(8)/8, graded with merging over data parallelism at 8 devices; the better of vgg-16-512's and
    gpt-small's profiles per cell (by the grade, then S/N)."""
    import paper_akintoye as ak

    started = time.perf_counter()
    models = ("gpt-small",) if quick else ("vgg-16-512", "gpt-small")

    def rows(scale: float, name: str, bw: float, lat: float) -> tuple:
        out = []
        with _scaled(scale):
            for model in models:
                r = ak.rows_for(paper_profiles.load(model), name, range(8, 9), {"bandwidth": bw, "latency": lat})[0]
                word = paper_verdicts.grade(paper_verdicts.akintoye(r[4], r[3] / r[9]))
                out.append((-paper_verdicts.WORDS.index(word), r[4], word, r))
        return max(out)[2:]

    def cell(scale: float, name: str, bw: float, lat: float) -> tuple[float, str]:
        word, r = rows(scale, name, bw, lat)
        return r[4], word

    values, words = _sweep(cell)
    extra = ""
    if not quick:
        lines = ["Per cell, the model shown and its S(8) with merging / with data parallelism (the grade's second part):",
                 "", "| compute \\ link | " + " | ".join(n for n, _, _ in LINKS) + " |", "|" + " --- |" * (len(LINKS) + 1)]
        for label, scale in SCALES:
            cells = []
            for name, bw, lat in LINKS:
                _, r = rows(scale, name, bw, lat)
                cells.append(f"{r[0]}: {r[3]:.2f} / {r[9]:.2f}")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines += ["", "Devices and microbatches (vgg-16-512; S(N)/N with merging, and data parallelism's), at two named "
                  "points:", "", "| N | microbatches | this CPU, gloo here | H100 peak + NVLink 4 (modelled) |",
                  "| --- | --- | --- | --- |"]
        for n in (4, 8):
            for m in (8, 32, 128):
                got = []
                for scale, (_, bw, lat) in ((1.0, LINKS[0]), (H100_SCALE, LINKS[4])):
                    old, ak.MICROBATCHES = ak.MICROBATCHES, m
                    try:
                        with _scaled(scale):
                            r = ak.rows_for(paper_profiles.load("vgg-16-512"), "x", range(n, n + 1),
                                            {"bandwidth": bw, "latency": lat})[0]
                    finally:
                        ak.MICROBATCHES = old
                    got.append(f"{r[4]:.2f} (dp {r[10]:.2f})")
                lines.append(f"| {n} | {m} | {got[0]} | {got[1]} |")
        extra = "\n".join(lines)
    return Grid("Akintoye et al.", f"merging's S(8)/8, better of {', '.join(models)}, 32 microbatches, 1F1B "
                "(simulated); graded with merging over data parallelism", "almost linear speedup (S/N >= 0.8) "
                "outperforming data parallelism", values, words, ".2f", extra, time.perf_counter() - started)


SWEEPS: dict[str, Callable[[bool], Grid]] = {"akintoye": akintoye, "optcnn": optcnn, "splitbrain": splitbrain,
                                             "spectrain": spectrain, "layerpipe": layerpipe}


def plot(grids: Sequence[Grid], out: Path) -> list[Path]:
    """One figure per paper: the metric per cell as a heat map, each cell marked R/P/N, the named setups boxed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for g in grids:
        fig, ax = plt.subplots(figsize=(8, 4.2))
        data = [[v if math.isfinite(v) else 0.0 for v in row] for row in g.values]
        im = ax.imshow(data, cmap="viridis", aspect="auto")
        fig.colorbar(im, ax=ax, label=g.metric.split(",")[0])
        ax.set_xticks(range(len(LINKS)), [n for n, _, _ in LINKS], rotation=20, ha="right", fontsize=7)
        ax.set_yticks(range(len(SCALES)), [n for n, _ in SCALES], fontsize=7)
        for i, row in enumerate(g.values):
            for j, v in enumerate(row):
                ax.text(j, i, f"{format(v, g.fmt)}\n{MARK[g.words[i][j]]}", ha="center", va="center", fontsize=6,
                        color="white")
        for i, j in NAMED.values():
            ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.5))
        ax.set_title(f"{g.paper}: {g.claim}\n(red: this CPU and H100 setups; H100 modelled at published peak)",
                     fontsize=8)
        fig.tight_layout()
        path = out / f"{g.paper.split()[0].lower()}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(papers: Sequence[str], quick: bool = False, plot_dir: Path | None = None) -> str:
    grids = [SWEEPS[p](quick) for p in papers]
    text = "\n\n".join(render(g) for g in grids)
    if plot_dir is not None:
        try:
            import matplotlib  # noqa: F401
        except ModuleNotFoundError:
            return text + "\n\n--plot: matplotlib is not installed (pip install -e '.[plot]'); no figures written."
        text += "\n\n" + "\n".join(f"wrote {p}" for p in plot(grids, plot_dir))
    return text
