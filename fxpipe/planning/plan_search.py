"""``--plan auto``: stage count x dp replicas x schedule x microbatches on a device budget, screened by a model.

Every combination with ``stages x dp <= devices`` is a candidate: the best partition per stage
count and microbatch count (``stage_count.best_partition``) under each schedule's memory, for each
replica count. A step model (the pipeline's step plus the slowest stage's exposed all-reduce) ranks
them; the caller simulates the best few and picks by simulated throughput, so the model only
screens. docs/internals/plan-search.md says how time-sharing cores and cache are counted.

Pure: plain values in, plain values out; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fxpipe.errors import PlanError
from fxpipe.planning.cost import allreduce_seconds, in_flight, transfer_time
from fxpipe.planning.stage_count import best_partition, pipeline_step

__all__ = ["PLAN_SCHEDULES", "Layers", "PlanCandidate", "plan_candidates", "time_sharing"]

PLAN_SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-h2")
"""The synchronous schedules with one stage per rank that the runtime runs from a plan."""


@dataclass(frozen=True)
class Layers:
    """Per layer: compute (F + B + W, one microbatch), bytes kept per microbatch in flight, static bytes
    (parameters, gradients, optimizer state) and trainable parameter bytes; per cut between layers, bytes."""

    times: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    static_bytes: tuple[float, ...]
    param_bytes: tuple[float, ...]
    cut_bytes: tuple[float, ...]
    # per layer, what its compute gains with every weight read from memory rather than none (() : nothing)
    cold: tuple[float, ...] = ()

    def at(self, scale: float, shift: float) -> tuple[float, ...]:
        """Per layer compute ``scale`` times slower (time-sharing) and reading ``shift`` more of its weights from
        memory (replicas sharing the cache)."""
        if shift and self.cold:
            return tuple(scale * (t + shift * c) for t, c in zip(self.times, self.cold))
        return tuple(t * scale for t in self.times) if scale != 1.0 else self.times


@dataclass(frozen=True)
class PlanCandidate:
    stages: int
    dp: int
    schedule: str
    microbatches: int
    bounds: tuple[int, ...]
    model_s: float  # the pipeline step model plus the slowest stage's all-reduce
    memory_bytes: float  # the most any device holds

    @property
    def devices(self) -> int:
        return self.stages * self.dp

    @property
    def per_step(self) -> int:
        """Microbatches per step over all replicas."""
        return self.dp * self.microbatches

    def throughput(self, step_s: float) -> float:
        """Microbatches per second at a step of ``step_s``."""
        return self.per_step / step_s if step_s > 0 else math.inf


def time_sharing(ranks: int, cores: int | None) -> float:
    """How much slower each rank computes when ``ranks`` ranks share ``cores`` cores (1 when ``cores`` is None):
    ``fxpipe.schedules.simulate.Costs.compute_scale``'s rule.

    >>> time_sharing(4, 2), time_sharing(2, 2), time_sharing(4, None)
    (2.0, 1.0, 1.0)
    """
    return 1.0 if cores is None else max(1.0, ranks / cores)


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def plan_candidates(layers: Layers, devices: int, *, bandwidth: float, latency: float,
                    memory_cap: float | None = None, schedules: Sequence[str] = PLAN_SCHEDULES,
                    microbatches_per_stage: Sequence[int] = (1, 2, 4),
                    cores: int | None = None,
                    cache: Callable[[int], float] | None = None) -> list[PlanCandidate]:
    """Every candidate that fits, best modelled throughput first (ties: fewer devices, then fewer stages).
    ``cores``: the cores the ranks time-share (None: a core each; see the module docstring). ``cache``: per dp, how
    much more of each weight its replicas (copies of the model on one machine's cache) read from memory than
    ``layers.times`` assume; the layers' times move by that times ``layers.cold``.

    Raises PlanError when none fits the cap (naming the least memory any needs) or the budget is below 1.
    """
    if devices < 1:
        raise PlanError(f"--devices must be at least 1 (devices: {devices})")
    if cores is not None and cores < 1:
        raise PlanError(f"--cores must be at least 1 (cores: {cores}); leave it out to model no time-sharing")
    n = len(layers.times)
    cut_s = [transfer_time(b, bandwidth=bandwidth, latency=latency) for b in layers.cut_bytes]
    static, acts, grads = _prefix(layers.static_bytes), _prefix(layers.activation_bytes), _prefix(layers.param_bytes)
    out: list[PlanCandidate] = []
    least = math.inf
    partitions: dict[tuple[int, int, tuple[int, ...], float, float], tuple[tuple[int, ...], float] | None] = {}
    for p in range(1, min(n, devices) + 1):
        if cores is None or cores >= devices:
            replicas = sorted({d for d in (2 ** k for k in range(devices.bit_length())) if p * d <= devices}
                              | {devices // p})
        else:  # time-sharing: the modelled throughput no longer grows with dp past the cores, so try every count
            replicas = list(range(1, devices // p + 1))
        for m in sorted({k * p for k in microbatches_per_stage}):
            for schedule in schedules:
                flights = [f.total for f in in_flight(schedule, p, m)]

                def fits(_p: int, k: int, i: int, j: int, flights: list[int] = flights) -> bool:
                    return memory_cap is None or static[j] - static[i] + flights[k] * (acts[j] - acts[i]) <= memory_cap

                # Time-sharing slows compute and not transfers, so the best cuts depend on the slowdown: one
                # partition per slowdown (one in all without --cores, or with as many cores as devices).
                def slowdown(dp: int, p: int = p) -> tuple[float, float]:
                    return time_sharing(p * dp, cores), cache(dp) if cache is not None else 0.0

                for scale, shift in sorted({slowdown(dp) for dp in replicas}):
                    times = layers.at(scale, shift)
                    key = (p, m, tuple(flights) if memory_cap is not None else (), scale, shift)
                    if key not in partitions:  # without a cap the partition does not depend on the schedule
                        partitions[key] = best_partition(times, cut_s, p, m,
                                                         feasible=fits if memory_cap is not None else None)
                    found = partitions[key]
                    if found is None:
                        # the least memory this (P, m, schedule) needs: its unconstrained plan
                        if memory_cap is not None:
                            free = best_partition(layers.times, cut_s, p, m)
                            assert free is not None
                            spans = list(zip(free[0], free[0][1:]))
                            least = min(least, max(static[j] - static[i] + flights[k] * (acts[j] - acts[i])
                                                   for k, (i, j) in enumerate(spans)))
                        continue
                    bounds, _ = found
                    spans = list(zip(bounds, bounds[1:]))
                    stage_t = [sum(times[i:j]) for i, j in spans]
                    step = pipeline_step(stage_t, [cut_s[b - 1] for b in bounds[1:-1]], m)
                    memory = max(static[j] - static[i] + flights[k] * (acts[j] - acts[i])
                                 for k, (i, j) in enumerate(spans))
                    for dp in replicas:
                        if slowdown(dp) != (scale, shift):
                            continue
                        sync = max(allreduce_seconds(grads[j] - grads[i], dp, bandwidth, latency) for i, j in spans)
                        out.append(PlanCandidate(p, dp, schedule, m, tuple(bounds), step + sync, memory))
    if not out:
        raise PlanError(f"no plan on {devices} devices fits --memory-per-stage {memory_cap:.0f} bytes; the least any "
                        f"needs is {least:.0f} bytes; raise --memory-per-stage or --devices")
    out.sort(key=lambda c: (-c.throughput(c.model_s), c.devices, c.stages, PLAN_SCHEDULES.index(c.schedule)
                            if c.schedule in PLAN_SCHEDULES else 99, c.microbatches))
    return out
