"""Merging partitions: equal to brute force over every merge sequence, the table's arithmetic, and its errors."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings, strategies as st

from fxpipe.errors import PlanError
from fxpipe.planning.merge import merge_partitions, merge_rows
from fxpipe.planning.stage_count import pipeline_step


def _step(times, cuts, m, bounds):
    return pipeline_step([sum(times[i:j]) for i, j in zip(bounds, bounds[1:])], [cuts[b - 1] for b in bounds[1:-1]], m)


def _brute(times, cuts, m, limit, start):
    """Every merge sequence from ``start`` ends in a subset of its cuts: the least step over all of them."""
    inner = start[1:-1]
    best = math.inf
    for r in range(len(inner) + 1):
        for kept in itertools.combinations(inner, r):
            if r + 1 <= limit:
                best = min(best, _step(times, cuts, m, (0, *kept, len(times))))
    return best


costs = st.floats(min_value=0.0, max_value=10.0, allow_nan=False, allow_infinity=False)


@st.composite
def chains(draw):
    n = draw(st.integers(2, 9))
    times = draw(st.lists(costs, min_size=n, max_size=n))
    cuts = draw(st.lists(costs, min_size=n - 1, max_size=n - 1))
    m = draw(st.integers(1, 16))
    limit = draw(st.one_of(st.none(), st.integers(1, n)))
    natural = draw(st.booleans())  # start from coarser "natural" layers: a random subset of the boundaries
    start = (0, *sorted(draw(st.sets(st.integers(1, n - 1)))), n) if natural else None
    return times, cuts, m, limit, start


@settings(max_examples=150, deadline=None)
@given(chains())
def test_merging_equals_brute_force_and_its_table_adds_up(chain) -> None:
    times, cuts, m, limit, start = chain
    n = len(times)
    plan = merge_partitions(times, cuts, m, max_stages=limit, start=start)
    first = tuple(range(n + 1)) if start is None else start
    cap = len(first) - 1 if limit is None else limit
    best = _brute(times, cuts, m, cap, first)
    assert plan.step_s == pytest.approx(best, rel=1e-9, abs=1e-9)
    assert plan.stages <= cap and set(plan.bounds) <= set(first)
    assert plan.start_bounds == first and plan.start_step_s == pytest.approx(_step(times, cuts, m, first))
    # The merges only remove cuts, one at a time, and each row's arithmetic is the step it reports.
    bounds = list(first)
    for s in plan.steps:
        k = bounds.index(s.cut)
        assert (s.left, s.right) == ((bounds[k - 1], s.cut), (s.cut, bounds[k + 1]))
        before = _step(times, cuts, m, bounds)
        bounds.remove(s.cut)
        assert s.step_s == pytest.approx(_step(times, cuts, m, bounds), rel=1e-9, abs=1e-9)
        assert s.step_s - before == pytest.approx(s.imbalance_added_s - s.comm_saved_s, rel=1e-9, abs=1e-9)
        assert s.comm_saved_s >= 2 * cuts[s.cut - 1] - 1e-12 and s.imbalance_added_s >= -1e-12
        if s.reason.startswith("forced"):
            assert s.partitions + 1 > cap
        elif s.reason == "saves more than it adds":
            assert s.gain_s > 0
    assert tuple(bounds) == plan.bounds
    # Where it stopped: no single merge left lowers the step (the plan is optimal).
    if plan.stop is None:
        assert plan.stages == 1
    else:
        assert plan.stop.gain_s <= 1e-9 * max(1.0, plan.step_s)
        for b in plan.bounds[1:-1]:
            assert _step(times, cuts, m, [x for x in plan.bounds if x != b]) >= plan.step_s * (1 - 1e-9) - 1e-12
    assert len(merge_rows(plan)) == len(plan.steps) + (plan.stop is not None)


def test_greedy_single_merges_are_not_enough_and_the_joint_choice_is() -> None:
    # Under a pace of 2 (m large), taking the costliest cut first keeps both outer cuts (4 s of fill and drain);
    # the best keeps only the middle one (3 s... twice: 6 s) or none: the DP finds the least step.
    times, cuts = [1.0, 1.0, 1.0, 1.0], [2.0, 3.0, 2.0]
    plan = merge_partitions(times, cuts, 2, max_stages=2)
    assert plan.step_s == pytest.approx(_brute(times, cuts, 2, 2, tuple(range(5))))
    assert plan.bounds == (0, 4)  # one partition: 4 + 4 = 8 beats any cut (e.g. 2|2 keeping 3: 4 + 6 + 2 = 12)
    assert [s.reason.split(":")[0] for s in plan.steps] == ["forced", "forced", "saves more than it adds"]


def test_merge_table_names_cuts_and_the_stop_row() -> None:
    plan = merge_partitions([4.0, 1.0, 4.0], [3.0, 3.0], 4, cut_bytes=[2**20, 2**21])
    rows = merge_rows(plan, ["a", "b", "c"])
    # Layer-wise: 9 + 12 + 3 x 4 = 33; the light middle layer merged: 9 + 6 + 3 x 5 = 30; one partition: 36.
    assert plan.bounds == (0, 1, 3) or plan.bounds == (0, 2, 3)
    assert rows[-1][0] == "stop" and "not taken" in rows[-1][-1]
    assert rows[0][2] in ("1 (a | b)", "2 (b | c)") and rows[0][3] in (1.0, 2.0)


@pytest.mark.parametrize("args, says", [
    (([], [], 2), "no layers"),
    (([1.0, 2.0], [], 2), "expected 1 cut costs for 2 layers"),
    (([1.0, 2.0], [0.1], 0), "microbatches must be at least 1"),
    (([1.0, -2.0], [0.1], 2), "non-negative"),
])
def test_merge_errors_name_the_problem(args, says) -> None:
    with pytest.raises(PlanError, match=says):
        merge_partitions(*args)
    with pytest.raises(PlanError, match="must rise strictly"):
        merge_partitions([1.0, 1.0], [0.0], 2, start=[0, 1])
    with pytest.raises(PlanError, match="at least 1"):
        merge_partitions([1.0, 1.0], [0.0], 2, max_stages=0)
