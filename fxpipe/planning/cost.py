"""The cost model the partitioner and the simulator share: link time, and memory in flight per schedule.

Memory in flight counts, per stage, the microbatches whose activations a schedule keeps alive:
between F and B (the F->B activations B reads) and between B and W (the B->W handover, plus the
saved values W reads, that a deferred W keeps). A fused BW frees both at once. Under 1F1B with
4 stages, stage 0 runs ``F0 F1 F2 F3 BW0 F4 BW1 ...`` and so holds 4 microbatches at its peak;
ZB-H1 keeps 1F1B's F/B order but runs stage s's W s backward slots late:

    stage 1 of 4 under zb-h1, m = 8 (fb, bw = microbatches held after each action)
        F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 ...
    fb   1  2  3  2  3  2  2  3  2  2
    bw   0  0  0  1  1  2  1  1  2  1           peak: fb 3, bw 2, fb + bw 4 = p

Every closed form here is exact against ``fxpipe.schedules.simulate`` (tests/planning/test_cost.py
simulates every schedule over a grid of stage and microbatch counts).

Data parallelism (dp replicas of every stage) adds two things: each stage's gradients are
all-reduced over its dp group once per step, in buckets, by a ring (``allreduce_seconds``), and a
rank holds its stages' parameters, gradients and optimizer state besides the activations in flight
(``static_memory``, ``rank_memory``); the microbatch shape, so the activations, do not change with dp.
A stage that recomputes its forward keeps only its inputs from F to B (``recomputed``);
``recompute_stages`` picks the fewest such stages that bring every stage under a memory cap.
Pure functions on plain values; no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from fxpipe.errors import OptionError, PlanError

__all__ = [
    "BUCKET_BYTES",
    "OPTIMIZER_STATE",
    "OPTIMIZER_TRAFFIC",
    "SCHEDULES",
    "InFlight",
    "activation_memory",
    "allreduce_buckets",
    "allreduce_bucket_seconds",
    "allreduce_seconds",
    "held_peaks",
    "optimizer_step_seconds",
    "in_flight",
    "recompute_stages",
    "recomputed",
    "limited_in_flight",
    "rank_memory",
    "static_memory",
    "transfer_time",
]

BUCKET_BYTES = 25 * 2**20
"""The largest gradient bucket all-reduced at once: DDP's ``bucket_cap_mb=25`` (25 MiB)."""

OPTIMIZER_STATE: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}
"""Optimizer state per parameter byte: none for plain SGD, a momentum buffer, Adam's two moments."""

OPTIMIZER_TRAFFIC: dict[str, int] = {"sgd": 3, "momentum": 5, "adam": 7, "adamw": 7}
"""Bytes an optimizer step reads and writes per parameter byte: the parameter, its gradient and its state
read, the parameter and the state written (SGD: p, g in, p out; momentum adds the buffer in and out). One pass, as
torch's fused kernels make it, which ``fxpipe run`` steps (``fxpipe.runtime.optim.fusable``)."""


def optimizer_step_seconds(param_bytes: float, optimizer: str, mem_bw: float) -> float:
    """Seconds of one optimizer step over ``param_bytes``: a memory-bound pass (``OPTIMIZER_TRAFFIC``) at ``mem_bw``.

    >>> optimizer_step_seconds(1e9, "momentum", 1e10)
    0.5
    """
    traffic = OPTIMIZER_TRAFFIC.get(optimizer)
    if traffic is None:
        raise OptionError(f"no step-time model for optimizer {optimizer!r} (known: {', '.join(OPTIMIZER_TRAFFIC)}); "
                          "pick one of those")
    return traffic * param_bytes / mem_bw


def transfer_time(nbytes: float, *, bandwidth: float, latency: float) -> float:
    """Seconds to send ``nbytes`` over one link: ``latency + nbytes / bandwidth``; nothing sent
    costs nothing, not even latency.

    >>> transfer_time(100, bandwidth=50.0, latency=0.5), transfer_time(0, bandwidth=1.0, latency=3.0)
    (2.5, 0.0)
    """
    if nbytes == 0:
        return 0.0
    return latency + nbytes / bandwidth


def allreduce_buckets(nbytes: float, bucket_bytes: float = BUCKET_BYTES) -> tuple[float, ...]:
    """The buckets ``nbytes`` of gradients are all-reduced in: full ones of ``bucket_bytes``, the rest last.

    The fewest buckets any packing can make; a runtime that packs whole parameters may make more.

    >>> allreduce_buckets(60, bucket_bytes=25), allreduce_buckets(0)
    ((25, 25, 10), ())
    """
    if not bucket_bytes > 0:
        raise OptionError(f"the all-reduce bucket must hold at least one byte (bucket_bytes: {bucket_bytes})")
    if nbytes <= 0:
        return ()
    full, rest = divmod(nbytes, bucket_bytes)
    return (bucket_bytes,) * int(full) + ((rest,) if rest > 0 else ())


def allreduce_bucket_seconds(nbytes: float, dp: int, bandwidth: float, latency: float,
                             bucket_bytes: float = BUCKET_BYTES) -> tuple[float, ...]:
    """Seconds of each bucket's ring all-reduce over ``dp`` ranks: ``2(d-1)/d x bytes / bandwidth + 2(d-1) x latency``.

    A ring all-reduce is a reduce-scatter and an all-gather, each d - 1 steps that send 1/d of
    the bucket to the next rank; nothing to reduce (dp = 1, or no bytes) costs nothing.

    >>> allreduce_bucket_seconds(60, 2, bandwidth=10.0, latency=0.5, bucket_bytes=25)
    (3.5, 3.5, 2.0)
    """
    if dp < 1:
        raise OptionError(f"data parallelism needs at least 1 replica (dp: {dp})")
    if dp == 1:
        return ()
    steps = 2 * (dp - 1)
    return tuple(steps / dp * b / bandwidth + steps * latency for b in allreduce_buckets(nbytes, bucket_bytes))


def allreduce_seconds(nbytes: float, dp: int, bandwidth: float, latency: float,
                      bucket_bytes: float = BUCKET_BYTES) -> float:
    """Seconds to all-reduce ``nbytes`` of gradients over ``dp`` ranks, bucket after bucket (ring).

    >>> allreduce_seconds(60, 2, bandwidth=10.0, latency=0.5, bucket_bytes=25), allreduce_seconds(60, 1, 10.0, 0.5)
    (9.0, 0.0)
    """
    return float(sum(allreduce_bucket_seconds(nbytes, dp, bandwidth, latency, bucket_bytes)))


def static_memory(param_bytes: float, optimizer: str = "sgd") -> float:
    """Bytes a rank holds for ``param_bytes`` of trainable parameters whatever the schedule: the
    parameters, their gradients (the flat all-reduce buckets are the gradients, not a copy) and
    the optimizer's state.

    >>> static_memory(100.0, "sgd"), static_memory(100.0, "momentum"), static_memory(100.0, "adam")
    (200.0, 300.0, 400.0)
    """
    state = OPTIMIZER_STATE.get(optimizer)
    if state is None:
        raise OptionError(f"no memory model for optimizer {optimizer!r} (known: {', '.join(OPTIMIZER_STATE)}); "
                          "pick one of those")
    return (2 + state) * param_bytes


def rank_memory(param_bytes: float, activation_bytes: float, optimizer: str = "sgd") -> float:
    """Peak bytes of one rank: its ``static_memory`` plus its peak activations in flight (``activation_memory``,
    or the simulator's ``RankStats.peak_memory``). The same for every dp replica: dp multiplies
    the batch by adding microbatches on other ranks, not by making them larger.

    >>> rank_memory(100.0, 30.0, "adam")
    430.0
    """
    return static_memory(param_bytes, optimizer) + activation_bytes


@dataclass(frozen=True)
class InFlight:
    """Microbatches one stage holds at once, at its peak, under one schedule.

    ``fb``: the most whose F->B activations it holds (F done, B or BW not yet).
    ``bw``: the most whose B->W bytes it holds (B done, W not yet): what deferred W keeps.
    ``total``: the most between F and the end of their backward, both kinds together.

    ``fb + bw`` can exceed ``total``: the two peaks need not coincide. Every schedule here peaks
    on the line ``fb' + bw' == total``, from ``(fb, total - fb)`` to ``(total - bw, bw)``, so
    ``memory`` (the larger end) is the stage's exact peak for any bytes per microbatch.
    """

    fb: int
    bw: int
    total: int

    def memory(self, held_fb: float, held_bw: float) -> float:
        """Peak bytes of a stage keeping ``held_fb`` bytes per microbatch from F to B and
        ``held_bw`` from B to W.

        >>> InFlight(fb=3, bw=2, total=4).memory(10.0, 1.0)   # 3 x 10 + 1 x 1
        31.0
        """
        return max(self.fb * held_fb + (self.total - self.fb) * held_bw,
                   (self.total - self.bw) * held_fb + self.bw * held_bw)


def _gpipe(p: int, m: int) -> list[InFlight]:
    # Every F before any BW: each stage holds all m microbatches.
    return [InFlight(m, 0, m) for _ in range(p)]


def _one_f_one_b(p: int, m: int) -> list[InFlight]:
    # p - s - 1 warm-up Fs, then one F before each BW: p - s at once (fewer if m is smaller).
    return [InFlight(min(p - s, m), 0, min(p - s, m)) for s in range(p)]


def _layerpipe(p: int, m: int) -> list[InFlight]:
    # 1F1B with each W right after its B: that one microbatch moves from F->B to B->W.
    return [InFlight(min(p - s, m), 1, min(p - s, m)) for s in range(p)]


def _layerpipe_async(p: int, m: int) -> list[InFlight]:
    # 1F1B with each W one backward slot after its B: two microbatches between B and W right after a B,
    # one more in flight than 1F1B.
    return [InFlight(min(p - s, m), min(2, m), min(p - s + 1, m)) for s in range(p)]


def _batched_w(p: int, m: int) -> list[InFlight]:
    # GPipe's order: all m from F to B before the first B; the first half's Ws run once its Bs have, so at most
    # ceil(m/2) from B to W.
    return [InFlight(m, (m + 1) // 2, m) for _ in range(p)]


def _zb_h1(p: int, m: int) -> list[InFlight]:
    # 1F1B's F/B order; stage s keeps s Ws pending, s + 1 right after a B. Whatever the stage,
    # F->B and B->W together reach p: 1F1B's stage-0 peak on every stage.
    return [InFlight(min(p - s, m), min(s + 1, m), min(p, m)) for s in range(p)]


def _zb_h2(p: int, m: int) -> list[InFlight]:
    # The greedy with a limit of 2p - 1 microbatches between F and W, for equal F, B and W
    # times: stage s runs 2(p - s) - 1 Fs before its first B arrives; each later stage turns two
    # more of its 2p - 1 into pending Ws (at most p + s of them). The last line: when m is
    # short of the limit, every stage still holds one W after a B.
    return [InFlight(min(m, 2 * (p - s) - 1), max(1, min(m - 2 * (p - s) + 2, p + s)), min(m, 2 * p - 1))
            for s in range(p)]


def _interleaved_1f1b(num_stages: int, m: int) -> list[InFlight]:
    # Two stages per rank: stage s = chunk * p + r on rank r. Rank r runs 2(p - r - 1) + p
    # warm-up Fs; its second chunk's stage holds up to p of them (less near the last rank), its
    # first chunk's up to p more.
    if num_stages % 2:
        raise OptionError(f"interleaved-1f1b puts 2 stages on each rank, so the stage count must be a multiple "
                          f"of 2 (stages: {num_stages}); use {num_stages + 1} stages")
    p = num_stages // 2
    if m % p:
        raise OptionError(f"interleaved-1f1b needs the microbatches to be a multiple of the ranks "
                          f"(microbatches: {m}, ranks: {p}); use {m + p - m % p} microbatches")
    last = [min(m, p, 2 * (p - r) - 1) for r in range(p)]
    first = [min(m, p + min(p, 2 * (p - r) - 1)) for r in range(p)]
    return [InFlight(n, 0, n) for n in first + last]


_FORMS: dict[str, Callable[[int, int], list[InFlight]]] = {
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "interleaved-1f1b": _interleaved_1f1b,
    "zb-h1": _zb_h1,
    "zb-h2": _zb_h2,
    "layerpipe": _layerpipe,
    "batched-w": _batched_w,
    "async-1f1b": _one_f_one_b,  # 1F1B's order; only when weights update differs
    "layerpipe-async": _layerpipe_async,
}

SCHEDULES: tuple[str, ...] = tuple(_FORMS)
"""Every schedule name with a closed form: the generators of ``fxpipe.schedules.generators``."""


def in_flight(schedule: str, num_stages: int, microbatches: int) -> tuple[InFlight, ...]:
    """Per stage, the microbatches ``schedule`` keeps in flight at its peak (k = min(p - s, m)):

        schedule          fb                  bw                              total
        gpipe             m                   0                               m
        1f1b, async-1f1b  k                   0                               k
        layerpipe         k                   1                               k
        layerpipe-async   k                   min(2, m)                       min(k + 1, m)
        batched-w         m                   ceil(m/2)                       m
        zb-h1             k                   min(s + 1, m)                   min(p, m)
        zb-h2             min(m, 2(p-s)-1)    max(1, min(m-2(p-s)+2, p+s))    min(m, 2p - 1)
        interleaved-1f1b  stage s = c * (p/2) + r on rank r, with q = p/2 ranks:
                          c = 1: min(m, q, 2(q-r)-1); c = 0: min(m, q + min(q, 2(q-r)-1)); bw 0

    Exact against the simulator for every schedule's generated order. Two caveats:

    - zb-h2's order depends on the F/B/W times; these are for equal times (its generator's
      default). With other times only ``total <= min(m, 2p - 1)`` holds (its memory limit), and
      ``limited_in_flight(p, m, 2 * p - 1)`` is the bound for any times.
    - interleaved-1f1b's two stages on a rank need not peak together: the rank's peak is at
      most the sum of its stages' (equal when m = p; with m >= 2p the rank peaks at
      3q - 2r - 1 microbatches, one or more below the sum).

    >>> [(f.fb, f.bw, f.total) for f in in_flight("zb-h1", 3, 8)]
    [(3, 1, 3), (2, 2, 3), (1, 3, 3)]

    Raises: OptionError for an unknown schedule, fewer than 1 stage or microbatch, or counts
    interleaved-1f1b cannot take.
    """
    form = _FORMS.get(schedule)
    if form is None:
        raise OptionError(f"no memory model for schedule {schedule!r} (known: {', '.join(SCHEDULES)}); "
                          "pick one of those")
    _check_counts(num_stages, microbatches)
    return tuple(form(num_stages, microbatches))


def limited_in_flight(num_stages: int, microbatches: int, limit: int) -> tuple[InFlight, ...]:
    """Per stage, a bound for the zero-bubble list scheduler run with ``limit`` microbatches
    between F and W (``fxpipe.schedules.generators.zero_bubble``), whatever the F/B/W times:
    at most ``min(m, limit)`` in flight, all of them of either kind.

    >>> limited_in_flight(2, 3, 4)
    (InFlight(fb=3, bw=3, total=3), InFlight(fb=3, bw=3, total=3))
    """
    _check_counts(num_stages, microbatches)
    if limit < 1:
        raise OptionError(f"the in-flight limit must be at least 1 microbatch (limit: {limit})")
    n = min(microbatches, limit)
    return tuple(InFlight(n, n, n) for _ in range(num_stages))


def activation_memory(schedule: str, microbatches: int, held_fb: Sequence[float],
                      held_bw: Sequence[float]) -> tuple[float, ...]:
    """Per stage, the peak bytes of activations ``schedule`` keeps alive: stage s holds
    ``held_fb[s]`` bytes per microbatch from F to B and ``held_bw[s]`` from B to W.

    Exact for each stage (see ``in_flight`` for zb-h2 under unequal times, and for
    interleaved-1f1b's ranks, whose peak is at most the sum of their two stages').

    >>> activation_memory("1f1b", 8, [10.0, 10.0], [4.0, 4.0])
    (20.0, 10.0)
    >>> activation_memory("zb-h1", 8, [10.0, 10.0], [4.0, 4.0])
    (20.0, 14.0)

    Raises: OptionError as ``in_flight`` does, or when the two byte lists differ in length.
    """
    if len(held_fb) != len(held_bw):
        raise OptionError(f"held_fb and held_bw need one value per stage each "
                          f"(held_fb: {len(held_fb)} values, held_bw: {len(held_bw)}); pass as many of each")
    flights = in_flight(schedule, len(held_fb), microbatches)
    return tuple(f.memory(a, b) for f, a, b in zip(flights, held_fb, held_bw))


def held_peaks(actions: Iterable[tuple[int, str]], held_fb: Sequence[float],
               held_bw: Sequence[float]) -> tuple[float, ...]:
    """Per stage, the peak bytes held when the stages run ``actions`` (``(stage, kind)``) in this order:
    F keeps ``held_fb[s]``, B trades it for ``held_bw[s]``, W frees that, BW frees ``held_fb[s]``;
    other kinds (sends, receives) hold nothing.

    A stage's peak depends only on the order of its own actions, which every valid run keeps (its
    rank runs them in list order): so it is the simulator's accounting (``RankStats.peak_memory``,
    per stage rather than per rank), and what the runtime's ``HeldBytes`` measures.

    >>> held_peaks([(0, "F"), (0, "F"), (0, "B"), (0, "W"), (0, "B"), (0, "W")], [10.0], [4.0])
    (20.0,)
    """
    level = [0.0] * len(held_fb)
    peak = [0.0] * len(held_fb)
    for s, kind in actions:
        if kind == "F":
            level[s] += held_fb[s]
        elif kind == "B":
            level[s] += held_bw[s] - held_fb[s]
        elif kind == "W":
            level[s] -= held_bw[s]
        elif kind == "BW":
            level[s] -= held_fb[s]
        peak[s] = max(peak[s], level[s])
    return tuple(peak)


def recomputed(held_fb: Sequence[float], held_in: Sequence[float], stages: Iterable[int]) -> tuple[float, ...]:
    """``held_fb`` with each of ``stages`` keeping only its inputs (``held_in[s]``) from F to B: its forward is
    recomputed just before its B, so F keeps nothing else. B to W is unchanged (W reads what the recompute made).

    >>> recomputed([10.0, 8.0], [2.0, 3.0], [1])
    (10.0, 3.0)
    """
    again = set(stages)
    bad = sorted(s for s in again if not 0 <= s < len(held_fb))
    if bad:
        raise OptionError(f"stage {bad[0]} cannot recompute: there are {len(held_fb)} stages; name stages 0 .. "
                          f"{len(held_fb) - 1}")
    if again and len(held_in) != len(held_fb):
        raise OptionError(f"held_in needs one value per stage (values: {len(held_in)}, stages: {len(held_fb)}); "
                          "pass the stages' input bytes")
    return tuple(float(held_in[s]) if s in again else float(x) for s, x in enumerate(held_fb))


def recompute_stages(actions: Sequence[tuple[int, str]], held_fb: Sequence[float], held_bw: Sequence[float],
                     held_in: Sequence[float], cap: float | None, static: Sequence[float] = ()) -> tuple[int, ...]:
    """The fewest stages to recompute so that every stage fits ``cap`` bytes when the stages run ``actions``:
    its ``static[s]`` bytes (parameters, gradients, optimizer state; none if not given) plus its held peak
    (``held_peaks``). A stage's peak depends on its own held bytes alone, so exactly the stages over the cap
    recompute, and only those whose peak recomputing lowers. No cap: none.

    >>> acts = [(0, "F"), (0, "F"), (0, "B"), (0, "W"), (0, "B"), (0, "W")]
    >>> recompute_stages(acts, [10.0], [4.0], [2.0], 15.0), recompute_stages(acts, [10.0], [4.0], [2.0], 25.0)
    ((0,), ())

    Raises: PlanError naming the first stage over the cap even when it recomputes.
    """
    if cap is None:
        return ()
    actions = list(actions)
    static = static or (0.0,) * len(held_fb)
    plain = held_peaks(actions, held_fb, held_bw)
    again = held_peaks(actions, recomputed(held_fb, held_in, range(len(held_fb))), held_bw)
    chosen = []
    for s, (kept, less, fixed) in enumerate(zip(plain, again, static)):
        if fixed + kept <= cap:
            continue
        if fixed + less > cap:
            raise PlanError(f"stage {s} needs {fixed + min(kept, less):.0f} bytes even with its forward recomputed "
                            f"({fixed:.0f} of parameters and optimizer state, {min(kept, less):.0f} of activations), "
                            f"over the memory cap of {cap:.0f} bytes; raise the cap, or use more stages or fewer "
                            "microbatches in flight")
        chosen.append(s)
    return tuple(chosen)


def _check_counts(num_stages: int, microbatches: int) -> None:
    if num_stages < 1:
        raise OptionError(f"a schedule needs at least 1 stage (stages: {num_stages})")
    if microbatches < 1:
        raise OptionError(f"a schedule needs at least 1 microbatch (microbatches: {microbatches})")
