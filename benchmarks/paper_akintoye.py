"""Akintoye et al.: speedup S(N) and S(N)/N for N = 1..8 with merging, against data parallelism and against
partitioning without merging, simulated from the committed profiles.

- **merging** (``fxpipe.planning.merge``): from one partition per layer, merged while the communication saved
  outweighs the imbalance added, on at most N devices (it may use fewer);
- **no merging**: the N-stage partition that balances compute alone (``best_partition`` with free cuts), the
  communication then paid as it falls;
- **data parallelism**: N replicas, each taking m / N of the microbatches, gradients all-reduced (ring).

Every configuration runs the same global batch, m = 4 x 8 = 32 microbatches of the profile's microbatch; the
pipelines run 1F1B. S(N) = m x one device's microbatch (F + B + W) / the simulated step. The column "= best
partition" says whether merging's cuts are the best contiguous partition (``best_partition`` with the cuts' costs)
at the stage count merging ended with: what the merge sequence replays.
"""

from __future__ import annotations

import math

from tabulate import tabulate

import paper_profiles
import paper_verdicts
import papers_measured
from fxpipe.planning.cost import transfer_time
from fxpipe.planning.merge import merge_partitions, merge_rows
from fxpipe.planning.stage_count import best_partition
from fxpipe.schedules.generators import generate
from fxpipe.schedules.simulate import Costs, simulate

MICROBATCHES = 32
MODELS = ("vgg-16-512", "resnet-small", "gpt-small")
LINKS = ("pcie4", "25gbe")


def _pipeline(p: paper_profiles.Profile, bounds: tuple[int, ...], link: dict, m: int) -> float:
    spans = list(zip(bounds, bounds[1:]))
    f, b, w = (tuple(math.fsum(p.field(k)[i:j]) for i, j in spans) for k in ("f", "b", "w"))
    saved = tuple(math.fsum(p.field("saved_bytes")[i:j]) for i, j in spans)
    sends = tuple(p.cut_bytes[j - 1] if j < len(p.times) else 0.0 for _, j in spans)
    costs = Costs(f, b, w, sends, saved, saved, link["latency"], link["bandwidth"])
    return simulate(generate("1f1b", len(spans), m, costs), costs).makespan


def _data_parallel(p: paper_profiles.Profile, n: int, link: dict, m: int) -> float:
    f, b, w = (math.fsum(p.field(k)) for k in ("f", "b", "w"))
    saved = math.fsum(p.field("saved_bytes"))
    costs = Costs((f,), (b,), (w,), (0.0,), (saved,), (saved,), link["latency"], link["bandwidth"], dp=n,
                  grad_bytes=(math.fsum(p.field("param_bytes")),), allreduce_latency=link["latency"],
                  allreduce_bandwidth=link["bandwidth"])
    return simulate(generate("1f1b", 1, m // n if m % n == 0 else math.ceil(m / n), costs), costs).makespan


def rows_for(p: paper_profiles.Profile, link_name: str, counts: range, link: dict | None = None) -> list[tuple]:
    """S(N) rows of ``p`` on ``link_name`` (or on ``link``, a {bandwidth, latency} dict, named ``link_name``)."""
    link = link or paper_profiles.links()[link_name]
    m, one = MICROBATCHES, math.fsum(p.times)
    cut_s = [transfer_time(x, bandwidth=link["bandwidth"], latency=link["latency"]) for x in p.cut_bytes]
    rows = []
    for n in counts:
        merged = merge_partitions(p.times, cut_s, m, max_stages=n, cut_bytes=p.cut_bytes)
        found = best_partition(p.times, [0.0] * len(cut_s), n, m)
        assert found is not None
        plain = found[0]
        s_merge = m * one / _pipeline(p, merged.bounds, link, m)
        s_plain = m * one / _pipeline(p, plain, link, m)
        # dp at N: N replicas of m / N microbatches (m = 32 is not a multiple of 3, 5, 6, 7: ceil, counted as done)
        per = math.ceil(m / n)
        s_dp = per * n * one / _data_parallel(p, n, link, m)
        best = best_partition(p.times, cut_s, merged.stages, m)
        same = "yes" if best is not None and tuple(best[0]) == tuple(merged.bounds) else "no"
        rows.append((p.model, link_name, n, round(s_merge, 2), round(s_merge / n, 2), merged.stages,
                     len(merged.steps), round(s_plain, 2), round(s_plain / n, 2), round(s_dp, 2), round(s_dp / n, 2),
                     same))
    return rows


HEADERS = ("model", "link", "N", "S merge", "S/N merge", "stages used", "merges", "S no-merge", "S/N no-merge",
           "S dp", "S/N dp", "= best partition")


def verdict(rows: list[tuple]) -> str:
    top = max(x[2] for x in rows)
    at_top = [r for r in rows if r[2] == top]
    efficiency = max(r[4] for r in at_top)
    over_dp = max(r[3] / r[9] for r in at_top)
    dp_eff = min(r[10] for r in at_top)
    line = paper_verdicts.sentence(paper_verdicts.AKINTOYE, paper_verdicts.akintoye(efficiency, over_dp), ".2f",
                                   f"simulated, N = {top}, best model and link")
    loss = max(1 - r[3] / r[7] for r in rows)
    helped = sum(r[3] > r[7] * 1.01 for r in rows)
    same = sum(r[11] == "yes" for r in rows)
    return (f"{line} Data parallelism's S/N there is at least {dp_eff:.2f}. Merging is more than 1% faster than "
            f"partitioning without merging in {helped} of {len(rows)} rows and at most {max(loss, 0.0):.1%} slower "
            f"in any; its cuts are best_partition's (the step model's optimum) at the stage count it ends with in {same} of "
            f"{len(rows)} rows. A synchronous 1F1B pipeline of m = "
            f"{MICROBATCHES} microbatches caps S/N at m / (m + N - 1) = {MICROBATCHES / (MICROBATCHES + top - 1):.2f}."
            + (" On these CPU profiles compute dwarfs every link, so merging changes little and data parallelism is "
               "near-linear (the regime map, --regimes, moves the ratio)." if helped == 0 else "")
            + " The paper's own models, devices and numbers were not readable (PAPERS.md 1b).")


def merge_table(p: paper_profiles.Profile, link_name: str, n: int) -> str:
    """Every merge of ``p`` on ``link_name`` at ``n`` devices: which two partitions, what it saves and adds, why."""
    link = paper_profiles.links()[link_name]
    cut_s = [transfer_time(x, bandwidth=link["bandwidth"], latency=link["latency"]) for x in p.cut_bytes]
    plan = merge_partitions(p.times, cut_s, MICROBATCHES, max_stages=n, cut_bytes=p.cut_bytes)
    headers = ("#", "partitions", "cut", "MiB saved", "comm saved ms", "imbalance added ms", "step ms",
               "partitions after", "why")
    return (f"Merges of {p.model} on {link_name} at N = {n} (from {len(p.times)} partitions, one per layer, to "
            f"{plan.stages}; cuts {' '.join(map(str, plan.bounds[1:-1])) or '-'}):\n\n"
            + tabulate(merge_rows(plan, p.names), headers=headers, tablefmt="github"))


def main(quick: bool = False) -> str:
    models = MODELS[:1] if quick else MODELS
    links = LINKS[:1] if quick else LINKS
    counts = range(1, 5) if quick else range(1, 9)
    rows, sources = [], []
    for name in models:
        p = paper_profiles.load(name)
        sources.append(f"{p.source} ({p.device}, microbatch {p.doc['microbatch']})")
        for link in links:
            rows.extend(rows_for(p, link, counts))
    table = tabulate(rows, headers=HEADERS, tablefmt="github")
    link_text = "; ".join(f"{k}: {paper_profiles.links()[k]['what']}" for k in links)
    return (f"## Akintoye et al.: layer-wise partitioning and merging, S(N) for N = 1..{counts[-1]}\n\n"
            f"Simulated 1F1B, {MICROBATCHES} microbatches per step for every N; profiles: {', '.join(sources)}; "
            f"links: {link_text}.\n\n{table}\n\n{merge_table(paper_profiles.load(models[-1]), links[-1], counts[-1])}"
            f"\n\n{verdict(rows)}\n\n{measured()}\n")


def measured() -> str:
    """S(2) measured on this machine against the simulator, from the committed run (papers_measured.py)."""
    doc = papers_measured.load("akintoye")
    if doc is None:
        return ("No configuration of this table is measured on this machine yet (`python benchmarks/papers_measured.py "
                "--paper akintoye` measures S(2) on resnet-small).")
    return papers_measured.akintoye_table(doc)
