"""Wall-clock time of each stage's F, B and W graphs, run whole as the executors run them (split-backward --profile)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from fxpipe.graphs.accumulate import accumulating_weight_graph
from fxpipe.graphs.convention import StageGraphs
from fxpipe.graphs.fx import preserved_buffers
from fxpipe.passes.split_stages import run_stages

Timing = tuple[float, float, float]  # F, B, W seconds


def time_stages(root: torch.fx.GraphModule, example_inputs: Sequence[Any], graphs: Sequence[StageGraphs],
                runs: int) -> list[Timing | None]:
    """:func:`time_graphs` for every stage of a split-stages root on the values its stages compute (None: fused)."""
    timings: list[Timing | None] = []
    for (_, stage, _, args, _), g in zip(run_stages(root, example_inputs), graphs, strict=True):
        with preserved_buffers(stage):
            timings.append(None if g.fused else time_graphs(g, args, runs))
    return timings


def time_graphs(g: StageGraphs, args: Sequence[Any], runs: int) -> Timing:
    """Median seconds of F, B and W of one stage on ``args`` (one warm-up run dropped).

    W is timed as executors run it on all but a step's first microbatch: W_acc, adding into
    gradient buffers that persist (``fxpipe.graphs.accumulate``), not returning fresh ones,
    whose first touch of new pages can double a thin weight-gradient GEMM's time.
    """
    samples = graph_samples(g, args, runs)
    return tuple(statistics.median(s[j] for s in samples) for j in range(3))  # type: ignore[return-value]


def graph_samples(g: StageGraphs, args: Sequence[Any], runs: int, before: Callable[[], object] | None = None,
                  before_backward: Callable[[], object] | None = None) -> list[Timing]:
    """Seconds of F, B and W of each of ``runs`` runs after one warm-up run (as :func:`time_graphs` times them);
    ``before`` is called before each of those runs' F, ``before_backward`` before its B (the calibration's cold runs
    evict the cache at both: in a pipeline each action, F or B, starts after a wait for its message)."""
    w_acc = accumulating_weight_graph(g.backward_weight, len(g.param_names))[0]  # type: ignore[arg-type]
    accs: list[torch.Tensor] | None = None
    samples: list[Timing] = []
    with torch.no_grad():
        for k in range(runs + 1):
            if k and before is not None:
                before()
            t0 = time.perf_counter()
            outputs, saved = g.run_forward(args)
            t1 = time.perf_counter()
            grads = [torch.ones_like(outputs[i]) for i in g.grad_outputs]
            if k and before_backward is not None:
                before_backward()
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
    return samples[1:]
