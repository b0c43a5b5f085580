"""Tests of the per-layer strategy search: elimination and unwinding against brute force and the ILP; cost rules by
hand."""

from __future__ import annotations

import math
import random
import sys

import pytest

from fxpipe.errors import OptionError
from fxpipe.planning.cost import allreduce_seconds, static_memory
from fxpipe.planning.strategies import (
    Config,
    Degrees,
    Edge,
    Layer,
    LayerGraph,
    LayerSpec,
    Layout,
    Transfer,
    apply_memory_cap,
    build_graph,
    config_degrees,
    cost_graph,
    data_parallel,
    edge_seconds,
    eliminate,
    layer_configs,
    layer_memory,
    solve,
    solve_brute_force,
    solve_ilp,
    splitbrain,
    strategy_cost,
    strategy_rows,
    transfer,
)

# --- random series-parallel graphs ------------------------------------------------------------


def random_sp_edges(rng: random.Random, num_layers: int) -> list[tuple[int, int]]:
    """A two-terminal series-parallel DAG on ``num_layers`` layers: start from one edge, then
    subdivide an edge (series) or double it (parallel) at random; labels shuffled."""
    edges = [(0, 1)]
    n = 2
    while n < num_layers:
        i = rng.randrange(len(edges))
        u, v = edges[i]
        if rng.random() < 0.6:
            edges[i] = (u, n)
            edges.append((n, v))
            n += 1
        else:
            edges.append((u, v))
    perm = list(range(n))
    rng.shuffle(perm)
    return [(perm[u], perm[v]) for u, v in edges]


def random_costs(rng: random.Random, edges: list[tuple[int, int]], num_layers: int, max_configs: int,
                 integral: bool) -> LayerGraph:
    """Random non-negative costs; integral ones make ties, which the comparisons must survive."""
    def draw() -> float:
        return float(rng.randint(0, 5)) if integral else rng.uniform(0.0, 10.0)

    sizes = [rng.randint(1, max_configs) for _ in range(num_layers)]
    nodes = [[draw() for _ in range(s)] for s in sizes]
    tables = [(u, v, [[draw() for _ in range(sizes[v])] for _ in range(sizes[u])]) for u, v in edges]
    return cost_graph(nodes, tables)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def test_elimination_equals_brute_force_on_random_series_parallel_graphs() -> None:
    rng = random.Random(14)
    for trial in range(250):
        n = rng.randint(2, 10)
        graph = random_costs(rng, random_sp_edges(rng, n), n, 4, integral=trial % 2 == 0)
        best = solve_brute_force(graph)
        for strict, left in ((False, 1), (True, 2)):
            got = solve(graph, strict=strict)
            assert close(got.cost, best.cost), (trial, strict, got, best)
            assert close(strategy_cost(graph, got.choice), got.cost)
            assert got.remaining == left and got.method == "elimination", (trial, strict, got)


def test_elimination_equals_the_ilp_on_larger_series_parallel_graphs() -> None:
    rng = random.Random(1414)
    for trial in range(24):
        n = rng.randint(30, 60)
        graph = random_costs(rng, random_sp_edges(rng, n), n, 4, integral=trial % 3 == 0)
        got, ilp = solve(graph), solve_ilp(graph)
        assert got.remaining == 1 and ilp.method == "ilp"
        assert close(got.cost, ilp.cost), (trial, got.cost, ilp.cost)


def test_single_layer_and_disconnected_layers() -> None:
    one = cost_graph([[3.0, 1.0, 2.0]])
    assert solve(one).choice == (1,) and solve(one).cost == 1.0
    two = cost_graph([[3.0, 1.0], [0.5, 4.0]])  # no edges: each layer on its own
    assert solve(two).choice == (1, 0) and solve(two, strict=True).remaining == 2


# --- the named graphs -------------------------------------------------------------------------

LINK = {"bandwidth": 1e9, "latency": 1e-5}
MB = 2.0**20


def conv(name: str, seconds: float, params: float, out: float) -> LayerSpec:
    return LayerSpec(name, seconds, params * MB, out * MB, out * MB, "matmul", spatial=True)


def pointwise(name: str, out: float, spatial: bool = True) -> LayerSpec:
    return LayerSpec(name, 0.001, 0.0, out * MB, out * MB, "elementwise", spatial)


def fc(name: str, seconds: float, params: float, out: float) -> LayerSpec:
    return LayerSpec(name, seconds, params * MB, out * MB, out * MB, "matmul")


def chain(specs: list[LayerSpec]) -> tuple[list[LayerSpec], list[tuple[int, int]]]:
    return specs, [(i, i + 1) for i in range(len(specs) - 1)]


def vgg_like() -> tuple[list[LayerSpec], list[tuple[int, int]]]:
    """A VGG-like chain: cheap-parameter convolutions, then a classifier of large fully-connected layers."""
    return chain([
        LayerSpec("input", out_bytes=6 * MB, kind="input"),
        conv("conv1", 0.20, 0.1, 64), conv("conv2", 0.30, 0.5, 32), pointwise("pool2", 8),
        conv("conv3", 0.30, 2.0, 16), conv("conv4", 0.30, 5.0, 8), pointwise("pool4", 2),
        fc("fc6", 0.05, 400.0, 0.5), fc("fc7", 0.02, 64.0, 0.5), fc("fc8", 0.01, 16.0, 0.1),
    ])


def resnet_block() -> tuple[list[LayerSpec], list[tuple[int, int]]]:
    """x -> conv1 -> relu -> conv2 -> add(x) -> relu -> head, the add reading x by a skip edge."""
    specs = [LayerSpec("input", out_bytes=8 * MB, kind="input"), conv("stem", 0.1, 0.1, 16),
             conv("conv1", 0.2, 2.0, 16), pointwise("relu1", 16), conv("conv2", 0.2, 2.0, 16),
             pointwise("add", 16), pointwise("relu", 16), fc("head", 0.01, 4.0, 0.1)]
    edges = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (1, 5), (5, 6), (6, 7)]
    return specs, edges


def inception_block() -> tuple[list[LayerSpec], list[tuple[int, int]]]:
    """Four branches (1x1; 1x1 -> 3x3; 1x1 -> 5x5; pool -> 1x1) from one input into a concat."""
    specs = [LayerSpec("input", out_bytes=8 * MB, kind="input"), conv("stem", 0.1, 0.2, 16),
             conv("b1_1x1", 0.05, 0.1, 4),
             conv("b2_1x1", 0.05, 0.1, 4), conv("b2_3x3", 0.2, 1.0, 8),
             conv("b3_1x1", 0.03, 0.05, 2), conv("b3_5x5", 0.1, 0.5, 4),
             pointwise("b4_pool", 16), conv("b4_1x1", 0.05, 0.1, 4),
             pointwise("concat", 20), fc("head", 0.01, 2.0, 0.1)]
    edges = [(0, 1), (1, 2), (1, 3), (3, 4), (1, 5), (5, 6), (1, 7), (7, 8),
             (2, 9), (4, 9), (6, 9), (8, 9), (9, 10)]
    return specs, edges


@pytest.mark.parametrize("make", [vgg_like, resnet_block, inception_block])
@pytest.mark.parametrize("ranks", [2, 4])
def test_named_graphs_reduce_to_at_most_two_layers_and_match_the_ilp(make, ranks: int) -> None:
    specs, edges = make()
    graph = build_graph(specs, edges, ranks, **LINK)
    ilp = solve_ilp(graph)
    for strict, left in ((False, 1), (True, 2)):
        assert eliminate(graph, strict=strict).remaining.__len__() == left
        got = solve(graph, strict=strict)
        assert got.remaining == left <= 2 and got.method == "elimination"
        assert close(got.cost, ilp.cost), (make.__name__, strict, got.names(graph), ilp.names(graph))


def test_vgg_search_is_hybrid_convolutions_data_parallel_classifier_sharded() -> None:
    """SplitBrain's shape falls out of the costs: the convolutions split the batch, the big fc6 does not."""
    specs, edges = vgg_like()
    graph = build_graph(specs, edges, 4, **LINK)
    got = solve(graph)
    chosen = dict(zip((s.name for s in specs), got.names(graph)))
    assert chosen["conv1"] == chosen["conv2"] == "s4"
    assert "c" in chosen["fc6"] or "r" in chosen["fc6"], chosen
    dp = [next(c for c, cfg in enumerate(layer.configs) if cfg.name == "s4") for layer in graph.layers]
    assert got.cost < strategy_cost(graph, dp)


# --- graphs that do not reduce ----------------------------------------------------------------


def wheatstone_bridge(rng: random.Random, configs: int) -> LayerGraph:
    """s -> a, s -> b, a -> b, a -> t, b -> t: not two-terminal series-parallel."""
    return random_costs(rng, [(0, 1), (0, 2), (1, 2), (1, 3), (2, 3)], 4, configs, integral=False)


def k4(rng: random.Random, configs: int) -> LayerGraph:
    """Every layer reads every earlier one (a dense block): every layer keeps three neighbours."""
    edges = [(u, v) for u in range(4) for v in range(u + 1, 4)]
    sizes = [configs] * 4
    return cost_graph([[rng.uniform(0, 10) for _ in range(s)] for s in sizes],
                      [(u, v, [[rng.uniform(0, 10) for _ in range(sizes[v])] for _ in range(sizes[u])])
                       for u, v in edges])


def test_the_wheatstone_bridge_keeps_four_layers_under_the_papers_rules_and_the_ilp_solves_it() -> None:
    rng = random.Random(3)
    for _ in range(10):
        graph = wheatstone_bridge(rng, 4)
        best = solve_brute_force(graph)
        assert len(eliminate(graph, strict=True).remaining) == 4
        fallback = solve(graph, strict=True, enumerate_limit=0)
        assert fallback.method == "elimination+ilp" and fallback.remaining == 4
        assert close(fallback.cost, best.cost)
        assert close(solve(graph, strict=True).cost, best.cost)  # small enough to enumerate too
        # any two edges may be eliminated: the bridge has treewidth 2, so it reduces to one layer
        assert solve(graph).remaining == 1 and close(solve(graph).cost, best.cost)


def test_k4_does_not_reduce_and_a_large_residue_goes_to_the_ilp() -> None:
    rng = random.Random(4)
    for configs in (3, 4):
        graph = k4(rng, configs)
        assert len(eliminate(graph).remaining) == 4
        best = solve_brute_force(graph)
        for limit in (0, 10_000):
            got = solve(graph, enumerate_limit=limit)
            assert got.remaining == 4 and close(got.cost, best.cost)
            assert got.method == ("elimination+ilp" if limit == 0 else "elimination")
    big = k4(rng, 12)  # 12^4 strategies: more than the default enumeration limit
    got = solve(big)
    assert got.method == "elimination+ilp" and close(got.cost, solve_brute_force(big).cost)


def test_without_highspy_a_graph_that_does_not_reduce_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "highspy", None)  # import highspy now raises ImportError
    graph = k4(random.Random(5), 2)
    with pytest.raises(OptionError, match=r"does not reduce.*pip install -c constraints.txt -e '\.\[strategies\]'"):
        solve(graph, enumerate_limit=0)
    with pytest.raises(OptionError, match=r"pip install -c constraints.txt -e '\.\[strategies\]'"):
        solve_ilp(graph)
    assert close(solve(graph).cost, solve_brute_force(graph).cost)  # small residues need no highspy


def test_unwinding_needs_every_remaining_layer_and_brute_force_has_a_limit() -> None:
    graph = k4(random.Random(6), 2)
    with pytest.raises(OptionError, match="missing"):
        eliminate(graph).unwind({0: 0})
    with pytest.raises(OptionError, match=r"brute force would try 16 strategies \(limit: 10\)"):
        solve_brute_force(graph, limit=10)


def test_malformed_graphs_are_refused() -> None:
    with pytest.raises(OptionError, match="needs a 2x1 cost table"):
        cost_graph([[1.0, 2.0], [3.0]], [(0, 1, [[1.0, 2.0]])])
    with pytest.raises(OptionError, match="two different layers"):
        cost_graph([[1.0]], [(0, 0, [[1.0]])])
    with pytest.raises(OptionError, match="no configuration"):
        LayerGraph((Layer("empty", ()),))


# --- the cost rules, by hand ------------------------------------------------------------------


@pytest.mark.parametrize(("held", "needed", "expected"), [
    (Layout(batch=2), Layout(batch=2), Transfer(0.0, 0)),  # same split
    (Layout(), Layout(channel=4), Transfer(0.0, 0)),  # a slice of a whole tensor
    (Layout(batch=4), Layout(batch=2), Transfer(25.0, 1)),  # gather 2 quarters into a half
    (Layout(batch=4), Layout(), Transfer(75.0, 3)),  # all-gather over 4: (g-1)/g B
    (Layout(channel=2), Layout(batch=2), Transfer(25.0, 1)),  # all-to-all over 2: (g-1)/g B/g
    (Layout(channel=4), Layout(batch=4), Transfer(18.75, 3)),  # all-to-all over 4: 3/4 * 25
    (Layout(partial=2), Layout(batch=2), Transfer(50.0, 1)),  # reduce-scatter over 2
    (Layout(partial=4), Layout(), Transfer(150.0, 6)),  # all-reduce over 4: 2(g-1)/g B
    (Layout(batch=2, partial=2), Layout(batch=4), Transfer(25.0, 1)),  # reduce-scatter over 2 of a half
    (Layout(batch=2, channel=2), Layout(batch=4), Transfer(12.5, 1)),  # s2c2 -> s4: an eighth from the neighbour
])
def test_transfer_rules(held: Layout, needed: Layout, expected: Transfer) -> None:
    got = transfer(held, needed, 100.0)
    assert got.steps == expected.steps and close(got.nbytes, expected.nbytes), got


def test_edge_costs_forward_plus_backward() -> None:
    """B = 100 bytes, 10 B/s, latency 1 s on 2 ranks."""
    a, b = LayerSpec("a", out_bytes=100.0), LayerSpec("b", out_bytes=100.0)
    link = {"bandwidth": 10.0, "latency": 1.0}

    def cost(da: Degrees, db: Degrees) -> float:
        return edge_seconds(a, da, b, db, **link)

    assert cost(Degrees(sample=2), Degrees(sample=2)) == 0.0  # data parallel throughout
    assert cost(Degrees(column=2), Degrees(row=2)) == 0.0  # Megatron MLP inside
    # column -> sample: an all-to-all forward (25 B) and one back (25 B)
    assert close(cost(Degrees(column=2), Degrees(sample=2)), 2 * (1 + 25 / 10))
    # sample -> column: an all-gather of 50 B forward, a reduce-scatter of the partial input grads back
    assert close(cost(Degrees(sample=2), Degrees(column=2)), 2 * (1 + 50 / 10))
    # row -> column: an all-reduce (2 steps, 100 B) each way
    assert close(cost(Degrees(row=2), Degrees(column=2)), 2 * (2 + 100 / 10))
    # a model input sends forward only; elementwise layers read their own layout
    x, relu = LayerSpec("x", out_bytes=100.0, kind="input"), LayerSpec("relu", kind="elementwise")
    assert close(edge_seconds(x, Degrees(sample=2), relu, Degrees(column=2), **link), 1 + 25 / 10)
    assert edge_seconds(relu, Degrees(column=2), b, Degrees(row=2), **link) == 0.0


def test_config_degrees() -> None:
    assert [d.name for d in config_degrees(4)] == ["s4", "s2c2", "s2r2", "c4", "c2r2", "r4"]
    assert len(config_degrees(4, spatial=True)) == 10  # ordered ways to write 4 as s*c*r*h
    assert [d.name for d in config_degrees(4, kind="elementwise")] == ["s4", "s2c2", "c4"]
    assert [d.name for d in config_degrees(4, kind="input")] == ["s4"]
    assert [d.name for d in config_degrees(2, divisors=True)] == ["s2", "c2", "r2", "s1"]
    with pytest.raises(OptionError, match="unknown layer kind 'attention'"):
        config_degrees(2, kind="attention")


def test_layer_configs_by_hand() -> None:
    """A conv of 8 s, 400 B of parameters, 64 B saved, on 4 ranks, 100 B/s, latency 0.1 s, momentum."""
    spec = LayerSpec("conv", seconds=8.0, param_bytes=400.0, saved_bytes=64.0, spatial=True)
    configs = {c.name: c for c in layer_configs(spec, 4, bandwidth=100.0, latency=0.1, optimizer="momentum")}
    s4, s2h2, c2r2, c4 = configs["s4"], configs["s2h2"], configs["c2r2"], configs["c4"]
    assert s4.compute == s2h2.compute == c2r2.compute == 2.0
    # ring all-reduce of all 400 B over 4: 2*3/4 * 400/100 + 2*3 * 0.1
    assert close(s4.sync, 6.0 + 0.6) and close(s4.sync, allreduce_seconds(400.0, 4, 100.0, 0.1))
    assert close(s2h2.sync, s4.sync)  # spatial splits replicate the parameters too
    assert c2r2.sync == c4.sync == 0.0  # parameters split 4 ways: nothing replicated
    assert configs["s2c2"].sync == allreduce_seconds(200.0, 2, 100.0, 0.1)
    # memory: (param + grad + momentum) of the local parameters + the input split s*r*h
    assert s4.memory == static_memory(400.0, "momentum") + 16.0 == 1216.0
    assert c2r2.memory == 3 * 100.0 + 64.0 / 2
    assert c4.memory == 3 * 100.0 + 64.0  # every column rank keeps the whole input
    assert s4.degrees == Degrees(sample=4)


def test_build_graph_tables() -> None:
    specs = [LayerSpec("x", kind="input", out_bytes=40.0), LayerSpec("fc1", 1.0, 8.0, 20.0),
             LayerSpec("fc2", 1.0, 8.0, 4.0)]
    graph = build_graph(specs, [(0, 1), (1, 2)], 2, bandwidth=10.0, latency=0.0)
    names = [c.name for c in graph.layers[1].configs]
    assert names == ["s2", "c2", "r2"]
    fc1_fc2 = graph.edges[1].cost
    assert fc1_fc2[names.index("c2")][names.index("r2")] == 0.0
    assert close(fc1_fc2[names.index("r2")][names.index("c2")], 2 * 20.0 / 10)  # all-reduce each way
    assert graph.edges[0].cost[0] == (0.0, 2.0, 1.0)  # the input's batch halves -> s2, c2, r2
    with pytest.raises(OptionError, match="must join two of the 3 layers"):
        build_graph(specs, [(0, 3)], 2, bandwidth=1.0, latency=0.0)


# --- the memory cap ---------------------------------------------------------------------------


def capped_graph() -> LayerGraph:
    # a large input (8 MB) and small parameters (1000 B): splitting the batch moves the least
    specs = [LayerSpec("x", kind="input", out_bytes=8e6), LayerSpec("fc", 1.0, 1000.0, 8.0, 8.0)]
    return build_graph(specs, [(0, 1)], 2, bandwidth=1e9, latency=0.0, optimizer="adam")


def test_memory_cap_drops_configurations_and_the_choice_keeps_original_indices() -> None:
    graph = capped_graph()
    fc = graph.layers[1]
    mem = {c.name: c.memory for c in fc.configs}
    assert mem["s2"] == 4 * 1000.0 + 4.0 and mem["c2"] == 4 * 500.0 + 8.0 and mem["r2"] == 4 * 500.0 + 4.0
    free = solve(graph)
    assert free.names(graph)[1] == "s2"
    cap = 3000.0
    capped, kept = apply_memory_cap(graph, cap)
    assert kept == ((0,), (1, 2)) and [c.name for c in capped.layers[1].configs] == ["c2", "r2"]
    assert capped.edges[0].cost == tuple(tuple(graph.edges[0].cost[0][b] for b in (1, 2)) for _ in (0,))
    for solver in (solve, solve_ilp):
        got = solver(graph, memory_cap=cap)
        assert graph.layers[1].configs[got.choice[1]].memory <= cap
        assert got.names(graph)[1] in ("c2", "r2") and close(got.cost, strategy_cost(graph, got.choice))
    assert solve(graph, memory_cap=cap).cost > free.cost


def test_an_impossible_memory_cap_is_one_clear_error() -> None:
    graph = capped_graph()
    with pytest.raises(OptionError, match=r"no configuration of layer 'fc' fits the memory cap per rank "
                                          r"\(cap: 1000.00 B; the smallest of 'fc', r2, needs 1.96 KiB\); "
                                          r"raise the cap to at least 1.96 KiB or use more ranks"):
        solve(graph, memory_cap=1000.0)
    two = LayerGraph((Layer("a", (Config("x", memory=5.0),)), Layer("b", (Config("y", memory=9.0),))), (
        Edge(0, 1, ((0.0,),)),))
    with pytest.raises(OptionError, match=r"of 2 layers \('a', 'b'\).*the smallest of 'b', y, needs 9.00 B"):
        apply_memory_cap(two, 1.0)


def test_docstring_examples() -> None:
    import doctest

    from fxpipe.planning import strategies

    result = doctest.testmod(strategies)
    assert result.failed == 0 and result.attempted >= 15


# --- presets: data parallelism and SplitBrain -------------------------------------------------


@pytest.mark.parametrize(("ranks", "group"), [(4, 2), (4, 4), (8, 2), (8, 4)])
def test_presets_on_a_vgg_like_chain(ranks: int, group: int) -> None:
    """Data parallelism splits only the batch; SplitBrain keeps the convolutions there and shards the
    classifier's fully-connected layers within groups of K (column, row, column), the batch across groups."""
    specs, edges = vgg_like()
    graph = build_graph(specs, edges, ranks, **LINK)
    assert set(data_parallel(graph).names(graph)) == {f"s{ranks}"}
    sb = splitbrain(graph, specs, group)
    chosen = dict(zip((s.name for s in specs), sb.names(graph)))
    outer = f"s{ranks // group}" if ranks > group else ""
    for name in ("input", "conv1", "conv2", "pool2", "conv3", "conv4", "pool4"):
        assert chosen[name] == f"s{ranks}", (name, chosen)
    assert (chosen["fc6"], chosen["fc7"], chosen["fc8"]) == (f"{outer}c{group}", f"{outer}r{group}", f"{outer}c{group}")
    assert close(sb.cost, strategy_cost(graph, sb.choice))
    # SplitBrain's point: the classifier's parameters (and gradients, optimizer state) shrink K-fold per rank
    fc6 = graph.layers[7].configs[sb.choice[7]]
    assert fc6.degrees is not None
    assert layer_memory(specs[7], fc6.degrees).params == pytest.approx(specs[7].param_bytes / group)
    with pytest.raises(OptionError, match="must divide"):
        splitbrain(graph, specs, 3)


def test_the_search_is_never_costlier_than_either_preset() -> None:
    rng = random.Random(14)
    cases = [(make, ranks) for make in (vgg_like, resnet_block, inception_block) for ranks in (2, 4, 8)]
    for _ in range(30):
        n = rng.randint(3, 8)
        edges = random_sp_edges(rng, n)
        kinds = ["input"] + [rng.choice(["matmul", "elementwise"]) for _ in range(n - 1)]
        specs = [LayerSpec(f"l{v}", rng.uniform(0, 0.3), rng.choice([0.0, 1.0, 50.0]) * MB * (k == "matmul"),
                           rng.uniform(0.1, 20) * MB, rng.uniform(0.1, 20) * MB, k, spatial=rng.random() < 0.5)
                 for v, k in enumerate(kinds)]
        cases.append((lambda specs=specs, edges=edges: (specs, edges), rng.choice([2, 4])))
    for make, ranks in cases:
        specs, edges = make()
        graph = build_graph(specs, edges, ranks, **LINK)
        best = solve(graph).cost
        presets = [data_parallel(graph)] + [splitbrain(graph, specs, k) for k in (2, ranks) if ranks % k == 0]
        for preset in presets:
            assert best <= preset.cost * (1 + 1e-9) + 1e-12, (preset.method, best, preset.cost)


def test_strategy_rows_add_up_to_the_strategy() -> None:
    specs, edges = vgg_like()
    graph = build_graph(specs, edges, 4, **LINK)
    for strategy in (solve(graph), data_parallel(graph), splitbrain(graph, specs, 2)):
        report = strategy_rows(graph, specs, strategy)
        body, total = report.rows[:-1], report.rows[-1]
        assert [r[0] for r in body] == [s.name for s in specs] and total[0] == "total"
        assert [r[1] for r in body] == list(strategy.names(graph))
        assert close(total[2] + total[3] + total[4], strategy.cost)
        mem = [layer_memory(s, graph.layers[v].configs[c].degrees).total
               for v, (s, c) in enumerate(zip(specs, strategy.choice))]
        assert [r[5] for r in body] == pytest.approx(mem)


# --- the runtime's host costs (HostCosts) -----------------------------------------------------------


def test_host_costs_by_hand() -> None:
    """x -> fc1 (params) -> relu -> fc2 -> loss on 2 ranks: host per layer, per layer with parameters, per
    gradient all-reduce, per redistribute that moves (each direction) and per step, all by hand."""
    from fxpipe.planning.strategies import HostCosts

    specs = [LayerSpec("x", kind="input", out_bytes=40.0), LayerSpec("fc1", 1.0, 8.0, 20.0),
             LayerSpec("relu", 0.5, 0.0, 20.0, kind="elementwise"), LayerSpec("fc2", 1.0, 8.0, 4.0, fixed_seconds=0.25),
             LayerSpec("loss", kind="loss")]
    edges = [(0, 1), (1, 2), (2, 3), (3, 4)]
    host = HostCosts(node=1.0, params=10.0, collective=100.0, sync=1000.0, step=10000.0)
    bare = build_graph(specs, edges, 2, bandwidth=10.0, latency=0.0)
    costed = build_graph(specs, edges, 2, bandwidth=10.0, latency=0.0, host=host)
    dp_bare, dp = data_parallel(bare), data_parallel(costed)
    # 3 compute layers, 2 with parameters, 2 gradient all-reduces, no redistribute, one step; fc2's fixed time
    assert close(dp.cost - dp_bare.cost, 3 * 1.0 + 2 * 10.0 + 2 * 1000.0 + 10000.0)
    fc2 = {c.name: c for c in costed.layers[3].configs}
    assert close(fc2["c2"].compute, 1.0 / 2 + 0.25 + 1.0 + 10.0) and fc2["c2"].sync == 0.0
    # relu s2 -> fc2 c2: an all-gather forward, a reduce-scatter back: two redistributes
    relu_fc2_bare, relu_fc2 = bare.edges[2].cost, costed.edges[2].cost
    s2, c2 = 0, [c.name for c in costed.layers[3].configs].index("c2")
    assert close(relu_fc2[s2][c2] - relu_fc2_bare[s2][c2], 2 * 100.0)
    assert relu_fc2[s2][s2] == relu_fc2_bare[s2][s2] == 0.0  # nothing moves: no host cost
    assert close(strategy_cost(costed, dp.choice), dp.cost)


def test_bucketed_sync_shares_a_bucket_latency_by_bytes() -> None:
    """bucket_layers: each layer pays its gradients' bytes and its bytes' share of a 25 MiB bucket's latency (and
    host.sync); BatchNorm statistics are still all-reduced on their own."""
    from fxpipe.planning.cost import BUCKET_BYTES
    from fxpipe.planning.strategies import HostCosts, sync_seconds

    fc, bn = LayerSpec("fc", param_bytes=BUCKET_BYTES / 4), LayerSpec("bn", param_bytes=64.0, stat_bytes=32.0,
                                                                       kind="elementwise")
    host = HostCosts(collective=1.0, sync=10.0)
    s4 = Degrees(sample=4)
    share = (2 * 3 * 0.5 + 10.0) / 4  # a quarter of a bucket: of its 6 ring steps' latency and its host.sync
    assert close(sync_seconds(fc, s4, bandwidth=1e6, latency=0.5, host=host, bucket_layers=True),
                 1.5 * BUCKET_BYTES / 4 / 1e6 + share)
    assert close(sync_seconds(fc, s4, bandwidth=1e6, latency=0.5, host=host),
                 allreduce_seconds(BUCKET_BYTES / 4, 4, 1e6, 0.5) + 10.0)  # per layer: a whole bucket's
    stats = 2 * (allreduce_seconds(32.0, 4, 1e6, 0.5) + 1.0)
    assert close(sync_seconds(bn, s4, bandwidth=1e6, latency=0.5, host=host, bucket_layers=True),
                 1.5 * 64.0 / 1e6 + (6 * 0.5 + 10.0) * 64.0 / BUCKET_BYTES + stats)
