"""Batched W: a run of one stage's adjacent W actions as one call over those microbatches.

A stage's W adds each microbatch's parameter gradient into ``.grad``. Run per microbatch, every W
reads and writes every gradient buffer, and its weight-gradient GEMMs are as thin as a microbatch
(``benchmarks/RESULTS.md`` measures one W over k microbatches against k W's). A schedule that
runs a stage's Ws back to back (``batched-w``: two batches of half the microbatches) lets the runtime make that one
call (the graph-level pieces are :mod:`fxpipe.graphs.batched`):

* **the graph**: the stage's W traced again at k microbatches (:func:`batched_weight_graphs`), the
  stage run on k microbatches' worth of example inputs (every model input stacked k times along
  its batch dimension, as the runtime splits a batch);
* **its inputs**: each of W's inputs (B's handover, F's saved tensors, output gradients) either
  grows k-fold along exactly one dimension (the k microbatches' tensors are concatenated along it)
  or keeps its shape (it must then be the same tensor in every microbatch, e.g. a weight F saved:
  checked at each call, by storage and layout);
* **the check**: the first batched call of each stage and k also runs the k per-microbatch W's and
  compares the sums (:func:`agree`); a stage whose W is not a sum over its rows (an op mixing a
  batch's samples, e.g. ``x - x.mean(0)``) fails it and runs per microbatch from then on.

A stage the batch cannot be traced for (a stage module with the microbatch's size written into its
views, as traced transformers have), or whose W inputs do not scale as above, keeps per-microbatch
W's; :class:`BatchedW` is then None and the reason is kept (``PipelineRuntime.batched_w``). The
result is the same sum of per-microbatch gradients, in another order of additions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fxpipe.graphs.batched import BatchedW, agree, build_batched, measure_ratio
from fxpipe.graphs.convention import StageGraphs, flatten_inputs

__all__ = ["BatchedW", "agree", "batched_weight_graphs", "measure_ratio"]


def batched_weight_graphs(pipe: Any, stage: int, base: StageGraphs, k: int,
                          example_inputs: Sequence[Any]) -> BatchedW | str:
    """Stage ``stage`` of ``pipe``'s W traced at ``k`` microbatches (:func:`fxpipe.graphs.batched.build_batched`), or
    why it cannot run batched. ``example_inputs``: one microbatch's model inputs."""
    if pipe.plan is not None and pipe.plan.backward_moves:
        return "the plan moves ops across its cuts (--balance-backward), which the batch is not traced with"
    stages = pipe.stage_list()
    wiring = {"inputs": list(pipe.input_names),
              "stages": [{"inputs": list(s.inputs), "outputs": list(s.outputs)} for s in stages]}
    return build_batched([s.module for s in stages], wiring, flatten_inputs(pipe.in_spec, tuple(example_inputs), {}),
                         stage, base, k, interfaces=[s.interface for s in stages])
