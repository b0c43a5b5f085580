"""split_stages: one GraphModule per stage that owns its parameters, under a root that calls them in order."""

from __future__ import annotations

import copy
import operator
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx

from fxpipe._compat import pytree
from fxpipe.graphs.fx import COMPUTE_OPS, clone, compute_nodes, get_path, output_node, preserved_buffers, set_path
from fxpipe.meta import get_meta, update_meta
from fxpipe.passes.driver import PassResult
from fxpipe.report import Report


def split_stages(gm: torch.fx.GraphModule) -> PassResult:
    """Build stage GraphModules ``stage_0 .. stage_{P-1}`` and a root graph that chains them.

    Reads: NodeMeta.stage_idx (partition_stages).
    Writes: a new root GraphModule whose only children are the stages. Stage ``k`` takes, as
    placeholders named after them, the values made before it that it reads (model inputs
    and earlier stages' outputs, skip connections included) and returns a tuple of the values
    it makes that a later stage or the model output reads. Each stage owns the parameters and
    buffers it reads, under their original dotted names (shared with the traced model).
    Tied parameters (read by several stages) are held by every stage that reads them, as the
    same Parameter object; ``root.meta["fxpipe_shared_params"]`` lists them, so a runtime that
    puts the stages apart knows to sum their gradients.

        root: %x -> stage_0(%x) -> (%h,)  -> stage_1(%h, %x) -> (%y,) -> output %y
    """
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    num_stages = 1 + max((get_meta(n).stage_idx for n in compute_nodes(gm.graph)), default=0)
    members: dict[int, list[torch.fx.Node]] = defaultdict(list)
    for node in compute_nodes(gm.graph):
        members[get_meta(node).stage_idx].append(node)
    out_node = output_node(gm.graph)

    def stage_of(node: torch.fx.Node) -> int:
        return get_meta(node).stage_idx if node.op in COMPUTE_OPS else -1

    root_graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in nodes:
        if node.op == "placeholder":
            env[node] = root_graph.placeholder(node.name, node.type)
            env[node].meta = copy.copy(node.meta)

    stages: dict[str, torch.nn.Module] = {}
    wiring: list[dict[str, list[str]]] = []
    readers: dict[str, list[int]] = defaultdict(list)
    rows = []
    for k in range(num_stages):
        body = members.get(k, [])
        inputs = sorted(
            {a for n in body for a in n.all_input_nodes
             if a.op == "placeholder" or (a.op in COMPUTE_OPS and stage_of(a) < k)},
            key=order.__getitem__,
        )
        attrs = sorted({a for n in body for a in n.all_input_nodes if a.op == "get_attr"}, key=order.__getitem__)
        outputs = [n for n in body if any(u is out_node or (u.op in COMPUTE_OPS and stage_of(u) > k) for u in n.users)]

        graph = torch.fx.Graph()
        local: dict[torch.fx.Node, torch.fx.Node] = {}
        for value in inputs:
            local[value] = graph.placeholder(value.name)
            local[value].meta = copy.copy(value.meta)
        owner = torch.nn.Module()
        for attr in attrs:
            local[attr] = graph.get_attr(str(attr.target))
            local[attr].meta = copy.copy(attr.meta)
            set_path(owner, str(attr.target), get_path(gm, str(attr.target)))
        for node in body:
            if node.op == "call_module":
                set_path(owner, str(node.target), get_path(gm, str(node.target)))
            local[node] = graph.node_copy(node, local.__getitem__)
        graph.output(tuple(local[v] for v in outputs))
        stage = torch.fx.GraphModule(owner, graph, class_name=f"Stage{k}")
        stage.meta["fxpipe_stage_idx"] = k
        name = f"stage_{k}"
        stages[name] = stage
        for pname, _ in stage.named_parameters(remove_duplicate=False):
            readers[pname].append(k)

        wiring.append({"inputs": [v.name for v in inputs], "outputs": [v.name for v in outputs]})
        call = root_graph.call_module(name, tuple(env[v] for v in inputs))
        for i, value in enumerate(outputs):
            env[value] = root_graph.call_function(operator.getitem, (call, i))
            env[value].meta = copy.copy(value.meta)
        rows.append((k, len(body), len(inputs), len(outputs), sum(1 for _ in stage.parameters()),
                     sum(p.numel() for p in stage.parameters()), sum(1 for _ in stage.buffers())))

    root_graph.output(torch.fx.node.map_arg(out_node.args[0], env.__getitem__))
    root = torch.fx.GraphModule(stages, root_graph, class_name="Pipelined")
    root.meta = dict(getattr(gm, "meta", {}))
    shared = {name: ks for name, ks in readers.items() if len(ks) > 1}
    root.meta["fxpipe_shared_params"] = shared
    leaves, graph_spec = pytree.tree_flatten(out_node.args[0])
    root.meta["fxpipe_wiring"] = {
        "inputs": [n.name for n in nodes if n.op == "placeholder"],
        "stages": wiring,
        "outputs": [leaf.name if isinstance(leaf, torch.fx.Node) else None for leaf in leaves],
        "constants": [None if isinstance(leaf, torch.fx.Node) else leaf for leaf in leaves],
    }
    if root.meta.get("fxpipe_out_spec") is None:
        root.meta["fxpipe_out_spec"] = graph_spec
    root.meta["fxpipe_num_compute_nodes"] = sum(1 for _ in compute_nodes(gm.graph))
    notes = tuple(f"shared parameter {name} is held by stages {ks}: "
                  "its gradient is the sum over them" for name, ks in shared.items())
    report = Report(
        title="split-stages: stage modules",
        columns=("stage", "nodes", "inputs", "outputs", "parameters", "param elements", "buffers"),
        rows=tuple(rows),
        notes=notes,
    )
    return PassResult(root, True, (report,))


def verify_split(root: torch.fx.GraphModule) -> list[str]:
    """The root owns nothing itself, every stage owns what it reads, and no call node was lost."""
    problems = []
    if any(True for _ in root.named_parameters(recurse=False)) or any(True for _ in root.named_buffers(recurse=False)):
        problems.append("the root holds parameters or buffers directly")
    total = 0
    for name, stage in root.named_children():
        if not isinstance(stage, torch.fx.GraphModule):
            problems.append(f"{name} is not a GraphModule")
            continue
        total += sum(1 for _ in compute_nodes(stage.graph))
        for node in stage.graph.nodes:
            if node.op == "get_attr":
                try:
                    get_path(stage, str(node.target))
                except AttributeError:
                    problems.append(f"{name} reads {node.target} but does not own it")
    expected = root.meta.get("fxpipe_num_compute_nodes")
    if expected is not None and total != expected:
        problems.append(f"stages hold {total} call nodes, the model had {expected}: "
                        "every node must be in exactly one stage")
    return problems


def split_by_layer(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The split-stages root with one stage per layer (NodeMeta.layer_idx), for per-layer work."""
    by_layer = clone(gm)
    for node in compute_nodes(by_layer.graph):
        update_meta(node, stage_idx=get_meta(node).layer_idx)
    return split_stages(by_layer).gm


def run_stages(root: torch.fx.GraphModule, example_inputs: Sequence[Any]
               ) -> Iterator[tuple[int, torch.fx.GraphModule, dict[str, list[str]], list[Any], tuple[Any, ...]]]:
    """Run a root's stages in order on the example inputs: (index, stage, wiring, args, outputs) each.

    No autograd, and in-place buffer updates (BatchNorm statistics) are undone after each stage.
    """
    wiring = root.meta["fxpipe_wiring"]
    env: dict[str, Any] = dict(zip(wiring["inputs"], example_inputs))
    for k, w in enumerate(wiring["stages"]):
        stage = getattr(root, f"stage_{k}")
        args = [env[name] for name in w["inputs"]]
        with torch.no_grad(), preserved_buffers(stage):
            outs = tuple(stage(*args))
        yield k, stage, w, args, outs
        env.update(zip(w["outputs"], outs))
