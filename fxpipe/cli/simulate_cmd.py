"""``fxpipe simulate [TARGET]``: a schedule simulated on a plan's (or uniform) costs: tables, timeline, trace, SVG."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from fxpipe.cli.common import (MAX_SIMULATE_SLOTS, check_outputs, check_schedule_size, check_writable_file,
                               one_line_errors, out, parse_size, say, write_output)
from fxpipe.errors import OptionError


def simulate_cmd(
    target: Annotated[Optional[str], typer.Argument(help="A plan directory, a zoo model or file.py:build; optional "
                                                     "with --uniform-costs.")] = None,
    schedule: Annotated[Optional[str], typer.Option("--schedule", help="gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2, "
                                                    "layerpipe, batched-w, async-1f1b, layerpipe-async, or auto "
                                                    "\\[default: 1f1b].")] = None,
    microbatches: Annotated[Optional[int], typer.Option(min=1, help="Microbatches per step (default: 2 x stages; "
                                                         "auto tries 1, 2 and 4 x stages).")] = None,
    stages: Annotated[Optional[int], typer.Option("--stages", "-s", min=1, help="Stages (for a model target or "
                                                  "--uniform-costs alone).")] = None,
    uniform_costs: Annotated[Optional[str], typer.Option(help="F,B,W: every stage takes these times and transfers "
                                                         "are free (for checking closed forms).")] = None,
    memory_per_stage: Annotated[Optional[str], typer.Option(help="Activation memory cap per rank for auto, e.g. 2GiB.")] = None,
    dp: Annotated[Optional[int], typer.Option("--dp", min=1, help="Replicas of every stage (data parallel); each "
                                              "stage's gradients are all-reduced over them \\[default: the plan's "
                                              "mesh, else 1].")] = None,
    allreduce: Annotated[Optional[float], typer.Option("--allreduce", min=0.0, help="Seconds (with --uniform-costs: "
                                                       "units) of every stage's all-reduce, instead of its "
                                                       "gradient bytes over the plan's link.")] = None,
    cores: Annotated[Optional[int], typer.Option("--cores", min=1, help="Cores the ranks share: F, B and W run "
                                                 "ranks / cores times slower when there are more ranks "
                                                 "(approximate time-sharing).")] = None,
    optimizer: Annotated[str, typer.Option("--optimizer", help="sgd, momentum or adam: the state counted in "
                                           "memory per rank with --dp.")] = "sgd",
    recompute: Annotated[str, typer.Option(help="none, stage or auto (a plan's stages): stages that recompute their "
                                           "forward in B, so each B takes F's time too and F keeps only the "
                                           "stage's inputs until B; auto: those the plan's memory cap needs.")
                         ] = "none",
    schedule_csv: Annotated[Optional[Path], typer.Option("--schedule-csv", help="A torch.distributed.pipelining "
                                                         "schedule CSV (what _dump_csv writes, compute only or with "
                                                         "its communication) to check and simulate instead of "
                                                         "--schedule, beside fxpipe's schedules.")] = None,
    w_lane: Annotated[bool, typer.Option("--w-lane", help="Each rank's W's on a second lane sharing its core, as "
                                         "fxpipe run --w-lane runs them (synchronous schedules).")] = False,
    trace: Annotated[Optional[Path], typer.Option(help="Write a Chrome-trace JSON (Perfetto, chrome://tracing).")] = None,
    svg: Annotated[Optional[Path], typer.Option(help="Write an SVG Gantt chart.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout, nothing else.")] = False,
    plain: Annotated[bool, typer.Option(help="Plain-text tables.")] = False,
) -> None:
    """Simulate a schedule on a plan's costs: per-rank table, ASCII timeline, optional trace and SVG."""
    with one_line_errors():
        from fxpipe.schedules.auto import choose
        from fxpipe.report import Report
        from fxpipe.schedules.simulate import Costs, dp_report, report, simulate
        from fxpipe.schedules.timeline import ascii_timeline, write_chrome_trace, write_svg

        csv_sched = None
        if schedule_csv is not None:
            if schedule is not None or microbatches is not None:
                raise OptionError("--schedule-csv is the schedule, its microbatches included; drop --schedule and "
                                  "--microbatches")
            csv_sched = _read_schedule_csv(schedule_csv)
            microbatches = csv_sched.num_microbatches
            stages = stages if stages is not None or target is not None else csv_sched.num_stages
        source = Path(target.split(":")[0]) if target else None
        check_outputs([("the target", source if source is not None and source.exists() else None)],
                      [("--trace", trace), ("--svg", svg)])
        from fxpipe.schedules.timeline import is_fxpipe_svg, is_fxpipe_trace

        for path, option, ours in ((trace, "--trace", is_fxpipe_trace), (svg, "--svg", is_fxpipe_svg)):
            if path is not None:
                check_writable_file(path, option, ours)  # before the work, so no result is lost
        unit = "s"
        if uniform_costs is not None:
            values = _floats(uniform_costs, "--uniform-costs", 3)
            num_stages = (csv_sched.num_stages if csv_sched is not None else stages if stages is not None
                          else (_plan_stages(target) if target else None))
            if num_stages is None:
                raise OptionError("--uniform-costs needs --stages (or a target to take the stage count from)")
            costs = Costs.uniform(num_stages, *values)
            unit = "unit"
        elif target is None:
            raise OptionError("give a plan directory or a model to simulate, or --uniform-costs F,B,W with --stages")
        else:
            from fxpipe.calibration.compute import plan_overheads

            plan = _plan(target, stages)
            costs = Costs.from_plan(plan, plan_overheads(plan))
            num_stages = len(costs.f)
        import dataclasses

        from fxpipe.planning.cost import OPTIMIZER_STATE

        if optimizer not in OPTIMIZER_STATE:
            raise OptionError(f"--optimizer takes one of {', '.join(OPTIMIZER_STATE)} (got {optimizer!r})")
        costs = dataclasses.replace(costs, **({"dp": dp} if dp is not None else {}),
                                    **({"allreduce_s": (allreduce,) * num_stages} if allreduce is not None else {}),
                                    **({"cores": cores} if cores is not None else {}), w_lane=w_lane)
        cap = parse_size(memory_per_stage, "--memory-per-stage") if memory_per_stage else None
        from fxpipe.plan import DEFAULTS

        # One schedule simulates in time linear in its actions; auto simulates a dozen candidates per count.
        check_schedule_size(num_stages, microbatches or (max(DEFAULTS.auto_microbatches(num_stages)) if schedule == "auto"
                                                 else DEFAULTS.microbatches(num_stages)),
                    sum(values) if uniform_costs is not None else 0.0,
                    **({} if schedule == "auto" else {"max_slots": MAX_SIMULATE_SLOTS}))
        from fxpipe.schedules.auto import RECOMPUTE, plan_recompute

        if recompute not in RECOMPUTE:
            raise OptionError(f"--recompute takes none, stage or auto (got {recompute!r})")
        if recompute != "none" and uniform_costs is not None:
            raise OptionError(f"--recompute {recompute} needs a plan's stage input bytes; --uniform-costs has none: "
                              "give a plan directory or a model")
        if csv_sched is not None:
            if csv_sched.num_stages != num_stages:
                raise OptionError(f"{schedule_csv} schedules {csv_sched.num_stages} stages, the plan has {num_stages}; "
                                  f"compile the model with --stages {csv_sched.num_stages} (torch's two-stage-per-rank "
                                  "schedules need twice the ranks)")
            from fxpipe.schedules.simulate import simulate as run_sim

            sched, result, extra = csv_sched, run_sim(csv_sched, costs), [_beside(csv_sched, costs, unit)]
        else:
            sched, result, extra = choose(schedule or DEFAULTS.schedule, num_stages, microbatches, costs, cap)
        if w_lane and not sched.synchronous:
            raise OptionError(f"--w-lane models a synchronous schedule's W's; {sched.name} updates the weights after "
                              "each W: drop --w-lane, or pick a synchronous schedule")
        if recompute != "none":
            again, note = plan_recompute(plan, sched, recompute)
            if again:  # before the runtime's costs: the loss's time is no part of the recomputed F
                base = Costs.from_plan(plan).recomputing(again).with_runtime(plan_overheads(plan))
                costs = dataclasses.replace(base, dp=costs.dp, allreduce_s=costs.allreduce_s, cores=costs.cores,
                                            w_lane=w_lane)
                result = simulate(sched, costs)
            extra = [*extra, Report("simulate: recompute", ("stage", "recomputes", "held F->B MiB"),
                                    tuple((k, k in again, round(costs.held_fb[k] / 2**20, 4))
                                          for k in range(num_stages)), (note,))]
        if not math.isfinite(result.makespan):
            raise OptionError(f"the simulated step does not add up to a finite time (makespan: {result.makespan}); "
                              "the costs are too large: use smaller --uniform-costs, or recompile the plan")
        table = report(result, sched, unit=unit, w_batched=costs.w_batched)
        if costs.dp > 1 or costs.cores is not None:
            extra = [*extra, dp_report(result, sched, costs, unit=unit, optimizer=optimizer,
                                       param_bytes=None if uniform_costs is not None else costs.grad_bytes)]
        if not sched.synchronous:  # the weight versions each policy keeps, per stage
            from fxpipe.schedules.versions import memory_report

            param_bytes = [0.0] * num_stages if uniform_costs is not None else [
                float(sum(layer.param_bytes for layer in plan.layers[st.first_layer:st.end_layer]))
                for st in plan.stages]
            extra = [*extra, memory_report(sched, param_bytes)]
        if trace is not None:
            write_output(trace, "--trace", lambda p: write_chrome_trace(result, p, time_unit_us=1e6 if unit == "s" else 1.0))
        if svg is not None:
            write_output(svg, "--svg", lambda p: write_svg(result, p))
        if as_json:
            print(json.dumps({
                "schema": "fxpipe.simulate/v1", "schedule": sched.name, "microbatches": sched.num_microbatches,
                "stages": sched.num_stages, "ranks": sched.num_ranks, "time_unit": unit,
                "makespan": result.makespan, "max_stage_span": result.max_stage_span,
                "per_rank": result.to_json()["ranks"], "staleness": result.to_json()["staleness"],
                **({key: result.to_json()[key] for key in ("dp", "compute_makespan", "allreduce_s", "exposed_s",
                                                            "hidden_fraction", "step_hidden_fraction", "allreduce")}
                   if result.dp > 1 else {}),
                "schedule_csv": sched.to_csv(), "reports": [r.to_json() for r in [*extra, table]],
            }))
            return
        from fxpipe.render import print_reports

        print_reports([*extra, table], plain=plain, console=out)
        print(ascii_timeline(result, width=_TIMELINE_WIDTH))  # plain print: rich would wrap the long rows
        busiest = max(len(rank) for rank in sched.ranks)
        if busiest > _TIMELINE_WIDTH:  # a long schedule: the rows sample it, they cannot draw every action
            print(f"(the timeline summarizes {busiest:,} actions on the busiest rank in {_TIMELINE_WIDTH} columns: each "
                  "column shows the kind that runs most of it, * where none does; the table above counts every action)")
        for path in (trace, svg):
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
    options = CompileOptions(**({"stages": stages} if stages is not None else {}))
    compiled = run_compile(resolved.model, resolved.example_inputs, options, example_kwargs=resolved.example_kwargs,
                           model_name=resolved.name)
    assert compiled.pipeline is not None  # no stop_after: every pass ran
    return compiled.pipeline.plan
