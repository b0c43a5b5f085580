"""Activation recomputation: a stage's F graph run again just before its B, from the stage's inputs alone.

A recomputing stage keeps only its inputs from F to B (``input_bytes``), not the saved tensors its B
and W read; B first runs :func:`recompute_graph` on them, which remakes those saved tensors, and W then
reads what that run made. The graph is F with two things left out: its outputs (nothing reads them
again), and its buffer updates (F already updated BatchNorm's running statistics; a second update
would count the microbatch twice). Random ops stay, in F's order, so that run from the RNG state F
started from (the executor's business) they draw F's numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from fxpipe.errors import OptionError
from fxpipe.graphs.convention import StageGraphs
from fxpipe.graphs.fx import COMPUTE_OPS, copy_graph


def recompute_graph(g: StageGraphs) -> torch.fx.GraphModule:
    """Stage ``g``'s F returning only its saved tensors, without its buffer updates: ``(*inputs) -> (*saved)``.

    It shares the stage's parameters and buffers with F. Raises OptionError for a stage with no F graph
    of its own (a fused stage, a compiled one, or one another rank runs).
    """
    forward = g.forward
    if not isinstance(forward, torch.fx.GraphModule) or g.fused:
        why = g.fused_reason or "its F graph is not an fx graph"
        raise OptionError(f"a stage recomputes its forward from its F graph, and this stage has none ({why}); "
                          "compile it with split_backward, or do not recompute it")
    graph = copy_graph(forward.graph)
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    out.args = (tuple(out.args[0][g.num_outputs:]),)
    for node in list(graph.nodes):  # F's buffer updates: copy_(get_attr buffer, new value)
        if node.op == "call_function" and node.target is torch.ops.aten.copy_.default and \
                isinstance(node.args[0], torch.fx.Node) and node.args[0].op == "get_attr":
            graph.erase_node(node)
    for node in reversed(list(graph.nodes)):  # what only the outputs or the updates read; random ops stay (F's draws)
        if node.op in COMPUTE_OPS and not node.users and not _random(node) and not _mutates(node):
            graph.erase_node(node)
    return torch.fx.GraphModule(forward, graph, class_name="StageRecompute")


def draws_random(gm: Any) -> bool:
    """Whether an F graph draws random numbers (dropout's mask, a random attention kernel): its recomputation must
    then start from the RNG state F started from."""
    return isinstance(gm, torch.fx.GraphModule) and any(_random(n) for n in gm.graph.nodes)


def input_bytes(g: StageGraphs) -> int:
    """Bytes of one microbatch's stage inputs (each its own tensor): what a recomputing stage keeps from F to B."""
    if g.interface is not None:
        vals: Sequence[Any] = g.interface[0]
    elif isinstance(g.forward, torch.fx.GraphModule):
        vals = [n.meta.get("val") for n in g.forward.graph.nodes if n.op == "placeholder"]
    else:
        return 0
    return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def _random(node: torch.fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _mutates(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)
