"""A stage's F, B and W graphs as data, and back, so that a plan carries them and a rank loads its own stages'
graphs instead of tracing them again through AOTAutograd.

    {"format": "fxpipe.stage-fbw/v1", "device": "cpu",
     "convention": {"num_outputs": 1, "num_saved": 26, "grad_inputs": [], "b_slots": [], ...},
     "graphs": {"forward": <fxpipe.graph/v1>, "backward_input": ..., "backward_weight": ...},
     "vals": {"forward": [[[2, 16], [16, 1], "int64", false], ...], ...}}

The graphs go through :mod:`fxpipe.graphs.serialize` (the stage graphs' allow-list: data, never code).
``convention`` is :class:`StageGraphs`' plain fields. ``vals`` is each node's traced value (``meta["val"]``) as
shape, strides, dtype and requires_grad, in node order: what the executors read of it (shapes, strides and dtypes of
F's inputs and outputs, of W's GEMM operands) comes back as meta tensors, so loading runs nothing and imports
neither AOTAutograd nor Dynamo (a ``FakeTensorMode`` would import Dynamo). Their device is meta, not the one the
graphs were traced for (``"device"``): a run that makes tensors from them (batched W) traces its graphs instead.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import torch
import torch.fx

from fxpipe.errors import PlanFileError
from fxpipe.graphs import serialize
from fxpipe.graphs.convention import StageGraphs, StageInterface

FORMAT = "fxpipe.stage-fbw/v1"
_GRAPHS = ("forward", "backward_input", "backward_weight")
_CLASSES = {"forward": "StageForward", "backward_input": "StageBackwardInput",
            "backward_weight": "StageBackwardWeight"}
_COUNTS = ("num_outputs", "num_saved", "num_handover", "flops_forward", "flops_backward_input",
           "flops_backward_weight", "flops_fused_backward", "bytes_f_to_b", "bytes_b_to_w")
_POSITIONS = ("grad_inputs", "grad_outputs")
_SLOTS = ("b_slots", "w_slots")
_NAMES = ("param_names", "split_ops")


def split_device(graphs: StageGraphs) -> str | None:
    """The device type a split stage's graphs were traced for (its F's inputs and weights); None when there is not
    one, or the stage has no F, B and W of its own (fused, or another rank's)."""
    if graphs.fused or graphs.remote or graphs.forward is None:
        return None
    kinds = {v.device.type for n in graphs.forward.graph.nodes if n.op in ("placeholder", "get_attr")
             for v in [n.meta.get("val")] if isinstance(v, torch.Tensor)}
    return kinds.pop() if len(kinds) == 1 else None


def dump_split(graphs: StageGraphs, where: str) -> dict[str, Any]:
    """A split stage's F, B and W graphs, their calling convention and their nodes' traced values, as JSON data.

    Raises PlanFileError naming the node that cannot be written (as :func:`serialize.dump`), or a stage that has
    no F, B and W on one device.
    """
    device = split_device(graphs)
    if device is None:
        raise PlanFileError(f"{where} has no F, B and W graphs traced on one device to store")
    convention: dict[str, Any] = {k: getattr(graphs, k) for k in _COUNTS}
    convention.update({k: list(getattr(graphs, k)) for k in (*_POSITIONS, *_NAMES)})
    convention.update({k: [[kind, i] for kind, i in getattr(graphs, k)] for k in _SLOTS})
    docs, vals = {}, {}
    for key in _GRAPHS:
        gm = getattr(graphs, key)
        docs[key] = serialize.dump(gm, f"{where} {key}")
        vals[key] = [_encode_val(n.meta.get("val")) for n in gm.graph.nodes]
    return {"format": FORMAT, "device": device, "convention": convention, "graphs": docs, "vals": vals}


def interface_values(graphs: StageGraphs) -> dict[str, Any]:
    """The stage's inputs and outputs as traced (F's placeholders and its first ``num_outputs`` results): what a
    rank that does not run the stage needs of it (``StageGraphs.interface``), as JSON data."""
    assert graphs.forward is not None  # split stages only (dump_split's callers)
    ins = [n.meta.get("val") for n in graphs.forward.graph.nodes if n.op == "placeholder"]
    out = next(n for n in reversed(graphs.forward.graph.nodes) if n.op == "output")
    outs = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in out.args[0][: graphs.num_outputs]]
    return {"inputs": [_encode_val(v) for v in ins], "outputs": [_encode_val(v) for v in outs]}


def load_split(doc: Any, module: torch.nn.Module, where: str, *, recorded: StageInterface | None = None,
               trust_ops: Collection[str] = serialize.TRUSTED_LIBRARIES) -> StageGraphs:
    """The StageGraphs :func:`dump_split` wrote, over ``module``'s parameters (the loaded stage's own objects).

    ``recorded``: the stage's interface in plan.json, which the graphs must match. Raises PlanFileError, one line
    naming ``where``, for anything not allowed or not consistent (counts of inputs and outputs against the
    convention, parameters the stage does not have).
    """
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise PlanFileError(f"{where} is not an {FORMAT} document")
    _device(doc.get("device"), where)
    c = _convention(doc.get("convention"), where)
    graphs, vals = doc.get("graphs"), doc.get("vals")
    if not isinstance(graphs, dict) or not isinstance(vals, dict):
        raise PlanFileError(f"{where} lacks its graphs or their values")
    # The graphs read the stage's parameters by name; nested graphs they call are set on this holder, not on the
    # stage module.
    holder = torch.nn.Module()
    for table in ("_modules", "_parameters", "_buffers"):
        getattr(holder, table).update(getattr(module, table))
    built: dict[str, torch.fx.GraphModule] = {}
    for key in _GRAPHS:
        here = f"{where} {key}"
        gm = serialize.load(graphs.get(key), holder, here, class_name=_CLASSES[key], trust_ops=trust_ops)
        node_vals = vals.get(key)
        nodes = list(gm.graph.nodes)
        if not isinstance(node_vals, list) or len(node_vals) != len(nodes):
            raise PlanFileError(f"{here} has {len(nodes)} nodes and values for "
                                f"{len(node_vals) if isinstance(node_vals, list) else 'none'} of them")
        for node, val in zip(nodes, node_vals):
            node.meta["val"] = _decode_val(val, f"{here} node {node.name}")
        built[key] = gm
    result = StageGraphs(built["forward"], built["backward_input"], built["backward_weight"], **c)
    _check_consistent(result, module, where)
    if recorded is not None and StageInterface.of(result) != recorded:
        raise PlanFileError(f"{where} has a backward with gradients for inputs {list(result.grad_inputs)} and outputs "
                            f"{list(result.grad_outputs)}, where plan.json records {list(recorded.grad_inputs)} and "
                            f"{list(recorded.grad_outputs)}")
    return result


def remote_split(values: Any, recorded: StageInterface, where: str) -> StageGraphs:
    """The interface-only StageGraphs of a stage another rank runs (``StageGraphs.remote``), from
    :func:`interface_values`' record: its inputs and outputs as meta tensors."""
    if not isinstance(values, dict) or not isinstance(values.get("inputs"), list) \
            or not isinstance(values.get("outputs"), list):
        raise PlanFileError(f"{where} lacks the stage's input and output values")
    ins = tuple(_decode_val(v, f"{where} input {i}") for i, v in enumerate(values["inputs"]))
    outs = tuple(_decode_val(v, f"{where} output {i}") for i, v in enumerate(values["outputs"]))
    if not all(v is None or isinstance(v, torch.Tensor) for v in (*ins, *outs)):
        raise PlanFileError(f"{where} records a stage input or output that is not a tensor's shape")
    return StageGraphs(None, None, None, num_outputs=len(outs), grad_inputs=recorded.grad_inputs,
                       grad_outputs=recorded.grad_outputs, fused_reason=recorded.fused_reason,
                       interface=(ins, outs))


def _encode_val(val: Any) -> Any:
    """A traced value as JSON: a tensor as ``[shape, strides, dtype, requires_grad]``, a tuple or list as
    ``{"items": [...]}``, a number as itself; anything else (a symbolic size, an object) as null."""
    if isinstance(val, torch.Tensor):
        shape, stride = list(val.shape), list(val.stride())
        if not all(type(d) is int for d in (*shape, *stride)):
            return None
        return [shape, stride, str(val.dtype).removeprefix("torch."), bool(val.requires_grad)]
    if isinstance(val, (tuple, list)):
        return {"items": [_encode_val(v) for v in val], "list": isinstance(val, list)}
    if val is None or isinstance(val, (bool, int)) or (isinstance(val, float) and math.isfinite(val)):
        return val
    return None


def _decode_val(val: Any, where: str, depth: int = 0) -> Any:
    """A value :func:`_encode_val` wrote; a tensor as a meta tensor of its shape, strides and dtype."""
    from fxpipe.plan import LIMITS

    if depth > serialize.MAX_DEPTH:
        raise PlanFileError(f"{where} nests its value more than {serialize.MAX_DEPTH} deep")
    if val is None or isinstance(val, (bool, int, float)):
        return val
    if isinstance(val, dict) and set(val) == {"items", "list"} and isinstance(val["items"], list):
        items = [_decode_val(v, where, depth + 1) for v in val["items"]]
        return items if val["list"] is True else tuple(items)
    if not (isinstance(val, list) and len(val) == 4 and isinstance(val[2], str) and isinstance(val[3], bool)):
        raise PlanFileError(f"{where} has a malformed value")
    shape, stride, dtype_name, requires_grad = val
    dims = (shape, stride)
    if not all(isinstance(d, list) and all(type(x) is int and 0 <= x < 2**63 for x in d) for d in dims) \
            or len(shape) != len(stride):
        raise PlanFileError(f"{where} has a malformed shape or strides")
    if math.prod(shape) > LIMITS.elements:
        raise PlanFileError(f"{where} has a value of shape {shape}, past {LIMITS.elements:,} elements")
    dtype = getattr(torch, dtype_name, None) if dtype_name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise PlanFileError(f"{where} has dtype {dtype_name!r}, which is not a torch dtype")
    t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return t.requires_grad_(True) if requires_grad and (t.is_floating_point() or t.is_complex()) else t


def _device(name: Any, where: str) -> torch.device:
    if not isinstance(name, str) or not name.isidentifier():
        raise PlanFileError(f"{where} names a malformed device")
    try:
        return torch.device(name)
    except RuntimeError as exc:
        raise PlanFileError(f"{where} names device {name!r} ({exc})") from None


def _convention(doc: Any, where: str) -> dict[str, Any]:
    """StageGraphs' plain fields from their JSON; PlanFileError for a missing or ill-typed one."""
    def whole(v: Any) -> bool:
        return type(v) is int and 0 <= v < 2**63

    expected = {*_COUNTS, *_POSITIONS, *_SLOTS, *_NAMES}
    if not isinstance(doc, dict) or set(doc) != expected:
        raise PlanFileError(f"{where} has a malformed calling convention (the fields of StageGraphs)")
    out: dict[str, Any] = {}
    for k in _COUNTS:
        if not whole(doc[k]):
            raise PlanFileError(f"{where} convention {k} is not a whole number")
        out[k] = doc[k]
    for k in _POSITIONS:
        if not (isinstance(doc[k], list) and all(whole(i) for i in doc[k])):
            raise PlanFileError(f"{where} convention {k} is not a list of positions")
        out[k] = tuple(doc[k])
    for k in _SLOTS:
        if not (isinstance(doc[k], list) and all(isinstance(s, list) and len(s) == 2 and s[0] in ("saved", "grad")
                                                 and whole(s[1]) for s in doc[k])):
            raise PlanFileError(f"{where} convention {k} is not a list of slots")
        out[k] = tuple((str(s[0]), int(s[1])) for s in doc[k])
    for k in _NAMES:
        if not (isinstance(doc[k], list) and all(isinstance(n, str) for n in doc[k])):
            raise PlanFileError(f"{where} convention {k} is not a list of names")
        out[k] = tuple(doc[k])
    return out


def _check_consistent(g: StageGraphs, module: torch.nn.Module, where: str) -> None:
    """The graphs take and return what the convention says, and read the stage's own parameters."""
    def counts(gm: torch.fx.GraphModule | None) -> tuple[int, int]:
        assert gm is not None
        out = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
        results = out.args[0] if out is not None else None
        return (sum(n.op == "placeholder" for n in gm.graph.nodes),
                len(results) if isinstance(results, (tuple, list)) else -1)

    stage_inputs = (sum(n.op == "placeholder" for n in module.graph.nodes)
                    if isinstance(module, torch.fx.GraphModule) else None)
    want = {"forward": (stage_inputs, g.num_outputs + g.num_saved),
            "backward_input": (len(g.b_slots), len(g.grad_inputs) + g.num_handover),
            "backward_weight": (g.num_handover + len(g.w_slots), len(g.param_names))}
    for key, (ins, outs) in want.items():
        have_ins, have_outs = counts(getattr(g, key))
        if (ins is not None and have_ins != ins) or have_outs != outs:
            raise PlanFileError(f"{where} {key} takes {have_ins} inputs and returns {have_outs} values, which its "
                                f"calling convention does not match")
    for kind, i in (*g.b_slots, *g.w_slots):
        if i >= (g.num_saved if kind == "saved" else len(g.grad_outputs)):
            raise PlanFileError(f"{where} reads slot ({kind}, {i}), which the stage does not have")
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    missing = [n for n in g.param_names if n not in params]
    if missing:
        raise PlanFileError(f"{where} names parameter {missing[0]!r}, which the stage does not have")
