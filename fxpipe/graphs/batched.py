"""Batched W at the graph level: a stage's W traced at k microbatches, its inputs combined, checked and timed.

:mod:`fxpipe.runtime.batched_w` says why and how the runtime uses it; the passes use it to time a profiled stage's
batched W against its microbatches' (``StageCost.w_batched``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fxpipe.errors import first_line
from fxpipe.graphs.accumulate import accumulating_weight_graph, grads_are_fresh
from fxpipe.graphs.convention import StageGraphs, StageInterface
from fxpipe.graphs.stages import build_stage_graphs
from fxpipe.timing import fastest


@dataclass
class BatchedW:
    """Stage ``stage``'s W over ``k`` microbatches at once, and how its inputs are combined."""

    stage: int
    k: int
    plain: torch.fx.GraphModule  # W at k microbatches: returns the gradients
    w_acc: Any  # ... adding them into the accumulators it is given
    w_set: Any  # ... writing them into the buffers it is given
    fresh: list[bool]  # grads_are_fresh(plain)
    dims: tuple[Any, ...]  # per W input: the dimension to concatenate along; None: one tensor for all (a tuple
    # of these for an input that is a tuple of tensors)
    checked: bool = False  # the first call compared against the per-microbatch W's
    # its time over the k per-microbatch W's (measure_ratio): what the simulator charges a W in a run
    ratio: float = 1.0

    def combine(self, args: Sequence[Sequence[Any]]) -> list[Any] | None:
        """One argument list for the batched W from ``k`` per-microbatch ones; None where an input that keeps
        its shape is not the same tensor in every microbatch (the caller then runs them one by one)."""
        out = [_combine([a[i] for a in args], dim) for i, dim in enumerate(self.dims)]
        return None if any(x is _DIFFERS for x in out) else out


_DIFFERS = object()


def _combine(column: list[Any], dim: Any) -> Any:
    """The k microbatches' values of one W input combined: concatenated along ``dim``, the one value when ``dim`` is
    None (``_DIFFERS`` unless it is the same in all), element by element for a tuple (a multi-output op's)."""
    if isinstance(dim, tuple):
        parts = [_combine([c[j] for c in column], d) for j, d in enumerate(dim)]
        return _DIFFERS if any(p is _DIFFERS for p in parts) else type(column[0])(parts)
    if dim is not None:
        return torch.cat(column, dim=dim)
    return column[0] if all(_same(column[0], x) for x in column[1:]) else _DIFFERS


def build_batched(stage_modules: Sequence[torch.fx.GraphModule], wiring: Mapping[str, Any],
                  flat_example_inputs: Sequence[Any], stage: int, base: StageGraphs, k: int, *,
                  interfaces: Sequence[StageInterface | None] | None = None) -> BatchedW | str:
    """Stage ``stage``'s W traced at ``k`` microbatches, or why it cannot run batched (one line).

    ``flat_example_inputs``: one microbatch's flattened model inputs (their shapes and dtypes are what matter); each
    is stacked ``k`` times along its first dimension. ``base``: the stage's graphs at one microbatch. ``interfaces``
    (a plan directory's record of each stage): the other stages are then not split, only run.
    """
    if base.backward_weight is None:
        return "it has no W graph"
    traced = trace_batched(stage_modules, wiring, flat_example_inputs, k, only={stage}, interfaces=interfaces)
    return traced if isinstance(traced, str) else batched_from(base, traced[stage], stage, k)


def trace_batched(stage_modules: Sequence[torch.fx.GraphModule], wiring: Mapping[str, Any],
                  flat_example_inputs: Sequence[Any], k: int, *, only: Any = None,
                  interfaces: Sequence[StageInterface | None] | None = None) -> list[StageGraphs] | str:
    """Every stage's graphs (``only``: those stages'; see ``build_stage_graphs``) split at ``k`` microbatches: the
    example inputs stacked ``k`` times along their first dimension. Or why the stages do not run on that (one line)."""
    stacked = [torch.cat([x] * k) if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in flat_example_inputs]
    try:
        return build_stage_graphs(stage_modules, wiring, stacked, only=only, interfaces=interfaces)
    except Exception as exc:  # e.g. a view traced with the microbatch's size  # noqa: BLE001
        return f"the stage does not run on {k} microbatches at once ({first_line(exc)})"


def batched_from(base: StageGraphs, graphs: StageGraphs, stage: int, k: int) -> BatchedW | str:
    """A stage's batched W from its graphs at one microbatch (``base``) and at ``k`` (``graphs``), or why their Ws do
    not correspond input by input (each input grown k-fold along one dimension, or the same shape)."""
    w = graphs.backward_weight
    if base.backward_weight is None or w is None or graphs.param_names != base.param_names \
            or len(graphs.w_slots) != len(base.w_slots) or graphs.num_handover != base.num_handover:
        return f"its W at {k} microbatches takes other inputs than at one"
    one, many = _placeholders(base.backward_weight), _placeholders(w)
    if len(one) != len(many):
        return f"its W at {k} microbatches takes {len(many)} inputs, at one {len(one)}"
    dims: list[Any] = []
    for i, (a, b) in enumerate(zip(one, many)):
        dim = _grown(a, b, k)
        if dim is False:
            return f"W's input {i} has shape {list(a)} at one microbatch and {list(b)} at {k}"
        dims.append(dim)
    n = len(graphs.param_names)
    return BatchedW(stage, k, w, accumulating_weight_graph(w, n)[0], accumulating_weight_graph(w, n, overwrite=True)[0],
                    grads_are_fresh(w, n), tuple(dims))


def measure_ratio(plain: torch.fx.GraphModule, w_acc: Any, batch: BatchedW, runs: int = 3,
                  device: torch.device | None = None) -> float:
    """The batched W's time over its k per-microbatch W's, each the fastest of ``runs`` on random inputs of W's shapes
    (the inputs that keep their shape shared, as at run time), both adding into the same gradient buffers as the
    runtime's W_acc does (a fresh multi-megabyte gradient per call would time the allocator): how much of W a batched
    run costs, for the simulator. ``plain``: the stage's W at one microbatch, ``w_acc`` its accumulating form;
    ``device``: where the stage runs (default: where its values were traced; a plan's stored values are on meta)."""
    def make(val: Any) -> Any:
        if isinstance(val, (tuple, list)):
            return type(val)(make(v) for v in val)
        if not isinstance(val, torch.Tensor):
            return val
        if val.is_floating_point():
            return torch.randn(val.shape, dtype=val.dtype, device=device or val.device)
        return torch.zeros(val.shape, dtype=val.dtype, device=device or val.device)

    vals = [n.meta.get("val") for n in plain.graph.nodes if n.op == "placeholder"]
    shared = [make(v) for v in vals]
    args = [[x if _keeps(d) else make(v) for x, v, d in zip(shared, vals, batch.dims)] for _ in range(batch.k)]
    combined = batch.combine(args)
    if combined is None:
        return 1.0

    out = next(n for n in reversed(plain.graph.nodes) if n.op == "output")
    accs = [torch.zeros(a.meta["val"].shape, dtype=a.meta["val"].dtype, device=device or a.meta["val"].device)
            for a in out.args[0]]
    with torch.no_grad():
        each = fastest(lambda: [w_acc(*a, *accs) for a in args], runs)
        once = fastest(lambda: batch.w_acc(*combined, *accs), runs)
    return once / each if each > 0 else 1.0


def _keeps(dim: Any) -> bool:
    """An input that keeps its shape (one value for every microbatch), wholly."""
    return dim is None or (isinstance(dim, tuple) and all(_keeps(d) for d in dim))


def agree(batched: Sequence[Any], summed: Sequence[Any]) -> bool:
    """The batched W's gradients equal the per-microbatch sums, up to the order of additions (float32: rows summed
    in another order differ by ~1e-6 of the largest entry; an op mixing samples differs by far more)."""
    for b, s in zip(batched, summed):
        if (b is None) != (s is None):
            return False
        if b is None:
            continue
        scale = float(s.abs().max()) if s.numel() else 0.0
        if b.shape != s.shape or not torch.allclose(b, s, rtol=1e-3, atol=1e-3 * scale + 1e-12):
            return False
    return True


def _placeholders(gm: torch.fx.GraphModule) -> list[Any]:
    """Each input's shape (a tuple of them for a tuple of tensors; None for anything else)."""
    return [_shape_of(node.meta.get("val")) for node in gm.graph.nodes if node.op == "placeholder"]


def _shape_of(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return tuple(val.shape)
    if isinstance(val, (tuple, list)):
        return [_shape_of(v) for v in val]
    return None


def _grown(one: Any, many: Any, k: int) -> Any:
    """The one dimension along which shape ``many`` is ``k`` times ``one``; None if they are equal; a tuple of
    those for a list of shapes; False otherwise."""
    if isinstance(one, list) and isinstance(many, list) and len(one) == len(many):
        dims = tuple(_grown(a, b, k) for a, b in zip(one, many))
        return False if any(d is False for d in dims) else dims
    if one is None or many is None or isinstance(one, list) or isinstance(many, list):
        return None if one is None and many is None else False
    if one == many:
        return None
    if len(one) != len(many):
        return False
    diff = [d for d, (a, b) in enumerate(zip(one, many)) if a != b]
    if len(diff) == 1 and many[diff[0]] == k * one[diff[0]]:
        return diff[0]
    return False


def _same(a: Any, b: Any) -> bool:
    """The same value in two microbatches: the same tensor data (storage, offset, shape and strides), or equal."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                and a.storage_offset() == b.storage_offset() and a.shape == b.shape and a.stride() == b.stride()
                and a.dtype == b.dtype)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return a is b or (type(a) is type(b) and isinstance(a, (int, float, bool, str, type(None))) and a == b)
