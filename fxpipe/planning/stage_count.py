"""How many stages: the exact partition for every stage count, and the count an objective picks.

Akintoye et al. partition layer-wise and then merge partitions. Here, for every stage count P, the
partition minimising the pipeline step model

    step(P) = sum(t_s) + 2 * sum(c_s) + (m - 1) * max(max(t_s), max(c_s))

is found exactly (equal to brute force over contiguous partitions); one count is then chosen by a
stated objective over the simulated steps. Merging itself, from one partition per layer, is
fxpipe.planning.merge. docs/internals/stage-count.md derives the model and the search.

Pure: plain values in, plain values out; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fxpipe.errors import OptionError, PlanError

__all__ = [
    "DEFAULT_MAX_STAGES",
    "DEFAULT_OBJECTIVE",
    "OBJECTIVES",
    "Objective",
    "StageCount",
    "best_partition",
    "choose_count",
    "parse_objective",
    "pipeline_step",
]

OBJECTIVES = ("fastest", "efficiency", "speedup")

# Relative tolerance under which two steps count as a tie (the fewer stages wins a tie).
_TIE = 1e-9

Feasible = Callable[[int, int, int, int], bool]
"""``feasible(P, k, i, j)``: whether stage ``k`` of ``P`` may hold layers ``i .. j-1`` (a memory cap)."""


@dataclass(frozen=True)
class Objective:
    """What ``--stages auto`` optimises.

    ``fastest``: the most throughput (speedup) within the stage budget. ``efficiency`` (``value``
    the least efficiency, e.g. 0.8): the most throughput among counts whose every device still gives
    that fraction of its own speed. ``speedup`` (``value`` the target): the fewest stages that reach
    that speedup, i.e. that step time; when none does, the fastest.
    """

    name: str
    value: float | None = None

    def __str__(self) -> str:
        return self.name if self.value is None else f"{self.name}:{self.value:g}"


DEFAULT_OBJECTIVE = Objective("fastest")
"""Why this default: a user who lets fxpipe choose the stage count, within the devices they have
(``--devices``, else ``DEFAULT_MAX_STAGES``), wants the fastest step: devices left idle buy nothing.
Ties (within 1e-9) go to fewer stages. Ask for ``efficiency:E`` when devices cost (the most speedup
whose every device still gives E of its own speed; note that m microbatches through P stages cap
it at m / (m + P - 1) even when perfectly balanced, 0.8 at m = 4P) or ``speedup:X`` when a step
time is the goal."""

DEFAULT_MAX_STAGES = 8
"""The most stages ``--stages auto`` tries when no device budget is given: one machine of 8 devices."""


def parse_objective(text: str) -> Objective:
    """``fastest`` (the default), ``efficiency[:E]`` (0 < E <= 1, default 0.8) or ``speedup:X`` (X >= 1)."""
    name, _, raw = text.partition(":")
    name = name.strip().lower()
    if name not in OBJECTIVES:
        raise OptionError(f"unknown stage-count objective {text!r}; use fastest, efficiency[:E] (e.g. "
                          "efficiency:0.8) or speedup:X (e.g. speedup:3)")
    if not raw:
        if name == "speedup":
            raise OptionError("the speedup objective needs its target, e.g. speedup:3 (the fewest stages that "
                              "run at least 3x one device)")
        return Objective(name, 0.8 if name == "efficiency" else None)
    if name == "fastest":
        raise OptionError(f"the fastest objective takes no value ({text!r}); use fastest")
    try:
        value = float(raw)
    except ValueError:
        raise OptionError(f"objective {text!r}: {raw!r} is not a number; e.g. {name}:"
                          f"{'0.8' if name == 'efficiency' else '3'}") from None
    if name == "efficiency" and not 0 < value <= 1:
        raise OptionError(f"efficiency must be in (0, 1] ({value:g}); e.g. efficiency:0.8")
    if name == "speedup" and not value >= 1:
        raise OptionError(f"a target speedup must be at least 1 ({value:g}); e.g. speedup:3")
    return Objective(name, value)


def pipeline_step(stage_times: Sequence[float], cut_seconds: Sequence[float], microbatches: int) -> float:
    """The module's step model: ``sum(t) + 2 * sum(c) + (m - 1) * max(max(t), max(c))``.

    >>> pipeline_step([2.0, 3.0], [0.5], 4)
    15.0
    """
    pace = max(max(stage_times), max(cut_seconds, default=0.0))
    return math.fsum(stage_times) + 2 * math.fsum(cut_seconds) + (microbatches - 1) * pace


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def best_partition(layer_times: Sequence[float], cut_seconds: Sequence[float], num_stages: int,
                   microbatches: int, *, feasible: Feasible | None = None) -> tuple[tuple[int, ...], float] | None:
    """The bounds (``0 = b_0 < ... < b_P = L``) minimising :func:`pipeline_step`, and that step; None when
    no partition into ``num_stages`` stages is ``feasible``. Ties go to the earliest cuts.

    >>> best_partition([1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0], 2, 4)
    ((0, 2, 4), 10.0)
    """
    n, p = len(layer_times), num_stages
    if not 1 <= p <= n:
        raise PlanError(f"cannot make {p} stages from {n} layers; use between 1 and {n} stages")
    if len(cut_seconds) != n - 1:
        raise PlanError(f"expected {n - 1} cut costs for {n} layers, got {len(cut_seconds)}")
    pre = _prefix(layer_times)
    total = pre[-1]

    def span(i: int, j: int) -> float:
        return pre[j] - pre[i]

    # Every partition's pace is one span's compute or one cut's transfer: the only maxima worth trying.
    candidates = sorted({span(i, j) for i in range(n) for j in range(i + 1, n + 1)} | set(cut_seconds))
    cheapest_cuts = 2 * math.fsum(sorted(cut_seconds)[:p - 1])
    # Feasibility only grows with the cap: bisect for the least cap any partition meets, and start there.
    lo, hi = 0, len(candidates)
    while lo < hi:
        mid = (lo + hi) // 2
        if _cheapest_cuts(span, cut_seconds, n, p, candidates[mid], feasible) is None:
            lo = mid + 1
        else:
            hi = mid
    best: tuple[float, tuple[int, ...]] | None = None
    for cap in candidates[lo:]:
        floor = total + (microbatches - 1) * cap + cheapest_cuts
        if best is not None and floor > best[0] * (1 + _TIE):
            break  # the maximum alone now costs more than the best step: no larger cap can win
        cuts = _cheapest_cuts(span, cut_seconds, n, p, cap, feasible)
        if cuts is None:
            continue
        bounds = (0, *cuts, n)
        times = [span(bounds[k], bounds[k + 1]) for k in range(p)]
        step = pipeline_step(times, [cut_seconds[b - 1] for b in cuts], microbatches)
        if best is None or step < best[0] * (1 - _TIE):
            best = (step, bounds)
    return None if best is None else (best[1], best[0])


def _cheapest_cuts(span: Callable[[int, int], float], cut_seconds: Sequence[float], n: int, p: int, cap: float,
                   feasible: Feasible | None) -> tuple[int, ...] | None:
    """The P-1 cuts of least total transfer whose every stage computes, and every cut transfers, in at most
    ``cap``; the earliest on ties."""
    inf = math.inf
    slack = cap * (1 + 1e-12)
    # cost[k][j]: least transfer for layers 0..j-1 in k stages (its last cut's transfer counted twice).
    cost = [[inf] * (n + 1) for _ in range(p + 1)]
    back = [[-1] * (n + 1) for _ in range(p + 1)]
    cost[0][0] = 0.0
    # first[j]: the first i whose span i..j-1 fits the cap (spans shrink as i grows: times are >= 0).
    first, i = [0] * (n + 1), 0
    for j in range(n + 1):
        while i < j and span(i, j) > slack:
            i += 1
        first[j] = i
    for k in range(1, p + 1):
        for j in range(k, n - (p - k) + 1):
            for i in range(max(k - 1, first[j]), j):
                if cost[k - 1][i] == inf or (i > 0 and cut_seconds[i - 1] > slack):
                    continue
                if feasible is not None and not feasible(p, k - 1, i, j):
                    continue
                c = cost[k - 1][i] + (2 * cut_seconds[i - 1] if i > 0 else 0.0)
                if c < cost[k][j] - 1e-15 * max(1.0, abs(c)):
                    cost[k][j], back[k][j] = c, i
    if cost[p][n] == inf:
        return None
    cuts, j = [], n
    for k in range(p, 0, -1):
        j = back[k][j]
        if k > 1:
            cuts.append(j)
    return tuple(reversed(cuts))


@dataclass(frozen=True)
class StageCount:
    """One stage count's best partition: its step (model and, when given, simulated), speedup and efficiency."""

    stages: int
    bounds: tuple[int, ...]
    stage_times: tuple[float, ...]  # per-microbatch compute of each stage
    cut_bytes: tuple[float, ...]  # bytes crossing each of its cuts
    microbatches: int
    model_s: float
    simulated_s: float | None
    compute_s: float  # one device, one microbatch: the whole model's F + B + W

    @property
    def step_s(self) -> float:
        """The step the choice judges by: the simulated one when there is one."""
        return self.model_s if self.simulated_s is None else self.simulated_s

    @property
    def speedup(self) -> float:
        return self.microbatches * self.compute_s / self.step_s if self.step_s > 0 else float(self.stages)

    @property
    def efficiency(self) -> float:
        return self.speedup / self.stages


def choose_count(rows: Sequence[StageCount], objective: Objective) -> StageCount:
    """The row ``objective`` picks (rows: the counts the budget and memory allow). Ties: fewer stages."""
    if not rows:
        raise PlanError("no stage count fits; raise the memory cap or the stage budget")
    ordered = sorted(rows, key=lambda r: r.stages)

    def fastest(pool: Sequence[StageCount]) -> StageCount:
        top = max(r.speedup for r in pool)
        return next(r for r in pool if r.speedup >= top * (1 - _TIE))

    if objective.name == "fastest":
        return fastest(ordered)
    if objective.name == "efficiency":
        assert objective.value is not None
        pool = [r for r in ordered if r.efficiency >= objective.value * (1 - _TIE)]
        return fastest(pool) if pool else ordered[0]
    assert objective.name == "speedup" and objective.value is not None
    return next((r for r in ordered if r.speedup >= objective.value * (1 - _TIE)), fastest(ordered))
