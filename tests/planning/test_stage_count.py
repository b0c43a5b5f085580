"""--stages auto: the exact partition per stage count against brute force, the objectives, the step model
against the simulator."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from torch.testing import assert_close

from fxpipe.errors import OptionError, PlanError
from fxpipe.planning.stage_count import (
    Objective,
    StageCount,
    best_partition,
    choose_count,
    parse_objective,
    pipeline_step,
)
from fxpipe.schedules.generators import generate
from fxpipe.schedules.simulate import Costs, simulate


def _partitions(n: int):  # every contiguous partition of n layers, as bounds
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            yield (0, *cuts, n)


def _instance(rng: random.Random) -> tuple[list[float], list[float], list[float], list[float]]:
    n = rng.randint(1, 12)
    times = [rng.choice([rng.uniform(0.1, 3.0), 1.0]) for _ in range(n)]  # repeated values make ties
    cuts = [rng.choice([0.0, rng.uniform(0.0, 1.5)]) for _ in range(n - 1)]
    static = [rng.uniform(0, 4) for _ in range(n)]
    acts = [rng.uniform(0, 1) for _ in range(n)]
    return times, cuts, static, acts


def _step(times, cuts, bounds, m):  # the model, written again from its definition
    spans = list(zip(bounds, bounds[1:]))
    pace = max([sum(times[i:j]) for i, j in spans] + [cuts[b - 1] for b in bounds[1:-1]])
    return sum(times) + 2 * sum(cuts[b - 1] for b in bounds[1:-1]) + (m - 1) * pace


@pytest.mark.parametrize("seed", range(40))
def test_each_count_s_partition_and_each_objective_s_pick_equal_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    times, cuts, static, acts = _instance(rng)
    n = len(times)
    per_stage = rng.choice([1, 2, 4])
    cap = rng.choice([None, 0.6 * sum(static) + sum(acts)])  # a cap that rules some partitions out

    def fits(p, k, i, j):  # stage k of p holds p - k microbatches in flight, as 1F1B does
        return cap is None or sum(static[i:j]) + (p - k) * sum(acts[i:j]) <= cap

    brute: dict[int, float] = {}
    for bounds in _partitions(n):
        p = len(bounds) - 1
        if all(fits(p, k, i, j) for k, (i, j) in enumerate(zip(bounds, bounds[1:]))):
            s = _step(times, cuts, bounds, per_stage * p)
            brute[p] = min(brute.get(p, math.inf), s)
    rows = []
    for p in range(1, n + 1):
        found = best_partition(times, cuts, p, per_stage * p, feasible=None if cap is None else fits)
        assert (found is None) == (p not in brute), p
        if found is None:
            continue
        bounds, step = found
        assert_close(step, brute[p], rtol=1e-9, atol=1e-12)
        assert_close(_step(times, cuts, bounds, per_stage * p), step, rtol=1e-9, atol=1e-12)  # the bounds give it
        spans = list(zip(bounds, bounds[1:]))
        rows.append(StageCount(p, bounds, tuple(sum(times[i:j]) for i, j in spans), (), per_stage * p, step, None,
                               sum(times)))
    if not rows:
        return
    # Every objective over every partition of every count, judged directly.
    speed = {p: per_stage * p * sum(times) / s if s > 0 else p for p, s in brute.items()}
    for objective in (Objective("fastest"), Objective("efficiency", 0.5), Objective("efficiency", 0.9),
                      Objective("speedup", 1.5), Objective("speedup", 50.0)):
        got = choose_count(rows, objective)
        if objective.name == "fastest":
            pool = speed
        elif objective.name == "efficiency":
            pool = {p: v for p, v in speed.items() if v / p >= objective.value * (1 - 1e-9)} or {min(speed): 0.0}
        else:
            reach = [p for p, v in speed.items() if v >= objective.value * (1 - 1e-9)]
            pool = {min(reach): 0.0} if reach else speed
        top = max(pool.values())
        want = min(p for p, v in pool.items() if v >= top * (1 - 1e-9))
        assert got.stages == want, (objective, {p: round(v, 6) for p, v in speed.items()})


def test_the_model_is_gpipe_exactly_and_bounds_1f1b_s_error() -> None:
    """GPipe's simulated step equals the model when each stage's F : B : W are in proportion; 1F1B's stays
    within the bounds the module's docstring states (measured here over random instances)."""
    rng = random.Random(0)
    worst = [1.0, 1.0]
    for _ in range(400):
        p = rng.randint(1, 5)
        m = rng.choice([p, 2 * p, 4 * p])
        t = [rng.uniform(0.2, 3.0) for _ in range(p)]
        sends = [rng.uniform(0, 1) for _ in range(p)]
        lat, bw = rng.choice([0.0, 0.05, 0.3]), rng.choice([math.inf, 1.0, 3.0])
        c = [lat + sends[s] / bw for s in range(p - 1)]
        model = pipeline_step(t, c, m)
        for name in ("gpipe", "1f1b"):
            costs = Costs(tuple(x / 4 for x in t), tuple(x / 2 for x in t), tuple(x / 4 for x in t), tuple(sends),
                          (1.0,) * p, (1.0,) * p, lat, bw)
            sim = simulate(generate(name, p, m, costs), costs).makespan
            if max(c, default=0.0) > min(t) / 4:  # a link slower than a stage's F: the model's pace is too simple
                continue
            if name == "gpipe":
                assert_close(sim, model, rtol=1e-9, atol=1e-12)
            else:
                worst = [min(worst[0], sim / model), max(worst[1], sim / model)]
    assert 0.85 <= worst[0] and worst[1] <= 1.13, worst  # measured: 0.865 and 1.125


def test_objectives_parse_and_refuse_in_one_line() -> None:
    assert parse_objective("fastest") == Objective("fastest")
    assert parse_objective("efficiency") == Objective("efficiency", 0.8)
    assert parse_objective(" Speedup:3 ") == Objective("speedup", 3.0)
    for bad, says in [("slowest", "unknown stage-count objective"), ("speedup", "needs its target"),
                      ("efficiency:1.5", "in (0, 1]"), ("speedup:x", "not a number"), ("fastest:2", "takes no value"),
                      ("speedup:0.5", "at least 1")]:
        with pytest.raises(OptionError, match=says.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            parse_objective(bad)
    with pytest.raises(PlanError, match="cannot make 3 stages from 2 layers"):
        best_partition([1.0, 1.0], [0.0], 3, 3)
    with pytest.raises(PlanError, match="no stage count fits"):
        choose_count([], Objective("fastest"))
