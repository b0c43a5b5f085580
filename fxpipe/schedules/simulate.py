"""Validate and simulate schedules: dependencies, matched sends, no deadlock; then an event simulation in time.

Both walk every rank's action list in order, executing an action once what it depends on has
run: F(s, m) needs F(s-1, m); B or BW(s, m) needs F(s, m) and the backward of (s+1, m); W(s, m)
needs B(s, m); a receive needs its send. Sends never block (asynchronous ``isend``). When no
rank can move, the schedule deadlocks, and the error shows the grid with each rank's stuck
action marked.

In simulated time a message takes ``latency + bytes / bandwidth`` and uses no compute time on
either rank. Each ordered pair of ranks is one link that carries one message at a time, in the
order they were sent (as gloo queues a pair's sends), so a message sent while the one before it
is still crossing waits for it; the two directions are separate links.

Data parallelism (``Costs.dp`` replicas of every stage) runs the same schedule on every replica,
each on its own microbatches, so one replica's simulation is every replica's. On top of it each
rank has one all-reduce lane: once the last W (or BW) of a stage on that rank has run, the
stage's gradient buckets are all-reduced over its dp group, one bucket after the other, in the
order the stages finish; the rank's step ends when both its compute and its lane are done.
1f1b, 2 stages, 2 microbatches, unit F/B/W, all-reduce 1.5 per stage, dp = 2 (``A``: all-reduce)::

    rank 0    |F0F1....X0XX..X1XX...|     compute ends at 9
    rank 0 ar |..................A0A|     all-reduce 9 .. 10.5
    rank 1    |..F0X0XXF1X1XX.......|     compute ends at 7
    rank 1 ar |..............A1A....|     all-reduce 7 .. 8.5

Two measures of what was hidden. A rank's own (``RankStats.exposed_s``, ``hidden_fraction``):
the all-reduce time after its last compute, what the rank waits for before its optimizer step
(here 1.5 of 1.5 on both ranks). With one stage per rank the stage's last W is the rank's last
compute, so this is always all of it; only ranks holding several stages (interleaved-1f1b) hide
some. The step's (``exposed_step_s``, ``SimResult.step_hidden_fraction``): the all-reduce time
after the last compute of any rank, which lengthens the step (here rank 1's all-reduce hides
behind rank 0's cooldown: 1.5 of 3 hidden). 1F1B's staggered cooldown hides the later stages'
all-reduce this way; zero-bubble schedules end every rank together and so hide less, in a shorter step.

The lane takes no compute time: gloo reduces on its own thread (on a machine with fewer cores
than ranks that thread competes with compute; see ``Costs.cores`` for compute itself).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from fxpipe.errors import OptionError, ScheduleError
from fxpipe.plan import Plan
from fxpipe.planning.cost import BUCKET_BYTES, allreduce_bucket_seconds, optimizer_step_seconds, transfer_time
from fxpipe.report import Report
from fxpipe.schedules.ir import COMM, COMPUTE, Action, Kind, Schedule, with_communication


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

    def with_optimizer(self, optimizer: str, mem_bw: float) -> "Costs":
        """These costs with each stage's optimizer step: a memory-bound pass over its parameters at ``mem_bw``."""
        return dataclasses.replace(self, optimizer_s=tuple(optimizer_step_seconds(g, optimizer, mem_bw)
                                                           for g in self.grad_bytes))

    @classmethod
    def uniform(cls, num_stages: int, f: float, b: float, w: float) -> "Costs":
        """Every stage F, B, W in the given times; free transfers; one unit of memory per microbatch in flight."""
        n = num_stages
        return cls((f,) * n, (b,) * n, (w,) * n, (0.0,) * n, (1.0,) * n, (1.0,) * n)

    @classmethod
    def from_plan(cls, plan: Plan) -> "Costs":
        """The plan's per-stage costs and link, for one microbatch."""
        st = plan.stages
        grads = tuple(float(sum(layer.param_bytes for layer in plan.layers[c.first_layer:c.end_layer])) for c in st)
        return cls(tuple(c.f for c in st), tuple(c.b for c in st), tuple(c.w for c in st),
                   tuple(c.send_bytes for c in st), tuple(c.held_fb for c in st), tuple(c.held_bw for c in st),
                   plan.link.latency, plan.link.bandwidth, dp=plan.mesh.dp, grad_bytes=grads,
                   allreduce_latency=plan.link.latency, allreduce_bandwidth=plan.link.bandwidth)

    def time(self, action: Action) -> float:
        s = action.stage
        return {Kind.F: self.f[s], Kind.B: self.b[s], Kind.W: self.w[s], Kind.BW: self.b[s] + self.w[s]}.get(action.kind, 0.0)

    def transfer(self, stage: int) -> float:
        """Seconds to send stage ``stage``'s output (or the gradient for it) over one link."""
        nbytes = self.send_bytes[stage] if self.send_bytes else 0.0
        return transfer_time(nbytes, bandwidth=self.bandwidth, latency=self.latency)

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

    @property
    def span(self) -> float:
        return self.end - self.start

    @property
    def step_end(self) -> float:
        """When the rank's step is done: compute and all-reduce both, then its optimizer step."""
        return max(self.end, self.allreduce_end) + self.optimizer_s

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


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError naming the first broken rule, with the grid; return None if valid."""
    _check_counts(schedule)
    _walk(with_communication(schedule), None)


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
    costs = _with(costs, schedule, dp, allreduce, cores)
    scale = costs.compute_scale(schedule.num_ranks)
    timed = costs if scale == 1.0 else dataclasses.replace(
        costs, f=tuple(t * scale for t in costs.f), b=tuple(t * scale for t in costs.b),
        w=tuple(t * scale for t in costs.w))
    full = with_communication(schedule)
    events = _walk(full, timed)
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
            r, start, end, sum(e.end - e.start for e in compute), *_memory(compute, timed),
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
    per_mb = _staleness(schedule) if not schedule.synchronous else {}
    worst: dict[int, int] = {}
    for (s, _), n in per_mb.items():
        worst[s] = max(worst.get(s, 0), n)
    return SimResult(schedule.name, makespan, max((r.step_end - r.start for r in active), default=0.0), tuple(ranks),
                     tuple(events), worst, per_mb, timed.dp, tuple(lanes))


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


def _check_counts(schedule: Schedule) -> None:
    seen: Counter[tuple[int, Kind, int]] = Counter()
    for r, acts in enumerate(schedule.ranks):
        for i, a in enumerate(acts):
            if not (0 <= a.stage < schedule.num_stages and 0 <= a.mb < schedule.num_microbatches):
                _fail(schedule, f"{a} names a stage or microbatch outside {schedule.num_stages} stages x "
                      f"{schedule.num_microbatches} microbatches", {r: i})
            if a.kind in COMPUTE and schedule.rank_of_stage[a.stage] != r:
                _fail(schedule, f"{a} runs on rank {r}, but stage {a.stage} lives on rank "
                      f"{schedule.rank_of_stage[a.stage]}", {r: i})
            seen[(a.stage, a.kind, a.mb)] += 1
            if seen[(a.stage, a.kind, a.mb)] > 1:
                _fail(schedule, f"{a} runs twice; every action runs once", {r: i})
    for s in range(schedule.num_stages):
        for m in range(schedule.num_microbatches):
            fused = seen[(s, Kind.BW, m)]
            split = (seen[(s, Kind.B, m)], seen[(s, Kind.W, m)])
            if seen[(s, Kind.F, m)] != 1:
                _fail(schedule, f"microbatch {m} never runs F on stage {s}; every microbatch runs F, B and W "
                      "(or BW) once per stage")
            if not ((fused == 1 and split == (0, 0)) or (fused == 0 and split == (1, 1))):
                _fail(schedule, f"microbatch {m} on stage {s} runs BW {fused}x, B {split[0]}x, W {split[1]}x; "
                      "it needs BW once, or B once and W once")
    sends = Counter((a.stage, a.kind, a.mb) for r in schedule.ranks for a in r if a.kind in COMM)
    for (s, kind, m), n in sends.items():
        pair = {Kind.SEND_F: (s + 1, Kind.RECV_F), Kind.RECV_F: (s - 1, Kind.SEND_F),
                Kind.SEND_B: (s - 1, Kind.RECV_B), Kind.RECV_B: (s + 1, Kind.SEND_B)}[kind]
        if sends[(pair[0], pair[1], m)] != n:
            _fail(schedule, f"{Action(s, kind, m)} has no matching {Action(pair[0], pair[1], m)}; "
                  "every send needs its receive")


def _deps(a: Action, schedule: Schedule) -> list[Action]:
    """What must have run before ``a`` (on any rank)."""
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


def _walk(schedule: Schedule, costs: Costs | None) -> list[Event]:
    """Execute every rank's list in order; with costs, in simulated time. Raises on deadlock."""
    done: dict[Action, float] = {}  # action -> time its result is available
    arrival: dict[Action, float] = {}  # send -> time its message is at the receiver
    link_free: dict[tuple[int, int], float] = {}  # (from rank, to rank) -> when its last message has arrived
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
                deps = _deps(a, schedule)
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
                    # One link per ordered pair of ranks carries one message at a time, in the order
                    # they were sent (gloo queues a pair's sends): a message starts when it is sent and
                    # the one before it on the link has arrived, and takes latency + bytes / bandwidth.
                    produced = a.stage if a.kind is Kind.SEND_F else a.stage - 1  # whose output (or its gradient)
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
                missing = [str(d) for d in _deps(a, schedule) if d not in done]
                waits.append(f"rank {r} at {a} waits for {', '.join(missing)}")
            _fail(schedule, "deadlock: no rank can run its next action (" + "; ".join(waits) + ")", stuck)
    return events


def _memory(compute: Sequence[Event], costs: Costs) -> tuple[float, int]:
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
        else:  # BW
            level -= held_fb[s]
            in_flight -= 1
        peak, peak_flight = max(peak, level), max(peak_flight, in_flight)
    return peak, peak_flight


def _staleness(schedule: Schedule) -> dict[tuple[int, int], int]:
    """Per (stage, microbatch), the weight updates (one per backward) between the microbatch's F and its backward."""
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


def _fail(schedule: Schedule, message: str, mark: dict[int, int] | None = None) -> None:
    raise ScheduleError(f"invalid schedule {schedule.name!r}: {message}\n{schedule.grid(mark)}")


def report(result: SimResult, schedule: Schedule, *, unit: str = "s") -> Report:
    """The per-rank table of a simulation (times in ms when ``unit`` is seconds, else in the costs' unit)."""
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
    columns = ("rank", "dp ranks", "stages", "buckets", f"all-reduce {tu}", f"exposed {tu}", f"exposed in step {tu}",
               "hidden %")
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
