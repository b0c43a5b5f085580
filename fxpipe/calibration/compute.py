"""This machine's compute: GEMM, convolution and attention throughput, memory bandwidth, slow kernels and the host
time per node and per ATen op, measured once and cached per machine and thread count: quickly by default (a few
seconds: fewer sizes, runs and rounds), in full with ``full=True`` (``--calibration full``,
``FXPIPE_CALIBRATION=full``).

Estimated costs (``annotate_costs`` without ``--profile``) know a node's FLOPs and bytes, not how fast this machine
turns them into time. :func:`measure_compute` gives them a clock (:class:`~fxpipe.plan.ComputeRates`): square and
skinny GEMMs (cached, and over a pool of weights larger than the measured cache), 3x3 convolutions by FLOPs and their
gradients by pixels, causal attention, the kernels that run below the memory bandwidth (``KERNELS``), and the host
time per node and per op of :class:`~fxpipe.calibration.probes.Mix`, split into F, B and W as ``fxpipe compile``
does and timed as the runtime runs them, cold (after an eviction) and cached (after a short wait). Each rate is the
fastest of several runs (another job only ever adds time); the noisiest are read in three rounds a few seconds
apart. ``ComputeRates.sustained`` (the machine's typical speed over its fastest) scales every estimate to a step's.

The result is cached as JSON in ``$XDG_CACHE_HOME/fxpipe/compute.json`` (else ``~/.cache/fxpipe``), keyed by
:func:`machine_key`; a file that cannot be read as such is ignored and rewritten (only ever parsed as JSON). The
runtime's fixed costs (``fxpipe.calibration.runtime_costs``) are cached beside it (``runtime.json``).
``FXPIPE_CALIBRATION=off`` (or ``fxpipe compile --calibration off``) keeps the fixed ``DEFAULTS.device_flops`` /
``device_mem_bw`` model: the test suite sets it, so no plan there depends on the machine. A quick entry serves a
quick calibration only; a full one serves both. Measuring is announced on the module's logger (INFO). What it
measured, and how the estimate compares with measured steps: benchmarks/RESULTS.md.

    >>> rates, cached = calibrate_compute()             # doctest: +SKIP
    >>> describe(rates, cached=cached)                  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fxpipe.calibration.host import HostTuning
from fxpipe.calibration.host_memory import keep_freed_memory
from fxpipe.calibration.probes import Mix
from fxpipe.errors import OptionError
from fxpipe.plan import OVERHEAD_SECONDS, CompileOptions, ComputeRates, RuntimeOverheads
from fxpipe.timing import fastest, least_disturbed, windows

logger = logging.getLogger(__name__)

ENV = "FXPIPE_CALIBRATION"
LEVELS = ("on", "full", "off")  # on: the quick calibration; full: every size, run and round; off: the fixed model
CALIBRATION_VERSION = 30  # raised when what is measured changes: older cache entries are then measured again
GEMM_SIZES = (128, 256, 512)
# The skinny GEMMs' smallest dimension (rows of an (m x 1024) x (1024 x 1024)), up to 256: a transformer's linears
# over batch x tokens rows run well under the square GEMMs' rate.
SKINNY_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SKINNY_WIDTH = 1024
COLD_POOL_MAX = 32  # distinct 4 MiB matrices in the cold pool (128 MiB), which the cold curves read
CACHE_PROBE = (1, 2, 4, 8, 12, 16, 24, 32)  # pools of distinct 4 MiB weights (4 to 128 MiB) the cache probe reads
CACHE_KNEE = 1.5  # a cache the probe's pools outgrow slows their rate by at least this much
# 3x3 convolutions (batch, channels in = out, side) for the rate by FLOPs per call: 29 MFLOP to 0.9 GFLOP
CONV_SIZES = ((2, 16, 56), (2, 64, 56), (1, 128, 56))
# Convolutions for ComputeRates.conv_grad_curve (kernel side, batch, channels in = out, side): stride 1, same padding,
# the channels doubling as the side halves (the FLOPs per call constant: 462 MFLOP at 3x3, 51-206 at 1x1), as
# resnet's and vgg's deeper layers do; their input and weight gradients each timed alone
CONV_GRAD_SHAPES = ((3, 2, 128, 28), (3, 2, 256, 14), (3, 2, 512, 7), (1, 2, 128, 28), (1, 2, 256, 14), (1, 2, 512, 7))
# Causal attention (batch, heads, tokens, head dim): gpt-base's (34 MFLOP per call forward) and one 4x its FLOPs
SDPA_SHAPES = ((2, 4, 128, 64), (2, 4, 256, 64))
# The kernels timed for ComputeRates.kernels (name as annotate_costs looks it up, input shape): the zoo's nodes that
# are neither a GEMM, a convolution nor attention and may run far below the memory bandwidth (a relu, for a
# reference, runs near it). Each a few milliseconds or less forward.
KERNELS = (("batch_norm", (2, 128, 56, 56)), ("max_pool2d 2x2", (2, 64, 56, 56)), ("max_pool2d 3x3", (2, 64, 56, 56)),
           ("layer_norm", (2, 128, 768)), ("gelu", (2, 128, 3072)), ("relu", (2, 128, 56, 56)),
           ("dropout", (2, 128, 3072)))
STREAM_BYTES = 32 << 20
SUSTAINED_SECONDS = 1.0  # how long the sustained-speed loop runs
# The quick calibration (the default): one round of the noisy measurements and of the host times instead of three,
# each the fastest of QUICK_RUNS, and the skinny GEMM curves at these rows (log-interpolated between them, as the
# full curves are). A fraction of the full measurement's time; the zoo's plans come out the same.
QUICK_RUNS = 5
QUICK_SKINNY_ROWS = (1, 8, 64, 256)
QUICK_MARK = " quick"  # ends a quick measurement's ``machine`` (after its seconds); a full one's ends in " s"

__all__ = ["ENV", "LEVELS", "ComputeRates", "cache_path", "calibrate_compute", "calibrate_overheads",
           "calibrated_options", "calibration_enabled", "calibration_level", "compute_overheads", "is_full", "describe",
           "effective_cache_bytes", "last_level_cache_bytes", "machine_key", "measure_compute", "overheads_cache_path",
           "plan_overheads"]


def calibration_level(setting: str | None = None) -> str:
    """How compiles calibrate, one of ``LEVELS``: ``setting`` (``--calibration on|full|off``), else
    ``$FXPIPE_CALIBRATION``, else on (the quick calibration)."""
    value = setting if setting is not None else os.environ.get(ENV, "on")
    choice = value.strip().lower()
    if choice in ("on", "1", "true", "yes", "quick"):
        return "on"
    if choice == "full":
        return "full"
    if choice in ("off", "0", "false", "no"):
        return "off"
    where = "--calibration" if setting is not None else f"${ENV}"
    raise OptionError(f"{where} takes on, full or off (got {value!r}); e.g. {where.lstrip('$')}=off for the fixed "
                      "model, full for the full measurement")


def calibration_enabled(setting: str | None = None) -> bool:
    """Whether compiles calibrate at all (:func:`calibration_level` is on or full)."""
    return calibration_level(setting) != "off"


def is_full(machine: str) -> bool:
    """Whether the measurement whose ``machine`` (``ComputeRates.machine``, ``RuntimeOverheads.machine``) this is
    was the full one; entries from before the quick calibration were all full."""
    return not machine.endswith(QUICK_MARK)


def machine_key(threads: int) -> str:
    """What a calibration is valid for: host, CPU model, torch version and thread count, and the calibration version."""
    return f"{socket.gethostname()}|{_cpu_model()}|torch {torch.__version__}|{threads} thread(s)|v{CALIBRATION_VERSION}"


def cache_path() -> Path:
    """``$XDG_CACHE_HOME/fxpipe/compute.json``, else ``~/.cache/fxpipe/compute.json``."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "fxpipe" / "compute.json"


def calibrate_compute(*, threads: int = 1, cache: bool = True, measure: Callable[[int], ComputeRates] | None = None,
                      host: HostTuning | None = None, full: bool = False) -> tuple[ComputeRates, bool]:
    """This machine's rates at ``threads`` threads and whether they came from the cache.

    Read from :func:`cache_path` when an entry for :func:`machine_key` is there and sound (with ``full``: and was
    the full measurement), else measured now (:func:`measure_compute`: quickly, a few seconds, or with ``full`` at
    every size and round, several times longer) and written back. A cache that cannot be read or written is no
    error: the rates are measured (and used) all the same. ``measure``: called with the thread count instead of
    :func:`measure_compute` (tests inject rates with it). ``host``: measure as ranks with these settings run (its
    ``keep_freed_memory`` is applied to this process first); None changes nothing.
    """
    if threads < 1:
        raise OptionError(f"a calibration needs at least 1 thread (threads: {threads})")
    path = cache_path()

    def make() -> ComputeRates:
        logger.info("calibrating this host's compute rates at %d thread%s (%s; cached in %s)", threads,
                    "" if threads == 1 else "s", "the full measurement" if full else
                    f"first run, a few seconds; {ENV}=full measures in full", path)
        if host is not None and host.keep_freed_memory:  # as the ranks that then run what this measures
            keep_freed_memory()
        return measure(threads) if measure is not None else measure_compute(threads, full=full)

    return _cached(path, machine_key(threads), _rates_from, make, cache,
                   enough=lambda rates: not full or is_full(rates.machine))


def cached_rates(threads: int = 1) -> ComputeRates | None:
    """This machine's rates at ``threads`` threads if an earlier calibration cached them, else None: measures
    nothing (for a run whose plan was profiled, which needs only its memory bandwidth: the optimizer's passes)."""
    if not calibration_enabled():
        return None
    key = machine_key(threads)
    return _rates_from(_read_cache(cache_path()).get(key), key)


def _cached(path: Path, key: str, sound: Callable[[Any, str], Any], make: Callable[[], Any], cache: bool, *,
            enough: Callable[[Any], bool] = lambda found: True) -> tuple[Any, bool]:
    """The entry ``key`` of the JSON cache at ``path`` when ``sound`` makes a record of it that is ``enough`` (a
    quick one is not, for a full calibration), else ``make()`` written back (when ``cache``); and whether it came
    from the cache."""
    entries = _read_cache(path) if cache else {}
    found = sound(entries.get(key), key)
    if found is not None and enough(found):
        return found, True
    made = make()
    if cache:
        entries[key] = dataclasses.asdict(made)
        _write_cache(path, entries)
    return made, False


def calibrated_options(options: CompileOptions, setting: str | None = None, *, explicit: bool = False,
                       host: HostTuning | None = None) -> tuple[CompileOptions, ComputeRates | None, bool]:
    """``options`` with this machine's calibrated compute, the rates, and whether they were cached.

    ``setting``: on (the quick calibration), full or off (:func:`calibration_level`). Unchanged (and None) when
    calibration is off, with ``--profile`` (measured layer times replace the estimates) or when the device model was
    given (``explicit``: ``--device-flops`` / ``--device-mem-bw``).
    """
    level = calibration_level(setting)
    if level == "off" or options.profile or explicit:
        return options, None, False
    # fxpipe run's ranks compute on one thread each
    rates, cached = calibrate_compute(threads=1, host=host, full=level == "full")
    return (dataclasses.replace(options, compute=rates, device_flops=rates.gemm_flops, device_mem_bw=rates.mem_bw),
            rates, cached)


def overheads_cache_path() -> Path:
    """``runtime.json`` beside :func:`cache_path`: the runtime's fixed costs per machine and thread count."""
    return cache_path().with_name("runtime.json")


def calibrate_overheads(rates: ComputeRates, measure: Callable[[ComputeRates, int], RuntimeOverheads], *,
                        threads: int = 1, cache: bool = True) -> tuple[RuntimeOverheads, bool]:
    """The runtime's fixed costs on this machine (:class:`~fxpipe.plan.RuntimeOverheads`: per compute action, per
    message, per rank's step) at ``threads`` threads, and whether they came from the cache.

    Measured once by ``measure(rates, threads)`` (``fxpipe compile`` passes the runtime's
    ``fxpipe.calibration.runtime_costs.measure_overheads``: two local ranks run a small pipeline, a few seconds; the
    passes do not import the runtime) and cached in :func:`overheads_cache_path` under :func:`machine_key`, like the
    compute rates. ``rates`` are this machine's compute rates: the action overhead is measured against the times
    they estimate, as thoroughly as they were measured (:func:`is_full`; ``measure_overheads`` reads it from them),
    and full rates take no quick entry from the cache.
    """
    path = overheads_cache_path()
    full = is_full(rates.machine)

    def make() -> RuntimeOverheads:
        logger.info("measuring the runtime's fixed costs on two local ranks (%s; cached in %s)",
                    "the full measurement" if full else "first run, a few seconds", path)
        made = measure(rates, threads)
        if not isinstance(made, RuntimeOverheads):
            raise TypeError(f"measure returned {type(made).__name__}, not RuntimeOverheads")
        return made

    return _cached(path, machine_key(threads), _overheads_from, make, cache,
                   enough=lambda found: not full or is_full(found.machine))


def plan_overheads(plan: Any) -> Any:
    """The runtime's fixed costs to simulate ``plan`` with: this machine's cached calibration when the plan's
    costs were estimated with compute rates measured on this machine (``plan.options.compute``) and calibration
    is on (``FXPIPE_CALIBRATION``); else None (a profiled plan, a fixed device model, another machine's plan,
    or no calibration yet). Only reads the cache: ``fxpipe compile`` measures it."""
    return compute_overheads(getattr(plan.options, "compute", None))




def compute_overheads(compute: ComputeRates | None) -> Any:
    """The runtime's fixed costs cached for the machine ``compute`` was measured on, when it is this machine and
    calibration is on; else None (see :func:`plan_overheads`). The planners (``--stages auto``, ``--plan auto``)
    read them through the graph's ``meta["fxpipe_compute"]`` (``annotate_costs``).

    Each was measured on the least disturbed step, so like the estimated times they are scaled to the machine's
    typical speed (``compute.sustained``)."""
    if compute is None or not calibration_enabled():
        return None
    key = compute.machine.rsplit("|", 1)[0] if compute.machine.count("|") > 4 else compute.machine
    if key != machine_key(compute.threads):
        return None
    found = _overheads_from(_read_cache(overheads_cache_path()).get(key), key)
    if found is None:
        return None
    return found.scaled(compute.sustained)


def _overheads_from(entry: Any, key: str) -> Any:
    """The overheads in one cache entry, or None when it is not a sound record for ``key``."""
    if not isinstance(entry, dict) or set(entry) != {f.name for f in dataclasses.fields(RuntimeOverheads)}:
        return None
    if not all(_finite(entry[k]) and entry[k] >= 0 for k in OVERHEAD_SECONDS):
        return None
    if type(entry["threads"]) is not int or not isinstance(entry["machine"], str):
        return None
    if not entry["machine"].startswith(key):
        return None
    return RuntimeOverheads(**{**entry, **{k: float(entry[k]) for k in OVERHEAD_SECONDS}})


def describe(rates: ComputeRates, *, cached: bool) -> str:
    """One line for the compile output."""
    threads = f"{rates.threads} thread{'s' if rates.threads != 1 else ''}"
    found = _overheads_from(_read_cache(overheads_cache_path()).get(machine_key(rates.threads)),
                            machine_key(rates.threads))
    runtime = f", {found.summary()}" if found is not None else ""
    skinny = ""
    if rates.gemm_curve:  # the curve's point at 8 rows (its first at or above 8)
        rows, rate = next((p for p in rates.gemm_curve if p[0] >= 8), rates.gemm_curve[0])
        uncached = dict(rates.gemm_cold_curve).get(rows)
        uncached_text = f", {uncached / 1e9:.0f} uncached" if uncached else ""
        skinny = f" ({rate / 1e9:.0f} at {rows:.0f} rows{uncached_text})"
    big_conv = f" ({rates.conv_curve[-1][1] / 1e9:.0f} large)" if rates.conv_curve else ""
    return (f"compute calibrated ({threads}): GEMM {rates.gemm_flops / 1e9:.0f} GFLOP/s{skinny}, conv "
            f"{rates.conv_flops / 1e9:.0f} GFLOP/s{big_conv}, {rates.mem_bw / 1e9:.1f} GB/s, "
            f"{rates.op_fwd * 1e6:.1f} us + {rates.op_bwd * 1e6:.1f} us per node F / B+W "
            f"({rates.graph_op_fwd * 1e6:.1f} + {rates.graph_op_bwd * 1e6:.1f} per graph op, "
            f"{rates.graph_op_fwd_cached * 1e6:.1f} + {rates.graph_op_bwd_cached * 1e6:.1f} cached), "
            f"typically {rates.sustained:.2f}x its fastest{runtime}; "
            f"{'cached' if cached else 'measured now'} ({'' if is_full(rates.machine) else 'quick; '}{cache_path()}; "
            f"{ENV}=full measures in full, off keeps the fixed model)")


def measure_compute(threads: int = 1, *, full: bool = True, gemm_sizes: tuple[int, ...] = GEMM_SIZES,
                    stream_bytes: int = STREAM_BYTES, runs: int | None = None) -> ComputeRates:
    """Measure GEMM and convolution FLOP/s, memory bandwidth and per-node host time now, at ``threads`` threads.

    Each time is the fastest of ``runs`` (default 10; ``QUICK_RUNS`` when not ``full``) after one warm-up. ``full``:
    the noisiest measurements and the host times in three rounds, the skinny GEMMs at every ``SKINNY_ROWS``; else
    one round and ``QUICK_SKINNY_ROWS`` (the default calibration: a few seconds). It runs once per machine and
    thread count (cached), on the first ``fxpipe compile`` that estimates (benchmarks/RESULTS.md).
    """
    start = time.perf_counter()
    runs = runs if runs is not None else 10 if full else QUICK_RUNS
    rows = SKINNY_ROWS if full else QUICK_SKINNY_ROWS
    with _threads(threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        rounds = [_noisy_round(runs, stream_bytes)]  # full: then one between the GEMM curves and one after them
        gemm = statistics.median(_gemm_rate(n, runs) for n in gemm_sizes)
        probe = [torch.randn(SKINNY_WIDTH, SKINNY_WIDTH) for _ in range(COLD_POOL_MAX)]
        caches = [effective_cache_bytes(probe, max(3, runs // 2))]  # full: one per round, the median of three kept
        # The whole probe, whatever the (noisy) cache measurement said: a pool sized from that measurement can come
        # out small enough for the cache to still largely hold it.
        pool = probe
        gemm_curve = tuple((float(m), _skinny_rate(m, runs, weight=False)) for m in rows)
        gemm_w_curve = tuple((float(m), _skinny_rate(m, runs, weight=True)) for m in rows)
        few = max(2, runs // 4) if full else 1  # each of these runs is `pool` GEMMs already (after a warm-up)
        gemm_cold_curve = tuple((float(m), _skinny_rate(m, few, weight=False, pool=pool)) for m in rows)
        gemm_w_cold_curve = tuple((float(m), _skinny_rate(m, few, weight=True, pool=pool)) for m in rows)
        if full:
            rounds.append(_noisy_round(runs, stream_bytes))
            caches.append(effective_cache_bytes(probe, max(3, runs // 2)))
        gemm_t_curve = tuple((float(m), _skinny_rate(m, runs, weight=False, transposed=True)) for m in rows)
        gemm_t_cold_curve = tuple((float(m), _skinny_rate(m, few, weight=False, pool=pool, transposed=True))
                                  for m in rows)
        if full:
            rounds.append(_noisy_round(runs, stream_bytes))
            caches.append(effective_cache_bytes(probe, max(3, runs // 2)))
        cache_bytes = statistics.median(caches)
        conv_curve = tuple((flops, max(r[0][k][1] for r in rounds)) for k, (flops, _) in enumerate(rounds[0][0]))
        mem_bw = max(r[1] for r in rounds)
        sustained = statistics.median(r[2] for r in rounds)

        # Write more than the cache holds, as the other work inside a step does: twice the measured cache, and at
        # least EVICT_BYTES, so that how cold a run starts does not follow that (noisy) measurement.
        sweep = torch.empty(int(max(2 * cache_bytes, EVICT_BYTES)) // 4)

        def evict() -> None:
            sweep.fill_(1.0)

        # The host times (the small convolution's cold seconds, the per-node and per-op times) are read three times
        # (full) between the other measurements, and each one's median kept: a single reading can be far off.
        def host_times() -> tuple[float, ...]:
            return (*_cold_conv_seconds(*COLD_CONV, evict, 2 * runs), *_node_times(runs, evict=evict,
                                                                                   sustained=sustained))

        readings = [host_times()]
        sdpa = [p for p in (_sdpa_point(shape, runs) for shape in SDPA_SHAPES) if p is not None]
        kernels = tuple(_kernel_point(name, shape, runs) for name, shape in KERNELS)
        if full:
            readings.append(host_times())
        conv_grad = tuple(_conv_grad_point(*shape, runs) for shape in CONV_GRAD_SHAPES)
        if full:
            readings.append(host_times())
        cold_f, cold_b, op_fwd, op_bwd, graph_op_fwd, graph_op_bwd, graph_op_fwd_cached, graph_op_bwd_cached = (
            _median_reading(readings))
        conv, conv_fwd, conv_bwd = _conv_rate(runs, cold=(cold_f, cold_b), sustained=sustained)
    took = f"{time.perf_counter() - start:.1f} s{'' if full else QUICK_MARK}"
    return ComputeRates(gemm_flops=gemm, conv_flops=conv, mem_bw=mem_bw, op_fwd=op_fwd, op_bwd=op_bwd,
                        graph_op_fwd=graph_op_fwd, graph_op_bwd=graph_op_bwd, graph_op_fwd_cached=graph_op_fwd_cached,
                        graph_op_bwd_cached=graph_op_bwd_cached,
                        conv_fwd=max(0.0, conv_fwd - op_fwd), conv_bwd=max(0.0, conv_bwd - op_bwd), threads=threads,
                        machine=f"{machine_key(threads)}|{took}", gemm_curve=gemm_curve,
                        gemm_w_curve=gemm_w_curve, conv_curve=conv_curve, gemm_cold_curve=gemm_cold_curve,
                        gemm_w_cold_curve=gemm_w_cold_curve, cache_bytes=float(cache_bytes), sustained=sustained,
                        gemm_t_curve=gemm_t_curve, gemm_t_cold_curve=gemm_t_cold_curve,
                        sdpa_curve=tuple((f, r) for f, r, _ in sdpa), sdpa_b_curve=tuple((f, r) for f, _, r in sdpa),
                        kernels=kernels, conv_grad_curve=conv_grad)


# -- the measurements ---------------------------------------------------------------------------------


def _sdpa_point(shape: tuple[int, int, int, int], runs: int) -> tuple[float, float, float] | None:
    """Causal ``scaled_dot_product_attention`` of q, k, v of ``shape``: its forward FLOPs per call (counted as
    annotate_costs counts them), the forward's FLOP/s, and the backward kernel's forward FLOPs per second (timed alone:
    autograd's own host time per node is ``op_bwd``'s). None
    where torch has no CPU attention kernel to time."""
    from fxpipe._compat import cpu_attention_ops, flop_counter_mode  # torch's own counts CPU attention as 0 FLOPs

    ops = cpu_attention_ops()
    if ops is None:
        return None
    fwd_op, bwd_op = ops
    q, k, v, grad = (torch.randn(*shape) for _ in range(4))
    with flop_counter_mode() as counter:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    flops = float(counter.get_total_flops())
    out, logsumexp = fwd_op(q, k, v, 0.0, True)[:2]
    fwd = fastest(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), runs)
    bwd = fastest(lambda: bwd_op(grad, q, k, v, out, logsumexp, 0.0, True), runs)
    return flops, flops / fwd, flops / bwd


def _kernel_point(name: str, shape: tuple[int, ...], runs: int) -> tuple[str, float, float]:
    """``name`` (one of ``KERNELS``) on a random input of ``shape`` with autograd on, as a training step runs it: bytes
    per second forward and backward, its bytes the input's, the output's and the parameters' (annotate_costs's
    traffic of the node), the backward's time autograd's whole backward (both gradients, where it has parameters,
    each a new tensor) less the forward."""
    x = torch.randn(*shape, requires_grad=True)
    params: list[torch.Tensor] = []  # a norm's weight and bias
    stats: list[torch.Tensor] = []  # batch norm's running mean and variance
    if name in ("batch_norm", "layer_norm"):
        width = shape[1] if name == "batch_norm" else shape[-1]
        params = [torch.ones(width, requires_grad=True), torch.zeros(width, requires_grad=True)]
    if name == "batch_norm":
        stats = [torch.zeros(width), torch.ones(width)]

        def fn() -> torch.Tensor:
            return F.batch_norm(x, stats[0], stats[1], params[0], params[1], training=True)
    elif name == "layer_norm":
        def fn() -> torch.Tensor:
            return F.layer_norm(x, (width,), params[0], params[1])
    elif name.startswith("max_pool2d "):
        k = int(name.rsplit("x", 1)[1])

        def fn() -> torch.Tensor:
            return F.max_pool2d(x, k, 2, k // 2 if k % 2 else 0)
    else:
        ops: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
            "gelu": F.gelu, "relu": F.relu, "dropout": lambda t: F.dropout(t, 0.1, training=True)}
        op = ops[name]

        def fn() -> torch.Tensor:
            return op(x)
    grad = torch.randn_like(fn())  # the output's shape: the input's, or a pool's smaller one
    inputs = [x, *params]

    def both() -> None:  # fresh gradients, as a B or W graph makes them (backward() would accumulate into .grad)
        torch.autograd.grad(fn(), inputs, grad)

    nbytes = sum(t.numel() * t.element_size() for t in (x, grad, *params, *stats))
    fwd = fastest(fn, runs)
    bwd = max(fastest(both, runs) - fwd, 0.05 * fwd)  # never below a twentieth of the forward: a noisy difference
    return name, nbytes / fwd, nbytes / bwd


def _gemm_rate(n: int, runs: int) -> float:
    a, b, out = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    reps = max(1, int(4e6 // (2 * n**3)))  # each timing at least ~4 MFLOP, so the clock's resolution does not matter

    def mm() -> None:
        for _ in range(reps):
            torch.mm(a, b, out=out)

    return 2 * n**3 * reps / fastest(mm, runs)


def _skinny_rate(m: int, runs: int, *, weight: bool, pool: list[torch.Tensor] | None = None,
                 transposed: bool = False) -> float:
    """FLOP/s of (m x 1024) x (1024 x 1024), or with ``weight`` of the weight gradient (1024 x m) x (m x 1024)
    accumulated into the gradient (``addmm_``, as W_acc runs); with a ``pool`` of distinct 1024 x 1024 weights
    (gradients), each in turn, so that each is read from memory, not the cache; ``transposed``: the weight read
    transposed (x @ w.T, a linear layer's forward)."""
    x, g = torch.randn(m, SKINNY_WIDTH), torch.randn(m, SKINNY_WIDTH)
    mats = pool or [torch.randn(SKINNY_WIDTH, SKINNY_WIDTH)]
    out = torch.empty(m, SKINNY_WIDTH)

    def weights() -> None:
        for w in mats:
            torch.mm(x, w.t() if transposed else w, out=out)

    def grads() -> None:
        for acc in mats:
            acc.addmm_(g.t(), x)

    seconds = fastest(grads if weight else weights, runs) / len(mats)
    return 2 * m * SKINNY_WIDTH * SKINNY_WIDTH / seconds


def effective_cache_bytes(probe: list[torch.Tensor], runs: int) -> float:
    """The bytes of weights this process's GEMMs still find in the cache: 8-row GEMMs over the first n distinct
    1024 x 1024 weights of ``probe`` in turn, n in ``CACHE_PROBE``, from one weight's rate (cached) down to the
    largest pool's (read from memory); the pool at which the rate crosses half-way between the two (their geometric
    mean), interpolated in log pool size between the last pool at or above it and the next. Measured, because the
    cache sysfs reports is the socket's: in a virtual machine the share a process gets is smaller and moves with its
    neighbours. When the rate does not fall by ``CACHE_KNEE``, the cache holds at least the largest pool: the
    system's figure if larger."""
    sizes = [n for n in CACHE_PROBE if n <= len(probe)]
    rates = [_skinny_rate(8, runs, weight=False, pool=probe[:n]) for n in sizes]
    matrix = 4 * SKINNY_WIDTH**2
    if len(sizes) < 2 or rates[0] < CACHE_KNEE * rates[-1]:  # nothing fell
        return float(max(sizes[-1] * matrix, last_level_cache_bytes()))
    half = math.sqrt(rates[0] * rates[-1])
    k = max(i for i, rate in enumerate(rates) if rate >= half)  # < len - 1: the last is below half
    (n0, r0), (n1, r1) = (sizes[k], rates[k]), (sizes[k + 1], rates[k + 1])
    return float(n0 * (n1 / n0) ** (math.log(r0 / half) / math.log(r0 / r1)) * matrix)


def _noisy_round(runs: int, stream_bytes: int) -> tuple[tuple[tuple[float, float], ...], float, float]:
    """One round of the measurements another job on the machine moves most: the convolution curve, the memory
    bandwidth and the sustained speed (over a third of ``SUSTAINED_SECONDS``). :func:`measure_compute` takes three
    rounds a few seconds apart, and the fastest rates and the median sustained speed of them: a neighbour's burst
    takes a whole round, not all three."""
    return _conv_curve(runs), _stream_rate(stream_bytes, runs), _sustained(SUSTAINED_SECONDS / 3)


def _sustained(seconds: float) -> float:
    """The median over the fastest time of a fixed piece of work (GEMMs and an element-wise op, ~5 ms) run back to
    back for ``seconds``: how much slower than its fastest the machine typically runs (>= 1)."""
    a, b, out = torch.randn(256, 256), torch.randn(256, 1024), torch.empty(256, 1024)

    def piece() -> None:
        for _ in range(4):
            torch.mm(a, b, out=out)
        F.gelu(out)

    piece()
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t0 = time.perf_counter()
        piece()
        times.append(time.perf_counter() - t0)
    return max(1.0, statistics.median(times) / min(times))


def last_level_cache_bytes() -> int:
    """The size of this machine's largest CPU cache in bytes (Linux sysfs), or 0 when the system does not say."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text[:-1] if scale != 1 else text
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best


def _conv_curve(runs: int) -> tuple[tuple[float, float], ...]:
    """(FLOPs per call, FLOP/s forward and backward together) of 3x3 convolutions at ``CONV_SIZES``."""
    points = []
    for batch, channels, side in CONV_SIZES:
        flops, fwd, bwd = _conv_seconds(batch, channels, side, runs)
        points.append((float(flops), 3 * flops / (fwd + bwd)))
    return tuple(sorted(points))


def _conv_seconds(batch: int, channels: int, side: int, runs: int) -> tuple[int, float, float]:
    """A 3x3, stride-1, same-padding convolution's forward FLOPs and its fastest forward and backward seconds."""
    x, w = torch.randn(batch, channels, side, side), torch.randn(channels, channels, 3, 3)
    grad = torch.randn(batch, channels, side, side)
    flops = 2 * batch * channels * channels * side * side * 9
    with torch.no_grad():
        fwd = fastest(lambda: _conv(x, w), runs)
        bwd = fastest(lambda: _conv_backward(grad, x, w), runs)
    return flops, fwd, bwd


def _conv_grad_point(k: int, batch: int, channels: int, side: int, runs: int) -> tuple[float, float, float, float]:
    """(kernel area, output pixels, FLOP/s of the input gradient, of the weight gradient) of a k x k, stride-1,
    same-padding convolution: each gradient alone (``output_mask``), as fxpipe's B and W graphs call it."""
    x, w = torch.randn(batch, channels, side, side), torch.randn(channels, channels, k, k)
    grad = torch.randn(batch, channels, side, side)
    flops = 2 * batch * channels * channels * side * side * k * k
    pad = [k // 2] * 2

    def backward(mask: list[bool]) -> Callable[[], Any]:
        return lambda: torch.ops.aten.convolution_backward.default(grad, x, w, None, [1, 1], pad, [1, 1], False,
                                                                   [0, 0], 1, mask)

    with torch.no_grad():
        b, wg = (fastest(backward(mask), runs) for mask in ([True, False, False], [False, True, False]))
    return float(k * k), float(batch * side * side), flops / b, flops / wg


def _conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The calibration's convolution: 3x3, stride 1, same padding, no bias (as the graphs call it)."""
    return torch.ops.aten.convolution.default(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)


def _conv_backward(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> Any:
    """Its backward: the input's and the weight's gradients."""
    return torch.ops.aten.convolution_backward.default(grad, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                                       [True, True, False])


def _conv_rate(runs: int, *, cold: tuple[float, float] | None = None, sustained: float = 1.0,
               ) -> tuple[float, float, float]:
    """FLOP/s of a 3x3 convolution, and its seconds per call forward and backward at no FLOPs (the intercepts).

    With ``cold`` (:func:`_cold_conv_seconds` of ``COLD_CONV``: forward and backward seconds per convolution of a
    chain run after evicting the cache), the small convolution's seconds are those over ``sustained``, never below
    the fastest back to back, as :func:`_node_times` takes the per-node time: a small convolution runs several times
    its warm fastest after the cache was read over, a large one does not move.
    """
    (f0, a0, b0), (f1, a1, b1) = (_conv_seconds(batch, channels, side, runs)
                                  for batch, channels, side in (COLD_CONV, (2, 64, 56)))
    rate = 3 * (f1 - f0) / max(a1 + b1 - a0 - b0, 1e-9)  # F does f FLOPs, its backward 2f
    if cold is not None:
        a0, b0 = max(a0, cold[0] / sustained), max(b0, cold[1] / sustained)
    # The backward does twice the forward's FLOPs (input and weight gradients): its intercept at that rate.
    return rate, max(0.0, a0 - f0 / rate), max(0.0, b0 - 2 * f0 / rate)


EVICT_BYTES = 128 << 20
COLD_CONV = (2, 8, 16)  # batch, channels, side of the small convolution whose cold seconds set the intercepts
CONV_CHAIN = 4  # small convolutions per evicted run: an action holds several, and only its first starts cold
# Cold runs are read in windows of this many, the least disturbed window's median kept (``timing.least_disturbed``):
# a neighbour's burst over a whole window does not move it, as it moves the median over all runs.
COLD_WINDOW = 5


def _cold_conv_seconds(batch: int, channels: int, side: int, evict: Callable[[], object],
                       runs: int) -> tuple[float, float]:
    """Median forward and backward seconds per convolution of a chain of ``CONV_CHAIN`` (distinct weights), each
    chain run after ``evict``."""
    x = torch.randn(batch, channels, side, side)
    ws = [torch.randn(channels, channels, 3, 3) for _ in range(CONV_CHAIN)]
    grad = torch.randn(batch, channels, side, side)
    fwd, bwd = [], []
    with torch.no_grad():
        for _ in range(runs + 1):
            evict()
            t0 = time.perf_counter()
            for w in ws:
                _conv(x, w)
            fwd.append(time.perf_counter() - t0)
            evict()
            t0 = time.perf_counter()
            for w in ws:
                _conv_backward(grad, x, w)
            bwd.append(time.perf_counter() - t0)
    return (least_disturbed(windows(fwd[1:], COLD_WINDOW)) / CONV_CHAIN,
            least_disturbed(windows(bwd[1:], COLD_WINDOW)) / CONV_CHAIN)


def _median_reading(readings: list[tuple[float, ...]]) -> tuple[float, ...]:
    """Each field's median over ``readings`` (several readings of the same times, taken seconds apart between the
    calibration's other measurements): one disturbed reading does not set any of them."""
    return tuple(statistics.median(field) for field in zip(*readings))


def measure_mem_bw(runs: int = 30, stream_bytes: int = STREAM_BYTES) -> float:
    """This machine's memory bandwidth now, at torch's current thread count: bytes per second of the fastest of
    ``runs`` element-wise adds over ``stream_bytes`` (as :func:`measure_compute` reads it; about 0.3 s on one core).
    ``fxpipe compile --profile`` records it beside the layer times: a profiled plan's optimizer steps and weight
    copies are memory-bound passes, and the run charges them at this rate."""
    return _stream_rate(stream_bytes, runs)


def _stream_rate(nbytes: int, runs: int) -> float:
    a = torch.randn(max(1, nbytes // 4))
    b, out = torch.randn_like(a), torch.empty_like(a)
    return 3 * a.numel() * 4 / fastest(lambda: torch.add(a, b, out=out), runs)


def _node_times(runs: int, *, evict: Callable[[], object] | None = None, sustained: float = 1.0,
                ) -> tuple[float, float, float, float, float, float]:
    """Seconds per node of F, and of B + W per node on the gradient path, of :class:`fxpipe.calibration.probes.Mix`
    (no convolution part) run as fxpipe runs it; then the same two times per ATen op of its F graph, and per op of
    its B and W graphs (:func:`graph_ops`); then those two per op with the cache holding the graphs (each F and B
    after a wait of ``IDLE_S``, not an eviction; 0.0 without ``evict``: the per-op times above are then warm
    already).

    With ``evict`` the per-op times are the uncached end: inside a pipeline a small model's actions start after a
    wait for a message, with its code and data still in the cache, between the two ends; ``count_backward`` charges
    the cached time plus the model's cache miss (``ComputeRates.cold``) of the difference, as the GEMM rates take it.
    The convolution part is left out: a convolution's host time is its own intercept (``conv_fwd`` / ``conv_bwd``,
    :func:`_conv_rate`), which averaged into every op would be charged again on each.

    With ``evict`` (reading more than the cache holds), each run starts as an action inside a pipeline step
    does, after other work took the cache: of ``2 * runs`` such runs, the least disturbed window's median
    (``COLD_WINDOW``), over ``sustained`` (so that ``annotate_costs``, which scales every time by it, gives back
    that median), and never less than the fastest run back to back.
    """
    from fxpipe.graphs.fx import COMPUTE_OPS
    from fxpipe.graphs.split import split_stage
    from fxpipe.passes.count_backward import graph_ops
    from fxpipe.passes.time_graphs import time_graphs
    from fxpipe.passes.trace import trace

    model = Mix()
    x = torch.randn(2, 4, 2, 2)
    gm = trace(model, (x,)).gm
    nodes = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS and n.target is not _getitem()]
    arg = x.clone().requires_grad_(True)
    graphs = split_stage(gm, [arg])
    if graphs.fused:  # cannot happen on this model unless torch changes; then time it under autograd (per node only:
        # no per-op times, 0.0, which the cost model reads as none measured and charges the per-node times instead)
        node_f, node_bw = _autograd_node_times(gm, x, len(nodes), runs)
        return node_f, node_bw, 0.0, 0.0, 0.0, 0.0
    times = [time_graphs(graphs, [x], 1) for _ in range(runs)]
    f = min(t[0] for t in times)
    bw = min(t[1] + t[2] for t in times)
    ops_f, ops_b, ops_w = graph_ops(graphs)
    if evict is None:
        return f / len(nodes), bw / len(nodes), f / ops_f, bw / (ops_b + ops_w), 0.0, 0.0

    def after(before: Callable[[], object], floors: tuple[float, float]) -> tuple[float, float]:
        """(F, B + W) of 2 x runs runs each after ``before``: the least disturbed window's median over ``sustained``,
        never below ``floors``."""
        samples = _cold_times(graphs, x, before, 2 * runs)

        def window_median(j: int) -> float:
            return max(floors[j], least_disturbed(windows([t[j] for t in samples], COLD_WINDOW)) / sustained)

        return window_median(0), window_median(1)

    f_hot, bw_hot = after(_idle, (f, bw))
    f, bw = after(evict, (f_hot, bw_hot))
    return f / len(nodes), bw / len(nodes), f / ops_f, bw / (ops_b + ops_w), f_hot / ops_f, bw_hot / (ops_b + ops_w)


IDLE_S = 0.0005  # the wait before each cached F and B: about a message's, without other work


def _idle() -> None:
    time.sleep(IDLE_S)


def _cold_times(graphs: Any, x: torch.Tensor, evict: Callable[[], object], runs: int) -> list[tuple[float, float]]:
    """(F, B + W) seconds of ``runs`` runs of the split graphs, F and B each after ``evict`` (a pipeline's B, like
    its F, starts after a wait; :func:`_idle` for the cached times); timed as
    :func:`fxpipe.passes.time_graphs.time_graphs` times them (W as W_acc into gradient buffers that persist)."""
    from fxpipe.passes.time_graphs import graph_samples

    return [(f, b + w) for f, b, w in graph_samples(graphs, [x], runs, before=evict, before_backward=evict)]


def _autograd_node_times(gm: torch.fx.GraphModule, x: torch.Tensor, nodes: int, runs: int) -> tuple[float, float]:
    def fwd() -> Any:
        return gm(x.detach().requires_grad_(True))

    def both() -> None:
        out = fwd()
        (out[0] if isinstance(out, (tuple, list)) else out).sum().backward()

    f = fastest(fwd, runs)
    return f / nodes, max(0.0, fastest(both, runs) - f) / nodes


def _getitem() -> Any:
    import operator

    return operator.getitem


# -- the cache ----------------------------------------------------------------------------------------


def _read_cache(path: Path) -> dict[str, Any]:
    """The cache's entries; empty when the file is missing, unreadable or not a JSON object (it is rewritten)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _rates_from(entry: Any, key: str) -> ComputeRates | None:
    """The rates in one cache entry, or None when it is not a sound record for ``key``."""
    if not isinstance(entry, dict):
        return None
    names = {f.name for f in dataclasses.fields(ComputeRates)}
    if set(entry) != names:
        return None
    floats = ("gemm_flops", "conv_flops", "mem_bw", "op_fwd", "op_bwd", "conv_fwd", "conv_bwd", "cache_bytes",
              "sustained", "graph_op_fwd", "graph_op_bwd", "graph_op_fwd_cached", "graph_op_bwd_cached")
    if not all(_finite(entry[k]) and entry[k] >= 0 for k in floats):
        return None
    if not all(entry[k] > 0 for k in ("gemm_flops", "conv_flops", "mem_bw")) or entry["sustained"] < 1:
        return None
    if type(entry["threads"]) is not int or not isinstance(entry["machine"], str):
        return None
    if not entry["machine"].startswith(key):
        return None
    curves = {}
    for k in ("gemm_curve", "gemm_w_curve", "conv_curve", "gemm_cold_curve", "gemm_w_cold_curve", "gemm_t_curve",
              "gemm_t_cold_curve", "sdpa_curve", "sdpa_b_curve"):
        points = entry[k]
        if not isinstance(points, list) or not all(
                isinstance(p, list) and len(p) == 2 and all(_finite(v) and v > 0 for v in p) for p in points):
            return None
        curves[k] = tuple((float(a), float(b)) for a, b in points)
        if any(a >= b for (a, _), (b, _) in zip(curves[k], curves[k][1:])):
            return None
    grad_points = entry["conv_grad_curve"]
    if not isinstance(grad_points, list) or not all(
            isinstance(p, list) and len(p) == 4 and all(_finite(v) and v > 0 for v in p) for p in grad_points):
        return None
    kernels = entry["kernels"]
    if not isinstance(kernels, list) or not all(
            isinstance(k, list) and len(k) == 3 and isinstance(k[0], str) and all(_finite(v) and v > 0 for v in k[1:])
            for k in kernels):
        return None
    return ComputeRates(**{**entry, **{k: float(entry[k]) for k in floats}, **curves,
                           "kernels": tuple((str(n), float(f), float(b)) for n, f, b in kernels),
                           "conv_grad_curve": tuple(tuple(float(v) for v in p) for p in grad_points)})


def _finite(value: Any) -> bool:
    """Whether a value read from the cache's JSON is a finite number (not a bool, a string or NaN)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _write_cache(path: Path, entries: dict[str, Any]) -> None:
    """Write ``entries`` atomically (a temporary file renamed over the cache); failing to is no error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".compute-", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError, UnboundLocalError):
            os.unlink(tmp)


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    name = platform.processor() or platform.machine()
    return name or hashlib.sha1(platform.platform().encode()).hexdigest()[:12]
