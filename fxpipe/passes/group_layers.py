"""group_layers: group call nodes into layers by module path, finding the repeating blocks by default."""

from __future__ import annotations

import operator
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx

from fxpipe.errors import OptionError
from fxpipe.graphs.fx import clone, compute_nodes, get_path, value_bytes
from fxpipe.meta import get_meta, update_meta
from fxpipe.passes.driver import PassResult
from fxpipe.report import Report

_CONTAINERS = ("torch.nn.modules.container.",)


@dataclass(frozen=True)
class LayerStats:
    """Totals of one layer, summed from its nodes' NodeMeta."""

    idx: int
    name: str
    num_nodes: int
    flops_fwd: int
    flops_bwd_input: int
    flops_bwd_weight: int
    time_fwd: float
    time_bwd_input: float
    time_bwd_weight: float
    params: tuple[str, ...]  # dotted names of the parameters/buffers the layer reads
    param_bytes: int
    saved_bytes: int  # activation bytes kept for backward, per microbatch
    # what its times gain with every weight read from memory rather than none (NodeMeta.cold_*; 0 when uncalibrated)
    cold_fwd: float = 0.0
    cold_bwd_input: float = 0.0
    cold_bwd_weight: float = 0.0

    @property
    def time(self) -> float:
        return self.time_fwd + self.time_bwd_input + self.time_bwd_weight

    @property
    def cold(self) -> float:
        return self.cold_fwd + self.cold_bwd_input + self.cold_bwd_weight

    def moved(self, shift: float) -> LayerStats:
        """This layer with ``shift`` more of its weights read from memory (its times along the ``cold_*`` slopes)."""
        return replace(self, time_fwd=self.time_fwd + shift * self.cold_fwd,
                       time_bwd_input=self.time_bwd_input + shift * self.cold_bwd_input,
                       time_bwd_weight=self.time_bwd_weight + shift * self.cold_bwd_weight)

    @property
    def flops(self) -> int:
        return self.flops_fwd + self.flops_bwd_input + self.flops_bwd_weight


def group_layers(gm: torch.fx.GraphModule, *, granularity: str = "auto") -> PassResult:
    """Assign every call node to a layer: a maximal run of nodes with the same module path.

    Reads: ``nn_module_stack`` (written by torch.export and torch.fx tracing).
    Writes: NodeMeta.layer_idx and NodeMeta.layer.
    granularity: ``auto`` (each instance of the outermost repeating module class is one
    layer: every transformer block, every ResNet bottleneck), ``node`` (one node per layer),
    or an integer depth in the module tree (``1``: children of the model).
    Nodes with no module of their own (ops in the model's own forward) join the layer before.

        blocks.0.ln_1 -> layer "blocks.0"    blocks.0.attn.c_attn -> layer "blocks.0"
    """
    out = clone(gm)
    nodes = list(compute_nodes(out.graph))
    stacks = [_stack(out, n) for n in nodes]
    if granularity == "node":
        keys: list[str | None] = [n.name for n in nodes]
        how = "one node per layer"
    elif granularity == "auto":
        block_type = _repeating_block_type(stacks)
        if block_type is None:
            keys = [_key_at_depth(s, 1) for s in stacks]
            how = "no repeating module class found: children of the model"
        else:
            instances = {p for s in stacks for p, t in s if t == block_type}
            keys = [_key_for_block(s, block_type, instances) for s in stacks]
            how = (f"one layer per {block_type.rsplit('.', 1)[-1]} ({len(instances)} instances), "
                   "other modules on their own")
    else:
        try:
            depth = int(granularity)
        except ValueError:
            raise OptionError(
                f"unknown --granularity {granularity!r}; use auto, node, or a module depth such as 1 or 2"
            ) from None
        if depth < 1:
            raise OptionError(f"--granularity depth must be at least 1 (depth: {depth}); "
                              "use 1 for the model's children")
        keys = [_key_at_depth(s, depth) for s in stacks]
        how = f"modules at depth {depth}"

    # A multi-output op's getitems stay in its layer, so no cut ever sends a tuple.
    key_of = {n: k for n, k in zip(nodes, keys)}
    for i, n in enumerate(nodes):
        if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node) and n.args[0] in key_of:
            keys[i] = key_of[n] = key_of[n.args[0]]
    names = _runs(keys)
    seen: Counter[str] = Counter()
    labels: list[str] = []
    for key in names:
        seen[key] += 1
        labels.append(key if seen[key] == 1 else f"{key}#{seen[key]}")
    layer_of = _layer_indices(keys)
    for node, idx in zip(nodes, layer_of):
        update_meta(node, layer_idx=idx, layer=labels[idx])
    stats = layer_stats(out)
    report = Report(
        title="group-layers: per-layer costs",
        columns=("layer", "name", "nodes", "fwd MFLOP", "bwd MFLOP (est)", "est ms", "tensors", "param MiB",
                 "saved MiB"),
        rows=tuple(
            (s.idx, s.name, s.num_nodes, round(s.flops_fwd / 1e6, 3),
             round((s.flops_bwd_input + s.flops_bwd_weight) / 1e6, 3), round(s.time * 1e3, 3),
             len(s.params), round(s.param_bytes / 2**20, 3), round(s.saved_bytes / 2**20, 3))
            for s in stats
        ),
        notes=(f"granularity {granularity}: {how}; {len(stats)} layers",),
    )
    return PassResult(out, True, (report,))


def verify_layers(gm: torch.fx.GraphModule) -> list[str]:
    """Every call node has a layer, and layers are contiguous runs in graph order."""
    problems = []
    last = -1
    for node in compute_nodes(gm.graph):
        idx = get_meta(node).layer_idx
        if idx < 0:
            problems.append(f"node {node.name} has no layer")
        elif idx < last:
            problems.append(f"node {node.name} is in layer {idx} after a node of layer {last}: "
                            "layers must be contiguous")
        last = max(last, idx)
    return problems


def layer_stats(gm: torch.fx.GraphModule) -> list[LayerStats]:
    """Per-layer totals, in layer order, from the nodes' NodeMeta."""
    groups: dict[int, list[torch.fx.Node]] = defaultdict(list)
    for node in compute_nodes(gm.graph):
        groups[get_meta(node).layer_idx].append(node)
    stats = []
    for idx in sorted(groups):
        members = groups[idx]
        metas = [get_meta(n) for n in members]
        params = sorted({str(a.target) for n in members for a in n.all_input_nodes if a.op == "get_attr"})
        if any(n.op == "call_module" for n in members):  # fx tracer: parameters live in leaf modules
            params = sorted(set(params) | {f"{n.target}.{p}" for n in members if n.op == "call_module"
                                           for p, _ in get_path(gm, str(n.target)).named_parameters()})
        stats.append(
            LayerStats(
                idx=idx,
                name=metas[0].layer,
                num_nodes=len(members),
                flops_fwd=sum(m.flops_fwd for m in metas),
                flops_bwd_input=sum(m.flops_bwd_input for m in metas),
                flops_bwd_weight=sum(m.flops_bwd_weight for m in metas),
                time_fwd=sum(m.time_fwd for m in metas),
                time_bwd_input=sum(m.time_bwd_input for m in metas),
                time_bwd_weight=sum(m.time_bwd_weight for m in metas),
                params=tuple(params),
                param_bytes=sum(value_bytes(get_path(gm, p)) for p in params),
                saved_bytes=sum(m.saved_bytes for m in metas),
                cold_fwd=sum(m.cold_fwd for m in metas),
                cold_bwd_input=sum(m.cold_bwd_input for m in metas),
                cold_bwd_weight=sum(m.cold_bwd_weight for m in metas),
            )
        )
    return stats


def _stack(gm: torch.fx.GraphModule, node: torch.fx.Node) -> list[tuple[str, str]]:
    """The node's module stack as (path, class name), without the root module."""
    raw: Any = node.meta.get("nn_module_stack") or {}
    stack = []
    for value in raw.values():
        path, typ = value
        name = typ if isinstance(typ, str) else f"{typ.__module__}.{typ.__qualname__}"
        if path:
            stack.append((str(path), name))
    if node.op == "call_module" and (not stack or stack[-1][0] != node.target):
        sub = get_path(gm, str(node.target))
        stack.append((str(node.target), f"{type(sub).__module__}.{type(sub).__qualname__}"))
    return stack


def _repeating_block_type(stacks: list[list[tuple[str, str]]]) -> str | None:
    """The non-container module class with 2+ outermost instances covering the most nodes."""
    instances: dict[str, set[str]] = defaultdict(set)
    for stack in stacks:
        for path, typ in stack:
            if not typ.startswith(_CONTAINERS):
                instances[typ].add(path)
    repeating = {t for t, paths in instances.items() if len(paths) >= 2}
    outermost: dict[str, set[str]] = defaultdict(set)
    cover: Counter[str] = Counter()
    for stack in stacks:
        for path, typ in stack:
            if typ in repeating:
                outermost[typ].add(path)
                cover[typ] += 1
                break  # only the outermost repeating module of this node counts
    candidates = [t for t in outermost if len(outermost[t]) >= 2]
    if not candidates:
        return None
    return max(candidates, key=lambda t: (cover[t], -len(outermost[t]), t))


def _key_for_block(stack: list[tuple[str, str]], block_type: str, instances: set[str]) -> str | None:
    for path, typ in stack:
        if typ == block_type:
            return path
    for path, _ in stack:
        prefix = path + "."
        if not any(inst.startswith(prefix) for inst in instances):
            return path
    return None


def _key_at_depth(stack: list[tuple[str, str]], depth: int) -> str | None:
    if not stack:
        return None
    return stack[min(depth, len(stack)) - 1][0]


def _runs(keys: list[str | None]) -> list[str]:
    """Names of the maximal runs of equal keys; a None key joins the run before it (or after, at the start)."""
    names: list[str] = []
    current: str | None = None
    for key in keys:
        if key is not None and key != current:
            names.append(key)
            current = key
    return names or ["model"]


def _layer_indices(keys: list[str | None]) -> list[int]:
    out: list[int] = []
    idx = -1
    current: str | None = None
    for key in keys:
        if key is not None and key != current:
            idx += 1
            current = key
        out.append(max(idx, 0))
    return out
