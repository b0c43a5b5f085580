"""calibrate_compute: real measurements at small sizes, the per-machine cache (round trip, corrupt file), the
estimate made of the calibrated rates, and the off switch that keeps the test suite's plans machine-independent."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import fxpipe
from fxpipe import models
from fxpipe.api import PassControl, run_compile
from fxpipe.calibration import compute as cc
from fxpipe.calibration.probes import Mix
from fxpipe.cli.main import app
from fxpipe.errors import OptionError
from fxpipe.meta import get_meta
from fxpipe.passes.annotate_costs import annotate_costs
from fxpipe.passes.count_backward import graph_ops
from fxpipe.passes.trace import trace
from fxpipe.plan import DEFAULTS, CompileOptions, ComputeRates, Plan

RATES = ComputeRates(gemm_flops=2e11, conv_flops=1e11, mem_bw=2e10, op_fwd=5e-6, op_bwd=8e-6, threads=1,
                     conv_fwd=3e-5, conv_bwd=6e-5, machine="")


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "fxpipe"


def _fake_measure(calls: list[int]):  # type: ignore[no-untyped-def]
    def measure(threads: int, *, full: bool = True) -> ComputeRates:
        calls.append(threads)
        return dataclasses.replace(RATES, threads=threads,
                                   machine=cc.machine_key(threads) + "|0.0 s" + ("" if full else cc.QUICK_MARK))
    return measure


def _fake_overheads(calls: list[int]):  # type: ignore[no-untyped-def]
    from fxpipe.calibration.runtime_costs import RuntimeOverheads

    def measure(rates: ComputeRates, threads: int) -> RuntimeOverheads:
        calls.append(threads)
        return RuntimeOverheads(1e-4, 2e-5, 3e-4, threads, cc.machine_key(threads) + "|0.0 s", loss=4e-5,
                                send=8e-5)
    return measure


@pytest.fixture(autouse=True)
def no_real_overheads(monkeypatch: pytest.MonkeyPatch) -> None:
    """fxpipe compile's calibration would start two ranks to measure the runtime: tests that turn it on get a
    fake (the real measurement is tested on two gloo ranks in tests/calibration/test_runtime_costs.py)."""
    from fxpipe.cli import compile_cmd

    monkeypatch.setattr(compile_cmd, "measure_runtime_overheads", _fake_overheads([]))


def test_measure_compute_gives_positive_finite_rates(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every measurement at small settings: the skinny GEMM curves at 3 of their 9 row counts, the cold pool and the
    # cache probe at 8 weights (32 MiB) of their 32; each curve's shape is still checked against its table.
    monkeypatch.setattr(cc, "SKINNY_ROWS", (1, 16, 256))
    monkeypatch.setattr(cc, "COLD_POOL_MAX", 8)
    rates = cc.measure_compute(1, gemm_sizes=(64, 128), stream_bytes=1 << 20, runs=2)
    for name in ("gemm_flops", "conv_flops", "mem_bw", "op_fwd", "op_bwd"):
        value = getattr(rates, name)
        assert math.isfinite(value) and value > 0, (name, value)
    assert rates.conv_fwd >= 0 and rates.conv_bwd >= 0
    assert 1e8 < rates.gemm_flops < 1e14 and 1e7 < rates.mem_bw < 1e13
    assert 1e-8 < rates.op_fwd < 1e-2  # a node's host time: microseconds, not nothing and not seconds
    assert rates.threads == 1 and rates.machine.startswith(cc.machine_key(1))
    for curve in (rates.gemm_curve, rates.gemm_w_curve, rates.gemm_cold_curve, rates.gemm_w_cold_curve,
                  rates.gemm_t_curve, rates.gemm_t_cold_curve):
        assert [m for m, _ in curve] == [float(m) for m in cc.SKINNY_ROWS] and all(r > 0 for _, r in curve)
    assert 4 << 20 <= rates.cache_bytes <= max(cc.COLD_POOL_MAX * (4 << 20), cc.last_level_cache_bytes())
    # attention at two shapes: 4 x 2 x 4 x 128 x 128 x 64 forward FLOPs (two products) and 4x that at 256 tokens
    flops = [f for f, _ in rates.sdpa_curve]
    assert flops == [4.0 * 2 * 4 * 128 * 128 * 64, 4.0 * 2 * 4 * 256 * 256 * 64]
    assert [f for f, _ in rates.sdpa_b_curve] == flops
    assert all(1e8 < r < 1e14 for _, r in (*rates.sdpa_curve, *rates.sdpa_b_curve))
    # the slow kernels, each forward and backward, in bytes per second
    assert [name for name, _, _ in rates.kernels] == [name for name, _ in cc.KERNELS]
    assert all(1e6 < r < 1e13 for _, f, b in rates.kernels for r in (f, b))
    # the convolutions' gradients by kernel and output pixels, each at a rate
    assert [(a, m) for a, m, _, _ in rates.conv_grad_curve] == [(float(k * k), float(n * s * s))
                                                              for k, n, _, s in cc.CONV_GRAD_SHAPES]
    assert all(1e8 < r < 1e14 for _, _, b, w in rates.conv_grad_curve for r in (b, w))


def test_attention_is_costed_at_its_own_rates() -> None:
    """Scaled-dot-product attention runs its own kernel (on one core here gpt-base's at 77 GFLOP/s forward and 45
    per forward FLOP backward, against 175 for the square GEMMs): annotate_costs charges its F and B at the
    calibrated attention rates by FLOPs per call; a calibration without them (before format 16) the GEMM rate."""
    rates = dataclasses.replace(RATES, mem_bw=1e30, sdpa_curve=((1e6, 1e9), (1e9, 4e9)),
                                sdpa_b_curve=((1e6, 5e8), (1e9, 2e9)))
    assert rates.sdpa_rates(1e6) == (1e9, 5e8) and rates.sdpa_rates(1e12) == (4e9, 2e9)  # clamped at the ends
    assert rates.sdpa_rates(math.sqrt(1e6 * 1e9)) == pytest.approx((2.5e9, 1.25e9))  # half-way in log FLOPs
    assert dataclasses.replace(rates, sdpa_curve=()).sdpa_rates(1e6) == (RATES.gemm_flops, RATES.gemm_flops)
    zoo = models.build("gpt-small")
    gm = trace(zoo.model, zoo.example_inputs).gm

    def attention(r: ComputeRates) -> tuple[float, float, int]:
        out = annotate_costs(gm, zoo.example_inputs, compute=r).gm
        node = next(n for n in out.graph.nodes if "scaled_dot_product" in str(n.target))
        meta = get_meta(node)
        return meta.time_fwd - meta.host_fwd, meta.time_bwd_input - meta.host_bwd_input, meta.flops_fwd

    f, b, flops = attention(rates)
    assert flops > 0
    fwd, bwd = rates.sdpa_rates(flops)
    assert f == pytest.approx(flops / fwd) and b == pytest.approx(flops / bwd)
    f_old, b_old, _ = attention(dataclasses.replace(rates, sdpa_curve=(), sdpa_b_curve=()))
    assert f_old == pytest.approx(flops / RATES.gemm_flops) and b_old == pytest.approx(f_old)


def test_convolution_gradients_are_costed_by_their_output_pixels() -> None:
    """A convolution over few output pixels runs its gradients below its forward's rate (on one core here a 3x3's
    weight gradient at 2 x 7 x 7 pixels, 512 channels, at 27-52 GFLOP/s against 100 at 2 x 28 x 28): annotate_costs
    charges B and W at the curve's rates for the node's kernel and pixels where they are lower than the forward's,
    the forward's from the curve's largest point up, and everywhere without a curve."""
    curve = ((9.0, 100.0, 4e10, 1e10), (9.0, 1000.0, 8e10, 6e10), (1.0, 100.0, 2e10, 9e10))
    rates = dataclasses.replace(RATES, mem_bw=1e30, conv_fwd=0.0, conv_bwd=0.0, conv_grad_curve=curve)  # FLOPs alone
    assert rates.conv_grad_rates(9, 100) == (4e10, 1e10) and rates.conv_grad_rates(49, 50) == (4e10, 1e10)
    assert rates.conv_grad_rates(9, math.sqrt(100 * 1000)) == pytest.approx((6e10, 3.5e10))  # half-way in log pixels
    assert rates.conv_grad_rates(9, 1000) is None and rates.conv_grad_rates(1, 100) is None  # at the largest point
    assert rates.conv_grad_rates(1, 10) == (2e10, 9e10) and RATES.conv_grad_rates(9, 10) is None
    zoo = models.build("resnet-tiny")
    gm = trace(zoo.model, zoo.example_inputs).gm

    def convs(r: ComputeRates) -> list[tuple[float, float, float, int, float]]:
        out = annotate_costs(gm, zoo.example_inputs, compute=r).gm
        metas = [(n, get_meta(n)) for n in out.graph.nodes if n.op == "call_function" and "conv" in str(n.target)]
        assert len(metas) > 4
        weights = [out.get_parameter(str(n.args[1].target)).shape for n, _ in metas]
        return [(m.time_bwd_input - m.host_bwd_input, m.time_bwd_weight - m.host_bwd_weight, float(m.flops_fwd),
                 int(w[2] * w[3]), float(n.meta["val"].numel() // n.meta["val"].shape[1]))
                for (n, m), w in zip(metas, weights)]

    plain = convs(dataclasses.replace(rates, conv_grad_curve=()))
    seen = set()
    for (b, w, flops, area, pixels), (b0, w0, *_) in zip(convs(rates), plain):
        rate = RATES.conv_rate(flops)
        grad = rates.conv_grad_rates(area, pixels)
        if w0 == 0:  # the first convolution: no gradient to its input image, W only
            assert b == b0 == 0
        if grad is None:
            assert (b, w) == (b0, w0)
            seen.add("forward's rate")
            continue
        seen.add(f"{area}")
        assert b == pytest.approx(b0 * rate / min(rate, grad[0]))
        assert w == pytest.approx(w0 * rate / min(rate, grad[1]))
        assert w > w0  # below the forward's rate here
    assert seen == {"forward's rate", "9", "1"}, seen


KERNEL_RATES = (("batch_norm", 4e9, 6e9), ("max_pool2d 2x2", 1e9, 4e9), ("max_pool2d 3x3", 6e8, 4.5e9),
                ("dropout", 1e9, 8e9))


def test_slow_kernels_are_costed_at_their_own_rates() -> None:
    """Training-mode batch norm, max pooling and a drawn dropout run far below the memory bandwidth (on one core here
    5, 0.6-0.9 and 1.2 GB/s against 29): a node of one is charged its bytes at the kernel's calibrated rate, forward,
    and backward with one call for both gradients shared between B and W as the host time is; a calibration without
    them (before format 17), a kernel not timed, and a dropout that draws nothing keep the memory bandwidth."""
    rates = dataclasses.replace(RATES, gemm_flops=1e30, kernels=KERNEL_RATES)  # bytes, not FLOPs, decide these
    assert rates.kernel_rates("batch_norm") == (4e9, 6e9) and rates.kernel_rates("relu") is None
    assert rates.kernel_rates("max_pool2d 5x5") == (6e8, 4.5e9)  # the timed window nearest in area
    assert rates.kernel_rates("max_pool2d 1x2") == (1e9, 4e9)
    assert RATES.kernel_rates("batch_norm") is None

    def memory_parts(name: str, r: ComputeRates, op: str) -> list[tuple[float, float, float]]:
        zoo = models.build(name)
        out = annotate_costs(trace(zoo.model, zoo.example_inputs).gm, zoo.example_inputs, compute=r).gm
        metas = [get_meta(n) for n in out.graph.nodes if n.op == "call_function" and op in str(n.target)]
        assert metas
        return [(m.time_fwd - m.host_fwd, m.time_bwd_input - m.host_bwd_input, m.time_bwd_weight - m.host_bwd_weight)
                for m in metas]

    plain = dataclasses.replace(rates, kernels=())
    # resnet-tiny's batch norms: both gradients, each half of the backward call
    for (f, b, w), (f0, b0, _) in zip(memory_parts("resnet-tiny", rates, "batch_norm"),
                                      memory_parts("resnet-tiny", plain, "batch_norm")):
        assert f0 > 0 and f == pytest.approx(f0 * RATES.mem_bw / 4e9)
        assert b == pytest.approx(0.5 * b0 * RATES.mem_bw / 6e9) and w == pytest.approx(b)
    # vgg-tiny's 2x2 max pools: no parameter, the whole backward is B's
    for (f, b, w), (f0, b0, _) in zip(memory_parts("vgg-tiny", rates, "max_pool2d"),
                                      memory_parts("vgg-tiny", plain, "max_pool2d")):
        assert f == pytest.approx(f0 * RATES.mem_bw / 1e9) and b == pytest.approx(b0 * RATES.mem_bw / 4e9) and w == 0
    # vgg-tiny's and gpt-tiny's dropouts have p = 0: nothing drawn, the memory bandwidth
    for name in ("vgg-tiny", "gpt-tiny"):
        assert memory_parts(name, rates, "dropout") == memory_parts(name, plain, "dropout")
    # one that draws its mask
    model, x = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Dropout(0.1)), (torch.randn(8, 64),)
    drawn = [[get_meta(n) for n in annotate_costs(trace(model, x).gm, x, compute=r).gm.graph.nodes
              if "dropout" in str(n.target)] for r in (rates, plain)]
    assert len(drawn[0]) == 1
    (m, m0), = zip(*drawn)
    assert m.time_fwd - m.host_fwd == pytest.approx((m0.time_fwd - m0.host_fwd) * RATES.mem_bw / 1e9)
    b, b0 = m.time_bwd_input - m.host_bwd_input, m0.time_bwd_input - m0.host_bwd_input
    assert b == pytest.approx(b0 * RATES.mem_bw / 8e9)


def test_the_kernel_rates_round_trip_through_the_cache_and_the_plan(cache_dir: Path) -> None:
    with_kernels = dataclasses.replace(RATES, kernels=KERNEL_RATES, machine=cc.machine_key(1) + "|0.0 s",
                                       conv_grad_curve=((9.0, 98.0, 8e10, 3e10), (1.0, 98.0, 5e10, 9e10)))
    first, cached = cc.calibrate_compute(threads=1, measure=lambda threads: with_kernels)
    again, cached = cc.calibrate_compute(threads=1, measure=lambda threads: pytest.fail("measured again"))
    assert cached and again == first == with_kernels
    zoo = models.build("mlp-tiny")
    options = CompileOptions(compute=with_kernels, device_flops=RATES.gemm_flops, device_mem_bw=RATES.mem_bw)
    pipe = run_compile(zoo.model, zoo.example_inputs, options).pipeline
    assert pipe is not None
    assert Plan.from_json(json.loads(json.dumps(pipe.plan.to_json()))).options.compute == with_kernels
    doc = json.loads((cache_dir / "compute.json").read_text())
    doc[cc.machine_key(1)]["kernels"] = [["relu", -1.0, 2e9]]  # a corrupt entry is measured again
    (cache_dir / "compute.json").write_text(json.dumps(doc))
    calls: list[int] = []
    _, cached = cc.calibrate_compute(threads=1, measure=_fake_measure(calls))
    assert not cached and calls == [1]


def test_the_noisiest_rates_are_the_best_of_three_rounds_and_the_sustained_speed_their_median(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The convolution curve and the memory bandwidth are each the fastest of three rounds (per point), the sustained
    speed and the cache's size the median round's: a neighbour's burst over one round moves none of them."""
    rounds = iter([(((1e7, 5e10), (1e9, 1e11)), 1e10, 1.4),   # the first round: a burst, everything slow
                   (((1e7, 8e10), (1e9, 1.6e11)), 2.5e10, 1.2),
                   (((1e7, 9e10), (1e9, 1.5e11)), 2.8e10, 1.1)])
    caches = iter([20e6, 60e6, 50e6])
    monkeypatch.setattr(cc, "_noisy_round", lambda runs, stream_bytes: next(rounds))
    monkeypatch.setattr(cc, "effective_cache_bytes", lambda probe, runs: next(caches))
    # every other reading fixed too (test_measure_compute_gives_positive_finite_rates runs them for real)
    monkeypatch.setattr(cc, "_gemm_rate", lambda n, runs: 1e10)
    monkeypatch.setattr(cc, "_skinny_rate", lambda m, runs, **kw: 1e10)
    monkeypatch.setattr(cc, "_cold_conv_seconds", lambda *a: (1e-3, 2e-3))
    monkeypatch.setattr(cc, "_node_times", lambda runs, **kw: (1e-5, 2e-5, 1e-5, 2e-5, 5e-6, 1e-5))
    monkeypatch.setattr(cc, "_sdpa_point", lambda shape, runs: None)
    monkeypatch.setattr(cc, "_kernel_point", lambda name, shape, runs: (name, 1e9, 1e9))
    monkeypatch.setattr(cc, "_conv_grad_point", lambda *a: (1.0, 1.0, 1e10, 1e10))
    monkeypatch.setattr(cc, "_conv_rate", lambda runs, **kw: (1e10, 1e-4, 2e-4))
    rates = cc.measure_compute(1, gemm_sizes=(64,), stream_bytes=1 << 20, runs=2)
    assert rates.conv_curve == ((1e7, 9e10), (1e9, 1.6e11)) and rates.mem_bw == 2.8e10 and rates.sustained == 1.2
    assert rates.cache_bytes == 50e6
    assert next(rounds, None) is None and next(caches, None) is None  # three rounds, no more


def _fixed_readings(monkeypatch: pytest.MonkeyPatch, counts: dict[str, list[int]]) -> None:
    """Every reading of ``measure_compute`` fixed, and the runs each was asked for listed by name in ``counts``."""
    def counted(name: str, value: Any) -> None:
        def reading(*args: Any, **kwargs: Any) -> Any:
            runs = kwargs.get("runs", args[-1] if args and isinstance(args[-1], int) else 0)
            counts.setdefault(name, []).append(runs)
            return value(*args, **kwargs)
        monkeypatch.setattr(cc, name, reading)

    counted("_noisy_round", lambda runs, stream_bytes: (((1e7, 1e11),), 1e10, 1.0))
    counted("effective_cache_bytes", lambda probe, runs: 1e6)
    counted("_gemm_rate", lambda n, runs: 1e10)
    counted("_skinny_rate", lambda m, runs, **kw: 1e10)
    counted("_cold_conv_seconds", lambda *a: (1e-3, 2e-3))
    counted("_node_times", lambda runs, **kw: (1e-5, 2e-5, 1e-5, 2e-5, 5e-6, 1e-5))
    counted("_sdpa_point", lambda shape, runs: None)
    counted("_kernel_point", lambda name, shape, runs: (name, 1e9, 1e9))
    counted("_conv_grad_point", lambda *a: (1.0, 1.0, 1e10, 1e10))
    counted("_conv_rate", lambda runs, **kw: (1e10, 1e-4, 2e-4))
    monkeypatch.setattr(cc, "COLD_POOL_MAX", 1)


@pytest.mark.parametrize("full", [False, True])
def test_the_default_calibration_reads_one_round_at_fewer_rows_and_runs_and_the_full_one_three(
        monkeypatch: pytest.MonkeyPatch, full: bool) -> None:
    """The quick measurement (the default, a few seconds on the first compile) reads the noisy measurements and the
    host times once, the skinny GEMMs at ``QUICK_SKINNY_ROWS``, each the fastest of ``QUICK_RUNS``; the full one
    (``fxpipe compile --calibration full``) three times, at every ``SKINNY_ROWS``, of 10. Each says which it was."""
    counts: dict[str, list[int]] = {}
    _fixed_readings(monkeypatch, counts)
    rates = cc.measure_compute(full=full, gemm_sizes=(64,), stream_bytes=1 << 16)
    rounds, rows, runs = (3, cc.SKINNY_ROWS, 10) if full else (1, cc.QUICK_SKINNY_ROWS, cc.QUICK_RUNS)
    assert {name: len(counts[name]) for name in ("_noisy_round", "effective_cache_bytes", "_node_times",
                                                 "_cold_conv_seconds")} == dict.fromkeys(
        ("_noisy_round", "effective_cache_bytes", "_node_times", "_cold_conv_seconds"), rounds)
    assert counts["_gemm_rate"] == [runs] and counts["_node_times"] == [runs] * rounds
    assert len(counts["_skinny_rate"]) == 6 * len(rows)  # six curves
    for curve in (rates.gemm_curve, rates.gemm_w_curve, rates.gemm_cold_curve, rates.gemm_w_cold_curve,
                  rates.gemm_t_curve, rates.gemm_t_cold_curve):
        assert [m for m, _ in curve] == [float(m) for m in rows]
    assert cc.is_full(rates.machine) is full and rates.machine.startswith(cc.machine_key(1))


def test_a_quick_entry_serves_quick_calibrations_and_a_full_one_both(cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Measuring says so on fxpipe's logger (what, that it is cached, where); reading the cache says nothing."""
    calls: list[int] = []
    monkeypatch.setattr(cc, "measure_compute", _fake_measure(calls))
    caplog.set_level(logging.INFO, logger="fxpipe")

    def notes() -> list[str]:
        said = [r.getMessage() for r in caplog.records if r.name == "fxpipe.calibration.compute"]
        caplog.clear()
        return said

    quick, cached = cc.calibrate_compute()
    assert not cached and not cc.is_full(quick.machine) and calls == [1]
    assert notes() == [f"calibrating this host's compute rates at 1 thread (first run, a few seconds; "
                       f"{cc.ENV}=full measures in full; cached in {cc.cache_path()})"]
    assert cc.calibrate_compute() == (quick, True) and notes() == []
    full, cached = cc.calibrate_compute(full=True)  # the quick entry is not enough: measured again, in full
    assert not cached and cc.is_full(full.machine) and calls == [1, 1]
    assert notes() == [f"calibrating this host's compute rates at 1 thread (the full measurement; cached in "
                       f"{cc.cache_path()})"]
    assert cc.calibrate_compute() == (full, True) and calls == [1, 1]  # the full entry serves a quick calibration
    assert cc.calibrated_options(CompileOptions(), "full")[1:] == (full, True) and notes() == []


def test_the_runtime_overheads_are_measured_as_thoroughly_as_the_compute_rates(cache_dir: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    from fxpipe.calibration.runtime_costs import RuntimeOverheads

    caplog.set_level(logging.INFO, logger="fxpipe")
    measured: list[bool] = []

    def measure(rates: ComputeRates, threads: int) -> RuntimeOverheads:
        measured.append(cc.is_full(rates.machine))
        return RuntimeOverheads(1e-4, 2e-5, 3e-4, threads,
                                rates.machine.split("|0.0 s")[0] + "|0.0 s" + ("" if measured[-1] else cc.QUICK_MARK))

    quick = dataclasses.replace(RATES, machine=cc.machine_key(1) + "|0.0 s" + cc.QUICK_MARK)
    full = dataclasses.replace(RATES, machine=cc.machine_key(1) + "|0.0 s")
    assert not cc.calibrate_overheads(quick, measure)[1] and measured == [False]
    assert [r.getMessage() for r in caplog.records] == [
        f"measuring the runtime's fixed costs on two local ranks (first run, a few seconds; cached in "
        f"{cc.overheads_cache_path()})"]
    assert cc.calibrate_overheads(quick, measure)[1] and measured == [False]
    assert not cc.calibrate_overheads(full, measure)[1] and measured == [False, True]  # full rates: measured again
    assert cc.calibrate_overheads(quick, measure)[1] and cc.calibrate_overheads(full, measure)[1]


def test_node_times_are_the_least_disturbed_cold_median_over_sustained_never_below_the_warm_fastest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    evictions: list[int] = []
    idles: list[Any] = []

    def cold(graphs, x, evict, runs):  # type: ignore[no-untyped-def]
        if evict is cc._idle:  # the cached runs: each F and B after a short wait, not an eviction
            idles.append(runs)
            return [(0.02, 0.06), (0.1, 0.2), (0.2, 0.3)]  # median F 0.1 s, B+W 0.2 s
        real = real_cold(graphs, x, evict, runs)  # the real loop: one eviction before each run
        assert len(real) == runs and all(f > 0 and bw > 0 for f, bw in real)
        return [(0.1, 0.2), (0.3, 0.4), (0.5, 0.6)]  # then fixed times: median F 0.3 s, B+W 0.4 s

    real_cold = cc._cold_times
    monkeypatch.setattr(cc, "_cold_times", cold)
    # the warm runs back to back read fixed times too (F 1 ms, B 2 ms, W 1 ms): no assert depends on the machine's speed
    monkeypatch.setattr("fxpipe.passes.time_graphs.time_graphs", lambda graphs, args, runs: (1e-3, 2e-3, 1e-3))
    f, bw, op_f, op_bw, hot_f, hot_bw = cc._node_times(3, evict=lambda: evictions.append(1), sustained=2.0)
    assert len(evictions) == 12  # 2 x runs cold runs, the F and the B of each after evicting
    assert idles == [6]  # and as many cached runs
    nodes = round(0.15 / f)  # per node: (median / sustained) / nodes, the same node count for F and B+W
    assert nodes > 10 and f == pytest.approx(0.15 / nodes) and bw == pytest.approx(0.2 / nodes)
    # per graph op: the same times over the ATen ops of Mix's F graph (without its convolution part, whose host
    # time is the convolutions' own intercept), and of its B and W graphs together
    from fxpipe.graphs.split import split_stage
    from fxpipe.passes.trace import trace

    x = torch.randn(2, 4, 2, 2)
    gm = trace(Mix(), (x,)).gm
    assert not any("conv" in str(n.target) or "pool" in str(n.target) or "batch_norm" in str(n.target)
                   for n in gm.graph.nodes if n.op == "call_function")
    ops_f, ops_b, ops_w = graph_ops(split_stage(gm, [x.requires_grad_(True)]))
    assert ops_f > nodes and ops_b + ops_w > nodes  # nodes decompose into more ATen ops, views included
    assert op_f == pytest.approx(0.15 / ops_f) and op_bw == pytest.approx(0.2 / (ops_b + ops_w))
    assert hot_f == pytest.approx(0.05 / ops_f) and hot_bw == pytest.approx(0.1 / (ops_b + ops_w))  # cached, per op
    f_big, bw_big, _, _, hot_f, hot_bw = cc._node_times(3, evict=lambda: None, sustained=1e9)
    # the warm fastest: cold over 1e9 is less
    assert f_big == pytest.approx(1e-3 / nodes) and bw_big == pytest.approx(3e-3 / nodes)
    assert hot_f * ops_f == pytest.approx(f_big * nodes) and hot_bw * (ops_b + ops_w) == pytest.approx(bw_big * nodes)
    # never more cached than uncached: a cached median above the cold one makes the cold time the cached one
    monkeypatch.setattr(cc, "_cold_times", lambda g, x, evict, runs: [(0.9, 0.9)] * 3 if evict is cc._idle
                        else [(0.3, 0.4)] * 3)
    f, bw, op_f, _, hot_f, hot_bw = cc._node_times(3, evict=lambda: None, sustained=1.0)
    assert op_f == pytest.approx(hot_f) and op_f * ops_f == pytest.approx(0.9)
    # without an eviction (the warm times are the measurement): no cached times apart
    assert cc._node_times(3)[4:] == (0.0, 0.0)
    # Read in windows of COLD_WINDOW runs, the least disturbed window's median: a burst over a whole window (F 1 s,
    # B+W 2 s) is left out, and so is a quiet window's own outlier (9 s).
    burst = [(1.0, 2.0)] * cc.COLD_WINDOW
    quiet = [(0.2, 0.3), (0.3, 0.4), (0.3, 0.4), (0.4, 0.5), (9.0, 9.0)]
    monkeypatch.setattr(cc, "_cold_times", lambda *a: burst + quiet)
    f, bw, *_ = cc._node_times(5, evict=lambda: None, sustained=2.0)
    assert f == pytest.approx(0.15 / nodes) and bw == pytest.approx(0.2 / nodes)


def test_cold_runs_evict_before_the_backward_as_before_the_forward() -> None:
    """In a pipeline each action, F or B, starts after a wait for its message; the calibration's cold runs evict
    the cache before each run's F and again before its B (format 20), none before the warm-up run."""
    from fxpipe.graphs.split import split_stage
    from fxpipe.passes.time_graphs import graph_samples

    x = torch.randn(2, 4, 2, 2)
    graphs = split_stage(trace(Mix(), (x,)).gm, [x.clone().requires_grad_(True)])
    events: list[str] = []
    samples = graph_samples(graphs, [x], 3, before=lambda: events.append("F"),
                            before_backward=lambda: events.append("B"))
    assert events == ["F", "B"] * 3 and len(samples) == 3 and all(t > 0 for s in samples for t in s)


def test_the_small_convolutions_intercept_is_measured_cold_too(monkeypatch: pytest.MonkeyPatch) -> None:
    evictions: list[int] = []
    f, b = cc._cold_conv_seconds(2, 8, 16, lambda: evictions.append(1), 3)
    assert len(evictions) == 2 * (3 + 1) and f > 0 and b > 0  # each chain (F, then B) after evicting
    # the warm readings fixed (FLOPs, F s, B s): the small convolution's and the large one's, 1e9 FLOP/s between them
    readings = {cc.COLD_CONV: (1e6, 2e-3, 3e-3), (2, 64, 56): (1e9 + 1e6, 2e-3 + 1.0, 3e-3 + 2.0)}
    monkeypatch.setattr(cc, "_conv_seconds", lambda batch, channels, side, runs: readings[(batch, channels, side)])
    rate, conv_fwd, conv_bwd = cc._conv_rate(2, cold=(1.0, 2.0), sustained=2.0)  # per convolution, cold median
    # the intercepts: (cold median / sustained) less the small convolution's FLOPs at the rate
    assert rate == pytest.approx(1e9)
    assert conv_fwd == pytest.approx(0.5 - 1e-3) and conv_bwd == pytest.approx(1.0 - 2e-3)
    # never below the warm fastest: the warm readings less the same FLOPs
    assert cc._conv_rate(2, cold=(0.0, 0.0), sustained=2.0)[1:] == pytest.approx((1e-3, 1e-3))


def test_the_host_times_are_read_three_times_and_each_ones_median_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """One disturbed reading (the 2026-11-27 06:38 calibration read the convolutions' cold intercepts 35-45% under
    the others) does not set the host times: ``measure_compute`` reads the small convolution's cold seconds and the
    per-node and per-op times three times and keeps each one's median."""
    convs = iter([(1.0, 9.0), (0.2, 3.0), (3.0, 5.0)])
    nodes = iter([(1, 2, 3, 4, 5, 6), (7, 1, 2, 3, 4, 5), (4, 9, 1, 5, 6, 2)])
    seen: dict[str, object] = {}
    monkeypatch.setattr(cc, "_cold_conv_seconds", lambda *a: next(convs))
    monkeypatch.setattr(cc, "_node_times", lambda runs, **kw: tuple(t * 1e-6 for t in next(nodes)))

    def conv_rate(runs: int, *, cold: tuple[float, float] | None = None, sustained: float = 1.0) -> tuple[float, ...]:
        seen["cold"] = cold
        return 1e11, 0.0, 0.0

    monkeypatch.setattr(cc, "_conv_rate", conv_rate)
    monkeypatch.setattr(cc, "_noisy_round", lambda runs, stream_bytes: (((1e7, 1e11),), 1e10, 1.0))  # not the point
    monkeypatch.setattr(cc, "effective_cache_bytes", lambda probe, runs: 1e6)
    monkeypatch.setattr(cc, "_skinny_rate", lambda m, runs, **kw: 1e10)
    monkeypatch.setattr(cc, "COLD_POOL_MAX", 1)
    rates = cc.measure_compute(runs=2, gemm_sizes=(64,), stream_bytes=1 << 16)
    assert seen["cold"] == (1.0, 5.0)  # F's median of 1.0, 0.2, 3.0; B's of 9.0, 3.0, 5.0
    got = [rates.op_fwd, rates.op_bwd, rates.graph_op_fwd, rates.graph_op_bwd, rates.graph_op_fwd_cached,
           rates.graph_op_bwd_cached]
    assert got == pytest.approx([4e-6, 2e-6, 2e-6, 4e-6, 5e-6, 5e-6])  # field by field, not one reading's
    assert next(convs, None) is None and next(nodes, None) is None  # all three read


@pytest.mark.parametrize(("rates", "expected_mib"), [
    # half-way from 60 to 28 GFLOP/s is 41, crossed 0.54 of the way (in log rate) from 16 to 24 weights: 19.9
    ((60, 61, 58, 60, 57, 59, 30, 28), 64 * 1.5 ** (math.log(59 / math.sqrt(60 * 28)) / math.log(59 / 30))),
    # a one-off dip (another job) before the fall is not the cache: the last pool above half-way counts
    ((60, 30, 58, 60, 57, 59, 30, 28), 64 * 1.5 ** (math.log(59 / math.sqrt(60 * 28)) / math.log(59 / 30))),
    # a gradual fall, as probed here: half-way (45) crossed between 8 and 12 weights
    ((81, 77, 64, 57, 42, 28, 28, 25), 32 * 1.5 ** (math.log(57 / math.sqrt(81 * 25)) / math.log(57 / 42))),
    ((60, 61, 58, 60, 57, 59, 50, 48), None),  # nothing falls by 1.5x: at least the largest pool, or what sysfs says
    ((60, 20, 20, 20, 20, 20, 20, 20), 4 * 2 ** (math.log(60 / math.sqrt(60 * 20)) / math.log(60 / 20))),  # one fits
])
def test_the_cache_ends_where_the_rate_crosses_half_way_to_the_uncached_one(
        monkeypatch: pytest.MonkeyPatch, rates: tuple[int, ...], expected_mib: float | None) -> None:
    by_size = dict(zip(cc.CACHE_PROBE, rates, strict=True))
    monkeypatch.setattr(cc, "_skinny_rate", lambda m, runs, *, weight, pool: by_size[len(pool)] * 1e9)
    monkeypatch.setattr(cc, "last_level_cache_bytes", lambda: 260 << 20)
    probe = [torch.empty(0)] * cc.COLD_POOL_MAX
    expected = (260 << 20) if expected_mib is None else expected_mib * (1 << 20)
    assert cc.effective_cache_bytes(probe, 1) == pytest.approx(expected)
    monkeypatch.setattr(cc, "last_level_cache_bytes", lambda: 0)  # the system does not say
    assert cc.effective_cache_bytes(probe, 1) == pytest.approx(128 << 20 if expected_mib is None else expected)


def test_a_model_that_outgrows_the_cache_reads_the_part_it_cannot_hold_at_the_uncached_rates() -> None:
    """The curves a calibration measured with weights out of the cache apply to the part of a model's parameters and
    their gradients (``S``) the cache (``C``) cannot hold, ``1 - C/S``, and to none while they fit: mlp-deep (64 MiB,
    S = 128 MiB) against a 32 MiB cache reads 3/4 of its weights from memory, and none against a 1 GiB one."""
    hot, cold = ((1.0, 4e10), (128.0, 8e10)), ((1.0, 1e10), (128.0, 8e10))
    rates = dataclasses.replace(RATES, mem_bw=1e30, gemm_curve=hot, gemm_w_curve=hot, gemm_cold_curve=cold,
                                gemm_w_cold_curve=cold, cache_bytes=float(32 << 20))
    assert rates.gemm_rate(1, cold=1.0) == 1e10 and rates.gemm_rate(1) == 4e10
    assert rates.gemm_rate(1, cold=0.5) == pytest.approx(1 / (0.5 / 4e10 + 0.5 / 1e10))  # time: half at each rate
    assert rates.cold(64 << 20) == 0.75 and rates.cold(24 << 20) == pytest.approx(1 / 3)  # 24 MiB + gradients: 48
    assert rates.cold(16 << 20) == 0.0  # 32 MiB with its gradients: fits
    assert dataclasses.replace(rates, cache_bytes=0.0).cold(64 << 20) == 0.0  # a cache the system does not report
    assert dataclasses.replace(rates, gemm_cold_curve=()).cold(64 << 20) == 0.0  # a calibration from before
    zoo = models.build("mlp-deep")
    gm = trace(zoo.model, zoo.example_inputs).gm

    def first_linear_fwd(r: ComputeRates) -> float:
        out = annotate_costs(gm, zoo.example_inputs, compute=r).gm
        return get_meta(next(n for n in out.graph.nodes if "linear" in str(n.target))).time_fwd

    flops = 2 * 8 * 1024 * 1024  # (8 x 1024) x (1024 x 1024)
    in_cache = first_linear_fwd(dataclasses.replace(rates, cache_bytes=float(1 << 30))) - RATES.op_fwd
    warm = 4e10 / 7 * 10  # 4e10 + 3/7 of 4e10, at 8 rows
    assert in_cache == pytest.approx(flops / rates.gemm_rate(8)) and rates.gemm_rate(8) == pytest.approx(warm)
    # about a quarter at the cached rate, three quarters at the uncached one (1e10 + 3/7 of 7e10 at 8 rows)
    miss = rates.cold(sum(p.numel() * 4 for p in zoo.model.parameters()))  # its biases too: 64.06 MiB
    assert miss == pytest.approx(0.75, abs=1e-3)
    assert first_linear_fwd(rates) - RATES.op_fwd == pytest.approx(flops * ((1 - miss) / warm + miss / 4e10))


def test_replicas_sharing_the_cache_move_each_gemm_along_its_slope_to_their_copies_miss() -> None:
    """dp replicas on one machine hold dp copies of the model on its cache: a plan for them (partition_stages, with
    --cores: the ranks share this machine) moves every node's times along annotate_costs' slopes to the miss of dp
    copies, which is what annotating one copy against a cache 1/dp the size gives; the plan's stage costs and the
    recorded miss follow. mlp-deep (S = 128 MiB) on 160 MiB: one copy fits, two read 3/8 of each weight from memory."""
    from fxpipe.passes.group_layers import group_layers
    from fxpipe.passes.partition_stages import StageSearch, partition_stages

    hot, cold = ((1.0, 4e10), (128.0, 8e10)), ((1.0, 1e10), (128.0, 2e10))
    rates = dataclasses.replace(RATES, mem_bw=1e30, gemm_curve=hot, gemm_w_curve=hot, gemm_cold_curve=cold,
                                gemm_w_cold_curve=cold, cache_bytes=float(160 << 20))
    zoo = models.build("mlp-deep")
    gm = trace(zoo.model, zoo.example_inputs).gm
    one = annotate_costs(gm, zoo.example_inputs, compute=rates).gm
    assert one.meta["fxpipe_cache_miss"] == 0.0
    half = annotate_costs(gm, zoo.example_inputs, compute=dataclasses.replace(rates, cache_bytes=float(80 << 20))).gm
    miss = half.meta["fxpipe_cache_miss"]
    assert miss == pytest.approx(3 / 8, abs=1e-3)
    grouped = group_layers(one).gm
    planned = partition_stages(grouped, num_stages="auto", search=StageSearch(dp=2, cores=2, max_stages=2)).gm
    assert planned.meta["fxpipe_cache_miss"] == pytest.approx(miss)
    fields = ("time_fwd", "time_bwd_input", "time_bwd_weight")
    moved = {n.name: get_meta(n) for n in planned.graph.nodes}
    gemms = 0
    for node in half.graph.nodes:
        want, got = get_meta(node), moved[node.name]
        for f in fields:
            assert getattr(got, f) == pytest.approx(getattr(want, f), rel=1e-9)
        gemms += want.cold_fwd > 0
    assert gemms == sum(isinstance(m, torch.nn.Linear) for m in zoo.model.modules()) == 16  # mlp-deep's linears
    alone = partition_stages(grouped, num_stages="auto", search=StageSearch(dp=2, max_stages=2)).gm  # no --cores
    assert alone.meta["fxpipe_cache_miss"] == 0.0
    total = {k: sum(c[k] for c in planned.meta["fxpipe_stage_costs"]) for k in "fbw"}
    base = {k: sum(c[k] for c in alone.meta["fxpipe_stage_costs"]) for k in "fbw"}
    slopes = [sum(getattr(get_meta(n), f"cold_{f}") for n in one.graph.nodes)
              for f in ("fwd", "bwd_input", "bwd_weight")]
    for k, slope in zip("fbw", slopes):
        assert total[k] == pytest.approx(base[k] + miss * slope) and (k == "b" or slope > 0)


def test_a_linear_s_forward_runs_at_the_transposed_curve_and_its_backward_at_the_plain_one() -> None:
    """A linear layer's F is x @ W.T (the weight read transposed), its B grad @ W (as stored): on one core here the
    skinny transposed GEMM runs at well under the plain one (8 rows: 35-40 against 70-100 GFLOP/s), so each takes
    its own curve; W keeps the weight gradient's. Plans and caches without the transposed curve use the plain."""
    plain, transposed, w = ((1.0, 8e10), (128.0, 8e10)), ((1.0, 2e10), (128.0, 2e10)), ((1.0, 4e10), (128.0, 4e10))
    rates = dataclasses.replace(RATES, mem_bw=1e30, gemm_curve=plain, gemm_t_curve=transposed, gemm_w_curve=w)
    zoo = models.build("mlp-deep")
    gm = trace(zoo.model, zoo.example_inputs).gm
    flops = 2 * 8 * 1024 * 1024  # (8 x 1024) x (1024 x 1024)

    def second_linear(r: ComputeRates) -> tuple[float, float, float]:
        out = annotate_costs(gm, zoo.example_inputs, compute=r).gm
        meta = get_meta([n for n in out.graph.nodes if "linear" in str(n.target)][1])  # its input needs a gradient
        return (meta.time_fwd - meta.host_fwd, meta.time_bwd_input - meta.host_bwd_input,
                meta.time_bwd_weight - meta.host_bwd_weight)

    f, b, w_time = second_linear(rates)
    assert f == pytest.approx(flops / 2e10) and b == pytest.approx(flops / 8e10)
    assert w_time == pytest.approx(flops / 4e10)
    f_old, b_old, _ = second_linear(dataclasses.replace(rates, gemm_t_curve=()))
    assert f_old == pytest.approx(flops / 8e10) and b_old == b
    # In an aten graph, mm(x, t(W)) reads the weight transposed as linear does; mm(x, W) does not
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxpipe.passes.annotate_costs import _reads_transposed

    graph = make_fx(lambda x, w: (torch.mm(x, w.t()), torch.mm(x, w)))(torch.randn(8, 16), torch.randn(16, 16))
    mms = [n for n in graph.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert [_reads_transposed(n, "mm") for n in mms] == [True, False]


def test_cache_round_trip(cache_dir: Path) -> None:
    calls: list[int] = []
    first, cached = cc.calibrate_compute(threads=1, measure=_fake_measure(calls))
    assert not cached and calls == [1]
    again, cached = cc.calibrate_compute(threads=1, measure=_fake_measure(calls))
    assert cached and again == first and calls == [1]  # read back, not measured again
    _, cached = cc.calibrate_compute(threads=2, measure=_fake_measure(calls))  # another thread count: its own entry
    assert not cached and calls == [1, 2]
    doc = json.loads((cache_dir / "compute.json").read_text())
    assert set(doc) == {cc.machine_key(1), cc.machine_key(2)}


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '"x"', "", "\x00\xff",
                                  '{"KEY": {"gemm_flops": "__import__(\'os\')"}}',
                                  '{"KEY": {"gemm_flops": -1, "conv_flops": 1, "mem_bw": 1, "op_fwd": 0, "op_bwd": 0, '
                                  '"conv_fwd": 0, "conv_bwd": 0, "threads": 1, "machine": "KEY"}}',
                                  "SUSTAINED_BELOW_ONE"])
def test_a_corrupt_cache_is_ignored_and_rewritten(cache_dir: Path, text: str) -> None:
    cache_dir.mkdir(parents=True)
    if text == "SUSTAINED_BELOW_ONE":  # a sound entry but for a machine faster than its fastest
        entry = dataclasses.asdict(dataclasses.replace(RATES, machine=cc.machine_key(1), sustained=0.5))
        text = json.dumps({cc.machine_key(1): entry})
    (cache_dir / "compute.json").write_text(text.replace("KEY", cc.machine_key(1)))
    calls: list[int] = []
    rates, cached = cc.calibrate_compute(threads=1, measure=_fake_measure(calls))
    assert not cached and calls == [1] and rates.gemm_flops == RATES.gemm_flops
    doc = json.loads((cache_dir / "compute.json").read_text())  # rewritten, sound
    assert doc[cc.machine_key(1)]["gemm_flops"] == RATES.gemm_flops
    assert cc.calibrate_compute(threads=1, measure=_fake_measure(calls))[1]


def test_an_unwritable_cache_still_calibrates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    rates, cached = cc.calibrate_compute(threads=1, measure=_fake_measure([]))
    assert not cached and rates.gemm_flops == RATES.gemm_flops


def test_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not cc.calibration_enabled()  # tests/conftest.py turns it off for the whole suite
    monkeypatch.setenv(cc.ENV, "on")
    assert cc.calibration_enabled() and not cc.calibration_enabled("off")
    monkeypatch.delenv(cc.ENV)
    assert cc.calibration_enabled()  # on by default
    assert [cc.calibration_level(s) for s in ("on", "quick", "full", "off")] == ["on", "on", "full", "off"]
    assert cc.calibration_enabled("full")
    with pytest.raises(OptionError, match=r"--calibration takes on, full or off \(got 'maybe'\)"):
        cc.calibration_enabled("maybe")
    monkeypatch.setenv(cc.ENV, "sometimes")
    with pytest.raises(OptionError, match=r"\$FXPIPE_CALIBRATION takes on, full or off"):
        cc.calibration_enabled()


def test_calibrated_options_skip_profile_and_explicit_rates(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cc, "measure_compute", _fake_measure([]))
    base = CompileOptions()
    assert cc.calibrated_options(base, "off") == (base, None, False)
    assert cc.calibrated_options(dataclasses.replace(base, profile=True), "on")[1] is None
    assert cc.calibrated_options(base, "on", explicit=True)[1] is None
    options, rates, _ = cc.calibrated_options(base, "on")
    assert rates is not None and options.compute == rates
    assert (options.device_flops, options.device_mem_bw) == (rates.gemm_flops, rates.mem_bw)


def test_the_estimate_uses_the_calibrated_rates() -> None:
    """time = host time per node + max(FLOPs / gemm_flops, bytes / mem_bw), checked one term at a time."""
    import operator

    zoo = models.build("mlp-tiny")
    gm = trace(zoo.model, zoo.example_inputs).gm
    flops_only = annotate_costs(gm, zoo.example_inputs, compute=dataclasses.replace(RATES, mem_bw=1e30)).gm
    bytes_fixed = annotate_costs(gm, zoo.example_inputs, device_flops=1e30).gm  # traffic / 1e10
    bytes_only = annotate_costs(gm, zoo.example_inputs, compute=dataclasses.replace(RATES, gemm_flops=1e30)).gm
    checked = 0
    for a, b, c in zip(flops_only.graph.nodes, bytes_fixed.graph.nodes, bytes_only.graph.nodes):
        if a.op not in ("call_function", "call_module"):
            continue
        fa, fb, fc = get_meta(a), get_meta(b), get_meta(c)
        host = 0.0 if a.target is operator.getitem else RATES.op_fwd
        assert fa.time_fwd == pytest.approx(host + fa.flops_fwd / RATES.gemm_flops, abs=1e-15)
        traffic = fb.time_fwd * DEFAULTS.device_mem_bw + fb.param_bytes  # calibrated, a node reads its parameters
        assert fc.time_fwd == pytest.approx(host + traffic / RATES.mem_bw, abs=1e-15)
        if fa.flops_bwd_input and fa.flops_bwd_weight:  # a linear on the gradient path: half the host time each
            assert fa.time_bwd_input == pytest.approx(RATES.op_bwd / 2 + fa.flops_bwd_input / RATES.gemm_flops)
            assert fa.time_bwd_weight == pytest.approx(RATES.op_bwd / 2 + fa.flops_bwd_weight / RATES.gemm_flops)
            checked += 1
    assert checked >= 3


def test_a_layers_host_time_is_its_real_graphs_ops_at_the_calibrated_rate_per_op() -> None:
    """With per-op rates, count_backward times each layer's host work by the ATen ops of its real F, B and W
    graphs: a linear is t + addmm forward, t + mm for its input's gradient, t + mm + sum + view for its weight's;
    a ReLU is relu + detach forward, threshold_backward for B, nothing for W. Per node, B and W had half each."""
    zoo = models.build("mlp-tiny")
    per_op = dataclasses.replace(RATES, graph_op_fwd=1.0, graph_op_bwd=2.0, sustained=1.5)  # seconds: ops dominate
    compiled = run_compile(zoo.model, zoo.example_inputs, CompileOptions(compute=per_op, granularity="node"))
    plan = compiled.pipeline.plan
    layers = {layer.name: layer for layer in plan.layers}
    # the pass's table names each layer by its index and name (the per-op charge leaves the index alone)
    table = next(r for r in compiled.reports if r.title.startswith("count-backward"))
    assert [row[:2] for row in table.rows] == [(k, layer.name) for k, layer in enumerate(plan.layers)]
    ops = {name: (round(layers[name].f / 1.5), round(layers[name].b / 3.0), round(layers[name].w / 3.0))
           for name in layers}
    assert ops["linear"] == (2, 0, 4)  # the first layer: its input is data, no B
    assert ops["linear_1"] == ops["linear_2"] == ops["linear_3"] == ops["linear_4"] == (2, 2, 4)
    assert ops["relu"] == ops["relu_1"] == ops["relu_3"] == (2, 1, 0)
    # the arithmetic stays: only the host part is replaced (per node: a linear's W had half of op_bwd)
    per_node = run_compile(zoo.model, zoo.example_inputs, CompileOptions(compute=RATES, granularity="node")).pipeline
    fc1 = per_node.plan.layers[2]
    arithmetic = (layers["linear_1"].w - 4 * 3.0) / 1.5  # at the machine's typical speed, like the rest
    assert fc1.name == "linear_1" and fc1.w - RATES.op_bwd / 2 == pytest.approx(arithmetic, rel=1e-6)


def test_an_op_costs_its_cached_time_plus_the_models_cache_miss_of_the_way_to_its_uncached_one() -> None:
    """Format 22: per op, the cached time (after a wait) and the model's cache miss (``ComputeRates.cold``) of the way
    to the uncached time (after an eviction); the rest of the way is on the nodes' cold_* slopes, which partition_stages
    moves plans with more replicas along. A model the cache holds pays the cached time; rates from before format 22
    (no cached time) the uncached one."""
    zoo = models.build("mlp-tiny")
    params = sum(p.numel() * p.element_size() for p in zoo.model.parameters())
    curve = ((1.0, 1e11), (256.0, 2e11))  # a cold curve, so that cold() can be non-zero
    base = dataclasses.replace(RATES, graph_op_fwd=1.0, graph_op_bwd=2.0, graph_op_fwd_cached=0.25,
                               graph_op_bwd_cached=0.5, gemm_cold_curve=curve, gemm_w_cold_curve=curve)

    def layer_ops(rates: ComputeRates) -> tuple[dict[str, tuple[float, float, float]], Any]:
        compiled = run_compile(zoo.model, zoo.example_inputs, CompileOptions(compute=rates, granularity="node"),
                               control=PassControl(stop_after="count-backward"))
        gm = compiled.root
        per: dict[str, list[float]] = {}
        for node in gm.graph.nodes:
            if node.op in ("call_function", "call_module"):
                m = get_meta(node)
                acc = per.setdefault(m.layer, [0.0] * 6)
                for i, f in enumerate(("host_fwd", "host_bwd_input", "host_bwd_weight", "cold_fwd", "cold_bwd_input",
                                       "cold_bwd_weight")):
                    acc[i] += getattr(m, f)
        return {k: tuple(v) for k, v in per.items()}, gm  # type: ignore[misc]

    fits, gm = layer_ops(dataclasses.replace(base, cache_bytes=4.0 * params))
    assert gm.meta["fxpipe_cache_miss"] == 0.0
    assert fits["linear_1"][:3] == pytest.approx((2 * 0.25, 2 * 0.5, 4 * 0.5))  # 2 F ops, 2 B, 4 W: cached
    assert fits["linear_1"][3:] == pytest.approx((2 * 0.75, 2 * 1.5, 4 * 1.5), rel=1e-6)  # and the slope beyond
    spills, gm = layer_ops(dataclasses.replace(base, cache_bytes=0.5 * params))  # 2 x params: miss 0.75
    miss = gm.meta["fxpipe_cache_miss"]
    assert miss == pytest.approx(0.75)
    f, b = 0.25 + miss * 0.75, 0.5 + miss * 1.5
    assert spills["linear_1"][:3] == pytest.approx((2 * f, 2 * b, 4 * b))
    assert spills["linear_1"][3:] == pytest.approx(fits["linear_1"][3:], rel=1e-6)  # slopes: the GEMMs' own + the ops'
    before, gm = layer_ops(dataclasses.replace(base, graph_op_fwd_cached=0.0, graph_op_bwd_cached=0.0,
                                               cache_bytes=4.0 * params))
    assert before["linear_1"][:3] == pytest.approx((2 * 1.0, 2 * 2.0, 4 * 2.0))  # uncached, as before format 22


def test_every_estimated_time_is_scaled_by_the_machines_sustained_speed() -> None:
    """A machine that typically runs 1.3x slower than its fastest runs: every node's F, B and W time 1.3x, on a
    convolutional and a transformer model; FLOPs and bytes unchanged."""
    for name in ("vgg-tiny", "gpt-tiny"):
        zoo = models.build(name)
        gm = trace(zoo.model, zoo.example_inputs).gm
        best = annotate_costs(gm, zoo.example_inputs, compute=RATES).gm
        typical = annotate_costs(gm, zoo.example_inputs, compute=dataclasses.replace(RATES, sustained=1.3)).gm
        scaled = 0
        for a, b in zip(best.graph.nodes, typical.graph.nodes):
            if a.op not in ("call_function", "call_module"):
                continue
            ma, mb = get_meta(a), get_meta(b)
            for field in ("time_fwd", "time_bwd_input", "time_bwd_weight"):
                assert getattr(mb, field) == pytest.approx(1.3 * getattr(ma, field), rel=1e-12, abs=1e-18)
            assert (mb.flops_fwd, mb.out_bytes, mb.param_bytes) == (ma.flops_fwd, ma.out_bytes, ma.param_bytes)
            scaled += ma.time_fwd > 0
        assert scaled >= 10


def test_the_sustained_speed_is_the_median_piece_over_the_fastest(monkeypatch: pytest.MonkeyPatch) -> None:
    pieces = [0.001, 0.002, 0.0015, 0.001, 0.003, 0.0012, 0.0013]  # seconds: median 1.3 ms, fastest 1 ms
    calls = iter(range(10**6))

    def clock() -> float:  # the deadline's start, then per piece: the deadline check, its start, its end
        n = next(calls)
        if n == 0:
            return 0.0
        piece, step = divmod(n - 1, 3)
        if piece >= len(pieces):
            return 5.0  # past the deadline
        return [0.0, 1.0, 1.0 + pieces[piece]][step]

    monkeypatch.setattr(cc.time, "perf_counter", clock)
    assert cc._sustained(1.0) == pytest.approx(1.3)
    monkeypatch.undo()
    assert cc._sustained(0.0) >= 1.0  # never faster than its fastest; at least 5 pieces even with no time


def test_a_convolution_costs_its_call_and_its_conv_rate() -> None:
    zoo = models.build("vgg-tiny")
    gm = trace(zoo.model, zoo.example_inputs).gm
    out = annotate_costs(gm, zoo.example_inputs, compute=dataclasses.replace(RATES, mem_bw=1e30)).gm
    convs = [n for n in out.graph.nodes if "conv" in str(n.target)]
    assert convs
    for node in convs:
        m = get_meta(node)
        assert m.time_fwd == pytest.approx(RATES.op_fwd + RATES.conv_fwd + m.flops_fwd / RATES.conv_flops)
        assert m.time_bwd_input + m.time_bwd_weight == pytest.approx(
            (RATES.op_bwd + RATES.conv_bwd) * (1.0 if m.time_bwd_input and m.time_bwd_weight else 1.0)
            + (m.flops_bwd_input + m.flops_bwd_weight) / RATES.conv_flops)


def test_the_plan_records_the_rates_and_old_plans_still_load(tmp_path: Path) -> None:
    zoo = models.build("mlp-tiny")
    options = CompileOptions(compute=RATES, device_flops=RATES.gemm_flops, device_mem_bw=RATES.mem_bw)
    pipe = run_compile(zoo.model, zoo.example_inputs, options).pipeline
    assert pipe is not None and pipe.plan.options.compute == RATES
    loaded = fxpipe.load(fxpipe.save(pipe, tmp_path / "plan"))
    assert loaded.plan.options.compute == RATES
    doc = json.loads(json.dumps(pipe.plan.to_json()))
    assert Plan.from_json(doc) == pipe.plan
    plain = json.loads(json.dumps(fxpipe.compile(zoo.model, zoo.example_inputs).plan.to_json()))
    assert "compute" not in plain["options"]  # uncalibrated plans are written as before calibration existed
    assert Plan.from_json(plain).options.compute is None


def test_fxpipe_compile_reports_the_calibration(cache_dir: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(cc, "measure_compute", _fake_measure(calls))
    runner = CliRunner()
    args = ["compile", "mlp-tiny", "--plain", "--out"]
    result = runner.invoke(app, [*args, str(tmp_path / "a"), "--calibration", "on"])
    assert result.exit_code == 0, result.output
    assert "compute calibrated (1 thread): GEMM 200 GFLOP/s, conv 100 GFLOP/s, 20.0 GB/s, 5.0 us + 8.0 us per node" \
        in result.output and "measured now" in result.output
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())["plan"]
    assert plan["options"]["compute"]["gemm_flops"] == RATES.gemm_flops and calls == [1]
    result = runner.invoke(app, [*args, str(tmp_path / "b"), "--calibration", "on"])
    assert "; cached (" in result.output and calls == [1]
    result = runner.invoke(app, [*args, str(tmp_path / "c")])  # FXPIPE_CALIBRATION=off (conftest): the fixed model
    assert result.exit_code == 0 and "calibrated" not in result.output
    assert "compute" not in json.loads((tmp_path / "c" / "plan.json").read_text())["plan"]["options"]
    result = runner.invoke(app, [*args, str(tmp_path / "d"), "--calibration", "on", "--device-flops", "1e12"])
    assert "calibrated" not in result.output  # an explicit device model wins
    result = runner.invoke(app, [*args, str(tmp_path / "e"), "--calibration", "sometimes"])
    assert result.exit_code == 2 and "'sometimes' is not one of 'on', 'full', 'off'" in result.output


def test_the_runtime_overheads_are_cached_and_simulate_calibrated_plans_only(cache_dir: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpipe.schedules.simulate import Costs

    calls: list[int] = []
    first, cached = cc.calibrate_overheads(RATES, threads=1, measure=_fake_overheads(calls))
    again, cached_again = cc.calibrate_overheads(RATES, threads=1, measure=_fake_overheads(calls))
    assert (cached, cached_again, calls, again) == (False, True, [1], first)
    cc.overheads_cache_path().write_text('{"x": 1}')  # corrupt: ignored and measured again
    assert cc.calibrate_overheads(RATES, threads=1, measure=_fake_overheads(calls))[1] is False and calls == [1, 1]
    zoo = models.build("mlp-tiny")
    rates = dataclasses.replace(RATES, machine=cc.machine_key(1) + "|0.0 s")
    calibrated = run_compile(zoo.model, zoo.example_inputs, CompileOptions(compute=rates)).pipeline
    assert calibrated is not None
    monkeypatch.setenv(cc.ENV, "on")
    costs = Costs.from_plan(calibrated.plan, cc.plan_overheads(calibrated.plan))
    assert (costs.action_s, costs.message_s, costs.step_s) == (1e-4, 2e-5, 3e-4)
    # the loss: on the last stage's F only, scaled like the rest
    from fxpipe.calibration.runtime_costs import RuntimeOverheads
    with_loss = Costs.from_plan(calibrated.plan, RuntimeOverheads(1e-4, 2e-5, 3e-4, loss=5e-5, send=7e-5))
    plain = Costs.from_plan(calibrated.plan)
    assert with_loss.send_s == 7e-5 and plain.send_s == 0.0  # each message's host time on its sender
    assert with_loss.f[:-1] == plain.f[:-1] and with_loss.f[-1] == pytest.approx(plain.f[-1] + 5e-5, rel=1e-12)
    assert (with_loss.b, with_loss.w) == (plain.b, plain.w)
    typical = dataclasses.replace(calibrated.plan, options=dataclasses.replace(  # measured at its fastest, like F/B/W
        calibrated.plan.options, compute=dataclasses.replace(rates, sustained=1.5)))
    costs = Costs.from_plan(typical, cc.plan_overheads(typical))
    assert (costs.action_s, costs.message_s, costs.step_s) == pytest.approx((1.5e-4, 3e-5, 4.5e-4), rel=1e-12)
    assert cc.plan_overheads(typical).loss == pytest.approx(6e-5, rel=1e-12)
    assert costs.send_s == pytest.approx(1.2e-4, rel=1e-12)
    elsewhere = dataclasses.replace(calibrated.plan, options=dataclasses.replace(
        calibrated.plan.options, compute=dataclasses.replace(rates, machine="another|host|torch|1 thread(s)|v3|1 s")))
    assert cc.plan_overheads(elsewhere) is None
    # another machine's plan: this machine's runtime is no guide
    assert Costs.from_plan(elsewhere, cc.plan_overheads(elsewhere)).action_s == 0.0
    # The planners simulate with them too: --stages auto's every count's step grows by at least the per-step cost.
    def steps() -> list[float]:
        result = run_compile(zoo.model, zoo.example_inputs, CompileOptions(compute=rates, stage_objective="fastest",
                                                                           max_stages=3))
        table = next(r for r in result.reports if r.title.startswith("partition-stages: stage count"))
        return [row[5] for row in table.rows]
    with_costs = steps()
    # and the loss, on the last stage's F as Costs.from_plan adds it: every count's step is longer with it
    cc.overheads_cache_path().unlink()
    cc.calibrate_overheads(RATES, threads=1, measure=lambda r, t: RuntimeOverheads(
        1e-4, 2e-5, 3e-4, t, cc.machine_key(t) + "|0.0 s", loss=0.0))
    assert all(a > b for a, b in zip(with_costs, steps()))
    monkeypatch.setenv(cc.ENV, "off")
    assert cc.plan_overheads(calibrated.plan) is None  # the test suite's switch: no plan depends on the machine
    without = steps()
    assert len(with_costs) == len(without) == 3
    assert all(a >= b + 0.3 for a, b in zip(with_costs, without))  # ms: 3e-4 s per step at least


def test_skinny_gemms_and_large_convolutions_run_at_their_calibrated_rates(cache_dir: Path) -> None:
    curves = dict(gemm_curve=((8.0, 1e10), (64.0, 1e11)), gemm_w_curve=((8.0, 5e9), (64.0, 1e11)),
                  conv_curve=((1e6, 1e10), (1e8, 1e11)))
    rates = dataclasses.replace(RATES, mem_bw=1e30, **curves)
    assert (rates.gemm_rate(4), rates.gemm_rate(8), rates.gemm_rate(64)) == (1e10, 1e10, 1e11)
    assert rates.gemm_rate(math.sqrt(8 * 64)) == pytest.approx(5.5e10)  # linear in log m
    assert 1e11 < rates.gemm_rate(96) < rates.gemm_rate(128) == rates.gemm_flops == rates.gemm_rate(4096)
    assert rates.gemm_rate(8, weight=True) == 5e9 and RATES.gemm_rate(8) == RATES.gemm_flops  # no curve: one rate
    assert (rates.conv_rate(1e4), rates.conv_rate(1e7), rates.conv_rate(1e9)) == (1e10, pytest.approx(5.5e10), 1e11)
    dip = dataclasses.replace(rates, conv_curve=((1e6, 1e10), (1e8, 1e11), (1e9, 5e10)))  # a disturbed last point
    assert dip.conv_rate(1e10) == dip.conv_rate(1e9) == 1e11 and dip.conv_rate(1e7) == pytest.approx(5.5e10)
    zoo = models.build("mlp-tiny")
    out = annotate_costs(trace(zoo.model, zoo.example_inputs).gm, zoo.example_inputs, compute=rates).gm
    linears = [n for n in out.graph.nodes if "linear" in str(n.target)]
    assert len(linears) >= 3
    for node in linears:
        m = get_meta(node)
        rows, n = math.prod(m.shape[0][:-1]), m.shape[0][-1]
        smallest = min(rows, m.flops_fwd // (2 * rows * n), n)  # M, K and N of 2 M K N FLOPs
        assert m.time_fwd == pytest.approx(RATES.op_fwd + m.flops_fwd / rates.gemm_rate(smallest))
        if m.flops_bwd_weight:
            host = RATES.op_bwd / (2 if m.flops_bwd_input else 1)
            weight_s = m.flops_bwd_weight / rates.gemm_rate(smallest, weight=True)
            assert m.time_bwd_weight == pytest.approx(host + weight_s)
    zoo = models.build("vgg-tiny")
    out = annotate_costs(trace(zoo.model, zoo.example_inputs).gm, zoo.example_inputs, compute=rates).gm
    for node in (n for n in out.graph.nodes if "conv" in str(n.target)):
        m = get_meta(node)
        assert m.time_fwd == pytest.approx(RATES.op_fwd + RATES.conv_fwd + m.flops_fwd / rates.conv_rate(m.flops_fwd))
    # A cache entry from before the curves is measured again; a plan from before them still loads (no curves).
    cache_dir.mkdir(parents=True)
    old = {k: v for k, v in dataclasses.asdict(RATES).items() if k not in curves}
    (cache_dir / "compute.json").write_text(json.dumps({cc.machine_key(1): {**old, "machine": cc.machine_key(1)}}))
    calls: list[int] = []
    assert not cc.calibrate_compute(threads=1, measure=_fake_measure(calls))[1] and calls == [1]
    pipe = run_compile(zoo.model, zoo.example_inputs, CompileOptions(compute=rates)).pipeline
    assert pipe is not None
    plan_doc = json.loads(json.dumps(pipe.plan.to_json()))
    assert plan_doc["options"]["compute"]["gemm_curve"] == [[8.0, 1e10], [64.0, 1e11]]
    for k in curves:
        del plan_doc["options"]["compute"][k]
    assert Plan.from_json(plan_doc).options.compute == dataclasses.replace(rates, gemm_curve=(), gemm_w_curve=(),
                                                                           conv_curve=())


def test_calibrated_plans_estimate_each_stage_s_batched_w_fraction() -> None:
    """With this machine's rates (no --profile), split-backward estimates each stage's W over 4 microbatches against
    the 4 one by one (``StageCost.w_batched``), from the same rates: a skinny GEMM 4x as deep runs at a faster point
    of the curve, and each op's host time is paid once, so the fraction is below 1; with a flat curve and no host
    time, 4x the rows are 4x the time, nothing saved. A stage that cannot batch (gpt-tiny: traced views) keeps 1.0."""
    curve = ((1.0, 1e9), (4.0, 4e9), (16.0, 1.6e10), (64.0, 6.4e10))  # the rate grows with the rows
    rates = dataclasses.replace(RATES, gemm_curve=curve, gemm_w_curve=curve, graph_op_fwd=1e-5, graph_op_bwd=1e-5)
    zoo = models.build("mlp-tiny")
    plan = run_compile(zoo.model, zoo.example_inputs, CompileOptions(stages=2, compute=rates)).pipeline.plan
    assert all(0.0 < s.w_batched < 0.6 for s in plan.stages), [s.w_batched for s in plan.stages]
    flat = dataclasses.replace(RATES, gemm_curve=(), gemm_w_curve=(), graph_op_fwd=1e-12, graph_op_bwd=1e-12)
    plan = run_compile(zoo.model, zoo.example_inputs, CompileOptions(stages=2, compute=flat)).pipeline.plan
    assert all(0.95 < s.w_batched <= 1.0 for s in plan.stages), [s.w_batched for s in plan.stages]
    gpt = models.build("gpt-tiny")
    plan = run_compile(gpt.model, gpt.example_inputs, CompileOptions(stages=2, compute=rates)).pipeline.plan
    assert [s.w_batched for s in plan.stages] == [1.0, 1.0]


def test_a_run_charges_its_optimizer_at_the_plans_own_memory_bandwidth_before_the_machines_cache(
        cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An estimated plan's calibrated rates, then a profiled plan's own reading, then this machine's cache: a
    profiled plan run on a machine never calibrated still charges its optimizer steps (it once charged none)."""
    from fxpipe.cli.rank import memory_bandwidth

    zoo = models.build("mlp-tiny")
    pipe = run_compile(zoo.model, zoo.example_inputs, CompileOptions(stages=2, device_flops=1e11,
                                                                     device_mem_bw=1e10)).pipeline
    assert pipe is not None
    plan = pipe.plan
    assert plan.options.compute is None and plan.provenance.profile_mem_bw is None
    assert memory_bandwidth(plan) is None  # nothing recorded, nothing cached: the simulation leaves them out
    profiled = dataclasses.replace(plan, provenance=dataclasses.replace(plan.provenance, profiled=True,
                                                                        profile_mem_bw=3e9))
    assert memory_bandwidth(profiled) == 3e9
    cc.calibrate_compute(threads=torch.get_num_threads(), measure=_fake_measure([]))
    assert memory_bandwidth(plan) is None  # calibration off (the suite's setting): the cache is not read
    monkeypatch.setenv("FXPIPE_CALIBRATION", "on")
    assert memory_bandwidth(plan) == RATES.mem_bw  # the cache, for a plan that has no reading of its own
    assert memory_bandwidth(profiled) == 3e9  # the plan's own reading, taken beside its layer times, comes first
    calibrated = dataclasses.replace(plan, options=dataclasses.replace(plan.options, compute=dataclasses.replace(
        RATES, mem_bw=7e9)))
    assert memory_bandwidth(calibrated) == 7e9
