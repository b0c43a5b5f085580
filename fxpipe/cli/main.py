"""``fxpipe compile | inspect | models``: tables on stdout, progress on stderr, one-line errors with exit code 2.

Nothing here imports torch at module level, so ``fxpipe --help`` answers at once.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

# torch warns on import when NumPy is absent; fxpipe never needs NumPy, so the warning is noise.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from fxpipe.errors import FxpipeError, OptionError

app = typer.Typer(
    name="fxpipe",
    help="Turn a PyTorch model into pipeline stages, and show every decision as a table.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
out = Console()
err = Console(stderr=True)


class Tracer(str, Enum):
    export = "export"
    fx = "fx"


class Device(str, Enum):
    cpu = "cpu"
    meta = "meta"


class DType(str, Enum):
    float32 = "float32"
    float64 = "float64"
    bfloat16 = "bfloat16"


@contextmanager
def _errors() -> Iterator[None]:
    """An FxpipeError becomes one line on stderr and exit code 2; Ctrl-C exits 130."""
    try:
        yield
    except FxpipeError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=2) from None
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(code=130) from None


_SIZE = re.compile(r"^\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNIT = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
         "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}


def parse_size(text: str, option: str) -> float:
    """``8GiB``, ``512MB``, ``1.5e9`` -> bytes."""
    match = _SIZE.match(text)
    if not match or match.group(2).lower() not in _UNIT:
        raise OptionError(f"{option} {text!r} is not a size; write e.g. 8GiB, 512MB or 1.5e9")
    return float(match.group(1)) * _UNIT[match.group(2).lower()]


@app.command("compile")
def compile_cmd(
    target: Annotated[str, typer.Argument(help="A zoo model (gpt, gpt-tiny, resnet-50, ...) or file.py:build.")],
    stages: Annotated[int, typer.Option("--stages", "-s", min=1, help="Number of pipeline stages.",
                                        rich_help_panel="Partitioning")] = 2,
    out_dir: Annotated[Optional[Path], typer.Option("--out", "-o", help="Plan directory to write.",
                                                    rich_help_panel="Output")] = None,
    tracer: Annotated[Tracer, typer.Option(help="Graph capture: torch.export, or torch.fx as a fallback.")] = Tracer.export,
    granularity: Annotated[str, typer.Option(help="Layers: auto (repeating blocks), node, or a module depth (1, 2, ...).",
                                             rich_help_panel="Partitioning")] = "auto",
    bandwidth: Annotated[str, typer.Option(help="Link bandwidth per second between stages, e.g. 1.5GB.",
                                           rich_help_panel="Partitioning")] = "1.5GB",
    latency: Annotated[float, typer.Option(help="Seconds per transfer.", rich_help_panel="Partitioning")] = 1e-4,
    memory_per_stage: Annotated[Optional[str], typer.Option(help="Memory cap per stage, e.g. 8GiB.",
                                                             rich_help_panel="Partitioning")] = None,
    microbatches: Annotated[Optional[int], typer.Option(min=1, help="Microbatches per step (for memory in flight; "
                                                         "default: the stage count).", rich_help_panel="Partitioning")] = None,
    schedule: Annotated[Optional[str], typer.Option("--schedule", help="Pick a schedule for the plan and record it: "
                                                    "gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2, layerpipe, async-1f1b "
                                                    "or auto.", rich_help_panel="Schedule")] = None,
    profile: Annotated[bool, typer.Option(help="Measure each layer's time on real tensors instead of estimating.",
                                          rich_help_panel="Costs")] = False,
    profile_runs: Annotated[int, typer.Option(min=1, help="Runs per layer with --profile (median).",
                                              rich_help_panel="Costs")] = 5,
    profile_threads: Annotated[Optional[int], typer.Option(
        min=1, help="Threads to profile with (default: torch's); fxpipe run's ranks use 1 each.",
        rich_help_panel="Costs")] = None,
    device_flops: Annotated[float, typer.Option(help="FLOP/s for estimated times.", rich_help_panel="Costs")] = 1e11,
    device_mem_bw: Annotated[str, typer.Option(help="Memory bandwidth per second for estimated times.",
                                               rich_help_panel="Costs")] = "10GB",
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
    balance_backward: Annotated[bool, typer.Option(help="Move activation derivatives at a cut into the next "
                                                   "stage's B when that lowers the bottleneck (LayerPipe).",
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
    with _errors():
        started = time.perf_counter()
        with _progress(disable=as_json) as step:
            step("importing torch", 0, 0)
            import torch

            from fxpipe.passes import CompileOptions, build_steps, run_steps
            from fxpipe.pipeline import pipeline_from_root
            from fxpipe.targets import resolve

            if out_dir is not None:
                from fxpipe.plan_dir import check_out_dir

                check_out_dir(out_dir)  # before the compile, not after it
            step(f"building {target}", 0, 0)
            resolved = resolve(target, device=device.value, dtype=getattr(torch, dtype.value),
                               batch_size=batch_size, seed=seed)
            options = CompileOptions(
                stages=stages, tracer=tracer.value, granularity=granularity,
                bandwidth=parse_size(bandwidth, "--bandwidth"), latency=latency,
                memory_per_stage=parse_size(memory_per_stage, "--memory-per-stage") if memory_per_stage else None,
                microbatches=microbatches, profile=profile, profile_runs=profile_runs,
                device_flops=device_flops, device_mem_bw=parse_size(device_mem_bw, "--device-mem-bw"),
                split_backward=split_backward, input_grads=input_grads, balance_backward=balance_backward,
                verify_each=verify_each, stop_after=stop_after, print_after=tuple(print_after or ()),
            )
            steps = build_steps(resolved.model, resolved.example_inputs, options, resolved.example_kwargs)
            threads = torch.get_num_threads()
            if profile_threads is not None:
                torch.set_num_threads(profile_threads)
            try:
                root, history = run_steps(steps, verify_each=options.verify_each, stop_after=options.stop_after,
                                          print_after=options.print_after,
                                          on_start=lambda name, i, n: step(f"pass {name}", i, n))
            finally:
                profiled_threads = torch.get_num_threads()
                torch.set_num_threads(threads)
        reports = [r for rec in history.records for r in rec.reports] + [history.report()]
        finished = len(history.records) == len(steps)
        written = None
        info: dict[str, Any] = {"model": resolved.name, "options": options.to_json(),
                                # how the example was built: what fxpipe run / PipelineRuntime rebuild
                                "build": {"dtype": dtype.value, "batch_size": batch_size, "seed": seed},
                                "profile_threads": profiled_threads if profile else None}
        if finished:
            pipe = pipeline_from_root(root, history, info=info)
            if schedule is not None:
                pipe.set_schedule(schedule, microbatches)
                reports = pipe.report()
            if out_dir is not None:
                written = pipe.save(out_dir)
        seconds = time.perf_counter() - started
        if as_json:
            doc = {
                "schema": "fxpipe.compile/v1",
                "model": resolved.name,
                "plan_dir": str(written) if written else None,
                "seconds": round(seconds, 3),
                "finished": finished,
                "bottleneck_ratio": _ratio(root),
                "reports": [r.to_json() for r in reports],
            }
            print(json.dumps(doc, default=str))
            return
        from fxpipe.render import print_reports

        print_reports(reports, plain=plain, console=out)
        for rec in history.records:
            if rec.printed is not None:
                out.print(f"[bold]graph after {rec.name}[/]")
                out.print(rec.printed, highlight=False, markup=False)
        if not finished:
            err.print(f"stopped after {history.records[-1].name}: no plan written")
        elif written is not None:
            err.print(f"wrote {written} ({stages} stages) in {seconds:.1f} s")
        else:
            err.print(f"done in {seconds:.1f} s; no --out given, so no plan written")


@app.command("simulate")
def simulate_cmd(
    target: Annotated[Optional[str], typer.Argument(help="A plan directory, a zoo model or file.py:build; optional "
                                                     "with --uniform-costs.")] = None,
    schedule: Annotated[str, typer.Option("--schedule", help="gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2, "
                                          "layerpipe, async-1f1b, or auto.")] = "1f1b",
    microbatches: Annotated[Optional[int], typer.Option(min=1, help="Microbatches per step (default: 2 x stages; "
                                                         "auto tries 1, 2 and 4 x stages).")] = None,
    stages: Annotated[Optional[int], typer.Option("--stages", "-s", min=1, help="Stages (for a model target or "
                                                  "--uniform-costs alone).")] = None,
    uniform_costs: Annotated[Optional[str], typer.Option(help="F,B,W: every stage takes these times and transfers "
                                                         "are free (for checking closed forms).")] = None,
    memory_per_stage: Annotated[Optional[str], typer.Option(help="Activation memory cap per rank for auto, e.g. 2GiB.")] = None,
    trace: Annotated[Optional[Path], typer.Option(help="Write a Chrome-trace JSON (Perfetto, chrome://tracing).")] = None,
    svg: Annotated[Optional[Path], typer.Option(help="Write an SVG Gantt chart.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout, nothing else.")] = False,
    plain: Annotated[bool, typer.Option(help="Plain-text tables.")] = False,
) -> None:
    """Simulate a schedule on a plan's costs: per-rank table, ASCII timeline, optional trace and SVG."""
    with _errors():
        from fxpipe.schedules.auto import choose
        from fxpipe.schedules.simulate import Costs, costs_from_info, report
        from fxpipe.schedules.timeline import ascii_timeline, write_chrome_trace, write_svg

        unit = "s"
        if uniform_costs is not None:
            values = _floats(uniform_costs, "--uniform-costs", 3)
            num_stages = stages if stages is not None else (_plan_stages(target) if target else None)
            if num_stages is None:
                raise OptionError("--uniform-costs needs --stages (or a target to take the stage count from)")
            costs = Costs.uniform(num_stages, *values)
            unit = "unit"
        elif target is None:
            raise OptionError("give a plan directory or a model to simulate, or --uniform-costs F,B,W with --stages")
        else:
            info = _plan_info(target, stages)
            costs = costs_from_info(info)
            num_stages = len(costs.f)
        cap = parse_size(memory_per_stage, "--memory-per-stage") if memory_per_stage else None
        sched, result, extra = choose(schedule, num_stages, microbatches, costs, cap)
        table = report(result, sched, unit=unit)
        if trace is not None:
            write_chrome_trace(result, trace, time_unit_us=1e6 if unit == "s" else 1.0)
        if svg is not None:
            write_svg(result, svg)
        if as_json:
            print(json.dumps({
                "schema": "fxpipe.simulate/v1", "schedule": sched.name, "microbatches": sched.num_microbatches,
                "stages": sched.num_stages, "ranks": sched.num_ranks, "time_unit": unit,
                "makespan": result.makespan, "max_stage_span": result.max_stage_span,
                "per_rank": result.to_json()["ranks"], "staleness": result.to_json()["staleness"],
                "schedule_csv": sched.to_csv(), "reports": [r.to_json() for r in [*extra, table]],
            }))
            return
        from fxpipe.render import print_reports

        print_reports([*extra, table], plain=plain, console=out)
        print(ascii_timeline(result))  # plain print: rich would wrap the long rows
        for path in (trace, svg):
            if path is not None:
                err.print(f"wrote {path}")


def _floats(text: str, option: str, count: int) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) != count or any(v < 0 for v in values):
        raise OptionError(f"{option} takes {count} non-negative numbers separated by commas (got {text!r}); e.g. 1,1,1")
    return values


def _plan_stages(target: str) -> int | None:
    path = Path(target)
    if (path / "plan.json").is_file():
        from fxpipe.plan_dir import read_plan_json

        return int(read_plan_json(path)["num_stages"])
    return None


def _plan_info(target: str, stages: int | None) -> dict[str, Any]:
    """Per-stage costs from a plan directory, or from compiling a model target."""
    path = Path(target)
    if path.is_dir():
        from fxpipe.plan_dir import read_plan_json

        return dict(read_plan_json(path).get("info", {}))
    import torch  # noqa: F401  (the compile below needs it; imported here to keep --help fast)

    from fxpipe.passes import CompileOptions, build_steps, run_steps
    from fxpipe.pipeline import pipeline_from_root
    from fxpipe.targets import resolve

    resolved = resolve(target)
    root, history = run_steps(build_steps(resolved.model, resolved.example_inputs,
                                          CompileOptions(stages=stages or 4), resolved.example_kwargs))
    return pipeline_from_root(root, history).info


@app.command("run")
def run_cmd(
    plan_dir: Annotated[Path, typer.Argument(help="A plan directory written by fxpipe compile (of a built-in model).")],
    nproc: Annotated[int, typer.Option(min=1, help="Ranks to start (one per stage, or stages/2 for interleaved).")] = 2,
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps.")] = 3,
    schedule: Annotated[Optional[str], typer.Option(help="Schedule (default: the one recorded in the plan, else 1f1b).")] = None,
    microbatches: Annotated[Optional[int], typer.Option(min=1, help="Microbatches per step.")] = None,
    data: Annotated[str, typer.Option(help="Training data: synthetic (random batches shaped like the example).")] = "synthetic",
    lr: Annotated[float, typer.Option(help="SGD learning rate.")] = 0.01,
    timeout: Annotated[float, typer.Option(help="Seconds a rank waits for a peer before giving up.")] = 60.0,
    checkpoint_dir: Annotated[Optional[Path], typer.Option(help="Save every rank's state here after each step.")] = None,
    resume: Annotated[bool, typer.Option(help="Start from the checkpoint in --checkpoint-dir.")] = False,
    trace: Annotated[Optional[Path], typer.Option(help="Write the last step's measured timeline (Chrome trace).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout, nothing else.")] = False,
    plain: Annotated[bool, typer.Option(help="Plain-text tables.")] = False,
    fail_rank: Annotated[int, typer.Option(hidden=True, help="Fault injection for tests: this rank raises.")] = -1,
    kill_rank: Annotated[int, typer.Option(hidden=True, help="Fault injection for tests: this rank is SIGKILLed "
                                                             "mid-step.")] = -1,
) -> None:
    """Train the plan on NPROC ranks (torch.distributed.run, gloo): per-step table, measured vs simulated."""
    with _errors():
        import os
        import shutil
        import statistics
        import sys
        import tempfile

        from fxpipe.plan_dir import read_plan_json
        from fxpipe.report import Report

        plan_doc = read_plan_json(plan_dir)
        from fxpipe.schedules.auto import plan_schedule

        # Before starting any rank: the schedule must exist and fit the plan on --nproc ranks.
        sched = plan_schedule(plan_doc.get("info", {}), int(plan_doc["num_stages"]), schedule, microbatches)
        if sched.num_ranks != nproc:
            raise OptionError(f"{sched.name} runs this plan's {sched.num_stages} stages on {sched.num_ranks} ranks, "
                              f"not {nproc}; use --nproc {sched.num_ranks}")
        if data != "synthetic":
            raise OptionError(f"--data {data!r} is not known; use --data synthetic")
        if resume and checkpoint_dir is None:
            raise OptionError("--resume needs --checkpoint-dir")
        out_dir = Path(tempfile.mkdtemp(prefix="fxpipe-run-"))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "fxpipe.runtime.launch", str(plan_dir), "--out", str(out_dir), "--steps", str(steps),
               "--lr", str(lr), "--timeout", str(timeout), "--fail-rank", str(fail_rank),
               "--kill-rank", str(kill_rank)]
        for flag, value in (("--schedule", schedule), ("--microbatches", microbatches),
                            ("--checkpoint-dir", checkpoint_dir)):
            if value is not None:
                cmd += [flag, str(value)]
        if resume:
            cmd.append("--resume")
        try:
            with _progress(disable=as_json) as step:
                step(f"starting {nproc} ranks", 0, steps)
                proc = _run_ranks(cmd, out_dir / "progress",
                                  lambda line: step(f"step {line.split()[1]}/{steps}: loss {line.split()[3]}, "
                                                    f"{line.split()[5]} ms", int(line.split()[1]), steps))
            errors = {int(p.stem[4:]): p.read_text().strip() for p in out_dir.glob("rank*.error")}
            errors = {rank: why for rank, why in errors.items() if why}  # empty: stopped while writing it
            if proc.returncode != 0 or errors:
                # The root cause is a rank that died without a word (a signal, os._exit: torchrun's summary
                # has its exit code) or failed by itself, not one that gave up waiting for it, nor one
                # torchrun stopped (SIGTERM) because another had failed.
                done = errors.keys() | {int(p.stem[4:]) for p in out_dir.glob("rank*.json")}
                died = _died_ranks(proc.stderr, done)
                first = sorted(errors.items(), key=lambda kv: ("waited for" in kv[1], kv[0]))
                alone = [kv for kv in first if "waited for" not in kv[1]]
                if died and (not died[0][2] or not alone):
                    rank, how, _ = died[0]
                    raise FxpipeError(f"rank {rank} died ({how}) without an error report; the other ranks stopped"
                                      + (f" ({len(errors)} reported waiting for it)" if errors else ""))
                if alone:
                    rank, why = alone[0]
                    raise FxpipeError(f"rank {rank} failed: {why}; the other ranks stopped"
                                      + (f" ({len(errors) - 1} reported waiting for it)" if len(errors) > 1 else ""))
                if first:
                    rank, why = first[0]
                    named = re.search(r"\brank (\d+) ", why)
                    culprit = named.group(1) if named else "?"
                    raise FxpipeError(f"rank {culprit} failed without an error report; rank {rank} reported: {why}")
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise FxpipeError(f"the ranks exited with code {proc.returncode} without a report ({tail[:200]}); "
                                  "re-run to see the ranks' output")
            results = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)
        step_ms = [max(r["step_ms"][i] for r in results) for i in range(len(results[0]["step_ms"]))]
        batch = results[0]["batch"]
        measured = statistics.median(step_ms[1:] if len(step_ms) > 1 else step_ms)
        doc = {
            "schema": "fxpipe.run/v1", "schedule": results[0]["schedule"], "microbatches": results[0]["microbatches"],
            "ranks": nproc, "batch": batch, "losses": results[0]["losses"], "step_ms": step_ms,
            "step_ms_median": measured, "samples_per_s": batch / (measured / 1e3),
            "simulated_step_ms": results[0]["simulated_step_ms"], "simulated_from_profile": bool(results[0].get("profiled")),
            "peak_rss_mib_per_rank": [r["peak_rss_mib"] for r in results],
        }
        if trace is not None:
            _write_measured_trace(results, trace)
        if as_json:
            print(json.dumps(doc))
            return
        from fxpipe.render import print_reports

        per_step = Report("run: per step", ("step", "loss", "step ms", "samples/s"),
                          tuple((i, round(loss, 6), round(ms, 2), round(batch / (ms / 1e3), 1))
                                for i, (loss, ms) in enumerate(zip(doc["losses"], step_ms))),
                          (f"{doc['schedule']}, {doc['microbatches']} microbatches, {nproc} ranks: median step "
                           f"{measured:.2f} ms measured (after the first), {doc['simulated_step_ms']:.2f} ms simulated"
                           + ("" if results[0].get("profiled") else
                              " from estimated costs (compile with --profile to simulate with measured ones)")
                           + (f" (profiled with {results[0]['profile_threads']} threads, the ranks ran with 1: "
                              "compile with --profile-threads 1 to match)"
                              if (results[0].get("profile_threads") or 1) != 1 else ""),))
        per_rank = Report("run: per rank", ("rank", "peak RSS MiB", "median step ms"),
                          tuple((r["rank"], round(r["peak_rss_mib"], 1), round(statistics.median(r["step_ms"]), 2))
                                for r in results))
        print_reports([per_step, per_rank], plain=plain, console=out)
        if trace is not None:
            err.print(f"wrote {trace}")


def _run_ranks(cmd: list[str], progress: Path, on_step: Callable[[str], None]) -> subprocess.CompletedProcess[str]:
    """Run torchrun, reporting each step rank 0 finishes (a line ``step K loss L ms T`` in ``progress``)."""
    import os
    import tempfile
    import threading

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as errf:
        proc = subprocess.Popen(cmd, stdout=out, stderr=errf, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        shown = 0
        done = threading.Event()
        while not done.wait(0.2):
            if proc.poll() is not None:
                done.set()
            lines = progress.read_text().splitlines() if progress.exists() else []
            for line in lines[shown:]:
                if line.startswith("step "):
                    on_step(line)
            shown = len(lines)
        out.seek(0)
        errf.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), errf.read())


def _died_ranks(torchrun_stderr: str, reported: set[int]) -> list[tuple[int, str, bool]]:
    """The ranks torchrun's failure summary lists that wrote neither a result nor an error: (rank, how it
    ended, whether by SIGTERM), those torchrun itself stopped (SIGTERM, once another rank failed) last."""
    import signal

    died = []
    for rank, code in re.findall(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", torchrun_stderr):
        rank, code = int(rank), int(code)
        if rank in reported or code == 0:
            continue
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = "unknown signal"
            how = f"killed by signal {-code}, {name}" + (": often the out-of-memory killer" if -code == 9 else "")
        else:
            how = f"exit code {code}"
        died.append((code == -signal.SIGTERM, rank, how))
    return [(rank, how, term) for term, rank, how in sorted(set(died))]


def _write_measured_trace(results: list[dict[str, Any]], path: Path) -> None:
    """The last step's measured actions, in the same Chrome-trace format as fxpipe simulate."""
    from fxpipe.schedules.ir import Action
    from fxpipe.schedules.simulate import Event, RankStats, SimResult
    from fxpipe.schedules.timeline import write_chrome_trace

    events = [Event(r["rank"], Action.parse(a), t0, t1) for r in results for a, t0, t1 in r["events"]]
    ranks = tuple(RankStats(r["rank"], min((e[1] for e in r["events"]), default=0.0),
                            max((e[2] for e in r["events"]), default=0.0),
                            sum(e[2] - e[1] for e in r["events"]), 0.0, 0, 0.0) for r in results)
    end = max((e.end for e in events), default=0.0)
    write_chrome_trace(SimResult(f"measured {results[0]['schedule']}", end, max(r.span for r in ranks), ranks,
                                 tuple(events)), path)


@app.command("inspect")
def inspect_cmd(
    plan_dir: Annotated[Path, typer.Argument(help="A plan directory written by fxpipe compile.")],
    as_json: Annotated[bool, typer.Option("--json", help="plan.json's summary as JSON.")] = False,
    plain: Annotated[bool, typer.Option(help="Plain-text tables.")] = False,
) -> None:
    """Print a plan directory's tables again, without recompiling."""
    with _errors():
        from fxpipe.plan_dir import read_plan_json
        from fxpipe.report import Report

        doc = read_plan_json(plan_dir)
        reports = [Report.from_json(r) for r in doc.get("reports", [])]
        summary = Report(
            title=f"plan {plan_dir}",
            columns=("stage", "module", "inputs", "outputs", "parameters", "param elements"),
            rows=tuple((s["index"], s["module"], len(s["inputs"]), len(s["outputs"]), len(s["parameters"]),
                        sum(_numel(p["shape"]) for p in s["parameters"])) for s in doc["stages"]),
            notes=(f"schema {doc['schema']}, fxpipe {doc.get('fxpipe_version')}, torch {doc.get('torch_version')}, "
                   f"model {doc.get('info', {}).get('model', '?')}",),
        )
        if as_json:
            print(json.dumps({"schema": "fxpipe.inspect/v1", "plan": doc}, default=str))
            return
        from fxpipe.render import print_reports

        print_reports([*reports, summary], plain=plain, console=out)


@app.command("models")
def models_cmd(
    as_json: Annotated[bool, typer.Option("--json", help="The zoo as JSON.")] = False,
    plain: Annotated[bool, typer.Option(help="Plain-text table.")] = False,
) -> None:
    """List the built-in models and their sizes with parameter counts."""
    with _errors():
        from fxpipe import models
        from fxpipe.report import Report

        rows = []
        for entry in models.entries():
            for size in entry.sizes:
                name = f"{entry.family}-{size}"
                rows.append((name, models.parameter_count(name), "yes" if size == entry.default_size else "",
                             entry.description))
        if as_json:
            print(json.dumps({"schema": "fxpipe.models/v1", "models": [
                {"name": r[0], "parameters": r[1], "default": bool(r[2]), "description": r[3]} for r in rows]}))
            return
        from fxpipe.render import print_reports

        print_reports([Report("fxpipe models (the bare family name is the default size)",
                              ("model", "parameters", "default", "description"), tuple(rows))],
                      plain=plain, console=out)


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _ratio(root: Any) -> float | None:
    plan = getattr(root, "meta", {}).get("fxpipe_stage_plan")
    return None if plan is None else plan.ratio


@contextmanager
def _progress(*, disable: bool) -> Iterator[Callable[[str, int, int], None]]:
    """A transient spinner on stderr (drawn only on a terminal)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=err, transient=True, disable=disable or not err.is_terminal)
    with progress:
        task = progress.add_task("starting", total=None)

        def step(description: str, done: int, total: int) -> None:
            progress.update(task, description=description, completed=done, total=total or None)

        yield step


def main() -> None:
    app()


if __name__ == "__main__":
    main()
