"""count_backward: replace the estimated B and W FLOPs of every layer with counts on its real B and W graphs."""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from fxpipe.graphs.convention import StageGraphs
from fxpipe.graphs.fx import clone, compute_nodes
from fxpipe.graphs.split import example_input
from fxpipe.graphs.stages import cached_split, graph_signature
from fxpipe.meta import get_meta, update_meta
from fxpipe.passes.driver import PassResult
from fxpipe.passes.split_backward import count_flops
from fxpipe.passes.split_stages import run_stages, split_by_layer
from fxpipe.plan import DEFAULTS
from fxpipe.report import Report


def count_backward(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                   device_flops: float | None = None) -> PassResult:
    """Split every layer's backward as split_backward splits a stage's, and count its B and W FLOPs.

    Reads: NodeMeta.layer_idx (group_layers) and the cost estimates (annotate_costs).
    Writes: NodeMeta.flops_bwd_input / flops_bwd_weight, scaled per layer so the layer's sums
    equal the counts on its real B and W graphs, and time_bwd_* scaled by the same ratios (a
    layer whose estimate was 0 gets ``FLOPs / device_flops``). With calibrated rates that time
    the graphs' ops (``ComputeRates.graph_op_fwd`` / ``graph_op_bwd``, from annotate_costs), the
    host part of each layer's F, B and W (NodeMeta.host_*) is its real graph's ATen ops at those
    rates instead of per node, spread evenly over the layer's nodes: a linear layer's F is two
    ops, its B two, its W four, where per node B and W took half each. Per op, the cached time plus
    the model's cache miss (``meta["fxpipe_cache_miss"]``) of the way to the uncached one
    (``ComputeRates.op_seconds``); the rest of that way goes on the nodes' cold_* slopes. Layers with the same
    structure and shapes (the repeating blocks) are traced once.
    A layer AOTAutograd cannot split keeps its estimates; the report says so.

        blocks.3: B 1.64 MFLOP (est 1.64), W 1.57 MFLOP (est 1.64)
    """
    device_flops = DEFAULTS.device_flops if device_flops is None else device_flops
    compute = gm.meta.get("fxpipe_compute")
    per_op = compute if compute is not None and compute.graph_op_fwd > 0 and compute.graph_op_bwd > 0 else None
    if per_op is not None:  # per op: between its cached and uncached times by the model's cache miss, at the
        # machine's typical speed as every estimated time
        op_f, op_bw, slope_f, slope_bw = (per_op.sustained * t
                                          for t in per_op.op_seconds(gm.meta.get("fxpipe_cache_miss", 0.0)))
    out = clone(gm)
    members: dict[int, list[torch.fx.Node]] = defaultdict(list)
    for node in compute_nodes(out.graph):
        members[get_meta(node).layer_idx].append(node)

    needs_grad: set[str] = set()
    seen: set[str] = set()
    rows = []
    notes = []
    for k, layer, w, args, outs in run_stages(split_by_layer(gm), example_inputs):
        example = [example_input(a, n in needs_grad) for a, n in zip(args, w["inputs"])]
        key = graph_signature(layer, example)
        seen.add(key)
        graphs = _COUNTED.get(key)
        if graphs is None:
            if len(_COUNTED) >= _COUNTED_MAX:
                _COUNTED.clear()
            graphs = _COUNTED[key] = _Counted.of(cached_split(layer, example, count_flops=count_flops))
        nodes = members[k]
        metas = [get_meta(n) for n in nodes]
        est_b = sum(m.flops_bwd_input for m in metas)
        est_w = sum(m.flops_bwd_weight for m in metas)
        if graphs.fused:
            notes.append(f"layer {k} ({metas[0].layer}) keeps estimated B/W: {graphs.fused_reason}")
            diff = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.is_floating_point()]
            rows.append((k, metas[0].layer, est_b, est_b, est_w, est_w, "estimate"))
        else:
            if per_op is not None:  # the host part goes now, and comes back below from the graphs' ops
                _strip_host(nodes)
            _rescale(nodes, "flops_bwd_input", "time_bwd_input", graphs.flops_backward_input, device_flops)
            _rescale(nodes, "flops_bwd_weight", "time_bwd_weight", graphs.flops_backward_weight, device_flops)
            if per_op is not None:
                ops_f, ops_b, ops_w = graphs.ops
                _add_host(nodes, ops_f * op_f, ops_b * op_bw, ops_w * op_bw,
                          slopes=(ops_f * slope_f, ops_b * slope_bw, ops_w * slope_bw))
            diff = list(graphs.grad_outputs)
            rows.append((k, metas[0].layer, est_b, graphs.flops_backward_input, est_w, graphs.flops_backward_weight,
                         "counted"))
        needs_grad.update(w["outputs"][i] for i in diff)
    report = Report(
        title="count-backward: B and W FLOPs per layer, counted on the split graphs",
        columns=("layer", "name", "B est", "B counted", "W est", "W counted", "source"),
        rows=tuple(rows),
        notes=(f"{len(seen)} distinct layer graphs for {len(rows)} layers", *notes),
    )
    return PassResult(out, True, (report,))


@dataclass(frozen=True)
class _Counted:
    """What count_backward reads of a layer's split: its B and W FLOPs and which outputs take a gradient."""

    flops_backward_input: int
    flops_backward_weight: int
    grad_outputs: tuple[int, ...]
    fused_reason: str | None
    ops: tuple[int, int, int] = (0, 0, 0)  # ATen ops of F, B and W (graph_ops)

    @property
    def fused(self) -> bool:
        return self.fused_reason is not None

    @classmethod
    def of(cls, graphs: StageGraphs) -> _Counted:
        return cls(graphs.flops_backward_input, graphs.flops_backward_weight, tuple(graphs.grad_outputs),
                   graphs.fused_reason, (0, 0, 0) if graphs.fused else graph_ops(graphs))


def graph_ops(graphs: StageGraphs) -> tuple[int, int, int]:
    """The ATen ops (every call but ``getitem``) of split graphs' F, B and W: what each costs the host to run."""
    f, b, w = (sum(1 for n in compute_nodes(gm.graph) if n.target is not operator.getitem)
               for gm in graphs.split_graphs())
    return f, b, w


# Counts by layer signature (ops, wiring, shapes, dtypes, which inputs need a gradient: everything the counts
# depend on), shared by every compile in the process: a model compiled again, at another stage count or
# granularity, traces none of its layers again. Numbers only; cleared when it grows past _COUNTED_MAX.
_COUNTED: dict[str, _Counted] = {}
_COUNTED_MAX = 4096


def _rescale(nodes: list[torch.fx.Node], flops_field: str, time_field: str, total: int, device_flops: float) -> None:
    est = sum(getattr(get_meta(n), flops_field) for n in nodes)
    if est > 0:
        ratio = total / est
        for n in nodes:
            meta = get_meta(n)
            update_meta(n, **{flops_field: round(getattr(meta, flops_field) * ratio),
                              time_field: getattr(meta, time_field) * ratio})
        return
    for n in nodes:
        meta = get_meta(n)
        update_meta(n, **{flops_field: total // len(nodes),
                          time_field: getattr(meta, time_field) + total / len(nodes) / device_flops})


_HOST = (("time_fwd", "host_fwd"), ("time_bwd_input", "host_bwd_input"), ("time_bwd_weight", "host_bwd_weight"))


def _strip_host(nodes: list[torch.fx.Node]) -> None:
    """Take annotate_costs' per-node host time out of each node's times (what is left: arithmetic and bytes)."""
    for n in nodes:
        meta = get_meta(n)
        update_meta(n, **{t: max(0.0, getattr(meta, t) - getattr(meta, h)) for t, h in _HOST}, host_fwd=0.0,
                    host_bwd_input=0.0, host_bwd_weight=0.0)


def _add_host(nodes: list[torch.fx.Node], *seconds: float, slopes: tuple[float, float, float]) -> None:
    """Add a layer's host seconds of F, B and W, an equal share on each of its nodes, and to their cold_* slopes
    what those seconds gain with all of the model read from memory rather than the share the graph assumes."""
    share = [s / len(nodes) for s in seconds]
    more = [s / len(nodes) for s in slopes]
    for n in nodes:
        meta = get_meta(n)
        update_meta(n, **{t: getattr(meta, t) + x for (t, _), x in zip(_HOST, share)},
                    **{h: getattr(meta, h) + x for (_, h), x in zip(_HOST, share)},
                    **{c: getattr(meta, c) + x for c, x in zip(_COLD, more)})


_COLD = ("cold_fwd", "cold_bwd_input", "cold_bwd_weight")
