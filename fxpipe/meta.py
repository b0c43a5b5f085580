"""NodeMeta: the one frozen record fxpipe writes under ``node.meta["fxpipe"]``.

Each field has one owning pass (named in its comment); passes update it with
``dataclasses.replace`` through :func:`update_meta`, never in place, because torch copies
``node.meta`` shallowly and a mutable value would be shared between graphs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch.fx

META_KEY = "fxpipe"


@dataclass(frozen=True)
class NodeMeta:
    # annotate_costs: shapes, bytes and FLOPs on fake tensors
    shape: tuple[tuple[int, ...], ...] = ()  # one shape per tensor output
    dtype: str = ""  # dtype of the first tensor output ("" for non-tensors)
    out_bytes: int = 0  # bytes of every tensor this node produces
    saved_bytes: int = 0  # bytes kept for backward (0 for views and integer outputs)
    param_bytes: int = 0  # bytes of the parameters/buffers this node reads directly
    flops_fwd: int = 0
    flops_bwd_input: int = 0  # estimate until split_backward counts the real graph
    flops_bwd_weight: int = 0  # estimate until split_backward counts the real graph
    # annotate_costs (estimated from FLOPs and bytes) or profile_layers (measured), seconds
    time_fwd: float = 0.0
    time_bwd_input: float = 0.0
    time_bwd_weight: float = 0.0
    # annotate_costs (calibrated) or count_backward: the seconds of host work inside each time_* above
    host_fwd: float = 0.0
    host_bwd_input: float = 0.0
    host_bwd_weight: float = 0.0
    # annotate_costs (calibrated): what each time_* above gains when all of the node's weight (W: its gradient) is
    # read from memory rather than none of it (GEMMs; and count_backward's host time per op, whose cached and uncached
    # ends follow the same share); the times assume the model's own share
    # (``ComputeRates.cold``, in the graph's meta["fxpipe_cache_miss"]), and a plan whose replicas put more copies of
    # the model on one cache moves them along these slopes (partition_stages)
    cold_fwd: float = 0.0
    cold_bwd_input: float = 0.0
    cold_bwd_weight: float = 0.0
    # group_layers
    layer_idx: int = -1
    layer: str = ""
    # partition_stages
    stage_idx: int = -1


_EMPTY = NodeMeta()


def get_meta(node: torch.fx.Node) -> NodeMeta:
    """The node's record, or an empty one when no pass has written it yet."""
    meta = node.meta.get(META_KEY)
    return meta if isinstance(meta, NodeMeta) else _EMPTY


def update_meta(node: torch.fx.Node, **changes: Any) -> NodeMeta:
    """Replace the node's record with a copy that has ``changes`` applied."""
    new = dataclasses.replace(get_meta(node), **changes)
    node.meta[META_KEY] = new
    return new
