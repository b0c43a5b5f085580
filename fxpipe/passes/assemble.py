"""The compile pipeline's assembly: the ordered pass list, and the Plan and Pipeline read from its last graph.

``fxpipe.api.run_compile`` runs it for every compile; the machine calibration builds its probe pipeline with it too,
so neither reaches up into the API.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from fxpipe.graphs.convention import flatten_inputs
from fxpipe.graphs.recompute import input_bytes
from fxpipe.passes.annotate_costs import annotate_costs, verify_costs
from fxpipe.passes.driver import History, Step
from fxpipe.passes.group_layers import group_layers, verify_layers
from fxpipe.passes.partition_stages import StageSearch, partition_stages, verify_stages
from fxpipe.passes.split_stages import split_stages, verify_split
from fxpipe.passes.trace import trace
from fxpipe.pipeline import Pipeline, Stage
from fxpipe.plan import CompileOptions, LayerCost, Link, Mesh, Plan, Provenance, RuntimeOverheads, StageCost, TensorSpec

__all__ = ["build_steps", "pipeline_from_root", "plan_from_root"]


def build_steps(model: torch.nn.Module, example_inputs: Sequence[Any], options: CompileOptions,
                example_kwargs: dict[str, Any] | None = None, *,
                overheads: RuntimeOverheads | None = None) -> list[Step]:
    """The compile pipeline as an explicit ordered list of named steps. ``overheads``: the runtime's fixed costs
    the stage planners simulate with (None: none)."""

    def need(gm: torch.fx.GraphModule | None) -> torch.fx.GraphModule:
        assert gm is not None  # every step after trace receives the previous step's graph
        return gm

    def flat(gm: torch.fx.GraphModule | None) -> list[Any]:
        return flatten_inputs(need(gm).meta.get("fxpipe_in_spec"), tuple(example_inputs), dict(example_kwargs or {}))

    steps = [
        Step("trace", lambda gm: trace(model, example_inputs, tracer=options.tracer, example_kwargs=example_kwargs)),
        Step("annotate-costs", lambda gm: annotate_costs(need(gm), flat(gm), device_flops=options.device_flops,
                                                          device_mem_bw=options.device_mem_bw,
                                                          compute=options.compute), verify_costs),
        Step("group-layers", lambda gm: group_layers(need(gm), granularity=options.granularity), verify_layers),
    ]
    if options.split_backward:
        from fxpipe.passes.count_backward import count_backward

        steps.append(Step("count-backward", lambda gm: count_backward(need(gm), flat(gm),
                                                                      device_flops=options.device_flops), verify_costs))
    if options.profile:
        from fxpipe.passes.profile_layers import profile_layers

        steps.append(Step("profile-layers", lambda gm: profile_layers(need(gm), flat(gm), runs=options.profile_runs),
                          verify_layers))
    steps += [
        Step("partition-stages", lambda gm: partition_stages(
            need(gm), num_stages="plan" if options.plan_search else "auto" if options.stage_objective is not None
            else options.stages, link=Link(options.bandwidth, options.latency),
            memory_per_stage=options.memory_per_stage, microbatches=options.microbatches,
            schedule=options.schedule_name, search=StageSearch(
                objective=options.stage_objective, max_stages=options.max_stages, devices=options.devices,
                dp=options.dp, cores=options.cores, overheads=overheads),
            balance_backward=options.balance_backward, input_grads=options.input_grads), verify_stages),
        Step("split-stages", lambda gm: split_stages(need(gm)), verify_split),
    ]
    if options.split_backward:
        from fxpipe.passes.split_backward import split_backward, verify_split_backward

        steps.append(Step("split-backward", lambda gm: split_backward(
            need(gm), flat(gm), input_grads=options.input_grads,
            profile_runs=options.profile_runs if options.profile else 0, compute=options.compute),
            verify_split_backward))
        if options.balance_backward:
            from fxpipe.passes.balance_backward import balance_backward

            steps.append(Step("balance-backward", lambda gm: balance_backward(need(gm)), verify_split_backward))
    return steps


def plan_from_root(root: torch.fx.GraphModule, options: CompileOptions, provenance: Provenance,
                   flat_inputs: Sequence[Any]) -> Plan:
    """The Plan the passes decided: read once from the split root graph's metadata."""
    stage_plan = root.meta["fxpipe_stage_plan"]
    wiring = root.meta["fxpipe_wiring"]
    layers = tuple(LayerCost(index=s.idx, name=s.name, f=float(s.time_fwd), b=float(s.time_bwd_input),
                             w=float(s.time_bwd_weight), flops=int(s.flops), saved_bytes=int(s.saved_bytes),
                             param_bytes=int(s.param_bytes), params=tuple(s.params))
                   for s in root.meta.get("fxpipe_layer_stats", ()))
    moves = tuple(root.meta.get("fxpipe_backward_moves", ()))
    costs = _stage_costs(root)
    for move in moves:  # --balance-backward: B moved from the stage before the cut to the one after it
        costs[move.cut]["b"] = max(0.0, costs[move.cut]["b"] - move.seconds)
        costs[move.cut + 1]["b"] += move.seconds
    stages = tuple(StageCost(index=k, first_layer=stage_plan.bounds[k], end_layer=stage_plan.bounds[k + 1],
                             time=float(stage_plan.stage_times[k]), **c)
                   for k, c in enumerate(costs))
    link = root.meta["fxpipe_link"]
    inputs = tuple(TensorSpec(name, tuple(int(d) for d in v.shape), str(v.dtype).replace("torch.", ""))
                   if isinstance(v, torch.Tensor) else TensorSpec(name, (), type(v).__name__)
                   for name, v in zip(wiring["inputs"], flat_inputs))
    if options.stage_objective is not None:  # --stages auto: the plan records the count it chose
        options = dataclasses.replace(options, stages=len(stages))
    choice = root.meta.get("fxpipe_plan_choice")
    if choice is not None:  # --plan auto: the plan records what it chose (the schedule is generated and recorded)
        options = dataclasses.replace(options, stages=len(stages), dp=int(choice["dp"]),
                                      schedule=str(choice["schedule"]), microbatches=int(choice["microbatches"]))
    return Plan(provenance=provenance, options=options, inputs=inputs, layers=layers, stages=stages,
                link=Link(float(link["bandwidth"]), float(link["latency"])),
                mesh=Mesh.from_rank_of_stage(tuple(range(len(stages))), options.dp),
                bottleneck_s=float(stage_plan.bottleneck), lower_bound_s=float(stage_plan.lower_bound),
                backward_moves=moves)


def _stage_costs(root: torch.fx.GraphModule) -> list[dict[str, float]]:
    """Per-stage F, B, W seconds and bytes for schedules, with the split graphs' view of B and W.

    A stage whose inputs need no gradient has an empty B (its activation gradients are W's work),
    so its per-layer B time moves to W; the split graphs' F->B and B->W bytes give its memory.
    """
    costs = []
    graphs = root.meta.get("fxpipe_stage_graphs")
    raw = root.meta["fxpipe_stage_costs"]
    timings = root.meta.get("fxpipe_stage_timings") or [None] * len(raw)
    # batched W (profiled): the runtime does not batch a plan whose ops moved across cuts (--balance-backward)
    batched = root.meta.get("fxpipe_stage_w_batched") if not root.meta.get("fxpipe_backward_moves") else None
    for c, g, timed, w_batched in zip(raw, graphs or [None] * len(raw), timings, batched or [1.0] * len(raw)):
        f, b, w = float(c["f"]), float(c["b"]), float(c["w"])
        held_fb = held_bw = float(c["saved_bytes"])
        held_in = None
        if g is not None and not g.fused:
            held_in = float(input_bytes(g))
            if not g.grad_inputs:
                w, b = w + b, 0.0
            held_fb, held_bw = float(g.bytes_f_to_b), float(g.bytes_b_to_w)
        if timed is not None:  # profiled: the stage's own F, B and W graphs, timed whole (split-backward)
            f, b, w = (float(t) for t in timed)
        cost = {"f": f, "b": b, "w": w, "send_bytes": float(c["send_bytes"]), "saved_bytes": float(c["saved_bytes"]),
                "held_fb": held_fb, "held_bw": held_bw, "w_batched": float(w_batched)}
        if held_in is not None:  # else StageCost's default: not known without the split graphs
            cost["held_in"] = held_in
        costs.append(cost)
    return costs


def pipeline_from_root(root: torch.fx.GraphModule, history: History | None, plan: Plan) -> Pipeline:
    """Wrap the split-stages root graph as a Pipeline."""
    wiring = root.meta["fxpipe_wiring"]
    graphs = root.meta.get("fxpipe_stage_graphs") or [None] * len(wiring["stages"])
    stages = [Stage(k, getattr(root, f"stage_{k}"), w["inputs"], w["outputs"], graphs[k])
              for k, w in enumerate(wiring["stages"])]
    return Pipeline(stages, input_names=wiring["inputs"], output_names=wiring["outputs"],
                    output_constants=wiring["constants"], in_spec=root.meta.get("fxpipe_in_spec"),
                    out_spec=root.meta.get("fxpipe_out_spec"), shared_params=root.meta.get("fxpipe_shared_params", {}),
                    plan=plan, history=history)
