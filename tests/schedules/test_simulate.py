"""Validator and simulator: broken schedules are refused with the marked grid; memory, bytes and auto on real plans."""

from __future__ import annotations

import dataclasses

import pytest

import fxpipe
from fxpipe import models
from fxpipe.errors import PlanError, ScheduleError
from fxpipe.schedules.auto import auto
from fxpipe.schedules.generators import generate
from fxpipe.schedules.ir import Action, Kind, Schedule
from fxpipe.schedules.simulate import Costs, simulate, validate


def _swap(sched: Schedule, rank: int, i: int, j: int) -> Schedule:
    acts = list(sched.ranks[rank])
    acts[i], acts[j] = acts[j], acts[i]
    ranks = list(sched.ranks)
    ranks[rank] = tuple(acts)
    return Schedule(sched.name, sched.num_stages, sched.num_microbatches, sched.rank_of_stage, tuple(ranks))


def test_a_deadlock_shows_the_grid_with_each_stuck_rank_marked() -> None:
    sched = generate("1f1b", 2, 2)  # rank 1: 1F0 1BW0 1F1 1BW1
    bad = _swap(sched, 1, 0, 1)  # rank 1 runs BW of mb 0 before its F
    with pytest.raises(ScheduleError) as info:
        validate(bad)
    text = str(info.value)
    assert "deadlock" in text and "rank 1 at 1BW0 waits for 1F0" in text
    assert "1BW0 <<" in text  # the failing step is marked in the grid
    assert text.count("<<") == 2  # rank 0 is stuck too, waiting for the gradient


def test_w_before_b_and_missing_or_duplicate_actions() -> None:
    sched = generate("zb-h1", 2, 2)
    acts = list(sched.ranks[1])
    w = next(i for i, a in enumerate(acts) if a.kind is Kind.W)
    b = next(i for i, a in enumerate(acts) if a == Action(1, Kind.B, acts[w].mb))
    with pytest.raises(ScheduleError, match=r"waits for 1B0"):
        validate(_swap(sched, 1, b, w))
    missing = Schedule("x", 2, 2, (0, 1), (sched.ranks[0], sched.ranks[1][:-1]))
    with pytest.raises(ScheduleError, match="runs BW 0x, B 1x, W 0x"):
        validate(missing)
    twice = Schedule("x", 2, 2, (0, 1), (sched.ranks[0] + (sched.ranks[0][0],), sched.ranks[1]))
    with pytest.raises(ScheduleError, match="0F0 runs twice"):
        validate(twice)
    wrong_rank = Schedule("x", 2, 2, (0, 1), (sched.ranks[0] + (Action(1, Kind.F, 0),), sched.ranks[1]))
    with pytest.raises(ScheduleError, match="1F0 runs on rank 0, but stage 1 lives on rank 1"):
        validate(wrong_rank)


def test_a_send_without_its_receive_is_refused() -> None:
    from fxpipe.schedules.ir import with_communication

    full = with_communication(generate("gpipe", 2, 1))
    no_recv = Schedule("x", 2, 1, (0, 1), (full.ranks[0], tuple(a for a in full.ranks[1] if a.kind is not Kind.RECV_F)))
    with pytest.raises(ScheduleError, match="0SEND_F0 has no matching 1RECV_F0"):
        validate(no_recv)


def test_transfers_delay_receivers_and_count_bytes() -> None:
    free = Costs.uniform(2, 1, 1, 1)
    slow = Costs((1.0, 1.0), (1.0, 1.0), (1.0, 1.0), (100.0, 0.0), (1.0, 1.0), (1.0, 1.0), latency=0.5, bandwidth=100.0)
    a = simulate(generate("1f1b", 2, 3), free)
    b = simulate(generate("1f1b", 2, 3), slow)
    # Each microbatch crosses the cut twice (activation, gradient): 0.5 + 100/100 = 1.5 each way.
    assert b.makespan > a.makespan
    assert b.ranks[0].bytes_sent == 3 * 100.0 and b.ranks[1].bytes_sent == 0.0
    first_f_on_rank1 = next(e for e in b.events if e.action == Action(1, Kind.F, 0))
    assert first_f_on_rank1.start == pytest.approx(1.0 + 1.5)


def test_memory_tracks_what_f_keeps_for_b_and_b_for_w() -> None:
    costs = Costs((1.0,), (1.0,), (1.0,), (0.0,), (10.0,), (4.0,))
    actions = (Action(0, Kind.F, 0), Action(0, Kind.F, 1), Action(0, Kind.B, 0),
               Action(0, Kind.B, 1), Action(0, Kind.W, 0), Action(0, Kind.W, 1))
    split = simulate(Schedule("x", 1, 2, (0,), (actions,)), costs)
    assert split.ranks[0].peak_memory == 20.0  # both F's held
    fused = simulate(generate("1f1b", 1, 2), costs)
    assert fused.ranks[0].peak_memory == 10.0


ZOO = ["mlp", "gpt", "resnet", "vgg"]


@pytest.fixture(scope="module")
def plans() -> dict[str, Costs]:
    out = {}
    for name in ZOO:
        zoo = models.build(name)
        out[name] = Costs.from_plan(fxpipe.compile(zoo.model, zoo.example_inputs, stages=4).plan)
    return out


@pytest.mark.parametrize("name", ZOO)
def test_auto_is_never_slower_than_any_fixed_schedule_it_considered(name: str, plans: dict[str, Costs]) -> None:
    costs = plans[name]
    choice = auto(4, costs, microbatches=[4, 8])
    best = choice.result.makespan / choice.schedule.num_microbatches
    for row in choice.report.rows:
        assert best <= row[3] / 1e3 + 5e-8  # the table rounds to 0.1 us
    for fixed in ("gpipe", "1f1b", "zb-h1", "zb-h2", "layerpipe"):
        for m in (4, 8):
            assert best <= simulate(generate(fixed, 4, m, costs), costs).makespan / m + 1e-12
    zb_h1 = simulate(generate("zb-h1", 4, 8, costs), costs).makespan / 8
    assert best < zb_h1  # the zoo's stages are unequal: cost-aware W placement and more memory both help


def test_auto_respects_the_memory_cap_and_says_when_nothing_fits(plans: dict[str, Costs]) -> None:
    costs = plans["gpt"]
    free = auto(4, costs, microbatches=[8])
    cap = min(max(r.peak_memory for r in simulate(generate(n, 4, 8, costs), costs).ranks)
              for n in ("1f1b", "layerpipe"))
    capped = auto(4, costs, microbatches=[8], memory_cap=cap)
    assert max(r.peak_memory for r in capped.result.ranks) <= cap
    assert capped.result.makespan >= free.result.makespan
    with pytest.raises(PlanError, match="no schedule fits .* the least any candidate needs is"):
        auto(4, costs, microbatches=[8], memory_cap=1.0)


def test_the_runtime_overheads_add_per_action_per_message_and_per_step() -> None:
    """GPipe, 2 stages, 1 microbatch: F0 -> message -> F1 BW1 -> message -> BW0, then the step's fixed cost."""
    f, b, w, lat, bw, nbytes = 1.0, 2.0, 3.0, 0.5, 100.0, 50.0
    costs = Costs((f, f), (b, b), (w, w), (nbytes, nbytes), latency=lat, bandwidth=bw)
    sched = generate("gpipe", 2, 1, costs)
    plain = simulate(sched, costs).makespan
    message = lat + nbytes / bw
    assert plain == pytest.approx(2 * (f + b + w) + 2 * message)
    a, m, s = 0.25, 0.125, 0.75
    over = simulate(sched, costs.with_overheads(a, m, s))
    assert over.makespan == pytest.approx(plain + 4 * a + 2 * m + s)  # 4 compute actions on the path, 2 messages
    assert all(r.fixed_s == s for r in over.ranks)
    assert costs.with_overheads(a, m, s).time(Action(0, Kind.BW, 0)) == b + w + a  # one action, one overhead
    # A send's host time: the message leaves after it, and its sender's next action starts after it.
    sent = simulate(sched, dataclasses.replace(costs, send_s=0.375))
    assert sent.makespan == pytest.approx(plain + 2 * 0.375)  # both messages are on the path
    f1 = next(e for e in sent.events if e.action == Action(1, Kind.F, 0))
    assert f1.start == pytest.approx(f + 0.375 + message)
    # 1f1b, 2 microbatches: rank 0's F1 follows F0's send, so it starts after the send's host time
    two = generate("1f1b", 2, 2, costs)
    second = next(e for e in simulate(two, dataclasses.replace(costs, send_s=0.375)).events
                  if e.action == Action(0, Kind.F, 1))
    assert second.start == pytest.approx(f + 0.375)


def test_a_batched_run_of_ws_costs_the_measured_fraction() -> None:
    """batched-w's Ws are charged ``Costs.w_batched`` of their time alone (what the runtime measured); a schedule
    that does not batch its Ws ignores it."""
    costs = Costs.uniform(2, 1.0, 1.0, 1.0)
    halved = dataclasses.replace(costs, w_batched=(0.5, 0.25))
    scaled = dataclasses.replace(costs, w=(0.5, 0.25))
    batched = generate("batched-w", 2, 4)
    assert simulate(batched, halved).makespan == simulate(batched, scaled).makespan < simulate(batched, costs).makespan
    assert simulate(generate("zb-h1", 2, 4), halved).makespan == simulate(generate("zb-h1", 2, 4), costs).makespan


def test_auto_considers_batched_w_only_where_the_costs_say_ws_batch_faster() -> None:
    """A profiled plan's ``StageCost.w_batched`` below 1 makes batched-w a candidate of ``auto``; without it batched-w
    would be simulated at its Ws' whole time, GPipe's order with nothing gained, and is not tried."""
    import dataclasses

    costs = Costs.uniform(2, 1.0, 1.0, 3.0)
    names = lambda c: [row[0] for row in auto(2, c, microbatches=[8]).report.rows]  # noqa: E731
    assert "batched-w" not in names(costs)
    batched = dataclasses.replace(costs, w_batched=(0.3, 0.3))
    assert "batched-w" in names(batched)
    assert auto(2, batched, microbatches=[8]).schedule.name == "batched-w"  # Ws 3x F, batched to 0.9x F: fastest


def test_ws_on_a_second_lane_share_the_core_and_fill_its_waits() -> None:
    """``Costs.w_lane``: rank 1 of layerpipe at 2 stages hands W0 (2 s) to its lane as F1 (1 s) starts at 3 s; both run
    at half speed, so F1 ends at 5 s, and B1 (1 s) shares the rest of W0 the same way: both end at 7 s, where one lane
    would run W0 3-5, F1 5-6 and B1 6-7. Rank 0's W0 starts as its B0 ends, beside its wait for B1's gradient."""
    costs = Costs((1.0, 1.0), (1.0, 1.0), (2.0, 2.0))
    sched = generate("layerpipe", 2, 2, costs)
    two = simulate(sched, dataclasses.replace(costs, w_lane=True))
    events = {(e.rank, str(e.action)): (e.start, e.end) for e in two.events}
    assert [events[(1, a)] for a in ("1B0", "1F1", "1W0", "1B1")] == [(2.0, 3.0), (3.0, 5.0), (3.0, 7.0), (5.0, 7.0)]
    assert events[(0, "0W0")][0] == events[(0, "0B0")][1]
    assert two.makespan <= simulate(sched, costs).makespan
    assert all(r.busy <= r.span + 1e-12 for r in two.ranks)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-h2", "layerpipe", "interleaved-1f1b"])
def test_a_second_lane_is_never_slower_and_changes_nothing_without_ws(name: str) -> None:
    import random

    rng = random.Random(name)
    gained = False
    for _ in range(40):  # zb-h2 gains in 1 of these 40 draws: its W's already sit in its bubbles
        p, m = rng.choice([2, 4]), rng.choice([2, 4, 8])
        costs = Costs(*(tuple(rng.uniform(lo, 2.0) for _ in range(p)) for lo in (0.5, 0.5, 0.0)),
                      send_bytes=tuple(rng.choice([0.0, 1e6]) for _ in range(p)), latency=rng.choice([0.0, 0.1]),
                      bandwidth=1e7, send_s=rng.choice([0.0, 0.01]))
        sched = generate(name, p, m, costs)
        one, two = simulate(sched, costs), simulate(sched, dataclasses.replace(costs, w_lane=True))
        assert two.makespan <= one.makespan * (1 + 1e-9)
        gained = gained or two.makespan < one.makespan * (1 - 1e-6)
        assert sum(e.action.kind is Kind.W for e in two.events) == sum(e.action.kind is Kind.W for e in one.events)
        none = dataclasses.replace(costs, w=(0.0,) * p)
        assert simulate(sched, dataclasses.replace(none, w_lane=True)).makespan == pytest.approx(
            simulate(sched, none).makespan, rel=1e-12)
    # a W longer than the main action beside it ends that action sooner; GPipe and 1F1B run B and W as one BW
    assert gained == (name not in ("gpipe", "1f1b", "interleaved-1f1b"))
