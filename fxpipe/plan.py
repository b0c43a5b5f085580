"""The plan as frozen plain data: what fxpipe decided for a model, written once, read by every executor.

A :class:`Plan` records where it came from (:class:`Provenance`), what was asked
(:class:`CompileOptions`), the model's flat inputs, every layer's costs, the stages (which layers,
what they cost), the link model, the device mesh (which ranks hold each stage), the schedule
record and the per-layer strategy record (:class:`StrategyRecord`). It is plain values only: it
round-trips through JSON exactly (``Plan.from_json(p.to_json()) == p``), and its schema is versioned.

Every default fxpipe uses lives in :data:`DEFAULTS`, read when a value is needed (never bound into
a signature), so changing it there changes it everywhere::

    >>> DEFAULTS.stages, DEFAULTS.schedule, DEFAULTS.microbatches(4)
    (2, '1f1b', 8)

This module imports nothing but the standard library and fxpipe.errors.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Union

from fxpipe.errors import OptionError, PlanFileError

PLAN_VERSION = 1


@dataclass
class Defaults:
    """The one place a default is decided. Mutable on purpose: a test (or an embedding program)
    may change a value here and every entry point (CLI, Python API, backend, runtime) follows."""

    stages: int = 2
    schedule: str = "1f1b"  # what the runtime and `fxpipe simulate` run when none is recorded or asked for
    microbatches_per_stage: int = 2  # microbatches = this x stages (fill the pipeline twice over)
    auto_microbatches_per_stage: tuple[int, ...] = (1, 2, 4)  # what `--schedule auto` tries
    tracer: str = "export"
    granularity: str = "auto"
    # This machine's gloo loopback link (the shared ECOSYSTEM.md, section 4.2: 1-2.7 GB/s, ~0.1-1 ms).
    bandwidth: float = 1.5e9
    latency: float = 1e-4
    # One core of this machine: a 512^3 matmul ran at 1.8e11 FLOP/s on one thread.
    device_flops: float = 1e11
    device_mem_bw: float = 1e10
    profile_runs: int = 5
    lr: float = 0.01  # the runtime's default SGD

    def microbatches(self, num_stages: int) -> int:
        """Microbatches per step when none is given."""
        return self.microbatches_per_stage * num_stages

    def auto_microbatches(self, num_stages: int) -> list[int]:
        """The microbatch counts `--schedule auto` searches."""
        return [k * num_stages for k in self.auto_microbatches_per_stage]


DEFAULTS = Defaults()


def machine_memory() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say): no one tensor can be larger."""
    import os

    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(frozen=True)
class Limits:
    """The largest sizes fxpipe takes, checked before any work starts (CLI, Python API, backend, plan files):
    past them a request costs minutes or gigabytes before it could fail, so it is refused in one line."""

    # A schedule lists stages x microbatches actions per rank; generating and simulating more takes minutes.
    schedule_slots: int = 10_000
    microbatches: int = 10_000
    # Each stage is a graph, and each rank a process holding its stages: past these, setup alone takes minutes.
    stages: int = 1_024
    ranks: int = 1_024  # stages x dp ranks of one run (torchrun starts each as a process)
    batch_size: int = 1 << 20  # rows of a built-in model's example batch, built before anything is checked
    elements: int = 1 << 34  # elements of one tensor a plan describes (64 GiB as float32)
    int_bits: int = 63  # whole numbers in plans and graphs: what a C++ int64 holds
    latency: float = 3600.0  # seconds per transfer: an hour is no link

    def whole(self, name: str, value: Any, most: int, why: str, *, least: int = 1,
              error: type[Exception] | None = None) -> int:
        """``value`` as a whole number in ``least..most``; else one line naming ``name``, the bound and ``why``."""
        kind = error or OptionError
        if isinstance(value, bool) or not isinstance(value, int):
            raise kind(f"{name} must be a whole number from {least:,} to {most:,} (got {type(value).__name__} "
                       f"{str(value)[:40]!r})")
        shown = f"{value:,}" if abs(value) < 10**30 else f"a {len(str(abs(value)))}-digit number"
        if value < least:
            raise kind(f"{name} must be at least {least:,} ({name.lstrip('-').split('.')[-1]}: {shown})")
        if value > most:
            raise kind(f"{name} must be at most {most:,} (got {shown}): {why}")
        return value

    def grid(self, pipeline: str, pp: int, dp: int, fix: str) -> None:
        """``pp`` pipeline ranks (``pipeline`` names them) times ``dp`` replicas within ``ranks``; else one line."""
        if pp * dp > self.ranks:
            raise OptionError(f"{pipeline} x --dp {dp} = {pp * dp:,} ranks, more than the {self.ranks:,} one run "
                              f"starts (each is a process); {fix}")

    def positive(self, name: str, value: Any, example: float, *, error: type[Exception] | None = None) -> float:
        """``value`` as a finite number above 0; else one line naming ``name``."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise (error or OptionError)(f"{name} must be a positive number, and finite ({str(value)[:40]}); e.g. "
                                         f"{example:g}")
        return float(value)


LIMITS = Limits()
# The simulator steps time by 1e-9 to wait for an arrival, and at 1e7 a step of 1e-9 is lost to rounding.
_MAX_UNITS = 1e6  # (F + B + W) x (microbatches + stages), in --uniform-costs units


def check_schedule_size(num_stages: int, microbatches: int, step_units: float = 0.0, *,
                        max_slots: int | None = None) -> None:
    """Refuse a schedule too big to generate and simulate in a moment (more than ``max_slots``, default
    ``LIMITS.schedule_slots``, stages x microbatches), or whose times (``step_units``: F+B+W in --uniform-costs
    units) the simulator cannot step through."""
    most = LIMITS.schedule_slots if max_slots is None else max_slots
    if num_stages * microbatches > most:
        raise OptionError(f"a schedule of {num_stages} stages x {microbatches} microbatches is too big to generate and "
                          f"simulate (at most {most:,} stage-microbatches); lower --stages or --microbatches")
    if step_units * (microbatches + num_stages) > _MAX_UNITS:
        raise OptionError(f"--uniform-costs are too large: F+B+W ({step_units:g}) x (microbatches + stages) must stay "
                          f"under {_MAX_UNITS:g} units, where the simulator's 1e-9 time step is lost to rounding; "
                          "use smaller units")


def fxpipe_version() -> str:
    """The installed fxpipe's version (recorded in every plan)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fxpipe")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def _default(name: str) -> Any:
    return field(default_factory=lambda: getattr(DEFAULTS, name))


@dataclass(frozen=True)
class RuntimeOverheads:
    """The runtime's fixed costs on this machine, as ``fxpipe.calibration.runtime_costs.measure_overheads`` measured
    them on two ranks running a real pipeline of a model whose graphs cost next to nothing: what a step costs
    beyond the graphs' estimated times and the link's latency (``Costs.with_overheads``). Plain data: half of the
    machine model (with :class:`ComputeRates`), which planning reads without importing the calibration."""

    action: float  # seconds per compute action beyond its graphs' estimated time (median over actions)
    message: float  # seconds per message through the runtime's channel beyond the bare link's fitted latency
    # seconds per step beyond what the other costs simulate: the calibration pipeline's measured step less its
    # simulated one (``fxpipe.calibration.runtime_costs.step_residual``)
    step: float
    threads: int = 1  # torch threads per rank
    machine: str = ""  # what it was measured on (``calibration.compute.machine_key``), and how long it took
    # seconds the last stage's F costs beyond another action, per microbatch: the loss and its gradient, on the
    # host inside a step (``Costs.from_plan`` adds it to the last stage's F). 0: not measured.
    loss: float = 0.0
    # seconds each message costs its sender's host (``isend``: the sender's next action starts that much later),
    # inside a step. 0: not measured.
    send: float = 0.0
    # seconds of a stage's optimizer step (``torch.optim.SGD``, as ``fxpipe run`` builds it) beyond its memory
    # traffic, inside a step: per step whatever its size, and per parameter tensor (without and with momentum).
    # ``Costs.with_optimizer`` adds them. 0: not measured.
    optimizer: float = 0.0
    optimizer_tensor: float = 0.0
    optimizer_tensor_momentum: float = 0.0

    def scaled(self, factor: float) -> RuntimeOverheads:
        """These costs with every one in seconds (``OVERHEAD_SECONDS``) times ``factor`` (the machine's sustained
        speed)."""
        return dataclasses.replace(self, **{k: getattr(self, k) * factor for k in OVERHEAD_SECONDS})

    def summary(self) -> str:
        return (f"runtime {self.action * 1e6:.0f} us per action, {self.message * 1e6:.0f} us per message "
                f"(+{self.send * 1e6:.0f} us to send it), {self.step * 1e6:.0f} us per step, "
                f"{self.loss * 1e6:.0f} us per loss, {self.optimizer * 1e6:.0f} us per optimizer step "
                f"+ {self.optimizer_tensor * 1e6:.1f} per tensor")


# RuntimeOverheads' fields in seconds (the rest: threads and machine): what a cache entry must hold as non-negative
# numbers, and what the machine's sustained speed scales
OVERHEAD_SECONDS = tuple(f.name for f in dataclasses.fields(RuntimeOverheads) if f.name not in ("threads", "machine"))


@dataclass(frozen=True)
class ComputeRates:
    """This machine's compute as ``fxpipe.calibration.compute`` measured it: what estimated times are made of
    (``annotate_costs``: per-node host time + max(FLOPs / rate, bytes / mem_bw)). Half of the machine model (with
    :class:`RuntimeOverheads`). A field left at its default (a plan or cache that lacks it) falls back as its
    comment says."""

    gemm_flops: float  # FLOP/s of a matmul (the median over a few sizes)
    conv_flops: float  # FLOP/s of a 3x3 convolution (the slope between a small one and a large one)
    mem_bw: float  # bytes/s of an element-wise add over tensors larger than the caches
    op_fwd: float  # seconds of host work per graph node in F, whatever its size
    op_bwd: float  # seconds per node on the gradient path in B + W together
    threads: int  # torch threads it was measured with (fxpipe run's ranks use 1)
    conv_fwd: float = 0.0  # seconds a convolution costs beyond a node whatever its size (the fit's intercept)
    conv_bwd: float = 0.0  # the same for its backward (input and weight gradients together)
    machine: str = ""  # what it was measured on: host, CPU, torch version, threads
    # Skinny GEMMs run slower: (smallest dimension, FLOP/s) of an (m x 1024) x (1024 x 1024) torch.mm (F and B) and
    # of the weight gradient's (1024 x m) x (m x 1024), m = 1..256; towards gemm_flops at twice the last m,
    # gemm_flops above it. Empty: gemm_flops for every GEMM.
    gemm_curve: tuple[tuple[float, float], ...] = ()
    gemm_w_curve: tuple[tuple[float, float], ...] = ()
    # (FLOPs per call, FLOP/s) of 3x3 convolutions, forward and backward together, at a few sizes: a convolution's
    # rate interpolated in log FLOPs (clamped at the ends), at least the best point at or below its FLOPs (another
    # job only ever slows a point). Empty: conv_flops for every convolution.
    conv_curve: tuple[tuple[float, float], ...] = ()
    # The same two GEMM curves with the weight (F, B) or the gradient it accumulates into (W) not in the caches: each
    # GEMM of a pool of distinct 1024 x 1024 matrices larger than the last-level cache in turn, as a stage's layers
    # run when the model's parameters do not fit there. Empty: the cached curves. ``cache_bytes``: that cache's size
    # as measured (0: unknown; then the cached curves are used).
    gemm_cold_curve: tuple[tuple[float, float], ...] = ()
    gemm_w_cold_curve: tuple[tuple[float, float], ...] = ()
    cache_bytes: float = 0.0
    # The (m x 1024) x (1024 x 1024) GEMM with its weight transposed, as a linear layer's forward reads it (x @ W.T;
    # its backward reads W as stored): cached and over the cold pool; skinny, it runs well under the plain curve.
    # Empty: the plain curves.
    gemm_t_curve: tuple[tuple[float, float], ...] = ()
    gemm_t_cold_curve: tuple[tuple[float, float], ...] = ()
    # The machine's typical speed against its fastest: a mixed GEMM and element-wise loop run for a second in
    # short pieces, the median piece over the fastest (>= 1). The rates above are each the fastest of a few runs
    # (another job only ever adds time), and a step takes the machine as it typically is; estimated times are
    # multiplied by it. 1.0: none.
    sustained: float = 1.0
    # Seconds of host work per ATen op of a layer's real F graph, and per op of its B and W graphs (``count_backward``
    # counts them on each layer's split and puts them in place of op_fwd / op_bwd per node, which a layer of linears
    # decomposes into more ops than the average node, and whose halves misplace W's work): the same runs as op_fwd
    # and op_bwd over the ops of those graphs. 0: per node only.
    graph_op_fwd: float = 0.0
    graph_op_bwd: float = 0.0
    # The same per op with the cache holding the graphs' code and data: each F and B after a short wait (``IDLE_S``),
    # as a pipeline's actions start after waiting for a message, not after other work took the cache.
    # graph_op_fwd / graph_op_bwd above are the uncached end: every F and B after writing more than the cache holds.
    # ``count_backward`` charges an op the cached time plus the model's cache miss (:meth:`cold`) of the difference.
    # 0: the uncached time for every op.
    graph_op_fwd_cached: float = 0.0
    graph_op_bwd_cached: float = 0.0
    # (forward FLOPs per call, FLOP/s) of causal scaled-dot-product attention at a few shapes: its forward's rate, and
    # its backward's as forward FLOPs per second of backward (annotate costs B by the forward's FLOPs), interpolated
    # in log FLOPs, clamped at the ends. Empty: gemm_flops.
    sdpa_curve: tuple[tuple[float, float], ...] = ()
    sdpa_b_curve: tuple[tuple[float, float], ...] = ()
    # (kernel, bytes/s forward, bytes/s backward) of the ATen kernels that run far below ``mem_bw`` (batch norm, max
    # pooling, layer norm, ...), each timed at one size (``calibration.compute.KERNELS``), its bytes counted as
    # annotate_costs counts a node's (inputs and output; the backward's: forward and backward kernels together, per
    # those same bytes). Empty: ``mem_bw`` for every node.
    kernels: tuple[tuple[str, float, float], ...] = ()
    # (kernel area, output pixels per call, FLOP/s of the input gradient, FLOP/s of the weight gradient) of 3x3 and
    # 1x1 stride-1 convolutions whose channels grow as their side shrinks (the same FLOPs per call), each gradient
    # timed alone as B and W run it. The pixels (batch x output height x width) are what the weight gradient sums
    # over, and its rate falls with them. ``conv_grad_rates`` interpolates in log pixels; from the largest point up
    # it leaves the rate to ``conv_curve``. Empty: the backward at the forward's rate.
    conv_grad_curve: tuple[tuple[float, float, float, float], ...] = ()

    def conv_grad_rates(self, area: int, pixels: float) -> tuple[float, float] | None:
        """FLOP/s of a convolution's input and weight gradients (``conv_grad_curve``) at a kernel of ``area``
        (1 for 1x1; any larger kernel takes the 3x3 points) and ``pixels`` output pixels per call; None where the
        curve has no such kernel or ``pixels`` is at or above its largest point."""
        points = sorted((m, b, w) for a, m, b, w in self.conv_grad_curve if (a == 1) == (area == 1))
        if not points or pixels >= points[-1][0]:
            return None
        return (_log_interpolate(tuple((m, b) for m, b, _ in points), pixels),
                _log_interpolate(tuple((m, w) for m, _, w in points), pixels))

    def sdpa_rates(self, flops: float) -> tuple[float, float]:
        """FLOP/s of an attention call of ``flops`` forward FLOPs: its forward's, and its backward's (per forward
        FLOP)."""
        if not self.sdpa_curve or not self.sdpa_b_curve:
            return self.gemm_flops, self.gemm_flops
        return _log_interpolate(self.sdpa_curve, flops), _log_interpolate(self.sdpa_b_curve, flops)

    def kernel_rates(self, kernel: str) -> tuple[float, float] | None:
        """Bytes/s of ``kernel`` forward and backward (``kernels``), or None where it was not timed. A max_pool2d
        window without its own entry takes the timed window nearest in area (``max_pool2d 3x3``)."""
        rates = {name: (f, b) for name, f, b in self.kernels}
        if kernel in rates or not kernel.startswith("max_pool2d "):
            return rates.get(kernel)
        area = _window_area(kernel)
        pools = [(abs(_window_area(name) - area), name) for name in rates if name.startswith("max_pool2d ")]
        return rates[min(pools)[1]] if pools and area else None

    def op_seconds(self, miss: float) -> tuple[float, float, float, float]:
        """Host seconds per ATen op of an F graph and of a B or W graph for a model whose cache miss (:meth:`cold`)
        is ``miss``: the cached time and ``miss`` of the way to the uncached one; then what the rest of the way adds
        (F, B/W), the slope a plan with more copies of the model on one cache moves along. Without a cached time:
        the uncached time, no slope."""
        f_hot = self.graph_op_fwd_cached or self.graph_op_fwd
        b_hot = self.graph_op_bwd_cached or self.graph_op_bwd
        df, db = max(0.0, self.graph_op_fwd - f_hot), max(0.0, self.graph_op_bwd - b_hot)
        return f_hot + miss * df, b_hot + miss * db, df, db

    def cold(self, param_bytes: float) -> float:
        """The fraction of its GEMMs' weights a model of ``param_bytes`` of parameters reads from memory: none while
        its parameters and their gradients (each W reads and writes its layer's), ``S``, fit the cache ``C`` (the
        ranks on one machine share it, so the whole model counts, not one stage), else ``1 - C/S``, the part of them
        the cache cannot hold. Graded, not all or nothing: a step reads its layers forwards, then backwards, so
        those read last are read again first (benchmarks/RESULTS.md compares it with measured steps)."""
        total = 2 * param_bytes
        if not self.gemm_cold_curve or self.cache_bytes <= 0 or total <= self.cache_bytes:
            return 0.0
        return 1.0 - self.cache_bytes / total

    def gemm_rate(self, smallest: float, *, weight: bool = False, cold: float = 0.0, transposed: bool = False) -> float:
        """FLOP/s of a GEMM whose smallest dimension is ``smallest`` (``weight``: a weight gradient, contracting it;
        ``cold``: the fraction of its weight, or gradient, read from memory (:meth:`cold`), its time that part at the
        uncached rate and the rest at the cached one; ``transposed``: its second operand a transposed view, as a
        linear layer's forward reads its weight)."""
        warm = self._gemm_rate(smallest, weight, False, transposed)
        if cold <= 0 or not self.gemm_cold_curve:
            return warm
        uncached = self._gemm_rate(smallest, weight, True, transposed)
        return 1.0 / ((1.0 - cold) / warm + cold / uncached)

    def _gemm_rate(self, smallest: float, weight: bool, cold: bool, transposed: bool) -> float:
        curve = self.gemm_w_curve if weight else self.gemm_curve
        if cold and self.gemm_cold_curve:
            curve = self.gemm_w_cold_curve if weight else self.gemm_cold_curve
        if transposed and not weight and self.gemm_t_curve:
            curve = self.gemm_t_cold_curve if cold and self.gemm_t_cold_curve else self.gemm_t_curve
        if not curve or smallest >= 2 * curve[-1][0]:
            return self.gemm_flops
        if smallest > curve[-1][0]:  # towards the large GEMMs' rate by twice the curve's last point
            return _log_interpolate((*curve, (2 * curve[-1][0], self.gemm_flops)), smallest)
        return _log_interpolate(curve, smallest)

    def conv_rate(self, flops: float) -> float:
        """FLOP/s of a convolution of ``flops`` FLOPs per call (forward; its backward does twice as many)."""
        if not self.conv_curve:
            return self.conv_flops
        below = [rate for x, rate in self.conv_curve if x <= flops]
        return max([_log_interpolate(self.conv_curve, flops), *below])


def _window_area(kernel: str) -> int:
    """The window's area in a kernel name such as ``max_pool2d 3x3``, 0 where it has none."""
    try:
        h, w = kernel.rsplit(" ", 1)[1].split("x")
        return int(h) * int(w)
    except (IndexError, ValueError):
        return 0


def _log_interpolate(curve: tuple[tuple[float, float], ...], x: float) -> float:
    """y at ``x`` on the (x, y) points ``curve`` (x increasing), linear in log x, the end points' y beyond them."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            t = math.log(x / x0) / math.log(x1 / x0)
            return y0 + t * (y1 - y0)
    return curve[-1][1]


@dataclass(frozen=True)
class CompileOptions:
    """What was asked of the compile: every knob of ``fxpipe compile`` (defaults from DEFAULTS)."""

    stages: int = _default("stages")
    tracer: str = _default("tracer")
    granularity: str = _default("granularity")
    bandwidth: float = _default("bandwidth")
    latency: float = _default("latency")
    memory_per_stage: float | None = None
    microbatches: int | None = None  # None: DEFAULTS.microbatches(stages)
    schedule: str | None = None  # None: DEFAULTS.schedule (the partitioner plans its memory in flight)
    profile: bool = False
    profile_runs: int = _default("profile_runs")
    device_flops: float = _default("device_flops")
    device_mem_bw: float = _default("device_mem_bw")
    # This machine's calibrated compute (fxpipe compile without --profile); None: device_flops and device_mem_bw
    # alone, no per-node host time. Absent from plan.json when None (plans from before it still load).
    compute: ComputeRates | None = None
    split_backward: bool = True
    input_grads: bool = False
    balance_backward: bool = False
    dp: int = 1  # replicas of every stage (data parallel): the plan's mesh is pp x dp
    # --stages auto: the objective that chose ``stages`` (fastest, efficiency:E, speedup:X) and the most stages it
    # could pick (None: stage_count.DEFAULT_MAX_STAGES, 8); None when the stage count was given.
    stage_objective: str | None = None
    max_stages: int | None = None
    # --plan auto: stages, dp, schedule and microbatches searched on this many devices (recorded as chosen).
    plan_search: bool = False
    devices: int | None = None
    # --cores N: the planners (--plan auto, --stages auto) model the plan's ranks time-sharing N cores (F, B and W
    # max(1, ranks / N) times slower). None: every rank has a core of its own. Absent from plan.json when None.
    cores: int | None = None

    @property
    def num_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else DEFAULTS.microbatches(self.stages)

    @property
    def schedule_name(self) -> str:
        return self.schedule if self.schedule is not None else DEFAULTS.schedule


@dataclass(frozen=True)
class BuildRecipe:
    """How a built-in model's example was built (what ``fxpipe run`` rebuilds): dtype, batch, seed."""

    dtype: str = "float32"
    batch_size: int | None = None
    seed: int = 0


@dataclass(frozen=True)
class Provenance:
    model: str | None  # a zoo name, file.py:fn, or None (the Python API)
    tracer: str
    torch_version: str
    fxpipe_version: str
    build: BuildRecipe | None = None  # set for the built-in models
    profiled: bool = False  # costs measured (--profile) rather than estimated
    profile_threads: int | None = None
    # bytes/s of memory the profile measured beside the layers (the optimizer's and weight copies' passes, which the
    # layer times leave out); None: estimated, or profiled before fxpipe recorded it
    profile_mem_bw: float | None = None


@dataclass(frozen=True)
class TensorSpec:
    """One flat input of the model, as compiled (one microbatch)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class LayerCost:
    """One layer (group_layers) for one microbatch: seconds, FLOPs and bytes."""

    index: int
    name: str
    f: float
    b: float
    w: float
    flops: int  # F + B + W
    saved_bytes: int  # activations kept for backward
    param_bytes: int
    params: tuple[str, ...] = ()


@dataclass(frozen=True)
class StageCost:
    """One stage for one microbatch: its layers, its F/B/W seconds and the bytes it sends and holds."""

    index: int
    first_layer: int
    end_layer: int  # one past the last
    f: float
    b: float
    w: float
    send_bytes: float  # its output over the right cut (and the gradient sent back for it)
    saved_bytes: float
    held_fb: float  # kept from F until B (or BW)
    held_bw: float  # kept from B until W
    time: float  # F + B + W plus its transfers (what the partitioner balanced)
    # Profiled plans: its W over 4 microbatches at once against the 4 one by one (batched W,
    # fxpipe.graphs.batched); 1.0: not measured, or the stage cannot batch
    w_batched: float = 1.0
    # Bytes of one microbatch's inputs: all it keeps from F to B when it recomputes its forward (--recompute); None in
    # plans written before recomputation, and for a stage without split graphs
    held_in: float | None = None


@dataclass(frozen=True)
class BackwardMove:
    """``--balance-backward`` moved the derivative of ``value`` (an activation stage ``cut`` sends to stage
    ``cut + 1``) from stage ``cut``'s B to the end of stage ``cut + 1``'s: ``seconds`` of B moved with it (the
    pass's estimate, already in the stages' ``b``). A loaded plan's ranks make the same moves."""

    cut: int
    value: str
    seconds: float


@dataclass(frozen=True)
class Link:
    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Mesh:
    """Named device-mesh dimensions (``pp``, ``dp``) and which ranks hold each stage.

    A stage lives on a group of ranks: ``stage_ranks[s]`` is stage s's group, its dp replicas. The
    layout is torch's ``init_device_mesh(..., (pp, dp), mesh_dim_names=("pp", "dp"))``: the rank at
    pipeline position p and replica d is ``p * dp + d``, so a stage's replicas are neighbours.
    """

    dims: tuple[str, ...]
    shape: tuple[int, ...]
    stage_ranks: tuple[tuple[int, ...], ...]

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def pp(self) -> int:
        return self.shape[self.dims.index("pp")]

    @property
    def dp(self) -> int:
        return self.shape[self.dims.index("dp")] if "dp" in self.dims else 1

    @property
    def rank_of_stage(self) -> tuple[int, ...]:
        """Each stage's pipeline position (the schedule's rank of the stage; replica 0's rank over dp)."""
        return tuple(group[0] // self.dp for group in self.stage_ranks)

    @classmethod
    def from_rank_of_stage(cls, rank_of_stage: tuple[int, ...] | list[int], dp: int = 1) -> Mesh:
        """The mesh of a schedule's placement of stages (``rank_of_stage``: pipeline positions), each on ``dp``
        replicas."""
        ranks = tuple(rank_of_stage)
        return cls(("pp", "dp"), (1 + max(ranks, default=0), dp),
                   tuple(tuple(r * dp + d for d in range(dp)) for r in ranks))


@dataclass(frozen=True)
class ScheduleRecord:
    """The schedule a plan runs: as generated (CSV), with how it was asked for and what it simulated to."""

    name: str
    requested: str
    microbatches: int
    csv: str
    synchronous: bool = True  # False: weights update after every microbatch, no flush (async-1f1b)
    weights: str | None = None  # weight policy of an asynchronous schedule (stale, stash, predict)
    makespan_s: float = 0.0
    max_stage_span_s: float = 0.0
    batch_w: bool = False  # the runtime runs a stage's adjacent Ws as one batched W (batched-w)


STRATEGY_NAMES = ("auto", "dp", "splitbrain")
_CONFIG_NAME = re.compile(r"^(?:s[0-9]+)?(?:c[0-9]+)?(?:r[0-9]+)?(?:h[0-9]+)?$")


@dataclass(frozen=True)
class StrategyStage:
    """One pipeline stage of a pipelined strategy: the first and last fx node it runs, and its own search's
    result on its stage graph (``planning.strategies.stage_graph``) on the record's ``ranks``."""

    first: str  # the stage's first fx node (the model's input, or the node after the previous stage's last)
    last: str  # the node it ends with: the cut its output crosses (the model's output for the last stage)
    method: str  # how its configurations were found (elimination, data-parallel, splitbrain-K, ...)
    cost: float  # modelled seconds per step of this stage on its ranks (the whole batch)


@dataclass(frozen=True)
class StrategyRecord:
    """The per-layer strategy a plan runs (``fxpipe compile --strategy``): on which ranks, how it was found, and
    each fx node's configuration (``Degrees`` names: ``s4``, ``s2c2``, ``s2r2``; degrees over sample, column,
    row, height) of ``fxpipe.passes.strategy_graph``'s trace.

    Pipelined (``fxpipe compile --stages P --dp D --strategy ...``): ``stages`` holds each pipeline stage's
    first and last node and its own search (on ``ranks`` = D ranks each, P x D in all), ``microbatches`` the
    microbatches a step takes unless ``fxpipe run --microbatches`` says otherwise; ``nodes`` still names every
    node's configuration. A one-stage record
    has neither (plan.json then has the keys it had before pipelined records existed)."""

    name: str  # auto, dp or splitbrain: what was asked
    ranks: int  # the stage's group of ranks (--dp)
    group: int  # SplitBrain's group (recorded for every choice)
    method: str  # how it was found: elimination, elimination+ilp, data-parallel, splitbrain-K, ...
    cost: float  # modelled seconds per step
    nodes: tuple[tuple[str, str], ...]  # (fx node name, configuration name), in graph order
    stages: tuple[StrategyStage, ...] = ()  # pipelined: one entry per pipeline stage (at least 2); () for one stage
    microbatches: int = 1  # pipelined: microbatches per step by default (the batch is cut into this many)

    @property
    def configs(self) -> dict[str, str]:
        """fx node name -> configuration name."""
        return dict(self.nodes)

    @property
    def cuts(self) -> tuple[str, ...]:
        """The node each pipeline stage but the last ends with (``StrategyRuntime(stages=...)``); () for one stage."""
        return tuple(s.last for s in self.stages[:-1])

    @property
    def world(self) -> int:
        """Ranks the record runs on: its stages x ``ranks``."""
        return max(1, len(self.stages)) * self.ranks

    def problems(self) -> list[str]:
        """What is wrong with this record (empty when it is sound)."""
        found = []
        if self.name not in STRATEGY_NAMES:
            found.append(f"name {self.name!r} is not one of {', '.join(STRATEGY_NAMES)}")
        if self.ranks < 2 or self.ranks & (self.ranks - 1):
            found.append(f"ranks {self.ranks} is not a power of two of at least 2")
        if self.group < 1 or (self.ranks > 0 and self.ranks % self.group):
            found.append(f"group {self.group} does not divide ranks {self.ranks}")
        if not math.isfinite(self.cost) or self.cost < 0:
            found.append(f"cost {self.cost!r} is not a finite number of seconds")
        names = [n for n, _ in self.nodes]
        if len(set(names)) != len(names):
            found.append("a node is named twice")
        for node, config in self.nodes:
            m = _CONFIG_NAME.match(config) if config else None
            degrees = [int(x) for x in re.findall(r"[0-9]+", config)] if m else []
            if not m or not degrees or math.prod(degrees) != self.ranks and config != "s1":
                found.append(f"node {node!r} has configuration {config!r}, not degrees whose product is {self.ranks}")
                break
        return found + self._stage_problems(names)

    def _stage_problems(self, names: list[str]) -> list[str]:
        """What is wrong with the pipelined part: stages that do not cover ``nodes`` in order, one after another."""
        if not self.stages:
            return [] if self.microbatches == 1 else [f"microbatches {self.microbatches} without pipeline stages"]
        found = []
        if len(self.stages) < 2:
            found.append(f"{len(self.stages)} pipeline stage(s): a pipelined record has at least 2")
        if self.microbatches < 1:
            found.append(f"microbatches {self.microbatches} is not at least 1")
        at = {n: i for i, n in enumerate(names)}
        expected = 0
        for i, stage in enumerate(self.stages):
            if stage.first not in at or stage.last not in at:
                found.append(f"stage {i} names node {stage.first if stage.first not in at else stage.last!r}, "
                             "which has no configuration")
                break
            if at[stage.first] != expected or at[stage.last] < at[stage.first]:
                found.append(f"stage {i} runs {stage.first!r}..{stage.last!r}, not the nodes after the previous stage")
                break
            if not math.isfinite(stage.cost) or stage.cost < 0:
                found.append(f"stage {i} cost {stage.cost!r} is not a finite number of seconds")
                break
            expected = at[stage.last] + 1
        else:
            if expected != len(names):
                found.append(f"the stages end at node {names[expected - 1]!r}, not at the last node {names[-1]!r}")
        return found


@dataclass(frozen=True)
class Plan:
    provenance: Provenance
    options: CompileOptions
    inputs: tuple[TensorSpec, ...]
    layers: tuple[LayerCost, ...]
    stages: tuple[StageCost, ...]
    link: Link
    mesh: Mesh
    bottleneck_s: float
    lower_bound_s: float
    schedule: ScheduleRecord | None = None
    version: int = PLAN_VERSION
    strategy: StrategyRecord | None = None  # a per-layer strategy (--strategy); absent from plan.json when None
    # --balance-backward's moves, in the order made; absent from plan.json when there are none
    backward_moves: tuple[BackwardMove, ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def bounds(self) -> tuple[int, ...]:
        """Stage k holds layers ``bounds[k] .. bounds[k+1]-1``."""
        return (*(s.first_layer for s in self.stages), self.stages[-1].end_layer) if self.stages else (0,)

    @property
    def ratio(self) -> float:
        """Bottleneck over the lower bound ``max(sum/p, max layer)``."""
        return self.bottleneck_s / self.lower_bound_s if self.lower_bound_s > 0 else 1.0

    def with_schedule(self, record: ScheduleRecord, rank_of_stage: tuple[int, ...]) -> Plan:
        """This plan running ``record`` (the mesh follows the schedule's placement of stages)."""
        return dataclasses.replace(self, schedule=record, mesh=Mesh.from_rank_of_stage(rank_of_stage, self.mesh.dp))

    def with_strategy(self, record: StrategyRecord | None) -> Plan:
        """This plan running the per-layer strategy ``record``."""
        return dataclasses.replace(self, strategy=record)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = _encode(self)
        if self.strategy is None:  # plans without a strategy are written exactly as before it existed
            del doc["strategy"]
        elif not self.strategy.stages:  # and one-stage strategies as before pipelined ones existed
            del doc["strategy"]["stages"], doc["strategy"]["microbatches"]
        if not self.backward_moves:  # nor plans that moved no derivative before moves were recorded
            del doc["backward_moves"]
        if self.options.compute is None:  # nor uncalibrated ones before calibration existed
            del doc["options"]["compute"]
        if self.options.cores is None:  # nor plans that model no time-sharing before --cores existed
            del doc["options"]["cores"]
        return doc

    def check_sizes(self, where: str = "the plan") -> None:
        """Every count and shape within ``LIMITS`` (a crafted plan.json could ask a rank for terabytes); else
        PlanFileError naming the field."""
        o, fix = self.options, "; re-run fxpipe compile"
        LIMITS.whole(f"{where}.options.stages", o.stages, LIMITS.stages, "stages past it are not a plan" + fix,
                     error=PlanFileError)
        LIMITS.whole(f"{where}.options.dp", o.dp, LIMITS.ranks, "replicas past it are not a plan" + fix,
                     error=PlanFileError)
        if o.microbatches is not None:
            LIMITS.whole(f"{where}.options.microbatches", o.microbatches, LIMITS.microbatches,
                         "a schedule lists every microbatch's actions" + fix, error=PlanFileError)
        if self.schedule is not None:
            LIMITS.whole(f"{where}.schedule.microbatches", self.schedule.microbatches, LIMITS.microbatches,
                         "a schedule lists every microbatch's actions" + fix, error=PlanFileError)
        build = self.provenance.build
        if build is not None and build.batch_size is not None:
            LIMITS.whole(f"{where}.provenance.build.batch_size", build.batch_size, LIMITS.batch_size,
                         "every rank builds the example batch" + fix, error=PlanFileError)
        if build is not None:
            LIMITS.whole(f"{where}.provenance.build.seed", build.seed, 2**64 - 1, "torch takes a 64-bit seed" + fix,
                         least=-(2**63), error=PlanFileError)
        for spec in self.inputs:
            count = math.prod(spec.shape)
            if any(d < 0 for d in spec.shape) or count > LIMITS.elements:
                raise PlanFileError(f"{where}.inputs {spec.name!r} has shape {list(spec.shape)[:8]} ({count:,} "
                                    f"elements), past {LIMITS.elements:,}{fix}")

    @classmethod
    def from_json(cls, data: Any, where: str = "the plan") -> Plan:
        """The plan ``to_json`` wrote; PlanFileError naming the field for anything else."""
        if not isinstance(data, dict) or data.get("version") != PLAN_VERSION:
            found = data.get("version") if isinstance(data, dict) else type(data).__name__
            raise PlanFileError(f"{where} has plan version {found!r}, this fxpipe reads {PLAN_VERSION}; "
                                "re-run fxpipe compile")
        plan: Plan = _decode(cls, data, where)
        plan.check_sizes(where)
        mem_bw = plan.provenance.profile_mem_bw
        if mem_bw is not None and not (math.isfinite(mem_bw) and mem_bw > 0):
            raise PlanFileError(f"{where}.provenance.profile_mem_bw must be a positive number of bytes per second "
                                f"(found {mem_bw!r}); re-run fxpipe compile --profile")
        cores = plan.options.cores
        if cores is not None and cores < 1:
            raise PlanFileError(f"{where}.options.cores must be at least 1 (cores: {cores}); leave it out to model no "
                                "time-sharing, or re-run fxpipe compile")
        for move in plan.backward_moves:
            if not 0 <= move.cut < len(plan.stages) - 1 or not math.isfinite(move.seconds) or move.seconds < 0:
                raise PlanFileError(f"{where}.backward_moves has a move across cut {move.cut} of {move.seconds!r} s, "
                                    f"which {len(plan.stages)} stages cannot have; re-run fxpipe compile")
        if plan.strategy is not None:
            bad = plan.strategy.problems()
            if bad:
                raise PlanFileError(f"{where}.strategy is corrupt ({bad[0]}); re-run fxpipe compile")
        return plan


# -- exact JSON: dataclasses as objects, tuples as lists, decoded by the field types ----------------


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    return value


def _decode(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _decode(option, value, where)
            except PlanFileError as exc:
                errors.append(exc)
        raise errors[0] if errors else _bad(where, tp, value)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list):
            raise _bad(where, tp, value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise _bad(where, tp, value)
        return tuple(_decode(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _bad(where, tp.__name__, value)
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise PlanFileError(f"{where} has unknown field(s) {unknown}; re-run fxpipe compile")
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in value:
                kwargs[f.name] = _decode(hints[f.name], value[f.name], f"{where}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise PlanFileError(f"{where} lacks {f.name!r}; re-run fxpipe compile")
        return tp(**kwargs)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad(where, tp, value)
        if not math.isfinite(value):  # a plan holds times, sizes and rates: NaN or infinity is an edit
            raise PlanFileError(f"{where} is {value}, not a finite number; re-run fxpipe compile")
        return float(value)
    if tp in (int, str, bool):
        if type(value) is not tp:
            raise _bad(where, tp, value)
        if tp is int and not -(2**LIMITS.int_bits) <= value < 2**LIMITS.int_bits:
            raise PlanFileError(f"{where} is a whole number of {len(str(abs(value)))} digits, beyond 64 bits; "
                                "re-run fxpipe compile")
        return value
    if tp is Any:
        return value
    raise _bad(where, tp, value)


def _bad(where: str, expected: Any, value: Any) -> PlanFileError:
    name = getattr(expected, "__name__", str(expected))
    return PlanFileError(f"{where} should be {name}, found {type(value).__name__} {str(value)[:60]!r}; "
                         "re-run fxpipe compile")
