"""The runtime's costs on this machine, measured on live ranks: the link between ranks, compute
contention, gloo's all-reduce, and the runtime's fixed costs per action, message and step.

Every rank calls :func:`calibrate` inside an initialised process group and gets the same
:class:`Calibration` back: the link's latency and bandwidth fitted to ping-pong round trips,
``contention`` (how much slower a rank computes while every rank computes) and
``memory_contention`` (the same for reads from memory). :func:`calibrate_allreduce` fits the ring
all-reduce formula over a group; :func:`measure_overheads` reads the runtime's fixed costs from a
probe pipeline. Each time is the fastest of several runs: interference only adds time.

    cal = calibrate()                                   # on every rank
    simulate(schedule, cal.apply(pipe.schedule_costs()))

docs/internals/runtime-costs.md says how each is measured and applied.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypedDict

import torch
import torch.distributed as dist

from fxpipe.calibration.host import HostTuning
from fxpipe.calibration.probes import Mix
from fxpipe.errors import OptionError, RankFailedError
from fxpipe.plan import RuntimeOverheads
from fxpipe.planning.cost import BUCKET_BYTES, allreduce_seconds, transfer_time
from fxpipe.schedules.simulate import Costs, simulate
from fxpipe.timing import least_disturbed, typical, windows

DEFAULT_SIZES = (4, 4096, 65536, 262144, 1048576, 4194304)  # bytes: 4 B .. 4 MiB
MEMORY_BYTES = 64 << 20  # each tensor of the memory-bound loop: past a typical last-level cache
ALLREDUCE_SIZES = (4, 65536, 1048576, 4194304, 16777216, 26214400)  # bytes: 4 B .. 25 MiB, the largest bucket


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` measured; the same on every rank."""

    latency: float  # seconds per message: the fit's intercept
    bandwidth: float  # bytes per second: one over the fit's slope
    contention: float  # compute time with every rank computing / with one rank computing (median over ranks)
    sizes: tuple[int, ...] = ()  # the ping-pong message sizes, bytes
    one_way: tuple[float, ...] = ()  # seconds per transfer at each size (half the fastest round trip)
    alone: float = 0.0  # seconds of the contention loop on one rank alone (median over ranks)
    together: float = 0.0  # the same with every rank computing at once
    seconds: float = 0.0  # how long calibrate() took
    # An add_ over tensors past the last-level cache with every rank running it / alone (median over ranks): the
    # slowdown of reading from memory while the other ranks do. 1.0: calibrations from before (no such charge).
    memory_contention: float = 1.0

    def transfer(self, nbytes: float) -> float:
        """The fitted seconds to send ``nbytes`` (0 for nothing, as the simulator counts it)."""
        return transfer_time(nbytes, bandwidth=self.bandwidth, latency=self.latency)

    def apply(self, costs: Costs) -> Costs:
        """``costs`` for this machine: link latency and bandwidth set, F, B and W times times ``contention``, and
        the part of each spent reading from memory (``Costs.dram_*``) that much more where ``memory_contention`` is
        the larger: ``t * contention + dram * (memory_contention - contention)``."""
        k, extra = self.contention, max(0.0, self.memory_contention - self.contention)

        def scaled(times: tuple[float, ...], dram: tuple[float, ...]) -> tuple[float, ...]:
            return tuple(t * k + (dram[s] * extra if dram else 0.0) for s, t in enumerate(times))

        return dataclasses.replace(costs, f=scaled(costs.f, costs.dram_f), b=scaled(costs.b, costs.dram_b),
                                   w=scaled(costs.w, costs.dram_w), latency=self.latency, bandwidth=self.bandwidth)

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Calibration:
        """The inverse of :meth:`to_json` (lists back to tuples)."""
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in doc.items()}
        return cls(**fields)

    def summary(self) -> str:
        return (f"link {self.latency * 1e6:.1f} us + {self.bandwidth / 1e9:.3g} GB/s; "
                f"compute {self.contention:.3f}x slower with every rank busy, reads from memory "
                f"{self.memory_contention:.3f}x ({self.seconds:.2f} s to measure)")


def fit_link(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least squares ``t = latency + bytes / bandwidth`` in relative error; returns (latency, bandwidth).

    Relative error weighs each size alike, so the small messages set the latency and the large ones
    the bandwidth. A negative intercept is clamped to 0 (and the slope refitted through the origin).
    """
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise OptionError(f"fit_link needs two or more (size, time) points (got {len(sizes)} sizes, "
                         f"{len(seconds)} times)")
    # Minimise sum(((a + b x - t) / t)^2): weighted least squares with weights 1 / t^2.
    w = [1.0 / (t * t) for t in seconds]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, sizes))
    sy = sum(wi * t for wi, t in zip(w, seconds))
    sxx = sum(wi * x * x for wi, x in zip(w, sizes))
    sxy = sum(wi * x * t for wi, x, t in zip(w, sizes, seconds))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det if det > 0 else 0.0
    latency = (sy - slope * sx) / sw
    if latency < 0:
        latency, slope = 0.0, sxy / sxx
    return latency, (1.0 / slope if slope > 0 else math.inf)


def calibrate(*, sizes: Sequence[int] = DEFAULT_SIZES, group: Any = None, trips: int = 20,
              matmul: int = 256, matmul_reps: int = 20, stream_bytes: int = 8 << 20, stream_reps: int = 4,
              rounds: int = 5, memory_bytes: int = MEMORY_BYTES) -> Calibration:
    """Measure the link (ranks 0 and 1) and compute contention (every rank); collective: call on every rank.

    ``trips`` timed round trips per size (half as many above 1 MiB). The contention loop is
    ``matmul_reps`` products of two ``matmul`` x ``matmul`` float32 matrices and ``stream_reps``
    in-place adds of two ``stream_bytes`` tensors, timed ``rounds`` times alone on each rank and
    ``rounds`` times on all ranks at once; then the memory loop, two in-place adds of two ``memory_bytes``
    tensors, the same way. Well under two seconds on two ranks of an idle machine.
    """
    if not dist.is_initialized():
        raise OptionError("calibrate() needs torch.distributed initialised (torchrun, or init_process_group)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world < 2:
        raise OptionError(f"calibrate() measures the link between two ranks (world size: {world}); run it on two "
                          "or more")
    start = time.perf_counter()
    one_way = _ping_pong(rank, list(sizes), group, trips)
    alone, together = _contention(rank, world, group, matmul, matmul_reps, stream_bytes, stream_reps, rounds)
    mem_alone, mem_together = _contention(rank, world, group, 0, 0, memory_bytes, 2, rounds)
    # Rank 0 measured the link and every rank its own slowdowns: share them.
    n = len(sizes)
    out = torch.zeros(n + 4 * world, dtype=torch.float64)
    if rank == 0:
        out[:n] = torch.tensor(one_way, dtype=torch.float64)
    for k, value in enumerate((alone, together, mem_alone, mem_together)):
        out[n + k * world + rank] = value
    dist.all_reduce(out, group=group)
    one_way = [float(t) for t in out[:n]]
    alones, togethers, mem_alones, mem_togethers = ([float(t) for t in out[n + k * world: n + (k + 1) * world]]
                                                    for k in range(4))
    latency, bandwidth = fit_link(sizes, one_way)
    contention = statistics.median(t / a for t, a in zip(togethers, alones))
    memory = statistics.median(t / a for t, a in zip(mem_togethers, mem_alones))
    return Calibration(latency, bandwidth, contention, tuple(sizes), tuple(one_way), statistics.median(alones),
                       statistics.median(togethers), time.perf_counter() - start, memory)


def _ping_pong(rank: int, sizes: list[int], group: Any, trips: int) -> list[float]:
    """Rank 0's one-way seconds per size against rank 1 (other ranks return zeros): half the fastest round trip.

    ``isend``/``irecv`` as the runtime sends; one warm-up round trip per size, then ``trips``
    timed ones (half as many for messages over 1 MiB, which take long enough to time in fewer).
    """
    times = [0.0] * len(sizes)
    for k, nbytes in enumerate(sizes):
        buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
        dist.barrier(group=group)
        if rank > 1:
            continue
        peer = _global(1 - rank, group)
        n = trips if nbytes <= 2**20 else max(3, trips // 2)
        measured: list[float] = []
        for trip in range(n + 1):
            t0 = time.perf_counter()
            if rank == 0:
                _wait(dist.isend(buf, peer, group=group, tag=k))
                _wait(dist.irecv(buf, peer, group=group, tag=k))
            else:
                _wait(dist.irecv(buf, peer, group=group, tag=k))
                _wait(dist.isend(buf, peer, group=group, tag=k))
            if trip > 0:
                measured.append(time.perf_counter() - t0)
        times[k] = min(measured) / 2
    return times


def _wait(work: Any) -> None:
    if work is not None:  # None only when this rank is outside the group, which calibrate() rules out
        work.wait()


def _global(rank: int, group: Any) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _contention(rank: int, world: int, group: Any, size: int, reps: int, stream_bytes: int, stream_reps: int,
                rounds: int) -> tuple[float, float]:
    """This rank's fastest seconds for the loop alone (others wait) and with every rank running it at once (size 0
    or reps 0: no matmul in it)."""
    gen = torch.Generator().manual_seed(rank)
    a = torch.randn(size, size, generator=gen)
    b = torch.randn(size, size, generator=gen)
    out = torch.empty(size, size)
    acc = torch.zeros(max(1, stream_bytes // 4))
    grad = torch.full_like(acc, 1e-3)

    def loop() -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=out)
        for _ in range(stream_reps):
            acc.add_(grad)
        return time.perf_counter() - t0

    loop()  # warm up
    alone: list[float] = []
    together: list[float] = []
    for _ in range(rounds):  # interleaved, so drift in the machine's load hits both alike
        for r in range(world):
            dist.barrier(group=group)
            if r == rank:
                alone.append(loop())
        dist.barrier(group=group)
        together.append(loop())
    dist.barrier(group=group)
    return min(alone), min(together)


@dataclasses.dataclass(frozen=True)
class AllReduceCalibration:
    """What :func:`calibrate_allreduce` measured over ``dp`` ranks; the same on every rank of the group."""

    latency: float  # seconds per ring step (the fit's intercept / 2(d-1))
    bandwidth: float  # bytes per second between ring neighbours (2(d-1)/d over the fit's slope)
    dp: int  # the group's size
    sizes: tuple[int, ...] = ()  # the all-reduced sizes, bytes
    measured: tuple[float, ...] = ()  # seconds per all-reduce at each size (the slowest rank's typical run)
    seconds: float = 0.0  # how long calibrate_allreduce() took

    def allreduce(self, nbytes: float, dp: int | None = None, bucket_bytes: float = BUCKET_BYTES) -> float:
        """The fitted seconds to all-reduce ``nbytes`` over ``dp`` ranks (default: the measured group's size)."""
        return allreduce_seconds(nbytes, self.dp if dp is None else dp, self.bandwidth, self.latency, bucket_bytes)

    def apply(self, costs: Costs) -> Costs:
        """``costs`` with the all-reduce link measured (dp, bytes and compute times unchanged)."""
        return dataclasses.replace(costs, allreduce_latency=self.latency, allreduce_bandwidth=self.bandwidth)

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> AllReduceCalibration:
        """The inverse of :meth:`to_json` (lists back to tuples)."""
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in doc.items()}
        return cls(**fields)

    def summary(self) -> str:
        return (f"all-reduce over {self.dp} ranks: {self.latency * 1e6:.1f} us per ring step + "
                f"{self.bandwidth / 1e9:.3g} GB/s ({self.seconds:.2f} s to measure)")


def fit_allreduce(sizes: Sequence[float], seconds: Sequence[float], dp: int) -> tuple[float, float]:
    """Least squares (relative error) of the ring formula over ``dp`` ranks; returns (latency, bandwidth).

    The ring is a line in ``x = 2(d-1)/d x bytes`` with intercept ``2(d-1) x latency``, so this is
    :func:`fit_link` on those coordinates.

    >>> lat, bw = fit_allreduce([0, 1e6], [4e-5, 4e-5 + 1e6 / 1e9], 2)   # 2 ranks: 2 x 20 us + bytes / 1 GB/s
    >>> round(lat * 1e6, 6), round(bw / 1e9, 6)
    (20.0, 1.0)
    """
    if dp < 2:
        raise OptionError(f"an all-reduce fit needs a group of 2 or more ranks (dp: {dp})")
    steps = 2 * (dp - 1)
    intercept, bandwidth = fit_link([steps / dp * x for x in sizes], seconds)
    return intercept / steps, bandwidth


def calibrate_allreduce(*, sizes: Sequence[int] = ALLREDUCE_SIZES, group: Any = None, trips: int = 12,
                        warmup: int = 2, window: int = 4) -> AllReduceCalibration:
    """Time gloo's all-reduce over ``group`` (default: the world) at ``sizes`` and fit the ring; collective.

    Each size is all-reduced ``warmup`` times untimed, then ``trips`` times (a quarter as many above
    4 MiB), each after a barrier; a rank keeps the median of its least disturbed window of ``window`` trips (a
    step waits for its typical all-reduce, as for its typical message: :func:`channel_one_way`) and the group takes
    the slowest rank's (an all-reduce ends when its last rank has its result). About 0.5 s for two idle ranks.

    Not the fastest trip: a small all-reduce's fastest can be half its typical time.
    """
    if not dist.is_initialized():
        raise OptionError("calibrate_allreduce() needs torch.distributed initialised (torchrun, or "
                          "init_process_group)")
    world = dist.get_world_size(group)
    if world < 2:
        raise OptionError(f"calibrate_allreduce() measures an all-reduce between ranks (group size: {world}); run "
                          "it on two or more")
    start = time.perf_counter()
    mine = []
    for nbytes in sizes:
        buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        n = trips if nbytes <= 4 << 20 else max(2, trips // 4)
        for _ in range(warmup):
            _wait(dist.all_reduce(buf, group=group, async_op=True))
        runs = []
        for _ in range(n):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            _wait(dist.all_reduce(buf, group=group, async_op=True))
            runs.append(time.perf_counter() - t0)
        mine.append(least_disturbed(windows(runs, window)))
    slowest = torch.tensor(mine, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    measured = [float(t) for t in slowest]
    latency, bandwidth = fit_allreduce(sizes, measured, world)
    return AllReduceCalibration(latency, bandwidth, world, tuple(sizes), tuple(measured), time.perf_counter() - start)


# -- the runtime's fixed costs ------------------------------------------------------------------------


def channel_one_way(rank: int, trips: int = 60, numel: int = 16, window: int = 10, *,
                    yield_after_send: bool = False) -> float:
    """Rank 0's one-way seconds of a small message through the runtime's :class:`Channel` (receives
    posted ahead, ``isend``, ``wait``: the path a pipeline's activations and gradients take), ranks 0 and 1;
    collective on those two. The median of a window of ``window`` round trips, not the fastest trip: a step
    waits for its typical message; the least disturbed window, not all of them: another job on the machine
    only ever adds time (:func:`least_disturbed`)."""
    from fxpipe.runtime.channel import Channel

    ch = Channel(torch.device("cpu"), yield_after_send=yield_after_send)
    buf = torch.zeros(numel)

    def failed(exc: Exception, *_: object) -> BaseException:
        return exc

    trips_s: list[float] = []
    for trip in range(trips + 2):
        t0 = time.perf_counter()
        item = ch.recv((numel,), torch.float32, 1 - rank, 7)
        if rank == 0:
            ch.send(buf, 1, 7)
            ch.poll()
            ch.wait(item, failed)
        else:
            ch.send(ch.wait(item, failed), 0, 7)
            ch.poll()
        if trip >= 2:
            trips_s.append(time.perf_counter() - t0)
    ch.flush(failed)
    return least_disturbed(windows(trips_s, window)) / 2


def optimizer_costs(*, momentum: float = 0.0, counts: tuple[int, int] = (1, 16), numel: int = 64, reps: int = 20,
                    window: int = 10, clock: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """(seconds per step, seconds per parameter tensor) of SGD (``lr``, ``momentum``) as ``fxpipe run`` builds it
    (``OptimizerSpec``: fused where torch has the kernel), as a pipeline runs it: cold, after other work. The line
    through the step times over ``counts`` small tensors (``numel`` floats each, so that the arithmetic is nothing);
    before each step, a 256 x 256 matmul and an in-place pass over 4 MiB (what an action leaves behind); each
    count's time the least disturbed window's median.
    Cold, as inside a step, the same steps take several times what they take back to back."""
    from fxpipe.runtime.optim import OptimizerSpec

    a, evict = torch.randn(256, 256), torch.randn(1 << 20)
    times = []
    for n in counts:
        params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(n)]
        for p in params:
            p.grad = torch.randn(numel)
        opt = OptimizerSpec("sgd", lr=1e-3, momentum=momentum)(params)
        runs = []
        for k in range(reps + 2):
            torch.mm(a, a)
            evict.mul_(1.0)
            t0 = clock()
            opt.step()
            if k >= 2:
                runs.append(clock() - t0)
        times.append(least_disturbed(windows(runs, window)))
    slope = max(0.0, (times[1] - times[0]) / (counts[1] - counts[0]))
    return max(0.0, times[0] - counts[0] * slope), slope


class _Round(NamedTuple):
    """One round of the calibration pipeline's steps on this rank (:func:`overheads_on_ranks`), per step: each
    action's overhead, the step's seconds, the losses' and the sends' seconds."""

    actions: list[list[float]]
    walls: list[float]
    losses: list[list[float]]
    sends: list[list[float]]


def probe_pipeline(model: torch.nn.Module, x: torch.Tensor, rates: Any) -> Any:
    """``model`` compiled at 2 stages with the compute ``rates``, as ``fxpipe.compile(model, (x,), stages=2,
    tracer="fx", compute=rates, ...)`` would: the passes assembled here (``fxpipe.passes.assemble``), so that the
    calibration does not reach up into the compile API."""
    from fxpipe.graphs.convention import flatten_inputs
    from fxpipe.passes import run_steps
    from fxpipe.passes.assemble import build_steps, pipeline_from_root, plan_from_root
    from fxpipe.plan import CompileOptions, Provenance, fxpipe_version

    options = CompileOptions(stages=2, tracer="fx", compute=rates, device_flops=rates.gemm_flops,
                             device_mem_bw=rates.mem_bw)
    root, history = run_steps(build_steps(model, (x,), options), verify_each=False)
    provenance = Provenance(model=None, tracer=str(root.meta.get("fxpipe_tracer")), torch_version=torch.__version__,
                            fxpipe_version=fxpipe_version(), build=None, profiled=False, profile_threads=None)
    flat = flatten_inputs(root.meta.get("fxpipe_in_spec"), (x,), {})
    return pipeline_from_root(root, history, plan_from_root(root, options, provenance, flat))


class LinkOptions(TypedDict, total=False):
    """The keyword arguments of :func:`calibrate` that :func:`overheads_on_ranks` passes on for the bare link."""

    trips: int
    rounds: int


QUICK_OVERHEADS = {"steps": 20, "rounds": 3}  # the quick calibration's steps and rounds (the full: 40 and 5)
QUICK_LINK: LinkOptions = {"trips": 10, "rounds": 3}  # and its link's (calibrate's defaults: 20 and 5)


def overheads_on_ranks(rates: Any, *, host: HostTuning | None = None, steps: int = 40, rounds: int = 5,
                       warmup: int = 1, link_options: LinkOptions | None = None) -> tuple[float, ...]:
    """(action, message, step, loss, send, optimizer, optimizer_tensor, optimizer_tensor_momentum) seconds measured on
    ranks 0 and 1 of a world of two; collective.

    The bare link (:func:`calibrate`), a message through the runtime's channel (:func:`channel_one_way`),
    then ``steps`` steps of a :class:`PipelineRuntime` on :class:`fxpipe.calibration.probes.Mix` (one of each kind
    of op the zoo's graphs hold, at sizes where the arithmetic is negligible: the model the compute calibration
    times its host work on) compiled at 2 stages with ``rates`` (so its estimated graph times are the ones a user's
    plan gets). Inside each action the loss and its gradient (the last stage's F) and each ``isend`` are timed where
    they run; an action's overhead is its measured time (graphs, bookkeeping) less its estimated time, less those
    two. The loss's and the send's are the median over a step's losses or sends, from the least disturbed step
    (:func:`least_disturbed`); the action's is the round's typical one (:func:`typical`); the median over the two
    ranks (the loss: its rank's). A step's cost is what the rest leaves of the pipeline's measured step
    (:func:`step_residual`), over the least disturbed window of 10 steps. The optimizer step's costs per step and
    per tensor are :func:`optimizer_costs`' (the small pipeline's own steps keep their caches warm).

    The pipeline runs ``warmup`` rounds of ``steps`` steps unmeasured, then ``rounds`` rounds of ``steps`` measured
    ones, and the action's cost and the step's are each the median over the rounds: one round's reading is as noisy
    as a whole calibration's. ``host``: what this rank's runtime changes about the process (None: nothing).
    ``link_options``: :func:`calibrate`'s keyword arguments for the bare link (None: its defaults).
    """
    from fxpipe.runtime.executor import PipelineRuntime
    from fxpipe.runtime.optim import OptimizerSpec

    host = HostTuning() if host is None else host  # None: this process as it is
    rank = dist.get_rank()
    link = calibrate(**(link_options or LinkOptions()))
    one_way = channel_one_way(rank, yield_after_send=host.yields_after_send(None))
    torch.manual_seed(0)
    model = Mix()
    x = torch.randn(2, 4, 2, 2)
    pipe = probe_pipeline(model, x, rates)
    rt = PipelineRuntime(pipe, loss_fn=torch.nn.functional.mse_loss, example_inputs=(x,),
                         optimizer=OptimizerSpec("sgd", lr=1e-3), host=host)
    m = rt.schedule.num_microbatches
    inputs, target = torch.randn(2 * m, 4, 2, 2), torch.randn(2 * m, 4)
    costs = pipe.plan.stages
    est = {"F": [c.f for c in costs], "B": [c.b for c in costs], "W": [c.w for c in costs],
           "BW": [c.b + c.w for c in costs]}
    inside: dict[str, list[tuple[int, float]]] = {"loss": [], "send": []}  # (action index in the step, seconds)

    def timed(label: str, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            if label != "loss" or out is not None:  # maybe_loss computes the loss once its outputs exist
                inside[label].append((len(rt.events), time.perf_counter() - t))
            return out
        return run

    rt.core.maybe_loss = timed("loss", rt.core.maybe_loss)  # type: ignore[method-assign]
    rt.channel.send = timed("send", rt.channel.send)  # type: ignore[method-assign]

    def one_round(skip: int) -> _Round:
        """``steps`` steps: per step after the first ``skip``, each action's overhead, the step's seconds on this
        rank (as ``fxpipe run`` times a step), the losses' and the sends' seconds."""
        actions: list[list[float]] = []
        walls: list[float] = []
        losses: list[list[float]] = []
        sends: list[list[float]] = []
        pending = None
        for k in range(steps):
            for spent in inside.values():
                spent.clear()
            t0 = time.perf_counter()
            now = rt.step_async((inputs,), target)
            wall = time.perf_counter() - t0
            if pending is not None:
                pending.wait()
            pending = now
            if k < skip:
                continue
            events = rt.events
            walls.append(wall)
            apart = [0.0] * len(events)  # each action's loss and sends, timed apart
            for spent in inside.values():
                for j, seconds in spent:
                    apart[j] += seconds
            actions.append([(end - start) - est[a.kind.value][a.stage] - apart[j]
                            for j, (a, start, end) in enumerate(events)])
            losses.append([seconds for _, seconds in inside["loss"]])
            sends.append([seconds for _, seconds in inside["send"]])
        assert pending is not None
        pending.wait()
        return _Round(actions, walls, losses, sends)

    for _ in range(warmup):
        one_round(steps)
    measured = [one_round(2 if r == 0 and not warmup else 0) for r in range(rounds)]
    opt_step, per_tensor = optimizer_costs()
    losses = [step for one in measured for step in one.losses]
    sends = [step for one in measured for step in one.sends]
    # The action's cost at the typical step, not the least disturbed one: these small host costs move more from
    # step to step than the GEMM loop whose spread (ComputeRates.sustained) scales the estimates.
    walls = [wall for one in measured for wall in one.walls]
    mine = torch.tensor([one_way, least_disturbed(losses) if any(losses) else 0.0, least_disturbed(sends), opt_step,
                         per_tensor, optimizer_costs(momentum=0.9)[1], *(typical(one.actions) for one in measured),
                         *walls], dtype=torch.float64)
    both = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(both, mine)
    one_way = float(both[0][0])  # rank 0 timed the round trips
    loss = max(0.0, max(float(t[1]) for t in both))  # the last stage's rank measured it (the others: 0)
    send = max(0.0, statistics.median(float(t[2]) for t in both))
    optimizer = [statistics.median(float(t[k]) for t in both) for k in (3, 4, 5)]
    message = max(0.0, one_way - link.latency)
    # Per round, the action's cost (the median over the two ranks) and the step's residual
    action_at = [max(0.0, statistics.median(float(t[6 + r]) for t in both)) for r in range(rounds)]
    residuals = []
    at = 6 + rounds  # where the round's steps start in what the ranks gathered
    for r, one in enumerate(measured):
        # A step as fxpipe run times it, the slowest rank's; the median of the least disturbed window of 10 steps
        slowest = [max(float(t[at + k]) for t in both) for k in range(len(one.walls))]
        at += len(one.walls)
        residuals.append(step_residual(
            least_disturbed(windows(slowest, 10)), pipe.plan, rt.schedule, link, rates,
            RuntimeOverheads(action_at[r], message, 0.0, loss=loss, send=send, optimizer=optimizer[0],
                             optimizer_tensor=optimizer[1], optimizer_tensor_momentum=optimizer[2])))
    return (statistics.median(action_at), message, statistics.median(residuals), loss, send, *optimizer)


def step_residual(measured: float, plan: Any, schedule: Any, link: Calibration, rates: Any,
                  overheads: RuntimeOverheads) -> float:
    """The step cost that makes the calibration pipeline's simulated step equal its ``measured`` one: ``measured``
    less the makespan ``fxpipe run`` would simulate for ``plan`` on ``schedule`` with ``overheads`` (whose step is
    0) as it reads them from the cache (scaled by ``rates.sustained``), the ``link`` and ``rates``' optimizer
    step; in the cache's units (over ``rates.sustained``), never below 0. Whatever the other costs leave out (a
    step's first message behind the previous loss's all-reduce, say) lands here, not nowhere."""
    scaled = overheads.scaled(rates.sustained)
    costs = link.apply(Costs.from_plan(plan, scaled)).with_optimizer("sgd", rates.mem_bw, scaled)
    return max(0.0, measured - simulate(schedule, costs).makespan) / rates.sustained


def _thread_lock_for_progress_bars() -> None:
    """torch.fx's ``Interpreter`` draws a tqdm progress bar where tqdm is installed (``torch.hub.tqdm``), and tqdm's
    first bar makes a multiprocessing lock: a named semaphore that a rank leaving with ``os._exit`` leaves registered
    with its parent's resource tracker, which then printed "There appear to be 2 leaked semaphore objects to clean
    up at shutdown" on ``fxpipe compile``'s stderr after the runtime's calibration. A thread lock serves a rank of
    one process."""
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type information (no py.typed)
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def _overheads_worker(rank: int, init: str, rates: Any, threads: int, out: str, host: HostTuning,
                      full: bool = True) -> None:
    import os
    import sys

    _thread_lock_for_progress_bars()
    torch.set_num_threads(threads)
    host.pin(rank, 2)  # as fxpipe run's ranks run: before the process group, so gloo's threads start there too
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        measured = (overheads_on_ranks(rates, host=host) if full
                    else overheads_on_ranks(rates, host=host, link_options=QUICK_LINK, **QUICK_OVERHEADS))
        if rank == 0:  # whole or not at all: the parent reads it even where a rank then aborts in gloo's teardown
            with open(out + ".part", "w") as f:
                f.write(" ".join(repr(v) for v in measured))
            os.replace(out + ".part", out)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Every result is written: leave without gloo's teardown, which can abort the process ("terminate called
    # without an active exception", SIGABRT: pytorch/pytorch#179291)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def measure_overheads(rates: Any, *, threads: int = 1, machine: str = "", host: HostTuning | None = None,
                      full: bool | None = None) -> RuntimeOverheads:
    """The runtime's fixed costs on this machine: two local ranks (processes, gloo), ``threads`` threads each,
    run :func:`overheads_on_ranks` with the compute ``rates`` (``ComputeRates``); a few seconds, most of it
    starting the two processes and compiling the probe pipeline there. ``host``: what those ranks change about
    their own processes (default: what ``fxpipe run``'s ranks do, :meth:`HostTuning.for_runs`); the calling process
    is left as it is. ``full``: every step and round, else ``QUICK_OVERHEADS`` and ``QUICK_LINK`` (default: as the
    ``rates`` were measured, ``fxpipe.calibration.compute.is_full``)."""
    from fxpipe.calibration.compute import QUICK_MARK, is_full

    host = HostTuning.for_runs() if host is None else host
    full = is_full(getattr(rates, "machine", "")) if full is None else full
    import os
    import tempfile

    import torch.multiprocessing as mp

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fxpipe-overheads-") as tmp:
        out = os.path.join(tmp, "result")
        try:
            mp.start_processes(_overheads_worker, args=(f"file://{tmp}/pg", rates, threads, out, host, full),
                               nprocs=2, start_method="spawn")
        except mp.ProcessExitedException as e:  # a rank died: after rank 0 wrote every result, only in teardown
            if not os.path.exists(out):
                raise RankFailedError(f"the runtime's calibration (two local ranks running a small pipeline) failed: "
                                      f"{e}; re-run, or set FXPIPE_CALIBRATION=off for the fixed cost model") from e
        with open(out) as f:
            action, message, step, loss, send, optimizer, per_tensor, per_tensor_momentum = (
                float(v) for v in f.read().split())
    took = f"{time.perf_counter() - start:.1f} s{'' if full else QUICK_MARK}"
    return RuntimeOverheads(action, message, step, threads, f"{machine}|{took}", loss, send, optimizer, per_tensor,
                            per_tensor_momentum)
