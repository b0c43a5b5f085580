"""split_backward: each stage's backward as separate input-gradient (B) and weight-gradient (W) graphs.

The graphs and their calling convention are ``fxpipe.graphs`` (``StageGraphs``): this pass
builds them for every stage of a split-stages root, counts their FLOPs, and reports them.

    F  (*inputs)                       -> (*outputs, *saved)
    B  (*slots_B)                      -> (*input_grads, *handover)
    W  (*handover, *slots_W)           -> (*param_grads)           # in StageGraphs.param_names order
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from fxpipe._compat import fake_tensor_mode, flop_counter_mode, op_overload_name, pytree
from fxpipe.graphs.accumulate import VIEW_OPS, accumulating_weight_graph
from fxpipe.graphs.batched import batched_from, measure_ratio, trace_batched
from fxpipe.graphs.convention import StageGraphs
from fxpipe.graphs.fx import clone, value_bytes
from fxpipe.graphs.stages import build_stage_graphs
from fxpipe.passes.annotate_costs import _CostInterpreter
from fxpipe.passes.driver import PassResult
from fxpipe.passes.time_graphs import time_stages
from fxpipe.plan import ComputeRates
from fxpipe.report import Report

aten = torch.ops.aten


def split_backward(root: torch.fx.GraphModule, example_inputs: Sequence[Any], *, input_grads: bool = False,
                   profile_runs: int = 0, compute: ComputeRates | None = None) -> PassResult:
    """Build F, B and W graphs for every stage of a split-stages root graph.

    Reads: the root's stages and wiring (split_stages), the model's flattened example inputs
    (real, or ``meta`` for models built on the meta device) to give each stage inputs of the
    right shape, and which of them need a gradient.
    Writes: ``root.meta["fxpipe_stage_graphs"]``, one StageGraphs per stage, FLOPs counted; the
    graph itself is unchanged. ``input_grads`` also differentiates the model's floating-point
    inputs (so the first stage's B computes their gradient); by default they are data and need
    none. A stage that cannot be split keeps a fused backward, and the report says why.
    ``profile_runs`` > 0 also times F, B and W of every stage on the example inputs (median of
    that many runs) into ``root.meta["fxpipe_stage_timings"]``, and each stage's W over ``BATCH_K``
    microbatches at once against them one by one (``root.meta["fxpipe_stage_w_batched"]``); without
    profiling, ``compute`` (this machine's calibrated rates) estimates that fraction instead.

        stage_1: 24 nodes  ──▶  F 31 ops (saves 18 tensors) | B 27 ops | W 22 ops (handover 6)
    """
    wiring = root.meta["fxpipe_wiring"]
    stages = [getattr(root, f"stage_{k}") for k in range(len(wiring["stages"]))]
    graphs = build_stage_graphs(stages, wiring, example_inputs, input_grads=input_grads, count_flops=count_flops)
    timings = time_stages(root, example_inputs, graphs, profile_runs) if profile_runs > 0 else []
    out = clone(root)  # shares the stages; only the meta gains the graphs
    out.meta["fxpipe_stage_graphs"] = graphs
    if timings:  # measured whole-stage F/B/W: what schedules are simulated with (see fxpipe.api)
        out.meta["fxpipe_stage_timings"] = timings
        out.meta["fxpipe_stage_w_batched"] = batched_ratios(stages, wiring, example_inputs, graphs, profile_runs)
    elif compute is not None:
        cold = root.meta.get("fxpipe_cache_miss")  # as annotate_costs decided it, and partition_stages for dp
        if cold is None:
            cold = compute.cold(sum(value_bytes(p) for p in root.parameters()))
        out.meta["fxpipe_stage_w_batched"] = batched_ratios(stages, wiring, example_inputs, graphs, 0,
                                                            estimate=lambda w: estimate_w_seconds(w, compute, cold))
    return PassResult(out, True, (_report(graphs, timings),))


BATCH_K = 4  # the microbatches a profiled stage's batched W is timed over (batched-w runs batches of m/2)


def batched_ratios(stages: Sequence[torch.fx.GraphModule], wiring: Any, example_inputs: Sequence[Any],
                   graphs: Sequence[StageGraphs], runs: int,
                   estimate: Callable[[torch.fx.GraphModule], float | None] | None = None) -> list[float]:
    """Per stage, its W over ``BATCH_K`` microbatches at once against the ``BATCH_K`` one by one (the fastest of
    ``runs``; :func:`fxpipe.graphs.batched.measure_ratio`), or with ``estimate`` (a W graph's estimated seconds)
    their estimated times: what batched-w's batched Ws cost the simulator. 1.0 for a stage that cannot batch (the
    runtime would run its Ws one by one) or whose W the estimate cannot cost."""
    traced = trace_batched(stages, wiring, example_inputs, BATCH_K)  # every stage at once: one pass
    out = []
    for k, g in enumerate(graphs):
        built = None if g.fused or isinstance(traced, str) else batched_from(g, traced[k], k, BATCH_K)
        if built is None or isinstance(built, str):
            out.append(1.0)
        elif estimate is not None:
            one, many = estimate(g.split_graphs()[2]), estimate(built.plain)
            out.append(1.0 if one is None or many is None or one <= 0 else min(1.0, many / (BATCH_K * one)))
        else:
            w = g.split_graphs()[2]
            w_acc = accumulating_weight_graph(w, len(g.param_names))[0]
            out.append(min(1.0, measure_ratio(w, w_acc, built, max(3, runs))))
    return out


_GEMMS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2), aten.bmm.default: (0, 1)}
_VIEWS = VIEW_OPS | {aten.squeeze.dim, aten.unsqueeze.default}


def estimate_w_seconds(w: torch.fx.GraphModule, compute: ComputeRates, cold: float) -> float | None:
    """A W graph's seconds at this machine's calibrated rates, for the batched-W fraction: per ATen op its host time
    (``ComputeRates.op_seconds`` at the cache miss ``cold``), a GEMM its FLOPs at the skinny-GEMM curve of its
    smallest dimension (the weight gradient's curve where that is the contracted one), anything else its bytes at
    ``mem_bw``. None for a graph with an op it cannot cost so (a convolution's backward)."""
    total = 0.0
    per_op = compute.op_seconds(cold)[1] if compute.graph_op_bwd > 0 else compute.op_bwd
    for node in w.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        total += per_op
        if node.target in _VIEWS:
            continue
        if node.target in _GEMMS:
            a, b = (node.args[i].meta["val"].shape for i in _GEMMS[node.target])
            batch = a[0] if len(a) == 3 else 1
            m, k, n = a[-2], a[-1], b[-1]
            smallest = min(m, k, n)
            flops = 2.0 * batch * m * k * n
            total += flops / compute.gemm_rate(smallest, weight=smallest == k, cold=cold)
            continue
        if "convolution" in str(node.target):
            return None
        values = [node.meta.get("val"), *(a.meta.get("val") for a in node.all_input_nodes)]
        total += sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor)) / compute.mem_bw
    return total


def verify_split_backward(root: torch.fx.GraphModule) -> list[str]:
    """One StageGraphs per stage, each graph lints, and W gives a gradient for exactly what the stage trains."""
    problems = []
    graphs = root.meta.get("fxpipe_stage_graphs")
    stages = [m for n, m in root.named_children() if n.startswith("stage_")]
    if graphs is None or len(graphs) != len(stages):
        return [f"expected {len(stages)} StageGraphs, found {0 if graphs is None else len(graphs)}"]
    for k, g in enumerate(graphs):
        if g.fused:
            continue
        for name, gm in (("F", g.forward), ("B", g.backward_input), ("W", g.backward_weight)):
            try:
                gm.graph.lint()
            except Exception as exc:
                problems.append(f"stage {k} {name}: {exc}")
        owned = {n for n, p in stages[k].named_parameters(remove_duplicate=False) if p.requires_grad}
        if set(g.param_names) != owned:
            problems.append(f"stage {k} W gives gradients for {sorted(g.param_names)}, "
                            f"the stage trains {sorted(owned)}")
    return problems


def count_flops(gm: torch.fx.GraphModule) -> int:
    """FLOPs of one run of ``gm`` on fake tensors shaped like its placeholders' ``meta["val"]``.

    A graph of ATen operators whose every value is recorded (AOTAutograd's, as split) is counted from those records,
    each operator by FlopCounterMode's own formula, without running it again; anything else runs on fake tensors
    under FlopCounterMode."""
    counted = _recorded_flops(gm)
    return counted if counted is not None else _run_flops(gm)


def _run_flops(gm: torch.fx.GraphModule) -> int:
    """FLOPs of ``gm`` run on fake tensors under FlopCounterMode."""
    mode = fake_tensor_mode(allow_non_fake_inputs=True)
    inputs = []
    with mode:
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                v = n.meta.get("val")
                inputs.append(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                              if isinstance(v, torch.Tensor) else v)
    interp = _CostInterpreter(gm, mode)
    interp.run_costs(inputs)
    return sum(interp.flops.values())


def _recorded_flops(gm: torch.fx.GraphModule) -> int | None:
    """FLOPs of ``gm`` from its nodes' ``meta["val"]``: FlopCounterMode's formula of each ATen operator on the
    recorded arguments and result, as FlopCounterMode applies it when the operator runs. None where a node is not
    an ATen operator (or ``getitem``) or a value it reads is not recorded: run it then."""
    registry = _flop_registry()
    missing = object()
    total = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr") or node.target is operator.getitem:
            continue
        if node.op != "call_function" or op_overload_name(node.target) is None:
            return None
        formula = registry.get(node.target.overloadpacket)
        if formula is None:
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs),
                                             lambda a: a.meta.get("val", missing))
        out = node.meta.get("val", missing)
        if out is missing or any(v is missing for v in pytree.tree_leaves((args, kwargs))):
            return None
        total += int(formula(*args, **kwargs, out_val=out))
    return total


@functools.cache
def _flop_registry() -> dict[Any, Any]:
    """FlopCounterMode's formulas by operator packet, with fxpipe's CPU attention (``flop_counter_mode``)."""
    return dict(flop_counter_mode().flop_registry)


def _report(graphs: list[StageGraphs], timings: Sequence[tuple[float, float, float] | None] = ()) -> Report:
    rows = []
    notes = []
    timed = bool(timings)
    for k, g in enumerate(graphs):
        ms: tuple[float, ...] = ()
        if timed:
            t = timings[k]
            ms = (0.0, 0.0, 0.0) if t is None else tuple(round(x * 1e3, 4) for x in t)
        if g.fused:
            rows.append((k, "fused", 0, 0, 0, 0, 0.0, 0.0, *ms))
            notes.append(f"stage {k} keeps a fused backward: {g.fused_reason}")
            continue
        rows.append((k, "split", g.flops_forward, g.flops_backward_input, g.flops_backward_weight, g.num_handover,
                     round(g.bytes_f_to_b / 2**20, 4), round(g.bytes_b_to_w / 2**20, 4), *ms))
        if g.split_ops:
            notes.append(f"stage {k}: split by output_mask into B and W halves: {', '.join(sorted(set(g.split_ops)))}")
    return Report(
        title="split-backward: F, B and W per stage",
        columns=("stage", "backward", "F FLOPs", "B FLOPs", "W FLOPs", "handover", "F->B MiB", "B->W MiB",
                 *(("F ms", "B ms", "W ms") if timed else ())),
        rows=tuple(rows),
        notes=tuple(notes),
    )
