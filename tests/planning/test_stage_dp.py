"""Tests of the exact stage-partitioning DP against brute force and hand-computed plans."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import math
import re
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from fxpipe.errors import PlanError
from fxpipe.planning import stage_dp
from fxpipe.planning.stage_dp import (
    Moves,
    StagePlan,
    format_bytes,
    min_memory_cap,
    plan_for_bounds,
    plan_stages,
    stage_memory,
    stage_time,
)

# --- an independent model of the cost, written without the module's helpers -------------------


@dataclasses.dataclass(frozen=True)
class Instance:
    costs: list[float]
    num_stages: int
    cut_bytes: list[float] | None
    bandwidth: float
    latency: float
    static_bytes: list[float] | None
    activation_bytes: list[float] | None
    in_flight: list[int] | None
    memory_cap: float | None

    def kwargs(self) -> dict[str, object]:
        return {
            "cut_bytes": self.cut_bytes,
            "bandwidth": self.bandwidth,
            "latency": self.latency,
            "static_bytes": self.static_bytes,
            "activation_bytes": self.activation_bytes,
            "in_flight": self.in_flight,
            "memory_cap": self.memory_cap,
        }


def _ref_times(inst: Instance, bounds: tuple[int, ...]) -> list[float]:
    n = len(inst.costs)
    cuts = inst.cut_bytes or [0.0] * (n - 1)

    def send(nbytes: float) -> float:
        return 0.0 if nbytes == 0 else inst.latency + nbytes / inst.bandwidth

    out = []
    for i, j in itertools.pairwise(bounds):
        t = math.fsum(inst.costs[i:j])
        if j < n:
            t += send(cuts[j - 1])
        if i > 0:
            t += send(cuts[i - 1])
        out.append(t)
    return out


def _ref_memory(inst: Instance, bounds: tuple[int, ...]) -> list[float]:
    n = len(inst.costs)
    static = inst.static_bytes or [0.0] * n
    act = inst.activation_bytes or [0.0] * n
    flights = inst.in_flight or [1] * inst.num_stages
    return [
        math.fsum(static[i:j]) + flights[k] * math.fsum(act[i:j])
        for k, (i, j) in enumerate(itertools.pairwise(bounds))
    ]


def _all_bounds(num_layers: int, num_stages: int) -> list[tuple[int, ...]]:
    return [
        (0, *cuts, num_layers)
        for cuts in itertools.combinations(range(1, num_layers), num_stages - 1)
    ]


def _brute_force(inst: Instance) -> tuple[list[tuple[tuple[int, ...], list[float]]], float]:
    """Every plan meeting the cap, with its stage times; and the smallest cap any plan meets."""
    feasible = []
    smallest_cap = math.inf
    for bounds in _all_bounds(len(inst.costs), inst.num_stages):
        mem = _ref_memory(inst, bounds)
        smallest_cap = min(smallest_cap, max(mem))
        if inst.memory_cap is None or max(mem) <= inst.memory_cap:
            feasible.append((bounds, _ref_times(inst, bounds)))
    return feasible, smallest_cap


# --- random instances ---------------------------------------------------------------------------

# Small integers make ties (between bottlenecks and between sums) common; floats test rounding.
_cost = st.one_of(
    st.integers(0, 5).map(float),
    st.floats(0, 10, allow_nan=False, allow_infinity=False),
)


@st.composite
def instances(
    draw: st.DrawFn,
    *,
    with_cap: bool | None = None,
    min_layers: int = 1,
    min_stages: int = 1,
    crowded: bool | None = None,
) -> Instance:
    """A random small instance; ``crowded`` ones have many plans tied on the bottleneck."""
    n = draw(st.integers(min_layers, 9))
    p = draw(st.integers(min_stages, min(n, 4)))
    costs = draw(st.lists(_cost, min_size=n, max_size=n))
    crowded = draw(st.booleans()) if crowded is None else crowded
    cut_list = st.lists(st.integers(0, 1000).map(float), min_size=n - 1, max_size=n - 1)
    if crowded:
        # One dominant layer fixes the bottleneck, so many plans tie on it and only the
        # traffic across their cuts tells them apart.
        costs[draw(st.integers(0, n - 1))] = 50.0
        cut_bytes = draw(cut_list)
    else:
        cut_bytes = draw(st.none() | cut_list)
    finite = [100.0, 1000.0, 37.5]
    bandwidth = draw(st.sampled_from(finite if crowded else [math.inf, *finite]))
    latency = draw(st.sampled_from([0.0, 0.01, 0.5]))
    use_cap = draw(st.booleans()) if with_cap is None else with_cap
    static_list = st.lists(st.integers(0, 1000).map(float), min_size=n, max_size=n)
    # A cap only binds when there is memory to count, so capped instances always have some.
    static = draw(static_list if use_cap else st.none() | static_list)
    act = draw(st.none() | st.lists(st.integers(0, 500).map(float), min_size=n, max_size=n))
    flights = draw(st.none() | st.lists(st.integers(1, 4), min_size=p, max_size=p))
    inst = Instance(costs, p, cut_bytes, bandwidth, latency, static, act, flights, None)
    if not use_cap:
        return inst
    # Caps at the thresholds where some plan starts or stops fitting bind most often; one byte
    # below the smallest of them is infeasible.
    thresholds = sorted({max(_ref_memory(inst, b)) for b in _all_bounds(n, p)})
    cap = draw(st.sampled_from(thresholds)) - draw(st.sampled_from([0.0, 1.0]))
    return dataclasses.replace(inst, memory_cap=cap)


def _check_plan_fields(inst: Instance, plan: StagePlan) -> None:
    n, p = len(inst.costs), inst.num_stages
    assert len(plan.bounds) == p + 1
    assert plan.bounds[0] == 0 and plan.bounds[-1] == n
    assert all(a < b for a, b in itertools.pairwise(plan.bounds)), plan.bounds
    for got, want in zip(plan.stage_times, _ref_times(inst, plan.bounds), strict=True):
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12)
    for got, want in zip(plan.stage_memory, _ref_memory(inst, plan.bounds), strict=True):
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12)
    assert plan.bottleneck == max(plan.stage_times)
    lb = max(math.fsum(inst.costs) / p, max(inst.costs))
    assert math.isclose(plan.lower_bound, lb, rel_tol=1e-12, abs_tol=1e-12)
    if lb == 0:
        assert plan.ratio == 1.0
    else:
        assert math.isclose(plan.ratio, plan.bottleneck / lb, rel_tol=1e-12)
        # Stage times include compute, so the bound holds up to rounding.
        assert plan.ratio >= 1.0 - 1e-9
    if inst.memory_cap is not None:
        assert max(plan.stage_memory) <= inst.memory_cap


def _check_against_brute_force(inst: Instance) -> None:
    feasible, smallest_cap = _brute_force(inst)
    assert min_memory_cap(
        inst.static_bytes or [0.0] * len(inst.costs),
        inst.activation_bytes or [0.0] * len(inst.costs),
        inst.in_flight,
        inst.num_stages,
    ) == smallest_cap
    if not feasible:
        with pytest.raises(PlanError) as info:
            plan_stages(inst.costs, inst.num_stages, **inst.kwargs())  # type: ignore[arg-type]
        assert f"({int(smallest_cap)} bytes)" in str(info.value)
        assert "\n" not in str(info.value)
        return

    plan = plan_stages(inst.costs, inst.num_stages, **inst.kwargs())  # type: ignore[arg-type]
    _check_plan_fields(inst, plan)

    optimum = min(max(times) for _, times in feasible)
    assert math.isclose(plan.bottleneck, optimum, rel_tol=1e-9, abs_tol=1e-12)
    optimal_sums = [
        math.fsum(times)
        for _, times in feasible
        if math.isclose(max(times), optimum, rel_tol=1e-9, abs_tol=1e-12)
    ]
    assert math.isclose(math.fsum(plan.stage_times), min(optimal_sums), rel_tol=1e-9, abs_tol=1e-12)


@settings(max_examples=200, deadline=None)
@given(instances())
def test_matches_brute_force(inst: Instance) -> None:
    _check_against_brute_force(inst)


@settings(max_examples=100, deadline=None)
@given(instances(min_layers=5, min_stages=3, crowded=True, with_cap=False))
def test_matches_brute_force_when_many_plans_tie(inst: Instance) -> None:
    _check_against_brute_force(inst)


@settings(max_examples=100, deadline=None)
@given(instances(min_layers=4, min_stages=2, with_cap=True))
def test_matches_brute_force_under_a_cap(inst: Instance) -> None:
    _check_against_brute_force(inst)


@settings(max_examples=100, deadline=None)
@given(instances(with_cap=False))
def test_cap_at_min_memory_cap_succeeds_and_just_below_fails(inst: Instance) -> None:
    n = len(inst.costs)
    static = inst.static_bytes or [0.0] * n
    act = inst.activation_bytes or [0.0] * n
    cap = min_memory_cap(static, act, inst.in_flight, inst.num_stages)
    kwargs = inst.kwargs() | {"memory_cap": cap}
    plan = plan_stages(inst.costs, inst.num_stages, **kwargs)  # type: ignore[arg-type]
    assert max(plan.stage_memory) <= cap
    if cap > 0:
        below = kwargs | {"memory_cap": cap - 0.5}  # bytes are integers here
        with pytest.raises(PlanError, match=re.escape(f"({int(cap)} bytes)")):
            plan_stages(inst.costs, inst.num_stages, **below)  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(instances(), st.data())
def test_public_helpers_match_reference(inst: Instance, data: st.DataObject) -> None:
    n = len(inst.costs)
    bounds = data.draw(st.sampled_from(_all_bounds(n, inst.num_stages)))
    cuts = inst.cut_bytes or [0.0] * (n - 1)
    static = inst.static_bytes or [0.0] * n
    act = inst.activation_bytes or [0.0] * n
    flights = inst.in_flight or [1] * inst.num_stages
    ref_t = _ref_times(inst, bounds)
    ref_m = _ref_memory(inst, bounds)
    for k, (i, j) in enumerate(itertools.pairwise(bounds)):
        t = stage_time(inst.costs, cuts, i, j, bandwidth=inst.bandwidth, latency=inst.latency)
        assert math.isclose(t, ref_t[k], rel_tol=1e-9, abs_tol=1e-12)
        assert math.isclose(stage_memory(static, act, flights, k, i, j), ref_m[k], rel_tol=1e-12)


# --- LayerPipe's inter-layer balance: moves across cuts chosen inside the DP ------------------------


# An instance, the movable (name, seconds) at each cut, and whether the first stage may move one out.
MovesCase = tuple[Instance, list[list[tuple[str, float]]], bool]


@st.composite
def with_moves(draw: st.DrawFn, *, with_cap: bool | None = None) -> MovesCase:
    """An instance of at least 2 stages, at some cuts a derivative's seconds that may move across it, and whether
    the first stage may move one out."""
    inst = draw(instances(min_layers=2, min_stages=2, with_cap=with_cap))
    movable = [[(f"relu_{c}", draw(_cost))] if draw(st.booleans()) else [] for c in range(1, len(inst.costs))]
    return inst, movable, draw(st.booleans())


def _moved_times(bounds: tuple[int, ...], times: list[float], moving: list[float],
                 moved: tuple[int, ...]) -> list[float]:
    out = list(times)
    for c in moved:
        k = bounds.index(c)
        out[k - 1] -= moving[c - 1]
        out[k] += moving[c - 1]
    return out


def _brute_force_moves(inst: Instance, movable: list[list[tuple[str, float]]], first: bool,
                       bounds_only: tuple[int, ...] | None = None,
                       ) -> list[tuple[tuple[int, ...], tuple[int, ...], list[float]]]:
    """Every plan meeting the cap, with every subset of its movable cuts moved: (bounds, moved cuts, stage times)."""
    moving = [math.fsum(t for _, t in values) for values in movable]
    feasible, _ = _brute_force(inst)
    rows = []
    for bounds, times in feasible:
        if bounds_only is not None and bounds != bounds_only:
            continue
        cuts = [c for c in bounds[1 if first else 2:-1] if moving[c - 1] > 0]
        for size in range(len(cuts) + 1):
            for moved in itertools.combinations(cuts, size):
                rows.append((bounds, moved, _moved_times(bounds, times, moving, moved)))
    return rows


def _check_moves(inst: Instance, movable: list[list[tuple[str, float]]], first: bool, plan: StagePlan,
                 rows: list[tuple[tuple[int, ...], tuple[int, ...], list[float]]]) -> None:
    moving = [math.fsum(t for _, t in values) for values in movable]
    moved = tuple(sorted({c for c, _, _ in plan.moves}))
    assert plan.moves == tuple((c, v, t) for c in moved for v, t in movable[c - 1])  # every value at a moved cut
    assert all(c in plan.bounds[1 if first else 2:-1] and moving[c - 1] > 0 for c in moved)
    want = _moved_times(plan.bounds, _ref_times(inst, plan.bounds), moving, moved)
    for got, ref in zip(plan.stage_times, want, strict=True):
        assert math.isclose(got, ref, rel_tol=1e-9, abs_tol=1e-9)
    assert plan.bottleneck == max(plan.stage_times)
    optimum = min(max(t) for _, _, t in rows)
    assert math.isclose(plan.bottleneck, optimum, rel_tol=1e-9, abs_tol=1e-9)
    best = [(b, m, t) for b, m, t in rows if math.isclose(max(t), optimum, rel_tol=1e-9, abs_tol=1e-9)]
    least = min(math.fsum(t) for _, _, t in best)
    assert math.isclose(math.fsum(plan.stage_times), least, rel_tol=1e-9, abs_tol=1e-9)
    fewest = min(len(m) for _, m, t in best if math.isclose(math.fsum(t), least, rel_tol=1e-9, abs_tol=1e-9))
    assert len(moved) == fewest


@settings(max_examples=200, deadline=None)
@given(with_moves())
def test_moves_chosen_inside_the_dp_match_brute_force(case: MovesCase) -> None:
    """The least bottleneck over every partition and every choice of moves across its cuts (brute force), the least
    total time among those, and the fewest moves among those."""
    inst, movable, first = case
    rows = _brute_force_moves(inst, movable, first)
    if not rows:
        with pytest.raises(PlanError, match="no .*-stage plan fits --memory-per-stage"):
            plan_stages(inst.costs, inst.num_stages, moves=Moves(movable, first), **inst.kwargs())  # type: ignore[arg-type]
        return
    plan = plan_stages(inst.costs, inst.num_stages, moves=Moves(movable, first), **inst.kwargs())  # type: ignore[arg-type]
    _check_moves(inst, movable, first, plan, rows)
    without = plan_stages(inst.costs, inst.num_stages, **inst.kwargs())  # type: ignore[arg-type]
    assert plan.bottleneck <= without.bottleneck * (1 + 1e-9) + 1e-12 and without.moves == ()


@settings(max_examples=100, deadline=None)
@given(with_moves(with_cap=False), st.data())
def test_moves_across_given_bounds_match_brute_force(case: tuple[Instance, list[list[tuple[str, float]]], bool],
                                                    data: st.DataObject) -> None:
    inst, movable, first = case
    bounds = data.draw(st.sampled_from(_all_bounds(len(inst.costs), inst.num_stages)))
    plan = plan_for_bounds(inst.costs, bounds, moves=Moves(movable, first), cut_bytes=inst.cut_bytes,
                           bandwidth=inst.bandwidth, latency=inst.latency, static_bytes=inst.static_bytes,
                           activation_bytes=inst.activation_bytes, in_flight=inst.in_flight)
    assert plan.bounds == bounds
    _check_moves(inst, movable, first, plan, _brute_force_moves(inst, movable, first, bounds))


def test_a_move_lowers_the_bottleneck_and_can_move_the_cut() -> None:
    # Without moves 3 | 1 + 1 (bottleneck 3) or 3 + 1 | 1 (4). Moving 1 s across cut 1 gives 2 | 3; moving 1.5 s
    # across cut 2 makes 3 + 1 - 1.5 | 1 + 1.5 = 2.5 | 2.5: the cut moves to where the derivative can follow it.
    assert plan_stages([3.0, 1.0, 1.0], 2).bounds == (0, 1, 3)
    plan = plan_stages([3.0, 1.0, 1.0], 2, moves=Moves([[("relu", 1.0)], [("relu_1", 1.5)]]))
    assert (plan.bounds, plan.stage_times, plan.moves) == ((0, 2, 3), (2.5, 2.5), ((2, "relu_1", 1.5),))
    assert plan.without(2, "relu_1").stage_times == (4.0, 1.0)
    # a move that would not lower the bottleneck is not made, nor one out of a first stage that has no B
    assert plan_stages([1.0, 1.0], 2, moves=Moves([[("relu", 0.5)]])).moves == ()
    assert plan_stages([3.0, 1.0], 2, moves=Moves([[("relu", 1.0)]])).moves == ((1, "relu", 1.0),)
    assert plan_stages([3.0, 1.0], 2, moves=Moves([[("relu", 1.0)]], first=False)).moves == ()


# --- hand-computed plans ------------------------------------------------------------------------


def test_even_split() -> None:
    plan = plan_stages([1, 1, 1, 1], 2)
    assert plan.bounds == (0, 2, 4)
    assert plan.stage_times == (2.0, 2.0)
    assert plan.stage_memory == (0.0, 0.0)
    assert plan.bottleneck == 2.0
    assert plan.lower_bound == 2.0
    assert plan.ratio == 1.0


def test_one_stage_holds_everything() -> None:
    plan = plan_stages([1, 2, 3], 1, cut_bytes=[100, 100], bandwidth=1.0, latency=1.0)
    assert plan.bounds == (0, 3)
    assert plan.stage_times == (6.0,)  # no cut, so no transfer


def test_one_layer_per_stage() -> None:
    plan = plan_stages([3, 1, 2], 3)
    assert plan.bounds == (0, 1, 2, 3)
    assert plan.bottleneck == 3.0
    assert plan.lower_bound == 3.0


def test_communication_moves_the_cut() -> None:
    # Cutting in the middle sends 200 B at 100 B/s both ways: 2 + 2 = 4 per stage. Cutting where
    # nothing crosses leaves 1 | 3 with no transfer, bottleneck 3; 3 | 1 ties it, earliest wins.
    plan = plan_stages([1, 1, 1, 1], 2, cut_bytes=[0, 200, 0], bandwidth=100.0)
    assert plan.bounds == (0, 1, 4)
    assert plan.stage_times == (1.0, 3.0)
    assert plan.bottleneck == 3.0
    assert plan.lower_bound == 2.0
    assert plan.ratio == 1.5


def test_latency_counts_only_when_bytes_cross() -> None:
    plan = plan_stages([1, 1], 2, cut_bytes=[0], latency=5.0)
    assert plan.stage_times == (1.0, 1.0)
    plan = plan_stages([1, 1], 2, cut_bytes=[1], latency=5.0)
    assert plan.stage_times == (6.0, 6.0)


def test_least_communication_among_optimal_plans() -> None:
    # The last layer alone fixes the bottleneck at 10; the first cut is free to move. Cut 1 sends
    # 4 B each way (times 5, 6), cut 2 sends 1 B (times 3, 2): same bottleneck, less traffic.
    plan = plan_stages([1, 1, 1, 10], 3, cut_bytes=[4, 1, 0], bandwidth=1.0)
    assert plan.bounds == (0, 2, 3, 4)
    assert plan.stage_times == (3.0, 2.0, 10.0)
    assert plan.bottleneck == 10.0


def test_earliest_cut_breaks_exact_ties() -> None:
    assert plan_stages([0, 0, 0], 2).bounds == (0, 1, 3)
    assert plan_stages([1, 0, 0, 1], 2).bounds == (0, 1, 4)


def test_memory_cap_moves_the_cut() -> None:
    costs = [1, 1, 1, 1]
    assert plan_stages(costs, 2).bounds == (0, 2, 4)
    plan = plan_stages(costs, 2, static_bytes=[6, 6, 0, 0], memory_cap=6)
    assert plan.bounds == (0, 1, 4)
    assert plan.stage_memory == (6.0, 6.0)
    assert plan.bottleneck == 3.0


def test_in_flight_scales_activation_memory() -> None:
    # Stage 0 keeps 2 microbatches: a layers there cost 2a, the rest 4 - a. a = 1 gives max 3.
    kwargs = {"activation_bytes": [1, 1, 1, 1], "in_flight": [2, 1]}
    assert min_memory_cap([0, 0, 0, 0], [1, 1, 1, 1], [2, 1], 2) == 3.0
    plan = plan_stages([1, 1, 1, 1], 2, memory_cap=3, **kwargs)  # type: ignore[arg-type]
    assert plan.bounds == (0, 1, 4)
    assert plan.stage_memory == (2.0, 3.0)
    with pytest.raises(PlanError, match=re.escape("smallest cap that works is 3.00 B (3 bytes)")):
        plan_stages([1, 1, 1, 1], 2, memory_cap=2, **kwargs)  # type: ignore[arg-type]


def test_min_memory_cap_example() -> None:
    assert min_memory_cap([4, 4, 4, 4], [0, 0, 0, 0], None, 2) == 8.0
    assert min_memory_cap([4, 4, 4, 4], [1, 1, 1, 1], [1, 1, 1, 1], 4) == 5.0


def test_lower_bound_uses_largest_layer() -> None:
    plan = plan_stages([5, 1, 1, 1], 4)
    assert plan.lower_bound == 5.0  # sum / P would be only 2
    assert plan.ratio == 1.0
    plan = plan_stages([5, 1, 1, 1], 2)
    assert plan.lower_bound == 5.0
    assert plan.bounds == (0, 1, 4)


def test_ratio_is_one_when_lower_bound_is_zero() -> None:
    plan = plan_stages([0, 0], 2)
    assert plan.lower_bound == 0.0
    assert plan.ratio == 1.0


def test_ratio_counts_communication() -> None:
    plan = plan_stages([2, 2], 2, cut_bytes=[10], bandwidth=10.0)
    assert plan.stage_times == (3.0, 3.0)
    assert plan.ratio == 1.5


# --- format_bytes (transfer_time is tested with the cost model, tests/planning/test_cost.py) ------


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0.00 B"),
        (512, "512.00 B"),
        (1536, "1.50 KiB"),
        (1024**2 - 1, "1.00 MiB"),
        (1073741824, "1.00 GiB"),
        (1471026790, "1.37 GiB"),
        (3 * 1024**4, "3.00 TiB"),
        (2048 * 1024**4, "2048.00 TiB"),
    ],
)
def test_format_bytes(n: float, text: str) -> None:
    assert format_bytes(n) == text


# --- errors -------------------------------------------------------------------------------------


def test_too_few_stages() -> None:
    with pytest.raises(PlanError, match=r"^--stages must be at least 1 \(stages: 0\)$"):
        plan_stages([1, 2, 3], 0)
    with pytest.raises(PlanError, match=re.escape("(stages: 0)")):
        min_memory_cap([1, 2], [0, 0], None, 0)


def test_more_stages_than_layers() -> None:
    msg = (
        "cannot make 4 stages from 3 layers (layers: 3, stages: 4); "
        "lower --stages or use a finer --granularity"
    )
    with pytest.raises(PlanError, match="^" + re.escape(msg) + "$"):
        plan_stages([1, 2, 3], 4)
    with pytest.raises(PlanError, match=re.escape("cannot make 1 stages from 0 layers")):
        plan_stages([], 1)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"cut_bytes": [1, 2, 3]}, r"cut_bytes.*\(cut_bytes: 3 values, expected: 2\)"),
        ({"static_bytes": [1, 2]}, r"static_bytes.*\(static_bytes: 2 values, expected: 3\)"),
        (
            {"activation_bytes": [1, 2, 3, 4]},
            r"activation_bytes.*\(activation_bytes: 4 values, expected: 3\)",
        ),
        ({"in_flight": [1]}, r"in_flight.*\(in_flight: 1 values, expected: 2\)"),
    ],
)
def test_length_mismatch(kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises(PlanError, match=pattern):
        plan_stages([1, 2, 3], 2, **kwargs)  # type: ignore[arg-type]


def test_min_memory_cap_length_mismatch() -> None:
    with pytest.raises(PlanError, match=r"activation_bytes: 1 values, expected: 2"):
        min_memory_cap([1, 2], [1], None, 1)


@pytest.mark.parametrize(
    ("args", "kwargs", "pattern"),
    [
        ([1, -1.0], {}, r"costs must be finite and >= 0 \(costs\[1\]: -1.0\)"),
        ([1, math.nan], {}, r"costs\[1\]: nan"),
        ([1, 2], {"cut_bytes": [math.inf]}, r"cut_bytes\[0\]: inf"),
        ([1, 2], {"bandwidth": 0.0}, r"bandwidth must be > 0 .*\(bandwidth: 0.0\)"),
        ([1, 2], {"latency": -1.0}, r"latency must be finite and >= 0 .*\(latency: -1.0\)"),
        ([1, 2], {"in_flight": [1, -1]}, r"in_flight\[1\]: -1"),
        ([1, 2], {"memory_cap": math.nan}, r"--memory-per-stage must be a number"),
    ],
)
def test_bad_values(args: list[float], kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises(PlanError, match=pattern):
        plan_stages(args, 2, **kwargs)  # type: ignore[arg-type]


def test_memory_cap_message() -> None:
    msg = (
        "no 1-stage plan fits --memory-per-stage 1.00 GiB (1073741824 bytes); "
        "the smallest cap that works is 1.37 GiB (1471026790 bytes); "
        "raise --memory-per-stage or add stages"
    )
    with pytest.raises(PlanError, match="^" + re.escape(msg) + "$"):
        plan_stages([1, 1], 1, static_bytes=[1_000_000_000, 471_026_790], memory_cap=1073741824)


def test_memory_cap_message_when_every_layer_has_its_own_stage() -> None:
    with pytest.raises(
        PlanError,
        match=re.escape(
            "the smallest cap that works is 9.00 B (9 bytes); "
            "raise --memory-per-stage or use a finer --granularity"
        ),
    ):
        plan_stages([1, 1], 2, static_bytes=[9, 2], memory_cap=8)


def test_memory_cap_message_keeps_fractional_bytes_exact() -> None:
    with pytest.raises(PlanError, match=re.escape("(2.5 bytes)")):
        plan_stages([1, 1], 1, static_bytes=[1.0, 1.5], memory_cap=2)


def test_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        plan_stages([1], 2)


# --- scale and purity ---------------------------------------------------------------------------


def test_few_hundred_layers_is_exact_on_a_known_answer() -> None:
    # 240 unit layers over 8 stages: every stage must hold 30; a costly cut everywhere but at the
    # multiples of 30 would only add time, so the DP must land exactly on them.
    n, p = 240, 8
    cuts = [0.0 if (c + 1) % 30 == 0 else 1e6 for c in range(n - 1)]
    plan = plan_stages([1.0] * n, p, cut_bytes=cuts, bandwidth=1.0, static_bytes=[1.0] * n)
    assert plan.bounds == tuple(range(0, n + 1, 30))
    assert plan.bottleneck == 30.0
    assert plan.ratio == 1.0


def test_module_does_not_import_torch() -> None:
    tree = ast.parse(Path(stage_dp.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported <= {"__future__", "math", "collections", "dataclasses", "typing", "fxpipe"}
