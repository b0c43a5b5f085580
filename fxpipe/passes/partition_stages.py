"""partition_stages: choose the stage cuts with the exact bottleneck DP and mark every node's stage."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.fx

from fxpipe.errors import OptionError, PlanError
from fxpipe.graphs.fx import COMPUTE_OPS, clone, compute_nodes, get_path, value_bytes
from fxpipe.meta import get_meta, update_meta
from fxpipe.passes.driver import PassResult
from fxpipe.passes.group_layers import LayerStats, layer_stats
from fxpipe.plan import DEFAULTS, Link, RuntimeOverheads
from fxpipe.planning.cost import SCHEDULES, in_flight, limited_in_flight
from fxpipe.planning.stage_dp import Moves, StagePlan, min_memory_cap, plan_for_bounds, plan_stages
from fxpipe.report import Report
from fxpipe.schedules.auto import FIXED, greedy_limits

if TYPE_CHECKING:  # imported where they are used: only --stages auto and --plan auto search
    from fxpipe.planning.merge import MergePlan
    from fxpipe.planning.plan_search import PlanCandidate
    from fxpipe.planning.stage_count import Objective, StageCount

# Bytes held per byte of trainable parameter: the parameter, its gradient and Adam's two moments.
TRAINING_BYTES_PER_PARAM_BYTE = 4



@dataclass(frozen=True)
class Cut:
    """Values crossing the boundary after a stage (activations forward, their gradients back)."""

    after_stage: int
    values: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class StageSearch:
    """How ``partition_stages`` searches when it chooses the stage count (``"auto"``) or the whole plan (``"plan"``);
    a fixed stage count reads only ``dp`` and ``cores``.

    Attributes:
        objective: The rule ``"auto"`` picks a count by (``fastest``, ``efficiency[:E]``, ``speedup:X``); None:
            ``fastest``.
        max_stages: The most stages ``"auto"`` tries; None: ``stage_count.DEFAULT_MAX_STAGES``.
        devices: The devices ``"plan"`` lays stages x replicas on; None: ``stage_count.DEFAULT_MAX_STAGES``.
        dp: Replicas of every stage ``"auto"`` plans for (their ranks time-share ``cores`` too).
        cores: The cores the plan's ranks time-share, so each candidate's compute counts ``max(1, ranks / cores)``
            times; None: a core per rank.
        overheads: The runtime's fixed costs the planners simulate with (``Costs.with_runtime``); None: none.
    """

    objective: str | None = None
    max_stages: int | None = None
    devices: int | None = None
    dp: int = 1
    cores: int | None = None
    overheads: RuntimeOverheads | None = None


def partition_stages(
    gm: torch.fx.GraphModule,
    *,
    num_stages: int | str,
    link: Link | None = None,
    memory_per_stage: float | None = None,
    microbatches: int | None = None,
    schedule: str = "1f1b",
    search: StageSearch = StageSearch(),
    balance_backward: bool = False,
    input_grads: bool = False,
) -> PassResult:
    """Cut the layers into ``num_stages`` contiguous stages minimising the bottleneck stage time.

    Reads: NodeMeta.layer_idx (group_layers) and the cost fields (annotate_costs).
    Writes: NodeMeta.stage_idx on every call node.
    A stage's time is its layers' F+B+W time plus sending every value that crosses its cuts
    (activations over its right cut, their gradients over its left cut; skip connections
    included) at ``latency + bytes / bandwidth``.

    ``num_stages="auto"`` chooses the count too (``fxpipe.planning.stage_count``): for every count up to
    ``search.max_stages`` the partition that minimises the pipeline step model, each simulated under ``schedule``
    (1F1B for ``auto``), and the count ``search.objective`` picks; its report has a row per count, and a second
    report merges from one partition per layer on the same budget (``fxpipe.planning.merge``).
    ``num_stages="plan"`` searches stages x dp replicas x schedule x microbatches on ``search.devices``
    (``fxpipe.planning.plan_search``): the model screens every candidate, the best are simulated, and the fastest
    simulated is the plan; ``out.meta["fxpipe_plan_choice"]`` holds its stages, dp, schedule and microbatches.

    Args:
        gm: The graph after ``group_layers`` and the cost passes; not mutated.
        num_stages: A stage count, ``"auto"`` or ``"plan"``.
        link: The link a cut's values cross; None: ``DEFAULTS``' bandwidth and latency.
        memory_per_stage: A cap on each stage's parameters, gradients and optimizer state (4 bytes per parameter
            byte) plus the activations ``schedule`` keeps in flight at its peak on that stage
            (``fxpipe.planning.cost.in_flight``); under ``"plan"``, the cap per device. None: no cap.
        microbatches: The microbatches the memory in flight is planned for; None: ``DEFAULTS.microbatches`` of the
            stage count (for ``auto``, every count it searches).
        schedule: The schedule whose activations in flight are planned for; ``auto`` plans for the most any of
            its candidates holds, so whichever it picks fits.
        search: How ``"auto"`` and ``"plan"`` search (:class:`StageSearch`).
        balance_backward: LayerPipe's inter-layer balance: the DP also chooses, at each cut, whether the derivative
            of an activation crossing it (:func:`movable_derivatives`) runs in the B of the stage after the cut;
            ``StagePlan.moves`` lists them and the ``balance-backward`` pass makes them.
        input_grads: Whether the first stage's inputs take a gradient; without it the first stage's backward is
            all W and no derivative moves out of it.

    Returns:
        A PassResult whose graph has every node's stage, the ``StagePlan`` in ``gm.meta["fxpipe_stage_plan"]``, and
        the partition's report (with ``"auto"``, also the count and merge reports; with ``"plan"``, the candidates').

    Raises:
        PlanError: The stage count is impossible, or no plan meets the cap (naming the smallest cap that works).
        OptionError: An unknown schedule, or counts it cannot take.

        layers [emb, b0, b1, b2, b3, head], 2 stages  ──▶  stage 0: emb..b1 | stage 1: b2..head
    """
    link = Link(DEFAULTS.bandwidth, DEFAULTS.latency) if link is None else link
    bandwidth, latency, cores, dp = link.bandwidth, link.latency, search.cores, search.dp
    if cores is not None and cores < 1:
        raise OptionError(f"--cores must be at least 1 (cores: {cores}); leave it out to model no time-sharing")
    if dp < 1:
        raise OptionError(f"--dp must be at least 1 (dp: {dp})")
    out = clone(gm)
    stats = layer_stats(out)
    num_layers = len(stats)
    if microbatches is not None and microbatches < 1:
        raise PlanError(f"--microbatches must be at least 1 (microbatches: {microbatches})")
    cut_bytes = _cut_bytes(out, num_layers)
    static = [_static_bytes(out, s) for s in stats]
    counted: tuple[Report, ...] = ()
    choice: PlanCandidate | None = None
    bounds: tuple[int, ...] = ()  # the searched partition (--stages auto, --plan auto)
    shift = _cache_shift(out) if cores is not None else None  # the ranks share this machine: its cache too
    if num_stages == "plan":
        choice, counted = _search_plans(stats, cut_bytes, static, link=link, memory_cap=memory_per_stage,
                                        search=search, cache=shift, shared=_shared_params(out, stats))
        count, bounds = choice.stages, choice.bounds
        schedule, microbatches, dp = choice.schedule, choice.microbatches, choice.dp
    if shift is not None and shift(dp) > 0:  # the plan's times as its dp replicas on one cache run them
        _read_more_from_memory(out, shift(dp))
        stats = layer_stats(out)
    if num_stages == "auto":
        count, bounds, counted = _choose_count(stats, cut_bytes, static, shared=_shared_params(out, stats),
                                               link=link, memory_cap=memory_per_stage, microbatches=microbatches,
                                               schedule=schedule, search=search)
    elif num_stages != "plan":
        if not isinstance(num_stages, int) or num_stages < 1:
            raise PlanError(f"--stages must be at least 1 or auto (stages: {num_stages})")
        count = num_stages
    flights, why = _in_flight(schedule, count, microbatches)
    moves = Moves(movable_derivatives(out, stats), first=input_grads) if balance_backward else None
    if counted:
        plan = plan_for_bounds([s.time for s in stats], bounds, cut_bytes=cut_bytes, bandwidth=bandwidth,
                               latency=latency, static_bytes=static,
                               activation_bytes=_held_per_microbatch(stats, schedule), in_flight=flights,
                               moves=moves)
    else:
        plan = plan_stages(
            [s.time for s in stats],
            count,
            cut_bytes=cut_bytes,
            bandwidth=bandwidth,
            latency=latency,
            static_bytes=static,
            activation_bytes=_held_per_microbatch(stats, schedule),
            in_flight=flights,
            memory_cap=memory_per_stage,
            moves=moves,
        )
    stage_of_layer = [k for k in range(count) for _ in range(plan.bounds[k], plan.bounds[k + 1])]
    for node in compute_nodes(out.graph):
        update_meta(node, stage_idx=stage_of_layer[get_meta(node).layer_idx])
    cuts = stage_cuts(out)
    out.meta["fxpipe_stage_plan"] = plan
    out.meta["fxpipe_layer_stats"] = stats  # the Plan records every layer's costs
    # Per stage, per microbatch: what a schedule simulator needs (seconds and bytes).
    f, b, w = _fbw(stats, list(zip(plan.bounds, plan.bounds[1:])))
    out.meta["fxpipe_stage_costs"] = [
        {
            "f": f[k],
            "b": b[k],
            "w": w[k],
            "send_bytes": cuts[k].nbytes if k < len(cuts) else 0,
            "saved_bytes": sum(s.saved_bytes for s in stats[plan.bounds[k]:plan.bounds[k + 1]]),
        }
        for k in range(count)
    ]
    out.meta["fxpipe_link"] = {"bandwidth": bandwidth, "latency": latency}
    if choice is not None:
        out.meta["fxpipe_plan_choice"] = {"stages": choice.stages, "dp": choice.dp, "schedule": choice.schedule,
                                          "microbatches": choice.microbatches}
    return PassResult(out, True, (*counted, _report(out, plan, stats, cuts, flights, why, bandwidth, latency,
                                                          _held_per_microbatch(stats, schedule))))


# Element-wise activations whose derivative reads the activation's output, which the next stage holds as its input:
# the split graphs can run it there (fxpipe.graphs.moves.MOVABLE, on the backward's ops). Exported graphs hold the
# aten ops; graphs of --tracer fx hold torch's functions and modules.
_MOVABLE_ACTIVATIONS = (torch.ops.aten.relu.default, torch.ops.aten.tanh.default, torch.ops.aten.sigmoid.default,
                        torch.relu, torch.tanh, torch.sigmoid, torch.nn.functional.relu, torch.nn.functional.tanh,
                        torch.nn.functional.sigmoid)
_MOVABLE_METHODS = ("relu", "tanh", "sigmoid")
_MOVABLE_MODULES = (torch.nn.ReLU, torch.nn.Tanh, torch.nn.Sigmoid)


def _movable_activation(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), _MOVABLE_MODULES)
    if node.op == "call_method":
        return node.target in _MOVABLE_METHODS
    return node.op == "call_function" and node.target in _MOVABLE_ACTIVATIONS


def movable_derivatives(gm: torch.fx.GraphModule, stats: Sequence[LayerStats]) -> list[list[tuple[str, float]]]:
    """Per boundary between layers ``c - 1`` and ``c`` (index ``c - 1``), the activations whose derivative could run
    in the B of a stage starting at ``c``: made by a relu, tanh or sigmoid in layer ``c - 1`` and read by layer
    ``c`` alone (not the model's output), each with its derivative's seconds (its node's B time, at most its
    layer's)."""
    out: list[list[tuple[str, float]]] = [[] for _ in range(len(stats) - 1)]
    for node in compute_nodes(gm.graph):
        if not node.users or not _movable_activation(gm, node):
            continue
        layer = get_meta(node).layer_idx
        if layer + 1 < len(stats) and all(u.op != "output" and get_meta(u).layer_idx == layer + 1 for u in node.users):
            out[layer].append((node.name, min(get_meta(node).time_bwd_input, stats[layer].time_bwd_input)))
    return out


def _fbw(stats: Sequence[LayerStats], spans: Sequence[tuple[int, int]],
         ) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """Per stage (``spans`` of layers), its layers' F, B and W seconds: ``Costs``' first three fields."""
    f, b, w = (tuple(sum(getattr(s, field) for s in stats[i:j]) for i, j in spans)
               for field in ("time_fwd", "time_bwd_input", "time_bwd_weight"))
    return f, b, w


def _shared_params(gm: torch.fx.GraphModule, stats: Sequence[LayerStats]) -> dict[str, float]:
    """The parameters two or more layers read (a weight tied across layers: GPT's token embedding and LM head), with
    their bytes."""
    seen: dict[str, int] = {}
    for s in stats:
        for name in s.params:
            seen[name] = seen.get(name, 0) + 1
    out = {}
    for name, count in sorted(seen.items()):
        value = get_path(gm, name) if count > 1 else None
        if isinstance(value, torch.nn.Parameter) and value.requires_grad:
            out[name] = float(value_bytes(value))
    return out


def _tied(stats: Sequence[LayerStats], spans: Sequence[tuple[int, int]],
          shared: dict[str, float]) -> tuple[tuple[tuple[int, ...], float], ...]:
    """``Costs.tied`` for the stages ``spans`` cut: each ``shared`` parameter whose layers fall in two or more
    stages, with those stages and its bytes (the runtime sums its gradient over their ranks after their compute)."""
    out = []
    for name, nbytes in shared.items():
        stages = tuple(sorted({k for k, (i, j) in enumerate(spans) for s in stats[i:j] if name in s.params}))
        if len(stages) > 1:
            out.append((stages, nbytes))
    return tuple(out)


def _cache_shift(gm: torch.fx.GraphModule) -> Callable[[int], float] | None:
    """Per dp: how much more of each GEMM's weight ``dp`` replicas of the model on this machine's cache read from
    memory than the graph's calibrated times assume (``ComputeRates.cold`` of ``dp`` copies of its parameters, less
    what annotate_costs charged for one); None for a graph not costed at calibrated rates."""
    compute, charged = gm.meta.get("fxpipe_compute"), gm.meta.get("fxpipe_cache_miss")
    if compute is None or charged is None:
        return None
    model = sum(value_bytes(p) for p in gm.parameters())
    return lambda dp: max(0.0, compute.cold(dp * model) - charged)


def _read_more_from_memory(gm: torch.fx.GraphModule, shift: float) -> None:
    """Every node's times with ``shift`` more of its weights read from memory (along its NodeMeta.cold_* slopes)."""
    for node in gm.graph.nodes:
        meta = get_meta(node)
        if meta.cold_fwd or meta.cold_bwd_input or meta.cold_bwd_weight:
            update_meta(node, time_fwd=meta.time_fwd + shift * meta.cold_fwd,
                        time_bwd_input=meta.time_bwd_input + shift * meta.cold_bwd_input,
                        time_bwd_weight=meta.time_bwd_weight + shift * meta.cold_bwd_weight)
    gm.meta["fxpipe_cache_miss"] = gm.meta["fxpipe_cache_miss"] + shift


def _choose_count(stats: list[LayerStats], cut_bytes: list[float], static: list[float], *,
                  shared: dict[str, float] | None = None, link: Link, memory_cap: float | None,
                  microbatches: int | None, schedule: str,
                  search: StageSearch) -> tuple[int, tuple[int, ...], tuple[Report, ...]]:
    """``--stages auto``: every count's best partition (the step model), simulated; the count the objective picks.
    With ``search.cores``, P stages on ``search.dp`` replicas compute ``max(1, P x dp / cores)`` times slower in
    both."""
    from fxpipe.planning.cost import transfer_time
    from fxpipe.planning.merge import merge_partitions
    from fxpipe.planning.plan_search import time_sharing
    from fxpipe.planning.stage_count import (
        DEFAULT_MAX_STAGES,
        DEFAULT_OBJECTIVE,
        StageCount,
        best_partition,
        choose_count,
        parse_objective,
    )
    from fxpipe.schedules.generators import generate
    from fxpipe.schedules.simulate import Costs, simulate

    bandwidth, latency, max_stages = link.bandwidth, link.latency, search.max_stages
    overheads, dp, cores = search.overheads, search.dp, search.cores
    goal = DEFAULT_OBJECTIVE if search.objective is None else parse_objective(search.objective)
    num_layers = len(stats)
    if max_stages is not None and max_stages < 1:
        raise OptionError(f"the stage budget must be at least 1 (max stages: {max_stages}); give --devices >= --dp")
    top = min(DEFAULT_MAX_STAGES if max_stages is None else max_stages, num_layers)
    times = [s.time for s in stats]
    acts = _held_per_microbatch(stats, schedule)
    cut_s = [transfer_time(b, bandwidth=bandwidth, latency=latency) for b in cut_bytes]
    static_pre, acts_pre = [0.0], [0.0]
    for a, b in zip(static, acts):
        static_pre.append(static_pre[-1] + a)
        acts_pre.append(acts_pre[-1] + b)
    sim_schedule = "1f1b" if schedule == "auto" else schedule
    rows: list[StageCount] = []
    for p in range(1, top + 1):
        m = microbatches if microbatches is not None else DEFAULTS.microbatches(p)
        flights, _ = _in_flight(schedule, p, microbatches)
        cap = memory_cap
        def fits(_p: int, k: int, i: int, j: int, flights: list[int] = flights, cap: float | None = cap) -> bool:
            return cap is None or static_pre[j] - static_pre[i] + flights[k] * (acts_pre[j] - acts_pre[i]) <= cap

        # Time-sharing slows compute, not transfers: the model's partition and step see the slowed layers, as the
        # simulator (Costs.cores) does; stage_times and the speedup's one device stay unshared.
        scale = time_sharing(p * dp, cores)
        found = best_partition([t * scale for t in times] if scale != 1.0 else times, cut_s, p, m,
                               feasible=None if memory_cap is None else fits)
        if found is None:
            continue
        bounds, model = found
        spans = list(zip(bounds, bounds[1:]))
        sends = tuple(float(cut_bytes[j - 1]) if j < num_layers else 0.0 for _, j in spans)
        costs = Costs(*_fbw(stats, spans),
                      sends, tuple(sum(acts[i:j]) for i, j in spans), tuple(sum(acts[i:j]) for i, j in spans),
                      latency, bandwidth,
                      # every replica time-shares too; --stages auto models no all-reduce (a zero one per stage)
                      cores=cores, dp=dp if cores is not None else 1,
                      allreduce_s=(0.0,) * p if cores is not None else (),
                      tied=_tied(stats, spans, shared or {}), allreduce_latency=latency, allreduce_bandwidth=bandwidth)
        costs = costs.with_runtime(overheads)
        simulated = simulate(generate(sim_schedule, p, m, costs), costs).makespan
        rows.append(StageCount(p, tuple(bounds), tuple(sum(times[i:j]) for i, j in spans), sends[:-1], m, model,
                               simulated, sum(times)))
    if not rows:
        need = min_memory_cap(static, acts, _in_flight(schedule, top, microbatches)[0], top)
        raise PlanError(f"no stage count up to {top} fits --memory-per-stage {memory_cap:.0f} bytes; the smallest "
                        f"cap that works at {top} stages is {need:.0f} bytes; raise --memory-per-stage or --devices")
    chosen = choose_count(rows, goal)
    # Merging (Akintoye et al.) from one partition per layer on the same budget, at the chosen count's microbatches.
    scale = time_sharing(chosen.stages * dp, cores)
    merged = merge_partitions([t * scale for t in times], cut_s, chosen.microbatches, max_stages=top,
                              cut_bytes=cut_bytes)
    return chosen.stages, chosen.bounds, (_count_report(rows, chosen, goal, sim_schedule, dp=dp, cores=cores),
                                          _merge_report(merged, chosen, stats, top))


SIMULATED_CANDIDATES = 16
"""How many of the model's best candidates ``--plan auto`` simulates."""


def _search_plans(stats: list[LayerStats], cut_bytes: list[float], static: list[float], *, link: Link,
                  memory_cap: float | None, search: StageSearch,
                  cache: Callable[[int], float] | None = None,
                  shared: dict[str, float] | None = None) -> tuple[PlanCandidate, tuple[Report, ...]]:
    """``--plan auto``: every (stages, dp, schedule, microbatches) on ``search.devices``, screened by the model, the
    best simulated; the fastest simulated is the plan. With ``search.cores`` both the model and the simulator
    time-share them."""
    from fxpipe.planning.plan_search import Layers, plan_candidates, time_sharing
    from fxpipe.planning.stage_count import DEFAULT_MAX_STAGES
    from fxpipe.schedules.generators import generate
    from fxpipe.schedules.simulate import Costs, simulate

    bandwidth, latency, overheads, cores = link.bandwidth, link.latency, search.overheads, search.cores
    budget = DEFAULT_MAX_STAGES if search.devices is None else search.devices
    layers = Layers(tuple(s.time for s in stats), tuple(float(s.saved_bytes) for s in stats), tuple(static),
                    tuple(float(s.param_bytes) for s in stats), tuple(cut_bytes), tuple(s.cold for s in stats))
    candidates = plan_candidates(layers, budget, bandwidth=bandwidth, latency=latency, memory_cap=memory_cap,
                                 cores=cores, cache=cache)
    compute = sum(layers.times)
    simulated = []
    for c in candidates[:SIMULATED_CANDIDATES]:
        spans = list(zip(c.bounds, c.bounds[1:]))
        sends = tuple(float(cut_bytes[j - 1]) if j < len(stats) else 0.0 for _, j in spans)
        held = tuple(sum(layers.activation_bytes[i:j]) for i, j in spans)
        more = cache(c.dp) if cache is not None else 0.0  # of each weight read from memory on its replicas' cache
        costs = Costs(*_fbw([s.moved(more) for s in stats] if more else stats, spans), sends, held, held,
                      latency, bandwidth, dp=c.dp, grad_bytes=tuple(sum(layers.param_bytes[i:j]) for i, j in spans),
                      allreduce_latency=latency, allreduce_bandwidth=bandwidth, cores=cores,
                      tied=_tied(stats, spans, shared or {}))
        costs = costs.with_runtime(overheads)
        simulated.append((c, simulate(generate(c.schedule, c.stages, c.microbatches, costs), costs).makespan))
    top = max(c.throughput(step) for c, step in simulated)
    # Ties (within 1e-9) go to the least memory per device, then the fewest devices.
    best, best_step = min(((c, step) for c, step in simulated if c.throughput(step) >= top * (1 - 1e-9)),
                          key=lambda t: (t[0].memory_bytes, t[0].devices))
    ordered = [(best, best_step), *sorted(((c, s) for c, s in simulated if c is not best),
                                          key=lambda t: (-t[0].throughput(t[1]), t[0].memory_bytes))]
    # With --cores, a column says how much slower each candidate's ranks compute (only then: older tables unchanged).
    def sharing(c: PlanCandidate) -> tuple[float, ...]:
        return (round(time_sharing(c.devices, cores), 3),) if cores is not None else ()

    rows = tuple((rank + 1, c.stages, c.dp, c.devices, c.schedule, c.microbatches, *sharing(c),
                  round(c.model_s * 1e3, 3), round(step * 1e3, 3), round(c.throughput(step) * compute, 3),
                  round(c.memory_bytes / 2**20, 2), "chosen" if c is best else "")
                 for rank, (c, step) in enumerate(ordered))
    capped = f"; memory per device <= {memory_cap:.0f} bytes" if memory_cap else ""
    notes = (f"{len(candidates)} candidates on {budget} devices (stages x dp <= devices; gpipe, 1f1b, zb-h1, zb-h2; "
             f"P, 2P, 4P microbatches{capped}"
             f"): the step model screened them, the best {len(simulated)} simulated",
             f"chosen: {best.stages} stages x {best.dp} replicas, {best.schedule}, {best.microbatches} microbatches: "
             f"{best.throughput(best_step) * compute:.2f}x one device's throughput on {best.devices} devices",
             "speedup = microbatches per step over all replicas x one device's microbatch / simulated step; per-layer "
             "strategies are not searched (fxpipe compile --strategy plans them for one stage)",
             *((_time_sharing_note(cores, "each candidate's stages x dp ranks"),) if cores is not None else ()),
             *_cache_note(cache, sorted({c.dp for c, _ in ordered})))
    report = Report(title="plan auto: candidates, fastest simulated first",
                    columns=("rank", "stages", "dp", "devices", "schedule", "microbatches",
                             *(("compute x",) if cores is not None else ()), "model step ms",
                             "simulated step ms", "speedup", "memory MiB", ""),
                    rows=rows, notes=notes)
    return best, (report,)


def _cache_note(cache: Callable[[int], float] | None, replicas: Sequence[int]) -> tuple[str, ...]:
    shifts = [(dp, cache(dp)) for dp in replicas] if cache is not None else []
    if not any(shift > 0 for _, shift in shifts):
        return ()
    return ("cache shared (--cores): dp replicas hold dp copies of the model on this machine's last-level cache, so "
            "each GEMM reads more of its weight from memory than one copy's estimate: "
            + ", ".join(f"+{shift:.0%} at dp {dp}" for dp, shift in shifts if shift > 0),)


def _time_sharing_note(cores: int, ranks: str) -> str:
    return (f"time-sharing modelled (--cores {cores}): {ranks} on {cores} cores compute max(1, ranks / {cores}) "
            "times slower (compute x), in the model and in the simulator; an approximation that charges every rank "
            "as always computing, and the speedup is against one device with a core of its own")


def _merge_report(merged: MergePlan, chosen: StageCount, stats: Sequence[LayerStats], top: int) -> Report:
    from fxpipe.planning.merge import merge_rows

    same = "the same partition as the chosen row" if merged.bounds == chosen.bounds else (
        f"the chosen row differs ({chosen.stages} stages, cuts {' '.join(map(str, chosen.bounds[1:-1])) or '-'}): it "
        "is judged by its simulated step within the memory cap, merging by the step model alone")
    notes = (f"from {len(stats)} partitions (one per layer) to {merged.stages} on at most {top} devices, at "
             f"{chosen.microbatches} microbatches: step model {merged.start_step_s * 1e3:.3f} -> "
             f"{merged.step_s * 1e3:.3f} ms; cuts {' '.join(map(str, merged.bounds[1:-1])) or '-'}; {same}",
             "a merge removes one cut: comm saved = 2 x its transfer (+ the pace it set), imbalance added = (m-1) x "
             "the pace the merged partition raises; the merges are chosen jointly (equal to brute force), applied "
             "largest gain first")
    return Report(title="partition-stages: merging (Akintoye et al.)",
                  columns=("#", "partitions", "cut", "MiB saved", "comm saved ms", "imbalance added ms",
                           "step ms", "partitions after", "why"),
                  rows=merge_rows(merged, [s.name for s in stats]), notes=notes)


def _count_report(rows: Sequence[StageCount], chosen: StageCount, goal: Objective, schedule: str, *, dp: int = 1,
                  cores: int | None = None) -> Report:
    from fxpipe.planning.plan_search import time_sharing

    def sharing(r: StageCount) -> tuple[float, ...]:
        return (round(time_sharing(r.stages * dp, cores), 3),) if cores is not None else ()

    table = tuple((r.stages, " ".join(str(b) for b in r.bounds[1:-1]) or "-", r.microbatches, *sharing(r),
                   round(max(r.stage_times) * 1e3, 3), round(r.model_s * 1e3, 3), round(r.step_s * 1e3, 3),
                   round(r.speedup, 3), round(r.efficiency, 3), round(sum(r.cut_bytes) / 2**20, 4),
                   "chosen" if r is chosen else "") for r in rows)
    notes = [f"objective {goal}: {chosen.stages} stages (speedup {chosen.speedup:.2f}, efficiency "
             f"{chosen.efficiency:.2f}); speedup = m x one device's microbatch / step; a cut at b runs between "
             f"layers b-1 and b; partitions minimise sum(t) + 2 sum(cut) + (m-1) max(t, cut), steps simulated under "
             f"{schedule}"]
    if cores is not None:
        notes.append(_time_sharing_note(cores, f"each count's P x {dp} ranks" if dp > 1 else "each count's P ranks"))
    return Report(title="partition-stages: stage count (--stages auto)",
                  columns=("stages", "cuts", "microbatches", *(("compute x",) if cores is not None else ()),
                           "max stage ms", "model step ms", "simulated step ms",
                           "speedup", "efficiency", "cut MiB", ""),
                  rows=table, notes=tuple(notes))


# How the report names a schedule; the rest go by their CLI names.
_TITLES = {"1f1b": "1F1B", "gpipe": "GPipe", "zb-h1": "ZB-H1", "zb-h2": "ZB-H2", "layerpipe": "LayerPipe"}


def _held_per_microbatch(stats: Sequence[LayerStats], schedule: str) -> list[float]:
    """Per layer, the bytes one microbatch in flight holds: F's saved activations, and under an
    asynchronous schedule also a copy of the layer's parameters (``fxpipe run``'s default weight
    policy, stash, keeps the version each microbatch's F read until its W; in a steady async-1f1b
    every microbatch in flight read a different one)."""
    if schedule in _ASYNC:
        return [float(s.saved_bytes + s.param_bytes) for s in stats]
    return [float(s.saved_bytes) for s in stats]


_ASYNC = frozenset({"async-1f1b", "layerpipe-async"})


def _in_flight(schedule: str, num_stages: int, microbatches: int | None) -> tuple[list[int], str]:
    """Per stage, the microbatches of activations to plan memory for, and how the report says why.

    A microbatch between B and W counts as one between F and B: per layer only the F->B bytes
    are known here, and the plan's costs use them for both until split-backward measures them.
    """
    if schedule == "auto":
        # What schedules.auto.choose searches: the given count, else p, 2p and 4p microbatches;
        # the fixed schedules, and the greedy zero-bubble scheduler at every limit from p to 2p.
        counts = [microbatches] if microbatches is not None else DEFAULTS.auto_microbatches(num_stages)
        candidates = [in_flight(name, num_stages, m) for m in counts for name in FIXED]
        candidates += [limited_in_flight(num_stages, m, limit) for m in counts
                       for limit in greedy_limits(num_stages)]
        most = [max(c[k].total for c in candidates) for k in range(num_stages)]
        return most, (f"auto: the most any of its candidates ({', '.join(FIXED)}, zb-greedy) holds "
                      f"at {', '.join(map(str, counts))} microbatches")
    if schedule not in SCHEDULES:
        raise OptionError(f"unknown schedule {schedule!r} (known: {', '.join([*SCHEDULES, 'auto'])}); "
                          "pick one of those")
    m = microbatches if microbatches is not None else DEFAULTS.microbatches(num_stages)
    flights = in_flight(schedule, num_stages, m)
    why = _TITLES.get(schedule, schedule)
    if any(f.bw for f in flights):
        why += ": F->B and B->W together"
    if schedule in _ASYNC:
        why += ": each with its F's weight version (stash)"
    return [f.total for f in flights], why


def verify_stages(gm: torch.fx.GraphModule) -> list[str]:
    """Every call node has a stage, and no value flows from a later stage to an earlier one."""
    problems = []
    for node in compute_nodes(gm.graph):
        stage = get_meta(node).stage_idx
        if stage < 0:
            problems.append(f"node {node.name} has no stage")
            continue
        for arg in node.all_input_nodes:
            if arg.op in COMPUTE_OPS and get_meta(arg).stage_idx > stage:
                problems.append(f"node {node.name} (stage {stage}) reads {arg.name} from later stage "
                                f"{get_meta(arg).stage_idx}")
    return problems


def stage_cuts(gm: torch.fx.GraphModule) -> list[Cut]:
    """For each boundary between stage k and k+1, the values that cross it and their bytes."""
    num_stages = 1 + max((get_meta(n).stage_idx for n in compute_nodes(gm.graph)), default=0)
    crossing: list[list[str]] = [[] for _ in range(num_stages - 1)]
    nbytes = [0] * max(num_stages - 1, 0)
    for node, first, last in _live_ranges(gm, key=lambda n: get_meta(n).stage_idx, end=num_stages - 1):
        for b in range(max(first + 1, 1), last + 1):
            crossing[b - 1].append(node.name)
            nbytes[b - 1] += _node_bytes(node)
    return [Cut(k, tuple(crossing[k]), nbytes[k]) for k in range(num_stages - 1)]


def _live_ranges(gm: torch.fx.GraphModule, *, key: Callable[[torch.fx.Node], int],
                 end: int) -> Iterator[tuple[torch.fx.Node, int, int]]:
    """(value, index where it is made, last index that reads it) for every placeholder and call.

    Placeholders are made at index -1 (inputs arrive at the first stage); the graph output is
    read at index ``end`` (the last stage returns it).
    """
    for node in gm.graph.nodes:
        if node.op not in COMPUTE_OPS and node.op != "placeholder":
            continue
        first = -1 if node.op == "placeholder" else key(node)
        last = first
        for user in node.users:
            last = max(last, end if user.op == "output" else key(user))
        yield node, first, last


def _cut_bytes(gm: torch.fx.GraphModule, num_layers: int) -> list[float]:
    """Bytes crossing each of the L-1 layer boundaries, by a difference array: O(nodes + layers)."""
    diff = [0] * (num_layers + 1)
    for node, first, last in _live_ranges(gm, key=lambda n: get_meta(n).layer_idx, end=num_layers - 1):
        lo = max(first + 1, 1)
        if last >= lo:
            size = _node_bytes(node)
            diff[lo] += size
            diff[last + 1] -= size
    out: list[float] = []
    running = 0
    for b in range(1, num_layers):
        running += diff[b]
        out.append(float(running))
    return out


def _node_bytes(node: torch.fx.Node) -> int:
    if node.op == "placeholder":
        val = node.meta.get("val")
        return value_bytes(val) if val is not None else 8
    meta = get_meta(node)
    return meta.out_bytes if meta.shape else 8


def _static_bytes(gm: torch.fx.GraphModule, stats: LayerStats) -> float:
    return float(sum(_param_state_bytes(get_path(gm, p)) for p in stats.params))


def _param_state_bytes(val: object) -> int:
    if isinstance(val, torch.nn.Parameter) and val.requires_grad:
        return TRAINING_BYTES_PER_PARAM_BYTE * value_bytes(val)
    return value_bytes(val)


def _report(gm: torch.fx.GraphModule, plan: StagePlan, stats: list[LayerStats], cuts: list[Cut],
            flights: list[int], why: str, bandwidth: float, latency: float, held: Sequence[float]) -> Report:
    rows = []
    num_stages = len(plan.bounds) - 1
    for k in range(num_stages):
        lo, hi = plan.bounds[k], plan.bounds[k + 1]
        members = stats[lo:hi]
        params = sorted({p for s in members for p in s.params})
        numel = sum(get_path(gm, p).numel() for p in params if isinstance(get_path(gm, p), torch.nn.Parameter))
        memory = sum(_param_state_bytes(get_path(gm, p)) for p in params) + flights[k] * sum(held[lo:hi])
        names = members[0].name if hi - lo == 1 else f"{members[0].name} .. {members[-1].name}"
        rows.append((
            k,
            f"{lo}-{hi - 1}",
            names,
            round(sum(s.flops for s in members) / 1e6, 3),
            round(sum(s.time for s in members) * 1e3, 3),
            round(plan.stage_times[k] * 1e3, 3),
            numel,
            round(cuts[k].nbytes / 2**20, 4) if k < len(cuts) else 0.0,
            len(cuts[k].values) if k < len(cuts) else 0,
            round(memory / 2**20, 2),
        ))
    compute = max(sum(s.time for s in stats[plan.bounds[k]:plan.bounds[k + 1]]) for k in range(num_stages))
    balance = compute / plan.lower_bound if plan.lower_bound > 0 else 1.0
    notes = (
        f"bottleneck {plan.bottleneck * 1e3:.3f} ms / lower bound max(sum/p, max layer) "
        f"{plan.lower_bound * 1e3:.3f} ms = {plan.ratio:.3f} (compute alone: {balance:.3f})",
        f"transfers at {bandwidth:.3g} B/s + {latency * 1e3:.3g} ms latency; memory = 4 x parameter bytes "
        f"+ activations of {flights} microbatches in flight ({why})",
    )
    return Report(
        title="partition-stages: chosen partition",
        columns=("stage", "layers", "names", "MFLOP (F+B+W)", "compute ms", "stage ms", "params", "out cut MiB",
                 "out values", "memory MiB"),
        rows=tuple(rows),
        notes=notes,
    )


