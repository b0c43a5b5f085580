"""compile / load / save: the compile passes run, and a Plan written.

The CLI (``fxpipe compile``, ``fxpipe simulate MODEL``), the Python API (``fxpipe.compile``) and
the ``torch.compile`` backend all call :func:`run_compile`, which runs the pass list
``fxpipe.passes.assemble`` builds.

    >>> pipe = fxpipe.compile(model, (x,), stages=2)     # a Pipeline; pipe.plan is its Plan
    >>> fxpipe.save(pipe, "plan/"); fxpipe.load("plan/")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fxpipe._overrides import with_overrides
from fxpipe.errors import OptionError, PlanError
from fxpipe.graphs.convention import flatten_inputs
from fxpipe.passes import History, run_steps
from fxpipe.passes.assemble import build_steps, pipeline_from_root, plan_from_root
from fxpipe.pipeline import Pipeline
from fxpipe.plan import (
    DEFAULTS,
    LIMITS,
    BuildRecipe,
    CompileOptions,
    ComputeRates,
    Plan,
    Provenance,
    ScheduleRecord,
    StrategyRecord,
    check_schedule_size,
    fxpipe_version,
)
from fxpipe.report import Report

__all__ = ["ChosenStrategy", "Compiled", "PassControl", "StrategyCosts", "build_steps", "check_strategy",
           "choose_pipelined_strategy", "choose_strategy", "compile", "load", "run_compile", "save", "set_schedule",
           "set_strategy", "strategy_cuts"]


@dataclass
class Compiled:
    """What :func:`run_compile` returns: the Pipeline (None when stopped early) and the pass history."""

    pipeline: Pipeline | None
    history: History
    root: torch.fx.GraphModule | None

    @property
    def reports(self) -> list[Report]:
        if self.pipeline is not None:
            return self.pipeline.report()
        return [r for rec in self.history.records for r in rec.reports] + [self.history.report()]


def compile(model: torch.nn.Module, example_inputs: Sequence[Any], *, stages: int | str | None = None,
            example_kwargs: dict[str, Any] | None = None, verify_each: bool = True, print_after: Sequence[str] = (),
            stop_after: str | None = None, **options: Any) -> Pipeline:
    """Trace ``model``, cost it and partition it into pipeline stages.

    Args:
        model: The model to compile; its parameters are shared with the stages, not copied.
        example_inputs: One microbatch of positional inputs, to trace and cost with.
        stages: A stage count, or ``"auto"`` to choose it (``stage_objective``, ``max_stages``; see
            ``fxpipe.planning.stage_count``); None: ``DEFAULTS.stages``.
        example_kwargs: Keyword inputs of the example, if the model takes any.
        verify_each: Check each pass's invariants after it runs.
        print_after: Pass names whose printed graph ``pipe.history`` keeps.
        stop_after: Only None or the last pass: a Pipeline needs every pass (``run_compile`` stops early).
        **options: Fields of :class:`fxpipe.plan.CompileOptions` (``tracer``, ``bandwidth``, ``memory_per_stage``,
            ``schedule``, ...). With ``schedule``, the schedule is also generated and recorded in the plan.

    Returns:
        The Pipeline; ``pipe.plan`` records what was decided and why.

    Raises:
        OptionError: An unknown or ill-typed option, or ``stop_after`` before the last pass.
        PlanError: A stage count outside what a model or the limits allow, or no plan within the memory cap.
        TraceError: The model cannot be traced.
    """
    if isinstance(stages, str) and stages.strip().lower() == "auto":
        from fxpipe.planning.stage_count import DEFAULT_OBJECTIVE

        options.setdefault("stage_objective", str(DEFAULT_OBJECTIVE))
        stages = None
    if stop_after not in (None, "split-backward", "balance-backward"):
        raise OptionError("compile() builds a Pipeline, so it runs every pass; to stop early use "
                          "fxpipe.api.run_compile(..., stop_after=...) or fxpipe.passes.run_steps")
    unknown = sorted(set(options) - set(CompileOptions.__dataclass_fields__))
    if unknown:
        raise OptionError(f"unknown compile option(s) {unknown}; known: {sorted(CompileOptions.__dataclass_fields__)}")
    if stages is not None:
        LIMITS.whole("stages", stages, LIMITS.stages, "each stage is a graph and a rank of its own; pass a count "
                     "or 'auto'", error=PlanError)
    for flag in ("verify_each", "profile", "split_backward", "input_grads", "balance_backward", "plan_search"):
        value = verify_each if flag == "verify_each" else options.get(flag, False)
        if not isinstance(value, bool):
            raise OptionError(f"{flag} must be True or False (got {type(value).__name__} {str(value)[:40]!r})")
    if stages is not None:
        options["stages"] = stages
    opts = CompileOptions(**options)
    compiled = run_compile(model, example_inputs, opts, example_kwargs=example_kwargs,
                           control=PassControl(verify_each=verify_each, print_after=tuple(print_after)))
    assert compiled.pipeline is not None  # no stop_after: every pass ran
    return compiled.pipeline


@dataclass(frozen=True)
class PassControl:
    """How :func:`run_compile` drives the passes (``fxpipe.passes.run_steps``).

    Attributes:
        verify_each: Check each pass's invariants after it runs.
        stop_after: The kebab-case name of the pass to stop after; None: run them all.
        print_after: Pass names whose printed graph the history keeps.
        on_pass: Called as ``on_pass(name, index, total)`` before each pass (a progress line).
    """

    verify_each: bool = False
    stop_after: str | None = None
    print_after: tuple[str, ...] = ()
    on_pass: Callable[[str, int, int], None] | None = None


def run_compile(model: torch.nn.Module, example_inputs: Sequence[Any], options: CompileOptions, *,
                example_kwargs: dict[str, Any] | None = None, model_name: str | None = None,
                build: BuildRecipe | None = None, control: PassControl = PassControl(),
                profile_threads: int | None = None, **overrides: Any) -> Compiled:
    """Run the pass pipeline; with every pass run, wrap it as a Pipeline whose Plan records the decisions.

    A schedule named in ``options.schedule`` is generated, simulated and recorded.

    Args:
        model: The model to compile.
        example_inputs: One microbatch of positional inputs.
        options: What to compile for (checked first).
        example_kwargs: Keyword inputs of the example.
        model_name: The model's name, recorded in the plan's provenance.
        build: How a built-in model's example was built, recorded so that ``fxpipe run`` rebuilds it.
        control: Verification, stopping and printing between passes (:class:`PassControl`).
        profile_threads: Torch's thread count while the passes run; None: unchanged.
        **overrides: Fields of ``control`` by name (the keyword arguments of before :class:`PassControl`).

    Returns:
        The Pipeline (None when stopped early), the pass history and the last graph.

    Raises:
        TypeError: An override that is no field of :class:`PassControl`.
        OptionError: Options out of range, or an unknown pass name.
    """
    from fxpipe.calibration.compute import compute_overheads, measure_mem_bw

    control = with_overrides(control, overrides, "run_compile")

    check_options(options)
    # the runtime's fixed costs cached for the machine options.compute was measured on (None: none)
    steps = build_steps(model, example_inputs, options, example_kwargs, overheads=compute_overheads(options.compute))
    threads = torch.get_num_threads()
    if profile_threads is not None:
        torch.set_num_threads(profile_threads)
    try:
        root, history = run_steps(steps, verify_each=control.verify_each, stop_after=control.stop_after,
                                  print_after=tuple(control.print_after), on_start=control.on_pass)
        # a profiled plan's memory bandwidth, at the profile's threads: what its optimizer steps are charged at
        mem_bw = measure_mem_bw() if options.profile and len(history.records) == len(steps) else None
    finally:
        profiled_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
    if len(history.records) < len(steps):
        return Compiled(None, history, root)
    flat = flatten_inputs(root.meta.get("fxpipe_in_spec"), tuple(example_inputs), dict(example_kwargs or {}))
    provenance = Provenance(model=model_name, tracer=str(root.meta.get("fxpipe_tracer")),
                            torch_version=torch.__version__, fxpipe_version=fxpipe_version(), build=build,
                            profiled=options.profile, profile_threads=profiled_threads if options.profile else None,
                            profile_mem_bw=mem_bw)
    pipe = pipeline_from_root(root, history, plan_from_root(root, options, provenance, flat))
    options = pipe.plan.options  # --stages auto and --plan auto record their choices there
    if options.schedule is not None:
        set_schedule(pipe, options.schedule, options.microbatches)
        if options.plan_search:
            batch_plan_ws(pipe)
    return Compiled(pipe, history, root)


def batch_plan_ws(pipe: Pipeline) -> bool:
    """``--plan auto`` after split-backward: its chosen stages, replicas and microbatches under ``batched-w`` too,
    where split-backward found some stage's Ws faster batched (``StageCost.w_batched``, profiled or estimated: the
    search itself ranks partitions before any stage is traced, so it cannot know). The faster simulated one is
    recorded, with a table of both. Not under ``--memory-per-device``: batched-w keeps all m microbatches from F
    to B, more than any schedule the search fits to the cap. Returns whether batched-w was chosen."""
    from fxpipe.schedules.generators import generate
    from fxpipe.schedules.simulate import simulate

    plan, record = pipe.plan, pipe.plan.schedule
    fractions = [st.w_batched for st in plan.stages]
    if record is None or record.batch_w or plan.options.memory_per_stage is not None or min(fractions) >= 1.0:
        return False
    costs = _schedule_costs(plan)  # as set_schedule simulated the recorded one
    batched = simulate(generate("batched-w", pipe.num_stages, record.microbatches, costs), costs).makespan
    chosen = batched < record.makespan_s
    rows = ((record.name, record.microbatches, round(record.makespan_s * 1e3, 3), "" if chosen else "chosen"),
            ("batched-w", record.microbatches, round(batched * 1e3, 3), "chosen" if chosen else ""))
    table = Report(title="plan auto: batched W, once the stages are split",
                   columns=("schedule", "microbatches", "simulated step ms", ""), rows=rows,
                   notes=("each stage's W over its batch costs " + ", ".join(f"stage {s}: {k:.2f}" for s, k in
                                                                            enumerate(fractions))
                          + " of its microbatches' Ws one by one (split-backward), which the search's step model "
                          "cannot see before the stages are traced",))
    if chosen:
        set_schedule(pipe, "batched-w", record.microbatches)
        pipe.plan = dataclasses.replace(pipe.plan, options=dataclasses.replace(pipe.plan.options,
                                                                                schedule="batched-w"))
    pipe.extra_reports = [table, *pipe.extra_reports]
    return chosen


def check_link(bandwidth: Any, latency: Any) -> None:
    """A link's bandwidth (bytes/s: positive, finite) and latency (0 to ``LIMITS.latency`` seconds)."""
    LIMITS.positive("--bandwidth", bandwidth, DEFAULTS.bandwidth)
    if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not 0 <= latency <= LIMITS.latency:
        raise OptionError(f"--latency must be 0 to {LIMITS.latency:g} seconds per transfer (latency: {latency})")


def check_options(options: CompileOptions) -> None:
    """Refuse values no pass can use, and sizes past ``LIMITS``, before any pass runs."""
    for name in ("device_flops", "device_mem_bw"):
        LIMITS.positive(f"--{name.replace('_', '-')}", getattr(options, name), getattr(DEFAULTS, name))
    check_link(options.bandwidth, options.latency)
    stages = LIMITS.whole("--stages", options.stages, LIMITS.stages, "each stage is a graph and a rank of its own",
                          error=PlanError)
    dp = LIMITS.whole("--dp", options.dp, LIMITS.ranks, "each replica is a rank (a process) of its own")
    LIMITS.grid(f"--stages {stages}", stages, dp, "lower --stages or --dp")
    for name in ("devices", "max_stages", "cores"):
        value = getattr(options, name)
        if value is not None:
            LIMITS.whole(f"--{name.replace('_', '-')}", value, LIMITS.ranks, "each device is a rank of its own")
    LIMITS.whole("--profile-runs", options.profile_runs, 1_000, "each run of each layer is timed")
    if options.microbatches is not None:
        LIMITS.whole("--microbatches", options.microbatches, LIMITS.microbatches,
                     "a schedule lists every microbatch's actions")
        check_schedule_size(stages, options.microbatches)
    if options.memory_per_stage is not None and not (isinstance(options.memory_per_stage, (int, float))
                                                     and 0 < options.memory_per_stage < float("inf")):
        raise OptionError(f"--memory-per-stage must be a positive finite size (memory_per_stage: "
                          f"{options.memory_per_stage!r}); e.g. 8GiB")
    if options.stage_objective is not None:
        from fxpipe.planning.stage_count import parse_objective

        parse_objective(options.stage_objective)
    if options.plan_search and (options.devices is None or options.devices < 1):
        raise OptionError("--plan auto needs --devices N (at least 1): the devices it may use")
    if options.cores is not None and (isinstance(options.cores, bool) or not isinstance(options.cores, int)
                                      or options.cores < 1):
        raise OptionError(f"--cores must be a whole number of at least 1 (cores: {options.cores!r}); leave it out to "
                          "model no time-sharing")
    if options.balance_backward and not options.split_backward:
        raise OptionError("--balance-backward moves work between the split backward graphs; drop --no-split-backward")


def set_schedule(pipe: Pipeline, name: str, microbatches: int | None = None, memory_cap: float | None = None) -> Any:
    """Generate (or search, for ``auto``) a schedule on the plan's costs, simulate it and record it in ``pipe.plan``.

    Returns the simulation result; its tables join ``pipe.report()`` and the plan directory.
    """
    from fxpipe.schedules.auto import choose
    from fxpipe.schedules.simulate import report

    costs = _schedule_costs(pipe.plan)
    sched, result, extra = choose(name, pipe.num_stages, microbatches, costs, memory_cap)
    record = ScheduleRecord(name=sched.name, requested=name, microbatches=sched.num_microbatches, csv=sched.to_csv(),
                            synchronous=sched.synchronous, batch_w=sched.batch_w, makespan_s=result.makespan,
                            max_stage_span_s=result.max_stage_span)
    pipe.plan = pipe.plan.with_schedule(record, sched.rank_of_stage)
    pipe.extra_reports = [*extra, report(result, sched, w_batched=costs.w_batched)]
    return result


def _schedule_costs(plan: Plan) -> Any:
    """The Costs a plan's schedule is simulated on at compile time: the plan's, with the runtime's fixed costs where
    it is calibrated, and the planners' time-sharing (--cores), so the recorded step is theirs."""
    from fxpipe.calibration.compute import plan_overheads
    from fxpipe.schedules.simulate import Costs

    costs = Costs.from_plan(plan, plan_overheads(plan))
    return costs if plan.options.cores is None else dataclasses.replace(costs, cores=plan.options.cores)


@dataclass(frozen=True)
class ChosenStrategy:
    """What :func:`choose_strategy` returns: the record for the plan and its two tables (per layer, totals)."""

    record: StrategyRecord
    reports: tuple[Report, ...]


def check_strategy(name: str, stages: int, ranks: int, group: int, *, schedule: str | None = None) -> None:
    """Refuse, in one line each, what ``--strategy`` cannot run: a rank group that is not a power of two of at
    least 2 (the DTensor runtime's (2, ..., 2) mesh), a SplitBrain group not dividing it, and a schedule that is
    asynchronous or puts several stages on one rank (``runtime.strategy.check_schedule``)."""
    from fxpipe.plan import STRATEGY_NAMES

    if name not in STRATEGY_NAMES:
        raise OptionError(f"--strategy must be one of {', '.join(STRATEGY_NAMES)} (given: {name!r})")
    if stages < 1:
        raise OptionError(f"--strategy needs at least 1 stage (given: {stages})")
    LIMITS.whole("--dp", ranks, LIMITS.ranks, "each is a rank (a process) of its own", least=0)
    if schedule is not None and schedule.strip().lower() != "auto":
        from fxpipe.runtime.strategy import check_schedule
        from fxpipe.schedules.generators import generate

        check_schedule(generate(schedule.strip().lower(), stages, 2 * stages), stages)
    if ranks < 2 or ranks & (ranks - 1):
        raise OptionError(f"--strategy runs on --dp ranks, a power of two of at least 2 (the DTensor runtime's "
                          f"(2, ..., 2) mesh; given: --dp {ranks}); use --dp 2, 4, 8, ...")
    if group < 1 or ranks % group:
        raise OptionError(f"--group {group} must divide --dp {ranks}; use a power of two up to {ranks}")


@dataclass(frozen=True)
class StrategyCosts:
    """How a per-layer strategy is costed and searched. The defaults are what the runtime runs: gloo, so no
    all-to-all, and no height splits.

    Attributes:
        bandwidth: The link's bytes per second; None: ``DEFAULTS.bandwidth``.
        latency: Seconds per ring step; None: ``DEFAULTS.latency``.
        alltoall: Cost all-to-all collectives (other backends than gloo; the ``fxpipe strategy`` preview).
        heights: Cost height splits of convolutions (cost model only).
        memory_cap: Bytes per rank the search must fit in; None: no cap.
        optimizer: The optimizer whose state bytes each rank holds.
        compute: This machine's GEMM and memory rates (``fxpipe.calibration.compute``); None: the defaults.
    """

    bandwidth: float | None = None
    latency: float | None = None
    alltoall: bool = False
    heights: bool = False
    memory_cap: float | None = None
    optimizer: str = "sgd"
    compute: ComputeRates | None = None

    def resolved(self) -> StrategyCosts:
        """These costs with the link's defaults filled in from DEFAULTS, and the link checked."""
        bandwidth = DEFAULTS.bandwidth if self.bandwidth is None else self.bandwidth
        latency = DEFAULTS.latency if self.latency is None else self.latency
        check_link(bandwidth, latency)
        return dataclasses.replace(self, bandwidth=bandwidth, latency=latency)


def choose_strategy(model: torch.nn.Module, example_inputs: Sequence[Any], name: str, *, ranks: int, group: int = 2,
                    costs: StrategyCosts = StrategyCosts(), **overrides: Any) -> ChosenStrategy:
    """A per-layer strategy for ``model``, on ``fxpipe.passes.strategy_graph``'s one-layer-per-fx-node graph of the
    whole batch. Both ``fxpipe compile --strategy`` and ``fxpipe strategy`` print its two tables.

    Args:
        model: The model.
        example_inputs: The whole batch's inputs.
        name: ``auto`` (the search), ``dp``, or ``splitbrain`` (groups of ``group``).
        ranks: The ranks the strategy runs on.
        group: SplitBrain's group size.
        costs: The link, collectives, memory cap and compute rates (:class:`StrategyCosts`).
        **overrides: Fields of ``costs`` by name (the keyword arguments of before :class:`StrategyCosts`).

    Returns:
        The record for the plan and its two tables (per layer, totals).

    Raises:
        TypeError: An override that is no field of :class:`StrategyCosts`.
        OptionError: A strategy, rank count, group or link the runtime cannot take.
    """
    from fxpipe.passes.strategy_graph import strategy_graph

    check_strategy(name, 1, ranks, group)
    costs = with_overrides(costs, overrides, "choose_strategy").resolved()
    g = strategy_graph(model, example_inputs, compute=costs.compute)
    batch = example_inputs[0].shape[0] if example_inputs and isinstance(example_inputs[0], torch.Tensor) else "?"
    chosen, reports = _choose_on(g.specs, g.edges, name, ranks=ranks, group=group, costs=costs,
                                 where=f"on {ranks} ranks, batch {batch}")
    record = StrategyRecord(name=name, ranks=ranks, group=group, method=chosen.method, cost=float(chosen.cost),
                            nodes=tuple(zip(g.nodes, chosen.configs)))
    return ChosenStrategy(record, reports)


@dataclass(frozen=True)
class _Choice:
    method: str
    cost: float
    configs: tuple[str, ...]  # one configuration name per layer of the graph it was chosen on


def _choose_on(specs: Sequence[Any], edges: Sequence[tuple[int, int]], name: str, *, ranks: int, group: int,
               costs: StrategyCosts, where: str) -> tuple[_Choice, tuple[Report, Report]]:
    """``name``'s strategy on one layer graph (a model's, or a pipeline stage's) and its two tables; ``costs``
    resolved (:meth:`StrategyCosts.resolved`)."""
    from fxpipe.planning.strategies import (
        Degrees,
        build_graph,
        data_parallel,
        solve,
        splitbrain,
        strategy_rows,
        traffic_per_layer,
    )

    assert costs.bandwidth is not None and costs.latency is not None  # resolved by the caller
    bandwidth, latency, alltoall, optimizer = costs.bandwidth, costs.latency, costs.alltoall, costs.optimizer
    heights, memory_cap, compute = costs.heights, costs.memory_cap, costs.compute

    graph = build_graph(specs, edges, ranks, bandwidth=bandwidth, latency=latency, optimizer=optimizer,
                        alltoall=alltoall, spatial=heights)
    presets = {"dp": data_parallel(graph), "splitbrain": splitbrain(graph, specs, group),
               "auto": solve(graph, memory_cap=memory_cap)}
    chosen = presets[name]
    rows = strategy_rows(graph, specs, chosen).rows
    per_layer = Report(f"strategy {name} ({chosen.method}) {where}: "
                       f"{_ms(chosen.cost)} ms per step",
                       ("layer", "config", "compute ms", "sync ms", "transfer in ms", "memory MB"),
                       tuple((r[0], r[1], _ms(r[2]), _ms(r[3]), _ms(r[4]), _mb(r[5])) for r in rows),
                       notes=(f"one row per fx node; link {bandwidth / 1e9:g} GB/s, {1e6 * latency:g} us per ring "
                              f"step; {'all-to-all' if alltoall else 'no all-to-all (gloo)'}; "
                              f"{'height splits (cost model only)' if heights else 'no height splits'}; compute "
                              f"from FLOP estimates at {'this machine' if compute else 'the default'}'s rates; "
                              f"memory per rank: parameters, gradients, {optimizer} state, "
                              "saved activations",))
    totals = []
    for key, s in presets.items():
        degrees = [graph.layers[v].configs[c].degrees or Degrees() for v, c in enumerate(s.choice)]
        total = strategy_rows(graph, specs, s).rows[-1]
        label = {"dp": "dp", "splitbrain": f"splitbrain-{group}", "auto": "auto (search)"}[key]
        totals.append((label + (" (chosen)" if key == name else ""), s.method, _ms(s.cost), _ms(total[2]),
                       _ms(total[3]), _ms(total[4]), _mb(total[5]),
                       _mb(sum(traffic_per_layer(specs, edges, degrees, alltoall=alltoall)))))
    summary = Report(f"totals per step and rank: {name} against dp and SplitBrain {where.split(', batch')[0]}",
                     ("strategy", "method", "step ms", "compute ms", "sync ms", "transfer ms", "memory MB",
                      "received MB"), tuple(totals))
    return _Choice(chosen.method, float(chosen.cost), tuple(chosen.names(graph))), (per_layer, summary)


def choose_pipelined_strategy(model: torch.nn.Module, example_inputs: Sequence[Any], name: str, plan: Plan, *,
                              ranks: int, group: int = 2, microbatches: int, bandwidth: float | None = None,
                              latency: float | None = None,
                              compute: ComputeRates | None = None) -> ChosenStrategy:
    """``name``'s strategy for each pipeline stage of ``plan`` (``plan.stages``, cut where the plan cuts), each
    chosen on its own stage graph (``planning.strategies.stage_graph``: a ``recv`` input, a ``send`` sink) on
    ``ranks`` ranks, over ``microbatches``: the record (``stages``: each stage's nodes, method
    and cost) and the per-layer table and totals of every stage. What the runtime runs (gloo): no all-to-all,
    no height splits. The record's ``cost`` is the slowest stage's modelled step x (M + P - 1) / M (GPipe's fill
    and drain; the sends between stages are in the stages' costs)."""
    from fxpipe.passes.strategy_graph import strategy_graph
    from fxpipe.plan import StrategyStage
    from fxpipe.planning.strategies import stage_graph

    count = len(plan.stages)
    check_strategy(name, count, ranks, group)
    batch = example_inputs[0].shape[0] if example_inputs and isinstance(example_inputs[0], torch.Tensor) else None
    if batch is None or batch % (microbatches * ranks):
        raise OptionError(f"a pipelined strategy cuts the batch into {microbatches} microbatches, each split over up "
                          f"to {ranks} ranks (batch: {batch}); use a --batch-size that {microbatches * ranks} divides")
    costs = StrategyCosts(bandwidth=bandwidth, latency=latency, compute=compute).resolved()
    g = strategy_graph(model, example_inputs, compute=compute)
    cuts = strategy_cuts(plan, g.module, g.edges)
    bounds = [0, *(g.nodes.index(c) + 1 for c in cuts), len(g.nodes)]
    configs: list[str] = [""] * len(g.nodes)
    stages: list[StrategyStage] = []
    reports: list[Report] = []
    for s, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        specs, edges, index = stage_graph(g.specs, g.edges, lo, hi)
        choice, tables = _choose_on(specs, edges, name, ranks=ranks, group=group, costs=costs,
                                    where=f"for stage {s} of {count} ({g.nodes[lo]}..{g.nodes[hi - 1]}) on {ranks} "
                                          f"ranks, batch {batch}")
        for i, config in zip(index, choice.configs):
            if i >= 0:
                configs[i] = config
        stages.append(StrategyStage(first=g.nodes[lo], last=g.nodes[hi - 1], method=choice.method, cost=choice.cost))
        reports += tables
    cost = max(st.cost for st in stages) * (microbatches + count - 1) / microbatches
    methods = sorted({st.method for st in stages})
    record = StrategyRecord(name=name, ranks=ranks, group=group, method="+".join(methods), cost=cost,
                            nodes=tuple(zip(g.nodes, configs)), stages=tuple(stages), microbatches=microbatches)
    return ChosenStrategy(record, tuple(reports))


def strategy_cuts(plan: Plan, module: torch.fx.GraphModule, edges: Sequence[tuple[int, int]]) -> tuple[str, ...]:
    """The fx node (of ``strategy_graph``'s trace ``module``) each of ``plan``'s stages but the last ends with.

    A stage ends with its last layer (``LayerCost``: a module path, e.g. ``features.5``, or the modules its
    parameters belong to); the cut is the last node calling that module or one inside it, moved on over the
    function nodes after it (a residual ``add``, ``flatten``) to the first place only one tensor crosses.
    OptionError (one line, naming the fix) where a stage's last layer is no module of the trace, or no such
    place exists before the next stage's first module."""
    nodes = list(module.graph.nodes)
    owner: dict[str, int] = {}  # module path -> plan layer
    for layer in plan.layers:
        for path in {layer.name, *(p.rsplit(".", 1)[0] for p in layer.params)}:
            owner.setdefault(path, layer.index)

    def layer_of(node: torch.fx.Node) -> int | None:
        if node.op != "call_module":
            return None
        path = str(node.target)
        while path:
            if path in owner:
                return owner[path]
            path = path.rpartition(".")[0]
        return None

    def crossing(i: int) -> set[int]:  # the nodes whose tensors cross a cut after node i
        return {u for u, v in edges if u <= i < v}

    layers = [layer_of(n) for n in nodes]
    cuts: list[str] = []
    for stage in plan.stages[:-1]:
        last = stage.end_layer - 1
        name = plan.layers[last].name
        mapped = [i for i, k in enumerate(layers) if k is not None and k <= last]
        if not any(k == last for k in layers) or not mapped:
            raise OptionError(f"stage {stage.index}'s last layer {name!r} is no module of the strategy trace, so its "
                              "cut cannot be placed there; compile with --granularity auto (module layers) or 1")
        i = max(mapped)
        later = [j for j, k in enumerate(layers) if k is not None and k > last]
        if later and min(later) < i:
            raise OptionError(f"the strategy trace runs a module of a later stage before stage {stage.index}'s last "
                              f"layer {name!r}; compile with --granularity auto or 1 (whole blocks)")
        end = min(later) if later else len(nodes) - 1
        while i < end - 1 and crossing(i) != {i}:
            i += 1
        if crossing(i) != {i} or (cuts and nodes[i].name == cuts[-1]):
            raise OptionError(f"after stage {stage.index}'s last layer {name!r} ({nodes[i].name}) "
                              f"{len(crossing(i))} tensors cross to the next stage (a strategy stage sends one); "
                              "compile with --granularity auto (whole blocks) or other --stages")
        cuts.append(nodes[i].name)
    return tuple(cuts)


def _ms(seconds: float) -> float:
    return round(1e3 * seconds, 4)


def _mb(nbytes: float) -> float:
    return round(nbytes / 1e6, 3)


def set_strategy(pipe: Pipeline, chosen: ChosenStrategy) -> None:
    """Record ``chosen`` in ``pipe.plan``; its tables join ``pipe.report()`` and the plan directory."""
    stages = max(1, len(chosen.record.stages))
    if pipe.num_stages != stages or pipe.plan.mesh.dp != chosen.record.ranks:
        raise OptionError(f"a strategy of {stages} stage(s) on {chosen.record.ranks} ranks each needs a {stages}-stage "
                          f"plan on as many dp ranks (this one: {pipe.num_stages} stages x {pipe.plan.mesh.dp}); "
                          f"compile with --stages {stages} --dp {chosen.record.ranks}")
    pipe.plan = pipe.plan.with_strategy(chosen.record)
    pipe.extra_reports = [*pipe.extra_reports, *chosen.reports]


def save(pipe: Pipeline, path: str | Path, *, overwrite: bool = False,
         replaced: list[str] | None = None) -> Path:
    """Write the plan directory: plan.json plus a .json, .pt and .py file per stage (see fxpipe.plan_dir).

    Only files fxpipe wrote (listed with their checksums in the old plan.json) are replaced, so that a wrong
    path never destroys a user's files.

    Args:
        pipe: The compiled Pipeline.
        path: The directory; made if missing.
        overwrite: Also replace files in the way that fxpipe did not write.
        replaced: If given, the names of such files replaced are added to it.

    Returns:
        The directory written.

    Raises:
        PlanFileError: A file in the way that fxpipe did not write (without ``overwrite``; nothing is changed), a
            directory that cannot be written, or stages that cannot be saved as data.
    """
    from fxpipe.plan_dir import save_pipeline

    return save_pipeline(pipe, Path(path), overwrite=overwrite, replaced=replaced)


def load(path: str | Path, *, trust_ops: Collection[str] | None = None) -> Pipeline:
    """Load a plan directory written by :func:`save` / ``fxpipe compile``: no model source needed.

    Args:
        path: The plan directory.
        trust_ops: Libraries whose ``torch.library`` operators the stages may call (default
            ``fxpipe.graphs.serialize.TRUSTED_LIBRARIES``: transformers).

    Returns:
        The Pipeline, its stages on the CPU.

    Raises:
        PlanFileError: A missing, corrupt or tampered file, or an operator outside the allow-list and ``trust_ops``.
    """
    from fxpipe.plan_dir import load as load_dir

    return load_dir(path) if trust_ops is None else load_dir(path, trust_ops=tuple(trust_ops))
