"""Merging partitions (Akintoye et al.): from one partition per layer, merge adjacent partitions while the
communication a merge saves outweighs the imbalance it adds.

The objective is stage_count's pipeline step, ``sum(t) + 2 * sum(c) + (m - 1) * max(max(t), max(c))``. Merging
partitions k and k+1 removes their cut: it saves ``2 c`` of fill and drain (and lowers the pace when that cut was
the slowest link) and adds imbalance when the merged partition becomes the slowest stage.

Taking the best single merge while it pays is not optimal: under a pace of 2, layers 1, 1, 1, 1 with cuts 2,
3, 2 lose the middle cut first and then must keep both outer ones (4), where keeping the middle one costs 3. So the
merges are chosen jointly: for every pace cap X (a
partition's time or a cut's), a DP over the layer boundaries finds the cheapest cuts to keep (a merge is forced
where a cut is slower than X or the devices are too few, forbidden where the merged partition would exceed X),
and the cap with the least step wins; this equals brute force over every merge sequence. The chosen merges are
then applied one at a time from the layer-wise partition, largest gain first, so the table shows each merge's
saving, its imbalance and why it was taken, and ends with the best merge left and why it was not.

Pure: plain values in, plain values out; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from fxpipe.errors import PlanError
from fxpipe.planning.stage_count import pipeline_step

__all__ = ["MergePlan", "MergeStep", "merge_partitions", "merge_rows"]

_TIE = 1e-9


@dataclass(frozen=True)
class MergeStep:
    """One merge: partitions ``left`` and ``right`` (layer ranges ``[i, j)``) become one; ``cut`` is the
    boundary removed (between layers cut-1 and cut). ``step_s`` is the step after it."""

    left: tuple[int, int]
    right: tuple[int, int]
    cut: int
    cut_bytes: float
    comm_saved_s: float  # 2 c of fill and drain, plus (m - 1) x the pace it lowers when that cut set it
    imbalance_added_s: float  # (m - 1) x the pace the merged partition raises
    step_s: float
    partitions: int  # after the merge
    reason: str

    @property
    def gain_s(self) -> float:
        return self.comm_saved_s - self.imbalance_added_s


@dataclass(frozen=True)
class MergePlan:
    """The final partition (bounds ``0 = b_0 < ... < b_P = L``), its step, the step it started from, each merge
    in the order applied, and the best merge not taken (None when one partition is left) with why."""

    bounds: tuple[int, ...]
    step_s: float
    start_bounds: tuple[int, ...]
    start_step_s: float
    steps: tuple[MergeStep, ...]
    stop: MergeStep | None

    @property
    def stages(self) -> int:
        return len(self.bounds) - 1


def _effect(bounds: Sequence[int], cut: int, pre: Sequence[float], cuts: Sequence[float],
            m: int) -> tuple[float, float, float]:
    """Removing ``cut`` from ``bounds``: (comm saved, imbalance added, step after)."""
    spans = [pre[j] - pre[i] for i, j in zip(bounds, bounds[1:])]
    kept = [cuts[b - 1] for b in bounds[1:-1]]
    k = bounds.index(cut)
    others = [c for b, c in zip(bounds[1:-1], kept) if b != cut]
    before = max(max(spans), max(kept, default=0.0))
    without_cut = max(max(spans), max(others, default=0.0))
    merged = spans[:k - 1] + [spans[k - 1] + spans[k]] + spans[k + 1:]
    after = max(max(merged), max(others, default=0.0))
    saved = 2 * cuts[cut - 1] + (m - 1) * (before - without_cut)
    added = (m - 1) * (after - without_cut)
    return saved, added, pipeline_step(merged, others, m)


def _best_cuts(units: Sequence[int], pre: Sequence[float], cuts: Sequence[float], m: int,
               max_parts: int) -> tuple[tuple[int, ...], float]:
    """The subset of the unit boundaries to keep (cuts at layer boundaries) with the least step, exactly."""
    u = len(units) - 1
    inner = list(units[1:-1])

    def span(a: int, b: int) -> float:  # units a..b-1
        return pre[units[b]] - pre[units[a]]

    cut_at = [cuts[units[a] - 1] if 0 < a < u else 0.0 for a in range(u + 1)]
    total = pre[units[-1]]
    candidates = sorted({span(a, b) for a in range(u) for b in range(a + 1, u + 1)} | {cuts[b - 1] for b in inner})
    inf = math.inf

    def table(cap: float) -> tuple[list[list[float]], list[list[int]]]:
        # cost[k][b]: least 2 x kept-cut seconds for units 0..b-1 in k partitions, every span and kept cut <= cap.
        slack = cap * (1 + 1e-12)
        cost = [[inf] * (u + 1) for _ in range(max_parts + 1)]
        back = [[-1] * (u + 1) for _ in range(max_parts + 1)]
        cost[0][0] = 0.0
        for k in range(1, max_parts + 1):
            for b in range(1, u + 1):
                for a in range(b - 1, -1, -1):
                    if span(a, b) > slack:
                        break
                    if cost[k - 1][a] == inf or (a > 0 and cut_at[a] > slack):
                        continue
                    c = cost[k - 1][a] + 2 * cut_at[a]
                    if c < cost[k][b] - 1e-15 * max(1.0, abs(c)):
                        cost[k][b], back[k][b] = c, a
        return cost, back

    # Feasibility only grows with the cap: bisect for the least cap any partition meets, and start there.
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if all(row[u] == inf for row in table(candidates[mid])[0]):
            lo = mid + 1
        else:
            hi = mid
    best: tuple[float, tuple[int, ...]] | None = None
    for cap in candidates[lo:]:
        if best is not None and total + (m - 1) * cap > best[0] * (1 + _TIE):
            break  # the pace alone now costs more than the best step: no larger cap can win
        cost, back = table(cap)
        for k in range(1, max_parts + 1):  # fewer partitions first: a tie keeps the fewer
            if cost[k][u] == inf:
                continue
            kept, b = [], u
            for kk in range(k, 0, -1):
                b = back[kk][b]
                if kk > 1:
                    kept.append(units[b])
            bounds = (units[0], *reversed(kept), units[-1])
            step = pipeline_step([pre[j] - pre[i] for i, j in zip(bounds, bounds[1:])],
                                 [cuts[x - 1] for x in bounds[1:-1]], m)
            if best is None or step < best[0] * (1 - _TIE):
                best = (step, bounds)
    assert best is not None  # one partition always fits the largest cap
    return best[1], best[0]


def merge_partitions(layer_times: Sequence[float], cut_seconds: Sequence[float], microbatches: int, *,
                     max_stages: int | None = None, start: Sequence[int] | None = None,
                     cut_bytes: Sequence[float] | None = None) -> MergePlan:
    """Merge from ``start`` (bounds; default one partition per layer) to the partition with the least step, using
    at most ``max_stages`` partitions (devices; default no limit). ``cut_seconds[b-1]`` is the cut between layers
    b-1 and b, one way; ``cut_bytes`` (same indexing) only labels the table.

    >>> plan = merge_partitions([1.0, 1.0, 1.0, 1.0], [2.0, 3.0, 2.0], 4)
    >>> plan.bounds, plan.step_s, [s.cut for s in plan.steps]
    ((0, 4), 16.0, [2, 1, 3])
    """
    n, m = len(layer_times), microbatches
    if n < 1:
        raise PlanError("cannot merge partitions of a graph with no layers; give at least one layer")
    if len(cut_seconds) != n - 1:
        raise PlanError(f"expected {n - 1} cut costs for {n} layers, got {len(cut_seconds)}")
    if m < 1:
        raise PlanError(f"microbatches must be at least 1 (got {m})")
    if any(t < 0 for t in layer_times) or any(c < 0 for c in cut_seconds):
        raise PlanError("layer times and cut costs must be non-negative; check the cost annotation")
    units = tuple(range(n + 1)) if start is None else tuple(start)
    if len(units) < 2 or units[0] != 0 or units[-1] != n or any(a >= b for a, b in zip(units, units[1:])):
        raise PlanError(f"start bounds {tuple(units)} must rise strictly from 0 to {n} (the layers); e.g. "
                        f"{tuple(range(n + 1))} for one partition per layer")
    limit = len(units) - 1 if max_stages is None else max_stages
    if limit < 1:
        raise PlanError(f"the device budget must be at least 1 (max stages: {max_stages})")
    limit = min(limit, len(units) - 1)
    pre = [0.0]
    for t in layer_times:
        pre.append(pre[-1] + t)
    nbytes = list(cut_bytes) if cut_bytes is not None else [0.0] * (n - 1)
    target, _ = _best_cuts(units, pre, cut_seconds, m, limit)
    remove = set(units[1:-1]) - set(target)

    def spans(bounds: Sequence[int]) -> list[float]:
        return [pre[j] - pre[i] for i, j in zip(bounds, bounds[1:])]

    def step_of(bounds: Sequence[int]) -> float:
        return pipeline_step(spans(bounds), [cut_seconds[b - 1] for b in bounds[1:-1]], m)

    def record(bounds: Sequence[int], cut: int, reason: str) -> MergeStep:
        saved, added, after = _effect(bounds, cut, pre, cut_seconds, m)
        k = list(bounds).index(cut)
        return MergeStep((bounds[k - 1], cut), (cut, bounds[k + 1]), cut, nbytes[cut - 1], saved, added, after,
                         len(bounds) - 2, reason)

    bounds = list(units)
    steps: list[MergeStep] = []
    while remove:
        # Largest gain first (ties: the earliest cut).
        cut = min(sorted(remove), key=lambda b: _effect(bounds, b, pre, cut_seconds, m)[2])
        saved, added, _ = _effect(bounds, cut, pre, cut_seconds, m)
        parts = len(bounds) - 1
        if parts > limit:
            reason = f"forced: {parts} partitions on {limit} devices"
        elif saved > added * (1 + _TIE) + 1e-15:
            reason = "saves more than it adds"
        else:
            reason = "adds more than it saves alone; the merges after it repay it"
        steps.append(record(bounds, cut, reason))
        bounds.remove(cut)
        remove.discard(cut)
    stop = None
    if len(bounds) > 2:
        cut = min(bounds[1:-1], key=lambda b: _effect(bounds, b, pre, cut_seconds, m)[2])
        stop = record(bounds, cut, "not taken: adds at least what it saves (no merge left lowers the step)")
    return MergePlan(tuple(bounds), step_of(bounds), units, step_of(units), tuple(steps), stop)


def merge_rows(plan: MergePlan, names: Sequence[str] | None = None) -> tuple[tuple[object, ...], ...]:
    """The merge table's rows (milliseconds): #, partitions merged, cut (with layer names), MiB saved per
    microbatch, comm saved, imbalance added, step after, partitions after, why; the stop row last."""
    def label(s: MergeStep) -> str:
        return f"{s.cut} ({names[s.cut - 1]} | {names[s.cut]})" if names is not None else str(s.cut)

    rows: list[tuple[object, ...]] = [
        (i + 1, f"[{s.left[0]}, {s.left[1]}) + [{s.right[0]}, {s.right[1]})", label(s),
         round(s.cut_bytes / 2**20, 4), round(s.comm_saved_s * 1e3, 4), round(s.imbalance_added_s * 1e3, 4),
         round(s.step_s * 1e3, 4), s.partitions, s.reason) for i, s in enumerate(plan.steps)]
    if plan.stop is not None:
        s = plan.stop
        rows.append(("stop", f"[{s.left[0]}, {s.left[1]}) + [{s.right[0]}, {s.right[1]})", label(s),
                     round(s.cut_bytes / 2**20, 4), round(s.comm_saved_s * 1e3, 4),
                     round(s.imbalance_added_s * 1e3, 4), round(s.step_s * 1e3, 4), s.partitions, s.reason))
    return tuple(rows)
