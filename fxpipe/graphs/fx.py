"""Small helpers on fx graphs that the passes and the stage graphs share: cloning, node kinds, attribute paths,
moving a module to a device, byte counts."""

from __future__ import annotations

import contextlib
import copy
import operator
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
import torch.fx

COMPUTE_OPS = frozenset({"call_function", "call_method", "call_module"})


def clone(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph that shares its parameters and submodules.

    Node meta is copied shallowly (torch's ``node_copy``), which is why NodeMeta is frozen.
    """
    new = torch.fx.GraphModule(gm, copy_graph(gm.graph), class_name=type(gm).__name__)
    new.meta = dict(getattr(gm, "meta", {}))
    return new


@contextlib.contextmanager
def preserved_buffers(module: torch.nn.Module) -> Iterator[None]:
    """Run example data through ``module`` without keeping its in-place buffer updates (BatchNorm statistics)."""
    saved = {name: buf.detach().clone() for name, buf in module.named_buffers() if not buf.is_meta}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, buf in module.named_buffers():
                if name in saved:
                    buf.copy_(saved[name])


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph``: new nodes, shallow-copied meta, the same codegen."""
    new = torch.fx.Graph(owning_module=None, tracer_cls=graph._tracer_cls)
    result = new.graph_copy(graph, {}, return_output_node=True)
    if result is not None:
        out_value, out_node = cast(tuple[Any, torch.fx.Node], result)
        new_out = new.output(out_value, out_node.type)
        new_out.meta = copy.copy(out_node.meta)
    new._codegen = copy.deepcopy(graph._codegen)
    return new


def compute_nodes(graph: torch.fx.Graph) -> Iterator[torch.fx.Node]:
    """Nodes that do work (calls), in graph order; placeholders, get_attr and output excluded."""
    return (n for n in graph.nodes if n.op in COMPUTE_OPS)


def output_node(graph: torch.fx.Graph) -> torch.fx.Node:
    for node in reversed(graph.nodes):
        if node.op == "output":
            return node
    raise ValueError("graph has no output node")


def returned(out: torch.fx.Node) -> list[Any]:
    """The values an output node returns, in order: a split stage graph returns a tuple (torch types an output's
    argument as any argument)."""
    return list(cast("Sequence[Any]", out.args[0]))


def get_path(root: torch.nn.Module, target: str) -> Any:
    """The attribute at a dotted path (``blocks.0.ln1.weight``)."""
    obj: Any = root
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def set_path(root: torch.nn.Module, target: str, value: Any) -> None:
    """Put ``value`` at a dotted path, creating empty parent modules on the way.

    Parameters stay parameters, tensors become buffers, modules become submodules: the
    result owns what it holds, so ``state_dict()`` and ``parameters()`` see it.
    """
    *parents, leaf = target.split(".")
    mod = root
    for atom in parents:
        child = getattr(mod, atom, None)
        if not isinstance(child, torch.nn.Module):
            child = torch.nn.Module()
            mod.add_module(atom, child)
        mod = child
    if isinstance(value, torch.nn.Parameter):
        mod.register_parameter(leaf, value)
    elif isinstance(value, torch.nn.Module):
        mod.add_module(leaf, value)
    elif isinstance(value, torch.Tensor):
        mod.register_buffer(leaf, value)
    else:
        setattr(mod, leaf, value)


def device_copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A detached copy of ``t`` on ``device``; a Parameter stays a Parameter (with its ``requires_grad``)."""
    copied = t.detach().to(device, copy=True)
    return torch.nn.Parameter(copied, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else copied


def inline_grad_regions(gm: torch.fx.GraphModule) -> int:
    """In place: each ``wrap_with_set_grad_enabled(enabled, body, *args)`` of ``gm`` (what torch.export makes of a
    ``torch.no_grad()`` block inside a model, e.g. a transformers release's rotary embedding) replaced by the body's
    own nodes; returns how many were inlined.

    A region with grad disabled computes the same values with grad enabled; only whether autograd records it
    differs, so each tensor it returns is ``aten.detach``ed: no gradient flows through it, as in eager. Every later
    pass, the plan file and the meta-device checks then see plain operators.
    """
    from fxpipe._compat import higher_order_op

    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or higher_order_op(node.target) != "wrap_with_set_grad_enabled":
            continue
        enabled, body_node, *operands = node.args
        body = get_path(gm, str(body_node.target))
        inline_grad_regions(body)  # nested regions first
        env: dict[torch.fx.Node, Any] = {}
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        env.update(zip(placeholders, operands))
        result: Any = None
        with gm.graph.inserting_before(node):
            for inner in body.graph.nodes:
                if inner.op == "placeholder":
                    continue
                if inner.op == "output":
                    result = torch.fx.node.map_arg(inner.args[0], lambda n: env[n])
                    break
                env[inner] = gm.graph.node_copy(inner, lambda n: env[n])
            if not enabled:
                result = torch.fx.node.map_aggregate(result, lambda v: _detached(gm.graph, v))
        outputs = result if isinstance(result, (tuple, list)) else None
        for user in list(node.users):
            if outputs is not None and user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(outputs[cast(int, user.args[1])])
                gm.graph.erase_node(user)
        if node.users:
            node.replace_all_uses_with(result)
        gm.graph.erase_node(node)
        if not body_node.users:
            gm.graph.erase_node(body_node)
            owner, _, leaf = str(body_node.target).rpartition(".")
            delattr(get_path(gm, owner) if owner else gm, leaf)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _detached(graph: torch.fx.Graph, value: Any) -> Any:
    if not isinstance(value, torch.fx.Node):
        return value
    node = graph.call_function(torch.ops.aten.detach.default, (value,))
    val = value.meta.get("val")
    if isinstance(val, torch.Tensor):
        node.meta["val"] = val.detach()
    return node


def rename_device(graph: torch.fx.Graph, home: torch.device, device: torch.device) -> None:
    """Every ``torch.device`` literal equal to ``home`` in the nodes' arguments becomes ``device``: the
    ``device=`` of factory ops (arange, ones, full, zeros) that tracing recorded where the model was."""
    for node in graph.nodes:
        node.args, node.kwargs = torch.fx.node.map_aggregate(
            (node.args, node.kwargs), lambda a: device if isinstance(a, torch.device) and a == home else a)


def move_module(module: torch.fx.GraphModule, home: torch.device, device: torch.device,
                made: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """In place: ``module``'s parameters, buffers and the plain tensor attributes its get_attr nodes read
    (constants ``Module.to`` leaves behind) replaced by copies on ``device``, its ``home`` device literals
    renamed ``device`` (:func:`rename_device`), and its code regenerated.

    ``made`` maps ``id(original)`` to ``(original, copy)`` across calls: a tensor several modules hold (a
    parameter tied between stages) becomes one copy that they all hold. A tensor already on ``device``
    stays as it is.
    """
    def moved(t: torch.Tensor) -> torch.Tensor:
        if t.device == device:
            return t
        if id(t) not in made:
            made[id(t)] = (t, device_copy(t, device))  # the original kept alive: its id is not reused meanwhile
        return made[id(t)][1]

    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for name, t in store.items():
                if t is not None:
                    store[name] = moved(t)  # type: ignore[assignment]
    for node in module.graph.nodes:
        if node.op == "get_attr":
            path, _, leaf = str(node.target).rpartition(".")
            owner = get_path(module, path) if path else module
            t = getattr(owner, leaf)
            if isinstance(t, torch.Tensor) and leaf not in owner._parameters and leaf not in owner._buffers:
                object.__setattr__(owner, leaf, moved(t))  # stays a plain attribute, as it was
    # The graphs a higher-order operator calls (an autocast region, a cond branch) are submodules with their own
    # device literals.
    for sub in module.modules():
        if isinstance(sub, torch.fx.GraphModule):
            rename_device(sub.graph, home, device)
            sub.recompile()


def value_bytes(val: Any) -> int:
    """Bytes a value occupies when sent: tensors by size, containers summed, scalars 8."""
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(value_bytes(v) for v in val)
    if isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat)):
        return 8
    return 0


def storage_bytes(vals: Sequence[Any], exclude: Sequence[Any] = ()) -> int:
    """Bytes of the distinct storages the tensors in ``vals`` keep alive, less those of ``exclude``'s tensors.

    What holding ``vals`` costs: views of one tensor share its storage (counted once, whole),
    and a view of a parameter (``exclude``) costs nothing more. Works on fake tensors (``meta["val"]``),
    whose views share their base's fake storage, as on real ones.
    """
    skip = {_storage_key(t) for v in exclude for t in tensors_in(v)}
    sizes: dict[Any, int] = {}
    for t in (t for v in vals for t in tensors_in(v)):
        key = _storage_key(t)
        if key not in skip:
            sizes[key] = t.untyped_storage().nbytes()
    return sum(sizes.values())


def _storage_key(t: torch.Tensor) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def tensors_in(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [t for v in val for t in tensors_in(v)]
    return []
