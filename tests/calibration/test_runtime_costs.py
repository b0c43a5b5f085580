"""Calibration: the link and contention measured on two real gloo ranks, and how it rescales the simulator's Costs.

Run as a script, this file is one rank of the two-process tests:
``python test_runtime_costs.py RANK WORLD INIT OUT link,allreduce``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests._helpers import HANG_S, Forked

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """One launch of two gloo ranks measuring the link (calibrate) and then the all-reduce (calibrate_allreduce):
    each measurement's result on every rank."""
    tmp_path = tmp_path_factory.mktemp("calibrate")
    init = f"file://{tmp_path / 'pg'}"
    procs = [Forked([__file__, str(r), "2", init, str(tmp_path), "link,allreduce"]) for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=HANG_S)
        assert p.returncode == 0, err[-3000:]
    return {what: [json.loads((tmp_path / f"rank{r}-{what}.json").read_text()) for r in range(2)]
            for what in ("link", "allreduce")}


def test_calibrate_on_two_gloo_ranks_fits_its_own_ping_pong(measured: dict[str, list[dict[str, Any]]]) -> None:
    from fxpipe.calibration.runtime_costs import Calibration, fit_link

    docs = measured["link"]
    assert docs[0] == {**docs[1], "seconds": docs[0]["seconds"]}  # every rank returns rank 0's measurement
    cal = Calibration.from_json(docs[0])
    # Real measurements, whatever the machine's speed (how well a fit follows its points is tested on fixed
    # readings in test_fit_link_*): every time was measured (> 0, finite), and the link is the fit of its own
    # ping-pong's one-way times
    assert cal.sizes == (4, 4096, 65536, 262144, 1048576, 4194304) and len(cal.one_way) == len(cal.sizes)
    assert all(t > 0 and math.isfinite(t) for t in (*cal.one_way, cal.alone, cal.together, cal.seconds))
    assert (cal.latency, cal.bandwidth) == fit_link(cal.sizes, cal.one_way)
    assert cal.latency >= 0 and cal.bandwidth > 0
    assert cal.contention > 0 and cal.memory_contention > 0 and math.isfinite(cal.memory_contention)
    assert cal.transfer(cal.sizes[-1]) > cal.transfer(cal.sizes[0])


_MEASURE = """
import dataclasses, json
from fxpipe.plan import ComputeRates
from fxpipe.calibration.runtime_costs import measure_overheads

rates = ComputeRates(gemm_flops=1e11, conv_flops=1e11, mem_bw=3e10, op_fwd=2e-5, op_bwd=3e-5, threads=1,
                     graph_op_fwd=2e-5, graph_op_bwd=1.5e-5, graph_op_fwd_cached=7e-6, graph_op_bwd_cached=6e-6)
print(json.dumps(dataclasses.asdict(measure_overheads(rates, machine="test"))))
"""


def test_measure_overheads_spawns_two_ranks_that_leave_without_gloos_teardown() -> None:
    """The real two-process measurement, in a process of its own as fxpipe compile runs it: the ranks exit (os._exit
    after rank 0 wrote every result, skipping gloo's teardown, which can abort) with status 0, the costs come back
    whole, and the parent's exit says nothing: a rank's exit leaves no multiprocessing semaphore registered (tqdm's
    lock, when tqdm is installed, as the dev extra installs it, made one and the resource tracker warned of it)."""
    done = subprocess.run([sys.executable, "-c", _MEASURE], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "leaked" not in done.stderr and "Warning" not in done.stderr, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["machine"].startswith("test|") and got["threads"] == 1
    # Timed where they run: a Python runtime never runs a loss and its gradient, an isend or an optimizer step in
    # 0 s. The step's cost is what the others leave of the measured step (step_residual): 0 where they simulate all
    # of it. (How the optimizer's costs are read from its timings: test_optimizer_costs_*, on an injected clock.)
    costs = {k: v for k, v in got.items() if k not in ("machine", "threads")}
    assert all(v >= 0 and math.isfinite(v) for v in costs.values()), got
    assert got["step"] >= 0 and got["loss"] > 0 and got["send"] > 0 and got["optimizer"] > 0, got


def test_measure_overheads_keeps_results_written_before_a_rank_aborts_in_teardown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that aborts after rank 0 wrote the results (gloo's teardown: SIGABRT) loses nothing; one that dies
    before is one line naming the failure and the way out, not a traceback."""
    import torch.multiprocessing as mp

    from fxpipe.calibration.runtime_costs import measure_overheads
    from fxpipe.errors import RankFailedError

    def aborts(write: bool) -> Any:
        def start(fn: Any, args: tuple[Any, ...], nprocs: int, start_method: str) -> None:
            assert nprocs == 2 and start_method == "spawn"
            if write:
                Path(args[3]).write_text(" ".join(repr(v * 1e-6) for v in range(1, 9)))
            raise mp.ProcessExitedException("process 1 terminated with signal SIGABRT", error_index=1, error_pid=1,
                                            exit_code=-6, signal_name="SIGABRT")
        return start

    monkeypatch.setattr(mp, "start_processes", aborts(write=True))
    got = measure_overheads(None, machine="m")
    assert (got.action, got.message, got.step, got.loss, got.send) == pytest.approx((1e-6, 2e-6, 3e-6, 4e-6, 5e-6))
    assert got.optimizer_tensor_momentum == pytest.approx(8e-6)
    monkeypatch.setattr(mp, "start_processes", aborts(write=False))
    with pytest.raises(RankFailedError, match=r"SIGABRT; re-run, or set FXPIPE_CALIBRATION=off") as e:
        measure_overheads(None, machine="m")
    assert "\n" not in str(e.value)


def test_measure_overheads_is_as_thorough_as_the_rates_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """Quick compute rates (the default calibration) get the quick runtime measurement (fewer steps, rounds and round
    trips on the ranks), full ones the full; each result says which it was."""
    import torch.multiprocessing as mp

    from fxpipe.calibration.compute import QUICK_MARK, is_full
    from fxpipe.calibration.runtime_costs import measure_overheads
    from fxpipe.plan import ComputeRates

    asked: list[bool] = []

    def start(fn: Any, args: tuple[Any, ...], nprocs: int, start_method: str) -> None:
        asked.append(args[-1])
        Path(args[3]).write_text(" ".join(repr(v * 1e-6) for v in range(1, 9)))

    monkeypatch.setattr(mp, "start_processes", start)
    rates = ComputeRates(gemm_flops=1e11, conv_flops=1e11, mem_bw=1e10, op_fwd=1e-6, op_bwd=1e-6, threads=1,
                         machine="m|0.1 s" + QUICK_MARK)
    got = [measure_overheads(rates, machine="m"), measure_overheads(dataclasses.replace(rates, machine="m|0.1 s"),
                                                                   machine="m")]
    assert asked == [False, True] and [is_full(o.machine) for o in got] == [False, True]


def test_calibration_scales_compute_and_sets_the_link() -> None:
    from fxpipe.calibration.runtime_costs import Calibration
    from fxpipe.schedules.simulate import Costs

    costs = Costs((1.0, 2.0), (3.0, 4.0), (5.0, 6.0), (100.0, 0.0), (7.0, 8.0), (9.0, 10.0))
    cal = Calibration(latency=2e-5, bandwidth=1e9, contention=1.25)
    out = cal.apply(costs)
    assert out.f == (1.25, 2.5) and out.b == (3.75, 5.0) and out.w == (6.25, 7.5)
    assert (out.latency, out.bandwidth) == (2e-5, 1e9)
    # Bytes and memory are the plan's own; only times change.
    assert (out.send_bytes, out.held_fb, out.held_bw) == (costs.send_bytes, costs.held_fb, costs.held_bw)
    assert out.transfer(0) == cal.transfer(100.0) == pytest.approx(2e-5 + 1e-7)
    assert cal.transfer(0) == 0.0 and out.transfer(1) == 0.0  # nothing sent costs nothing, as in the simulator
    assert costs.f == (1.0, 2.0) and costs.latency == 0.0  # the input is not changed
    # A calibration from before (no memory contention), or costs that read nothing from memory: the same scaling.
    assert Calibration.from_json({**cal.to_json(), "memory_contention": 1.0}).apply(costs) == out
    assert Calibration(2e-5, 1e9, 1.25, memory_contention=1.75).apply(costs) == out


def test_reads_from_memory_pay_the_memory_contention() -> None:
    """Each stage's seconds reading weights from memory (``Costs.dram_*``) slow down by ``memory_contention``, the
    rest by ``contention``: t * 1.25 + dram * (1.75 - 1.25); never less than the rest's when memory contends less."""
    from fxpipe.calibration.runtime_costs import Calibration
    from fxpipe.schedules.simulate import Costs

    costs = Costs((1.0, 2.0), (0.0, 4.0), (5.0, 6.0), dram_f=(0.5, 1.0), dram_b=(0.0, 1.0), dram_w=(1.5, 2.0))
    out = Calibration(2e-5, 1e9, 1.25, memory_contention=1.75).apply(costs)
    assert out.f == pytest.approx((1.25 + 0.25, 2.5 + 0.5))
    assert out.b == pytest.approx((0.0, 5.0 + 0.5))
    assert out.w == pytest.approx((6.25 + 0.75, 7.5 + 1.0))
    assert Calibration(2e-5, 1e9, 1.25, memory_contention=1.1).apply(costs).f == (1.25, 2.5)


def test_fit_link_recovers_a_line_and_clamps_a_negative_intercept() -> None:
    from fxpipe.calibration.runtime_costs import fit_link
    from fxpipe.errors import OptionError

    sizes = [4, 4096, 65536, 1 << 20, 4 << 20]
    latency, bandwidth = fit_link(sizes, [3e-5 + x / 2e9 for x in sizes])
    assert latency == pytest.approx(3e-5) and bandwidth == pytest.approx(2e9)
    latency, bandwidth = fit_link([1000, 2000], [0.5e-6, 1.5e-6])  # the line through them crosses 0 below 0
    assert latency == 0.0 and 0 < bandwidth < math.inf
    with pytest.raises(OptionError, match="two or more"):
        fit_link([4], [1e-5])


def test_messages_on_one_link_queue_behind_each_other() -> None:
    """The simulator's link model, which the calibration feeds: one message at a time per ordered pair of ranks.

    Stage 0 makes a 200-byte activation every 1 s; each takes 0.5 + 200/100 = 2.5 s to cross. The
    runtime's sends on one gloo pair go out in order, so the second arrives 2.5 s after the first,
    not 1 s after it. Gradients go the other way, on their own link.
    """
    from fxpipe.schedules.generators import generate
    from fxpipe.schedules.ir import Action, Kind
    from fxpipe.schedules.simulate import Costs, simulate

    costs = Costs((1.0, 1.0), (1.0, 1.0), (1.0, 1.0), (200.0, 0.0), (1.0, 1.0), (1.0, 1.0),
                  latency=0.5, bandwidth=100.0)
    result = simulate(generate("gpipe", 2, 3), costs)
    start = {e.action: e.start for e in result.events}
    assert [start[Action(1, Kind.F, m)] for m in range(3)] == pytest.approx([3.5, 6.0, 8.5])
    # Rank 1's backward runs right after its last F; each gradient queues on the 1 -> 0 link alone.
    recv_b = [e.start for e in result.events if e.action.kind is Kind.RECV_B]
    send_b = sorted(e.start for e in result.events if e.action.kind is Kind.SEND_B)
    assert sorted(recv_b) == pytest.approx([send_b[0] + 2.5, send_b[0] + 5.0, send_b[0] + 7.5])


def test_calibrate_allreduce_on_two_gloo_ranks_fits_the_ring(measured: dict[str, list[dict[str, Any]]]) -> None:
    from fxpipe.calibration.runtime_costs import AllReduceCalibration, fit_allreduce

    docs = measured["allreduce"]
    assert docs[0] == {**docs[1], "seconds": docs[0]["seconds"]}  # the slowest rank's times, on every rank
    ar = AllReduceCalibration.from_json(docs[0])
    # Real measurements, whatever the machine's speed (the fit's quality on fixed readings: the fit_allreduce
    # tests): every size was timed, and the ring is the fit of those times
    assert ar.dp == 2 and len(ar.sizes) == len(ar.measured) and min(ar.measured) > 0 and ar.seconds > 0
    assert (ar.latency, ar.bandwidth) == fit_allreduce(ar.sizes, ar.measured, 2)
    assert ar.latency >= 0 and ar.bandwidth > 0
    assert ar.allreduce(ar.sizes[-1]) > ar.allreduce(ar.sizes[0])


def test_calibrate_allreduce_keeps_each_sizes_typical_time_not_its_fastest(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step waits for its typical all-reduce: each size's time is the median of its least disturbed window of
    trips (as a message's, ``channel_one_way``), not its fastest trip, which was half the typical one here."""
    import fxpipe.calibration.runtime_costs as rc

    durations = iter([1, 1,  1, 9, 9, 9, 3, 3, 3, 3,      # 4 B: 2 warm-up trips, then windows [1 9 9 9] [3 3 3 3]
                      1, 1,  5, 5, 5, 5, 2, 8, 8, 8])     # 1 KiB: windows [5 5 5 5] [2 8 8 8]
    clock = [0.0]

    def all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        if async_op:  # the timed all-reduces; the group's MAX over ranks is not
            clock[0] += next(durations)

    monkeypatch.setattr(rc.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(rc.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(rc.dist, "barrier", lambda group=None: None)
    monkeypatch.setattr(rc.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(rc.time, "perf_counter", lambda: clock[0])
    ar = rc.calibrate_allreduce(sizes=(4, 1024), trips=8, window=4)
    assert ar.measured == (3.0, 5.0)  # the least disturbed window's median: not 1 and 2, the fastest trips
    assert next(durations, None) is None


def test_allreduce_calibration_sets_the_ring_and_fits_a_line() -> None:
    from fxpipe.calibration.runtime_costs import AllReduceCalibration, fit_allreduce
    from fxpipe.errors import OptionError
    from fxpipe.schedules.simulate import Costs

    # 4 ranks: t = 6 x 10 us + 1.5 x bytes / 2 GB/s.
    sizes = [4, 65536, 1 << 20, 16 << 20]
    latency, bandwidth = fit_allreduce(sizes, [6e-5 + 1.5 * x / 2e9 for x in sizes], 4)
    assert latency == pytest.approx(1e-5) and bandwidth == pytest.approx(2e9)
    with pytest.raises(OptionError, match="2 or more ranks"):
        fit_allreduce(sizes, [1.0] * 4, 1)
    ar = AllReduceCalibration(latency=1e-5, bandwidth=2e9, dp=4)
    costs = Costs.uniform(2, 1.0, 2.0, 3.0)
    out = ar.apply(costs)
    assert (out.allreduce_latency, out.allreduce_bandwidth) == (1e-5, 2e9)
    assert (out.f, out.latency, out.bandwidth, out.dp) == (costs.f, costs.latency, costs.bandwidth, 1)
    assert ar.allreduce(8e6) == pytest.approx(6e-5 + 1.5 * 8e6 / 2e9)  # one bucket
    assert ar.allreduce(8e6, dp=2) == pytest.approx(2e-5 + 8e6 / 2e9)
    assert ar.allreduce(8e6, dp=1) == 0.0


def _rank(rank: int, world: int, init: str, out: str, what: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        from fxpipe.calibration.runtime_costs import calibrate, calibrate_allreduce

        for one in what.split(","):
            cal = calibrate() if one == "link" else calibrate_allreduce()
            (Path(out) / f"rank{rank}-{one}.json").write_text(json.dumps(cal.to_json()))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
    from tests.runtime._leave import leave

    leave()  # without gloo's teardown, which can abort a rank at exit after its results are written (pytorch#179291)


def test_least_disturbed_takes_the_quietest_runs_median():
    from fxpipe.calibration.runtime_costs import least_disturbed

    quiet, loaded = [1.0, 1.1, 9.0], [3.0, 3.2, 3.1]  # an outlier in the quiet run; every value of the loaded one high
    assert least_disturbed([loaded, quiet]) == 1.1
    assert least_disturbed([[2.0], [], [0.5]]) == 0.5


def test_step_residual_makes_the_calibration_pipeline_simulate_at_its_measured_step() -> None:
    """The step's cost is the measured step less what every other cost simulates, in the cache's units: read back
    as fxpipe run reads it (times the sustained speed), the pipeline simulates at exactly the measured step; a
    measured step under the simulated one leaves no cost, never a negative one."""
    import dataclasses

    import torch

    import fxpipe
    from fxpipe.calibration.probes import Mix
    from fxpipe.calibration.runtime_costs import Calibration, step_residual
    from fxpipe.plan import ComputeRates, RuntimeOverheads
    from fxpipe.schedules.auto import plan_schedule
    from fxpipe.schedules.simulate import Costs, simulate

    rates = ComputeRates(gemm_flops=1e11, conv_flops=5e10, mem_bw=1e10, op_fwd=1e-5, op_bwd=1.5e-5, threads=1,
                         sustained=1.25)
    torch.manual_seed(0)
    x = torch.randn(2, 4, 2, 2)
    pipe = fxpipe.compile(Mix(), (x,), stages=2, tracer="fx", compute=rates, device_flops=rates.gemm_flops,
                          device_mem_bw=rates.mem_bw, verify_each=False)
    schedule = plan_schedule(pipe.plan, None, None)
    link = Calibration(latency=5e-5, bandwidth=5e9, contention=1.1, memory_contention=1.4)
    others = RuntimeOverheads(6e-5, 3e-5, 0.0, loss=1e-4, send=3e-5, optimizer=3e-5, optimizer_tensor=2e-6)

    def simulated(step: float) -> float:  # as fxpipe run simulates: the cached costs times the sustained speed
        read = dataclasses.replace(others, step=step).scaled(rates.sustained)
        return simulate(schedule, link.apply(Costs.from_plan(pipe.plan, read)).with_optimizer(
            "sgd", rates.mem_bw, read)).makespan

    bare = simulated(0.0)
    assert bare > 0
    step = step_residual(bare + 1e-3, pipe.plan, schedule, link, rates, others)
    assert step == pytest.approx(1e-3 / rates.sustained)
    assert simulated(step) == pytest.approx(bare + 1e-3)
    assert step_residual(bare * 0.9, pipe.plan, schedule, link, rates, others) == 0.0


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_optimizer_costs_are_the_line_through_the_step_times_over_the_tensor_counts(momentum: float) -> None:
    """On an injected clock: each SGD step over n tensors reads 100 us + 4 us per tensor (10 us with momentum), but
    for one disturbed step per count (another job only adds time); the line through the counts' least disturbed
    windows gives back the step's cost and the per-tensor one, whatever the machine's speed."""
    from fxpipe.calibration import runtime_costs as rc

    per_tensor = 10e-6 if momentum else 4e-6
    counts = (1, 16)
    reads: list[float] = []
    for n in counts:
        for k in range(20 + 2):
            took = 100e-6 + n * per_tensor + (5e-3 if k == 7 else 0.0)  # one step disturbed
            reads += [1.0, 1.0 + took] if k >= 2 else [1.0]  # before each step; after it, past the two untimed
    clock = iter(reads)
    step, tensor = rc.optimizer_costs(momentum=momentum, counts=counts, reps=20, window=10,
                                      clock=lambda: next(clock))
    assert next(clock, None) is None  # every reading used, no more
    assert step == pytest.approx(100e-6) and tensor == pytest.approx(per_tensor)
