"""Which weight version each phase of an asynchronous schedule reads, per weight policy.

In an asynchronous schedule a stage applies its optimizer after every microbatch's weight
gradient (W, or the fused backward BW), in its rank's order, with no flush. Version v of stage s
is its weights after v updates. For each (stage, microbatch) the schedule fixes f, b and w: the
stage's updates before its F, its B (or BW) and its W (or BW); its own update makes w + 1.
A policy says what each phase reads, as ``Read(version, ahead)``: the weights at ``version``,
extrapolated ``ahead`` updates further (SpecTrain's prediction) when ``ahead > 0``:

    stale               F: (f, 0)          B: (b, 0)          W: (w, 0)     whatever is current
    stash               F: (f, 0)          B: (f, 0)          W: (f, 0)     PipeDream: F's version
    predict             F: (f, w-f+k//2)   B: (b, w-b+k//2)   W: (w, k//2)  SpecTrain's paper version
    predict-consistent  F: (f, w-f)        B: (b, w-b)        W: (w, 0)     its consistent variant

``predict`` (the default prediction) aims every phase of stage k at the version current when the
microbatch completes, k//2 updates after its own (1F1B: forward s = k//2 + N-k-1, backward
s = k//2, the paper's distances); ``predict-consistent`` aims F and B at the version the
microbatch's update is applied to (forward s = N-k-1; 1F1B's fused backward then reads the live
weights). Each phase predicts when it runs and drops the prediction after, so no copy is kept
between actions. The distances are read off the schedule, so they hold for any order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fxpipe.errors import OptionError
from fxpipe.report import Report
from fxpipe.schedules.ir import Kind, Schedule

POLICIES = ("stale", "stash", "predict", "predict-consistent")
PREDICT = ("predict", "predict-consistent")
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


def completion_lag(stage: int) -> int:
    """SpecTrain's floor(k/2): updates stage k applies between a microbatch's backward there and its completion
    (the backward of stage 0), one per F/B pair while the gradient travels k stages back."""
    return stage // 2


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
            lag = completion_lag(s) if policy == "predict" else 0
            phases = (Read(t.f, t.w - t.f + lag), Read(t.b, t.w - t.b + lag), Read(t.w, lag))
        for phase, r in zip(PHASES, phases):
            out[(s, m, phase)] = r
    return out


def versions_kept(schedule: Schedule, policy: str) -> dict[int, int]:
    """Per stage, the most weight versions held at once besides the live weights.

    ``stash`` keeps F's version of every microbatch in flight (versions shared by microbatches
    whose F met the same one); the predicting policies make a phase's prediction when it runs
    and drop it after, so a stage holds one while a phase that looks ahead runs, none between
    actions (SpecTrain's point: prediction replaces the stash); ``stale`` keeps none.
    """
    if policy not in POLICIES:
        raise OptionError(f"unknown weight policy {policy!r}; use one of {', '.join(POLICIES)}")
    if policy == "stale":
        return {s: 0 for s in range(schedule.num_stages)}
    if policy in PREDICT:
        out = {s: 0 for s in range(schedule.num_stages)}
        for (s, _, _), r in reads(schedule, policy).items():
            out[s] = max(out[s], int(predicts(r)))
        return out
    times = timings(schedule)
    out = {}
    for actions in schedule.ranks:
        held: dict[int, dict[int, int]] = {}  # stage -> microbatch -> the version its F read
        for a in actions:
            if a.kind not in (Kind.F, Kind.B, Kind.W, Kind.BW):
                continue
            mine = held.setdefault(a.stage, {})
            if a.kind is Kind.F:
                mine[a.mb] = times[(a.stage, a.mb)].f
            elif a.kind in (Kind.W, Kind.BW):
                mine.pop(a.mb, None)
            out[a.stage] = max(out.get(a.stage, 0), len(set(mine.values())))
    return out


def copies(schedule: Schedule, policy: str) -> dict[tuple[int, Kind], int]:
    """Per (stage, action kind), the copies of the stage's weights ``policy`` makes in those actions over the
    schedule, as :class:`fxpipe.runtime.weights.WeightVersions` makes them: ``stash`` snapshots the live weights
    in an F that meets another version than the last snapshot (the first F included); the predicting policies
    make one prediction per phase that looks ahead (a BW's B and W phases each); ``stale`` makes none.

    >>> from fxpipe.schedules.generators import generate
    >>> sorted(copies(generate("async-1f1b", 2, 4), "stash").items())
    [((0, <Kind.F: 'F'>), 3), ((1, <Kind.F: 'F'>), 4)]
    """
    if policy not in POLICIES:
        raise OptionError(f"unknown weight policy {policy!r}; use one of {', '.join(POLICIES)}")
    out: dict[tuple[int, Kind], int] = {}
    if policy == "stale":
        return out
    times = timings(schedule)
    table = reads(schedule, policy) if policy in PREDICT else {}
    last: dict[int, int] = {}  # stash: stage -> the version of its last snapshot
    for actions in schedule.ranks:
        for a in actions:
            if a.kind not in (Kind.F, Kind.B, Kind.W, Kind.BW):
                continue
            if policy == "stash":
                made = int(a.kind is Kind.F and last.get(a.stage) != times[(a.stage, a.mb)].f)
                if made:
                    last[a.stage] = times[(a.stage, a.mb)].f
            else:
                phases = {Kind.F: ("F",), Kind.B: ("B",), Kind.W: ("W",), Kind.BW: ("B", "W")}[a.kind]
                made = sum(predicts(table[(a.stage, a.mb, ph)]) for ph in phases)
            if made:
                out[(a.stage, a.kind)] = out.get((a.stage, a.kind), 0) + made
    return out


def predicts(r: Read) -> bool:
    """Whether reading ``r`` makes a prediction (new tensors): it looks ahead, from a version that had an update
    (before its first step an optimizer has no smoothed gradient, and the live weights are read)."""
    return r.ahead > 0 and r.version > 0


def held_peaks_with_versions(schedule: Schedule, policy: str, held_fb: Sequence[float], held_bw: Sequence[float],
                             weight_bytes: Sequence[float]) -> tuple[float, ...]:
    """Per stage, the peak bytes held running ``schedule`` under weight policy ``policy``: the
    activations as ``fxpipe.planning.cost.held_peaks`` counts them, plus ``weight_bytes[s]`` per
    copy of stage s's parameters the policy keeps:

    - ``stash``: each distinct version its microbatches in flight (F run, W or BW not yet) read in
      their F; microbatches whose F met the same version share one snapshot;
    - ``predict``, ``predict-consistent``: one copy while a phase that predicts runs, counted at
      the end of that phase (B and W of a BW each), none between actions;
    - ``stale``: none.

    What the runtime's ``HeldBytes`` measures (shared storages once).

    >>> from fxpipe.schedules.generators import generate
    >>> sched = generate("async-1f1b", 2, 4)
    >>> held_peaks_with_versions(sched, "stash", [10.0, 10.0], [4.0, 4.0], [100.0, 100.0])
    (220.0, 110.0)
    >>> held_peaks_with_versions(sched, "predict", [10.0, 10.0], [4.0, 4.0], [100.0, 100.0])
    (120.0, 10.0)
    """
    if policy not in POLICIES:
        raise OptionError(f"unknown weight policy {policy!r}; use one of {', '.join(POLICIES)}")
    times = timings(schedule)
    table = reads(schedule, policy) if policy in PREDICT else {}
    n = schedule.num_stages
    level, copies, peak = [0.0] * n, [0] * n, [0.0] * n
    readers: list[dict[int, int]] = [{} for _ in range(n)]  # stash: stage -> version -> microbatches in flight

    def phase(s: int, mb: int, name: str) -> None:
        if predicts(table[(s, mb, name)]):
            peak[s] = max(peak[s], level[s] + weight_bytes[s])

    for actions in schedule.ranks:
        for a in actions:
            s, kind = a.stage, a.kind
            if kind not in (Kind.F, Kind.B, Kind.W, Kind.BW):
                continue
            t = times[(s, a.mb)]
            if kind is Kind.F:
                level[s] += held_fb[s]
                if table:
                    phase(s, a.mb, "F")
            if kind in (Kind.B, Kind.BW):
                level[s] += held_bw[s] - held_fb[s]
                if table:
                    phase(s, a.mb, "B")
            if kind in (Kind.W, Kind.BW):
                level[s] -= held_bw[s]
                if table:
                    phase(s, a.mb, "W")
            if policy == "stash":
                mine = readers[s]
                if kind is Kind.F:
                    mine[t.f] = mine.get(t.f, 0) + 1
                elif kind is not Kind.B:
                    mine[t.f] -= 1
                    if not mine[t.f]:
                        del mine[t.f]
                copies[s] = len(mine)
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
               "that read the same one); the predicting policies one prediction while a phase that looks ahead "
               "runs, none between actions",),
    )
