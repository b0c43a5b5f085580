"""auto: search schedule x microbatch count x W placement with the simulator, under a per-rank memory cap."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fxpipe.errors import PlanError
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

    @property
    def per_microbatch(self) -> float:
        return self.result.makespan / self.schedule.num_microbatches


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
        raise PlanError(f"no schedule fits --memory-per-stage {memory_cap:.4g} bytes of activations; the least any "
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
