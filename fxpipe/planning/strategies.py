"""Per-layer parallel configurations (OptCNN, Jia et al.), searched exactly on the layer graph.

Each layer has candidate configurations (degrees ``(s, c, r, h)``: batch, output channels, input
channels, height) with a node cost and memory per rank; each edge has a table of redistribution
costs between its endpoints' configurations. ``solve`` finds the cheapest assignment by edge, node
and leaf elimination, then enumeration or an ILP (HiGHS) on what is left, and unwinds.
``solve_ilp`` and ``solve_brute_force`` cross-check it. The cost model and the elimination rules
are written out in docs/internals/strategy-search.md.

Pure functions on plain values; no torch. HiGHS is imported only inside ``solve_ilp``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fxpipe.errors import OptionError
from fxpipe.planning.cost import BUCKET_BYTES, allreduce_buckets, allreduce_seconds, static_memory

__all__ = [
    "ENUMERATE_LIMIT",
    "KINDS",
    "NO_HOST",
    "STRATEGY_COLUMNS",
    "Config",
    "Degrees",
    "Edge",
    "HostCosts",
    "LayerMemory",
    "Layer",
    "LayerGraph",
    "LayerSpec",
    "Layout",
    "Reduction",
    "Strategy",
    "StrategyTable",
    "Transfer",
    "apply_memory_cap",
    "build_graph",
    "config_degrees",
    "cost_graph",
    "data_parallel",
    "edge_seconds",
    "edge_transfers",
    "eliminate",
    "layer_configs",
    "layer_memory",
    "layouts",
    "local_param_bytes",
    "solve",
    "solve_brute_force",
    "solve_ilp",
    "splitbrain",
    "stage_graph",
    "strategy_cost",
    "strategy_rows",
    "sync_collectives",
    "sync_seconds",
    "traffic_per_layer",
    "transfer",
]

ENUMERATE_LIMIT = 10_000
"""The most strategies ``solve`` enumerates for one connected piece of the residue; above it, the ILP."""

BRUTE_FORCE_LIMIT = 2_000_000
"""The most strategies ``solve_brute_force`` agrees to enumerate."""

KINDS = ("matmul", "elementwise", "input", "loss")
"""Layer kinds ``layer_configs`` knows: contracts input features | keeps its input's layout | a model input |
the loss (reads the model's output split over the batch on every rank, as the input is)."""

_INSTALL = "pip install -c constraints.txt -e '.[strategies]' (README.md)"


# --- the layer graph: plain data --------------------------------------------------------------


@dataclass(frozen=True)
class Degrees:
    """How a layer is split over ranks: batch (sample), output (column) and input (row) features, height (spatial).

    >>> Degrees(sample=2, column=2).name, Degrees().name, Degrees(row=4).product
    ('s2c2', 's1', 4)
    """

    sample: int = 1
    column: int = 1
    row: int = 1
    spatial: int = 1

    @property
    def product(self) -> int:
        return self.sample * self.column * self.row * self.spatial

    @property
    def name(self) -> str:
        parts = [f"{k}{v}" for k, v in zip("scrh", (self.sample, self.column, self.row, self.spatial)) if v > 1]
        return "".join(parts) or "s1"

    @classmethod
    def from_name(cls, name: str) -> Degrees:
        """The degrees ``name`` spells (the inverse of ``name``).

        >>> Degrees.from_name("s2c2") == Degrees(sample=2, column=2), Degrees.from_name("s1")
        (True, Degrees(sample=1, column=1, row=1, spatial=1))
        """
        parts: list[tuple[str, str]] = []
        for ch in name:
            if ch in "scrh":
                parts.append((ch, ""))
            elif ch.isdigit() and parts:
                parts[-1] = (parts[-1][0], parts[-1][1] + ch)
            else:
                parts = []
                break
        if not parts or any(not v for _, v in parts) or len({k for k, _ in parts}) != len(parts):
            raise OptionError(f"{name!r} is not a configuration name (e.g. s4, s2c2, c2r2: degrees over sample, "
                              "column, row, height)")
        values = {k: int(v) for k, v in parts}
        if any(v < 1 for v in values.values()):
            raise OptionError(f"{name!r}: every degree is at least 1")
        return cls(values.get("s", 1), values.get("c", 1), values.get("r", 1), values.get("h", 1))


@dataclass(frozen=True)
class Config:
    """One candidate configuration of a layer: its costs in seconds and its memory per rank in bytes."""

    name: str
    compute: float = 0.0
    sync: float = 0.0
    memory: float = 0.0
    degrees: Degrees | None = None

    @property
    def cost(self) -> float:
        """The node cost: compute plus the parameter-gradient sync (OptCNN's t_c + t_s)."""
        return self.compute + self.sync


@dataclass(frozen=True)
class Layer:
    """A node of the layer graph: a name and its candidate configurations (at least one)."""

    name: str
    configs: tuple[Config, ...]


@dataclass(frozen=True)
class Edge:
    """A tensor from layer ``src`` to layer ``dst``; ``cost[a][b]``: seconds to redistribute it when
    ``src`` runs its configuration a and ``dst`` its configuration b (OptCNN's t_x)."""

    src: int
    dst: int
    cost: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class LayerGraph:
    """Layers and the edges between them (several edges may join the same pair; no self-loops)."""

    layers: tuple[Layer, ...]
    edges: tuple[Edge, ...] = ()

    def __post_init__(self) -> None:
        for i, layer in enumerate(self.layers):
            if not layer.configs:
                raise OptionError(f"layer {i} ({layer.name!r}) has no configuration; give it at least one")
        n = len(self.layers)
        for e, edge in enumerate(self.edges):
            if not (0 <= edge.src < n and 0 <= edge.dst < n) or edge.src == edge.dst:
                raise OptionError(f"edge {e} ({edge.src} -> {edge.dst}) must join two different layers of 0..{n - 1}")
            rows, cols = len(self.layers[edge.src].configs), len(self.layers[edge.dst].configs)
            if len(edge.cost) != rows or any(len(r) != cols for r in edge.cost):
                shape = f"{len(edge.cost)}x{len(edge.cost[0]) if edge.cost else 0}"
                raise OptionError(f"edge {e} ({edge.src} -> {edge.dst}) needs a {rows}x{cols} cost table "
                                  f"(configurations of its layers), not {shape}")


def cost_graph(node_costs: Sequence[Sequence[float]],
               edges: Sequence[tuple[int, int, Sequence[Sequence[float]]]] = (),
               names: Sequence[str] | None = None) -> LayerGraph:
    """A ``LayerGraph`` from bare numbers: ``node_costs[v][c]`` and ``(src, dst, table)`` edges.

    >>> g = cost_graph([[1.0, 2.0], [3.0]], [(0, 1, [[5.0], [0.0]])])
    >>> solve(g).choice, solve(g).cost
    ((1, 0), 5.0)
    """
    layers = tuple(
        Layer(names[v] if names else f"l{v}", tuple(Config(f"c{c}", compute=float(x)) for c, x in enumerate(costs)))
        for v, costs in enumerate(node_costs))
    return LayerGraph(layers, tuple(Edge(u, v, tuple(tuple(float(x) for x in row) for row in t)) for u, v, t in edges))


@dataclass(frozen=True)
class Strategy:
    """A configuration per layer (``choice[v]`` indexes ``graph.layers[v].configs``) and its total cost.

    ``method``: how it was found (``elimination``, ``elimination+ilp``, ``ilp``, ``brute-force``);
    ``remaining``: layers left when no elimination rule applied (all of them for ``ilp`` / ``brute-force``).
    """

    choice: tuple[int, ...]
    cost: float
    method: str
    remaining: int

    def names(self, graph: LayerGraph) -> tuple[str, ...]:
        """Each layer's chosen configuration's name."""
        return tuple(layer.configs[c].name for layer, c in zip(graph.layers, self.choice))


def strategy_cost(graph: LayerGraph, choice: Sequence[int]) -> float:
    """The cost of one configuration per layer: its node costs plus its edges' table entries.

    >>> strategy_cost(cost_graph([[1.0, 2.0], [3.0]], [(0, 1, [[5.0], [0.0]])]), (0, 0))
    9.0
    """
    if len(choice) != len(graph.layers):
        raise OptionError(f"a strategy needs one configuration per layer (layers: {len(graph.layers)}, "
                          f"given: {len(choice)})")
    total = math.fsum(layer.configs[c].cost for layer, c in zip(graph.layers, choice))
    return total + math.fsum(e.cost[choice[e.src]][choice[e.dst]] for e in graph.edges)


# --- the memory cap ---------------------------------------------------------------------------


def _format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def apply_memory_cap(graph: LayerGraph, cap: float) -> tuple[LayerGraph, tuple[tuple[int, ...], ...]]:
    """Drop every configuration whose memory per rank exceeds ``cap``; also returns, per layer, the
    original indices of the configurations kept. Raises ``OptionError`` when a layer keeps none.

    >>> g = LayerGraph((Layer("fc", (Config("s2", memory=8.0), Config("c2", memory=5.0))),))
    >>> apply_memory_cap(g, 6.0)[1]
    ((1,),)
    """
    kept = tuple(tuple(c for c, cfg in enumerate(layer.configs) if cfg.memory <= cap) for layer in graph.layers)
    empty = [v for v, k in enumerate(kept) if not k]
    if empty:
        smallest = {v: min(graph.layers[v].configs, key=lambda cfg: cfg.memory) for v in empty}
        worst = max(empty, key=lambda v: smallest[v].memory)
        names = ", ".join(repr(graph.layers[v].name) for v in empty[:3]) + (", ..." if len(empty) > 3 else "")
        which = f"layer {names}" if len(empty) == 1 else f"{len(empty)} layers ({names})"
        need = _format_bytes(smallest[worst].memory)
        raise OptionError(
            f"no configuration of {which} fits the memory cap per rank (cap: {_format_bytes(cap)}; the smallest "
            f"of {graph.layers[worst].name!r}, {smallest[worst].name}, needs {need}); raise the cap to at least "
            f"{need} or use more ranks")
    layers = tuple(Layer(layer.name, tuple(layer.configs[c] for c in k)) for layer, k in zip(graph.layers, kept))
    edges = tuple(Edge(e.src, e.dst, tuple(tuple(e.cost[a][b] for b in kept[e.dst]) for a in kept[e.src]))
                  for e in graph.edges)
    return LayerGraph(layers, edges), kept


# --- elimination ------------------------------------------------------------------------------

_Table = list[list[float]]


@dataclass(frozen=True)
class _Series:
    """Layer ``node`` was removed between ``left`` and ``right``: ``arg[c_left][c_right]`` is its best config."""

    node: int
    left: int
    right: int
    arg: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class _Leaf:
    """Layer ``node`` was folded into ``into``: ``arg[c_into]`` is its best config."""

    node: int
    into: int
    arg: tuple[int, ...]


@dataclass(frozen=True)
class Reduction:
    """What elimination leaves: the remaining layers with their folded node costs, the remaining
    edges (between remaining layers), and the log that ``unwind`` replays backwards."""

    num_layers: int
    remaining: tuple[int, ...]
    node_costs: Mapping[int, tuple[float, ...]]
    edges: tuple[Edge, ...]
    steps: tuple[_Series | _Leaf, ...]

    def residual(self) -> tuple[LayerGraph, tuple[int, ...]]:
        """The remaining layers as a graph of their own (layer i is original layer ``remaining[i]``)."""
        index = {v: i for i, v in enumerate(self.remaining)}
        layers = tuple(Layer(f"l{v}", tuple(Config(f"c{c}", compute=x) for c, x in enumerate(self.node_costs[v])))
                       for v in self.remaining)
        edges = tuple(Edge(index[e.src], index[e.dst], e.cost) for e in self.edges)
        return LayerGraph(layers, edges), self.remaining

    def unwind(self, residual_choice: Mapping[int, int]) -> tuple[int, ...]:
        """Every layer's configuration, from one for each remaining layer (keyed by original index)."""
        missing = [v for v in self.remaining if v not in residual_choice]
        if missing:
            raise OptionError(f"unwinding needs a configuration for every remaining layer (missing: {missing})")
        choice = dict(residual_choice)
        for step in reversed(self.steps):
            if isinstance(step, _Series):
                choice[step.node] = step.arg[choice[step.left]][choice[step.right]]
            else:
                choice[step.node] = step.arg[choice[step.into]]
        return tuple(choice[v] for v in range(self.num_layers))


def _fold_series(a: _Table, mid: Sequence[float], b: _Table) -> tuple[_Table, list[tuple[int, ...]]]:
    """``T[i][k] = min_j a[i][j] + mid[j] + b[j][k]`` and its argmin (the first j on ties)."""
    cols = list(zip(*b))
    table, arg = [], []
    for row in a:
        pre = [x + m for x, m in zip(row, mid)]
        t_row, a_row = [], []
        for col in cols:
            vals = [p + q for p, q in zip(pre, col)]
            best = min(vals)
            t_row.append(best)
            a_row.append(vals.index(best))
        table.append(t_row)
        arg.append(tuple(a_row))
    return table, arg


def _fold_leaf(a: _Table, leaf: Sequence[float]) -> tuple[list[float], tuple[int, ...]]:
    """``add[i] = min_j a[i][j] + leaf[j]`` and its argmin."""
    add, arg = [], []
    for row in a:
        vals = [x + m for x, m in zip(row, leaf)]
        best = min(vals)
        add.append(best)
        arg.append(vals.index(best))
    return add, tuple(arg)


def _transpose(t: _Table) -> _Table:
    return [list(col) for col in zip(*t)]


def eliminate(graph: LayerGraph, *, strict: bool = False) -> Reduction:
    """Apply edge, node and (unless ``strict``) leaf elimination until none applies; see the module docstring.

    ``strict=True`` removes only layers with one in-edge and one out-edge (OptCNN's rule) and folds
    no leaves, so a series-parallel DAG ends at its source and sink.

    >>> chain = cost_graph([[1.0, 2.0]] * 4, [(v, v + 1, [[0.0, 1.0], [1.0, 0.0]]) for v in range(3)])
    >>> eliminate(chain).remaining, eliminate(chain, strict=True).remaining
    ((3,), (0, 3))
    """
    n = len(graph.layers)
    costs: dict[int, list[float]] = {v: [cfg.cost for cfg in layer.configs] for v, layer in enumerate(graph.layers)}
    edges: dict[int, tuple[int, int, _Table]] = {}
    incident: dict[int, set[int]] = {v: set() for v in range(n)}
    between: dict[tuple[int, int], int] = {}
    steps: list[_Series | _Leaf] = []
    next_id = 0

    def add_edge(u: int, v: int, table: _Table) -> None:
        nonlocal next_id
        key = (min(u, v), max(u, v))
        if key in between:  # edge elimination: add the tables, in the existing edge's direction
            eid = between[key]
            eu, ev, old = edges[eid]
            if (eu, ev) != (u, v):
                table = _transpose(table)
            edges[eid] = (eu, ev, [[x + y for x, y in zip(r, s)] for r, s in zip(old, table)])
            return
        eid, next_id = next_id, next_id + 1
        edges[eid] = (u, v, table)
        between[key] = eid
        incident[u].add(eid)
        incident[v].add(eid)

    def remove_edge(eid: int) -> tuple[int, int, _Table]:
        u, v, table = edges.pop(eid)
        del between[(min(u, v), max(u, v))]
        incident[u].discard(eid)
        incident[v].discard(eid)
        return u, v, table

    for e in graph.edges:
        add_edge(e.src, e.dst, [list(row) for row in e.cost])

    def oriented(eid: int, frm: int) -> tuple[int, _Table]:
        """The edge's other end and its table with ``frm``'s configurations as rows."""
        u, v, table = edges[eid]
        return (v, table) if u == frm else (u, _transpose(table))

    work = list(range(n))  # a FIFO queue: popped from ``head`` on (planning imports no collections)
    head = 0
    queued = set(work)
    while head < len(work):
        j = work[head]
        head += 1
        queued.discard(j)
        if j not in costs:
            continue
        eids = sorted(incident[j])
        if strict:
            ins = [e for e in eids if edges[e][1] == j]
            if len(eids) != 2 or len(ins) != 1:
                continue
            eids = [ins[0], next(e for e in eids if e != ins[0])]
        if len(eids) == 2:
            i, a = oriented(eids[0], j)  # a[cj][ci]
            k, b = oriented(eids[1], j)  # b[cj][ck]
            remove_edge(eids[0])
            remove_edge(eids[1])
            table, arg = _fold_series(_transpose(a), costs.pop(j), b)
            steps.append(_Series(j, i, k, tuple(arg)))
            add_edge(i, k, table)
            touched = [i, k]
        elif len(eids) == 1 and not strict:
            i, a = oriented(eids[0], j)
            remove_edge(eids[0])
            add, arg1 = _fold_leaf(_transpose(a), costs.pop(j))
            costs[i] = [x + y for x, y in zip(costs[i], add)]
            steps.append(_Leaf(j, i, arg1))
            touched = [i]
        else:
            continue
        for t in touched:
            if t not in queued:
                work.append(t)
                queued.add(t)

    remaining = tuple(sorted(costs))
    left = tuple(Edge(u, v, tuple(tuple(r) for r in t)) for u, v, t in (edges[e] for e in sorted(edges)))
    return Reduction(n, remaining, {v: tuple(costs[v]) for v in remaining}, left, tuple(steps))


# --- exhaustive search ------------------------------------------------------------------------


def _exhaustive(sizes: Sequence[int], node_costs: Sequence[Sequence[float]],
                edges: Sequence[tuple[int, int, Sequence[Sequence[float]]]]) -> tuple[float, list[int]]:
    """The least-cost assignment by trying every one (depth first, the last layer's choice vectorised)."""
    n = len(sizes)
    if n == 0:
        return 0.0, []
    # back[k]: the edges from layer k to layers before it, as (earlier, table with earlier's configs as rows)
    back: list[list[tuple[int, Sequence[Sequence[float]]]]] = [[] for _ in range(n)]
    for u, v, t in edges:
        if u < v:
            back[v].append((u, t))
        else:
            back[u].append((v, [list(col) for col in zip(*t)]))
    best_cost = math.inf
    best: list[int] = []
    assign = [0] * n

    def step_costs(k: int) -> list[float]:
        vals = list(node_costs[k])
        for u, t in back[k]:
            row = t[assign[u]]
            vals = [x + y for x, y in zip(vals, row)]
        return vals

    def visit(k: int, partial: float) -> None:
        nonlocal best_cost, best
        vals = step_costs(k)
        if k == n - 1:
            low = min(vals)
            if partial + low < best_cost:
                best_cost = partial + low
                assign[k] = vals.index(low)
                best = list(assign)
            return
        for c, x in enumerate(vals):
            assign[k] = c
            visit(k + 1, partial + x)

    visit(0, 0.0)
    return best_cost, best


def _count(sizes: Sequence[int]) -> int:
    return math.prod(sizes)


def solve_brute_force(graph: LayerGraph, *, limit: int = BRUTE_FORCE_LIMIT) -> Strategy:
    """The least-cost strategy by trying every one (tests, small graphs); refuses above ``limit`` strategies.

    >>> solve_brute_force(cost_graph([[1.0, 2.0], [3.0]], [(0, 1, [[5.0], [0.0]])])).choice
    (1, 0)
    """
    sizes = [len(layer.configs) for layer in graph.layers]
    if _count(sizes) > limit:
        raise OptionError(f"brute force would try {_count(sizes)} strategies (limit: {limit}); "
                          "use solve() or solve_ilp()")
    _, choice = _exhaustive(sizes, [[cfg.cost for cfg in layer.configs] for layer in graph.layers],
                            [(e.src, e.dst, e.cost) for e in graph.edges])
    return Strategy(tuple(choice), strategy_cost(graph, choice), "brute-force", len(graph.layers))


def _components(nodes: Sequence[int], edges: Sequence[Edge]) -> list[list[int]]:
    parent = {v: v for v in nodes}

    def find(v: int) -> int:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for e in edges:
        parent[find(e.src)] = find(e.dst)
    groups: dict[int, list[int]] = {}
    for v in nodes:
        groups.setdefault(find(v), []).append(v)
    return list(groups.values())


# --- the ILP (HiGHS) --------------------------------------------------------------------------


def _ilp(sizes: Sequence[int], node_costs: Sequence[Sequence[float]],
         edges: Sequence[tuple[int, int, Sequence[Sequence[float]]]], time_limit: float | None) -> list[int]:
    """Solve min sum x.cost + sum y.table with HiGHS; returns each layer's configuration.

    Variables: binary x[v,c] (layer v runs c), continuous y[e,a,b] in [0, 1] (edge e's ends run a, b).
    Rows: sum_c x[v,c] = 1; for each edge and each a: sum_b y[e,a,b] = x[src,a]; for each b:
    sum_a y[e,a,b] = x[dst,b]. With x integral these force y[e,a,b] = x[src,a] x[dst,b] exactly
    (the marginal form of the product linearisation, tighter than y >= x + x' - 1).
    """
    try:  # optional (the strategies extra), imported only here, when a graph needs the ILP
        import highspy
        import numpy as np
    except ImportError:
        raise OptionError(f"this layer graph does not reduce by elimination and its residue is too large to enumerate, "
                          f"so it needs the ILP solver HiGHS, which is not installed; {_INSTALL}") from None

    x_col: list[int] = []  # first column of layer v's x
    col = 0
    for s in sizes:
        x_col.append(col)
        col += s
    num_x = col
    y_col, e_row = [], []
    row = len(sizes)
    for u, v, _ in edges:
        y_col.append(col)
        col += sizes[u] * sizes[v]
        e_row.append(row)
        row += sizes[u] + sizes[v]
    num_col, num_row = col, row

    # column-wise matrix: each x column's rows, then each y column's two rows
    x_rows: list[list[tuple[int, float]]] = [[] for _ in range(num_x)]
    for v, s in enumerate(sizes):
        for c in range(s):
            x_rows[x_col[v] + c].append((v, 1.0))
    for e, (u, v, _) in enumerate(edges):
        for a in range(sizes[u]):
            x_rows[x_col[u] + a].append((e_row[e] + a, -1.0))
        for b in range(sizes[v]):
            x_rows[x_col[v] + b].append((e_row[e] + sizes[u] + b, -1.0))
    start, index, value, cost = [0], list[int](), list[float](), list[float]()
    for v in range(len(sizes)):
        cost.extend(node_costs[v])
    for entries in x_rows:
        for r, coef in entries:
            index.append(r)
            value.append(coef)
        start.append(len(index))
    for e, (u, v, table) in enumerate(edges):
        for a in range(sizes[u]):
            for b in range(sizes[v]):
                cost.append(table[a][b])
                index.extend((e_row[e] + a, e_row[e] + sizes[u] + b))
                value.extend((1.0, 1.0))
                start.append(len(index))

    lp: Any = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = num_col, num_row
    lp.col_cost_ = np.array(cost, dtype=np.float64)
    lp.col_lower_ = np.zeros(num_col)
    lp.col_upper_ = np.ones(num_col)
    rhs = np.zeros(num_row)
    rhs[: len(sizes)] = 1.0
    lp.row_lower_, lp.row_upper_ = rhs, rhs.copy()
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = num_col, num_row
    lp.a_matrix_.start_ = np.array(start, dtype=np.int32)
    lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(value, dtype=np.float64)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * num_x + [highspy.HighsVarType.kContinuous] * (num_col - num_x)

    h = highspy.Highs()  # type: ignore[no-untyped-call]  # highspy's stub leaves Highs.__init__ unannotated
    h.setOptionValue("output_flag", False)
    h.setOptionValue("mip_rel_gap", 0.0)  # the defaults (1e-4 relative, 1e-6 absolute) would stop short of exact
    h.setOptionValue("mip_abs_gap", 0.0)
    if time_limit is not None:
        h.setOptionValue("time_limit", float(time_limit))
    h.passModel(lp)
    h.run()
    status = h.getModelStatus()
    if status != highspy.HighsModelStatus.kOptimal:
        raise OptionError(f"HiGHS did not prove an optimal strategy (status: {h.modelStatusToString(status)}); "
                          "raise time_limit or shrink the graph")
    x = h.getSolution().col_value
    return [max(range(s), key=lambda c: x[x_col[v] + c]) for v, s in enumerate(sizes)]


def solve_ilp(graph: LayerGraph, *, memory_cap: float | None = None, time_limit: float | None = None) -> Strategy:
    """The least-cost strategy of the whole graph from an ILP solved by HiGHS (``highspy``, imported here).

    Exact on any graph; the cross-check of ``solve`` on large ones. Raises ``OptionError`` when
    highspy is missing, or HiGHS proves no optimum within ``time_limit`` seconds.
    """
    capped: LayerGraph = graph
    kept: tuple[tuple[int, ...], ...] | None = None
    if memory_cap is not None:
        capped, kept = apply_memory_cap(graph, memory_cap)
    sizes = [len(layer.configs) for layer in capped.layers]
    choice = _ilp(sizes, [[cfg.cost for cfg in layer.configs] for layer in capped.layers],
                  [(e.src, e.dst, e.cost) for e in capped.edges], time_limit)
    if kept is not None:
        choice = [kept[v][c] for v, c in enumerate(choice)]
    return Strategy(tuple(choice), strategy_cost(graph, choice), "ilp", len(graph.layers))


# --- the search -------------------------------------------------------------------------------


def solve(graph: LayerGraph, *, memory_cap: float | None = None, strict: bool = False,
          enumerate_limit: int = ENUMERATE_LIMIT, time_limit: float | None = None) -> Strategy:
    """The least-cost strategy: drop configurations over ``memory_cap``, eliminate, solve the residue, unwind.

    Each connected piece of the residue is enumerated when it has at most ``enumerate_limit``
    strategies, else solved by ``solve_ilp``'s ILP (HiGHS; without highspy, an ``OptionError``
    naming ``pip install -c constraints.txt -e '.[strategies]'``). ``Strategy.choice`` indexes the original
    configurations, also under a cap; ``Strategy.remaining`` counts the layers elimination left.

    >>> block = cost_graph([[1.0, 0.0], [0.0, 3.0], [2.0, 2.0], [0.0, 1.0]],
    ...                    [(0, 1, [[0.0, 1.0]] * 2), (1, 3, [[0.0, 0.0]] * 2), (0, 2, [[1.0, 0.0]] * 2),
    ...                     (2, 3, [[0.0, 0.0]] * 2), (0, 3, [[0.0, 0.0]] * 2)])
    >>> s = solve(block)
    >>> s.choice, s.cost, s.method, s.remaining
    ((1, 0, 1, 0), 2.0, 'elimination', 1)
    """
    capped: LayerGraph = graph
    kept: tuple[tuple[int, ...], ...] | None = None
    if memory_cap is not None:
        capped, kept = apply_memory_cap(graph, memory_cap)
    reduction = eliminate(capped, strict=strict)
    residual: dict[int, int] = {}
    used_ilp = False
    for comp in _components(reduction.remaining, reduction.edges):
        members = set(comp)
        sizes = [len(reduction.node_costs[v]) for v in comp]
        local = {v: i for i, v in enumerate(comp)}
        costs = [reduction.node_costs[v] for v in comp]
        edges = [(local[e.src], local[e.dst], e.cost) for e in reduction.edges if e.src in members]
        if _count(sizes) <= enumerate_limit:
            _, picked = _exhaustive(sizes, costs, edges)
        else:
            picked = _ilp(sizes, costs, edges, time_limit)
            used_ilp = True
        residual.update(zip(comp, picked))
    choice = list(reduction.unwind(residual))
    if kept is not None:
        choice = [kept[v][c] for v, c in enumerate(choice)]
    method = "elimination+ilp" if used_ilp else "elimination"
    return Strategy(tuple(choice), strategy_cost(graph, choice), method, len(reduction.remaining))


# --- configurations and costs from plain numbers ----------------------------------------------


@dataclass(frozen=True)
class LayerSpec:
    """What ``layer_configs`` needs to know about a layer, for the whole batch on one rank.

    ``seconds``: its forward + backward (B + W) time; ``param_bytes``: its trainable parameters;
    ``out_bytes``: its output tensor (what its out-edges carry); ``saved_bytes``: the activations it
    keeps for backward; ``kind``: one of ``KINDS``; ``spatial``: it has a height to split (conv, pool);
    ``bias_bytes``: the part of ``param_bytes`` a matmul adds to its output (split over its columns
    only: a row-split layer keeps the whole bias on each rank); ``stat_bytes``: statistics over the
    batch it all-reduces once forward and once backward when the batch is split (BatchNorm: the
    sums of x and x² per channel, then of dy and dy·x̂); ``fixed_seconds``: compute a rank pays whatever the
    configuration (a convolution's per-call time at any size), added to ``seconds / degrees``.
    """

    name: str
    seconds: float = 0.0
    param_bytes: float = 0.0
    out_bytes: float = 0.0
    saved_bytes: float = 0.0
    kind: str = "matmul"
    spatial: bool = False
    bias_bytes: float = 0.0
    stat_bytes: float = 0.0
    shape: tuple[int, ...] = ()  # its output's shape (batch, channels, height, ...); () when unknown
    in_features: int = 0  # a matmul's input features or channels (what a row split divides); 0 when unknown
    fixed_seconds: float = 0.0  # per step whatever the split (a convolution's per-call time): not divided by degrees

    def splits(self, degrees: Degrees) -> bool:
        """Whether ``degrees`` divide this layer's dims evenly: batch by sample, channels by column, height by
        spatial, input features by row (a dim of unknown size takes any degree).

        >>> LayerSpec("x", shape=(2, 3)).splits(Degrees(sample=4))
        False
        >>> LayerSpec("x", shape=(8, 3)).splits(Degrees(sample=4))
        True
        """
        sizes = (*self.shape, 0, 0, 0)
        return all(size == 0 or size % degree == 0 for size, degree in ((sizes[0], degrees.sample),
                   (sizes[1], degrees.column), (sizes[2], degrees.spatial), (self.in_features, degrees.row)))


@dataclass(frozen=True)
class HostCosts:
    """What a strategy runtime costs the host per step beyond compute and the link, in seconds (measured on the
    ranks that run it: ``benchmarks/strategy_measured.py``'s probe; all zero: the bare FLOP/byte model).

    ``node``: each layer but the input and the loss, forward and backward, whatever its configuration (the
    runtime's Python, ``to_local`` / ``from_local``, DTensor's autograd); ``params``: more for a layer with
    parameters (DTensor parameters, their gradient placements, the optimizer's step per tensor);
    ``collective``: each redistribute that moves data and each BatchNorm statistics all-reduce, beyond the
    link's ``steps x latency + bytes / bandwidth`` (DTensor's redistribute, the ranks meeting mid-step);
    ``sync``: each gradient all-reduce after backward, beyond the link's (issued together, waited together);
    ``step``: once per step (the loss, its all-reduce, ``zero_grad``), charged to the ``loss`` layer.

    >>> HostCosts(node=1e-4).layer(LayerSpec("fc", param_bytes=8.0))
    0.0001
    >>> HostCosts(node=1e-4).layer(LayerSpec("x", kind="input"))
    0.0
    """

    node: float = 0.0
    params: float = 0.0
    collective: float = 0.0
    sync: float = 0.0
    step: float = 0.0

    def layer(self, spec: LayerSpec) -> float:
        """Seconds ``spec``'s layer costs the host per step in any configuration."""
        if spec.kind == "input":
            return 0.0
        if spec.kind == "loss":
            return self.step
        return self.node + (self.params if spec.param_bytes > 0 else 0.0)


NO_HOST = HostCosts()


@dataclass(frozen=True)
class Layout:
    """Which block of a tensor each rank holds: the batch, channel and height dims split these many
    ways, and (held tensors only) a sum still pending over ``partial`` ranks."""

    batch: int = 1
    channel: int = 1
    height: int = 1
    partial: int = 1

    @property
    def splits(self) -> tuple[int, int, int]:
        return (self.batch, self.channel, self.height)


@dataclass(frozen=True)
class Transfer:
    """Bytes one rank receives, and its ring steps (each pays the link's latency once)."""

    nbytes: float
    steps: int

    def seconds(self, *, bandwidth: float, latency: float) -> float:
        return self.steps * latency + self.nbytes / bandwidth


def transfer(held: Layout, needed: Layout, nbytes: float, *, alltoall: bool = True) -> Transfer:
    """What redistributing a tensor of ``nbytes`` from ``held`` to ``needed`` costs one rank (see the module's table).

    ``alltoall=False``: the backend has no all-to-all (gloo), so moving a split from one dim to
    another all-gathers the block the ranks share and keeps its part, as DTensor does there: a rank
    receives everything of the block split ``min(held, needed)`` ways per dim that it does not hold.

    >>> transfer(Layout(batch=2), Layout(), 100.0)            # all-gather over 2
    Transfer(nbytes=50.0, steps=1)
    >>> transfer(Layout(partial=2), Layout(), 100.0)          # all-reduce over 2
    Transfer(nbytes=100.0, steps=2)
    >>> transfer(Layout(channel=2), Layout(channel=2), 100.0)  # already in place
    Transfer(nbytes=0.0, steps=0)
    """
    if needed.partial != 1:
        raise OptionError(f"a layer reads whole values, not partial sums (needed: {needed})")

    def gather(splits: Sequence[int]) -> Transfer:
        if not alltoall:
            coarse = math.prod(min(a, b) for a, b in zip(splits, needed.splits))
            held_block = nbytes / math.prod(splits)
            pieces = math.prod(splits) // coarse
            return Transfer(nbytes / coarse - held_block, max(0, pieces - 1))
        need = nbytes / math.prod(needed.splits)
        finest = math.prod(max(a, b) for a, b in zip(splits, needed.splits))
        pieces = finest // math.prod(needed.splits)
        return Transfer(need - nbytes / finest, max(0, pieces - 1))

    g = held.partial
    if g == 1:
        return gather(held.splits)
    region = nbytes / math.prod(held.splits)
    reduce = Transfer((g - 1) / g * region, g - 1)
    options = []
    for dim in range(3):  # the reduce-scatter splits one dim g ways further: the one that leaves least to fetch
        splits = list(held.splits)
        splits[dim] *= g
        options.append(gather(splits))
    rest = min(options, key=lambda t: (t.nbytes, t.steps))
    return Transfer(reduce.nbytes + rest.nbytes, reduce.steps + rest.steps)


def layouts(kind: str, d: Degrees) -> tuple[Layout, Layout, Layout, Layout]:
    """A layer's (input needed, output held, input gradient held, output gradient needed), per the module's table.

    >>> layouts("matmul", Degrees(column=2))[:2]
    (Layout(batch=1, channel=1, height=1, partial=1), Layout(batch=1, channel=2, height=1, partial=1))
    """
    if kind == "matmul":
        return (Layout(d.sample, d.row, d.spatial), Layout(d.sample, d.column, d.spatial, d.row),
                Layout(d.sample, d.row, d.spatial, d.column), Layout(d.sample, d.column, d.spatial))
    if kind in ("elementwise", "input", "loss"):
        same = Layout(d.sample, d.column, d.spatial)
        return same, same, same, same
    raise OptionError(f"unknown layer kind {kind!r} (known: {', '.join(KINDS)})")


def edge_transfers(src: LayerSpec, src_degrees: Degrees, dst: LayerSpec, dst_degrees: Degrees, *,
                   nbytes: float | None = None, alltoall: bool = True) -> tuple[Transfer, Transfer]:
    """The forward (``src``'s output to ``dst``'s input) and backward (the gradient back) transfers of one edge.
    A model input needs no gradient; a stage's received input (``stage_graph``'s ``:recv`` layer) does: it goes
    back to the previous stage split as it came."""
    size = src.out_bytes if nbytes is None else nbytes
    _, out_held, _, out_grad_needed = layouts(src.kind, src_degrees)
    in_needed, _, in_grad_held, _ = layouts(dst.kind, dst_degrees)
    forward = transfer(out_held, in_needed, size, alltoall=alltoall)
    if src.kind == "input" and not src.name.endswith(":recv"):
        return forward, Transfer(0.0, 0)
    return forward, transfer(in_grad_held, out_grad_needed, size, alltoall=alltoall)


def edge_seconds(src: LayerSpec, src_degrees: Degrees, dst: LayerSpec, dst_degrees: Degrees, *,
                 bandwidth: float, latency: float, nbytes: float | None = None, alltoall: bool = True) -> float:
    """Seconds to move ``src``'s output (``nbytes``, default ``src.out_bytes``) to ``dst`` and its gradient back.

    >>> mlp = LayerSpec("fc", out_bytes=100.0)
    >>> edge_seconds(mlp, Degrees(column=2), mlp, Degrees(row=2), bandwidth=10.0, latency=1.0)   # Megatron
    0.0
    >>> edge_seconds(mlp, Degrees(row=2), mlp, Degrees(column=2), bandwidth=10.0, latency=1.0)   # all-reduce x 2
    24.0
    """
    forward, backward = edge_transfers(src, src_degrees, dst, dst_degrees, nbytes=nbytes, alltoall=alltoall)
    return (forward.seconds(bandwidth=bandwidth, latency=latency)
            + backward.seconds(bandwidth=bandwidth, latency=latency))


def _factorisations(n: int, parts: int) -> list[tuple[int, ...]]:
    """Ordered ways to write n as a product of ``parts`` positive integers."""
    if parts == 1:
        return [(n,)]
    return [(f, *rest) for f in range(1, n + 1) if n % f == 0 for rest in _factorisations(n // f, parts - 1)]


def config_degrees(ranks: int, *, kind: str = "matmul", spatial: bool = False,
                   divisors: bool = False) -> tuple[Degrees, ...]:
    """The degrees a layer of ``kind`` may take on ``ranks`` ranks: products equal to ``ranks``
    (or, with ``divisors``, dividing it). Row splits only for matmuls, spatial only with ``spatial``,
    a model input only over the batch.

    >>> [d.name for d in config_degrees(2)]
    ['s2', 'c2', 'r2']
    """
    if ranks < 1:
        raise OptionError(f"a layer needs at least 1 rank (ranks: {ranks})")
    if kind not in KINDS:
        raise OptionError(f"unknown layer kind {kind!r} (known: {', '.join(KINDS)})")
    totals = [t for t in range(1, ranks + 1) if ranks % t == 0] if divisors else [ranks]
    out: list[Degrees] = []
    for total in sorted(totals, reverse=True):
        for s, c, r, h in _factorisations(total, 4):
            if (kind in ("input", "loss") and (c, r, h) != (1, 1, 1)) or (kind == "elementwise" and r != 1) \
                    or (not spatial and h != 1):
                continue
            out.append(Degrees(s, c, r, h))
    return tuple(sorted(out, key=lambda d: (-d.product, -d.sample, -d.column, -d.row, -d.spatial)))


def layer_configs(spec: LayerSpec, ranks: int, *, bandwidth: float, latency: float, optimizer: str = "sgd",
                  divisors: bool = False, spatial: bool = True, host: HostCosts = NO_HOST,
                  bucket_layers: bool = False) -> tuple[Config, ...]:
    """The configurations of one layer on ``ranks`` ranks with their compute, sync and memory (module docstring);
    ``host``'s per-layer cost and ``spec.fixed_seconds`` join the compute, its per-collective costs the sync.

    >>> fc = LayerSpec("fc", seconds=1.0, param_bytes=100.0, saved_bytes=40.0)
    >>> [(c.name, c.compute, c.sync, c.memory) for c in layer_configs(fc, 2, bandwidth=10.0, latency=0.5)]
    [('s2', 0.5, 11.0, 220.0), ('c2', 0.5, 0.0, 140.0), ('r2', 0.5, 0.0, 120.0)]
    """
    configs = []
    for d in config_degrees(ranks, kind=spec.kind, spatial=spec.spatial and spatial, divisors=divisors):
        if not spec.splits(d):  # DTensor would shard unevenly, and a rank could get no rows at all
            continue
        sync = sync_seconds(spec, d, bandwidth=bandwidth, latency=latency, host=host, bucket_layers=bucket_layers)
        compute = spec.seconds / d.product + spec.fixed_seconds + host.layer(spec)
        configs.append(Config(d.name, compute, sync, layer_memory(spec, d, optimizer).total, d))
    return tuple(configs)


def local_param_bytes(spec: LayerSpec, degrees: Degrees) -> float:
    """A rank's share of ``spec``'s parameters: a matmul's weight split over columns x rows, its bias
    over columns only; an elementwise layer's (BatchNorm's) over columns.

    >>> local_param_bytes(LayerSpec("fc", param_bytes=104.0, bias_bytes=4.0), Degrees(row=2))
    54.0
    """
    if spec.kind == "matmul":
        return (spec.param_bytes - spec.bias_bytes) / (degrees.column * degrees.row) + spec.bias_bytes / degrees.column
    return spec.param_bytes / degrees.column


def sync_collectives(spec: LayerSpec, degrees: Degrees) -> tuple[tuple[float, int], ...]:
    """The all-reduces a layer issues itself, as ``(bytes, ranks)``: its parameters' gradients (a rank's
    share, in ``BUCKET_BYTES`` buckets) over the ``sample x spatial`` ranks that hold the same share,
    and, for ``stat_bytes``, the batch statistics once forward and once backward over the same ranks.

    >>> sync_collectives(LayerSpec("bn", param_bytes=16.0, stat_bytes=16.0, kind="elementwise"), Degrees(sample=2))
    ((16.0, 2), (16.0, 2), (16.0, 2))
    """
    g = degrees.sample * degrees.spatial
    if g == 1:
        return ()
    out = [(b, g) for b in allreduce_buckets(local_param_bytes(spec, degrees))]
    if spec.stat_bytes:
        out += [(spec.stat_bytes / degrees.column, g)] * 2
    return tuple(out)


def traffic_per_layer(specs: Sequence[LayerSpec], edges: Sequence[tuple[int, int]], degrees: Sequence[Degrees], *,
                      alltoall: bool = True) -> tuple[float, ...]:
    """Bytes one rank receives per step for each layer: its in-edges' transfers (forward and backward) and its
    ``sync_collectives`` (a ring all-reduce of b bytes over g ranks receives ``2(g-1)/g x b``).

    >>> specs = [LayerSpec("x", kind="input", out_bytes=64.0), LayerSpec("fc", param_bytes=8.0, out_bytes=16.0)]
    >>> traffic_per_layer(specs, [(0, 1)], [Degrees(sample=2), Degrees(column=2)])
    (0.0, 32.0)
    """
    out = [0.0] * len(specs)
    for u, v in edges:
        fwd, bwd = edge_transfers(specs[u], degrees[u], specs[v], degrees[v], alltoall=alltoall)
        out[v] += fwd.nbytes + bwd.nbytes
    for v, (spec, d) in enumerate(zip(specs, degrees)):
        out[v] += math.fsum(2 * (g - 1) / g * b for b, g in sync_collectives(spec, d))
    return tuple(out)


def stage_graph(specs: Sequence[LayerSpec], edges: Sequence[tuple[int, int]], lo: int, hi: int) -> tuple[
        tuple[LayerSpec, ...], tuple[tuple[int, int], ...], tuple[int, ...]]:
    """Layers ``lo .. hi-1`` (topological order) as a pipeline stage's own graph: ``(specs, edges, index)``.

    A stage after the first starts with an ``input`` layer (the tensor layer ``lo - 1`` sends, split over
    the batch on every rank of the group); a stage before the last ends with a ``loss``-kind layer
    (what it sends on, split the same way). ``index[i]``: the original layer of the stage's i-th, -1 for
    those two. Only one tensor may cross a cut: every edge into the stage comes from layer ``lo - 1``,
    every edge out of it leaves from ``hi - 1``.

    >>> chain = [LayerSpec("x", kind="input", out_bytes=8.0), LayerSpec("a", out_bytes=4.0), LayerSpec("b")]
    >>> [s.kind for s in stage_graph(chain, [(0, 1), (1, 2)], 2, 3)[0]], stage_graph(chain, [(0, 1), (1, 2)], 2, 3)[2]
    (['input', 'matmul'], (-1, 2))
    """
    n = len(specs)
    if not 0 <= lo < hi <= n:
        raise OptionError(f"a stage is a non-empty range of the {n} layers (given {lo}..{hi - 1})")
    for u, v in edges:
        if u < lo <= v and u != lo - 1:
            raise OptionError(f"cutting before layer {lo} ({specs[lo].name!r}) cuts {specs[u].name!r} -> "
                              f"{specs[v].name!r} too: cut where one tensor crosses")
        if u < hi <= v and u != hi - 1:
            raise OptionError(f"cutting after layer {hi - 1} ({specs[hi - 1].name!r}) cuts {specs[u].name!r} -> "
                              f"{specs[v].name!r} too: cut where one tensor crosses")
    index = ([-1] if lo > 0 else []) + list(range(lo, hi)) + ([-1] if hi < n else [])
    where = {orig: i for i, orig in enumerate(index) if orig >= 0}
    out = []
    if lo > 0:
        out.append(LayerSpec(f"{specs[lo - 1].name}:recv", out_bytes=specs[lo - 1].out_bytes, kind="input"))
    out += list(specs[lo:hi])
    if hi < n:
        out.append(LayerSpec(f"{specs[hi - 1].name}:send", kind="loss"))
    sub = []
    for u, v in edges:
        if lo <= u < hi and lo <= v < hi:
            sub.append((where[u], where[v]))
        elif u == lo - 1 and lo <= v < hi:
            sub.append((0, where[v]))
        elif u == hi - 1 and v >= hi and (where[u], len(out) - 1) not in sub:
            sub.append((where[u], len(out) - 1))
    return tuple(out), tuple(sub), tuple(index)


def sync_seconds(spec: LayerSpec, degrees: Degrees, *, bandwidth: float, latency: float,
                 host: HostCosts = NO_HOST, bucket_layers: bool = False) -> float:
    """Seconds of ``sync_collectives``, each a ring all-reduce (``allreduce_seconds``) plus ``host.sync`` per
    gradient bucket and ``host.collective`` per statistics all-reduce (those wait mid-step).

    ``bucket_layers`` (the runtime's ``StrategyRuntime(bucket_layers=True)``: one buffer per sync group over all
    its layers, in ``BUCKET_BYTES`` buckets): the gradients' bytes as before, and a bucket's latency and
    ``host.sync`` shared by its bytes, ``b / BUCKET_BYTES`` of them to this layer. Summed over a group's
    layers that is ``total / BUCKET_BYTES`` buckets where the runtime issues ``ceil(total / BUCKET_BYTES)``:
    under by less than one bucket's latency per group and step (per layer, the search cannot see a ceiling).

    >>> bn = LayerSpec("bn", param_bytes=16.0, stat_bytes=16.0, kind="elementwise")
    >>> sync_seconds(bn, Degrees(sample=2), bandwidth=16.0, latency=0.0, host=HostCosts(collective=1.0, sync=10.0))
    15.0
    """
    collectives = sync_collectives(spec, degrees)
    stats = 2 if spec.stat_bytes and collectives else 0
    grads, rest = collectives[:len(collectives) - stats], collectives[len(collectives) - stats:]
    total = stats * host.collective + math.fsum(allreduce_seconds(b, g, bandwidth, latency) for b, g in rest)
    if not bucket_layers:
        return total + len(grads) * host.sync + math.fsum(allreduce_seconds(b, g, bandwidth, latency)
                                                          for b, g in grads)
    return total + math.fsum(2 * (g - 1) / g * b / bandwidth + (2 * (g - 1) * latency + host.sync) * b / BUCKET_BYTES
                             for b, g in grads)


def build_graph(specs: Sequence[LayerSpec], edges: Sequence[tuple[int, int]], ranks: int, *, bandwidth: float,
                latency: float, optimizer: str = "sgd", alltoall: bool = True, spatial: bool = True,
                host: HostCosts = NO_HOST, bucket_layers: bool = False) -> LayerGraph:
    """The layer graph of ``specs`` joined by ``(src, dst)`` edges on ``ranks`` ranks: every layer's
    configurations and every edge's table of ``edge_seconds`` (``alltoall=False`` for a backend without
    all-to-all, gloo; ``spatial=False``: no height splits, which the DTensor runtime does not run);
    ``host``: the runtime's costs per layer and per collective (``HostCosts``; an edge pays
    ``host.collective`` for each direction that moves data); ``bucket_layers``: gradients synced in buckets over
    layers (``sync_seconds``).

    >>> specs = [LayerSpec("x", kind="input", out_bytes=64.0), LayerSpec("fc", seconds=1.0, param_bytes=8.0)]
    >>> g = build_graph(specs, [(0, 1)], 2, bandwidth=1.0, latency=0.0)
    >>> [c.name for c in g.layers[1].configs], g.edges[0].cost
    (['s2', 'c2', 'r2'], ((0.0, 32.0, 16.0),))
    """
    configs = [layer_configs(s, ranks, bandwidth=bandwidth, latency=latency, optimizer=optimizer, spatial=spatial,
                             host=host, bucket_layers=bucket_layers) for s in specs]
    for spec, options in zip(specs, configs):
        if not options:
            dims = "x".join(map(str, spec.shape)) or "?"
            raise OptionError(f"layer {spec.name!r} (output {dims}) has no even split over {ranks} ranks: its batch of "
                              f"{spec.shape[0] if spec.shape else '?'} rows must be a multiple of {ranks} for a "
                              f"{spec.kind} layer; use a batch that {ranks} divides (--batch-size)")
    layers = tuple(Layer(s.name, c) for s, c in zip(specs, configs))
    out = []
    for u, v in edges:
        if not (0 <= u < len(specs) and 0 <= v < len(specs)):
            raise OptionError(f"edge ({u}, {v}) must join two of the {len(specs)} layers")
        table = tuple(tuple(edge_seconds(specs[u], a.degrees or Degrees(), specs[v], b.degrees or Degrees(),
                                         bandwidth=bandwidth, latency=latency, alltoall=alltoall)
                            + _edge_host(specs[u], a.degrees or Degrees(), specs[v], b.degrees or Degrees(), host,
                                         alltoall)
                               for b in configs[v])
                      for a in configs[u])
        out.append(Edge(u, v, table))
    return LayerGraph(layers, tuple(out))



def _edge_host(src: LayerSpec, src_degrees: Degrees, dst: LayerSpec, dst_degrees: Degrees, host: HostCosts,
               alltoall: bool) -> float:
    """``host.collective`` for each direction of an edge that moves data (one redistribute each)."""
    if not host.collective:
        return 0.0
    moves = edge_transfers(src, src_degrees, dst, dst_degrees, alltoall=alltoall)
    return host.collective * sum(1 for t in moves if t.steps > 0 or t.nbytes > 0)


# --- preset strategies and the per-layer table ---------------------------------------------------


def _find(graph: LayerGraph, v: int, degrees: Degrees) -> int:
    for c, cfg in enumerate(graph.layers[v].configs):
        if cfg.degrees == degrees:
            return c
    names = ", ".join(cfg.name for cfg in graph.layers[v].configs)
    raise OptionError(f"layer {v} ({graph.layers[v].name!r}) has no configuration {degrees.name} (it has: {names}); "
                      "build the graph with build_graph on a rank count the preset divides")


def _ranks(graph: LayerGraph) -> int:
    products = {cfg.degrees.product for layer in graph.layers for cfg in layer.configs if cfg.degrees is not None}
    if not products:
        raise OptionError("a preset needs a graph from build_graph (configurations with degrees)")
    return max(products)


def _preset(graph: LayerGraph, choice: Sequence[int], method: str) -> Strategy:
    return Strategy(tuple(choice), strategy_cost(graph, choice), method, len(graph.layers))


def data_parallel(graph: LayerGraph) -> Strategy:
    """Pure data parallelism: every layer of a ``build_graph`` graph splits only the batch, over all d ranks.

    >>> specs = [LayerSpec("x", kind="input", out_bytes=64.0), LayerSpec("fc", seconds=1.0, param_bytes=8.0)]
    >>> g = build_graph(specs, [(0, 1)], 2, bandwidth=1.0, latency=0.0)
    >>> data_parallel(g).names(g)
    ('s2', 's2')
    """
    d = _ranks(graph)
    return _preset(graph, [_find(graph, v, Degrees(sample=d)) for v in range(len(graph.layers))], "data-parallel")


def splitbrain(graph: LayerGraph, specs: Sequence[LayerSpec], group: int, *, min_param_bytes: float = 0.0) -> Strategy:
    """SplitBrain (Lai, Kadav and Kruus): convolutions and parameter-free layers data-parallel over all d ranks;
    fully-connected layers (``matmul`` kind, not ``spatial``, more than ``min_param_bytes`` of
    parameters) sharded over groups of ``group`` ranks and data-parallel across the d/group groups.

    Consecutive sharded layers alternate column then row (Megatron's pair: nothing moves between
    them; elementwise layers between the two keep the column layout); a lone or odd one is
    column-sharded. ``group`` must divide d.

    >>> specs = [LayerSpec("x", kind="input", out_bytes=64.0), LayerSpec("conv", seconds=1.0, param_bytes=8.0,
    ...          spatial=True), LayerSpec("fc1", seconds=1.0, param_bytes=80.0), LayerSpec("fc2", param_bytes=80.0)]
    >>> g = build_graph(specs, [(0, 1), (1, 2), (2, 3)], 4, bandwidth=1.0, latency=0.0)
    >>> splitbrain(g, specs, 2).names(g)
    ('s4', 's4', 's2c2', 's2r2')
    """
    d = _ranks(graph)
    if len(specs) != len(graph.layers):
        raise OptionError(f"splitbrain needs one spec per layer (layers: {len(graph.layers)}, specs: {len(specs)})")
    if group < 1 or d % group:
        raise OptionError(f"the SplitBrain group ({group}) must divide the ranks ({d})")
    choice = []
    previous_column = False
    for v, spec in enumerate(specs):
        fc = spec.kind == "matmul" and not spec.spatial and spec.param_bytes > min_param_bytes and group > 1
        if not fc and previous_column and spec.kind == "elementwise":
            degrees = Degrees(sample=d // group, column=group)  # ReLU/dropout between the pair keep its layout
        elif not fc:
            degrees, previous_column = Degrees(sample=d), False
        elif previous_column:
            degrees, previous_column = Degrees(sample=d // group, row=group), False
        else:
            degrees, previous_column = Degrees(sample=d // group, column=group), True
        choice.append(_find(graph, v, degrees))
    return _preset(graph, choice, f"splitbrain-{group}")


@dataclass(frozen=True)
class LayerMemory:
    """One rank's bytes for one layer in one configuration: parameters, gradients, optimizer state, saved
    activations."""

    params: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations


def layer_memory(spec: LayerSpec, degrees: Degrees, optimizer: str = "sgd") -> LayerMemory:
    """``layer_configs``'s memory per rank, split into its parts (its sum is the configuration's memory).

    >>> layer_memory(LayerSpec("fc", param_bytes=100.0, saved_bytes=40.0), Degrees(column=2), "momentum")
    LayerMemory(params=50.0, grads=50.0, optimizer=50.0, activations=40.0)
    """
    params = local_param_bytes(spec, degrees)
    state = static_memory(params, optimizer) - 2 * params
    in_split = math.prod(layouts(spec.kind, degrees)[0].splits)
    return LayerMemory(params, params, state, spec.saved_bytes / in_split)


STRATEGY_COLUMNS = ("layer", "config", "compute_s", "sync_s", "transfer_in_s", "memory_bytes")


@dataclass(frozen=True)
class StrategyTable:
    """``strategy_rows``'s table as plain values (planning imports nothing else; ``fxpipe.report.Report(*table)``
    makes it a report: the same title, columns and rows)."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter((self.title, self.columns, self.rows))


def strategy_rows(graph: LayerGraph, specs: Sequence[LayerSpec] | None, strategy: Strategy) -> StrategyTable:
    """A table of ``strategy`` on ``graph``: per layer its configuration, compute, sync, transfer-in
    seconds (its in-edges' entries, forward and backward) and memory per rank; then a ``total`` row
    (memory: the sum over layers, a rank holds all of them). ``specs`` only names the layers when given.

    >>> g = cost_graph([[1.0, 2.0], [3.0]], [(0, 1, [[5.0], [0.0]])])
    >>> strategy_rows(g, None, solve(g)).rows[-1]
    ('total', '', 5.0, 0.0, 0.0, 0.0)
    """
    if len(strategy.choice) != len(graph.layers):
        raise OptionError(f"the strategy has {len(strategy.choice)} choices for {len(graph.layers)} layers")
    transfer_in = [0.0] * len(graph.layers)
    for e in graph.edges:
        transfer_in[e.dst] += e.cost[strategy.choice[e.src]][strategy.choice[e.dst]]
    rows: list[tuple[str, str, float, float, float, float]] = []
    for v, (layer, c) in enumerate(zip(graph.layers, strategy.choice)):
        cfg = layer.configs[c]
        name = specs[v].name if specs is not None else layer.name
        rows.append((name, cfg.name, cfg.compute, cfg.sync, transfer_in[v], cfg.memory))
    rows.append(("total", "", math.fsum(r[2] for r in rows), math.fsum(r[3] for r in rows),
                 math.fsum(r[4] for r in rows), math.fsum(r[5] for r in rows)))
    return StrategyTable(f"strategy ({strategy.method}): {strategy.cost:.6g} s", STRATEGY_COLUMNS, tuple(rows))
