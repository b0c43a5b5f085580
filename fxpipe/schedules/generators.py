"""Schedule generators: each a pure function of stages, microbatches (and costs where the schedule needs them).

    gpipe             all F, then all fused backwards (BW)
    1f1b              warm-up Fs, then one F one BW, then the remaining BWs (PipeDream-Flush / DAPPLE)
    interleaved-1f1b  v stages per rank, Megatron's interleaved order
    zb-h1             B/W split, 1F1B's order; stage s defers each W by s backward slots (Zero
                      Bubble's handcrafted ZB-H1, at 1F1B's peak memory)
    zb-h2             B/W split; a greedy list scheduler in time (after Zero Bubble's heuristic)
                      holding at most 2p-1 microbatches (ZB-H2's bubble, (p-1)(F+B-2W))
    layerpipe         1F1B with B/W split, each W right after its B (LayerPipe's intra-layer split,
                      at exactly 1F1B's per-stage memory)
    batched-w         GPipe's order, B/W split, each stage's Ws in two batches (after the first half's Bs,
                      and at the end), each run as one W over its microbatches (fxpipe.runtime.batched_w)
    async-1f1b        1F1B order, no flush: weights update after every microbatch (PipeDream)
    layerpipe-async   LayerPipe as the paper schedules it: 1F1B order, B/W split, no flush; each W runs
                      one backward slot after its B, so the gradient goes upstream without waiting for
                      W, and the update uses the delayed weight gradient
    zb-gpipe          every stage on one rank (backend="fxpipe"): all F, then B back with each W
                      deferred by one microbatch (see one_rank)
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

from fxpipe.errors import OptionError
from fxpipe.schedules.ir import Action, Kind, Schedule
from fxpipe.schedules.simulate import Costs, gc_paused


def gpipe(num_stages: int, num_microbatches: int, costs: Costs | None = None) -> Schedule:
    p, m = _check(num_stages, num_microbatches)
    ranks = tuple(tuple([Action(s, Kind.F, i) for i in range(m)] + [Action(s, Kind.BW, i) for i in range(m)])
                  for s in range(p))
    return Schedule("gpipe", p, m, tuple(range(p)), ranks)


def one_f_one_b(num_stages: int, num_microbatches: int, costs: Costs | None = None) -> Schedule:
    p, m = _check(num_stages, num_microbatches)
    return Schedule("1f1b", p, m, tuple(range(p)), tuple(tuple(_1f1b_rank(s, p, m, fused=True)) for s in range(p)))


def async_1f1b(num_stages: int, num_microbatches: int, costs: Costs | None = None) -> Schedule:
    p, m = _check(num_stages, num_microbatches)
    ranks = tuple(tuple(_1f1b_rank(s, p, m, fused=True)) for s in range(p))
    return Schedule("async-1f1b", p, m, tuple(range(p)), ranks, synchronous=False,
                    notes=("weights update after every microbatch's backward: no flush, stale weights",))


def layerpipe(num_stages: int, num_microbatches: int, costs: Costs | None = None) -> Schedule:
    """1F1B order with B and W split, each W right after its B: LayerPipe's intra-layer split at
    exactly 1F1B's per-stage memory (stage s holds p - s microbatches). Its inter-layer balance is
    the ``--balance-backward`` pass on the graphs."""
    p, m = _check(num_stages, num_microbatches)
    return Schedule("layerpipe", p, m, tuple(range(p)), tuple(_deferred_w(s, p, m, 0) for s in range(p)))


def layerpipe_async(num_stages: int, num_microbatches: int, costs: Costs | None = None) -> Schedule:
    """LayerPipe's delayed-gradient pipeline: :func:`async_1f1b`'s order with B and W split and each W one backward
    slot after its B (after the next F and B), no flush. B, which the stage before waits for, never waits for a W;
    the weight update applies W's gradient a slot later (a delayed gradient: the asynchronous weight policies read
    the versions this order implies). Stage s holds p - s + 1 microbatches at most (one more, B to W, than 1F1B)."""
    p, m = _check(num_stages, num_microbatches)
    return Schedule("layerpipe-async", p, m, tuple(range(p)), tuple(_deferred_w(s, p, m, 1) for s in range(p)),
                    synchronous=False,
                    notes=("W one backward slot after its B, weights updated after every W: no flush",))


def batched_w(num_stages: int, num_microbatches: int, costs: Costs | None = None) -> Schedule:
    """GPipe's order with B and W split and each stage's Ws run in two batches: the first half's right after the
    B that ends it, the rest at the end. The runtime runs each batch as one W over its microbatches
    (``Schedule.batch_w``; :mod:`fxpipe.runtime.batched_w`): one pass over each gradient buffer and weight-gradient
    GEMMs as deep as the batch, for stages whose W is thin (few rows a microbatch). All Fs first let the first
    stages, whose B is empty or small, run the first half's W while the later stages still send gradients; the
    second half is the step's tail (benchmarks/RESULTS.md compares it with 1F1B and zb-h2). Memory: GPipe's m
    microbatches from F to B, and up to half of them from B to W."""
    p, m = _check(num_stages, num_microbatches)
    first = (m + 1) // 2
    ranks = []
    for s in range(p):
        out = [Action(s, Kind.F, i) for i in range(m)]
        for i in range(m):
            out.append(Action(s, Kind.B, i))
            if i == first - 1:
                out += [Action(s, Kind.W, j) for j in range(first)]
        out += [Action(s, Kind.W, j) for j in range(first, m)]
        ranks.append(tuple(out))
    return Schedule("batched-w", p, m, tuple(range(p)), tuple(ranks), batch_w=True)


def _deferred_w(s: int, p: int, m: int, delay: int) -> tuple[Action, ...]:
    """1F1B's F/B order for stage s with each W run ``delay`` backward slots after its B (the rest at the end)."""
    out: list[Action] = []
    pending: list[int] = []
    for a in _1f1b_rank(s, p, m, fused=False):
        out.append(a)
        if a.kind is Kind.B:
            pending.append(a.mb)
            if len(pending) > delay:
                out.append(Action(s, Kind.W, pending.pop(0)))
    out += [Action(s, Kind.W, i) for i in pending]
    return tuple(out)


def interleaved_1f1b(num_stages: int, num_microbatches: int, costs: Costs | None = None, *,
                     stages_per_rank: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: stage s on rank s % ranks; needs microbatches to be a multiple of the ranks."""
    p_total, m = _check(num_stages, num_microbatches)
    v = stages_per_rank
    if v < 1 or p_total % v:
        raise OptionError(f"interleaved-1f1b puts {v} stages on each rank, so the stage count must be a multiple "
                          f"of {v} (stages: {p_total}); use {p_total - p_total % v or v} stages")
    p = p_total // v
    if m % p:
        raise OptionError(f"interleaved-1f1b needs the microbatches to be a multiple of the ranks "
                          f"(microbatches: {m}, ranks: {p}); use {m + p - m % p} microbatches")
    total = m * v

    def unit(r: int, k: int, kind: Kind) -> Action:
        """The k-th forward (or backward) of rank r: chunks advance every p microbatches."""
        chunk = (k // p) % v
        if kind is not Kind.F:
            chunk = v - 1 - chunk
        return Action(chunk * p + r, kind, (k // (p * v)) * p + k % p)

    ranks = []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        out = [unit(r, k, Kind.F) for k in range(warmup)]
        for k in range(total - warmup):  # steady state: one forward, one backward
            out += [unit(r, warmup + k, Kind.F), unit(r, k, Kind.BW)]
        out += [unit(r, k, Kind.BW) for k in range(total - warmup, total)]
        ranks.append(tuple(out))
    return Schedule("interleaved-1f1b", p_total, m, tuple(s % p for s in range(p_total)), tuple(ranks))


def zb_h1(num_stages: int, num_microbatches: int, costs: Costs | None = None) -> Schedule:
    """Zero Bubble's ZB-H1: 1F1B's F/B order, stage s running each W s backward slots after its B.

    The Ws of later stages fill the slots where 1F1B waits for gradients; every stage holds at
    most p microbatches between F and W (1F1B's peak, on stage 0). Bubble: (p-1)(F+B-W).
    """
    p, m = _check(num_stages, num_microbatches)
    return Schedule("zb-h1", p, m, tuple(range(p)), tuple(_deferred_w(s, p, m, s) for s in range(p)))


def zb_h2(num_stages: int, num_microbatches: int, costs: Costs | None = None) -> Schedule:
    """Zero Bubble's ZB-H2 (bubble (p-1)(F+B-2W), none when the three are equal): the greedy list
    scheduler with every stage holding at most 2p - 1 microbatches between F and W (under twice
    1F1B's peak of p). Needs m >= 2p - 1 microbatches to fill the warm-up."""
    p, m = _check(num_stages, num_microbatches)
    return zero_bubble(p, m, costs, limits=[2 * p - 1] * p, name="zb-h2")


def zero_bubble(p: int, m: int, costs: Costs | None, *, limits: list[int], name: str) -> Schedule:
    """A greedy list scheduler in simulated time: B first, then F (within the memory limit), then W.

    A rank that is free picks the ready B of its oldest microbatch (it unblocks the stage before),
    else the next F if fewer than ``limits[s]`` microbatches are between F and W, else a pending
    W; with nothing ready it waits for the next arrival. W only ever fills time that would
    otherwise be idle, or makes room under the memory limit.
    """
    costs = costs or Costs.uniform(p, 1.0, 1.0, 1.0)
    done: dict[Action, float] = {}
    order: list[list[Action]] = [[] for _ in range(p)]
    next_f = [0] * p
    next_b = [0] * p
    pending_w: list[list[int]] = [[] for _ in range(p)]
    in_flight = [0] * p
    heap = [(0.0, s) for s in range(p)]
    waiting = [math.inf] * p  # when an idle stage's next input arrives (inf: not known yet, or not idle)
    remaining = 3 * p * m

    def arrival(a: Action) -> float | None:
        """When the inputs of ``a`` are on its rank, or None if not known yet."""
        s, mb = a.stage, a.mb
        if a.kind is Kind.F:
            if s == 0:
                return 0.0
            prev = done.get(Action(s - 1, Kind.F, mb))
            return None if prev is None else prev + costs.transfer(s - 1)
        own = done.get(Action(s, Kind.F, mb))
        if own is None:
            return None
        if s == p - 1:
            return own
        nxt = done.get(Action(s + 1, Kind.B, mb))
        return None if nxt is None else max(own, nxt + costs.transfer(s))

    while remaining:
        t, s = heapq.heappop(heap)
        choice: Action | None = None
        wake: list[float] = []
        # B first, then F (within the in-flight limit): the first whose input has arrived runs.
        candidates = [Action(s, Kind.B, next_b[s])] if next_b[s] < m else []
        if next_f[s] < m and in_flight[s] < limits[s]:
            candidates.append(Action(s, Kind.F, next_f[s]))
        for a in candidates:
            at = arrival(a)
            if at is not None and at <= t:
                choice = a
                break
            if at is not None:
                wake.append(at)
        if choice is None and pending_w[s]:
            choice = Action(s, Kind.W, pending_w[s].pop(0))
        if choice is None:
            # the next time anything can change: an action ending, or an input arriving on any idle stage
            waiting[s] = min((x for x in wake if x > t), default=math.inf)
            later = [u for u, _ in heap if u > t] + [x for x in waiting if t < x < math.inf]
            # after every other stage at t; nextafter where t + 1e-9 rounds back to t (t >= ~1e7)
            heapq.heappush(heap, (min(later) if later else max(t + 1e-9, math.nextafter(t, math.inf)), s))
            continue
        waiting[s] = math.inf
        end = t + costs.time(choice)
        done[choice] = end
        order[s].append(choice)
        remaining -= 1
        if choice.kind is Kind.F:
            next_f[s] += 1
            in_flight[s] += 1
        elif choice.kind is Kind.B:
            next_b[s] += 1
            pending_w[s].append(choice.mb)
        else:
            in_flight[s] -= 1
        if remaining:
            heapq.heappush(heap, (end, s))
    return Schedule(name, p, m, tuple(range(p)), tuple(tuple(r) for r in order),
                    notes=(f"memory limit per stage (microbatches between F and W): {limits}",))


def one_rank(num_stages: int, num_microbatches: int, *, defer_w: bool = True) -> Schedule:
    """Every stage on one rank (``backend="fxpipe"``): all F, microbatch by microbatch; then each
    microbatch's B from the last stage to the first, stage s running W of the previous microbatch
    right after its B (``zb-gpipe``: W fills the gap while the gradient travels) or, with
    ``defer_w=False``, its own W at once (``gpipe-one-rank``)::

        zb-gpipe, 2 stages, 2 microbatches:  0F0 1F0 0F1 1F1 | 1B0 0B0 1B1 1W0 0B1 0W0 1W1 0W1
    """
    p, m = _check(num_stages, num_microbatches)
    out = [Action(s, Kind.F, i) for i in range(m) for s in range(p)]
    pending: list[Action] = []
    for i in range(m):
        for s in reversed(range(p)):
            out.append(Action(s, Kind.B, i))
            pending.append(Action(s, Kind.W, i))
            ready = [w for w in pending if w.stage == s and (not defer_w or w.mb < i)]
            out += ready
            pending = [w for w in pending if w not in ready]
    out += pending
    name = "zb-gpipe" if defer_w else "gpipe-one-rank"
    return Schedule(name, p, m, (0,) * p, (tuple(out),))


GENERATORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
    "layerpipe": layerpipe,
    "batched-w": batched_w,
    "async-1f1b": async_1f1b,
    "layerpipe-async": layerpipe_async,
}


@gc_paused()  # a long schedule is millions of actions with no cycles to collect
def generate(name: str, num_stages: int, num_microbatches: int, costs: Costs | None = None) -> Schedule:
    if name not in GENERATORS:
        raise OptionError(f"unknown schedule {name!r} (known: {', '.join([*GENERATORS, 'auto'])}); pick one of those")
    return GENERATORS[name](num_stages, num_microbatches, costs)


def _1f1b_rank(s: int, p: int, m: int, *, fused: bool) -> list[Action]:
    warmup = min(p - s - 1, m)
    backward = Kind.BW if fused else Kind.B
    out = [Action(s, Kind.F, i) for i in range(warmup)]
    for i in range(m - warmup):
        out.append(Action(s, Kind.F, warmup + i))
        out.append(Action(s, backward, i))
    out += [Action(s, backward, i) for i in range(m - warmup, m)]
    return out


def _check(num_stages: int, num_microbatches: int) -> tuple[int, int]:
    if num_stages < 1:
        raise OptionError(f"a schedule needs at least 1 stage (stages: {num_stages})")
    if num_microbatches < 1:
        raise OptionError(f"a schedule needs at least 1 microbatch (microbatches: {num_microbatches})")
    return num_stages, num_microbatches
