"""split_backward: each stage's backward as separate input-gradient (B) and weight-gradient (W) graphs.

For each stage GraphModule, AOTAutograd traces the joint forward+backward graph; the forward
is partitioned off (saving, never recomputing, what backward needs), and the backward graph is
split by its typed output descriptors:

    F  (*inputs)                       -> (*outputs, *saved)
    B  (*slots_B)                      -> (*input_grads, *handover)
    W  (*handover, *slots_W)           -> (*param_grads)           # in StageGraphs.param_names order

A slot is ``("saved", i)`` (F's i-th saved tensor) or ``("grad", j)`` (the gradient of the
stage's j-th differentiable output). B is every backward node on a path to an input gradient;
W is the rest of what the parameter gradients need, and ``handover`` is what W reads from B.
``convolution_backward``, which makes both, is split in two by its ``output_mask`` so the weight
half runs in W; normalisation backwards stay whole in B (see ``_SPLIT_BY_MASK``).
"""

from __future__ import annotations

import copy
import hashlib
import statistics
import time
import operator
from collections.abc import Iterable, Sequence
import dataclasses
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpipe._compat import descriptor_kind, joint_graph, partition_joint
from fxpipe.passes._graph import COMPUTE_OPS, clone, copy_graph, get_path, preserved_buffers, value_bytes
from fxpipe.passes.annotate_costs import _CostInterpreter
from fxpipe.passes.driver import PassResult
from fxpipe.report import Report

Slot = tuple[str, int]  # ("saved", i) or ("grad", j)


@dataclass(frozen=True, eq=False)
class StageGraphs:
    """The F, B and W graphs of one stage and their calling convention (see the module docstring).

    When ``fused_reason`` is set the stage could not be split: the three graphs are None and
    executors run the stage's module under autograd with one fused backward (BW).
    """

    forward: torch.fx.GraphModule | None
    backward_input: torch.fx.GraphModule | None
    backward_weight: torch.fx.GraphModule | None
    num_outputs: int = 0
    num_saved: int = 0
    grad_inputs: tuple[int, ...] = ()  # stage input positions whose gradient B returns, in order
    grad_outputs: tuple[int, ...] = ()  # stage output positions that take a gradient; ("grad", j) is the j-th
    b_slots: tuple[Slot, ...] = ()
    w_slots: tuple[Slot, ...] = ()
    num_handover: int = 0
    param_names: tuple[str, ...] = ()
    flops_forward: int = 0
    flops_backward_input: int = 0
    flops_backward_weight: int = 0
    flops_fused_backward: int = 0  # the backward graph before the split
    bytes_f_to_b: int = 0  # what F keeps for B and W
    bytes_b_to_w: int = 0  # what is still held once B ran, until W runs
    split_ops: tuple[str, ...] = ()  # multi-output backward ops split in two by output_mask
    fused_reason: str | None = None

    @property
    def fused(self) -> bool:
        return self.fused_reason is not None

    # -- the calling convention, shared by every executor (reference, runtime, backend) ----------
    # Plain calls: no autograd mode is set here (executors run them under ``torch.no_grad()``),
    # and nothing is kept; where values live and when they are dropped is the executor's policy.
    # The loss on the pipeline's outputs is ``fxpipe.runtime.stage_calls.loss_and_output_grads``.

    def run_forward(self, args: Sequence[Any]) -> tuple[Sequence[Any], list[Any]]:
        """F on the stage's inputs: ``(outputs, saved)``, saved being what B and W read as ``("saved", i)``."""
        result = self.forward(*args)  # type: ignore[misc]
        return result[: self.num_outputs], list(result[self.num_outputs:])

    def run_backward_input(self, saved: Sequence[Any], grad_outs: Sequence[Any]) -> tuple[Sequence[Any], tuple[Any, ...]]:
        """B: ``(input_grads, handover)``; ``input_grads[k]`` is the gradient of stage input ``grad_inputs[k]``.

        ``grad_outs[j]`` is the gradient of stage output ``grad_outputs[j]`` (a ``("grad", j)`` slot).
        """
        result = self.backward_input(*_slot_args(self.b_slots, saved, grad_outs))  # type: ignore[misc]
        n = len(self.grad_inputs)
        return result[:n], tuple(result[n:])

    def weight_args(self, handover: Sequence[Any], saved: Sequence[Any], grad_outs: Sequence[Any]) -> tuple[Any, ...]:
        """W's arguments, ``(*handover, *w_slots)``: for ``backward_weight`` or its accumulating variants."""
        return (*handover, *_slot_args(self.w_slots, saved, grad_outs))

    def run_backward_weight(self, handover: Sequence[Any], saved: Sequence[Any], grad_outs: Sequence[Any]) -> Sequence[Any]:
        """W: the parameter gradients, in ``param_names`` order (a tied parameter may come twice)."""
        return self.backward_weight(*self.weight_args(handover, saved, grad_outs))  # type: ignore[misc]


def _slot_args(slots: Sequence[Slot], saved: Sequence[Any], grad_outs: Sequence[Any]) -> list[Any]:
    """The values of B's or W's slots: F's saved tensors and the stage outputs' gradients."""
    return [saved[i] if kind == "saved" else grad_outs[i] for kind, i in slots]


class _Unsplittable(Exception):
    """A stage whose joint graph has a shape this pass does not split; it falls back to fused."""


def split_backward(root: torch.fx.GraphModule, example_inputs: Sequence[Any], *, input_grads: bool = False,
                   profile_runs: int = 0) -> PassResult:
    """Build F, B and W graphs for every stage of a split-stages root graph.

    Reads: the root's stages and wiring (split_stages), the model's flattened example inputs
    (real, or ``meta`` for models built on the meta device) to give each stage inputs of the
    right shape, and which of them need a gradient.
    Writes: ``root.meta["fxpipe_stage_graphs"]``, one StageGraphs per stage; the graph itself is
    unchanged. ``input_grads`` also differentiates the model's floating-point inputs (so the
    first stage's B computes their gradient); by default they are data and need none. A stage
    that cannot be split keeps a fused backward, and the report says why. ``profile_runs`` > 0
    also times F, B and W of every stage on the example inputs (median of that many runs).

        stage_1: 24 nodes  ──▶  F 31 ops (saves 18 tensors) | B 27 ops | W 22 ops (handover 6)
    """
    from fxpipe.passes.split_stages import run_stages

    wiring = root.meta["fxpipe_wiring"]
    needs_grad: set[str] = {name for name, v in zip(wiring["inputs"], example_inputs)
                            if input_grads and isinstance(v, torch.Tensor) and v.is_floating_point()}
    graphs: list[StageGraphs] = []
    seen: dict[str, int] = {}
    stage_args: list[list[Any]] = []
    for k, stage, w, args, outs in run_stages(root, example_inputs):
        stage_args.append(args)
        example = [_example(a, name in needs_grad) for a, name in zip(args, w["inputs"])]
        key = graph_signature(stage, example)
        if key in seen:  # the same blocks as an earlier stage: reuse its graphs on these parameters
            result = rebind(graphs[seen[key]], getattr(root, f"stage_{seen[key]}"), stage)
        else:
            result = split_stage(stage, example)
            seen[key] = k
        graphs.append(result)
        if result.fused:
            diff = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.is_floating_point()]
        else:
            diff = list(result.grad_outputs)
        needs_grad.update(w["outputs"][i] for i in diff)
    timings: list[tuple[float, float, float] | None] = []
    if profile_runs > 0:
        for k, (g, args) in enumerate(zip(graphs, stage_args)):
            with preserved_buffers(getattr(root, f"stage_{k}")):
                timings.append(None if g.fused else time_graphs(g, args, profile_runs))
    out = clone(root)  # shares the stages; only the meta gains the graphs
    out.meta["fxpipe_stage_graphs"] = graphs
    if timings:  # measured whole-stage F/B/W: what schedules are simulated with (see pipeline._stage_costs)
        out.meta["fxpipe_stage_timings"] = timings
    return PassResult(out, True, (_report(graphs, timings),))


def time_graphs(g: StageGraphs, args: Sequence[Any], runs: int) -> tuple[float, float, float]:
    """Median seconds of F, B and W of one stage on ``args`` (one warm-up run dropped).

    W is timed as executors run it on all but a step's first microbatch: W_acc, adding into
    gradient buffers that persist (``fxpipe.passes.fuse_accumulation``), not returning fresh
    ones, whose first touch of new pages can double a thin weight-gradient GEMM's time.
    """
    from fxpipe.passes.fuse_accumulation import accumulating_weight_graph

    w_acc = accumulating_weight_graph(g.backward_weight, len(g.param_names))[0]  # type: ignore[arg-type]
    accs: list[torch.Tensor] | None = None
    samples: list[tuple[float, float, float]] = []
    with torch.no_grad():
        for _ in range(runs + 1):
            t0 = time.perf_counter()
            outputs, saved = g.run_forward(args)
            t1 = time.perf_counter()
            grads = [torch.ones_like(outputs[i]) for i in g.grad_outputs]
            t2 = time.perf_counter()
            handover = g.run_backward_input(saved, grads)[1]
            t3 = time.perf_counter()
            w_args = g.weight_args(handover, saved, grads)
            if accs is None:  # the warm-up run: W itself, whose gradients become the buffers
                accs = [t.contiguous() for t in g.backward_weight(*w_args)]  # type: ignore[misc]
                t3 = time.perf_counter()
            else:
                w_acc(*w_args, *accs)
            t4 = time.perf_counter()
            samples.append((t1 - t0, t3 - t2, t4 - t3))
    return tuple(statistics.median(s[j] for s in samples[1:]) for j in range(3))  # type: ignore[return-value]


def split_stage(module: torch.fx.GraphModule, args: Sequence[Any]) -> StageGraphs:
    """F, B and W for one stage called on ``args`` (tensors with ``requires_grad`` set as the pipeline needs)."""
    try:
        return _split(module, tuple(args))
    except _Unsplittable as exc:
        return StageGraphs(None, None, None, fused_reason=str(exc))
    except Exception as exc:  # AOTAutograd can refuse a graph; the stage still trains, fused
        return StageGraphs(None, None, None, fused_reason=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")


def graph_signature(layer: torch.fx.GraphModule, example: list[Any]) -> str:
    """A key equal for layers with the same ops, wiring, input and parameter shapes (names aside)."""
    index = {n: i for i, n in enumerate(layer.graph.nodes)}
    parts = []
    for n in layer.graph.nodes:
        args = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{index[a]}")  # type: ignore[arg-type,return-value]
        extra = ""
        if n.op == "get_attr":
            t = get_path(layer, str(n.target))
            extra = f"{tuple(t.shape)}:{t.dtype}:{getattr(t, 'requires_grad', False)}" if isinstance(t, torch.Tensor) else "?"
            parts.append(f"get_attr {extra}")
            continue
        if n.op == "placeholder":
            parts.append("placeholder")
            continue
        target = n.target if n.op != "call_module" else type(get_path(layer, str(n.target))).__name__
        parts.append(f"{n.op} {target} {args}")
    for a in example:
        parts.append(f"in {tuple(a.shape)}:{a.dtype}:{a.requires_grad}" if isinstance(a, torch.Tensor) else f"in {a!r}")
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()


def rebind(graphs: StageGraphs, src: torch.fx.GraphModule, dst: torch.fx.GraphModule) -> StageGraphs:
    """The F, B and W graphs of ``src`` moved onto ``dst``, a stage of the same signature with other parameters.

    Equal signatures list their get_attr nodes in the same order, so the k-th parameter of one is
    the k-th of the other.
    """
    if graphs.fused:
        return graphs
    names = dict(zip((str(n.target) for n in src.graph.nodes if n.op == "get_attr"),
                     (str(n.target) for n in dst.graph.nodes if n.op == "get_attr")))

    def move(gm: torch.fx.GraphModule | None, cls: str) -> torch.fx.GraphModule | None:
        if gm is None:
            return None
        g = copy_graph(gm.graph)
        for node in g.nodes:
            if node.op == "get_attr":
                node.target = names[str(node.target)]
        return torch.fx.GraphModule(dst, g, class_name=cls)

    return dataclasses.replace(
        graphs,
        forward=move(graphs.forward, "StageForward"),
        backward_input=move(graphs.backward_input, "StageBackwardInput"),
        backward_weight=move(graphs.backward_weight, "StageBackwardWeight"),
        param_names=tuple(names[p] for p in graphs.param_names),
    )


def verify_split_backward(root: torch.fx.GraphModule) -> list[str]:
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
                gm.graph.lint()  # type: ignore[union-attr]
            except Exception as exc:
                problems.append(f"stage {k} {name}: {exc}")
        owned = {n for n, p in stages[k].named_parameters(remove_duplicate=False) if p.requires_grad}
        if set(g.param_names) != owned:
            problems.append(f"stage {k} W gives gradients for {sorted(g.param_names)}, the stage trains {sorted(owned)}")
    return problems


def _example(value: Any, requires_grad: bool) -> Any:
    if isinstance(value, torch.Tensor):
        t = value.detach().clone() if not value.is_meta else torch.empty_like(value)
        return t.requires_grad_(requires_grad and t.is_floating_point())
    return value


def _fresh(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _with_fresh_outputs(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``module`` (sharing its parameters and buffers) with every output cloned.

    AOTAutograd gives an output that aliases an input (``transpose``, ``view``, ``flatten`` of
    a stage input: a stage cut between nodes) or another output no tangent and its gradient no
    path: its runtime wrapper regenerates such outputs outside the graph. A stage split from
    that joint graph silently drops the gradient (and every later stage then thinks the value
    needs none). Cloned, every output is its own tensor with its own tangent; ``_build_forward``
    takes the clones out of F again, so F is unchanged. A module that is not a GraphModule (no
    stage is one) is traced as it is.
    """
    if not isinstance(module, torch.fx.GraphModule):
        return module
    g = copy_graph(module.graph)
    out = next(n for n in reversed(g.nodes) if n.op == "output")
    with g.inserting_before(out):
        out.args = (torch.fx.node.map_arg(out.args[0], lambda a: g.call_function(_fresh, (a,))),)
    return torch.fx.GraphModule(module, g, class_name=type(module).__name__)


def _split(module: torch.fx.GraphModule, args: tuple[Any, ...]) -> StageGraphs:
    joint, _ = joint_graph(_with_fresh_outputs(module), args)
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in reversed(joint.graph.nodes) if n.op == "output")
    out_descs = list(out_node.meta["desc"])
    for node in placeholders:
        kind = descriptor_kind(node.meta.get("desc"))
        if kind not in ("ParamAOTInput", "BufferAOTInput", "PlainAOTInput", "TangentAOTInput"):
            raise _Unsplittable(f"joint graph input {node.name} is a {kind}, which the split does not handle")
    # Forward outputs first, then one entry per differentiable input: a gradient, or None (with a
    # None descriptor) for an input that needs none.
    kinds = [descriptor_kind(d) for d in out_descs]
    num_fwd = next((i for i, k in enumerate(kinds) if k in ("GradAOTOutput", "NoneType")), len(kinds))
    for k in kinds[:num_fwd]:
        if k not in ("PlainAOTOutput", "InputMutationAOTOutput"):
            raise _Unsplittable(f"joint graph forward output of kind {k} is not handled")
    if any(k not in ("GradAOTOutput", "NoneType") for k in kinds[num_fwd:]):
        raise _Unsplittable("joint graph outputs are not forward outputs followed by gradients")

    fw, bw = partition_joint(joint, num_fwd)
    forward, saved_names, num_outputs = _build_forward(module, fw)
    # default_partition can leave forward ops whose results no gradient reads in the backward
    # graph (seen: attention's forward kernel, which eliminate_dead_code keeps because it is
    # tagged random). Neither eager autograd nor the split runs them.
    live = _ancestors([next(n for n in reversed(bw.graph.nodes) if n.op == "output")])
    for node in reversed(list(bw.graph.nodes)):
        if node.op in COMPUTE_OPS and node not in live and not node.users:
            bw.graph.erase_node(node)
    bw.recompile()
    fused_bw = copy.deepcopy(bw)
    split_ops = _split_masked_ops(bw)
    return _build_backward(module, fw, bw, fused_bw, forward, saved_names, num_outputs, split_ops)


def _build_forward(module: torch.fx.GraphModule, fw: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[str], int]:
    """F from the partitioned forward: parameters as get_attr, buffer mutations applied in place."""
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inputs = sorted((n for n in fw.graph.nodes if n.op == "placeholder" and descriptor_kind(n.meta.get("desc")) == "PlainAOTInput"),
                    key=lambda n: n.meta["desc"].idx)
    for n in inputs:
        env[n] = g.placeholder(f"input_{n.meta['desc'].idx}")
        env[n].meta = copy.copy(n.meta)
    by_name: dict[str, torch.fx.Node] = {}
    outputs: dict[int, Any] = {}
    saved: list[torch.fx.Node] = []
    # The clones _with_fresh_outputs put on the outputs: F returns what they copy.
    fw_out = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    fresh: dict[torch.fx.Node, Any] = {a: a.args[0] for a, d in zip(fw_out.args[0], fw_out.meta["desc"])
             if descriptor_kind(d) == "PlainAOTOutput" and isinstance(a, torch.fx.Node)
             and a.target is torch.ops.aten.clone.default and not a.kwargs}
    refs = [a for a in fw_out.args[0] if isinstance(a, torch.fx.Node)]
    dropped = {a for a in fresh if len(a.users) == 1 and refs.count(a) == 1}
    for n in fw.graph.nodes:
        if n in dropped:
            continue
        if n.op == "placeholder":
            if n not in env:
                env[n] = _attr(g, n)
        elif n.op == "output":
            for arg, desc in zip(n.args[0], n.meta["desc"]):
                kind = descriptor_kind(desc)
                if kind == "PlainAOTOutput":
                    if isinstance(arg, torch.fx.Node):
                        outputs[desc.idx] = env[cast(torch.fx.Node, fresh.get(arg, arg))]
                    else:
                        outputs[desc.idx] = arg
                elif kind == "InputMutationAOTOutput":
                    target = desc.mutated_input
                    if descriptor_kind(target) != "BufferAOTInput":
                        raise _Unsplittable(f"the stage mutates its input {target}; only buffer updates are handled")
                    g.call_function(torch.ops.aten.copy_.default, (g.get_attr(target.target), env[arg]))
                else:
                    saved.append(arg)
        else:
            env[n] = g.node_copy(n, env.__getitem__)
        by_name[n.name] = n
    num_outputs = len(outputs)
    saved_names = [s.name for s in saved]
    g.output((*(outputs[i] for i in range(num_outputs)), *(env[s] for s in saved)))
    return torch.fx.GraphModule(module, g, class_name="StageForward"), saved_names, num_outputs


def _attr(g: torch.fx.Graph, placeholder: torch.fx.Node) -> torch.fx.Node:
    desc: Any = placeholder.meta.get("desc")
    kind = descriptor_kind(desc)
    if kind not in ("ParamAOTInput", "BufferAOTInput"):
        raise _Unsplittable(f"graph input {placeholder.name} ({kind}) is neither a stage input nor a parameter")
    node = g.get_attr(desc.target)
    node.meta = copy.copy(placeholder.meta)
    return node


def _split_masked_ops(bw: torch.fx.GraphModule) -> list[str]:
    """Split each backward op that makes both an input gradient and weight gradients into two calls.

    ``convolution_backward(..., output_mask=[True, True, True])`` used by B (grad_input) and W
    (grad_weight, grad_bias) becomes one call with mask [True, False, False] in B and one with
    [False, True, True] in W: the same FLOPs, none of the weight work in B.
    """
    out_node = next(n for n in reversed(bw.graph.nodes) if n.op == "output")
    b_roots = [a for a, d in zip(out_node.args[0], out_node.meta["desc"])
               if isinstance(a, torch.fx.Node) and _grad_kind(d) == "PlainAOTInput"]
    in_b = _ancestors(b_roots)
    split: list[str] = []
    for node in list(bw.graph.nodes):
        if node not in in_b or node.target not in _SPLIT_BY_MASK:
            continue
        names = [a.name for a in node.target._schema.arguments]
        if "output_mask" not in names:
            continue
        pos = names.index("output_mask")
        mask = list(node.args[pos] if pos < len(node.args) else node.kwargs["output_mask"])
        users = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        b_idx = {i for i, u in users.items() if u in in_b}
        w_idx = {i for i in users if i not in b_idx}
        if not w_idx or not b_idx:
            continue
        mask_b = [bool(m) and i in b_idx for i, m in enumerate(mask)]
        mask_w = [bool(m) and i in w_idx for i, m in enumerate(mask)]
        with bw.graph.inserting_after(node):
            twin = bw.graph.node_copy(node)
        _set_arg(node, pos, mask_b)
        _set_arg(twin, pos, mask_w)
        for i in w_idx:
            users[i].replace_input_with(node, twin)
        twin.meta = copy.copy(node.meta)
        split.append(str(node.target).replace("aten.", "").replace(".default", ""))
    bw.graph.lint()
    bw.recompile()
    return split


# Ops whose weight half is as costly as their input half. Normalisation backwards
# (native_layer_norm_backward, native_batch_norm_backward, ...) stay whole in B: their weight
# gradients are cheap reductions of terms the input gradient computes anyway, so splitting them
# would recompute those terms (measured: +2.5% backward time on a GPT stage); B hands the small
# weight gradients over to W instead.
_SPLIT_BY_MASK = frozenset({torch.ops.aten.convolution_backward.default})


def _set_arg(node: torch.fx.Node, pos: int, value: Any) -> None:
    if pos < len(node.args):
        args = list(node.args)
        args[pos] = value
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, "output_mask": value}


def _grad_kind(desc: Any) -> str:
    return descriptor_kind(getattr(desc, "grad_of", None)) if descriptor_kind(desc) == "GradAOTOutput" else ""


def _ancestors(roots: Iterable[torch.fx.Node]) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def _build_backward(module: torch.fx.GraphModule, fw: torch.fx.GraphModule, bw: torch.fx.GraphModule,
                    fused_bw: torch.fx.GraphModule, forward: torch.fx.GraphModule, saved_names: list[str],
                    num_outputs: int, split_ops: list[str]) -> StageGraphs:
    out_node = next(n for n in reversed(bw.graph.nodes) if n.op == "output")
    b_roots: dict[int, torch.fx.Node] = {}
    w_roots: list[tuple[str, torch.fx.Node]] = []
    for arg, desc in zip(out_node.args[0], out_node.meta["desc"]):
        if not isinstance(arg, torch.fx.Node):
            continue
        kind = _grad_kind(desc)
        if kind == "PlainAOTInput":
            b_roots[desc.grad_of.idx] = arg
        elif kind == "ParamAOTInput":
            w_roots.append((desc.grad_of.target, arg))
        else:
            raise _Unsplittable(f"backward output {desc} is not a gradient of an input or a parameter")

    # Slots: what the backward graph reads that is not a parameter.
    grad_outputs: list[int] = []
    slot_of: dict[torch.fx.Node, Slot] = {}
    saved_index = {name: i for i, name in enumerate(saved_names)}
    for n in bw.graph.nodes:
        if n.op != "placeholder":
            continue
        kind = descriptor_kind(n.meta.get("desc"))
        if kind == "TangentAOTInput":
            out_desc = n.meta["desc"].output
            if descriptor_kind(out_desc) != "PlainAOTOutput":
                raise _Unsplittable(f"tangent for {out_desc} is not for a stage output")
            slot_of[n] = ("grad", len(grad_outputs))
            grad_outputs.append(out_desc.idx)
        elif kind in ("ParamAOTInput", "BufferAOTInput"):
            continue
        elif n.name in saved_index:
            slot_of[n] = ("saved", saved_index[n.name])
        else:
            raise _Unsplittable(f"backward input {n.name} is not saved by the forward")

    in_b = {n for n in _ancestors(b_roots.values()) if n.op in COMPUTE_OPS}
    in_w = {n for n in _ancestors(r for _, r in w_roots) if n.op in COMPUTE_OPS} - in_b
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    handover = sorted(
        {a for n in in_w for a in n.all_input_nodes if a in in_b} | {r for _, r in w_roots if r in in_b},
        key=order.__getitem__,
    )

    def build(members: set[torch.fx.Node], lead: list[torch.fx.Node], outputs: list[torch.fx.Node],
              name: str) -> tuple[torch.fx.GraphModule, list[Slot]]:
        g = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for i, n in enumerate(lead):
            env[n] = g.placeholder(f"handover_{i}")
            env[n].meta = copy.copy(n.meta)
        slots: list[Slot] = []
        reads = {a for n in members for a in n.all_input_nodes} | set(outputs)
        for n in bw.graph.nodes:
            if n.op == "placeholder" and n in reads and n not in env:
                if n in slot_of:
                    slot = slot_of[n]
                    env[n] = g.placeholder(f"{slot[0]}_{slot[1]}")
                    env[n].meta = copy.copy(n.meta)
                    slots.append(slot)
                else:
                    env[n] = _attr(g, n)
        for n in bw.graph.nodes:
            if n in members:
                env[n] = g.node_copy(n, env.__getitem__)
        g.output(tuple(env[o] for o in outputs))
        _drop_identities(g)
        return torch.fx.GraphModule(module, g, class_name=name), slots

    grad_inputs = sorted(b_roots)
    backward_input, b_slots = build(in_b, [], [b_roots[i] for i in grad_inputs] + handover, "StageBackwardInput")
    backward_weight, w_slots = build(in_w, handover, [r for _, r in w_roots], "StageBackwardWeight")

    saved_vals = [n.meta.get("val") for n in bw.graph.nodes if n.op == "placeholder" and slot_of.get(n, ("", 0))[0] == "saved"]
    slot_bytes = {slot_of[n]: value_bytes(n.meta.get("val")) for n in slot_of}
    return StageGraphs(
        forward=forward,
        backward_input=backward_input,
        backward_weight=backward_weight,
        num_outputs=num_outputs,
        num_saved=len(saved_names),
        grad_inputs=tuple(grad_inputs),
        grad_outputs=tuple(grad_outputs),
        b_slots=tuple(b_slots),
        w_slots=tuple(w_slots),
        num_handover=len(handover),
        param_names=tuple(t for t, _ in w_roots),
        flops_forward=count_flops(forward),
        flops_backward_input=count_flops(backward_input),
        flops_backward_weight=count_flops(backward_weight),
        flops_fused_backward=count_flops(fused_bw),
        bytes_f_to_b=sum(value_bytes(v) for v in saved_vals),
        bytes_b_to_w=sum(value_bytes(n.meta.get("val")) for n in handover) + sum(slot_bytes[s] for s in w_slots),
        split_ops=tuple(split_ops),
    )


def _drop_identities(g: torch.fx.Graph) -> None:
    """Remove ops that return their input's values unchanged: ``t(t(x))``, ``detach(x)``, same-shape ``view``.

    The AOTAutograd backward is full of them (every weight gradient is ``t(t(mm(...)))``); each
    costs a Python-level op call in a graph run eagerly, where autograd's engine pays it in C++.
    """
    aten = torch.ops.aten
    for node in list(g.nodes):
        if node.op != "call_function":
            continue
        src = node.args[0] if node.args else None
        same = None
        if node.target is aten.detach.default:
            same = src
        elif node.target is aten.t.default and isinstance(src, torch.fx.Node) and src.target is aten.t.default:
            same = src.args[0]
        elif node.target is aten.view.default and isinstance(src, torch.fx.Node):
            before, after = src.meta.get("val"), node.meta.get("val")
            if isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and before.shape == after.shape:
                same = src
        if isinstance(same, torch.fx.Node):
            node.replace_all_uses_with(same)
            g.erase_node(node)
    for node in reversed(list(g.nodes)):
        if node.op == "call_function" and not node.users and node.target in (aten.t.default, aten.view.default):
            g.erase_node(node)


def count_flops(gm: torch.fx.GraphModule) -> int:
    """FLOPs of one run of ``gm`` on fake tensors shaped like its placeholders' ``meta["val"]``."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
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
