"""``fxpipe simulate [TARGET]``: a schedule simulated on a plan's (or uniform) costs: tables, timeline, trace, SVG."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fxpipe.cli.command_configs import SimulateConfig, sizes
from fxpipe.cli.common import (
    MAX_SIMULATE_SLOTS,
    check_outputs,
    check_schedule_size,
    check_writable_file,
    one_line_errors,
    out,
    say,
    write_output,
)
from fxpipe.cli.config import command
from fxpipe.errors import OptionError


def _simulate(ctx: Any, config: SimulateConfig) -> None:
    """Simulate a schedule on a plan's costs: per-rank table, ASCII timeline, optional trace and SVG."""
    with one_line_errors():
        _check_files(config)
        setup = _costs(config)
        sim = _schedule(config, setup)
        _write_files(config, sim)
        if config.as_json:
            _print_json(sim)
        else:
            _print_text(config, sim)


simulate_cmd = command(SimulateConfig, _simulate, "simulate")


@dataclass
class Setup:
    """What the schedule is simulated on: the costs, their unit, the plan (None for uniform costs), the schedule
    CSV read (if any), the stage count and microbatches."""

    costs: Any
    unit: str
    plan: Any
    csv_sched: Any
    num_stages: int
    microbatches: int | None


@dataclass
class Simulated:
    """A simulated schedule and the tables beside it."""

    sched: Any
    result: Any
    costs: Any
    unit: str
    extra: list[Any]
    table: Any = None


def _check_files(config: SimulateConfig) -> None:
    """The target readable and --trace / --svg writable, before the work, so no result is lost."""
    from fxpipe.schedules.timeline import is_fxpipe_svg, is_fxpipe_trace

    target = config.target
    source = Path(target.split(":")[0]) if target else None
    check_outputs([("the target", source if source is not None and source.exists() else None)],
                  [("--trace", config.trace), ("--svg", config.svg)])
    for path, option, ours in ((config.trace, "--trace", is_fxpipe_trace), (config.svg, "--svg", is_fxpipe_svg)):
        if path is not None:
            check_writable_file(path, option, ours)


def _costs(config: SimulateConfig) -> Setup:
    """The costs to simulate on (a plan's, a model's compiled now, or --uniform-costs) with --dp, --allreduce,
    --cores and --w-lane applied; the schedule's size checked."""
    import dataclasses

    from fxpipe.plan import DEFAULTS
    from fxpipe.schedules.simulate import Costs

    csv_sched, microbatches, stages, target = None, config.microbatches, config.stages, config.target
    if config.schedule_csv is not None:
        csv_sched = _read_schedule_csv(config.schedule_csv)
        microbatches = csv_sched.num_microbatches
        stages = stages if stages is not None or target is not None else csv_sched.num_stages
    plan: Any = None
    unit = "s"
    values: tuple[float, ...] = ()
    if config.uniform_costs is not None:
        values = _floats(config.uniform_costs, "--uniform-costs", 3)
        num_stages = (csv_sched.num_stages if csv_sched is not None else stages if stages is not None
                      else (_plan_stages(target) if target else None))
        if num_stages is None:
            raise OptionError("--uniform-costs needs --stages (or a target to take the stage count from)")
        costs, unit = Costs.uniform(num_stages, *values), "unit"
        if config.recompute != "none":
            raise OptionError(f"--recompute {config.recompute} needs a plan's stage input bytes; --uniform-costs has "
                              "none: give a plan directory or a model")
    elif target is None:
        raise OptionError("give a plan directory or a model to simulate, or --uniform-costs F,B,W with --stages")
    else:
        from fxpipe.calibration.compute import plan_overheads

        plan = _plan(target, stages)
        costs = Costs.from_plan(plan, plan_overheads(plan))
        num_stages = len(costs.f)
    # Only the options given replace the costs' own: a plan's dp and cores stay unless overridden.
    changes: dict[str, Any] = {"w_lane": config.w_lane}
    if config.dp is not None:
        changes["dp"] = config.dp
    if config.allreduce is not None:
        changes["allreduce_s"] = (config.allreduce,) * num_stages
    if config.cores is not None:
        changes["cores"] = config.core_count()
    costs = dataclasses.replace(costs, **changes)
    auto = config.schedule == "auto"
    # One schedule simulates in time linear in its actions; auto simulates a dozen candidates per count.
    check_schedule_size(num_stages, microbatches or (max(DEFAULTS.auto_microbatches(num_stages)) if auto
                                                     else DEFAULTS.microbatches(num_stages)),
                        sum(values), **({} if auto else {"max_slots": MAX_SIMULATE_SLOTS}))
    return Setup(costs, unit, plan, csv_sched, num_stages, microbatches)


def _schedule(config: SimulateConfig, setup: Setup) -> Simulated:
    """The schedule chosen (or read) and simulated, recomputation applied, with its tables."""
    from fxpipe.plan import DEFAULTS
    from fxpipe.schedules.auto import choose
    from fxpipe.schedules.simulate import report, simulate

    costs, unit, csv_sched, num_stages = setup.costs, setup.unit, setup.csv_sched, setup.num_stages
    if csv_sched is not None:
        if csv_sched.num_stages != num_stages:
            raise OptionError(f"{config.schedule_csv} schedules {csv_sched.num_stages} stages, the plan has "
                              f"{num_stages}; compile the model with --stages {csv_sched.num_stages} (torch's "
                              "two-stage-per-rank schedules need twice the ranks)")
        sched, result, extra = csv_sched, simulate(csv_sched, costs), [_beside(csv_sched, costs, unit)]
    else:
        cap = sizes(activation_memory_per_stage=config.activation_memory_per_stage)["activation_memory_per_stage"]
        sched, result, extra = choose(config.schedule or DEFAULTS.schedule, num_stages, setup.microbatches, costs,
                                      cap)
    if config.w_lane and not sched.synchronous:
        raise OptionError(f"--w-lane models a synchronous schedule's W's; {sched.name} updates the weights after "
                          "each W: drop --w-lane, or pick a synchronous schedule")
    sim = Simulated(sched, result, costs, unit, list(extra))
    if config.recompute != "none":
        _recompute(config, setup, sim)
    if not math.isfinite(sim.result.makespan):
        raise OptionError(f"the simulated step does not add up to a finite time (makespan: {sim.result.makespan}); "
                          "the costs are too large: use smaller --uniform-costs, or recompile the plan")
    sim.table = report(sim.result, sched, unit=unit, w_batched=sim.costs.w_batched)
    _more_reports(config, setup, sim)
    return sim


def _recompute(config: SimulateConfig, setup: Setup, sim: Simulated) -> None:
    """--recompute stage|auto: the stages that recompute, their costs and the simulation again, and a table."""
    import dataclasses

    from fxpipe.calibration.compute import plan_overheads
    from fxpipe.report import Report
    from fxpipe.schedules.auto import plan_recompute
    from fxpipe.schedules.simulate import Costs, simulate

    plan, costs = setup.plan, sim.costs
    again, note = plan_recompute(plan, sim.sched, config.recompute)
    if again:  # before the runtime's costs: the loss's time is no part of the recomputed F
        base = Costs.from_plan(plan).recomputing(again).with_runtime(plan_overheads(plan))
        costs = dataclasses.replace(base, dp=costs.dp, allreduce_s=costs.allreduce_s, cores=costs.cores,
                                    w_lane=config.w_lane)
        sim.costs, sim.result = costs, simulate(sim.sched, costs)
    sim.extra.append(Report("simulate: recompute", ("stage", "recomputes", "held F->B MiB"),
                            tuple((k, k in again, round(costs.held_fb[k] / 2**20, 4))
                                  for k in range(setup.num_stages)), (note,)))


def _more_reports(config: SimulateConfig, setup: Setup, sim: Simulated) -> None:
    """The data-parallel table (--dp, --cores) and an asynchronous schedule's weight versions."""
    from fxpipe.schedules.simulate import dp_report

    costs, sched, uniform = sim.costs, sim.sched, setup.plan is None
    if costs.dp > 1 or costs.cores is not None:
        sim.extra.append(dp_report(sim.result, sched, costs, unit=sim.unit, optimizer=config.state,
                                   param_bytes=None if uniform else costs.grad_bytes))
    if not sched.synchronous:  # the weight versions each policy keeps, per stage
        from fxpipe.schedules.versions import memory_report

        param_bytes = [0.0] * setup.num_stages if uniform else [
            float(sum(layer.param_bytes for layer in setup.plan.layers[st.first_layer:st.end_layer]))
            for st in setup.plan.stages]
        sim.extra.append(memory_report(sched, param_bytes))


def _write_files(config: SimulateConfig, sim: Simulated) -> None:
    from fxpipe.schedules.timeline import write_chrome_trace, write_svg

    if config.trace is not None:
        write_output(config.trace, "--trace", lambda p: write_chrome_trace(
            sim.result, p, time_unit_us=1e6 if sim.unit == "s" else 1.0))
    if config.svg is not None:
        write_output(config.svg, "--svg", lambda p: write_svg(sim.result, p))


def _print_json(sim: Simulated) -> None:
    sched, result = sim.sched, sim.result
    doc = result.to_json()
    print(json.dumps({
        "schema": "fxpipe.simulate/v1", "schedule": sched.name, "microbatches": sched.num_microbatches,
        "stages": sched.num_stages, "ranks": sched.num_ranks, "time_unit": sim.unit,
        "makespan": result.makespan, "max_stage_span": result.max_stage_span,
        "per_rank": doc["ranks"], "staleness": doc["staleness"],
        **({key: doc[key] for key in ("dp", "compute_makespan", "allreduce_s", "exposed_s", "hidden_fraction",
                                      "step_hidden_fraction", "allreduce")} if result.dp > 1 else {}),
        "schedule_csv": sched.to_csv(), "reports": [r.to_json() for r in [*sim.extra, sim.table]],
    }))


def _print_text(config: SimulateConfig, sim: Simulated) -> None:
    from fxpipe.render import print_reports
    from fxpipe.schedules.timeline import ascii_timeline

    print_reports([*sim.extra, sim.table], plain=config.plain, console=out)
    # plain print: rich would wrap the long rows
    print(ascii_timeline(sim.result, width=_TIMELINE_WIDTH, unit=sim.unit))
    busiest = max(len(rank) for rank in sim.sched.ranks)
    if busiest > _TIMELINE_WIDTH:  # a long schedule: the rows sample it, they cannot draw every action
        print(f"(the timeline summarizes {busiest:,} actions on the busiest rank in {_TIMELINE_WIDTH} columns: each "
              "column shows the kind that runs most of it, * where none does; the table above counts every action)")
    for path in (config.trace, config.svg):
        if path is not None:
            say(f"wrote {path}")


_TIMELINE_WIDTH = 100  # columns of the ASCII timeline


def _read_schedule_csv(path: Path) -> Any:
    """A torch schedule CSV, its communication checked and dropped, validated by fxpipe's rules (OptionError or
    ScheduleError in one line)."""
    from fxpipe.schedules.simulate import validate
    from fxpipe.schedules.torch_csv import check_comms, read_torch_csv

    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise OptionError(f"--schedule-csv {str(path)!r} cannot be read ({getattr(exc, 'strerror', None) or exc}); "
                          "give the file torch's _dump_csv wrote") from None
    sched = read_torch_csv(text, name=f"csv:{path.name}")
    check_comms(sched)
    sched = sched.compute_only()
    validate(sched)
    return sched


def _beside(csv_sched: Any, costs: Any, unit: str) -> Any:
    """The CSV's schedule and fxpipe's for the same stages, ranks and microbatches, on the same costs."""
    from fxpipe.report import Report
    from fxpipe.schedules.generators import generate
    from fxpipe.schedules.simulate import simulate

    p, s, m = csv_sched.num_ranks, csv_sched.num_stages, csv_sched.num_microbatches
    names = ("gpipe", "1f1b", "zb-h1", "zb-h2") if s == p else ("interleaved-1f1b",) if s == 2 * p else ()
    from fxpipe.errors import FxpipeError

    rows, scheds = [], [csv_sched]
    for n in names:
        try:
            scheds.append(generate(n, s, m, costs))
        except FxpipeError:  # a count this generator cannot take (interleaved: microbatches a multiple of the ranks)
            continue
    for sched in scheds:
        res = simulate(sched, costs)
        rows.append((sched.name, sched.num_ranks, round(res.makespan * (1e3 if unit == "s" else 1), 4),
                     max(r.peak_in_flight for r in res.ranks)))
    return Report(f"simulate: {csv_sched.name} beside fxpipe's schedules ({s} stages, {p} ranks, {m} microbatches)",
                  ("schedule", "ranks", "makespan ms" if unit == "s" else "makespan", "peak in flight"), tuple(rows),
                  ("fxpipe's schedules for the same placement; the CSV's sends and receives are checked, then placed "
                   "by the simulator",))


def _floats(text: str, option: str, count: int) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) != count or not all(math.isfinite(v) and v >= 0 for v in values):
        raise OptionError(f"{option} takes {count} non-negative numbers separated by commas, each finite (got "
                          f"{text!r}); e.g. 1,1,1")
    return values


def _plan_stages(target: str) -> int | None:
    path = Path(target)
    if (path / "plan.json").is_file():
        from fxpipe.plan_dir import read_plan_json

        return int(read_plan_json(path)["num_stages"])
    return None


def _plan(target: str, stages: int | None) -> Any:
    """The Plan of a plan directory, or of compiling a model target (``--stages``, else DEFAULTS.stages)."""
    path = Path(target)
    if path.is_dir():
        from fxpipe.plan_dir import read_plan

        return read_plan(path)
    import torch  # noqa: F401  (the compile below needs it; imported here to keep --help fast)

    from fxpipe.api import run_compile
    from fxpipe.plan import CompileOptions
    from fxpipe.targets import resolve

    resolved = resolve(target)
    options = CompileOptions() if stages is None else CompileOptions(stages=stages)
    compiled = run_compile(resolved.model, resolved.example_inputs, options, example_kwargs=resolved.example_kwargs,
                           model_name=resolved.name)
    assert compiled.pipeline is not None  # no stop_after: every pass ran
    return compiled.pipeline.plan
