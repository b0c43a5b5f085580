"""``fxpipe compile TARGET``: trace, cost and partition a model; print every pass's tables; write the plan directory."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fxpipe.cli.command_configs import CompileConfig, sizes
from fxpipe.cli.common import (
    check_schedule_size,
    check_writable_dir,
    one_line_errors,
    out,
    progress,
    quiet_torch_logs,
    say,
)
from fxpipe.cli.config import command
from fxpipe.errors import OptionError


def _compile(ctx: Any, config: CompileConfig) -> None:
    """Trace, cost and partition a model; print the tables and write the plan directory."""
    with one_line_errors():
        started = time.perf_counter()
        with progress(disable=config.output.as_json) as step:
            step("importing torch", 0, 0)
            import torch  # noqa: F401  (imported under the progress line: it takes seconds)

            quiet_torch_logs()
            _check_out(config)
            compiled = _run_compile(config, step)
        written = _save(config, compiled.pipeline) if compiled.pipeline is not None else None
        seconds = time.perf_counter() - started
        if config.output.as_json:
            _print_json(config, compiled, written, seconds)
        else:
            _print_text(config, compiled, written, seconds)


compile_cmd = command(CompileConfig, _compile, "compile")


@dataclass
class Compiled:
    """What a compile made: the pipeline (None: stopped early), its history and reports, the strategy chosen, and
    the calibration used."""

    pipeline: Any
    history: Any
    root: Any
    reports: list[Any]
    options: Any
    name: str
    chosen: Any = None
    rates: Any = None
    cached: bool = False


def _check_out(config: CompileConfig) -> None:
    """--out before the compile, not after it: writable, and a plan directory (or new)."""
    out_dir = config.output.out
    if out_dir is None:
        return
    from fxpipe.cli.common import check_outputs
    from fxpipe.plan_dir import check_out_dir

    target = config.target
    model_file = Path(target.rpartition(":")[0] or target)
    check_outputs([("the model file", model_file if model_file.is_file() else None)], [("--out", out_dir)])
    check_writable_dir(out_dir, "--out")
    check_out_dir(out_dir, overwrite=config.output.overwrite)


def _options(config: CompileConfig) -> Any:
    """The compiler's CompileOptions of the command line (checked, before any calibration or compile)."""
    from fxpipe.api import check_options
    from fxpipe.plan import CompileOptions

    p, c, b = config.partitioning, config.costs, config.backward
    count, objective = config.stage_count()
    if config.sharding.strategy is not None:
        count = 1 if count is None else count
    searching = config.searching
    size = sizes(bandwidth=p.bandwidth, memory_per_stage=p.memory_per_stage, device_mem_bw=c.device_mem_bw)
    given: dict[str, Any] = {"stages": count, "latency": p.latency, "device_flops": c.device_flops,
                             "bandwidth": size["bandwidth"], "device_mem_bw": size["device_mem_bw"]}
    options = CompileOptions(
        **{k: v for k, v in given.items() if v is not None},
        tracer=config.model.tracer, granularity=p.granularity, memory_per_stage=size["memory_per_stage"],
        microbatches=p.microbatches, schedule=config.scheduling.schedule, profile=c.profile,
        profile_runs=c.profile_runs, split_backward=b.split_backward, input_grads=b.input_grads,
        balance_backward=b.balance_backward, dp=p.dp, stage_objective=objective,
        max_stages=None if p.devices is None or objective is None else p.devices // p.dp,
        plan_search=searching, devices=p.devices if searching else None, cores=config.core_count(),
    )
    check_options(options)  # every size bounded before calibrating, choosing a strategy or compiling
    return options


def _check_strategy(config: CompileConfig, count: int | None) -> None:
    """--strategy against the stage count and schedule, and the schedule's size, before the compile (generating
    a schedule too large could take ages)."""
    p, s = config.partitioning, config.sharding
    schedule = config.scheduling.schedule
    if s.strategy is not None:
        from fxpipe.api import check_strategy

        check_strategy(s.strategy, 1 if count is None else count, p.dp, 2 if s.group is None else s.group,
                       schedule=schedule)
    if schedule is not None and p.microbatches is not None:
        from fxpipe.plan import DEFAULTS

        check_schedule_size(count if count is not None else DEFAULTS.stages, p.microbatches)


def _calibrate(config: CompileConfig, options: Any, step: Any) -> tuple[Any, Any, bool]:
    """The options with this machine's calibrated compute (and the runtime's fixed costs cached), as fxpipe run's
    ranks run: (options, rates or None, whether they were cached)."""
    from fxpipe.calibration.compute import calibrate_overheads, calibrated_options
    from fxpipe.calibration.host import HostTuning

    c = config.costs
    runs_as = HostTuning.for_runs()  # measured and profiled as fxpipe run's ranks run
    if c.profile and runs_as.keep_freed_memory:
        from fxpipe.calibration.host_memory import keep_freed_memory

        keep_freed_memory()
    step("calibrating compute", 0, 0)
    options, rates, cached = calibrated_options(options, c.calibration, host=runs_as,
                                                explicit=c.device_flops is not None or c.device_mem_bw is not None)
    if rates is not None:  # the runtime's fixed costs, for every simulation of the plan (plan_overheads)
        calibrate_overheads(rates, measure_runtime_overheads, threads=1)
    return options, rates, cached


def _run_compile(config: CompileConfig, step: Any) -> Compiled:
    """Build the target, calibrate, choose a per-layer strategy where asked, and run the passes."""
    import torch

    from fxpipe.api import run_compile
    from fxpipe.plan import DEFAULTS, BuildRecipe
    from fxpipe.targets import resolve

    m, p, s, d = config.model, config.partitioning, config.sharding, config.debugging
    count = config.stage_count()[0]
    count = 1 if s.strategy is not None and count is None else count
    _check_strategy(config, count)
    step(f"building {config.target}", 0, 0)
    resolved = resolve(config.target, device=m.build_device, dtype=getattr(torch, m.dtype),
                       batch_size=m.batch_size, seed=m.seed)
    options, rates, cached = _calibrate(config, _options(config), step)
    group = 2 if s.group is None else s.group
    chosen = None
    if s.strategy is not None and count == 1:
        from fxpipe.api import choose_strategy

        step(f"choosing a per-layer strategy ({s.strategy}) on {p.dp} ranks", 0, 0)
        chosen = choose_strategy(resolved.model, resolved.example_inputs, s.strategy, ranks=p.dp, group=group,
                                 bandwidth=options.bandwidth, latency=options.latency, compute=options.compute)
    compiled = run_compile(resolved.model, resolved.example_inputs, options,
                           example_kwargs=resolved.example_kwargs, model_name=resolved.name,
                           build=BuildRecipe(m.dtype, m.batch_size, m.seed), verify_each=d.verify_each,
                           stop_after=d.stop_after, print_after=tuple(d.print_after or ()),
                           on_pass=lambda name, i, n: step(f"pass {name}", i, n),
                           profile_threads=config.costs.profile_threads)
    pipeline = compiled.pipeline
    # --strategy set count (1 above); `count is not None` says so to mypy
    if s.strategy is not None and count is not None and count != 1 and pipeline is not None:  # cut where the plan cuts
        from fxpipe.api import choose_pipelined_strategy

        step(f"choosing a per-layer strategy ({s.strategy}) for each of {count} stages on {p.dp} ranks", 0, 0)
        chosen = choose_pipelined_strategy(
            resolved.model, resolved.example_inputs, s.strategy, pipeline.plan, ranks=p.dp, group=group,
            microbatches=p.microbatches if p.microbatches is not None else DEFAULTS.microbatches(count),
            bandwidth=options.bandwidth, latency=options.latency, compute=options.compute)
    if chosen is not None and pipeline is not None:
        from fxpipe.api import set_strategy

        set_strategy(pipeline, chosen)
    reports = compiled.reports
    if chosen is not None and pipeline is None:  # stopped early: the tables still print, unrecorded
        reports = [*reports[:-1], *chosen.reports, reports[-1]]
    return Compiled(pipeline, compiled.history, compiled.root, reports, options, resolved.name, chosen, rates, cached)


def _save(config: CompileConfig, pipeline: Any) -> Path | None:
    """The plan written to --out (None without it); a failed write is one line."""
    out_dir = config.output.out
    if out_dir is None:
        return None
    from fxpipe.api import save

    replaced: list[str] = []
    try:
        written = save(pipeline, out_dir, overwrite=config.output.overwrite, replaced=replaced)
    except (OSError, RuntimeError) as exc:  # torch.save raises RuntimeError when the disk is full
        if isinstance(exc, RuntimeError) and not _write_failure(exc):
            raise
        from fxpipe.errors import first_line

        raise OptionError(f"--out {str(out_dir)!r} could not be written ({first_line(exc)}); free space "
                          "there or choose another path") from None
    if replaced:
        say(f"note: --overwrite replaced {', '.join(replaced)} in {out_dir}, which fxpipe had not written")
    return Path(written)


def _print_json(config: CompileConfig, c: Compiled, written: Path | None, seconds: float) -> None:
    from fxpipe.calibration.compute import describe

    doc: dict[str, Any] = {
        "schema": "fxpipe.compile/v1",
        "model": c.name,
        "plan_dir": str(written) if written else None,
        "seconds": round(seconds, 3),
        "finished": c.pipeline is not None,
        "bottleneck_ratio": _ratio(c.root),
        "reports": [r.to_json() for r in c.reports],
    }
    if c.chosen is not None:
        import dataclasses

        doc["strategy"] = dataclasses.asdict(c.chosen.record)
    if c.rates is not None:
        doc["calibration"] = describe(c.rates, cached=c.cached)
    hint = _cores_hint(c.options, c.rates is not None)
    if hint is not None:
        doc["hint"] = hint
    print(json.dumps(doc, default=str))


def _print_text(config: CompileConfig, c: Compiled, written: Path | None, seconds: float) -> None:
    from fxpipe.calibration.compute import describe
    from fxpipe.render import print_reports

    print_reports(c.reports, plain=config.output.plain, console=out)
    if c.rates is not None:
        say(describe(c.rates, cached=c.cached), console=out)
    hint = _cores_hint(c.options, c.rates is not None)
    if hint is not None:
        say(hint, console=out)
    for rec in c.history.records:
        if rec.printed is not None:
            say(f"graph after {rec.name}", console=out, style="bold")
            say(rec.printed, console=out)
    if c.pipeline is None:
        say(f"stopped after {c.history.records[-1].name}: no plan written")
    elif written is not None:
        say(f"wrote {written} ({c.pipeline.num_stages} stages{_chosen_by(c)}) in {seconds:.1f} s")
    else:
        say(f"done in {seconds:.1f} s; no --out given, so no plan written")


def _chosen_by(c: Compiled) -> str:
    """What chose the plan, for the last line: the stage objective or the plan search, and the strategy."""
    options, chosen = c.options, c.chosen
    using = "" if chosen is None else (
        f", strategy {chosen.record.name} on {chosen.record.ranks} ranks" + (
            f" per stage, cut after {', '.join(chosen.record.cuts)}, {chosen.record.microbatches} "
            "microbatches" if chosen.record.stages else ""))
    chosen_by = f", chosen by {options.stage_objective}" if options.stage_objective is not None else ""
    if options.plan_search:
        p = c.pipeline.plan
        chosen_by = (f" x {p.mesh.dp} replicas, {p.schedule.name if p.schedule else '?'} with "
                     f"{p.options.microbatches} microbatches, chosen on {options.devices} devices")
    return chosen_by + using


def _write_failure(exc: RuntimeError) -> bool:
    """Whether torch.save's RuntimeError is a failed write (a full disk, a quota), not a bug to show."""
    text = str(exc).lower()
    return any(w in text for w in ("failed writing", "file write failed", "no space", "unexpected pos", "quota"))


def measure_runtime_overheads(rates: Any, threads: int) -> Any:
    """The runtime's fixed costs measured now on two local ranks
    (``fxpipe.calibration.runtime_costs.measure_overheads``), for ``calibrate_overheads`` to cache, on ranks tuned
    as ``fxpipe run``'s are."""
    from fxpipe.calibration.compute import machine_key
    from fxpipe.calibration.runtime_costs import measure_overheads

    return measure_overheads(rates, threads=threads, machine=machine_key(threads))


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

