"""The configurations of ``fxpipe compile``, ``simulate``, ``strategy``, ``inspect``, ``models`` and ``export``: every
option declared once (type, default, choices, help), as :class:`fxpipe.cli.run_config.RunConfig` is ``fxpipe run``'s.

Each command is built from its config by :func:`fxpipe.cli.config.command`, so each has ``--config FILE`` and
``--print-config``. An option that means the same in two commands has the same flag and the same choices in both:
``--schedule`` (:data:`ScheduleName`), ``--optimizer sgd|adamw`` with ``--momentum`` (as ``fxpipe run``'s),
``--dp``, ``--cores``, ``--bandwidth``, ``--latency``, ``--json``, ``--plain``. Where the meaning differs the word does
too: ``compile --build-device cpu|meta`` (where the model is built) is not ``run --device cpu|cuda`` (where ranks
train); ``compile --memory-per-stage`` (all of a stage's bytes), ``simulate --activation-memory-per-stage`` (the
activations a schedule holds) and ``strategy --memory-per-device`` (one rank's share of a layer-split model).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fxpipe.cli.config import Config, option, section
from fxpipe.errors import OptionError

# fxpipe.schedules.generators.GENERATORS' names and auto (tests/cli/test_command_configs.py checks they agree)
ScheduleName = Literal["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "layerpipe", "batched-w", "async-1f1b",
                       "layerpipe-async", "auto"]
Optimizer = Literal["sgd", "adamw"]
SCHEDULES = "gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2, layerpipe, batched-w, async-1f1b, layerpipe-async or auto"
PARTITIONING, SCHEDULE, STRATEGY, COSTS, MODEL, BACKWARD, DEBUGGING, OUTPUT = (
    "Partitioning", "Schedule", "Strategy", "Costs", "Model", "Backward", "Debugging", "Output")
OPTIMIZER_HELP = ("The optimizer whose state and step the {what} count: sgd (with --momentum > 0, one momentum "
                  "buffer) or adamw (two buffers), as fxpipe run's --optimizer.")
MOMENTUM_HELP = "SGD momentum, as fxpipe run's: above 0, SGD keeps a momentum buffer per parameter."


def optimizer_state(optimizer: str, momentum: float) -> str:
    """The cost model's name for an optimizer's state (``fxpipe.planning.cost.OPTIMIZER_STATE``): sgd, momentum or
    adamw."""
    return "momentum" if optimizer == "sgd" and momentum > 0 else optimizer


def sizes(**given: str | None) -> dict[str, float | None]:
    """Each size option's bytes (``8GiB``, ``1.5e9``) by name, None where not given; OptionError names the flag."""
    from fxpipe.cli.common import parse_size

    return {name: None if text is None else parse_size(text, "--" + name.replace("_", "-"))
            for name, text in given.items()}


def cores(text: str | None) -> int | None:
    """``--cores N`` or ``auto`` (this machine's ``os.cpu_count()``); None when absent; OptionError otherwise."""
    if text is None:
        return None
    if text.strip().lower() == "auto":
        return os.cpu_count() or 1
    try:
        count = int(text)
    except ValueError:
        raise OptionError(f"--cores takes a number of cores or auto (got {text!r}); e.g. --cores 2") from None
    if count < 1:
        raise OptionError(f"--cores must be at least 1 (got {count}); leave it out to model no time-sharing, or give "
                          "--cores auto for this machine's")
    return count


# -- compile -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    """What compile builds and how it captures the graph."""

    build_device: Literal["cpu", "meta"] = option("cpu", "Where the model is built: cpu, or meta (no weights "
                                                  "allocated; the plan's weights are meta too). Not fxpipe run's "
                                                  "--device, where ranks train.", panel=MODEL)
    dtype: Literal["float32", "float64", "bfloat16"] = option("float32", "Parameter dtype.", panel=MODEL)
    batch_size: int | None = option(None, "Example batch size (zoo models).", min=1, panel=MODEL)
    seed: int = option(0, "Seed for weights and example inputs.", panel=MODEL)
    tracer: Literal["export", "fx"] = option("export", "Graph capture: torch.export, or torch.fx as a fallback.",
                                             panel=MODEL)


@dataclass(frozen=True)
class Partitioning:
    """How many stages, where they cut, and on how many devices."""

    stages: str | None = option(None, "Number of pipeline stages, or auto: every count up to --devices / --dp "
                                "(default 8) partitioned, simulated, and the one --objective picks \\[default: 2].",
                                flags=("--stages", "-s"), panel=PARTITIONING)
    objective: str | None = option(None, "With --stages auto: fastest (the most speedup), efficiency:E (the most "
                                   "speedup with speedup / stages >= E) or speedup:X (the fewest stages reaching X) "
                                   "\\[default: fastest].", panel=PARTITIONING)
    devices: int | None = option(None, "With --stages auto or --plan auto: the devices to use at most (stages x dp) "
                                 "\\[default: 8 stages].", min=1, panel=PARTITIONING)
    plan: Literal["auto"] | None = option(None, "auto: search stages x dp replicas x schedule x microbatches on "
                                          "--devices (under --memory-per-stage), simulate the best, and record the "
                                          "fastest.", flags=("--plan",), panel=PARTITIONING)
    cores: str | None = option(None, "With --plan auto or --stages auto: the cores the plan's ranks will share, N "
                               "or auto (this machine's). Ranks beyond them time-share: F, B and W run ranks / "
                               "cores times slower in the planner's model and simulator, so fewer ranks can win; "
                               "and they share its cache: dp replicas hold dp copies of the model, so more of each "
                               "weight is read from memory (calibrated). Give it when the plan will run as CPU ranks "
                               "on that many cores (auto: fxpipe run here); the plan records it. \\[default: none: a "
                               "core, or device, per rank, as for a plan compiled here for other machines]",
                               flags=("--cores",), panel=PARTITIONING)
    dp: int = option(1, "Replicas of every stage (data parallel): the plan's mesh is stages x dp ranks, each replica "
                     "taking its share of every batch.", min=1, flags=("--dp",), panel=PARTITIONING)
    granularity: str = option("auto", "Layers: auto (repeating blocks), node, or a module depth (1, 2, ...).",
                              panel=PARTITIONING)
    bandwidth: str | None = option(None, "Link bandwidth per second between stages, e.g. 1.5GB \\[default: 1.5GB].",
                                   panel=PARTITIONING)
    latency: float | None = option(None, "Seconds per transfer \\[default: 0.0001].", min=0.0, panel=PARTITIONING)
    memory_per_stage: str | None = option(None, "Memory cap per stage, e.g. 8GiB: its weights, gradients, optimizer "
                                          "state and the activations its schedule keeps in flight. A stage is on "
                                          "a device of its own (interleaved-1f1b puts two on one), so with --plan "
                                          "auto it is the cap per device.", flags=("--memory-per-stage",),
                                          panel=PARTITIONING)
    microbatches: int | None = option(None, "Microbatches per step (for memory in flight) \\[default: 2 x the stage "
                                      "count].", min=1, panel=PARTITIONING)


@dataclass(frozen=True)
class Scheduling:
    """The schedule recorded in the plan."""

    schedule: ScheduleName | None = option(None, "Pick a schedule for the plan and record it (auto: the fastest "
                                           "that fits) \\[default: none recorded; fxpipe run uses 1f1b].",
                                           flags=("--schedule",), panel=SCHEDULE)


@dataclass(frozen=True)
class Sharding:
    """A per-layer parallel configuration for each stage's --dp ranks."""

    strategy: Literal["auto", "dp", "splitbrain"] | None = option(
        None, "A per-layer parallel configuration (degrees over batch, output and input channels) for each stage's "
        "--dp ranks (a power of two), recorded in the plan: auto (the search), dp (every layer splits the batch) or "
        "splitbrain (fully connected layers sharded in groups of --group). With --stages P > 1 (default 1 with "
        "--strategy) each stage's --dp ranks get their own, searched on the stage's graph where the plan cuts, run "
        "under any synchronous --schedule (default gpipe) over --microbatches. Costed for gloo: no all-to-all; "
        "height splits stay in the cost model only (fxpipe strategy --heights). \\[default: none]",
        panel=STRATEGY, show_default=False)
    group: int | None = option(None, "SplitBrain's group of ranks (divides --dp) \\[default: 2].", min=1,
                               panel=STRATEGY)


@dataclass(frozen=True)
class Costs:
    """Where each layer's time comes from: measured, calibrated, or the fixed model."""

    profile: bool = option(False, "Measure each layer's time on real tensors instead of estimating.", panel=COSTS)
    profile_runs: int = option(5, "Runs per layer with --profile (median).", min=1, panel=COSTS)
    profile_threads: int | None = option(None, "Threads to profile with (default: torch's); fxpipe run's ranks use 1 "
                                         "each.", min=1, panel=COSTS)
    device_flops: float | None = option(None, "FLOP/s for estimated times \\[default: 1e11].", panel=COSTS)
    device_mem_bw: str | None = option(None, "Memory bandwidth per second for estimated times \\[default: 10GB].",
                                       panel=COSTS)
    calibration: Literal["on", "full", "off"] | None = option(
        None, "on: estimate with this machine's GEMM, memory and per-node times (a quick measurement, once, cached); "
        "full: the full measurement; off: the fixed --device-flops/--device-mem-bw model \\[default: "
        "$FXPIPE_CALIBRATION, else on].", panel=COSTS)


@dataclass(frozen=True)
class Backward:
    """How each stage's backward is split and balanced."""

    split_backward: bool = option(True, "Split each stage's backward into input-gradient (B) and weight-gradient (W) "
                                  "graphs, and count real B/W FLOPs per layer.", panel=BACKWARD)
    input_grads: bool = option(False, "Also differentiate the model's floating-point inputs.", panel=BACKWARD)
    balance_backward: bool = option(False, "Let the partitioner move activation derivatives (relu, tanh, sigmoid) "
                                    "across the cuts it makes, into the next stage's B, where that lowers the "
                                    "bottleneck (LayerPipe).", panel=BACKWARD)


@dataclass(frozen=True)
class Debugging:
    """The pass driver's checks and stops."""

    verify_each: bool = option(False, "Check the graph's invariants after every pass.", panel=DEBUGGING)
    stop_after: str | None = option(None, "Stop after this pass (writes no plan).", panel=DEBUGGING)
    print_after: list[str] | None = option(None, "Print the graph after this pass (repeatable).", panel=DEBUGGING)


@dataclass(frozen=True)
class CompileOutput:
    """Where the plan goes and how the tables print."""

    out: Path | None = option(None, "Plan directory to write.", flags=("--out", "-o"), panel=OUTPUT)
    overwrite: bool = option(False, "Replace files in --out that fxpipe did not write (or that changed since) where "
                             "the plan writes its own; each is named.", panel=OUTPUT)
    as_json: bool = option(False, "One JSON object on stdout, nothing else.", flags=("--json",), panel=OUTPUT)
    plain: bool = option(False, "Plain-text tables (tabulate) instead of rich.", panel=OUTPUT)


@dataclass(frozen=True)
class CompileConfig(Config):
    """``fxpipe compile``'s every option, in sections (as ``--print-config`` writes them)."""

    target: str = option("", "A zoo model (gpt, gpt-tiny, resnet-50, ...) or file.py:build; may come from --config's "
                         "target key.", argument=True, show_default=False)
    model: Model = section(Model)
    partitioning: Partitioning = section(Partitioning)
    scheduling: Scheduling = section(Scheduling)
    sharding: Sharding = section(Sharding)
    costs: Costs = section(Costs)
    backward: Backward = section(Backward)
    debugging: Debugging = section(Debugging)
    output: CompileOutput = section(CompileOutput)

    def check(self) -> None:
        """What the options say together, before anything is built: the stage count's options, --plan auto's,
        --strategy's, --cores' and every size (one OptionError line each)."""
        p, c = self.partitioning, self.costs
        sizes(bandwidth=p.bandwidth, memory_per_stage=p.memory_per_stage, device_mem_bw=c.device_mem_bw)
        objective = self.stage_count()[1]
        self.core_count()
        s = self.sharding
        if s.strategy is not None:
            if objective is not None:
                raise OptionError("--strategy splits each stage's layers over its --dp ranks; it takes --stages 1, "
                                  "not auto, or another count of stages (--stages 2, 3, ...)")
        elif s.group is not None:
            raise OptionError("--group is SplitBrain's group of ranks; give it with --strategy splitbrain")

    @property
    def searching(self) -> bool:
        """``--plan auto``: whether to search, refusing the options it chooses itself."""
        p = self.partitioning
        if p.plan is None:
            return False
        if p.devices is None:
            raise OptionError("--plan auto needs --devices N: the devices it may use")
        chosen = [name for name, given in (("--stages", p.stages), ("--objective", p.objective),
                                           ("--schedule", self.scheduling.schedule), ("--microbatches", p.microbatches),
                                           ("--strategy", self.sharding.strategy),
                                           ("--dp", p.dp if p.dp != 1 else None)) if given is not None]
        if chosen:
            raise OptionError(f"--plan auto chooses {', '.join(chosen)} itself; drop "
                              f"{'it' if len(chosen) == 1 else 'them'}")
        return True

    def stage_count(self) -> tuple[int | None, str | None]:
        """``--stages N`` or ``auto`` (with ``--objective`` and ``--devices``): the fixed count, or the objective;
        (None, None) under --plan auto or with neither."""
        p = self.partitioning
        if self.searching:
            return None, None
        if p.stages is not None and p.stages.strip().lower() == "auto":
            from fxpipe.planning.stage_count import DEFAULT_OBJECTIVE, parse_objective

            if p.devices is not None and p.devices < p.dp:
                raise OptionError(f"--devices {p.devices} cannot hold one stage of --dp {p.dp} replicas; give "
                                  f"--devices >= {p.dp}")
            return None, str(parse_objective(p.objective) if p.objective is not None else DEFAULT_OBJECTIVE)
        if p.objective is not None or p.devices is not None:
            raise OptionError("--objective and --devices choose the stage count; give them with --stages auto")
        if p.stages is None:
            return None, None
        try:
            count = int(p.stages)
        except ValueError:
            raise OptionError(f"--stages takes a number of stages or auto (got {p.stages!r}); e.g. --stages "
                              "4") from None
        if count < 1:
            raise OptionError(f"--stages must be at least 1 or auto (got {count}); e.g. --stages 2")
        return count, None

    def core_count(self) -> int | None:
        """``--cores N`` or ``auto`` (this machine's ``os.cpu_count()``), given only with a planner; None when
        absent."""
        text = self.partitioning.cores
        if text is None:
            return None
        if not (self.searching or self.stage_count()[1] is not None):
            raise OptionError("--cores models the ranks time-sharing cores for the planners; give it with --plan auto "
                              "or --stages auto")
        return cores(text)


# -- simulate ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimulateConfig(Config):
    """``fxpipe simulate``'s every option (as ``--print-config`` writes them)."""

    target: str | None = option(None, "A plan directory, a zoo model or file.py:build; optional with "
                                "--uniform-costs.", argument=True)
    schedule: ScheduleName | None = option(None, "The schedule (auto: the fastest that fits "
                                           "--activation-memory-per-stage) \\[default: 1f1b].", flags=("--schedule",))
    microbatches: int | None = option(None, "Microbatches per step \\[default: 2 x stages; auto tries 1, 2 and 4 x "
                                      "stages].", min=1)
    stages: int | None = option(None, "Stages (for a model target or --uniform-costs alone).", min=1,
                                flags=("--stages", "-s"))
    uniform_costs: str | None = option(None, "F,B,W: every stage takes these times and transfers are free (for "
                                       "checking closed forms).")
    activation_memory_per_stage: str | None = option(
        None, "With --schedule auto: the activations a stage (its rank) may hold from F to B and B to W, e.g. 2GiB; "
        "activations only, not compile --memory-per-stage's whole stage.", flags=("--activation-memory-per-stage",))
    dp: int | None = option(None, "Replicas of every stage (data parallel); each stage's gradients are all-reduced "
                            "over them \\[default: the plan's mesh, else 1].", min=1, flags=("--dp",))
    allreduce: float | None = option(None, "Seconds (with --uniform-costs: units) of every stage's all-reduce, "
                                     "instead of its gradient bytes over the plan's link.", min=0.0,
                                     flags=("--allreduce",))
    cores: str | None = option(None, "Cores the ranks share, N or auto (this machine's), as compile's --cores: F, B "
                               "and W run ranks / cores times slower when there are more ranks (approximate "
                               "time-sharing).", flags=("--cores",))
    optimizer: Optimizer = option("sgd", OPTIMIZER_HELP.format(what="memory per rank with --dp"),
                                  flags=("--optimizer",))
    momentum: float = option(0.0, MOMENTUM_HELP, min=0.0, max=0.999)
    recompute: Literal["none", "stage", "auto"] = option(
        "none", "Stages that recompute their forward in B (a plan's stages), so each B takes F's time too and F keeps "
        "only the stage's inputs until B: none, stage (every one) or auto (those the plan's --memory-per-stage cap "
        "needs).")
    schedule_csv: Path | None = option(None, "A torch.distributed.pipelining schedule CSV (what _dump_csv writes, "
                                       "compute only or with its communication) to check and simulate instead of "
                                       "--schedule, beside fxpipe's schedules.", flags=("--schedule-csv",))
    w_lane: bool = option(False, "Each rank's W's on a second lane sharing its core, as fxpipe run --w-lane runs "
                          "them (synchronous schedules).", flags=("--w-lane",))
    trace: Path | None = option(None, "Write a Chrome-trace JSON (Perfetto, chrome://tracing).")
    svg: Path | None = option(None, "Write an SVG Gantt chart.")
    as_json: bool = option(False, "One JSON object on stdout, nothing else.", flags=("--json",))
    plain: bool = option(False, "Plain-text tables.")

    def check(self) -> None:
        sizes(activation_memory_per_stage=self.activation_memory_per_stage)
        self.core_count()
        if self.schedule_csv is not None and (self.schedule is not None or self.microbatches is not None):
            raise OptionError("--schedule-csv is the schedule, its microbatches included; drop --schedule and "
                              "--microbatches")

    @property
    def state(self) -> str:
        """The optimizer's state as the cost model names it."""
        return optimizer_state(self.optimizer, self.momentum)

    def core_count(self) -> int | None:
        """``--cores N`` or ``auto`` (this machine's); None when absent."""
        return cores(self.cores)


# -- strategy ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StrategyConfig(Config):
    """``fxpipe strategy``'s every option (as ``--print-config`` writes them)."""

    target: str = option("", "A zoo model that torch.fx traces: vgg-tiny, vgg-16, resnet-50, mlp-small, ...; may come "
                         "from --config's target key.", argument=True, show_default=False)
    ranks: int = option(4, "The group of ranks (a power of two: the DTensor runtime's (2, ..., 2) mesh).",
                        flags=("--ranks", "-r"))
    strategy: Literal["auto", "splitbrain", "dp"] = option(
        "auto", "auto: the search (node/edge elimination, exact); splitbrain: convolutions data-parallel, fully "
        "connected layers sharded in groups of --group; dp: every layer splits the batch.")
    group: int = option(2, "SplitBrain's group of ranks (divides --ranks).", min=1)
    batch_size: int | None = option(None, "Global batch, a multiple of --ranks (default: the zoo's example batch).",
                                    min=1, flags=("--batch-size", "--batch"))
    bandwidth: str = option("1.5GB", "Link bandwidth per second between ranks, e.g. 1.5GB.")
    latency: float = option(1e-4, "Seconds per ring step of a collective.", min=0.0)
    alltoall: bool = option(False, "The backend has all-to-all (NCCL); gloo does not, and moving a split between "
                            "dims then all-gathers.")
    heights: bool = option(False, "Also consider height (spatial) splits of convolutions: cost model only, the "
                           "DTensor runtime does not run them.")
    memory_per_device: str | None = option(None, "Memory cap per device (rank) for the search, e.g. 8GiB: its share "
                                           "of every layer's weights, gradients, optimizer state and activations "
                                           "(not compile --memory-per-stage: here one stage spans --ranks devices).",
                                           flags=("--memory-per-device",))
    optimizer: Optimizer = option("sgd", OPTIMIZER_HELP.format(what="memory column"), flags=("--optimizer",))
    momentum: float = option(0.0, MOMENTUM_HELP, min=0.0, max=0.999)
    as_json: bool = option(False, "One JSON object on stdout, nothing else.", flags=("--json",))
    plain: bool = option(False, "Plain-text tables.")

    def check(self) -> None:
        k = self.ranks.bit_length() - 1
        if self.ranks < 2 or 1 << k != self.ranks:
            raise OptionError(f"--ranks must be a power of two of at least 2 (the runtime's (2, ..., 2) mesh; "
                              f"given: {self.ranks}); use 2, 4, 8, ...")
        if self.ranks % self.group:
            raise OptionError(f"--group {self.group} must divide --ranks {self.ranks}; use a power of two up to "
                              f"{self.ranks}")
        sizes(bandwidth=self.bandwidth, memory_per_device=self.memory_per_device)


# -- inspect, models, export -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InspectConfig(Config):
    """``fxpipe inspect``'s options."""

    plan_dir: Path = option(Path("plan"), "A plan directory written by fxpipe compile; may come from --config's "
                            "plan-dir key.", argument=True, show_default=False)
    as_json: bool = option(False, "plan.json's summary as JSON.", flags=("--json",))
    plain: bool = option(False, "Plain-text tables.")
    torchtitan: bool = option(False, "torchtitan's \\[parallelism] TOML fragment for the plan: its stages by module, "
                              "its schedule as a CSV, its microbatch size; refused where a cut falls inside a module.",
                              flags=("--torchtitan",))


@dataclass(frozen=True)
class ModelsConfig(Config):
    """``fxpipe models``' options."""

    as_json: bool = option(False, "The zoo as JSON.", flags=("--json",))
    plain: bool = option(False, "Plain-text table.")


@dataclass(frozen=True)
class ExportConfig(Config):
    """``fxpipe export``'s options."""

    plan_dir: Path = option(Path("plan"), "A plan directory written by fxpipe compile; may come from --config's "
                            "plan-dir key.", argument=True, show_default=False)
    to: Literal["torch"] = option("torch", "The runtime to export for: torch (torch.distributed.pipelining's "
                                  "_PipelineScheduleRuntime).", flags=("--to",))
    out: Path = option(Path("torch_export"), "Directory to write: schedule.csv (compute only), schedule_comms.csv "
                       "(torch's lowering), torch_export.json, plan/.", flags=("--out",))
    as_json: bool = option(False, "The manifest as JSON on stdout.", flags=("--json",))


__all__ = ["CompileConfig", "ExportConfig", "InspectConfig", "ModelsConfig", "ScheduleName", "SimulateConfig",
           "StrategyConfig", "optimizer_state", "sizes"]
