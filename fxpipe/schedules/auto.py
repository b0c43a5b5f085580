"""auto: search schedule x microbatch count x W placement with the simulator, under a per-rank memory cap; the plan's
schedule (``plan_schedule``) and the stages that recompute their forward under the plan's cap (``plan_recompute``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from fxpipe.errors import OptionError, PlanError
from fxpipe.plan import DEFAULTS, LIMITS, Plan, check_schedule_size
from fxpipe.report import Report
from fxpipe.schedules.generators import generate, zero_bubble
from fxpipe.schedules.ir import Schedule
from fxpipe.schedules.simulate import Costs, SimResult, simulate

FIXED = ("gpipe", "1f1b", "zb-h1", "zb-h2", "layerpipe")


@dataclass(frozen=True)
class Choice:
    schedule: Schedule
    result: SimResult
    report: Report


def greedy_limits(num_stages: int) -> list[int]:
    """The memory limits (microbatches in flight) auto tries the greedy zero-bubble scheduler at:
    p to 2p, but 2p - 1, which is zb-h2 itself."""
    p = num_stages
    return [limit for limit in range(p, 2 * p + 1) if limit != 2 * p - 1]


def auto(num_stages: int, costs: Costs, *, microbatches: Sequence[int], memory_cap: float | None = None) -> Choice:
    """The fastest candidate per microbatch (makespan / m) whose peak memory on every rank fits the cap.

    Candidates, for each m: the fixed schedules (gpipe, 1f1b, zb-h1, zb-h2, layerpipe; and batched-w where
    ``costs.w_batched`` says some stage's Ws run faster batched) and the
    zero-bubble list scheduler with every memory limit from p to 2p microbatches (where the Ws
    go depends on the real F/B/W costs, unlike zb-h1/zb-h2's fixed shapes). interleaved-1f1b is
    not a candidate: it puts two stages on a rank, so it needs a plan with twice the stages.
    Raises PlanError when nothing fits, naming the least memory any candidate needs.
    """
    p = num_stages
    tried: list[tuple[Schedule, SimResult, float, bool]] = []
    for m in sorted(set(microbatches)):
        # batched-w where the costs know its Ws run faster batched (a profiled plan's StageCost.w_batched)
        batched = ("batched-w",) if costs.w_batched and min(costs.w_batched) < 1.0 else ()
        candidates = [generate(name, p, m, costs) for name in (*FIXED, *batched)]
        candidates += [zero_bubble(p, m, costs, limits=[limit] * p, name=f"zb-greedy(limit={limit})")
                       for limit in greedy_limits(p)]
        for sched in candidates:
            result = simulate(sched, costs)
            peak = max(r.peak_memory for r in result.ranks)
            tried.append((sched, result, peak, memory_cap is None or peak <= memory_cap))
    fitting = [t for t in tried if t[3]]
    if not fitting:
        least = min(t[2] for t in tried)
        raise PlanError(f"no schedule fits --activation-memory-per-stage {memory_cap:.4g} bytes; the least any "
                        f"candidate needs is {least:.4g} bytes; raise the cap or use fewer microbatches")
    best = min(fitting, key=lambda t: (t[1].makespan / t[0].num_microbatches, t[2], t[0].name))
    rows = tuple(
        (s.name, s.num_microbatches, round(r.makespan * 1e3, 4), round(r.makespan / s.num_microbatches * 1e3, 4),
         round(r.max_stage_span * 1e3, 4), round(peak / 2**20, 3), "yes" if fits else "no",
         "<== chosen" if (s, r) == (best[0], best[1]) else "")
        for s, r, peak, fits in sorted(tried, key=lambda t: (t[1].makespan / t[0].num_microbatches, t[2]))
    )
    why = (f"chose {best[0].name} with {best[0].num_microbatches} microbatches: the least time per microbatch "
           f"({best[1].makespan / best[0].num_microbatches * 1e3:.4f} ms) of {len(fitting)} candidates that fit"
           + (f"; {len(tried) - len(fitting)} exceeded the memory cap" if len(fitting) < len(tried) else ""))
    report = Report(
        title="schedule auto: candidates, fastest per microbatch first",
        columns=("schedule", "microbatches", "makespan ms", "per microbatch ms", "max stage span ms", "peak MiB",
                 "fits", ""),
        rows=rows,
        notes=(why, "interleaved-1f1b is not a candidate: it needs two stages per rank (compile twice the stages)"),
    )
    return Choice(best[0], best[1], report)


def choose(name: str, num_stages: int, microbatches: int | None, costs: Costs,
           memory_cap: float | None = None) -> tuple[Schedule, SimResult, list[Report]]:
    """Generate (or, for ``auto``, search) a schedule and simulate it; the reports to show with it.

    ``microbatches`` None: ``DEFAULTS.microbatches(num_stages)``, or for ``auto`` every count of
    ``DEFAULTS.auto_microbatches(num_stages)``.
    """
    m = microbatches
    if name == "auto":
        choice = auto(num_stages, costs, microbatches=[m] if m else DEFAULTS.auto_microbatches(num_stages),
                      memory_cap=memory_cap)
        return choice.schedule, choice.result, [choice.report]
    sched = generate(name, num_stages, m or DEFAULTS.microbatches(num_stages), costs)
    return sched, simulate(sched, costs), []


def plan_schedule(plan: Plan, schedule: str | None, microbatches: int | None) -> Schedule:
    """The schedule a plan runs: the one recorded in it (``compile --schedule``) when no other is
    asked for, else ``schedule`` (default ``DEFAULTS.schedule``) generated for the plan's costs with
    ``microbatches``: by default the plan's own count (its recorded schedule's, else ``compile
    --microbatches``), else ``DEFAULTS.microbatches``; ``auto`` without one searches the counts. A
    recorded schedule keeps whether it is synchronous. Raises OptionError for an unknown name or
    counts the schedule cannot take."""
    if microbatches is not None:
        LIMITS.whole("--microbatches", microbatches, LIMITS.microbatches, "a schedule lists every microbatch's actions")
        check_schedule_size(plan.num_stages, microbatches)
    recorded = plan.schedule
    if schedule is None and recorded is not None and microbatches in (None, recorded.microbatches):
        return Schedule.from_csv(recorded.csv, recorded.name, synchronous=recorded.synchronous,
                                 batch_w=recorded.batch_w)
    name = schedule or DEFAULTS.schedule
    if microbatches is None and name != "auto":  # the batch the plan was compiled for, not a default one
        microbatches = recorded.microbatches if recorded is not None else plan.options.microbatches
    return choose(name, plan.num_stages, microbatches, Costs.from_plan(plan))[0]


RECOMPUTE = ("none", "stage", "auto")
"""``--recompute``'s choices: no stage recomputes its forward, every stage does, or those the memory cap needs."""


def plan_recompute(plan: Plan, schedule: Schedule, how: str,
                   held_in: Sequence[float] | None = None) -> tuple[tuple[int, ...], str]:
    """The stages that recompute their forward just before B when ``plan`` runs ``schedule``, and one line saying why.

    ``how``: ``none``; ``stage``, every stage whose inputs are smaller than what its F saves (the others would hold as
    much and pay F again); or ``auto``, the fewest stages whose recomputing brings every stage's memory (4 x its
    parameter bytes, as the partitioner counts parameters, gradients and Adam's two moments, plus its simulated held
    peak: ``fxpipe.planning.cost.recompute_stages``) under the plan's cap (``compile --memory-per-stage``); with no
    cap, none. ``held_in``: each stage's input bytes where the plan has none.
    Raises OptionError for another ``how``, PlanError where a stage cannot fit even recomputing.
    """
    from fxpipe.planning.cost import recompute_stages, static_memory

    if how not in RECOMPUTE:
        raise OptionError(f"--recompute takes none, stage or auto (got {how!r})")
    if how == "none":
        return (), "recompute none: every stage keeps its saved activations from F to B"
    cap = plan.options.memory_per_stage
    if how == "auto" and cap is None:
        return (), ("recompute auto: the plan has no memory cap (compile --memory-per-stage), so no stage "
                    "recomputes")
    costs = Costs.from_plan(plan)
    if not costs.held_in:
        if held_in is None:
            raise OptionError(f"--recompute {how} needs the stages' input bytes, which this plan (written before "
                              "recomputation) lacks; recompile it")
        costs = dataclasses.replace(costs, held_in=tuple(float(x) for x in held_in))
    if how == "stage":  # a stage whose inputs are no smaller than what its F saves would hold as much, and pay F again
        stages = tuple(s for s in range(plan.num_stages) if costs.held_in[s] < costs.held_fb[s])
        rest = [s for s in range(plan.num_stages) if s not in stages]
        return stages, ("recompute stage: " + (f"stages {', '.join(map(str, stages))} keep only their inputs from F "
                                               "to B" if stages else "no stage")
                        + (f"; stages {', '.join(map(str, rest))} save no more than their inputs, and keep what "
                           "they save" if len(rest) > 1 else f"; stage {rest[0]} saves no more than its inputs, and "
                           "keeps what it saves" if rest else ""))
    static = [static_memory(g, "adam") for g in costs.grad_bytes]
    stages = recompute_stages([(a.stage, a.kind.value) for acts in schedule.ranks for a in acts], costs.held_fb,
                              costs.held_bw, costs.held_in, cap, static)
    if not stages:
        return (), f"recompute auto: every stage fits the memory cap of {cap:.0f} bytes without recomputing"
    return stages, (f"recompute auto: stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))} "
                    f"recompute{'s' if len(stages) == 1 else ''} to fit the memory cap of {cap:.0f} bytes")
