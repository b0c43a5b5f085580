"""A stage's F, B and W graphs, split from AOTAutograd's joint forward+backward graph of the stage module.

AOTAutograd traces the joint graph with typed descriptors; the forward is partitioned off
(saving, never recomputing, what backward needs), and the backward graph is split by its output
descriptors into B (every node on a path to a gradient of a stage input) and W (the rest of
what the parameter gradients need). ``convolution_backward``, which makes both, is split in two
by its ``output_mask`` so the weight half runs in W; normalisation backwards stay whole in B
(see ``_SPLIT_BY_MASK``). The calling convention is ``fxpipe.graphs.convention``.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
import torch.fx

from fxpipe._compat import descriptor_kind, joint_graph, partition_joint
from fxpipe.graphs.convention import Slot, StageGraphs
from fxpipe.graphs.fx import COMPUTE_OPS, copy_graph, storage_bytes

# FLOPs of one run of a graph (fxpipe.passes.split_backward.count_flops)
FlopCounter = Callable[[torch.fx.GraphModule], int]


class _Unsplittable(Exception):
    """A stage whose joint graph has a shape the split does not handle; it falls back to fused."""


def split_stage(module: torch.fx.GraphModule, args: Sequence[Any], *,
                count_flops: FlopCounter | None = None) -> StageGraphs:
    """F, B and W for one stage called on ``args`` (tensors with ``requires_grad`` set as the pipeline needs).

    A stage AOTAutograd cannot trace, or whose joint graph has a shape this split does not
    handle, gets a fused StageGraphs whose ``fused_reason`` says why. ``count_flops`` fills the
    FLOP fields (they stay 0 without it).
    """
    try:
        return _split(module, tuple(args), count_flops)
    except _Unsplittable as exc:
        return StageGraphs(None, None, None, fused_reason=str(exc))
    except Exception as exc:  # AOTAutograd can refuse a graph; the stage still trains, fused
        return StageGraphs(None, None, None, fused_reason=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")


def example_input(value: Any, requires_grad: bool) -> Any:
    """A copy of one stage input to split on: detached, ``requires_grad`` as the pipeline needs (floats only)."""
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


def _split(module: torch.fx.GraphModule, args: tuple[Any, ...], count_flops: FlopCounter | None) -> StageGraphs:
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
    flops_fused = count_flops(bw) if count_flops is not None else 0  # the backward before the B/W split
    split_ops = _split_masked_ops(bw)
    return _build_backward(module, bw, flops_fused, forward, saved_names, num_outputs, split_ops, count_flops)


def _build_forward(module: torch.fx.GraphModule,
                   fw: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[str], int]:
    """F from the partitioned forward: parameters as get_attr, buffer mutations applied in place."""
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inputs = sorted((n for n in fw.graph.nodes
                     if n.op == "placeholder" and descriptor_kind(n.meta.get("desc")) == "PlainAOTInput"),
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
# would recompute those terms (slower backward on a GPT stage); B hands the small
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


def _build_backward(module: torch.fx.GraphModule, bw: torch.fx.GraphModule, flops_fused: int,
                    forward: torch.fx.GraphModule, saved_names: list[str], num_outputs: int, split_ops: list[str],
                    count_flops: FlopCounter | None) -> StageGraphs:
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

    # Held bytes are storages, each once and none of a parameter's: F saves views of the weights
    # (``t(weight)`` for B's matmul) and several views of one activation, which hold nothing more.
    weights = [n.meta.get("val") for n in forward.graph.nodes if n.op == "get_attr"]
    weights += [n.meta.get("val") for n in bw.graph.nodes if n.op == "placeholder" and n not in slot_of]
    saved_vals = [n.meta.get("val") for n in bw.graph.nodes
                  if n.op == "placeholder" and slot_of.get(n, ("", 0))[0] == "saved"]
    slot_val = {slot_of[n]: n.meta.get("val") for n in slot_of}
    count = count_flops or (lambda gm: 0)
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
        flops_forward=count(forward),
        flops_backward_input=count(backward_input),
        flops_backward_weight=count(backward_weight),
        flops_fused_backward=flops_fused,
        bytes_f_to_b=storage_bytes(saved_vals, weights),
        bytes_b_to_w=storage_bytes([n.meta.get("val") for n in handover] + [slot_val[s] for s in w_slots], weights),
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

