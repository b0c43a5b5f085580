"""A stage's F, B and W graphs: their calling convention and how they are built from a stage module.

    convention.py  StageGraphs and how executors call F, B and W; pipeline inputs and loss
    split.py       one stage's F, B and W from AOTAutograd's joint graph
    stages.py      every stage's graphs at once, one split per distinct stage graph
    accumulate.py  W rewritten to accumulate into (or overwrite) gradient buffers
    fx.py          small fx helpers the passes share
"""

from __future__ import annotations

from fxpipe.graphs.convention import Slot, StageGraphs, flatten_inputs, loss_and_output_grads, split_batch
from fxpipe.graphs.split import FlopCounter, example_input, split_stage
from fxpipe.graphs.stages import build_stage_graphs, graph_signature, rebind

__all__ = [
    "FlopCounter", "Slot", "StageGraphs", "build_stage_graphs", "example_input",
    "flatten_inputs", "graph_signature", "loss_and_output_grads", "rebind", "split_batch", "split_stage",
]
