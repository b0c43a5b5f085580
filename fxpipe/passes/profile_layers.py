"""profile_layers: measure each layer's forward and backward time on real tensors (``--profile``)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from fxpipe.errors import OptionError
from fxpipe.graphs.fx import clone, compute_nodes, preserved_buffers
from fxpipe.meta import get_meta, update_meta
from fxpipe.passes.driver import PassResult
from fxpipe.passes.split_stages import run_stages, split_by_layer
from fxpipe.report import Report


def profile_layers(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, runs: int = 5) -> PassResult:
    """Replace each layer's estimated times with the fastest of ``runs`` measured runs.

    The runs go round-robin over the layers (every layer once, then every layer again), after one
    warm-up round that is dropped, so a burst of load on the machine touches every layer alike
    instead of all the runs of a few; and each layer keeps its fastest run, because another job on
    the machine only ever adds time (as ``fxpipe.calibration.compute`` and ``time_graphs`` see it). With the
    median of a layer's runs back to back, the 16 identical layers of mlp-deep measured B+W from
    1.1 to 9.3 ms at load 3, and the partition's cut moved with the noise. No allocator setting is changed here:
    a caller that profiles as ``fxpipe run``'s ranks run keeps freed memory first (``fxpipe compile --profile`` does).

    Reads: NodeMeta.layer_idx and time_* estimates; real parameters and example inputs.
    Writes: NodeMeta.time_fwd / time_bwd_input / time_bwd_weight, scaled per layer so the
    layer's sums equal the measured forward time and backward time (the backward is measured
    fused and divided between B and W in the ratio of their estimates).
    Buffers the model updates in place (BatchNorm running statistics) are restored afterwards.
    Raises: OptionError on a model with ``meta`` weights (nothing to run).

        layer blocks.0: est F 0.21 ms, B+W 0.40 ms  ──▶  measured F 0.35 ms, B+W 0.71 ms
    """
    if runs < 1:
        raise OptionError(f"--profile-runs must be at least 1 (runs: {runs})")
    tensors = [*gm.parameters(), *gm.buffers(), *(t for t in example_inputs if isinstance(t, torch.Tensor))]
    if any(t.is_meta for t in tensors):
        raise OptionError("--profile runs the layers on real tensors, but the model is on the meta device; "
                          "drop --profile or build the model on cpu (--build-device cpu)")
    out = clone(gm)
    with preserved_buffers(gm):
        layers = [(layer, args) for _, layer, _, args, _ in run_stages(split_by_layer(gm), example_inputs)]
        samples: list[list[tuple[float, float]]] = [[] for _ in layers]
        for _ in range(runs + 1):  # the first round warms up and is dropped
            for mine, (layer, args) in zip(samples, layers):
                mine.append(_time_layer(layer, args))
    measured = [(min(f for f, _ in mine[1:]), min(b for _, b in mine[1:])) for mine in samples]

    members: dict[int, list[torch.fx.Node]] = defaultdict(list)
    for node in compute_nodes(out.graph):
        members[get_meta(node).layer_idx].append(node)
    rows = []
    for idx, (fwd, bwd) in enumerate(measured):
        nodes = members[idx]
        metas = [get_meta(n) for n in nodes]
        est_f = sum(m.time_fwd for m in metas)
        est_b = sum(m.time_bwd_input for m in metas)
        est_w = sum(m.time_bwd_weight for m in metas)
        share_b = est_b / (est_b + est_w) if est_b + est_w > 0 else 1.0
        _rescale(nodes, "time_fwd", fwd, lambda m: m.time_fwd)
        _rescale(nodes, "time_bwd_input", bwd * share_b, lambda m: m.time_bwd_input)
        _rescale(nodes, "time_bwd_weight", bwd * (1.0 - share_b), lambda m: m.time_bwd_weight)
        rows.append((idx, metas[0].layer, round(est_f * 1e3, 4), round(fwd * 1e3, 4),
                     round((est_b + est_w) * 1e3, 4), round(bwd * 1e3, 4)))
    report = Report(
        title="profile-layers: measured layer times",
        columns=("layer", "name", "est F ms", "measured F ms", "est B+W ms", "measured B+W ms"),
        rows=tuple(rows),
        notes=(f"fastest of {runs} runs per layer (round-robin over the layers), {torch.get_num_threads()} thread(s), "
               "on the example inputs",),
    )
    return PassResult(out, True, (report,))


def _rescale(nodes: list[torch.fx.Node], field: str, total: float, current: Callable[[Any], float]) -> None:
    est = sum(current(get_meta(n)) for n in nodes)
    for node in nodes:
        share = current(get_meta(node)) / est if est > 0 else 1.0 / len(nodes)
        update_meta(node, **{field: total * share})


def _time_layer(stage: torch.fx.GraphModule, args: list[Any]) -> tuple[float, float]:
    """One run of one layer: its forward's seconds and its backward's (fused: input and weight gradients)."""
    params = [p for p in stage.parameters() if p.requires_grad]
    inputs = [a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
              for a in args]
    start = time.perf_counter()
    outs = stage(*inputs)
    mid = time.perf_counter()
    diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    wrt = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad] + params
    if diff and wrt:
        torch.autograd.grad(diff, wrt, grad_outputs=[torch.ones_like(o) for o in diff], allow_unused=True)
    return mid - start, time.perf_counter() - mid
