"""The simulator at scale: equal to the straightforward walk it replaced, and linear in the actions.

The reference below is the simulator as it was before issue 15 (git 769d855,
``fxpipe/schedules/simulate.py`` and ``ir.py``), cut to what differs: the walk re-derives every
dependency from the action lists (``_is_fused`` and ``split_backward`` scan whole ranks), so it is
quadratic. The new one must give the same SimResult, to the bit, and the same errors.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fxpipe.errors import ScheduleError
from fxpipe.schedules.generators import GENERATORS, generate, one_rank, zero_bubble
from fxpipe.schedules.ir import COMM, COMPUTE, Action, Kind, Schedule, with_communication
from fxpipe.schedules.simulate import (
    Costs,
    Event,
    RankStats,
    SimResult,
    _allreduce_lanes,
    _asynchronous,
    _walk,
    _with,
    report,
    simulate,
    validate,
)
from fxpipe.schedules.timeline import ascii_timeline

# -- the reference: the old walk, verbatim but for names ---------------------------------------------------------


def _ref_simulate(schedule: Schedule, costs: Costs, *, dp: int | None = None,
                  allreduce: Sequence[float] | None = None, cores: int | None = None) -> SimResult:
    _ref_check_counts(schedule)
    if len(costs.f) != schedule.num_stages:
        raise ScheduleError(f"costs give {len(costs.f)} stages, the schedule has {schedule.num_stages}; "
                            "give one cost per stage")
    costs = _with(costs, schedule, dp, allreduce, cores)
    scale = costs.compute_scale(schedule.num_ranks)
    timed = costs if scale == 1.0 else dataclasses.replace(
        costs, f=tuple(t * scale for t in costs.f), b=tuple(t * scale for t in costs.b),
        w=tuple(t * scale for t in costs.w))
    if not schedule.synchronous:  # charging an asynchronous schedule's per-microbatch steps: shared, not the walk's
        timed = _asynchronous(schedule, timed)
    full = _ref_with_communication(schedule)
    events = _ref_walk(full, timed)
    lanes = _allreduce_lanes(events, timed, full.num_ranks)
    ranks = []
    step_compute_end = max((e.end for e in events if e.action.kind in COMPUTE), default=0.0)
    for r in range(full.num_ranks):
        mine = [e for e in events if e.rank == r]
        compute = [e for e in mine if e.action.kind in COMPUTE]
        if not compute:
            ranks.append(RankStats(r, 0.0, 0.0, 0.0, 0.0, 0, 0.0))
            continue
        start, end = min(e.start for e in compute), max(e.end for e in compute)
        lane = [e for e in lanes if e.rank == r]
        ranks.append(RankStats(
            r, start, end, sum(e.end - e.start for e in compute), *_ref_memory(compute, timed),
            sum(timed.send_bytes[e.action.stage] if timed.send_bytes else 0.0
                for e in mine if e.action.kind in (Kind.SEND_F, Kind.SEND_B)),
            sum(e.end - e.start for e in lane), max((e.end for e in lane), default=0.0),
            sum(max(0.0, e.end - max(e.start, end)) for e in lane),
            sum(max(0.0, e.end - max(e.start, step_compute_end)) for e in lane),
            sum(timed.optimizer_s[s] for s in range(schedule.num_stages)
                if timed.optimizer_s and schedule.rank_of_stage[s] == r),
        ))
    active = [r for r in ranks if r.end > r.start]
    makespan = (max(r.step_end for r in active) - min(r.start for r in active)) if active else 0.0
    per_mb = _ref_staleness(schedule) if not schedule.synchronous else {}
    worst: dict[int, int] = {}
    for (s, _), n in per_mb.items():
        worst[s] = max(worst.get(s, 0), n)
    return SimResult(schedule.name, makespan, max((r.step_end - r.start for r in active), default=0.0), tuple(ranks),
                     tuple(events), worst, per_mb, timed.dp, tuple(lanes))


def _ref_validate(schedule: Schedule) -> None:
    _ref_check_counts(schedule)
    _ref_walk(_ref_with_communication(schedule), None)


def _ref_with_communication(schedule: Schedule) -> Schedule:
    if any(a.kind in COMM for r in schedule.ranks for a in r):
        return schedule
    where = schedule.rank_of_stage
    last = schedule.num_stages - 1
    ranks = []
    for acts in schedule.ranks:
        out: list[Action] = []
        for a in acts:
            s, m = a.stage, a.mb
            if a.kind is Kind.F and s > 0 and where[s - 1] != where[s]:
                out.append(Action(s, Kind.RECV_F, m))
            if a.kind in (Kind.B, Kind.BW) and s < last and where[s + 1] != where[s]:
                out.append(Action(s, Kind.RECV_B, m))
            out.append(a)
            if a.kind is Kind.F and s < last and where[s + 1] != where[s]:
                out.append(Action(s, Kind.SEND_F, m))
            if a.kind in (Kind.B, Kind.BW) and s > 0 and where[s - 1] != where[s]:
                out.append(Action(s, Kind.SEND_B, m))
        ranks.append(tuple(out))
    return Schedule(schedule.name, schedule.num_stages, schedule.num_microbatches, schedule.rank_of_stage,
                    tuple(ranks), schedule.synchronous, schedule.notes)


def _ref_check_counts(schedule: Schedule) -> None:
    seen: Counter[tuple[int, Kind, int]] = Counter()
    for r, acts in enumerate(schedule.ranks):
        for i, a in enumerate(acts):
            if not (0 <= a.stage < schedule.num_stages and 0 <= a.mb < schedule.num_microbatches):
                _ref_fail(schedule, f"{a} names a stage or microbatch outside {schedule.num_stages} stages x "
                          f"{schedule.num_microbatches} microbatches", {r: i})
            if a.kind in COMPUTE and schedule.rank_of_stage[a.stage] != r:
                _ref_fail(schedule, f"{a} runs on rank {r}, but stage {a.stage} lives on rank "
                          f"{schedule.rank_of_stage[a.stage]}", {r: i})
            seen[(a.stage, a.kind, a.mb)] += 1
            if seen[(a.stage, a.kind, a.mb)] > 1:
                _ref_fail(schedule, f"{a} runs twice; every action runs once", {r: i})
    for s in range(schedule.num_stages):
        for m in range(schedule.num_microbatches):
            fused = seen[(s, Kind.BW, m)]
            split = (seen[(s, Kind.B, m)], seen[(s, Kind.W, m)])
            if seen[(s, Kind.F, m)] != 1:
                _ref_fail(schedule, f"microbatch {m} never runs F on stage {s}; every microbatch runs F, B and W "
                          "(or BW) once per stage")
            if not ((fused == 1 and split == (0, 0)) or (fused == 0 and split == (1, 1))):
                _ref_fail(schedule, f"microbatch {m} on stage {s} runs BW {fused}x, B {split[0]}x, W {split[1]}x; "
                          "it needs BW once, or B once and W once")
    sends = Counter((a.stage, a.kind, a.mb) for r in schedule.ranks for a in r if a.kind in COMM)
    for (s, kind, m), n in sends.items():
        pair = {Kind.SEND_F: (s + 1, Kind.RECV_F), Kind.RECV_F: (s - 1, Kind.SEND_F),
                Kind.SEND_B: (s - 1, Kind.RECV_B), Kind.RECV_B: (s + 1, Kind.SEND_B)}[kind]
        if sends[(pair[0], pair[1], m)] != n:
            _ref_fail(schedule, f"{Action(s, kind, m)} has no matching {Action(pair[0], pair[1], m)}; "
                      "every send needs its receive")


def _ref_deps(a: Action, schedule: Schedule) -> list[Action]:
    s, m = a.stage, a.mb
    last = schedule.num_stages - 1
    where = schedule.rank_of_stage
    if a.kind is Kind.F:
        if s == 0:
            return []
        return [Action(s, Kind.RECV_F, m)] if where[s - 1] != where[s] else [Action(s - 1, Kind.F, m)]
    if a.kind in (Kind.B, Kind.BW):
        deps = [Action(s, Kind.F, m)]
        if s < last:
            deps.append(Action(s, Kind.RECV_B, m) if where[s + 1] != where[s] else _ref_backward(schedule, s + 1, m))
        return deps
    if a.kind is Kind.W:
        return [Action(s, Kind.B, m)]
    if a.kind is Kind.SEND_F:
        return [Action(s, Kind.F, m)]
    if a.kind is Kind.SEND_B:
        return [_ref_backward(schedule, s, m)]
    if a.kind is Kind.RECV_F:
        return [Action(s - 1, Kind.SEND_F, m)]
    return [Action(s + 1, Kind.SEND_B, m)]


def _ref_backward(schedule: Schedule, s: int, m: int) -> Action:
    split = any(a.kind in (Kind.B, Kind.W) for r in schedule.ranks for a in r)
    fused = any(a == Action(s, Kind.BW, m) for a in schedule.ranks[schedule.rank_of_stage[s]])
    return Action(s, Kind.B if split and not fused else Kind.BW, m)


def _ref_walk(schedule: Schedule, costs: Costs | None) -> list[Event]:
    done: dict[Action, float] = {}
    arrival: dict[Action, float] = {}
    link_free: dict[tuple[int, int], float] = {}
    where = schedule.rank_of_stage
    clock = [0.0] * schedule.num_ranks
    pos = [0] * schedule.num_ranks
    events: list[Event] = []
    total = sum(len(r) for r in schedule.ranks)
    while len(events) < total:
        moved = False
        for r, acts in enumerate(schedule.ranks):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                deps = _ref_deps(a, schedule)
                if any(d not in done for d in deps):
                    break
                ready = max((done[d] for d in deps), default=0.0)
                if a.kind in (Kind.RECV_F, Kind.RECV_B):
                    ready = arrival[deps[0]]
                start = max(clock[r], ready) if a.kind is not Kind.SEND_F and a.kind is not Kind.SEND_B else clock[r]
                end = start + (costs.time(a) if costs is not None else 1.0 if a.kind in COMPUTE else 0.0)
                clock[r] = end
                done[a] = end
                if a.kind in (Kind.SEND_F, Kind.SEND_B):
                    produced = a.stage if a.kind is Kind.SEND_F else a.stage - 1
                    link = (r, where[a.stage + 1] if a.kind is Kind.SEND_F else where[a.stage - 1])
                    begin = max(end, link_free.get(link, end))
                    arrival[a] = link_free[link] = begin + (costs.transfer(produced) if costs is not None else 0.0)
                events.append(Event(r, a, start, end))
                pos[r] += 1
                moved = True
        if not moved:
            stuck = {r: pos[r] for r in range(schedule.num_ranks) if pos[r] < len(schedule.ranks[r])}
            waits = []
            for r, i in stuck.items():
                a = schedule.ranks[r][i]
                missing = [str(d) for d in _ref_deps(a, schedule) if d not in done]
                waits.append(f"rank {r} at {a} waits for {', '.join(missing)}")
            _ref_fail(schedule, "deadlock: no rank can run its next action (" + "; ".join(waits) + ")", stuck)
    return events


def _ref_memory(compute: Sequence[Event], costs: Costs) -> tuple[float, int]:
    held_fb = costs.held_fb or (1.0,) * len(costs.f)
    held_bw = costs.held_bw or (1.0,) * len(costs.f)
    level, peak, in_flight, peak_flight = 0.0, 0.0, 0, 0
    for e in sorted(compute, key=lambda e: e.end):
        s, kind = e.action.stage, e.action.kind
        if kind is Kind.F:
            level += held_fb[s]
            in_flight += 1
        elif kind is Kind.B:
            level += held_bw[s] - held_fb[s]
        elif kind is Kind.W:
            level -= held_bw[s]
            in_flight -= 1
        else:
            level -= held_fb[s]
            in_flight -= 1
        peak, peak_flight = max(peak, level), max(peak_flight, in_flight)
    return peak, peak_flight


def _ref_staleness(schedule: Schedule) -> dict[tuple[int, int], int]:
    out: dict[tuple[int, int], int] = {}
    for acts in schedule.ranks:
        for s in {a.stage for a in acts}:
            updates = 0
            f_at: dict[int, int] = {}
            for a in acts:
                if a.stage != s or a.kind not in COMPUTE:
                    continue
                if a.kind is Kind.F:
                    f_at[a.mb] = updates
                elif a.kind in (Kind.BW, Kind.W):
                    out[(s, a.mb)] = updates - f_at[a.mb]
                    updates += 1
    return out


def _ref_grid(schedule: Schedule, mark: dict[int, int] | None = None) -> str:
    mark = mark or {}
    steps = max((len(r) for r in schedule.ranks), default=0)
    width = max([len(str(a)) for r in schedule.ranks for a in r] + [6]) + 3
    lines = ["step  " + "".join(f"rank {r}".ljust(width) for r in range(schedule.num_ranks))]
    for i in range(steps):
        cells = []
        for r, acts in enumerate(schedule.ranks):
            text = str(acts[i]) if i < len(acts) else ""
            if mark.get(r) == i:
                text += " <<"
            cells.append(text.ljust(width))
        lines.append(f"{i:>4}  " + "".join(cells).rstrip())
    return "\n".join(lines)


def _ref_fail(schedule: Schedule, message: str, mark: dict[int, int] | None = None) -> None:
    raise ScheduleError(f"invalid schedule {schedule.name!r}: {message}\n{_ref_grid(schedule, mark)}")


# -- equal to the reference ------------------------------------------------------------------------------------

_TIMES = st.sampled_from([0.0, 0.5, 1.0, 1.25, 2.0, 3.0, 0.1])
# zb-h2's greedy scheduler steps time by 1e-9 while every stage waits for a transfer in flight (1e9 steps
# for a transfer of 1): its schedules are made with free transfers, then simulated with the drawn ones.
_GREEDY = ("zb-h2", "zb-greedy")


def _outcome(run: Callable[[], Any]) -> Any:
    """What ``run`` returns, or the message of the ScheduleError it raises."""
    try:
        return run()
    except ScheduleError as exc:
        return ("ScheduleError", str(exc))


@st.composite
def _cases(draw: st.DrawFn) -> tuple[Schedule, Costs]:
    name = draw(st.sampled_from([*GENERATORS, "zb-greedy", "zb-gpipe", "gpipe-one-rank"]))
    if name == "interleaved-1f1b":
        ranks = draw(st.integers(1, 3))
        p, m = 2 * ranks, ranks * draw(st.integers(1, 4))
    else:
        p, m = draw(st.integers(1, 5)), draw(st.integers(1, 10))
    n = p
    costs = Costs(
        tuple(draw(st.lists(_TIMES, min_size=n, max_size=n))), tuple(draw(st.lists(_TIMES, min_size=n, max_size=n))),
        tuple(draw(st.lists(_TIMES, min_size=n, max_size=n))),
        tuple(draw(st.lists(st.sampled_from([0.0, 10.0, 100.0, 64.0]), min_size=n, max_size=n))),
        tuple(draw(st.lists(st.sampled_from([1.0, 4.0, 10.0]), min_size=n, max_size=n))),
        tuple(draw(st.lists(st.sampled_from([1.0, 2.0, 0.5]), min_size=n, max_size=n))),
        latency=draw(st.sampled_from([0.0, 0.25, 1.0])), bandwidth=draw(st.sampled_from([float("inf"), 50.0, 200.0])),
        dp=draw(st.integers(1, 3)),
        grad_bytes=tuple(draw(st.lists(st.sampled_from([0.0, 3e7, 8e7]), min_size=n, max_size=n))),
        allreduce_latency=0.01, allreduce_bandwidth=1e8,
        allreduce_s=draw(st.sampled_from([(), tuple(float(s % 3) for s in range(n))])),
        cores=draw(st.sampled_from([None, 1, 3])),
        optimizer_s=draw(st.sampled_from([(), tuple(0.5 for _ in range(n))])),
    )
    made_for = dataclasses.replace(costs, send_bytes=()) if name in _GREEDY else costs
    if name == "zb-greedy":
        sched = zero_bubble(p, m, made_for, limits=[draw(st.integers(p, 2 * p))] * p, name=name)
    elif name in ("zb-gpipe", "gpipe-one-rank"):
        sched = one_rank(p, m, defer_w=name == "zb-gpipe")
    else:
        sched = generate(name, p, m, made_for)
    if draw(st.booleans()):  # sends and receives given, not inserted
        sched = with_communication(sched)
    if draw(st.integers(0, 3)) == 0:  # two actions of one rank swapped: valid in another order, or deadlocked
        r = draw(st.integers(0, sched.num_ranks - 1))
        acts = list(sched.ranks[r])
        i, j = draw(st.integers(0, len(acts) - 1)), draw(st.integers(0, len(acts) - 1))
        acts[i], acts[j] = acts[j], acts[i]
        sched = dataclasses.replace(sched, ranks=sched.ranks[:r] + (tuple(acts),) + sched.ranks[r + 1:])
    return sched, costs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_simulate_equals_the_reference_walk(case: tuple[Schedule, Costs]) -> None:
    sched, costs = case
    new = _outcome(lambda: simulate(sched, costs))
    old = _outcome(lambda: _ref_simulate(sched, costs))
    assert new == old
    assert _outcome(lambda: validate(sched)) == _outcome(lambda: _ref_validate(sched))
    if isinstance(new, SimResult):
        assert new.to_json() == old.to_json()
        assert report(new, sched).rows == report(old, sched).rows
        assert ascii_timeline(new) == ascii_timeline(old)


@pytest.mark.parametrize("bad", [
    Schedule("x", 2, 2, (0, 1), ((Action(0, Kind.F, 0), Action(0, Kind.F, 1), Action(0, Kind.BW, 0),
                                  Action(0, Kind.BW, 1), Action(0, Kind.SEND_F, 1)),
                                 (Action(1, Kind.F, 0), Action(1, Kind.F, 1), Action(1, Kind.BW, 0),
                                  Action(1, Kind.BW, 1)))),  # a send without its receive
    Schedule("x", 2, 2, (0, 1), ((Action(0, Kind.F, 0), Action(0, Kind.F, 5)), (Action(1, Kind.F, 0),))),  # range
    Schedule("x", 2, 1, (0, 1), ((Action(0, Kind.F, 0), Action(0, Kind.B, 0), Action(0, Kind.BW, 0)),
                                 (Action(1, Kind.F, 0), Action(1, Kind.BW, 0)))),  # B and BW
    Schedule("x", 2, 1, (0, 1), ((Action(0, Kind.BW, 0),), (Action(1, Kind.F, 0), Action(1, Kind.BW, 0)))),  # no F
])
def test_broken_schedules_fail_with_the_reference_message(bad: Schedule) -> None:
    assert _outcome(lambda: validate(bad)) == _outcome(lambda: _ref_validate(bad))
    assert isinstance(_outcome(lambda: validate(bad)), tuple)


def test_a_deadlock_in_a_long_schedule_draws_only_the_steps_near_each_stuck_action() -> None:
    sched = generate("1f1b", 2, 2000)
    acts = list(sched.ranks[1])
    acts[2000], acts[2001] = acts[2001], acts[2000]  # rank 1: a BW before its F, halfway
    bad = dataclasses.replace(sched, ranks=(sched.ranks[0], tuple(acts)))
    with pytest.raises(ScheduleError) as info:
        validate(bad)
    text = str(info.value)
    assert "deadlock" in text and f"rank 1 at {acts[2000]} waits for 1F1000" in text
    assert text.count("<<") == 2 and f"{acts[2000]} <<" in text
    assert "not drawn (of " in text and len(text.splitlines()) < 60  # not 8,000 lines of grid


# -- linear in the actions -------------------------------------------------------------------------------------


def _actions(sched: Schedule) -> int:
    return sum(len(r) for r in with_communication(sched).ranks)


@pytest.mark.parametrize("name", list(GENERATORS))
def test_the_walk_checks_each_action_about_once(name: str) -> None:
    """Each dependency check runs an action or finds its rank waiting, once per round: never more than
    twice the actions (the old walk re-derived every dependency by scanning whole ranks)."""
    for m in (8, 200, 2000):
        sched = with_communication(generate(name, 4, m))
        actions = _actions(sched)
        assert actions <= _walk(sched, Costs.uniform(4, 1.0, 2.0, 0.5)).checks <= 2 * actions


def _calls(run: Callable[[], object]) -> int:
    """Python and C function calls ``run`` makes: a deterministic count of work, unlike wall time."""
    count = 0

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return count


@pytest.mark.parametrize("name", list(GENERATORS))
def test_ten_times_the_microbatches_is_ten_times_the_work(name: str) -> None:
    """Generate, simulate, report and draw 100 and 1,000 microbatches: calls grow at most 11x (the
    quadratic walk made 60x to 90x the calls for the same tenfold step)."""
    costs = Costs(f=(1.0, 1.5, 1.0, 2.0), b=(2.0, 2.0, 3.0, 1.0), w=(1.0, 0.5, 1.0, 1.0),
                  send_bytes=(64.0,) * 4, latency=0.5, bandwidth=100.0, dp=2, grad_bytes=(1e6,) * 4)

    def path(m: int) -> Callable[[], object]:
        def run() -> object:
            sched = generate(name, 4, m, dataclasses.replace(costs, send_bytes=()))  # free for zb-h2 (see _GREEDY)
            result = simulate(sched, costs)
            return report(result, sched), ascii_timeline(result)
        return run

    small, large = _calls(path(100)), _calls(path(1000))
    assert large <= 11 * small, (small, large)


def test_a_long_timeline_shows_what_fills_each_column_not_whichever_action_crosses_its_edge() -> None:
    """A steady 1F1B (F = 1, BW = 2) is two thirds X in every column; a steady zb-h1 with F = B = W
    runs no kind for more than half a column: ``*``. Drawing the action at each column edge made
    stripes of F and X (aliasing) that the schedule does not have."""
    one_f_one_b = ascii_timeline(simulate(generate("1f1b", 4, 3000), Costs.uniform(4, 1.0, 1.0, 1.0)), width=50)
    rows = [line.split("|")[1] for line in one_f_one_b.splitlines()[2:]]
    assert "* mixed" in one_f_one_b.splitlines()[1] and "digits" not in one_f_one_b
    for row in rows:
        assert len(row) == 50 and row[2:-2] == "X" * 46, row  # the ends fill and drain
    zb = ascii_timeline(simulate(generate("zb-h1", 4, 3000), Costs.uniform(4, 1.0, 1.0, 1.0)), width=50)
    for line in zb.splitlines()[2:]:
        assert set(line.split("|")[1][2:-2]) == {"*"}, line
    short = ascii_timeline(simulate(generate("1f1b", 2, 2), Costs.uniform(2, 1.0, 1.0, 1.0)), width=50)
    assert "digits: microbatch" in short and "F0" in short  # few actions: drawn one by one, as before
