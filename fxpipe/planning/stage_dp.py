"""Exact chain DP: cut L layers into P contiguous stages with the least bottleneck stage time."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NoReturn

from fxpipe.errors import PlanError
from fxpipe.planning.cost import transfer_time

__all__ = [
    "Moves",
    "StagePlan",
    "format_bytes",
    "min_memory_cap",
    "plan_for_bounds",
    "plan_stages",
    "stage_memory",
    "stage_time",
]

# The second DP accepts stage times up to the optimum plus this relative slack, so float
# rounding can never make the optimum the first DP found look infeasible.
_REL_TOL = 1e-9
# Sums of stage times closer than this are treated as a tie and resolved by the earliest cut,
# so the choice does not hinge on the order in which floats happened to be added.
_TIE_TOL = 1e-12

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


@dataclass(frozen=True)
class Moves:
    """LayerPipe's inter-layer balance (``--balance-backward``): what B may move across each cut.

    ``movable[c - 1]``: the (value, seconds) of B, derivatives of the activations layer ``c - 1`` makes, that may
    run in either stage of the cut between layers ``c - 1`` and ``c``. ``first`` False: none moves out of the first
    stage (its inputs take no gradient, so it has no B).

    >>> plan_stages([3.0, 1.0], 2, moves=Moves([[("relu", 1.0)]])).moves
    ((1, 'relu', 1.0),)
    """

    movable: Sequence[Sequence[tuple[str, float]]]
    first: bool = True


@dataclass(frozen=True)
class StagePlan:
    """Where the cuts go, and what each stage then costs.

    Stage k holds layers ``bounds[k] .. bounds[k+1]-1``; no stage is empty.

    >>> plan = plan_stages([1.0, 1.0, 1.0, 1.0], 2)
    >>> plan.bounds, plan.stage_times, plan.bottleneck, plan.ratio
    ((0, 2, 4), (2.0, 2.0), 2.0, 1.0)
    """

    bounds: tuple[int, ...]
    stage_times: tuple[float, ...]
    stage_memory: tuple[float, ...]
    bottleneck: float
    lower_bound: float
    # LayerPipe's inter-layer balance (--balance-backward): each (cut, value, seconds) moves ``seconds`` of B, the
    # derivative of the activation ``value`` that layer ``cut - 1`` makes, from the stage ending at ``cut`` to the
    # stage starting there; ``stage_times`` count the moves
    moves: tuple[tuple[int, str, float], ...] = ()

    def without(self, cut: int, value: str) -> StagePlan:
        """This plan with the move of ``value`` across ``cut`` taken back (the split graphs cannot make it)."""
        (seconds,) = [t for c, v, t in self.moves if (c, v) == (cut, value)]
        k = self.bounds.index(cut) - 1
        times = list(self.stage_times)
        times[k] += seconds
        times[k + 1] -= seconds
        return replace(self, stage_times=tuple(times), bottleneck=max(times),
                       moves=tuple(m for m in self.moves if (m[0], m[1]) != (cut, value)))

    @property
    def ratio(self) -> float:
        """Bottleneck over the compute-only lower bound; 1.0 when the lower bound is 0."""
        if self.lower_bound == 0:
            return 1.0
        return self.bottleneck / self.lower_bound


def format_bytes(n: float) -> str:
    """Human-readable size with two decimals: ``format_bytes(1536) == '1.50 KiB'``."""
    value = float(n)
    for unit in _UNITS[:-1]:
        # Compare the rounded value so 1023.999 KiB prints as 1.00 MiB, not 1024.00 KiB.
        if abs(round(value, 2)) < 1024:
            return f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} {_UNITS[-1]}"


def _exact_bytes(n: float) -> str:
    """Bytes with no rounding: an integer when integral, else the shortest round-trip float."""
    if math.isfinite(n) and float(n).is_integer():
        return str(int(n))
    return repr(float(n))


def _span_sum(values: Sequence[float], i: int, j: int) -> float:
    # Left-to-right on purpose: the DP tables accumulate in the same order, so a plan's reported
    # times and memory equal, bit for bit, the values the DP compared against the cap.
    total = 0.0
    for idx in range(i, j):
        total += values[idx]
    return total


def stage_time(
    costs: Sequence[float],
    cut_bytes: Sequence[float],
    i: int,
    j: int,
    *,
    bandwidth: float,
    latency: float,
) -> float:
    """Time of a stage holding layers ``i .. j-1``: compute, plus the activations it sends across
    its right cut (if any), plus the input gradients it sends back across its left cut (if any)."""
    total = _span_sum(costs, i, j)
    if j < len(costs):
        total += transfer_time(cut_bytes[j - 1], bandwidth=bandwidth, latency=latency)
    if i > 0:
        total += transfer_time(cut_bytes[i - 1], bandwidth=bandwidth, latency=latency)
    return total


def stage_memory(
    static_bytes: Sequence[float],
    activation_bytes: Sequence[float],
    in_flight: Sequence[int],
    k: int,
    i: int,
    j: int,
) -> float:
    """Bytes stage ``k`` needs for layers ``i .. j-1``: their static state, plus the activations
    of every microbatch it keeps in flight."""
    return _span_sum(static_bytes, i, j) + in_flight[k] * _span_sum(activation_bytes, i, j)


def _check_stage_count(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise PlanError(f"--stages must be at least 1 (stages: {num_stages})")
    if num_stages > num_layers:
        raise PlanError(
            f"cannot make {num_stages} stages from {num_layers} layers "
            f"(layers: {num_layers}, stages: {num_stages}); "
            "lower --stages or use a finer --granularity"
        )


def _check_length(name: str, values: Sequence[object], expected: int, per: str) -> None:
    if len(values) != expected:
        raise PlanError(
            f"{name} needs one value per {per} "
            f"({name}: {len(values)} values, expected: {expected}); "
            f"pass exactly {expected} values for {name}"
        )


def _check_values(name: str, values: Sequence[float], fix: str = "fix the cost annotation") -> None:
    for idx, v in enumerate(values):
        if not (math.isfinite(v) and v >= 0):
            raise PlanError(f"{name} must be finite and >= 0 ({name}[{idx}]: {v}); {fix}")


def _prefix_table(values: Sequence[float]) -> list[list[float]]:
    """``table[i][j] == _span_sum(values, i, j)`` for all ``i < j``, in O(L^2)."""
    n = len(values)
    table: list[list[float]] = []
    for i in range(n):
        row = [0.0] * (n + 1)
        total = 0.0
        for j in range(i + 1, n + 1):
            total += values[j - 1]
            row[j] = total
        table.append(row)
    return table


def _memory_dp(
    static_sum: list[list[float]],
    act_sum: list[list[float]],
    in_flight: Sequence[int],
    num_layers: int,
    num_stages: int,
) -> float:
    """Min over partitions of the max stage memory (a bottleneck DP on memory instead of time)."""
    inf = math.inf
    prev = [inf] * (num_layers + 1)
    f0 = in_flight[0]
    for j in range(1, num_layers - num_stages + 2):
        prev[j] = static_sum[0][j] + f0 * act_sum[0][j]
    for k in range(1, num_stages):
        fk = in_flight[k]
        cur = [inf] * (num_layers + 1)
        for j in range(k + 1, num_layers - (num_stages - 1 - k) + 1):
            best = inf
            for i in range(k, j):
                d = prev[i]
                if d >= best:
                    continue
                m = static_sum[i][j] + fk * act_sum[i][j]
                v = d if d > m else m
                if v < best:
                    best = v
            cur[j] = best
        prev = cur
    return prev[num_layers]


def _default_in_flight(in_flight: Sequence[int] | None, num_stages: int) -> Sequence[int]:
    if in_flight is None:
        return [1] * num_stages
    _check_length("in_flight", in_flight, num_stages, "stage")
    _check_values("in_flight", in_flight, "pass microbatch counts >= 0")
    return in_flight


def min_memory_cap(
    static_bytes: Sequence[float],
    activation_bytes: Sequence[float],
    in_flight: Sequence[int] | None,
    num_stages: int,
) -> float:
    """Smallest per-stage memory cap some ``num_stages``-stage plan meets (in_flight None: 1 each).

    >>> min_memory_cap([4, 4, 4, 4], [0, 0, 0, 0], None, 2)
    8.0

    Raises PlanError for a stage count the layers cannot make or mismatched lengths.
    """
    num_layers = len(static_bytes)
    _check_stage_count(num_layers, num_stages)
    _check_length("activation_bytes", activation_bytes, num_layers, "layer")
    _check_values("static_bytes", static_bytes)
    _check_values("activation_bytes", activation_bytes)
    flights = _default_in_flight(in_flight, num_stages)
    static_sum = _prefix_table(static_bytes)
    act_sum = _prefix_table(activation_bytes)
    return _memory_dp(static_sum, act_sum, flights, num_layers, num_stages)


def plan_stages(
    costs: Sequence[float],
    num_stages: int,
    *,
    cut_bytes: Sequence[float] | None = None,
    bandwidth: float = math.inf,
    latency: float = 0.0,
    static_bytes: Sequence[float] | None = None,
    activation_bytes: Sequence[float] | None = None,
    in_flight: Sequence[int] | None = None,
    memory_cap: float | None = None,
    moves: Moves | None = None,
) -> StagePlan:
    """Cut ``costs`` into ``num_stages`` contiguous stages with the smallest possible bottleneck.

    Exact over every contiguous partition whose stages all fit ``memory_cap``. A stage's time is
    its compute plus the transfers across its cuts (``stage_time``); its memory is
    ``stage_memory``. Among the plans with the optimal bottleneck it returns the one with the
    least total stage time (the least communication), then the one with the earliest cuts.
    Two O(L^2 P) DPs: the bottleneck, then the least sum subject to every stage <= the bottleneck.

    ``moves`` (LayerPipe's inter-layer balance, :class:`Moves`): the DPs then also choose, for every cut they make,
    whether its movable seconds move to the stage after it (ties: the fewest moves), and ``StagePlan.moves`` lists
    the moves.

    Raises PlanError: fewer than 1 stage, more stages than layers, a sequence of the wrong
    length, a negative or non-finite value, or a memory cap no plan meets (the message gives
    the smallest cap that works).

        costs [1, 1, 1, 1], 2 stages               -> bounds (0, 2, 4), bottleneck 2
        same, 200 bytes across cut 1|2 at 100 B/s  -> bounds (0, 1, 4), bottleneck 3
    """
    num_layers = len(costs)
    _check_stage_count(num_layers, num_stages)
    _check_values("costs", costs)
    if not (bandwidth > 0):
        raise PlanError(
            f"bandwidth must be > 0 bytes/s (bandwidth: {bandwidth}); pass a positive bandwidth"
        )
    if not (math.isfinite(latency) and latency >= 0):
        raise PlanError(
            f"latency must be finite and >= 0 s (latency: {latency}); pass a latency >= 0"
        )
    if memory_cap is not None and math.isnan(memory_cap):
        raise PlanError(
            f"--memory-per-stage must be a number (memory_cap: {memory_cap}); pass a byte count"
        )

    cuts: Sequence[float] = [0.0] * (num_layers - 1) if cut_bytes is None else cut_bytes
    _check_length("cut_bytes", cuts, max(num_layers - 1, 0), "cut between adjacent layers")
    _check_values("cut_bytes", cuts)
    statics: Sequence[float] = [0.0] * num_layers if static_bytes is None else static_bytes
    _check_length("static_bytes", statics, num_layers, "layer")
    _check_values("static_bytes", statics)
    acts: Sequence[float] = [0.0] * num_layers if activation_bytes is None else activation_bytes
    _check_length("activation_bytes", acts, num_layers, "layer")
    _check_values("activation_bytes", acts)
    flights = _default_in_flight(in_flight, num_stages)

    # Transfer out of the stage that ends at j (right cut) and out of the one that starts at i
    # (left cut); both are 0 at the ends of the chain.
    right = [0.0] * (num_layers + 1)
    left = [0.0] * (num_layers + 1)
    for c in range(1, num_layers):
        t = transfer_time(cuts[c - 1], bandwidth=bandwidth, latency=latency)
        right[c] = t
        left[c] = t
    compute = _prefix_table(costs)
    # times[i][j] is stage_time(costs, cuts, i, j, ...) with the additions in the same order.
    times = [
        [compute[i][j] + right[j] + left[i] if j > i else 0.0 for j in range(num_layers + 1)]
        for i in range(num_layers)
    ]
    static_sum = _prefix_table(statics)
    act_sum = _prefix_table(acts)
    cap = math.inf if memory_cap is None else memory_cap

    def memory(k: int, i: int, j: int) -> float:  # stage_memory from the prefix tables
        return static_sum[i][j] + flights[k] * act_sum[i][j]

    def fits(k: int, i: int, j: int) -> bool:
        return memory(k, i, j) <= cap

    moving = _moving(moves, num_layers)
    if moves is not None and any(moving):
        found = _plan_with_moves(times, moving, fits, num_stages, first=moves.first)
        if found is None:
            _no_plan_fits(static_sum, act_sum, flights, num_layers, num_stages, cap)
        spans = list(zip(found[0], found[0][1:]))
        return _plan_of(costs, times, found[0], found[1], moves.movable, moving,
                        tuple(memory(k, i, j) for k, (i, j) in enumerate(spans)))
    inf = math.inf
    # DP 1: best[j] = least bottleneck of layers 0..j-1 cut into k+1 stages.
    best = [inf] * (num_layers + 1)
    for j in range(1, num_layers - num_stages + 2):
        if fits(0, 0, j):
            best[j] = times[0][j]
    for k in range(1, num_stages):
        cur = [inf] * (num_layers + 1)
        for j in range(k + 1, num_layers - (num_stages - 1 - k) + 1):
            b = inf
            for i in range(k, j):
                d = best[i]
                if d >= b:
                    continue
                t = times[i][j]
                v = d if d > t else t
                if v < b and fits(k, i, j):
                    b = v
            cur[j] = b
        best = cur
    optimum = best[num_layers]

    if optimum == inf:
        _no_plan_fits(static_sum, act_sum, flights, num_layers, num_stages, cap)

    # DP 2, over suffixes so that scanning j upwards picks the earliest cut among ties:
    # rest[i] = least total time of layers i..L-1 in stages k..P-1, every stage <= limit.
    limit = optimum + abs(optimum) * _REL_TOL
    rest = [inf] * (num_layers + 1)
    rest[num_layers] = 0.0
    choice: list[list[int]] = [[-1] * (num_layers + 1) for _ in range(num_stages)]
    for k in range(num_stages - 1, -1, -1):
        cur = [inf] * (num_layers + 1)
        last_j = num_layers - (num_stages - 1 - k)
        for i in range(k, num_layers - (num_stages - k) + 1):
            b = inf
            pick = -1
            row = times[i]
            for j in range(i + 1, last_j + 1):
                r = rest[j]
                t = row[j]
                if r == inf or t > limit:
                    continue
                v = t + r
                if v < b and not math.isclose(v, b, rel_tol=_TIE_TOL) and fits(k, i, j):
                    b = v
                    pick = j
            cur[i] = b
            choice[k][i] = pick
        rest = cur
    if rest[0] == inf:  # pragma: no cover - DP 1 found a plan that DP 2 also admits
        raise PlanError(
            f"internal error: no plan within the optimal bottleneck {optimum!r} "
            f"(layers: {num_layers}, stages: {num_stages}); report this bug"
        )

    bounds = [0]
    for k in range(num_stages):
        bounds.append(choice[k][bounds[-1]])
    stage_times = tuple(times[bounds[k]][bounds[k + 1]] for k in range(num_stages))
    stage_mem = tuple(memory(k, bounds[k], bounds[k + 1]) for k in range(num_stages))
    lower_bound = max(math.fsum(costs) / num_stages, max(costs))
    return StagePlan(
        bounds=tuple(bounds),
        stage_times=stage_times,
        stage_memory=stage_mem,
        bottleneck=max(stage_times),
        lower_bound=float(lower_bound),
    )


def _no_plan_fits(static_sum: list[list[float]], act_sum: list[list[float]], flights: Sequence[int],
                  num_layers: int, num_stages: int, cap: float) -> NoReturn:
    # P <= L, so only the memory cap can leave no plan.
    need = _memory_dp(static_sum, act_sum, flights, num_layers, num_stages)
    fix = (
        "raise --memory-per-stage or add stages"
        if num_stages < num_layers
        else "raise --memory-per-stage or use a finer --granularity"
    )
    raise PlanError(
        f"no {num_stages}-stage plan fits --memory-per-stage {format_bytes(cap)} "
        f"({_exact_bytes(cap)} bytes); the smallest cap that works is {format_bytes(need)} "
        f"({_exact_bytes(need)} bytes); {fix}"
    )


def _moving(moves: Moves | None, num_layers: int) -> list[float]:
    """Seconds movable at each layer boundary ``c`` (index ``c``; 0 at both ends of the chain)."""
    if moves is None:
        return [0.0] * (num_layers + 1)
    _check_length("movable", moves.movable, max(num_layers - 1, 0), "cut between adjacent layers")
    seconds = [math.fsum(t for _, t in values) for values in moves.movable]
    _check_values("movable", seconds)
    return [0.0, *seconds, 0.0]


def _plan_with_moves(times: list[list[float]], moving: Sequence[float], fits: Callable[[int, int, int], bool],
                     num_stages: int,
                     bounds: Sequence[int] | None = None, first: bool = True) -> tuple[list[int], list[int]] | None:
    """The bounds and moved cuts of the least bottleneck, then least total time, then fewest moves (then the earliest
    cuts), when every cut ``c`` may move ``moving[c]`` seconds from the stage before it to the stage after it; only
    ``bounds`` when given; ``first`` False: nothing moves out of the first stage. Stage ``i..j-1``'s time is
    ``times[i][j] + moving[i] x moved-in - moving[j] x moved-out``: the DPs of :func:`plan_stages` with each
    boundary's move as part of the state. None: no plan fits."""
    num_layers = len(moving) - 1
    inf = math.inf

    def ends(k: int, i: int) -> range | tuple[int, ...]:  # where stage k, starting at layer i, may end
        if bounds is not None:
            return (bounds[k + 1],) if bounds[k] == i else ()
        return range(i + 1, num_layers - (num_stages - 1 - k) + 1)

    def options(j: int, k: int = 1) -> tuple[int, ...]:  # whether stage k, ending at j, moves out there
        return (0, 1) if moving[j] > 0 and (first or k > 0) else (0,)

    def time(i: int, j: int, y: int, x: int) -> float:
        return times[i][j] + (moving[i] if y else 0.0) - (moving[j] if x else 0.0)

    # DP 1: best[x][j] = least bottleneck of layers 0..j-1 in k+1 stages, the last one moving out x at j.
    best = [[inf] * (num_layers + 1) for _ in range(2)]
    for j in ends(0, 0):
        if fits(0, 0, j):
            for x in options(j, 0):
                best[x][j] = time(0, j, 0, x)
    for k in range(1, num_stages):
        cur = [[inf] * (num_layers + 1) for _ in range(2)]
        for i in range(k, num_layers):
            for j in ends(k, i):
                if not fits(k, i, j):
                    continue
                for y in options(i):
                    d = best[y][i]
                    for x in options(j):
                        v = max(d, time(i, j, y, x))
                        if v < cur[x][j]:
                            cur[x][j] = v
        best = cur
    optimum = best[0][num_layers]
    if optimum == inf:
        return None
    # DP 2 over suffixes: rest[y][i] = (least total, fewest moves) of layers i..L-1 in stages k..P-1, stage k
    # moving in y at i, every stage <= the optimum.
    limit = optimum + abs(optimum) * _REL_TOL
    rest: list[list[tuple[float, int]]] = [[(inf, 0)] * (num_layers + 1) for _ in range(2)]
    rest[0][num_layers] = (0.0, 0)
    choice: list[dict[tuple[int, int], tuple[int, int]]] = [{} for _ in range(num_stages)]
    for k in range(num_stages - 1, -1, -1):
        cur_rest: list[list[tuple[float, int]]] = [[(inf, 0)] * (num_layers + 1) for _ in range(2)]
        for i in range(k, num_layers):
            for y in options(i):
                b, bm, pick = inf, 0, None
                for j in ends(k, i):
                    for x in options(j, k):
                        r, rm = rest[x][j]
                        t = time(i, j, y, x)
                        if r == inf or t > limit or not fits(k, i, j):
                            continue
                        v, vm = t + r, rm + x
                        close = math.isclose(v, b, rel_tol=_TIE_TOL)
                        if (v < b and not close) or (close and vm < bm):
                            b, bm, pick = v, vm, (j, x)
                cur_rest[y][i] = (b, bm)
                if pick is not None:
                    choice[k][(y, i)] = pick
        rest = cur_rest
    cuts, moved, y = [0], [], 0
    for k in range(num_stages):
        j, x = choice[k][(y, cuts[-1])]
        cuts.append(j)
        if x:
            moved.append(j)
        y = x
    return cuts, moved


def _plan_of(costs: Sequence[float], times: list[list[float]], bounds: Sequence[int], moved: Sequence[int],
             movable: Sequence[Sequence[tuple[str, float]]], moving: Sequence[float],
             memory: tuple[float, ...]) -> StagePlan:
    """The StagePlan of ``bounds`` with the cuts ``moved`` moving their ``moving`` seconds (:func:`_plan_with_moves`'
    stage time, added in the same order)."""
    spans = list(zip(bounds, bounds[1:]))
    stage_times = tuple(times[i][j] + (moving[i] if i in moved else 0.0) - (moving[j] if j in moved else 0.0)
                        for i, j in spans)
    return StagePlan(
        bounds=tuple(bounds), stage_times=stage_times, stage_memory=memory,
        bottleneck=max(stage_times), lower_bound=float(max(math.fsum(costs) / len(spans), max(costs))),
        moves=tuple((c, value, t) for c in moved for value, t in movable[c - 1]))


def plan_for_bounds(
    costs: Sequence[float],
    bounds: Sequence[int],
    *,
    cut_bytes: Sequence[float] | None = None,
    bandwidth: float = math.inf,
    latency: float = 0.0,
    static_bytes: Sequence[float] | None = None,
    activation_bytes: Sequence[float] | None = None,
    in_flight: Sequence[int] | None = None,
    moves: Moves | None = None,
) -> StagePlan:
    """The StagePlan of given ``bounds`` (chosen elsewhere, e.g. by ``stage_count``), costed as :func:`plan_stages`
    costs its own: stage time with both cuts' transfers, memory with ``in_flight`` microbatches; with ``moves``,
    the moves across those cuts that make the least bottleneck (:func:`plan_stages`).

    >>> plan_for_bounds([1.0, 2.0, 3.0], (0, 2, 3)).stage_times
    (3.0, 3.0)
    """
    num_layers, num_stages = len(costs), len(bounds) - 1
    _check_stage_count(num_layers, num_stages)
    if bounds[0] != 0 or bounds[-1] != num_layers or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise PlanError(f"bounds {tuple(bounds)} do not cut {num_layers} layers into non-empty stages")
    cuts: Sequence[float] = [0.0] * (num_layers - 1) if cut_bytes is None else cut_bytes
    statics: Sequence[float] = [0.0] * num_layers if static_bytes is None else static_bytes
    acts: Sequence[float] = [0.0] * num_layers if activation_bytes is None else activation_bytes
    flights = _default_in_flight(in_flight, num_stages)
    spans = list(zip(bounds, bounds[1:]))
    times = tuple(stage_time(costs, cuts, i, j, bandwidth=bandwidth, latency=latency) for i, j in spans)
    memory = tuple(stage_memory(statics, acts, flights, k, i, j) for k, (i, j) in enumerate(spans))
    moving = _moving(moves, num_layers)
    if moves is not None and any(moving):
        table = [[0.0] * (num_layers + 1) for _ in range(num_layers)]
        for (i, j), t in zip(spans, times):
            table[i][j] = t
        found = _plan_with_moves(table, moving, lambda k, i, j: True, num_stages, bounds, moves.first)
        assert found is not None  # every stage fits: no cap
        return _plan_of(costs, table, bounds, found[1], moves.movable, moving, memory)
    return StagePlan(bounds=tuple(bounds), stage_times=times, stage_memory=memory, bottleneck=max(times),
                     lower_bound=float(max(math.fsum(costs) / num_stages, max(costs))))
