"""Which weight version each phase of an asynchronous schedule reads, per weight policy.

In an asynchronous schedule a stage applies its optimizer after every microbatch's weight
gradient (W, or the fused backward BW), in its rank's order, with no flush. Version v of stage s
is its weights after v updates. For each (stage, microbatch) the schedule fixes four counts:

    f  updates of the stage before its F           b  ... before its B (or BW)
    w  updates before its W (or BW)                 (its own update makes version w + 1)

A policy says what each phase reads, as ``Read(version, ahead)``: the stage's weights at
``version``, extrapolated ``ahead`` updates further (SpecTrain's prediction) when ``ahead > 0``:

    stale    F: (f, 0)    B: (b, 0)        W: (w, 0)        whatever is current (naive asynchronous)
    stash    F: (f, 0)    B: (f, 0)        W: (f, 0)        PipeDream: B and W use F's version
    predict  F: (f, b-f)  B: (b, w-b)      W: (b, w-b)      SpecTrain: F predicts the weights its
                                                             backward will meet, B the weights its
                                                             update will be applied to

With B and W split apart (zero-bubble orders), a deferred W computes the gradient from what B
handed over and from F's saved tensors, so under ``stash`` and ``predict`` it reads B's weights
(the same tensors); under ``stale`` a W that reads a weight reads the current one. Everything here
is read off the schedule itself, not from a closed formula, so it holds for any order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fxpipe.errors import OptionError
from fxpipe.report import Report
from fxpipe.schedules.ir import Kind, Schedule

POLICIES = ("stale", "stash", "predict")
PHASES = ("F", "B", "W")


@dataclass(frozen=True)
class Timing:
    """Updates of one stage applied before a microbatch's F, B (or BW) and W (or BW)."""

    f: int
    b: int
    w: int


@dataclass(frozen=True)
class Read:
    """The weights a phase reads: version ``version``, predicted ``ahead`` updates further."""

    version: int
    ahead: int = 0


def timings(schedule: Schedule) -> dict[tuple[int, int], Timing]:
    """Per (stage, microbatch), the stage's update count before each phase, in its rank's order."""
    out: dict[tuple[int, int], Timing] = {}
    for actions in schedule.ranks:
        updates: dict[int, int] = {}
        seen: dict[tuple[int, int], dict[str, int]] = {}
        for a in actions:
            if a.kind not in (Kind.F, Kind.B, Kind.W, Kind.BW):
                continue
            n = updates.get(a.stage, 0)
            entry = seen.setdefault((a.stage, a.mb), {})
            if a.kind is Kind.F:
                entry["f"] = n
            elif a.kind is Kind.B:
                entry["b"] = n
            else:  # W or BW: the microbatch's update comes right after it
                entry["w"] = n
                entry.setdefault("b", n)
                updates[a.stage] = n + 1
        for key, entry in seen.items():
            out[key] = Timing(entry["f"], entry["b"], entry["w"])
    return out


def reads(schedule: Schedule, policy: str) -> dict[tuple[int, int, str], Read]:
    """Per (stage, microbatch, phase), the weights ``policy`` makes it read (see the module docstring)."""
    if policy not in POLICIES:
        raise OptionError(f"unknown weight policy {policy!r}; use one of {', '.join(POLICIES)}")
    out: dict[tuple[int, int, str], Read] = {}
    for (s, m), t in timings(schedule).items():
        if policy == "stale":
            phases = (Read(t.f), Read(t.b), Read(t.w))
        elif policy == "stash":
            phases = (Read(t.f), Read(t.f), Read(t.f))
        else:
            phases = (Read(t.f, t.b - t.f), Read(t.b, t.w - t.b), Read(t.b, t.w - t.b))
        for phase, r in zip(PHASES, phases):
            out[(s, m, phase)] = r
    return out


def versions_kept(schedule: Schedule, policy: str) -> dict[int, int]:
    """Per stage, the most weight versions held at once besides the live weights.

    ``stash`` keeps F's version of every microbatch in flight (versions shared by microbatches
    whose F met the same one); ``predict`` keeps one predicted copy per microbatch from an F that
    looks ahead until its B, and from a B that looks ahead until its W; ``stale`` keeps none.
    """
    if policy == "stale":
        return {s: 0 for s in range(schedule.num_stages)}
    times = timings(schedule)
    out: dict[int, int] = {}
    for actions in schedule.ranks:
        held: dict[int, dict[int, set[object]]] = {}  # stage -> microbatch -> keys it holds
        for a in actions:
            if a.kind not in (Kind.F, Kind.B, Kind.W, Kind.BW):
                continue
            t = times[(a.stage, a.mb)]
            mine = held.setdefault(a.stage, {})
            if policy == "stash":
                if a.kind is Kind.F:
                    mine[a.mb] = {t.f}
                elif a.kind in (Kind.W, Kind.BW):
                    mine.pop(a.mb, None)
            else:  # a predicted copy only where the phase looks ahead
                if a.kind is Kind.F:
                    mine[a.mb] = {("f", a.mb)} if t.b > t.f else set()
                elif a.kind is Kind.B:
                    mine[a.mb] = {("b", a.mb)} if t.w > t.b else set()
                else:
                    mine.pop(a.mb, None)
            live = set().union(*mine.values()) if mine else set()
            out[a.stage] = max(out.get(a.stage, 0), len(live))
    return out


def held_peaks_with_versions(schedule: Schedule, policy: str, held_fb: Sequence[float], held_bw: Sequence[float],
                             weight_bytes: Sequence[float]) -> tuple[float, ...]:
    """Per stage, the peak bytes held running ``schedule`` under weight policy ``policy``: the
    activations as ``fxpipe.planning.cost.held_peaks`` counts them, plus ``weight_bytes[s]`` per
    copy of stage s's parameters the policy keeps for its microbatches in flight:

    - ``stash``: each distinct version its microbatches in flight (F run, W or BW not yet) read in
      their F; microbatches whose F met the same version share one snapshot;
    - ``predict``: one predicted copy per microbatch from an F that looks ahead until its B, and
      from a B that looks ahead until its W (each prediction is its own tensors);
    - ``stale``: none.

    What the runtime's ``HeldBytes`` measures (it holds the copies under the microbatch, shared
    storages once).

    >>> from fxpipe.schedules.generators import generate
    >>> sched = generate("async-1f1b", 2, 4)
    >>> held_peaks_with_versions(sched, "stash", [10.0, 10.0], [4.0, 4.0], [100.0, 100.0])
    (220.0, 110.0)
    >>> held_peaks_with_versions(sched, "stale", [10.0, 10.0], [4.0, 4.0], [100.0, 100.0])
    (20.0, 10.0)
    """
    if policy not in POLICIES:
        raise OptionError(f"unknown weight policy {policy!r}; use one of {', '.join(POLICIES)}")
    times = timings(schedule)
    n = schedule.num_stages
    level, copies, peak = [0.0] * n, [0] * n, [0.0] * n
    readers: list[dict[int, int]] = [{} for _ in range(n)]  # stash: stage -> version -> microbatches in flight
    ahead: dict[tuple[int, int], int] = {}  # predict: (stage, mb) -> predicted copies it holds (0 or 1)
    for actions in schedule.ranks:
        for a in actions:
            s, kind = a.stage, a.kind
            if kind not in (Kind.F, Kind.B, Kind.W, Kind.BW):
                continue
            t = times[(s, a.mb)]
            if kind is Kind.F:
                level[s] += held_fb[s]
            elif kind is Kind.B:
                level[s] += held_bw[s] - held_fb[s]
            else:
                level[s] -= held_bw[s] if kind is Kind.W else held_fb[s]
            if policy == "stash":
                mine = readers[s]
                if kind is Kind.F:
                    mine[t.f] = mine.get(t.f, 0) + 1
                elif kind is not Kind.B:
                    mine[t.f] -= 1
                    if not mine[t.f]:
                        del mine[t.f]
                copies[s] = len(mine)
            elif policy == "predict":
                had = ahead.pop((s, a.mb), 0)
                now = int(t.b > t.f) if kind is Kind.F else int(t.w > t.b) if kind is Kind.B else 0
                if now:
                    ahead[(s, a.mb)] = now
                copies[s] += now - had
            peak[s] = max(peak[s], level[s] + copies[s] * weight_bytes[s])
    return tuple(peak)


def memory_report(schedule: Schedule, param_bytes: Sequence[float]) -> Report:
    """Per policy and stage: the weight versions kept besides the live weights, and their bytes
    (``param_bytes[s]``: stage s's parameter bytes)."""
    rows = []
    for policy in POLICIES:
        kept = versions_kept(schedule, policy)
        for s in range(schedule.num_stages):
            rows.append((policy, s, kept.get(s, 0), round(kept.get(s, 0) * param_bytes[s] / 2**20, 3)))
    return Report(
        title="weights: versions per stage",
        columns=("policy", "stage", "versions kept", "extra MiB"),
        rows=tuple(rows),
        notes=(f"{schedule.name}, {schedule.num_stages} stages, {schedule.num_microbatches} microbatches: besides the "
               "live weights, stash keeps the version each microbatch in flight read in its F (shared by microbatches "
               "that read the same one) and predict one predicted copy per microbatch whose F or B looks ahead",),
    )
