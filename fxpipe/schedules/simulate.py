"""Validate and simulate schedules: dependencies, matched sends, no deadlock; then an event simulation in time.

Both walk every rank's action list in order, running an action once what it depends on has run;
when no rank can move the schedule deadlocks, and the error shows the grid with each rank's stuck
action marked. In simulated time a message takes ``latency + bytes / bandwidth`` on its own link
(one per ordered pair of ranks, one message at a time, as gloo queues a pair's sends); dp replicas
add one all-reduce lane per rank; tied weights add a blocking all-reduce at the step's end.
docs/internals/simulator.md draws the rules and the two "hidden" measures.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import math
import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fxpipe.errors import OptionError, ScheduleError
from fxpipe.plan import Plan
from fxpipe.planning.cost import (
    BUCKET_BYTES,
    allreduce_bucket_seconds,
    allreduce_seconds,
    optimizer_step_seconds,
    recomputed,
    transfer_time,
)
from fxpipe.report import Report
from fxpipe.schedules.ir import Action, Kind, Schedule, with_communication
from fxpipe.schedules.versions import POLICIES, PREDICT, copies

PREDICTION_TRAFFIC: dict[str, int] = {"momentum": 3, "adam": 9, "adamw": 9}
"""Bytes one weight prediction reads and writes per parameter byte (``fxpipe.runtime.weights``): momentum SGD
``W - ahead * lr * buf`` in one pass (3); Adam first makes ``exp_avg / (sqrt(v_hat) + eps)`` in place (6)."""


@dataclass(frozen=True)
class Costs:
    """Per-stage times (any unit, e.g. seconds) and bytes for one microbatch."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    send_bytes: tuple[float, ...] = ()  # bytes of stage s's output (and of the gradient sent back for it)
    held_fb: tuple[float, ...] = ()  # bytes stage s keeps from F until B (or BW)
    held_bw: tuple[float, ...] = ()  # bytes stage s keeps from B until W
    latency: float = 0.0
    bandwidth: float = math.inf
    # Data parallelism: dp replicas of every stage, each stage's gradients all-reduced over its replicas.
    dp: int = 1
    grad_bytes: tuple[float, ...] = ()  # bytes of stage s's gradients (its trainable parameters)
    grad_tensors: tuple[int, ...] = ()  # how many parameter tensors stage s has (its optimizer's per-tensor work)
    allreduce_latency: float = 0.0  # the ring's per-step latency (seconds)
    allreduce_bandwidth: float = math.inf  # the ring's bytes per second between neighbours
    allreduce_s: tuple[float, ...] = ()  # seconds of stage s's whole all-reduce: overrides bytes and link
    bucket_bytes: float = BUCKET_BYTES
    # Time-sharing: pp x dp ranks on this many cores run F, B and W ranks / cores times slower. An
    # approximation: it charges every rank as if all were computing all the time (idle ranks free
    # their core in fact), so it overstates the bubble-heavy schedules' compute. None: off.
    cores: int | None = None
    # Seconds of stage s's optimizer step, after its all-reduce and its last compute (``with_optimizer``). Empty:
    # the step ends at the last compute or all-reduce, as schedules are usually compared.
    optimizer_s: tuple[float, ...] = ()
    # The runtime's fixed costs, as ``fxpipe.calibration.runtime_costs.RuntimeOverheads`` measures them on this machine
    # (``with_overheads``; 0: none, as schedules are usually compared): seconds each compute action (F, B, W, BW)
    # costs beyond its graphs' time, each message beyond the link's latency, and each rank's step beyond its
    # actions (splitting the batch, posting receives, flushing sends, the loss's all-reduce).
    action_s: float = 0.0
    message_s: float = 0.0
    step_s: float = 0.0
    # Weights tied across stages (GPT's token embedding and LM head): per tied parameter, the stages holding it and
    # its bytes. The ranks holding it (two or more) sum its gradient with a blocking all-reduce once every one of them
    # has finished its compute and its replicas' all-reduce (at the all-reduce's link), then step their optimizers.
    tied: tuple[tuple[tuple[int, ...], float], ...] = ()
    # Seconds a message costs its sender's host (``isend``), after the action that produced it: the rank's next
    # action starts that much later and the message leaves then. 0: sends take no time, as schedules are usually
    # compared.
    send_s: float = 0.0
    # Per stage, what a W costs inside a run of adjacent Ws the schedule batches (``Schedule.batch_w``), as a fraction
    # of its time alone: the runtime measures it (``PipelineRuntime.batched_w_ratio``), and a profiled plan records
    # it (``StageCost.w_batched``). Empty: 1, no gain assumed.
    w_batched: tuple[float, ...] = ()
    # Per stage, the seconds of its F, B and W spent reading its weights (and, in W, its gradients) from memory rather
    # than the caches, as its plan's calibrated rates assume them (``from_plan``: the weights' share the cache cannot
    # hold, ``ComputeRates.cold``, at ``mem_bw``). Every rank reading memory at once slows that part more than the
    # rest (``fxpipe.calibration.runtime_costs.Calibration.apply``: ``memory_contention``). Empty: none.
    dram_f: tuple[float, ...] = ()
    dram_b: tuple[float, ...] = ()
    dram_w: tuple[float, ...] = ()
    # Per stage, the bytes of one microbatch's inputs: all a stage that recomputes its forward keeps from F to B
    # (``recomputing``). Empty: not known (a plan written before recomputation).
    held_in: tuple[float, ...] = ()
    # The stages that recompute their forward just before B (``recomputing``: already in ``b`` and ``held_fb``).
    recompute: tuple[int, ...] = ()
    # Asynchronous schedules (``with_weights``): the weight policy, and per stage the seconds one copy of its weights
    # takes under it (a stash snapshot, or one prediction), charged to the actions that make them (``charged``).
    weights: str = ""
    copy_s: tuple[float, ...] = ()
    # Each rank's W's on a second lane (``PipelineRuntime(w_lane=True)``): in the schedule's order, at full speed while
    # the rank's main lane waits, at half speed each while both compute (the two share the rank's core); nothing waits
    # for a W but the step's end. False: one lane.
    w_lane: bool = False

    def recomputing(self, stages: Sequence[int]) -> Costs:
        """These costs with ``stages`` recomputing their forward: each B runs F first (B's time plus F's, and F's
        weight reads again) and F keeps only the stage's inputs (``held_in``) until B; B to W is unchanged. Apply it
        before ``with_runtime``, whose loss time is no part of the recomputed F."""
        again = tuple(sorted(set(stages) | set(self.recompute)))
        if not again or again == self.recompute:
            return self
        if not self.held_in:
            raise OptionError("these costs do not know the stages' input bytes (a plan written before recomputation); "
                              "recompile the plan with this fxpipe")
        new = [s for s in again if s not in self.recompute]
        b = list(self.b)
        dram_b = list(self.dram_b)
        for s in new:
            b[s] += self.f[s]
            if dram_b:
                dram_b[s] += self.dram_f[s]
        return dataclasses.replace(self, b=tuple(b), dram_b=tuple(dram_b), recompute=again,
                                   held_fb=recomputed(self.held_fb or (1.0,) * len(self.f), self.held_in, new))

    def with_overheads(self, action_s: float, message_s: float, step_s: float, send_s: float = 0.0) -> Costs:
        """These costs with the runtime's fixed costs per compute action, per message (its latency, and its
        sender's host time) and per rank's step."""
        return dataclasses.replace(self, action_s=action_s, message_s=message_s, step_s=step_s, send_s=send_s)

    def with_optimizer(self, optimizer: str, mem_bw: float, overheads: Any = None) -> Costs:
        """These costs with each stage's optimizer step: a memory-bound pass over its parameters at ``mem_bw``; with
        ``overheads`` (``fxpipe.plan.RuntimeOverheads``), plus the step's host time as the runtime runs it: a cost
        per step and one per parameter tensor (``grad_tensors``), for a stage that has parameters."""
        per_step = getattr(overheads, "optimizer", 0.0)
        per_tensor = getattr(overheads, "optimizer_tensor_momentum" if optimizer == "momentum" else "optimizer_tensor",
                             0.0)
        tensors = self.grad_tensors or (0,) * len(self.grad_bytes)
        return dataclasses.replace(self, optimizer_s=tuple(
            optimizer_step_seconds(g, optimizer, mem_bw) + (per_step + per_tensor * n if g > 0 else 0.0)
            for g, n in zip(self.grad_bytes, tensors)))

    def with_weights(self, policy: str, optimizer: str, mem_bw: float) -> Costs:
        """These costs with an asynchronous schedule's weight copies under ``policy`` (``fxpipe.schedules.versions``):
        a memory-bound pass over the stage's parameters (``grad_bytes``) at ``mem_bw`` per copy, 2 bytes per byte for
        a stash snapshot (read the live weights, write the spare), ``PREDICTION_TRAFFIC`` for a prediction; ``stale``
        copies nothing. Synchronous schedules ignore it."""
        if policy not in POLICIES:
            raise OptionError(f"unknown weight policy {policy!r}; use one of {', '.join(POLICIES)}")
        traffic = 2 if policy == "stash" else PREDICTION_TRAFFIC.get(optimizer, 0) if policy in PREDICT else 0
        if policy in PREDICT and not traffic:
            raise OptionError(f"no prediction-time model for optimizer {optimizer!r} (known: "
                              f"{', '.join(PREDICTION_TRAFFIC)}); pick one of those")
        return dataclasses.replace(self, weights=policy, copy_s=tuple(traffic * g / mem_bw for g in self.grad_bytes))

    @classmethod
    def uniform(cls, num_stages: int, f: float, b: float, w: float) -> Costs:
        """Every stage F, B, W in the given times; free transfers; one unit of memory per microbatch in flight."""
        n = num_stages
        return cls((f,) * n, (b,) * n, (w,) * n, (0.0,) * n, (1.0,) * n, (1.0,) * n)

    @classmethod
    def from_plan(cls, plan: Plan, overheads: Any = None) -> Costs:
        """The plan's per-stage costs and link, for one microbatch; with ``overheads`` (anything with ``action``,
        ``message`` and ``step`` seconds, and optionally ``loss``: the runtime's fixed costs, ``fxpipe.calibration.
        compute.plan_overheads(plan)`` for a plan estimated with this machine's calibrated rates), added as
        :meth:`with_overheads` does, and ``loss`` to the last stage's F. The callers above the passes look them up;
        this layer reads no cache."""
        st = plan.stages
        grads = tuple(float(sum(layer.param_bytes for layer in plan.layers[c.first_layer:c.end_layer])) for c in st)
        tensors = tuple(len({p for layer in plan.layers[c.first_layer:c.end_layer] for p in layer.params}) for c in st)
        dram_f, dram_b, dram_w = _weight_reads(plan, grads)
        costs = cls(tuple(c.f for c in st), tuple(c.b for c in st), tuple(c.w for c in st),
                   tuple(c.send_bytes for c in st), tuple(c.held_fb for c in st), tuple(c.held_bw for c in st),
                   plan.link.latency, plan.link.bandwidth, dp=plan.mesh.dp, grad_bytes=grads, grad_tensors=tensors,
                   allreduce_latency=plan.link.latency, allreduce_bandwidth=plan.link.bandwidth,
                   w_batched=tuple(c.w_batched for c in st) if any(c.w_batched != 1.0 for c in st) else (),
                   held_in=tuple(float(c.held_in or 0.0) for c in st) if all(c.held_in is not None for c in st) else (),
                   dram_f=dram_f, dram_b=dram_b, dram_w=dram_w)
        return costs.with_runtime(overheads)

    def with_runtime(self, overheads: Any) -> Costs:
        """These costs with the runtime's fixed costs ``overheads`` (``action``, ``message``, ``step`` and optionally
        ``loss`` seconds; None: none), as :meth:`from_plan` and the planners add them: ``loss`` to the last stage's
        F, the rest as :meth:`with_overheads`."""
        if overheads is None:
            return self
        # the last stage's F also computes the loss and its gradient
        costs, loss = self, getattr(overheads, "loss", 0.0)
        if loss:
            costs = dataclasses.replace(costs, f=(*costs.f[:-1], costs.f[-1] + loss))
        return costs.with_overheads(overheads.action, overheads.message, overheads.step,
                                    getattr(overheads, "send", 0.0))

    def time(self, action: Action) -> float:
        s = action.stage
        took = {Kind.F: self.f[s], Kind.B: self.b[s], Kind.W: self.w[s],
                Kind.BW: self.b[s] + self.w[s]}.get(action.kind)
        return 0.0 if took is None else took + self.action_s

    def transfer(self, stage: int) -> float:
        """Seconds to send stage ``stage``'s output (or the gradient for it) over one link (with ``message_s``)."""
        nbytes = self.send_bytes[stage] if self.send_bytes else 0.0
        return transfer_time(nbytes, bandwidth=self.bandwidth, latency=self.latency + self.message_s)

    def allreduce_buckets(self, stage: int) -> tuple[float, ...]:
        """Seconds of each of stage ``stage``'s all-reduce buckets, in order (one when ``allreduce_s`` is given)."""
        if self.dp == 1:
            return ()
        if self.allreduce_s:
            return (self.allreduce_s[stage],) if self.allreduce_s[stage] > 0 else ()
        nbytes = self.grad_bytes[stage] if self.grad_bytes else 0.0
        return allreduce_bucket_seconds(nbytes, self.dp, self.allreduce_bandwidth, self.allreduce_latency,
                                        self.bucket_bytes)

    def allreduce(self, stage: int) -> float:
        """Seconds to all-reduce stage ``stage``'s gradients over its ``dp`` replicas (0 for dp = 1)."""
        return float(sum(self.allreduce_buckets(stage)))

    def compute_scale(self, num_ranks: int) -> float:
        """How much slower F, B and W run with ``num_ranks`` x dp ranks time-sharing ``cores`` (1 when off)."""
        if self.cores is None:
            return 1.0
        return max(1.0, num_ranks * self.dp / self.cores)


@dataclass(frozen=True)
class Event:
    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class AllReduceEvent:
    """One gradient bucket of ``stage`` all-reduced on ``rank``'s lane (every replica of the rank alike)."""

    rank: int
    stage: int
    bucket: int
    start: float
    end: float


@dataclass(frozen=True)
class RankStats:
    rank: int
    start: float
    end: float  # the rank's last compute end
    busy: float
    peak_memory: float  # bytes (or units with uniform costs) held from F to B and from B to W
    peak_in_flight: int  # microbatches with F done and their last backward action not done
    bytes_sent: float
    allreduce_s: float = 0.0  # seconds its all-reduce lane was busy
    allreduce_end: float = 0.0  # when its last bucket was reduced (0 with nothing to reduce)
    exposed_s: float = 0.0  # all-reduce seconds past ``end``: what the rank waits for before its optimizer step
    exposed_step_s: float = 0.0  # all-reduce seconds past the last compute of any rank: what lengthens the step
    optimizer_s: float = 0.0  # its stages' optimizer steps, once compute and all-reduce are done
    fixed_s: float = 0.0  # the runtime's fixed cost of the rank's step outside its actions (``Costs.step_s``)
    tied_end: float = 0.0  # when its weights tied with other ranks' are summed with theirs (``Costs.tied``; 0: none)

    @property
    def span(self) -> float:
        return self.end - self.start

    @property
    def step_end(self) -> float:
        """When the rank's step is done: compute, all-reduce and its tied weights' sums, then its optimizer step."""
        return max(self.end, self.allreduce_end, self.tied_end) + self.optimizer_s + self.fixed_s

    @property
    def hidden_fraction(self) -> float:
        """Share of the all-reduce that ran while the rank still computed (1 when there is none)."""
        return 1.0 if self.allreduce_s == 0 else 1.0 - self.exposed_s / self.allreduce_s

    @property
    def bubble(self) -> float:
        """Idle fraction of this rank's own span."""
        return 0.0 if self.span == 0 else 1.0 - self.busy / self.span


@dataclass(frozen=True)
class SimResult:
    schedule: str
    makespan: float  # first action's start to the last rank's step end (compute and all-reduce), over all ranks
    max_stage_span: float  # the longest single rank's first start to its step end
    ranks: tuple[RankStats, ...]
    events: tuple[Event, ...]
    staleness: dict[int, int] = field(default_factory=dict)  # stage -> most weight updates between a mb's F and B
    # (stage, microbatch) -> weight updates between that microbatch's F and its backward (asynchronous schedules)
    staleness_per_microbatch: dict[tuple[int, int], int] = field(default_factory=dict)
    dp: int = 1  # replicas of every rank; ``ranks`` are the pipeline positions, each the same on every replica
    allreduce: tuple[AllReduceEvent, ...] = ()  # every rank's all-reduce lane, bucket by bucket

    @property
    def allreduce_s(self) -> float:
        """All-reduce seconds of one replica, summed over its ranks."""
        return sum(r.allreduce_s for r in self.ranks)

    @property
    def exposed_s(self) -> float:
        """All-reduce seconds past each rank's last compute, summed over one replica's ranks."""
        return sum(r.exposed_s for r in self.ranks)

    @property
    def hidden_fraction(self) -> float:
        """1 - exposed / total over all ranks: how much all-reduce ran while its own rank computed (1 when none)."""
        return 1.0 if self.allreduce_s == 0 else 1.0 - self.exposed_s / self.allreduce_s

    @property
    def step_hidden_fraction(self) -> float:
        """1 - exposed_step / total over all ranks: how much ran while any rank computed (1 when none)."""
        return 1.0 if self.allreduce_s == 0 else 1.0 - sum(r.exposed_step_s for r in self.ranks) / self.allreduce_s

    @property
    def compute_makespan(self) -> float:
        """The makespan without waiting for the all-reduce: the first compute start to the last compute end."""
        active = [r for r in self.ranks if r.end > r.start]
        return (max(r.end for r in active) - min(r.start for r in active)) if active else 0.0

    def allreduce_stage_s(self, num_stages: int) -> tuple[float, ...]:
        """Per stage, its all-reduce seconds."""
        out = [0.0] * num_stages
        for e in self.allreduce:
            out[e.stage] += e.end - e.start
        return tuple(out)

    def to_json(self) -> dict[str, object]:
        doc: dict[str, object] = {
            "schedule": self.schedule,
            "makespan": self.makespan,
            "max_stage_span": self.max_stage_span,
            "ranks": [{"rank": r.rank, "span": r.span, "busy": r.busy, "bubble": r.bubble, "peak_memory": r.peak_memory,
                       "peak_in_flight": r.peak_in_flight, "bytes_sent": r.bytes_sent} for r in self.ranks],
            "staleness": {str(k): v for k, v in self.staleness.items()},
            "staleness_per_microbatch": [[s, m, n] for (s, m), n in sorted(self.staleness_per_microbatch.items())],
        }
        if self.dp > 1:  # dp = 1 keeps the document it always had
            for row, r in zip(doc["ranks"], self.ranks):  # type: ignore[call-overload]
                row.update({"allreduce_s": r.allreduce_s, "exposed_s": r.exposed_s, "exposed_step_s": r.exposed_step_s,
                            "hidden_fraction": r.hidden_fraction, "step_end": r.step_end})
            doc.update({"dp": self.dp, "compute_makespan": self.compute_makespan, "allreduce_s": self.allreduce_s,
                        "exposed_s": self.exposed_s, "hidden_fraction": self.hidden_fraction,
                        "step_hidden_fraction": self.step_hidden_fraction,
                        "allreduce": [{"rank": e.rank, "stage": e.stage, "bucket": e.bucket, "start": e.start,
                                       "end": e.end} for e in self.allreduce]})
        return doc


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (as a ``with`` block or a decorator).

    Generating and simulating a long schedule makes millions of small objects with no cycles
    (actions, events), and every automatic collection would walk all of them again: a third of
    the time at 100,000 microbatches. They are freed by reference counting all the same.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@gc_paused()
def validate(schedule: Schedule) -> None:
    """Raise ScheduleError naming the first broken rule, with the grid; return None if valid."""
    _check_counts(schedule)
    _walk(with_communication(schedule), None)


@gc_paused()
def simulate(schedule: Schedule, costs: Costs, *, dp: int | None = None, allreduce: Sequence[float] | None = None,
             cores: int | None = None) -> SimResult:
    """Run the schedule in simulated time; see the module docstring for the rules.

    ``dp``, ``allreduce`` (per-stage all-reduce seconds) and ``cores`` are shorthand for the same
    fields of ``costs`` (``Costs.dp``, ``Costs.allreduce_s``, ``Costs.cores``), which say the rest.
    """
    _check_counts(schedule)
    if len(costs.f) != schedule.num_stages:
        raise ScheduleError(f"costs give {len(costs.f)} stages, the schedule has {schedule.num_stages}; "
                            "give one cost per stage")
    timed = charged(schedule, _with(costs, schedule, dp, allreduce, cores))
    full = with_communication(schedule)
    walk = _walk(full, timed)
    lanes = _allreduce_lanes(walk.events, timed, full.num_ranks)
    # The last compute end of any rank (as max() over every compute event: ends are never -0.0).
    step_compute_end = max((max(map(_END, c)) for c in walk.compute if c), default=0.0)
    ranks = []
    for r in range(full.num_ranks):
        compute, sends = walk.compute[r], walk.sends[r]
        if not compute:
            ranks.append(RankStats(r, 0.0, 0.0, 0.0, 0.0, 0, 0.0))
            continue
        start, end = min(map(_START, compute)), max(map(_END, compute))
        lane = [e for e in lanes if e.rank == r]
        send_bytes = timed.send_bytes
        ranks.append(RankStats(
            r, start, end,
            _union(compute) if timed.w_lane else sum(map(operator.sub, map(_END, compute), map(_START, compute))),
            *_memory(compute, timed),
            sum([send_bytes[e.action.stage] for e in sends]) if send_bytes else 0.0 if sends else 0,
            sum(e.end - e.start for e in lane), max((e.end for e in lane), default=0.0),
            sum(max(0.0, e.end - max(e.start, end)) for e in lane),
            sum(max(0.0, e.end - max(e.start, step_compute_end)) for e in lane),
            sum(timed.optimizer_s[s] for s in range(schedule.num_stages)
                if timed.optimizer_s and schedule.rank_of_stage[s] == r),
            timed.step_s,
        ))
    if timed.tied:  # each rank's compute and replicas' all-reduce done: its weights tied across ranks are summed
        ends = _tied_ends(full, timed, [max(r.end, r.allreduce_end) for r in ranks])
        ranks = [dataclasses.replace(r, tied_end=e) for r, e in zip(ranks, ends)]
    active = [r for r in ranks if r.end > r.start]
    makespan = (max(r.step_end for r in active) - min(r.start for r in active)) if active else 0.0
    per_mb = _staleness(schedule) if not schedule.synchronous else {}
    worst: dict[int, int] = {}
    for (s, _), n in per_mb.items():
        worst[s] = max(worst.get(s, 0), n)
    return SimResult(schedule.name, makespan, max((r.step_end - r.start for r in active), default=0.0), tuple(ranks),
                     tuple(walk.events), worst, per_mb, timed.dp, tuple(lanes))


def _tied_ends(schedule: Schedule, costs: Costs, ready: Sequence[float]) -> list[float]:
    """Per rank, when the gradients of its weights tied with other ranks' (``Costs.tied``) are summed: the runtime
    all-reduces each tied parameter in turn (in ``tied``'s order) over the ranks holding it, each a blocking
    collective that starts when the last of them is ``ready`` (its compute and its replicas' all-reduce done)."""
    ends = [0.0] * schedule.num_ranks
    for stages, nbytes in costs.tied:
        ranks = sorted({schedule.rank_of_stage[s] for s in stages})
        if len(ranks) < 2 or nbytes <= 0:
            continue
        start = max(max(ready[r], ends[r]) for r in ranks)
        took = allreduce_seconds(nbytes, len(ranks), costs.allreduce_bandwidth, costs.allreduce_latency,
                                 bucket_bytes=nbytes)  # one all_reduce of the whole parameter
        for r in ranks:
            ends[r] = start + took
    return ends


def charged(schedule: Schedule, costs: Costs) -> Costs:
    """The costs each action of ``schedule`` is charged at when it is simulated (``Costs.time`` of an action): a
    ``batch_w`` schedule's Ws at their batched fraction, and every compute cost slowed by time-sharing
    (``Costs.compute_scale``)."""
    if schedule.batch_w and costs.w_batched:
        # a stage's Ws in runs of two or more run batched, at the measured fraction of their time: charged as each
        # stage's mean over its Ws (exact in total; the Ws of a batched run all end when it does)
        share = _batched_share(schedule)
        costs = dataclasses.replace(costs, w=tuple(w * (1.0 + share[s] * (k - 1.0))
                                                   for s, (w, k) in enumerate(zip(costs.w, costs.w_batched))))
    scale = costs.compute_scale(schedule.num_ranks)
    if scale != 1.0:
        costs = dataclasses.replace(
            costs, f=tuple(t * scale for t in costs.f), b=tuple(t * scale for t in costs.b),
            w=tuple(t * scale for t in costs.w), action_s=costs.action_s * scale, step_s=costs.step_s * scale,
            send_s=costs.send_s * scale)
    return costs if schedule.synchronous else _asynchronous(schedule, costs)


def replayed(schedule: Schedule, costs: Costs, measured: Mapping[tuple[int, str], float]) -> Costs:
    """``costs`` as ``schedule`` charges them (:func:`charged`), with each (stage, kind) of action that ``measured``
    times (seconds per action, ``Kind`` values as keys) taking that long: simulating ``schedule`` on the result
    replays a run's own action times through the schedule model (its order, messages, waits and step end), so that
    the gap between a simulation and a run splits into the per-action costs' and the schedule model's. A BW's time is
    split between B and W as charged; the measured times hold each action's host time and any time-sharing of the
    cores, so neither is charged again. Kinds not measured keep their charged time."""
    timed = charged(schedule, costs)
    f, b, w = ([t + timed.action_s for t in ts] for ts in (timed.f, timed.b, timed.w))
    for (stage, kind), seconds in measured.items():
        if not 0 <= stage < schedule.num_stages or not math.isfinite(seconds) or seconds < 0:
            raise ScheduleError(f"a measured {kind} of stage {stage} took {seconds!r} s, which a {schedule.num_stages}"
                                "-stage schedule cannot replay")
        if kind == Kind.BW.value:
            both = timed.b[stage] + timed.w[stage]
            b[stage] = seconds * (timed.b[stage] / both if both > 0 else 0.5)
            w[stage] = seconds - b[stage]
        else:
            {Kind.F.value: f, Kind.B.value: b, Kind.W.value: w}[kind][stage] = seconds
    return dataclasses.replace(timed, f=tuple(f), b=tuple(b), w=tuple(w), action_s=0.0, cores=None, w_batched=(),
                               copy_s=(), weights="")


def _asynchronous(schedule: Schedule, costs: Costs) -> Costs:
    """An asynchronous schedule's costs: each W (or BW) of a stage ends with its optimizer step (one per
    microbatch, not one per step), and each action that copies the stage's weights under ``Costs.weights``
    (``versions.copies``) takes ``copy_s`` longer, charged as the mean over that kind's actions of the stage (exact
    in total)."""
    n = schedule.num_stages
    extra = {kind: [0.0] * n for kind in (Kind.F, Kind.B, Kind.W)}
    if costs.optimizer_s:
        extra[Kind.W] = list(costs.optimizer_s)
    if costs.weights and costs.copy_s:
        made = copies(schedule, costs.weights)
        count: dict[tuple[int, Kind], int] = {}
        for acts in schedule.ranks:
            for a in acts:
                count[(a.stage, a.kind)] = count.get((a.stage, a.kind), 0) + 1
        for (s, kind), k in made.items():
            # a BW is B + W: its copies are charged to w, which only W and BW actions read
            extra[Kind.W if kind is Kind.BW else kind][s] += costs.copy_s[s] * k / count[(s, kind)]
    if not any(map(any, extra.values())):
        return costs
    return dataclasses.replace(costs, f=tuple(map(operator.add, costs.f, extra[Kind.F])),
                               b=tuple(map(operator.add, costs.b, extra[Kind.B])),
                               w=tuple(map(operator.add, costs.w, extra[Kind.W])), optimizer_s=())


def _batched_share(schedule: Schedule) -> list[float]:
    """Per stage, the fraction of its W actions that are in a run of two or more adjacent Ws of that stage on its
    rank: the ones a schedule with ``batch_w`` runs batched."""
    inside, total = [0] * schedule.num_stages, [0] * schedule.num_stages
    for acts in schedule.ranks:
        run: list[Action] = []
        for a in [*acts, None]:
            if a is not None and a.kind is Kind.W and run and run[-1].stage == a.stage:
                run.append(a)
                continue
            if run:
                total[run[0].stage] += len(run)
                inside[run[0].stage] += len(run) if len(run) > 1 else 0
            run = [a] if a is not None and a.kind is Kind.W else []
    return [i / t if t else 0.0 for i, t in zip(inside, total)]


def _with(costs: Costs, schedule: Schedule, dp: int | None, allreduce: Sequence[float] | None,
          cores: int | None) -> Costs:
    """``costs`` with the keyword overrides of :func:`simulate`, checked."""
    changes: dict[str, object] = {}
    if dp is not None:
        changes["dp"] = dp
    if allreduce is not None:
        changes["allreduce_s"] = tuple(float(x) for x in allreduce)
    if cores is not None:
        changes["cores"] = cores
    out = dataclasses.replace(costs, **changes) if changes else costs  # type: ignore[arg-type]
    if out.dp < 1:
        raise OptionError(f"data parallelism needs at least 1 replica per stage (dp: {out.dp})")
    if out.cores is not None and out.cores < 1:
        raise OptionError(f"cores must be at least 1 (cores: {out.cores}); leave it unset to not model time-sharing")
    for name in ("allreduce_s", "grad_bytes"):
        values = getattr(out, name)
        if values and len(values) != schedule.num_stages:
            raise OptionError(f"{name} needs one value per stage (values: {len(values)}, stages: "
                              f"{schedule.num_stages}); give {schedule.num_stages}")
    return out


def _allreduce_lanes(events: Sequence[Event], costs: Costs, num_ranks: int) -> list[AllReduceEvent]:
    """Every rank's all-reduce lane: a stage's buckets start once its last W or BW on the rank has run,
    one after another, stages in the order they finish (ties: lower stage first)."""
    if costs.dp == 1:
        return []
    last: dict[tuple[int, int], float] = {}  # (rank, stage) -> its last W or BW end
    for e in events:
        if e.action.kind in (Kind.W, Kind.BW):
            key = (e.rank, e.action.stage)
            last[key] = max(last.get(key, e.end), e.end)
    out: list[AllReduceEvent] = []
    free = [0.0] * num_ranks
    for (rank, stage), ready in sorted(last.items(), key=lambda kv: (kv[1], kv[0][1])):
        for i, seconds in enumerate(costs.allreduce_buckets(stage)):
            start = max(free[rank], ready)
            free[rank] = start + seconds
            out.append(AllReduceEvent(rank, stage, i, start, free[rank]))
    return sorted(out, key=lambda e: (e.rank, e.start))


# Kinds as small integers, for the flat tables of the checks and the walk (Kind's order: F B W BW SEND_F RECV_F
# SEND_B RECV_B). Looked up by the member's value string: an Enum member hashes in Python, a str in C.
_KIND_INDEX: dict[str, int] = {k.value: i for i, k in enumerate(Kind)}
_F, _B, _W, _BW, _SEND_F, _RECV_F, _SEND_B, _RECV_B = range(8)


def _check_counts(schedule: Schedule) -> None:
    """Every action in range, on its stage's rank and run once; F and BW (or B and W) once per stage
    and microbatch; every send with its receive.

    One pass marks each action in a flat table indexed by ``(mb * stages + stage) * 8 + kind``;
    whole columns of it are then compared at once, and only a failed comparison scans stage by
    stage for the first broken rule, to name it.
    """
    p, num_mb, where = schedule.num_stages, schedule.num_microbatches, schedule.rank_of_stage
    seen = bytearray(8 * p * num_mb)
    kind_index = _KIND_INDEX
    comm: list[tuple[Action, int]] = []  # every send and receive with its table index, in rank order
    for r, acts in enumerate(schedule.ranks):
        for i, a in enumerate(acts):
            s, m, k = a.stage, a.mb, kind_index[a.kind._value_]
            if not (0 <= s < p and 0 <= m < num_mb):
                _fail(schedule, f"{a} names a stage or microbatch outside {schedule.num_stages} stages x "
                      f"{schedule.num_microbatches} microbatches", {r: i})
            if k < _SEND_F and where[s] != r:
                _fail(schedule, f"{a} runs on rank {r}, but stage {s} lives on rank {where[s]}", {r: i})
            code = (m * p + s) * 8 + k
            if seen[code]:
                _fail(schedule, f"{a} runs twice; every action runs once", {r: i})
            seen[code] = 1
            if k >= _SEND_F:
                comm.append((a, code))
    f, b, w, bw = (int.from_bytes(seen[k::8], "little") for k in (_F, _B, _W, _BW))
    ones = int.from_bytes(b"\x01" * (p * num_mb), "little")
    if not (f == ones and b == w and b ^ bw == ones):  # each byte 0 or 1: B == W, and exactly one of B and BW
        for s in range(p):
            for m in range(num_mb):
                base = (m * p + s) * 8
                fused, split = seen[base + _BW], (seen[base + _B], seen[base + _W])
                if seen[base + _F] != 1:
                    _fail(schedule, f"microbatch {m} never runs F on stage {s}; every microbatch runs F, B and W "
                          "(or BW) once per stage")
                if not ((fused == 1 and split == (0, 0)) or (fused == 0 and split == (1, 1))):
                    _fail(schedule, f"microbatch {m} on stage {s} runs BW {fused}x, B {split[0]}x, W {split[1]}x; "
                          "it needs BW once, or B once and W once")
    # A send's receive is one stage on (SEND_F -> RECV_F of s + 1) or back (SEND_B -> RECV_B of s - 1).
    partner = {_SEND_F: (1, _RECV_F), _RECV_F: (-1, _SEND_F), _SEND_B: (-1, _RECV_B), _RECV_B: (1, _SEND_B)}
    for a, code in comm:
        step, kind = partner[code % 8]
        s = a.stage + step
        if not (0 <= s < p and seen[(a.mb * p + s) * 8 + kind]):
            _fail(schedule, f"{a} has no matching {Action(s, list(Kind)[kind], a.mb)}; every send needs its receive")


def _deps(a: Action, schedule: Schedule) -> list[Action]:
    """What must have run before ``a`` (on any rank); :func:`_walk` follows the same rules on its tables."""
    s, m = a.stage, a.mb
    last = schedule.num_stages - 1
    where = schedule.rank_of_stage
    backward = (Kind.B, Kind.BW)
    if a.kind is Kind.F:
        if s == 0:
            return []
        return [Action(s, Kind.RECV_F, m)] if where[s - 1] != where[s] else [Action(s - 1, Kind.F, m)]
    if a.kind in backward:
        deps = [Action(s, Kind.F, m)]
        if s < last:
            deps.append(Action(s, Kind.RECV_B, m) if where[s + 1] != where[s] else _backward(schedule, s + 1, m))
        return deps
    if a.kind is Kind.W:
        return [Action(s, Kind.B, m)]
    if a.kind is Kind.SEND_F:
        return [Action(s, Kind.F, m)]
    if a.kind is Kind.SEND_B:
        return [_backward(schedule, s, m)]
    if a.kind is Kind.RECV_F:
        return [Action(s - 1, Kind.SEND_F, m)]
    return [Action(s + 1, Kind.SEND_B, m)]  # RECV_B


def _backward(schedule: Schedule, s: int, m: int) -> Action:
    return Action(s, Kind.B if schedule.split_backward and not _is_fused(schedule, s, m) else Kind.BW, m)


def _is_fused(schedule: Schedule, s: int, m: int) -> bool:
    return any(a == Action(s, Kind.BW, m) for a in schedule.ranks[schedule.rank_of_stage[s]])


@dataclass
class _Walk:
    """What :func:`_walk` ran: every event in order, each rank's compute and sends (in its order),
    and how many dependency checks it made."""

    events: list[Event]
    compute: list[list[Event]]
    sends: list[list[Event]]
    checks: int


def _walk(schedule: Schedule, costs: Costs | None) -> _Walk:
    """Execute every rank's list in order; with costs, in simulated time. Raises on deadlock.

    In rounds, each rank in turn runs its actions until one needs a result not yet available.
    Results sit in a flat table indexed by ``(mb * stages + stage) * 8 + kind`` (a send's entry:
    when its message arrives), so a dependency check is one or two lookups. Every round but the
    last moves at least one action, so the checks number at most actions + ranks x rounds: linear
    in the actions for a given number of ranks. Expects :func:`_check_counts` to have passed: each
    (stage, microbatch) has one B or one BW, and a backward's entry (at B) is whichever ran, the
    one :func:`_backward` names.
    """
    p, where, last = schedule.num_stages, schedule.rank_of_stage, schedule.num_stages - 1
    slots = p * schedule.num_microbatches
    F, B, W, BW, SEND_F, RECV_F, SEND_B, RECV_B = range(8)  # kind indices (as _KIND_INDEX), local: fast to read
    from_prev = [s > 0 and where[s - 1] != where[s] for s in range(p)]  # F(s) receives its input from another rank
    from_next = [s < last and where[s + 1] != where[s] for s in range(p)]  # B(s) receives its gradient
    if costs is None:
        took: list[tuple[float, ...]] = [(1.0,) * p] * 4
        transfer = (0.0,) * p
        send_cost = 0.0
    else:
        extra = costs.action_s  # the runtime's cost of running an action, whatever its graphs
        took = [tuple(t + extra for t in costs.f), tuple(t + extra for t in costs.b), tuple(t + extra for t in costs.w),
                tuple(b + w + extra for b, w in zip(costs.b, costs.w))]
        transfer = tuple(costs.transfer(s) for s in range(p))
        send_cost = costs.send_s  # the sender's host time per message (isend); the message leaves after it
    kind_index = _KIND_INDEX
    done: list[float | None] = [None] * (8 * slots)  # when each result is available (a send's: its arrival)
    link_free: dict[tuple[int, int], float] = {}  # (from rank, to rank) -> when its last message has arrived
    clock = [0.0] * schedule.num_ranks
    pos = [0] * schedule.num_ranks
    out = _Walk([], [[] for _ in schedule.ranks], [[] for _ in schedule.ranks], 0)
    lanes = [_Lane(r, out) for r in range(schedule.num_ranks)] if costs is not None and costs.w_lane else None
    append = out.events.append
    total = remaining = sum(len(r) for r in schedule.ranks)
    waited = 0  # checks that found a rank waiting
    while remaining:
        moved = False
        for r, acts in enumerate(schedule.ranks):
            first = i = pos[r]
            n = len(acts)
            now = clock[r]
            computed, sent = out.compute[r].append, out.sends[r].append
            while i < n:
                a = acts[i]
                s, m, k = a.stage, a.mb, kind_index[a.kind._value_]
                at = (m * p + s) * 8
                # ``ready``: when its inputs are there; it starts at max(now, ready) (the first of equals, as max()).
                if k < SEND_F:
                    if k == F:
                        ready = 0.0 if s == 0 else done[at + RECV_F] if from_prev[s] else done[at - 8 + F]
                    elif k == W:
                        ready = done[at + B]
                    else:  # B or BW: its F, and the gradient from stage s + 1
                        ready = done[at + F]
                        if s < last and ready is not None:
                            grad = done[at + RECV_B] if from_next[s] else done[at + 8 + B]
                            ready = None if grad is None else grad if grad > ready else ready
                    if ready is None:
                        waited += 1
                        break
                    start = ready if ready > now else now
                    if lanes is not None:
                        side = lanes[r]
                        side.run(now, start, 1.0)  # the main lane waits: the second runs at full speed
                        if k == W:
                            side.queue.append([a, took[W][s], None])
                            i += 1
                            continue
                        now = end = start + took[k][s] + side.share(start, took[k][s])
                    else:
                        now = end = start + took[k][s]
                    done[at + k] = end
                    if k == BW:
                        done[at + B] = end  # the backward of (s, m), whichever kind ran
                    e = Event(r, a, start, end)
                    computed(e)
                elif k == SEND_F or k == SEND_B:  # sends never wait (isend); they take send_cost of the sender's time
                    if done[at + F if k == SEND_F else at + B] is None:
                        waited += 1
                        break
                    start = now
                    now = end = start + send_cost + (lanes[r].share(start, send_cost) if lanes is not None and send_cost
                                                     else 0.0)
                    # One link per ordered pair of ranks carries one message at a time, in the order
                    # they were sent (gloo queues a pair's sends): a message starts when it is sent and
                    # the one before it on the link has arrived, and takes latency + bytes / bandwidth.
                    link = (r, where[s + 1] if k == SEND_F else where[s - 1])
                    free = link_free.get(link, end)
                    # it carries stage s's output, or the gradient of stage s - 1's
                    done[at + k] = link_free[link] = (free if free > end else end) + transfer[
                        s if k == SEND_F else s - 1]
                    e = Event(r, a, start, end)
                    sent(e)
                else:  # a receive: once its message has arrived
                    ready = done[at - 8 + SEND_F] if k == RECV_F else done[at + 8 + SEND_B]
                    if ready is None:
                        waited += 1
                        break
                    if lanes is not None:
                        lanes[r].run(now, ready, 1.0)
                    now = start = end = ready if ready > now else now
                    done[at + k] = end
                    e = Event(r, a, start, end)
                append(e)
                i += 1
            if i > first:
                pos[r], clock[r] = i, now
                remaining -= i - first
                moved = True
        if not moved:
            stuck = {r: pos[r] for r in range(schedule.num_ranks) if pos[r] < len(schedule.ranks[r])}
            waits = []
            for r, i in stuck.items():
                a = schedule.ranks[r][i]
                missing = [str(d) for d in _deps(a, schedule)
                           if done[(d.mb * p + d.stage) * 8 + kind_index[d.kind._value_]] is None]
                waits.append(f"rank {r} at {a} waits for {', '.join(missing)}")
            _fail(schedule, "deadlock: no rank can run its next action (" + "; ".join(waits) + ")", stuck)
    for r, side in enumerate(lanes or ()):  # the W's left once the main lane is done
        side.run(clock[r], math.inf, 1.0)
    out.checks = total + waited
    return out


class _Lane:
    """A rank's second lane (``Costs.w_lane``): its W's, first in first out, each ``[action, seconds left, start]``;
    it records each W's event as the W ends (nothing waits for a W's result)."""

    def __init__(self, rank: int, walk: _Walk) -> None:
        self.rank, self.walk = rank, walk
        self.queue: collections.deque[list[Any]] = collections.deque()

    def run(self, t0: float, t1: float, rate: float) -> None:
        """Run from ``t0`` to ``t1`` at ``rate`` seconds of W per second."""
        t = t0
        while self.queue and t < t1:
            item = self.queue[0]
            if item[2] is None:
                item[2] = t
            need = item[1] / rate
            if t + need <= t1 or math.isclose(t + need, t1, rel_tol=1e-12):
                t = min(t + need, t1)
                self.queue.popleft()
                e = Event(self.rank, item[0], item[2], t)
                self.walk.compute[self.rank].append(e)
                self.walk.events.append(e)
            else:
                item[1] -= (t1 - t) * rate
                t = t1

    def share(self, start: float, seconds: float) -> float:
        """The main lane computes ``seconds`` from ``start`` beside it: both run at half speed until the lane is empty
        (or the main lane done). Returns how much longer the main lane's work takes: the lane's work it shared."""
        shared: float = min(sum(item[1] for item in self.queue), seconds)
        if shared > 0:
            self.run(start, start + 2 * shared, 0.5)
        return shared


def _memory(compute: Sequence[Event], costs: Costs) -> tuple[float, int]:
    held_fb = costs.held_fb or (1.0,) * len(costs.f)
    held_bw = costs.held_bw or (1.0,) * len(costs.f)
    level, peak, in_flight, peak_flight = 0.0, 0.0, 0, 0
    forward, input_grad, weight_grad = Kind.F, Kind.B, Kind.W
    for e in sorted(compute, key=_END):
        a = e.action
        s, kind = a.stage, a.kind
        if kind is forward:
            level += held_fb[s]
            in_flight += 1
        elif kind is input_grad:
            level += held_bw[s] - held_fb[s]
        elif kind is weight_grad:
            level -= held_bw[s]
            in_flight -= 1
        else:  # BW
            level -= held_fb[s]
            in_flight -= 1
        if level > peak:  # as peak = max(peak, level), without the call
            peak = level
        if in_flight > peak_flight:
            peak_flight = in_flight
    return peak, peak_flight


_START, _END = operator.attrgetter("start"), operator.attrgetter("end")


def _union(events: Sequence[Event]) -> float:
    """Seconds in which at least one of ``events`` runs (a rank's two lanes overlap)."""
    total, reach = 0.0, -math.inf
    for e in sorted(events, key=_START):
        if e.end > reach:
            total += e.end - max(e.start, reach)
            reach = e.end
    return total


def _staleness(schedule: Schedule) -> dict[tuple[int, int], int]:
    """Per (stage, microbatch), the weight updates (one per backward) between the microbatch's F and its backward.

    One pass per rank counts every stage's updates; the entries are then laid out stage by stage,
    in the order of the rank's set of stages, as the per-stage scan this replaced laid them out.
    """
    out: dict[tuple[int, int], int] = {}
    forward, weight_grad, fused = Kind.F, Kind.W, Kind.BW
    for acts in schedule.ranks:
        updates: dict[int, int] = {}
        f_at: dict[tuple[int, int], int] = {}
        per_stage: dict[int, list[tuple[tuple[int, int], int]]] = {}
        for a in acts:
            kind, s = a.kind, a.stage
            if kind is forward:
                f_at[(s, a.mb)] = updates.get(s, 0)
            elif kind is weight_grad or kind is fused:
                n = updates.get(s, 0)
                per_stage.setdefault(s, []).append(((s, a.mb), n - f_at[(s, a.mb)]))
                updates[s] = n + 1
        for s in {a.stage for a in acts}:
            out.update(per_stage.get(s, ()))
    return out


# A schedule longer than this many steps shows only the steps near each marked one in its error.
_GRID_STEPS = 200
_GRID_CONTEXT = 8


def _fail(schedule: Schedule, message: str, mark: dict[int, int] | None = None) -> None:
    steps = max((len(r) for r in schedule.ranks), default=0)
    grid = schedule.grid(mark, context=_GRID_CONTEXT if steps > _GRID_STEPS else None)
    raise ScheduleError(f"invalid schedule {schedule.name!r}: {message}\n{grid}")


def report(result: SimResult, schedule: Schedule, *, unit: str = "s", w_batched: Sequence[float] = ()) -> Report:
    """The per-rank table of a simulation (times in ms when ``unit`` is seconds, else in the costs' unit);
    ``w_batched``: the costs' ``Costs.w_batched``, for a schedule that batches its Ws."""
    scale, tu = (1e3, "ms") if unit == "s" else (1.0, unit)
    mem, mu = (1 / 2**20, "MiB") if unit == "s" else (1.0, "units")
    rows = tuple(
        (r.rank, ",".join(str(s) for s in range(schedule.num_stages) if schedule.rank_of_stage[s] == r.rank),
         round(r.span * scale, 4), round(r.busy * scale, 4), round(100 * r.bubble, 2), round(r.peak_memory * mem, 3),
         r.peak_in_flight, round(r.bytes_sent / 2**20, 4))
        for r in result.ranks
    )
    notes = [f"{schedule.name}, {schedule.num_stages} stages on {schedule.num_ranks} ranks, "
             f"{schedule.num_microbatches} microbatches: makespan {result.makespan * scale:.4f} {tu}, "
             f"max stage span {result.max_stage_span * scale:.4f} {tu}"]
    if schedule.batch_w:
        notes.append("batched W: each W in a run of two or more of its stage's is charged "
                     + (", ".join(f"stage {s}: {k:.2f}" for s, k in enumerate(w_batched)) + " of its time alone "
                        "(timed or estimated at compile, measured by fxpipe run)" if w_batched else
                        "its whole time alone, an upper bound: the costs do not know how much faster the runtime "
                        "runs them batched (fxpipe run measures it and simulates with it)"))
    if result.staleness:
        notes.append("asynchronous: weight updates between a microbatch's F and its backward, per stage: "
                     + ", ".join(f"stage {s}: {n}" for s, n in sorted(result.staleness.items())))
    return Report(
        title="simulate: per rank",
        columns=("rank", "stages", f"span {tu}", f"busy {tu}", "bubble %", f"peak memory {mu}", "peak in flight",
                 "MiB sent"),
        rows=rows,
        notes=tuple(notes),
    )


def dp_report(result: SimResult, schedule: Schedule, costs: Costs, *, param_bytes: Sequence[float] | None = None,
              optimizer: str = "sgd", unit: str = "s") -> Report:
    """The data-parallel table of a simulation: per rank its replicas, all-reduce, what of it hid, memory.

    ``param_bytes[s]``: stage s's trainable parameter bytes, for memory per rank (parameters,
    gradients, ``optimizer``'s state and the simulated peak activations); None: no memory column
    (uniform costs have no bytes).
    """
    from fxpipe.planning.cost import rank_memory

    scale, tu = (1e3, "ms") if unit == "s" else (1.0, unit)
    dp = result.dp
    per_stage = result.allreduce_stage_s(schedule.num_stages)
    rows = []
    for r in result.ranks:
        stages = [s for s in range(schedule.num_stages) if schedule.rank_of_stage[s] == r.rank]
        row: tuple[object, ...] = (
            r.rank, ",".join(str(r.rank * dp + d) for d in range(dp)), ",".join(str(s) for s in stages),
            sum(len(costs.allreduce_buckets(s)) for s in stages), round(r.allreduce_s * scale, 4),
            round(r.exposed_s * scale, 4), round(r.exposed_step_s * scale, 4), round(100 * r.hidden_fraction, 2))
        if param_bytes is not None:
            static = sum(param_bytes[s] for s in stages)
            row += (round(rank_memory(static, r.peak_memory, optimizer) / 2**20, 3),)
        rows.append(row)
    columns: tuple[str, ...] = ("rank", "dp ranks", "stages", "buckets", f"all-reduce {tu}", f"exposed {tu}",
                                f"exposed in step {tu}", "hidden %")
    if param_bytes is not None:
        columns += (f"memory per rank MiB ({optimizer})",)
    notes = [f"dp {dp}: {schedule.num_ranks} x {dp} = {schedule.num_ranks * dp} ranks; a step takes "
             f"{dp} x {schedule.num_microbatches} microbatches; each stage's gradients are all-reduced over its "
             f"{dp} replicas (ring, buckets of at most {costs.bucket_bytes / 2**20:g} MiB) once its last W has run",
             "all-reduce per stage: " + ", ".join(f"{s}: {t * scale:.4g} {tu}" for s, t in enumerate(per_stage)),
             f"makespan {result.makespan * scale:.4f} {tu} = compute {result.compute_makespan * scale:.4f} {tu} + "
             f"{(result.makespan - result.compute_makespan) * scale:.4f} {tu} of all-reduce past the last compute",
             f"hidden: {100 * result.hidden_fraction:.1f}% behind the rank's own compute (exposed: after the rank's "
             f"last compute), {100 * result.step_hidden_fraction:.1f}% behind any rank's compute (exposed in step)"]
    if costs.cores is not None:
        notes.append(f"F, B and W {costs.compute_scale(schedule.num_ranks):g}x slower: "
                     f"{schedule.num_ranks * dp} ranks time-share {costs.cores} cores (an approximation: as if "
                     "every rank always computed)")
    return Report(title="simulate: data parallel", columns=columns, rows=tuple(rows), notes=tuple(notes))


def _weight_reads(plan: Plan,
                  per_stage: Sequence[float]) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """Per stage, the seconds its F, B and W spend reading weights (W: reading and writing their gradients) from
    memory, as its plan's calibrated rates (``plan.options.compute``) assume: each stage's parameter bytes
    (``per_stage``, ``Costs.grad_bytes``) times the
    share of the weights the cache cannot hold (``ComputeRates.cold`` of every replica's parameters, which share this
    machine's cache), at ``mem_bw``; F and B read each weight once, W reads and writes each gradient (and, in a stage
    whose B is empty, reads the weights for the activations' gradients too, as B would). Empty for a plan without
    calibrated rates (profiled, or a fixed device model) and for one whose weights fit the cache."""
    compute = getattr(plan.options, "compute", None)
    if compute is None or not plan.layers:
        return ((), (), ())
    miss = compute.cold(sum(per_stage) * plan.mesh.dp)
    if miss <= 0:
        return ((), (), ())
    seconds = [miss * nbytes / compute.mem_bw for nbytes in per_stage]
    return (tuple(seconds), tuple(t if c.b > 0 else 0.0 for t, c in zip(seconds, plan.stages)),
            tuple((2 if c.b > 0 else 3) * t if c.w > 0 else 0.0 for t, c in zip(seconds, plan.stages)))
