"""The simulator with data parallelism: the all-reduce lane per rank, what it hides, dp = 1 unchanged, time-sharing."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fxpipe.errors import OptionError, ScheduleError
from fxpipe.planning.cost import allreduce_seconds
from fxpipe.schedules.generators import GENERATORS, generate
from fxpipe.schedules.ir import Schedule
from fxpipe.schedules.simulate import AllReduceEvent, Costs, simulate
from fxpipe.schedules.timeline import ascii_timeline, chrome_trace, measured_result, svg_gantt

GOLDEN = Path(__file__).parents[1] / "golden"
UNIT = Costs.uniform(2, 1.0, 1.0, 1.0)


def _lane(result: object) -> list[tuple[int, int, float, float]]:
    return [(e.rank, e.stage, e.start, e.end) for e in result.allreduce]  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_dp_1_gives_todays_result_whatever_the_all_reduce_inputs(name: str) -> None:
    stages = 4
    sched = generate(name, stages, 8)
    costs = Costs((1.0, 2.0, 1.5, 1.0), (1.0, 2.5, 1.0, 2.0), (0.5, 1.0, 2.0, 1.0), (100.0,) * 4, (3.0,) * 4,
                  (2.0,) * 4, latency=0.1, bandwidth=1e3)
    today = simulate(sched, costs)
    # dp = 1 reduces nothing: gradient bytes, a link, seconds per stage and spare cores change nothing.
    with_dp_inputs = dataclasses.replace(costs, grad_bytes=(1e9,) * 4, allreduce_latency=1.0, allreduce_bandwidth=1.0)
    for result in (simulate(sched, with_dp_inputs, dp=1), simulate(sched, costs, dp=1, allreduce=[5.0] * 4),
                   simulate(sched, costs, cores=8)):
        assert result == today
        assert result.to_json() == today.to_json()  # the JSON document is the one it always was
    assert today.allreduce == () and today.hidden_fraction == 1.0 and today.compute_makespan == today.makespan


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("schedule_*.csv")), ids=lambda p: p.stem)
def test_dp_1_on_the_golden_schedules(path: Path) -> None:
    sched = Schedule.from_csv(path.read_text())
    costs = Costs.uniform(sched.num_stages, 1.0, 1.0, 1.0)
    assert simulate(sched, costs, dp=1, allreduce=[1.0] * sched.num_stages) == simulate(sched, costs)


def test_a_tiny_case_by_hand() -> None:
    """1f1b, 2 stages, 2 microbatches, unit F/B/W (BW = 2), all-reduce 1.5 per stage::

        rank 0    |F0F1....X0XX..X1XX...|     compute 0 .. 9, all-reduce 9 .. 10.5: all exposed
        rank 0 ar |..................A0A|
        rank 1    |..F0X0XXF1X1XX.......|     compute 1 .. 7, all-reduce 7 .. 8.5: exposed on the rank,
        rank 1 ar |..............A1A....|     hidden in the step (rank 0 computes until 9)
    """
    result = simulate(generate("1f1b", 2, 2), UNIT, dp=2, allreduce=[1.5, 1.5])
    assert _lane(result) == [(0, 0, 9.0, 10.5), (1, 1, 7.0, 8.5)]
    r0, r1 = result.ranks
    assert (r0.end, r0.allreduce_s, r0.exposed_s, r0.exposed_step_s, r0.step_end) == (9.0, 1.5, 1.5, 1.5, 10.5)
    assert (r1.end, r1.allreduce_s, r1.exposed_s, r1.exposed_step_s, r1.step_end) == (7.0, 1.5, 1.5, 0.0, 8.5)
    assert r0.hidden_fraction == r1.hidden_fraction == 0.0
    assert (result.makespan, result.compute_makespan, result.max_stage_span) == (10.5, 9.0, 10.5)
    assert (result.allreduce_s, result.exposed_s, result.hidden_fraction) == (3.0, 3.0, 0.0)
    assert result.step_hidden_fraction == 0.5  # 1.5 of 3 ran while rank 0 still computed
    assert result.dp == 2 and result.allreduce_stage_s(2) == (1.5, 1.5)
    # Compute is what dp = 1 gives: the lane takes no compute time.
    assert result.events == simulate(generate("1f1b", 2, 2), UNIT).events


def test_two_stages_on_a_rank_hide_the_first_to_finish_and_queue_on_one_lane() -> None:
    """interleaved-1f1b, 4 stages on 2 ranks, 2 microbatches, unit costs. Rank 0 holds stages 0 and 2:
    stage 2's last BW ends at 11, stage 0's (the rank's last compute) at 15; rank 1 holds 1 and 3 (9, 13)::

        rank 0 |F0F1FF0F1F.....X0XX...X1XXXX0XXXX1XX....|
        rank 1 |..F0FF1F0FX0XXXF1X1XXXX0XXXX1XXX........|
    """
    sched = generate("interleaved-1f1b", 4, 2)
    result = simulate(sched, Costs.uniform(4, 1.0, 1.0, 1.0), dp=2, allreduce=[1.5] * 4)
    assert _lane(result) == [(0, 2, 11.0, 12.5), (0, 0, 15.0, 16.5), (1, 3, 9.0, 10.5), (1, 1, 13.0, 14.5)]
    r0, r1 = result.ranks
    assert (r0.allreduce_s, r0.exposed_s, r0.hidden_fraction) == (3.0, 1.5, 0.5)  # stage 2's hides behind stage 0
    assert (r1.allreduce_s, r1.exposed_s, r1.exposed_step_s) == (3.0, 1.5, 0.0)  # ends at 14.5, before rank 0's 15
    assert result.hidden_fraction == 0.5 and result.step_hidden_fraction == 0.75
    # A longer all-reduce: stage 2's (11 .. 16) still runs when stage 0 is ready at 15, so stage 0's waits for it.
    slow = simulate(sched, Costs.uniform(4, 1.0, 1.0, 1.0), dp=2, allreduce=[5.0] * 4)
    assert _lane(slow)[:2] == [(0, 2, 11.0, 16.0), (0, 0, 16.0, 21.0)]
    assert slow.ranks[0].exposed_s == 6.0 and slow.makespan == 21.0


def test_one_stage_per_rank_hides_nothing_on_the_rank_and_1f1b_hides_more_in_the_step_than_zb_h1() -> None:
    """Uniform 4 stages, 8 microbatches, all-reduce 3 per stage. A stage's gradients are final only after
    its last W, which is its rank's last compute, so on its own rank nothing hides, whatever the schedule.
    Behind the pipeline it does: 1F1B's cooldown ends stage 3, 2, 1, 0 at 27, 29, 31, 33, so the later
    stages' all-reduce runs while stage 0 computes (4 of 12 exposed in the step). ZB-H1 fills that
    cooldown with deferred Ws: every rank ends at 27 and all of it is exposed, in a shorter step
    (30 against 36).
    """
    costs = Costs.uniform(4, 1.0, 1.0, 1.0)
    one = simulate(generate("1f1b", 4, 8), costs, dp=2, allreduce=[3.0] * 4)
    zb = simulate(generate("zb-h1", 4, 8), costs, dp=2, allreduce=[3.0] * 4)
    assert one.hidden_fraction == zb.hidden_fraction == 0.0
    assert [r.end for r in one.ranks] == [33.0, 31.0, 29.0, 27.0]
    assert [r.exposed_step_s for r in one.ranks] == [3.0, 1.0, 0.0, 0.0]
    assert one.step_hidden_fraction == pytest.approx(2 / 3)
    assert [r.end for r in zb.ranks] == [27.0] * 4 and zb.step_hidden_fraction == 0.0
    assert one.step_hidden_fraction > zb.step_hidden_fraction
    assert (one.makespan, zb.makespan) == (36.0, 30.0)


def test_buckets_from_gradient_bytes_run_back_to_back() -> None:
    mib = 2**20
    costs = dataclasses.replace(UNIT, grad_bytes=(60 * mib, 10 * mib), allreduce_latency=1e-3,
                                allreduce_bandwidth=100 * mib)
    result = simulate(generate("1f1b", 2, 2), costs, dp=4)
    rank0 = [e for e in result.allreduce if e.rank == 0]
    assert [e.bucket for e in rank0] == [0, 1, 2]  # 25 + 25 + 10 MiB
    per_bucket = [1.5 * b / 100 + 6e-3 for b in (25, 25, 10)]  # 2(d-1)/d x MiB / (100 MiB/s) + 2(d-1) x 1 ms
    assert [e.end - e.start for e in rank0] == pytest.approx(per_bucket)
    assert all(a.end == b.start for a, b in zip(rank0, rank0[1:]))
    assert result.ranks[0].allreduce_s == pytest.approx(allreduce_seconds(60 * mib, 4, 100 * mib, 1e-3))
    assert costs.allreduce(1) == 0.0  # dp = 1 in the costs themselves
    assert dataclasses.replace(costs, dp=4).allreduce(1) == pytest.approx(1.5 * 10 / 100 + 6e-3)


def test_cores_time_share_compute_only() -> None:
    sched = generate("1f1b", 2, 4)
    base = simulate(sched, UNIT)
    shared = simulate(sched, UNIT, dp=2, cores=2)  # 4 ranks on 2 cores: F, B and W twice as long
    assert shared.makespan == 2 * base.makespan
    assert [e.end - e.start for e in shared.events] == [2 * (e.end - e.start) for e in base.events]
    assert simulate(sched, UNIT, dp=2, cores=4).makespan == base.makespan  # enough cores: no slowdown
    # The all-reduce is not scaled: it starts at the slowed compute's end and takes its own time.
    both = simulate(sched, UNIT, dp=2, cores=2, allreduce=[1.0, 1.0])
    assert both.makespan == 2 * base.makespan + 1.0


@pytest.mark.parametrize("kwargs, match", [
    ({"dp": 0}, "at least 1 replica"),
    ({"dp": 2, "allreduce": [1.0]}, "allreduce_s needs one value per stage"),
    ({"cores": 0}, "cores must be at least 1"),
])
def test_bad_dp_inputs_are_one_line(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(OptionError, match=match):
        simulate(generate("1f1b", 2, 2), UNIT, **kwargs)  # type: ignore[arg-type]


def test_timelines_draw_the_all_reduce_lane() -> None:
    result = simulate(generate("1f1b", 2, 2), UNIT, dp=2, allreduce=[1.5, 1.5])
    text = ascii_timeline(result, width=21)
    assert "2 ranks x dp 2" in text and "A all-reduce" in text
    assert "rank 0 ar |..................A0A|" in text and "rank 1 ar |..............A1A....|" in text
    assert "rank 0    |F0F1....X0XX..X1XX...|" in text
    trace = chrome_trace(result, time_unit_us=1.0)
    lane = [e for e in trace["traceEvents"] if e.get("cat") == "allreduce"]  # type: ignore[union-attr]
    assert [(e["pid"], e["tid"], e["ts"], e["dur"]) for e in lane] == [(0, 2, 9.0, 1.5), (1, 2, 7.0, 1.5)]
    json.dumps(trace)
    svg = svg_gantt(result)
    assert svg.count('class="allreduce"') == 2 and svg.count('class="arlane"') == 2
    # Without dp nothing of it is drawn.
    plain = simulate(generate("1f1b", 2, 2), UNIT)
    assert " ar |" not in ascii_timeline(plain, width=21) and 'class="allreduce"' not in svg_gantt(plain)
    assert not any(e.get("tid") == 2 for e in chrome_trace(plain)["traceEvents"])  # type: ignore[union-attr]


def test_a_measured_run_counts_its_all_reduce_as_the_simulator_does() -> None:
    measured = measured_result({0: [("0F0", 0.0, 1.0), ("0BW0", 2.0, 4.0)], 1: [("1F0", 1.0, 2.0)]}, "run",
                               allreduce={0: [(0, 3.0, 5.0), (0, 5.0, 6.0)]}, dp=2)
    assert measured.allreduce == (AllReduceEvent(0, 0, 0, 3.0, 5.0), AllReduceEvent(0, 0, 1, 5.0, 6.0))
    r0 = measured.ranks[0]
    assert (r0.allreduce_s, r0.exposed_s, r0.step_end) == (3.0, 2.0, 6.0)
    assert measured.hidden_fraction == pytest.approx(1 / 3) and measured.makespan == 6.0


def test_costs_from_a_plan_take_its_mesh_and_parameter_bytes() -> None:
    import fxpipe
    from fxpipe import models

    zoo = models.build("mlp-tiny")
    plan = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2, dp=2).plan
    costs = Costs.from_plan(plan)
    assert costs.dp == plan.mesh.dp == 2
    params = [sum(p.numel() * p.element_size() for p in stage.parameters()) for stage in
              fxpipe.compile(zoo.model, zoo.example_inputs, stages=2).stages]
    assert costs.grad_bytes == tuple(float(p) for p in params) and min(params) > 0
    assert (costs.allreduce_bandwidth, costs.allreduce_latency) == (plan.link.bandwidth, plan.link.latency)
    result = simulate(generate("1f1b", 2, 4), costs)
    assert result.allreduce_stage_s(2) == pytest.approx([allreduce_seconds(b, 2, plan.link.bandwidth,
                                                                           plan.link.latency) for b in params])


def test_the_optimizer_step_ends_each_rank_after_its_all_reduce() -> None:
    """1f1b, 2 stages, 2 microbatches, unit F/B/W (BW takes 2), dp 2 with 1.5 s all-reduce per stage: stage 1 ends
    its compute at 7 and its lane at 8.5; stage 0 at 9 and 10.5. Optimizer steps of 0.25 and 0.5 s end them at
    8.75 and 11."""
    costs = dataclasses.replace(Costs.uniform(2, 1.0, 1.0, 1.0), dp=2, allreduce_s=(1.5, 1.5))
    plain = simulate(generate("1f1b", 2, 2), costs)
    stepped = simulate(generate("1f1b", 2, 2), dataclasses.replace(costs, optimizer_s=(0.5, 0.25)))
    assert [r.step_end for r in plain.ranks] == [10.5, 8.5]
    assert [r.step_end for r in stepped.ranks] == [11.0, 8.75]
    assert stepped.makespan == plain.makespan + 0.5
    # A memory-bound pass: momentum SGD reads parameter, gradient and buffer and writes two (5 bytes per byte).
    with_opt = dataclasses.replace(costs, grad_bytes=(1e9, 2e9)).with_optimizer("momentum", 1e10)
    assert with_opt.optimizer_s == (0.5, 1.0)


def test_the_optimizer_step_adds_the_runtimes_host_time_per_step_and_per_tensor() -> None:
    """With the runtime's calibrated costs, a stage's optimizer step is its memory traffic plus a cost per step and
    one per parameter tensor (momentum's per-tensor cost for momentum); a stage without parameters steps nothing."""
    from fxpipe.plan import RuntimeOverheads

    over = RuntimeOverheads(0.0, 0.0, 0.0, optimizer=1e-4, optimizer_tensor=2e-6, optimizer_tensor_momentum=6e-6)
    costs = dataclasses.replace(Costs.uniform(3, 1.0, 1.0, 1.0), grad_bytes=(1e9, 2e9, 0.0), grad_tensors=(6, 4, 0))
    sgd = costs.with_optimizer("sgd", 1e10, over)
    assert sgd.optimizer_s == pytest.approx((0.3 + 1e-4 + 12e-6, 0.6 + 1e-4 + 8e-6, 0.0))
    momentum = costs.with_optimizer("momentum", 1e10, over)
    assert momentum.optimizer_s == pytest.approx((0.5 + 1e-4 + 36e-6, 1.0 + 1e-4 + 24e-6, 0.0))
    assert costs.with_optimizer("sgd", 1e10).optimizer_s == pytest.approx((0.3, 0.6, 0.0))  # no runtime: traffic only


def test_a_weight_tied_across_ranks_is_summed_after_the_last_of_its_ranks_then_each_steps() -> None:
    """gpipe, 3 stages on 3 ranks, 1 microbatch, unit F/B/W: the ranks end their compute at 9 (rank 0), 7 (rank 1) and
    5 (rank 2). A weight tied between stages 0 and 2 (10 bytes, all-reduce 1 s latency per ring step, 10 B/s: 2 x 1
    + 10 / 10 = 3 s) is summed from 9 to 12 on ranks 0 and 2, whose optimizer steps (0.5 s) then end them at 12.5;
    rank 1 holds none of it and ends at 7.5. A weight on one rank only, or tied within a rank, costs nothing."""
    from fxpipe.schedules.generators import generate

    costs = dataclasses.replace(Costs.uniform(3, 1.0, 1.0, 1.0), optimizer_s=(0.5, 0.5, 0.5), allreduce_latency=1.0,
                                allreduce_bandwidth=10.0)
    plain = simulate(generate("gpipe", 3, 1), costs)
    assert [r.end for r in plain.ranks] == [9.0, 7.0, 5.0]
    tied = simulate(generate("gpipe", 3, 1), dataclasses.replace(costs, tied=(((0, 2), 10.0),)))
    assert [r.tied_end for r in tied.ranks] == [12.0, 0.0, 12.0]
    assert [r.step_end for r in tied.ranks] == [12.5, 7.5, 12.5]
    assert tied.makespan == 12.5 and plain.makespan == 9.5
    # Two tied weights on the same ranks are summed one after the other.
    two = simulate(generate("gpipe", 3, 1), dataclasses.replace(costs, tied=(((0, 2), 10.0), ((0, 2), 10.0))))
    assert [r.tied_end for r in two.ranks] == [15.0, 0.0, 15.0]
    one_rank = simulate(generate("gpipe", 3, 1), dataclasses.replace(costs, tied=(((1,), 10.0),)))
    assert one_rank.makespan == plain.makespan


def test_costs_from_a_plan_read_the_weights_the_cache_cannot_hold_from_memory() -> None:
    """``Costs.dram_*``: each stage's parameter bytes times the share of the model's weights (and gradients) the
    cache cannot hold (``ComputeRates.cold``), over ``mem_bw``; F and B read each weight once, W reads and writes
    each gradient, and a stage whose B is empty (the first: its input takes no gradient) reads them for B's work in
    W. None for a plan without calibrated rates, or whose weights fit the cache."""
    import fxpipe
    from fxpipe import models
    from fxpipe.plan import ComputeRates

    zoo = models.build("mlp-tiny")
    model_bytes = sum(p.numel() * p.element_size() for p in zoo.model.parameters())
    rates = ComputeRates(gemm_flops=2e11, conv_flops=1e11, mem_bw=2e10, op_fwd=5e-6, op_bwd=8e-6, threads=1,
                         gemm_cold_curve=((1.0, 1e10), (256.0, 1e11)), cache_bytes=model_bytes / 2)
    plan = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2, compute=rates).plan
    costs = Costs.from_plan(plan)
    miss = 1 - (model_bytes / 2) / (2 * model_bytes)  # weights and gradients: 2x the model, on half its bytes
    per_stage = [sum(layer.param_bytes for layer in plan.layers[c.first_layer:c.end_layer]) for c in plan.stages]
    assert sum(per_stage) == model_bytes and min(per_stage) > 0
    assert costs.dram_f == pytest.approx([miss * b / 2e10 for b in per_stage])
    assert plan.stages[0].b == 0 and plan.stages[1].b > 0
    assert costs.dram_b == pytest.approx([0.0, miss * per_stage[1] / 2e10])
    assert costs.dram_w == pytest.approx([3 * miss * per_stage[0] / 2e10, 2 * miss * per_stage[1] / 2e10])
    fits = dataclasses.replace(rates, cache_bytes=4.0 * model_bytes)
    assert Costs.from_plan(fxpipe.compile(zoo.model, zoo.example_inputs, stages=2, compute=fits).plan).dram_f == ()
    assert Costs.from_plan(fxpipe.compile(zoo.model, zoo.example_inputs, stages=2).plan).dram_w == ()


def test_an_asynchronous_schedule_steps_after_every_w_and_pays_for_its_weight_copies() -> None:
    """Asynchronous schedules apply each microbatch's update after its W (or BW), so a stage's optimizer step is
    charged to every one of them, not once at the step's end; a weight policy's copies (``with_weights``) are charged
    to the actions that make them, as ``versions.copies`` counts them. Synchronous schedules keep one step at the end
    and ignore the policy."""
    base = dataclasses.replace(Costs.uniform(2, 1.0, 1.0, 1.0), grad_bytes=(1e9, 1e9))
    sched = generate("async-1f1b", 2, 4)  # rank 0: F F BW F BW F BW BW; rank 1: F BW x 4
    plain = simulate(sched, base).makespan
    stepped = simulate(sched, base.with_optimizer("sgd", 1e10))  # 0.3 s per step
    # every one of the 8 BWs is 0.3 s longer, and five of them lie on the step's longest path
    unstepped = sum(r.busy for r in simulate(sched, base).ranks)
    assert sum(r.busy for r in stepped.ranks) == pytest.approx(unstepped + 8 * 0.3)
    assert stepped.makespan == pytest.approx(plain + 5 * 0.3)
    assert all(r.optimizer_s == 0 for r in stepped.ranks)
    # stash: stage 0 snapshots in 3 of its 4 Fs (F0 and F1 meet version 0), stage 1 in all 4; a clone is 2 bytes per
    # byte, 0.2 s here: the mean over a stage's Fs is charged to each
    copied = base.with_weights("stash", "sgd", 1e10)
    assert copied.copy_s == (0.2, 0.2)
    from fxpipe.schedules.simulate import charged
    timed = charged(sched, copied)
    assert timed.f == pytest.approx((1.0 + 0.2 * 3 / 4, 1.0 + 0.2))
    assert charged(generate("1f1b", 2, 4), copied).f == base.f  # synchronous: no copies, no per-W steps
    assert charged(sched, base.with_weights("stale", "sgd", 1e10)).f == base.f
    # predict on momentum SGD: one pass of 3 bytes per byte per prediction
    assert base.with_weights("predict", "momentum", 1e10).copy_s == (0.3, 0.3)
    with pytest.raises(OptionError, match="no prediction-time model for optimizer 'sgd'"):
        base.with_weights("predict", "sgd", 1e10)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "async-1f1b", "layerpipe-async"])
def test_a_schedule_replayed_on_the_times_it_is_charged_is_its_own_simulation(name: str) -> None:
    """``replayed`` takes a run's measured per-action times in place of the costs'; fed back the very times
    ``charged`` gives each (stage, kind) (host time, time-sharing, per-W optimizer steps and copies included), it
    simulates the same step, charging none of them twice; and measured times twice as long make every action so."""
    from fxpipe.schedules.ir import Action, Kind
    from fxpipe.schedules.simulate import charged, replayed

    costs = dataclasses.replace(Costs.uniform(3, 1.0, 0.7, 0.5), grad_bytes=(1e9, 2e9, 1e9), latency=0.05,
                                send_bytes=(1e8, 1e8, 0.0), bandwidth=1e9, action_s=0.01, cores=2)
    costs = costs.with_optimizer("momentum", 2e10).with_weights("stash", "momentum", 2e10)
    sched = generate(name, 3, 6)
    timed = charged(sched, costs)
    kinds = {(a.stage, a.kind.value) for acts in sched.ranks for a in acts}
    measured = {(s, k): timed.time(Action(s, Kind(k), 0)) for s, k in kinds}
    assert simulate(sched, replayed(sched, costs, measured)).makespan == pytest.approx(simulate(sched, costs).makespan)
    slower = replayed(sched, costs, {key: 2 * t for key, t in measured.items()})
    assert all(slower.time(Action(s, Kind(k), 0)) == pytest.approx(2 * t) for (s, k), t in measured.items())
    with pytest.raises(ScheduleError, match="a measured F of stage 5 took 1.0 s, which a 3-stage schedule cannot"):
        replayed(sched, costs, {(5, "F"): 1.0})
