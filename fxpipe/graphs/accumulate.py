"""Gradient accumulation fused into the weight-gradient GEMMs of a W graph.

A pipeline runs W once per microbatch and sums the parameter gradients over microbatches. Done
after the fact, every microbatch pays a separate ``grad += w`` over every parameter: it reads
both and writes one, as much memory traffic as a thin weight-gradient GEMM itself. BLAS accumulates for free: ``C = A @
B + C`` is the same GEMM with beta = 1. So
``accumulating_weight_graph`` rewrites W into W_acc, which takes the accumulators as extra inputs
and returns nothing:

* ``mm(a, b)``     -> ``addmm_(acc, a, b)``
* ``t(mm(a, b))``  -> ``addmm_(acc, t(b), t(a))`` (the transpose of a product)
* anything else    -> ``add_(acc, grad)`` (bias sums, convolution weight gradients, ...)

With ``overwrite=True`` the same rewrite gives W_set, which writes the gradients into existing
buffers instead (``mm(a, b, out=acc)``, ``copy_``): the first microbatch of a step reuses the
previous step's gradient buffers, with no zeroing pass and no fresh allocation (a fresh
multi-megabyte buffer is new pages from the kernel, faulted in on first touch).

The very first microbatch runs W itself (its outputs become the gradients); after it, W_set
starts each step and W_acc adds the rest. This is Megatron-LM's "gradient accumulation fusion",
for any W graph.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

aten = torch.ops.aten


def _shape(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _only_user_is(node: torch.fx.Node, user: torch.fx.Node) -> bool:
    return set(node.users) == {user}


def accumulating_weight_graph(w: torch.fx.GraphModule, num_grads: int, *,
                              overwrite: bool = False) -> tuple[torch.fx.GraphModule, int]:
    """W_acc: W's inputs, then one accumulator per gradient W returns; adds into them, returns ().

    With ``overwrite``, W_set: writes the gradients into those buffers instead of adding. Also
    returns how many gradients went into a GEMM (the rest are plain ``add_`` / ``copy_``).
    """
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    out = next(n for n in reversed(w.graph.nodes) if n.op == "output")
    grads = list(out.args[0])[:num_grads]
    fused: dict[torch.fx.Node, tuple[torch.fx.Node, torch.fx.Node, bool]] = {}  # grad -> (a, b, transposed)
    for g in grads:
        if not isinstance(g, torch.fx.Node) or g in fused or grads.count(g) > 1:
            continue
        if g.target is aten.mm.default and _only_user_is(g, out):
            fused[g] = (g.args[0], g.args[1], False)  # type: ignore[assignment]
        elif (g.target is aten.t.default and isinstance(g.args[0], torch.fx.Node)
              and g.args[0].target is aten.mm.default and _only_user_is(g.args[0], g) and _only_user_is(g, out)):
            mm = g.args[0]
            fused[g] = (mm.args[0], mm.args[1], True)  # type: ignore[assignment]
    skip = {g.args[0] for g, (_, _, t) in fused.items() if t} | set(fused)  # nodes W_acc does not compute
    placeholders = [n for n in w.graph.nodes if n.op == "placeholder"]
    for node in w.graph.nodes:
        if node.op == "output" or node in skip:
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
        if node is placeholders[-1]:
            accs = [graph.placeholder(f"acc_{k}") for k in range(num_grads)]
    if not placeholders:
        accs = [graph.placeholder(f"acc_{k}") for k in range(num_grads)]
    for g, acc in zip(grads, accs):
        if g in fused:
            a, b, transposed = fused[g]
            lhs, rhs = env[a], env[b]
            if transposed:
                lhs, rhs = (graph.call_function(aten.t.default, (env[b],)),
                            graph.call_function(aten.t.default, (env[a],)))
            if overwrite:
                graph.call_function(aten.mm.out, (lhs, rhs), {"out": acc})
            else:
                graph.call_function(aten.addmm_.default, (acc, lhs, rhs))
        else:
            op = aten.copy_.default if overwrite else aten.add_.Tensor
            graph.call_function(op, (acc, env[g] if isinstance(g, torch.fx.Node) else g))
    graph.output(())
    graph.eliminate_dead_code()  # in-place ops are impure: they stay
    name = "WeightGradInto" if overwrite else "WeightGradAccumulate"
    return torch.fx.GraphModule(w, graph, class_name=name), len(fused)


# The ATen ops of W graphs that return a view of their input (no new memory, no work beyond the call).
VIEW_OPS = frozenset({aten.t.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                      aten.permute.default, aten.transpose.int, aten.expand.default, aten.alias.default})


def grads_are_fresh(w: torch.fx.GraphModule, num_grads: int) -> list[bool]:
    """Whether each gradient W returns is a new tensor (not an input of W or a view of one),
    so it can become ``param.grad`` without a copy and be accumulated into in place."""
    out = next(n for n in reversed(w.graph.nodes) if n.op == "output")
    fresh = []
    grads = list(out.args[0])[:num_grads]
    for k, g in enumerate(grads):
        base = g
        while isinstance(base, torch.fx.Node) and base.target in VIEW_OPS:
            base = base.args[0]
        shared = any(other is g for other in grads[:k])  # the same tensor returned twice
        fresh.append(isinstance(base, torch.fx.Node) and base.op == "call_function" and not shared)
    return fresh
