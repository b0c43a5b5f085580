"""The Inception-like network (fxpipe/models/inception.py): its four-branch blocks make a series-parallel layer graph
that node and edge elimination reduce without the ILP fallback, and the search's choice costs what it says."""

from __future__ import annotations

import torch

from fxpipe.models.inception import build
from fxpipe.passes.strategy_graph import strategy_graph
from fxpipe.planning.strategies import build_graph, data_parallel, eliminate, solve, strategy_cost


def test_inception_blocks_reduce_by_elimination_and_the_search_beats_dp() -> None:
    state = torch.random.get_rng_state()
    model, inputs = build("tiny")
    assert torch.equal(torch.random.get_rng_state(), state)  # build leaves the caller's RNG alone
    g = strategy_graph(model.to("meta"), tuple(t.to("meta") for t in inputs))  # shapes only: nothing computed
    assert g.specs[-2].shape == (2, 10)  # the classifier's logits, then the loss
    assert sum(1 for _, v in g.edges if g.nodes[v].startswith("cat")) >= 4  # the four branches meet at a cat
    graph = build_graph(g.specs, g.edges, 2, bandwidth=1e9, latency=1e-5)
    assert len(eliminate(graph).remaining) <= 2
    s = solve(graph)
    assert s.method == "elimination"
    assert s.cost == strategy_cost(graph, s.choice) <= data_parallel(graph).cost
