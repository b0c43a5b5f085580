"""``fxpipe compile TARGET``: trace, cost and partition a model; print every pass's tables; write the plan directory."""

from __future__ import annotations

import json
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from fxpipe.cli.common import (check_schedule_size, check_writable_dir, one_line_errors, out, parse_size, progress,
                               quiet_torch_logs, say)
from fxpipe.errors import OptionError


class Tracer(str, Enum):
    export = "export"
    fx = "fx"


class Device(str, Enum):
    cpu = "cpu"
    meta = "meta"


class StrategyChoice(str, Enum):
    auto = "auto"
    dp = "dp"
    splitbrain = "splitbrain"


class DType(str, Enum):
    float32 = "float32"
    float64 = "float64"
    bfloat16 = "bfloat16"


def compile_cmd(
    target: Annotated[str, typer.Argument(help="A zoo model (gpt, gpt-tiny, resnet-50, ...) or file.py:build.")],
    stages: Annotated[Optional[str], typer.Option("--stages", "-s", help="Number of pipeline stages, or auto: "
                                                  "every count up to --devices / --dp (default 8) partitioned, "
                                                  "simulated, and the one --objective picks \\[default: 2].",
                                                  rich_help_panel="Partitioning")] = None,
    objective: Annotated[Optional[str], typer.Option(help="With --stages auto: fastest (the most speedup), "
                                                     "efficiency:E (the most speedup with speedup / stages >= E) or "
                                                     "speedup:X (the fewest stages reaching X) \\[default: fastest].",
                                                     rich_help_panel="Partitioning")] = None,
    devices: Annotated[Optional[int], typer.Option(min=1, help="With --stages auto or --plan auto: the devices to "
                                                   "use at most (stages x dp) \\[default: 8 stages].",
                                                   rich_help_panel="Partitioning")] = None,
    plan: Annotated[Optional[str], typer.Option("--plan", help="auto: search stages x dp replicas x schedule x "
                                                "microbatches on --devices (under --memory-per-device), simulate "
                                                "the best, and record the fastest.",
                                                rich_help_panel="Partitioning")] = None,
    cores: Annotated[Optional[str], typer.Option("--cores", help="With --plan auto or --stages auto: the cores the "
                                                 "plan's ranks will share, N or auto (this machine's). Ranks beyond "
                                                 "them time-share: F, B and W run ranks / cores times slower in the "
                                                 "planner's model and simulator, so fewer ranks can win; and they "
                                                 "share its cache: dp replicas hold dp copies of the model, so more "
                                                 "of each weight is read from memory (calibrated). Give it when "
                                                 "the plan will run as CPU ranks on that many cores (auto: fxpipe "
                                                 "run here); the plan records it. \\[default: none: a core, or device, "
                                                 "per rank, as for a plan compiled here for other machines]",
                                                 rich_help_panel="Partitioning")] = None,
    dp: Annotated[int, typer.Option("--dp", min=1, help="Replicas of every stage (data parallel): the plan's mesh "
                                    "is stages x dp ranks, each replica taking its share of every batch.")] = 1,
    out_dir: Annotated[Optional[Path], typer.Option("--out", "-o", help="Plan directory to write.",
                                                    rich_help_panel="Output")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace files in --out that fxpipe did not write (or that changed "
                                            "since) where the plan writes its own; each is named.",
                                            rich_help_panel="Output")] = False,
    tracer: Annotated[Tracer, typer.Option(help="Graph capture: torch.export, or torch.fx as a fallback.")] = Tracer.export,
    granularity: Annotated[str, typer.Option(help="Layers: auto (repeating blocks), node, or a module depth (1, 2, ...).",
                                             rich_help_panel="Partitioning")] = "auto",
    bandwidth: Annotated[Optional[str], typer.Option(help="Link bandwidth per second between stages, e.g. 1.5GB "
                                                     "\\[default: 1.5GB].", rich_help_panel="Partitioning")] = None,
    latency: Annotated[Optional[float], typer.Option(help="Seconds per transfer \\[default: 0.0001].",
                                                     rich_help_panel="Partitioning")] = None,
    memory_per_stage: Annotated[Optional[str], typer.Option("--memory-per-stage", "--memory-per-device",
                                                             help="Memory cap per stage (one stage per device), "
                                                             "e.g. 8GiB.",
                                                             rich_help_panel="Partitioning")] = None,
    microbatches: Annotated[Optional[int], typer.Option(min=1, help="Microbatches per step (for memory in flight; "
                                                         "default: 2 x the stage count).",
                                                         rich_help_panel="Partitioning")] = None,
    schedule: Annotated[Optional[str], typer.Option("--schedule", help="Pick a schedule for the plan and record it: "
                                                    "gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2, layerpipe, batched-w, "
                                                    "async-1f1b, layerpipe-async or auto.", rich_help_panel="Schedule")] = None,
    strategy: Annotated[Optional[StrategyChoice], typer.Option(
        help="A per-layer parallel configuration (degrees over batch, output and input channels) for each "
             "stage's --dp ranks (a power of two), recorded in the plan: auto (the search), dp (every layer "
             "splits the batch) or splitbrain (fully connected layers sharded in groups of --group). With "
             "--stages P > 1 (default 1 with --strategy) each stage's --dp ranks get their own, searched on the "
             "stage's graph where the plan cuts, run under any synchronous --schedule (default gpipe) over "
             "--microbatches. Costed for gloo: no "
             "all-to-all; height splits stay in the cost model only (fxpipe strategy --heights). \\[default: none]",
        rich_help_panel="Strategy")] = None,
    group: Annotated[Optional[int], typer.Option(min=1, help="SplitBrain's group of ranks (divides --dp) "
                                                 "\\[default: 2].", rich_help_panel="Strategy")] = None,
    profile: Annotated[bool, typer.Option(help="Measure each layer's time on real tensors instead of estimating.",
                                          rich_help_panel="Costs")] = False,
    profile_runs: Annotated[int, typer.Option(min=1, help="Runs per layer with --profile (median).",
                                              rich_help_panel="Costs")] = 5,
    profile_threads: Annotated[Optional[int], typer.Option(
        min=1, help="Threads to profile with (default: torch's); fxpipe run's ranks use 1 each.",
        rich_help_panel="Costs")] = None,
    device_flops: Annotated[Optional[float], typer.Option(help="FLOP/s for estimated times \\[default: 1e11].",
                                                          rich_help_panel="Costs")] = None,
    device_mem_bw: Annotated[Optional[str], typer.Option(help="Memory bandwidth per second for estimated times "
                                                         "\\[default: 10GB].", rich_help_panel="Costs")] = None,
    calibration: Annotated[Optional[str], typer.Option(help="on: estimate with this machine's GEMM, memory and "
                                                       "per-node times (measured once, cached); off: the fixed "
                                                       "--device-flops/--device-mem-bw model \\[default: "
                                                       "$FXPIPE_CALIBRATION, else on].",
                                                       rich_help_panel="Costs")] = None,
    device: Annotated[Device, typer.Option(help="Build the model on cpu, or on meta (no weights allocated).",
                                           rich_help_panel="Model")] = Device.cpu,
    dtype: Annotated[DType, typer.Option(help="Parameter dtype.", rich_help_panel="Model")] = DType.float32,
    batch_size: Annotated[Optional[int], typer.Option(min=1, help="Example batch size (zoo models).",
                                                      rich_help_panel="Model")] = None,
    seed: Annotated[int, typer.Option(help="Seed for weights and example inputs.", rich_help_panel="Model")] = 0,
    split_backward: Annotated[bool, typer.Option(help="Split each stage's backward into input-gradient (B) and "
                                                 "weight-gradient (W) graphs, and count real B/W FLOPs per layer.",
                                                 rich_help_panel="Backward")] = True,
    input_grads: Annotated[bool, typer.Option(help="Also differentiate the model's floating-point inputs.",
                                              rich_help_panel="Backward")] = False,
    balance_backward: Annotated[bool, typer.Option(help="Let the partitioner move activation derivatives "
                                                   "(relu, tanh, sigmoid) across the cuts it makes, into the next "
                                                   "stage's B, where that lowers the bottleneck (LayerPipe).",
                                                   rich_help_panel="Backward")] = False,
    verify_each: Annotated[bool, typer.Option(help="Check the graph's invariants after every pass.",
                                              rich_help_panel="Debugging")] = False,
    stop_after: Annotated[Optional[str], typer.Option(help="Stop after this pass (writes no plan).",
                                                      rich_help_panel="Debugging")] = None,
    print_after: Annotated[Optional[list[str]], typer.Option(help="Print the graph after this pass (repeatable).",
                                                             rich_help_panel="Debugging")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout, nothing else.",
                                          rich_help_panel="Output")] = False,
    plain: Annotated[bool, typer.Option(help="Plain-text tables (tabulate) instead of rich.",
                                        rich_help_panel="Output")] = False,
) -> None:
    """Trace, cost and partition a model; print the tables and write the plan directory."""
    with one_line_errors():
        started = time.perf_counter()
        with progress(disable=as_json) as step:
            step("importing torch", 0, 0)
            import torch

            quiet_torch_logs()

            from fxpipe.api import run_compile
            from fxpipe.plan import BuildRecipe, CompileOptions
            from fxpipe.targets import resolve

            if out_dir is not None:
                from fxpipe.plan_dir import check_out_dir

                from fxpipe.cli.common import check_outputs

                model_file = Path(target.rpartition(":")[0] or target)
                check_outputs([("the model file", model_file if model_file.is_file() else None)], [("--out", out_dir)])
                check_writable_dir(out_dir, "--out")  # before the compile, not after it
                check_out_dir(out_dir, overwrite=overwrite)
            searching = _check_plan(plan, stages, objective, devices, dp, schedule, microbatches, strategy)
            count, objective_text = _stage_count(None if searching else stages, objective,
                                                 None if searching else devices, dp)
            core_count = _cores(cores, planning=searching or objective_text is not None)
            if strategy is not None:
                from fxpipe.api import check_strategy

                if objective_text is not None:
                    raise OptionError("--strategy splits each stage's layers over its --dp ranks; it takes --stages 1, "
                                      "not auto, or another count of stages (--stages 2, 3, ...)")
                count = 1 if count is None else count
                check_strategy(strategy.value, count, dp, 2 if group is None else group, schedule=schedule)
            elif group is not None:
                raise OptionError("--group is SplitBrain's group of ranks; give it with --strategy splitbrain")
            if schedule is not None and microbatches is not None:  # before the compile: generating it could take ages
                from fxpipe.plan import DEFAULTS

                check_schedule_size(count if count is not None else DEFAULTS.stages, microbatches)
            step(f"building {target}", 0, 0)
            resolved = resolve(target, device=device.value, dtype=getattr(torch, dtype.value),
                               batch_size=batch_size, seed=seed)
            given = {"stages": count, "latency": latency, "device_flops": device_flops,
                     "bandwidth": parse_size(bandwidth, "--bandwidth") if bandwidth is not None else None,
                     "device_mem_bw": parse_size(device_mem_bw, "--device-mem-bw") if device_mem_bw is not None else None}
            options = CompileOptions(
                **{k: v for k, v in given.items() if v is not None},
                tracer=tracer.value, granularity=granularity,
                memory_per_stage=parse_size(memory_per_stage, "--memory-per-stage") if memory_per_stage else None,
                microbatches=microbatches, schedule=schedule, profile=profile, profile_runs=profile_runs,
                split_backward=split_backward, input_grads=input_grads, balance_backward=balance_backward,
                dp=dp, stage_objective=objective_text,
                max_stages=None if devices is None or objective_text is None else devices // dp,
                plan_search=searching, devices=devices if searching else None, cores=core_count,
            )
            from fxpipe.api import check_options

            check_options(options)  # every size bounded before calibrating, choosing a strategy or compiling
            from fxpipe.calibration.compute import calibrate_overheads, calibrated_options, describe
            from fxpipe.calibration.host import HostTuning

            runs_as = HostTuning.for_runs()  # measured and profiled as fxpipe run's ranks run
            if profile and runs_as.keep_freed_memory:
                from fxpipe.calibration.host_memory import keep_freed_memory

                keep_freed_memory()
            step("calibrating compute", 0, 0)
            options, rates, cached = calibrated_options(options, calibration, host=runs_as,
                                                        explicit=device_flops is not None or device_mem_bw is not None)
            if rates is not None:  # the runtime's fixed costs, for every simulation of the plan (plan_overheads)
                calibrate_overheads(rates, measure_runtime_overheads, threads=1)
            chosen = None
            if strategy is not None and count == 1:
                from fxpipe.api import choose_strategy

                step(f"choosing a per-layer strategy ({strategy.value}) on {dp} ranks", 0, 0)
                chosen = choose_strategy(resolved.model, resolved.example_inputs, strategy.value, ranks=dp,
                                         group=2 if group is None else group, bandwidth=options.bandwidth,
                                         latency=options.latency, compute=options.compute)
            compiled = run_compile(resolved.model, resolved.example_inputs, options,
                                   example_kwargs=resolved.example_kwargs, model_name=resolved.name,
                                   build=BuildRecipe(dtype.value, batch_size, seed), verify_each=verify_each,
                                   stop_after=stop_after, print_after=tuple(print_after or ()),
                                   on_pass=lambda name, i, n: step(f"pass {name}", i, n),
                                   profile_threads=profile_threads)
            if strategy is not None and count != 1 and compiled.pipeline is not None:  # cut where the plan cuts
                from fxpipe.api import choose_pipelined_strategy
                from fxpipe.plan import DEFAULTS

                step(f"choosing a per-layer strategy ({strategy.value}) for each of {count} stages on {dp} ranks",
                     0, 0)
                chosen = choose_pipelined_strategy(
                    resolved.model, resolved.example_inputs, strategy.value, compiled.pipeline.plan, ranks=dp,
                    group=2 if group is None else group,
                    microbatches=microbatches if microbatches is not None else DEFAULTS.microbatches(count),
                    bandwidth=options.bandwidth, latency=options.latency, compute=options.compute)
        history, root = compiled.history, compiled.root
        finished = compiled.pipeline is not None
        if chosen is not None and compiled.pipeline is not None:
            from fxpipe.api import set_strategy

            set_strategy(compiled.pipeline, chosen)
        reports = compiled.reports
        if chosen is not None and compiled.pipeline is None:  # stopped early: the tables still print, unrecorded
            reports = [*reports[:-1], *chosen.reports, reports[-1]]
        written = None
        if compiled.pipeline is not None and out_dir is not None:
            from fxpipe.api import save

            replaced: list[str] = []
            try:
                written = save(compiled.pipeline, out_dir, overwrite=overwrite, replaced=replaced)
            except (OSError, RuntimeError) as exc:  # torch.save raises RuntimeError when the disk is full
                if isinstance(exc, RuntimeError) and not _write_failure(exc):
                    raise
                from fxpipe.errors import first_line

                raise OptionError(f"--out {str(out_dir)!r} could not be written ({first_line(exc)}); free space "
                                  "there or choose another path") from None
            if replaced:
                say(f"note: --overwrite replaced {', '.join(replaced)} in {out_dir}, which fxpipe had not written")
        seconds = time.perf_counter() - started
        if as_json:
            hint = _cores_hint(options, rates is not None)
            doc = {
                "schema": "fxpipe.compile/v1",
                "model": resolved.name,
                "plan_dir": str(written) if written else None,
                "seconds": round(seconds, 3),
                "finished": finished,
                "bottleneck_ratio": _ratio(root),
                "reports": [r.to_json() for r in reports],
            }
            if chosen is not None:
                import dataclasses

                doc["strategy"] = dataclasses.asdict(chosen.record)
            if rates is not None:
                doc["calibration"] = describe(rates, cached=cached)
            if hint is not None:
                doc["hint"] = hint
            print(json.dumps(doc, default=str))
            return
        from fxpipe.render import print_reports

        print_reports(reports, plain=plain, console=out)
        if rates is not None:
            say(describe(rates, cached=cached), console=out)
        hint = _cores_hint(options, rates is not None)
        if hint is not None:
            say(hint, console=out)
        for rec in history.records:
            if rec.printed is not None:
                say(f"graph after {rec.name}", console=out, style="bold")
                say(rec.printed, console=out)
        if not finished:
            say(f"stopped after {history.records[-1].name}: no plan written")
        elif written is not None:
            using = "" if chosen is None else (
                f", strategy {chosen.record.name} on {chosen.record.ranks} ranks" + (
                    f" per stage, cut after {', '.join(chosen.record.cuts)}, {chosen.record.microbatches} "
                    "microbatches" if chosen.record.stages else ""))
            chosen_by = f", chosen by {options.stage_objective}" if options.stage_objective is not None else ""
            if options.plan_search:
                p = compiled.pipeline.plan
                chosen_by = (f" x {p.mesh.dp} replicas, {p.schedule.name if p.schedule else '?'} with "
                             f"{p.options.microbatches} microbatches, chosen on {options.devices} devices")
            say(f"wrote {written} ({compiled.pipeline.num_stages} stages{chosen_by}{using}) in {seconds:.1f} s")
        else:
            say(f"done in {seconds:.1f} s; no --out given, so no plan written")


def _write_failure(exc: RuntimeError) -> bool:
    """Whether torch.save's RuntimeError is a failed write (a full disk, a quota), not a bug to show."""
    text = str(exc).lower()
    return any(w in text for w in ("failed writing", "file write failed", "no space", "unexpected pos", "quota"))


def measure_runtime_overheads(rates: Any, threads: int) -> Any:
    """The runtime's fixed costs measured now on two local ranks (``fxpipe.calibration.runtime_costs.measure_overheads``),
    for ``calibrate_overheads`` to cache, on ranks tuned as ``fxpipe run``'s are."""
    from fxpipe.calibration.compute import machine_key
    from fxpipe.calibration.runtime_costs import measure_overheads

    return measure_overheads(rates, threads=threads, machine=machine_key(threads))


def _check_plan(plan: str | None, stages: str | None, objective: str | None, devices: int | None, dp: int,
                schedule: str | None, microbatches: int | None, strategy: object) -> bool:
    """``--plan auto``: whether to search, refusing the options it chooses itself."""
    if plan is None:
        return False
    if plan.strip().lower() != "auto":
        raise OptionError(f"--plan takes auto (got {plan!r}): search stages x dp x schedule x microbatches")
    if devices is None:
        raise OptionError("--plan auto needs --devices N: the devices it may use")
    chosen = [name for name, given in (("--stages", stages), ("--objective", objective), ("--schedule", schedule),
                                       ("--microbatches", microbatches), ("--strategy", strategy),
                                       ("--dp", dp if dp != 1 else None)) if given is not None]
    if chosen:
        raise OptionError(f"--plan auto chooses {', '.join(chosen)} itself; drop {'it' if len(chosen) == 1 else 'them'}")
    return True


def _stage_count(stages: str | None, objective: str | None, devices: int | None,
                 dp: int) -> tuple[int | None, str | None]:
    """``--stages N`` or ``auto`` (with ``--objective`` and ``--devices``): the fixed count, or the objective."""
    if stages is not None and stages.strip().lower() == "auto":
        from fxpipe.planning.stage_count import DEFAULT_OBJECTIVE, parse_objective

        if devices is not None and devices < dp:
            raise OptionError(f"--devices {devices} cannot hold one stage of --dp {dp} replicas; give --devices >= {dp}")
        return None, str(parse_objective(objective) if objective is not None else DEFAULT_OBJECTIVE)
    if objective is not None or devices is not None:
        raise OptionError("--objective and --devices choose the stage count; give them with --stages auto")
    if stages is None:
        return None, None
    try:
        count = int(stages)
    except ValueError:
        raise OptionError(f"--stages takes a number of stages or auto (got {stages!r}); e.g. --stages 4") from None
    if count < 1:
        raise OptionError(f"--stages must be at least 1 or auto (got {count}); e.g. --stages 2")
    return count, None


def _cores(text: str | None, *, planning: bool) -> int | None:
    """``--cores N`` or ``auto`` (this machine's ``os.cpu_count()``), given only with a planner; None when absent."""
    if text is None:
        return None
    if not planning:
        raise OptionError("--cores models the ranks time-sharing cores for the planners; give it with --plan auto or "
                          "--stages auto")
    if text.strip().lower() == "auto":
        import os

        return os.cpu_count() or 1
    try:
        count = int(text)
    except ValueError:
        raise OptionError(f"--cores takes a number of cores or auto (got {text!r}); e.g. --cores 2") from None
    if count < 1:
        raise OptionError(f"--cores must be at least 1 (got {count}); leave it out to model no time-sharing, or give "
                          "--cores auto for this machine's")
    return count


def _cores_hint(options: Any, calibrated: bool) -> str | None:
    """When a planner, estimating with this machine's calibrated compute (so for CPU ranks like its own), was given
    more devices than this machine has cores and no --cores: a line saying what --cores would change."""
    import os

    from fxpipe.planning.stage_count import DEFAULT_MAX_STAGES

    here = os.cpu_count() or 1
    devices = options.devices if options.plan_search else (
        (options.max_stages or DEFAULT_MAX_STAGES) * options.dp if options.stage_objective is not None else None)
    if options.cores is not None or not calibrated or devices is None or devices <= here:
        return None
    return (f"note: {devices} devices but this machine has {here} cores, and time-sharing was not modelled; if the "
            f"plan will run here (fxpipe run), --cores auto plans for {devices} ranks sharing {here} cores")


def _ratio(root: Any) -> float | None:
    plan = getattr(root, "meta", {}).get("fxpipe_stage_plan")
    return None if plan is None else plan.ratio

