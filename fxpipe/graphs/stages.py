"""Every stage's F, B and W graphs at once: each stage split on its own example inputs, one split per distinct stage
graph.

Stages with the same graph signature (ops, wiring, input and parameter shapes; names aside)
reuse one split, rebound to their own parameters: the 1.5 B plan's six identical middle stages
are traced once. The splits are kept for the process (:func:`cached_split`, a bounded cache of
graphs without parameters), so compiling a model again, loading its plan, or counting a layer
that is also a whole stage does not trace it through AOTAutograd again.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Container, Mapping, Sequence
from typing import Any

import torch
import torch.fx

from fxpipe._compat import tracing_state
from fxpipe.errors import PlanFileError
from fxpipe.graphs.convention import StageGraphs, StageInterface
from fxpipe.graphs.fx import copy_graph, get_path, preserved_buffers
from fxpipe.graphs.split import FlopCounter, example_input, split_stage


def build_stage_graphs(stage_modules: Sequence[torch.fx.GraphModule], wiring: Mapping[str, Any],
                       flat_example_inputs: Sequence[Any], *, input_grads: bool = False,
                       count_flops: FlopCounter | None = None, only: Container[int] | None = None,
                       interfaces: Sequence[StageInterface | None] | None = None,
                       built: Sequence[StageGraphs | None] | None = None) -> list[StageGraphs]:
    """F, B and W of every stage, split on the values the stages compute from ``flat_example_inputs``.

    ``wiring`` names the values (split-stages' ``fxpipe_wiring``): ``{"inputs": [name, ...],
    "stages": [{"inputs": [...], "outputs": [...]}, ...]}``. The stages run in order under no
    grad, their buffer updates undone, to give each the inputs it will see; an input needs a
    gradient when an earlier stage's B gives one (``input_grads`` also differentiates the
    model's floating-point inputs, so the first stage's B computes their gradient). Inputs on
    the meta device give meta example values. ``count_flops`` fills the FLOP fields.

    ``only`` (with ``interfaces``, a plan directory's record of each stage): split these stages only;
    a stage outside it whose interface is recorded gets an interface-only StageGraphs
    (``StageGraphs.remote``), which is all a rank needs of the stages other ranks run. A split stage
    whose interface differs from its record is a stale or damaged plan (PlanFileError). ``built``:
    graphs a stage already has (split for an earlier placement), kept as they are.
    """
    env: dict[str, Any] = dict(zip(wiring["inputs"], flat_example_inputs))
    needs_grad = {name for name, v in env.items()
                  if input_grads and isinstance(v, torch.Tensor) and v.is_floating_point()}
    graphs: list[StageGraphs] = []
    for k, (module, w) in enumerate(zip(stage_modules, wiring["stages"], strict=True)):
        args = [env[name] for name in w["inputs"]]
        with torch.no_grad(), preserved_buffers(module):
            outs = tuple(module(*args))
        recorded = interfaces[k] if interfaces is not None else None
        have = built[k] if built is not None else None
        if have is not None and not have.remote:
            result = have
        elif only is not None and k not in only and recorded is not None:
            result = StageGraphs(None, None, None, num_outputs=len(outs), grad_inputs=recorded.grad_inputs,
                                 grad_outputs=recorded.grad_outputs, fused_reason=recorded.fused_reason,
                                 interface=(tuple(map(_meta, args)), tuple(map(_meta, outs))))
        else:
            example = [example_input(a, name in needs_grad) for a, name in zip(args, w["inputs"])]
            result = cached_split(module, example, count_flops=count_flops)
            if recorded is not None and StageInterface.of(result) != recorded:
                raise PlanFileError(f"stage {k} splits into a backward with gradients for inputs "
                                    f"{list(result.grad_inputs)} and outputs {list(result.grad_outputs)}, where the "
                                    f"plan records {list(recorded.grad_inputs)} and {list(recorded.grad_outputs)}: "
                                    "the plan was written by another fxpipe or torch, or damaged; re-run fxpipe "
                                    "compile")
        graphs.append(result)
        env.update(zip(w["outputs"], outs))
        needs_grad.update(w["outputs"][i] for i in _differentiable_outputs(result, outs))
    return graphs


def _meta(value: Any) -> Any:
    """A stage value as the other ranks see it: a meta tensor of its shape, dtype and strides (None if no tensor)."""
    if not isinstance(value, torch.Tensor):
        return None
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")


def _differentiable_outputs(graphs: StageGraphs, outputs: Sequence[Any]) -> list[int]:
    """Positions of the stage outputs whose gradient B takes (a fused stage: every floating-point tensor)."""
    if graphs.fused:
        return [i for i, o in enumerate(outputs) if isinstance(o, torch.Tensor) and o.is_floating_point()]
    return list(graphs.grad_outputs)


def graph_signature(layer: torch.fx.GraphModule, example: Sequence[Any]) -> str:
    """A key equal for layers with the same ops, wiring, input and parameter shapes (names aside)."""
    index = {n: i for i, n in enumerate(layer.graph.nodes)}
    parts = []
    for n in layer.graph.nodes:
        args = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{index[a]}")
        extra = ""
        if n.op == "get_attr":
            t = get_path(layer, str(n.target))
            extra = (f"{tuple(t.shape)}:{t.dtype}:{getattr(t, 'requires_grad', False)}"
                     if isinstance(t, torch.Tensor) else "?")
            parts.append(f"get_attr {extra}")
            continue
        if n.op == "placeholder":
            parts.append("placeholder")
            continue
        if n.op == "call_module":  # a leaf module: its class and configuration (a stride is not in its shapes)
            mod = get_path(layer, str(n.target))
            target = f"{type(mod).__module__}.{type(mod).__qualname__}({mod.extra_repr()})"
        else:
            target = n.target
        parts.append(f"{n.op} {target} {args}")
    for a in example:
        parts.append(f"in {tuple(a.shape)}:{a.dtype}:{a.requires_grad}" if isinstance(a, torch.Tensor) else f"in {a!r}")
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()


def rebind(graphs: StageGraphs, src: torch.fx.GraphModule, dst: torch.fx.GraphModule) -> StageGraphs:
    """The F, B and W graphs of ``src`` moved onto ``dst``, a stage of the same signature with other parameters.

    Equal signatures read their tensors in the same order (:func:`_attr_targets`), so the k-th
    parameter of one is the k-th of the other.
    """
    if graphs.fused:
        return graphs
    return _Split.of(graphs, src).on(dst)


@dataclasses.dataclass(frozen=True)
class _Split:
    """A stage's split without its module: the graphs (no parameters held) and the get_attr targets they read, in
    the order the stage's graph lists them."""

    graphs: StageGraphs  # F, B and W set to None
    code: tuple[torch.fx.Graph | None, ...]  # F, B and W
    targets: tuple[str, ...]

    @classmethod
    def of(cls, graphs: StageGraphs, module: torch.fx.GraphModule) -> _Split:
        code = tuple(None if gm is None else copy_graph(gm.graph)
                     for gm in (graphs.forward, graphs.backward_input, graphs.backward_weight))
        return cls(dataclasses.replace(graphs, forward=None, backward_input=None, backward_weight=None), code,
                   _attr_targets(module))

    def on(self, dst: torch.fx.GraphModule) -> StageGraphs:
        """The graphs on ``dst``'s parameters (a stage of the same signature)."""
        if self.graphs.fused:
            return self.graphs
        names = dict(zip(self.targets, _attr_targets(dst), strict=True))

        def move(graph: torch.fx.Graph | None, cls: str) -> torch.fx.GraphModule | None:
            return None if graph is None else torch.fx.GraphModule(dst, _retargeted(graph, names), class_name=cls)

        fw, bi, bw = self.code
        return dataclasses.replace(self.graphs, forward=move(fw, "StageForward"),
                                   backward_input=move(bi, "StageBackwardInput"),
                                   backward_weight=move(bw, "StageBackwardWeight"),
                                   param_names=tuple(names[p] for p in self.graphs.param_names))


def _retargeted(graph: torch.fx.Graph, names: Mapping[str, str]) -> torch.fx.Graph:
    """A copy of ``graph`` whose get_attr nodes read ``names[target]``, each new node named as fx names a get_attr
    of its target (a split of the new stage itself names its nodes so), the other nodes as in ``graph``."""
    new = torch.fx.Graph(owning_module=None, tracer_cls=graph._tracer_cls)
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            env[node] = new.get_attr(names[str(node.target)])
            env[node].meta = copy.copy(node.meta)
        else:
            env[node] = new.node_copy(node, lambda n: env[n])
    new._codegen = copy.deepcopy(graph._codegen)
    return new


def _attr_targets(module: torch.fx.GraphModule) -> tuple[str, ...]:
    """The tensors ``module``'s graph reads, by qualified name, in graph order: a get_attr's target, and each
    parameter and buffer of a called leaf module (``--tracer fx`` keeps ``nn.Linear`` as a call); modules of equal
    signatures list theirs in the same order."""
    found: dict[str, None] = {}
    for n in module.graph.nodes:
        if n.op == "get_attr":
            found[str(n.target)] = None
        elif n.op == "call_module":
            leaf = get_path(module, str(n.target))
            tensors = (*leaf.named_parameters(remove_duplicate=False), *leaf.named_buffers(remove_duplicate=False))
            for name, _ in tensors:
                found[f"{n.target}.{name}"] = None
    return tuple(found)


def cached_split(module: torch.fx.GraphModule, example: Sequence[Any], *,
                 count_flops: FlopCounter | None = None) -> StageGraphs:
    """:func:`split_stage`, traced once per process for each graph signature (with the example's devices, the
    autocast state it is traced under, and which FLOP counter fills it): a hit is the same graphs rebound to
    ``module``'s parameters. The cache holds graphs, never parameters, and keeps the most recent _SPLITS_MAX."""
    key = _split_key(module, example, count_flops)
    hit = _SPLITS.get(key)
    if hit is None:
        result = split_stage(module, example, count_flops=count_flops)
        hit = _SPLITS[key] = _Split.of(result, module)
        while len(_SPLITS) > _SPLITS_MAX:
            _SPLITS.popitem(last=False)
        return result
    _SPLITS.move_to_end(key)
    try:
        return hit.on(module)
    except (KeyError, ValueError):  # tensors the signature does not pair up: trace this one as it is
        return split_stage(module, example, count_flops=count_flops)


def _split_key(module: torch.fx.GraphModule, example: Sequence[Any], count_flops: FlopCounter | None) -> str:
    devices = [str(a.device) for a in example if isinstance(a, torch.Tensor)]
    counter = None if count_flops is None else f"{count_flops.__module__}.{count_flops.__qualname__}"
    return f"{graph_signature(module, example)} {devices} {tracing_state()} {counter}"


_SPLITS: OrderedDict[str, _Split] = OrderedDict()
_SPLITS_MAX = 64
