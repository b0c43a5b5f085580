"""Recomputation in the memory model and the simulator: B pays F again, F holds only the stage's inputs, and
``auto`` recomputes the fewest stages that bring every stage under the plan's cap."""

from __future__ import annotations

import dataclasses

import pytest

from fxpipe.errors import OptionError, PlanError
from fxpipe.planning.cost import held_peaks, recompute_stages, recomputed
from fxpipe.schedules.generators import generate
from fxpipe.schedules.simulate import Costs, simulate

F, B, W = 2.0, 3.0, 1.0


def _costs() -> Costs:
    return Costs((F,) * 3, (B,) * 3, (W,) * 3, (0.0,) * 3, (10.0, 20.0, 30.0), (4.0, 4.0, 4.0),
                 held_in=(1.0, 2.0, 3.0))


def _acts(sched: object) -> list[tuple[int, str]]:
    return [(a.stage, a.kind.value) for acts in sched.ranks for a in acts]  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "zb-h1"])
def test_recomputing_charges_f_in_b_and_holds_the_inputs(name: str) -> None:
    costs = _costs()
    again = costs.recomputing([1])
    assert again.b == (B, B + F, B) and again.f == costs.f and again.w == costs.w and again.recompute == (1,)
    assert again.held_fb == (10.0, 2.0, 30.0) and again.held_bw == costs.held_bw
    assert again.recomputing([1]) == again  # once only
    sched = generate(name, 3, 6, costs)
    plain, slower = simulate(sched, costs), simulate(sched, again)
    by_hand = simulate(sched, dataclasses.replace(costs, b=(B, B + F, B)))  # the same walk with B + F typed in
    assert slower.makespan == by_hand.makespan > plain.makespan
    busy = {r.rank: r.busy for r in plain.ranks}
    assert slower.ranks[1].busy == pytest.approx(busy[1] + 6 * F)  # F once more per microbatch, on stage 1 only
    assert slower.ranks[0].busy == busy[0] and slower.ranks[2].busy == busy[2]
    # Memory: the simulator's per-rank peak (one stage per rank) is the memory model's, inputs held from F to B.
    model = held_peaks(_acts(sched), again.held_fb, again.held_bw)
    assert [r.peak_memory for r in slower.ranks] == pytest.approx(list(model))
    assert slower.ranks[1].peak_memory < plain.ranks[1].peak_memory
    assert slower.ranks[0].peak_memory == plain.ranks[0].peak_memory


def test_recomputed_and_its_refusals() -> None:
    assert recomputed([10.0, 20.0], [1.0, 2.0], []) == (10.0, 20.0)
    with pytest.raises(OptionError, match="stage 2 cannot recompute: there are 2 stages"):
        recomputed([10.0, 20.0], [1.0, 2.0], [2])
    with pytest.raises(OptionError, match="do not know the stages' input bytes"):
        dataclasses.replace(_costs(), held_in=()).recomputing([0])


def test_auto_recomputes_the_fewest_stages_that_fit_the_cap() -> None:
    costs = _costs()
    acts = _acts(generate("1f1b", 3, 6, costs))
    peaks = held_peaks(acts, costs.held_fb, costs.held_bw)  # 1f1b: 3, 2 and 1 microbatches in flight
    assert peaks == (30.0, 40.0, 30.0)
    static = (5.0, 5.0, 5.0)
    assert recompute_stages(acts, costs.held_fb, costs.held_bw, costs.held_in, None, static) == ()
    assert recompute_stages(acts, costs.held_fb, costs.held_bw, costs.held_in, 45.0, static) == ()
    assert recompute_stages(acts, costs.held_fb, costs.held_bw, costs.held_in, 44.0, static) == (1,)
    assert recompute_stages(acts, costs.held_fb, costs.held_bw, costs.held_in, 30.0, static) == (0, 1, 2)
    # brute force: the chosen set fits, and no smaller set does
    import itertools

    def fits(stages: tuple[int, ...], cap: float) -> bool:
        held = held_peaks(acts, recomputed(costs.held_fb, costs.held_in, stages), costs.held_bw)
        return all(s + h <= cap for s, h in zip(static, held))

    for cap in (20.0, 30.0, 34.0, 35.0, 40.0, 44.0, 45.0, 60.0):
        chosen = recompute_stages(acts, costs.held_fb, costs.held_bw, costs.held_in, cap, static)
        assert fits(chosen, cap)
        smaller = [c for k in range(len(chosen)) for c in itertools.combinations(range(3), k)]
        assert not any(fits(c, cap) for c in smaller), (cap, chosen)
    with pytest.raises(PlanError, match="stage 0 needs 8 bytes even with its forward recomputed"):
        recompute_stages(acts, costs.held_fb, costs.held_bw, costs.held_in, 7.0, static)


def test_plan_recompute_under_the_plans_cap() -> None:
    """``auto`` on a compiled plan (mlp-tiny, 2 stages, 1F1B): nothing without a cap; under a cap, the stages
    whose memory (4 x their parameter bytes plus their held peak) is over it, a set that fits while no smaller one
    does (brute force over every cap between the stages' needs), or one line where none fits."""
    import itertools

    from fxpipe.plan_dir import read_plan
    from fxpipe.planning.cost import static_memory
    from fxpipe.schedules.auto import plan_recompute, plan_schedule
    from tests._helpers import MLP_PLAN, cli_plan

    plan = read_plan(cli_plan(*MLP_PLAN))
    sched = plan_schedule(plan, "1f1b", 4)
    assert plan.options.memory_per_stage is None
    assert plan_recompute(plan, sched, "auto") == ((), "recompute auto: the plan has no memory cap (compile "
                                                       "--memory-per-stage), so no stage recomputes")
    assert plan_recompute(plan, sched, "none")[0] == ()
    costs = Costs.from_plan(plan)
    acts = _acts(sched)
    static = [static_memory(g, "adam") for g in costs.grad_bytes]
    n = len(static)

    def need(stages: tuple[int, ...]) -> list[float]:
        held = held_peaks(acts, recomputed(costs.held_fb, costs.held_in, stages), costs.held_bw)
        return [a + b for a, b in zip(static, held)]

    plain, every = need(()), need(tuple(range(n)))
    assert any(e < p for e, p in zip(every, plain))  # recomputing lowers some stage: the caps below can tell
    caps = sorted({x + d for x in plain + every for d in (-1.0, 0.0)})
    seen = set()
    for cap in caps:
        capped = dataclasses.replace(plan, options=dataclasses.replace(plan.options, memory_per_stage=cap))
        fitting = [c for k in range(n + 1) for c in itertools.combinations(range(n), k) if max(need(c)) <= cap]
        if not fitting:
            with pytest.raises(PlanError, match="even with its forward recomputed"):
                plan_recompute(capped, sched, "auto")
            continue
        stages, note = plan_recompute(capped, sched, "auto")
        assert max(need(stages)) <= cap and len(stages) == min(len(c) for c in fitting), (cap, stages, fitting)
        assert (f"{cap:.0f} bytes" in note) and (not stages or "recompute" in note)
        seen.add(stages)
    assert () in seen and len(seen) >= 2  # some cap needs no recomputation, and some needs it
