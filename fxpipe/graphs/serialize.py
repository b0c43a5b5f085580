"""A stage graph as JSON data, and back: loading never runs code from the file.

A saved graph is a list of nodes (name, op, target, args, kwargs). Loading turns each target
name back into a callable only by looking it up in an allow-list:

- ATen and prims operator overloads (``aten.add.Tensor``), except the few that touch files
  (``aten.save``, ``aten.from_file``) or print;
- the higher-order operators whose operands are nested graphs of the same plan
  (``wrap_with_set_grad_enabled``, ``wrap_with_autocast``, ``cond``, ...), which are saved too;
- Python's ``operator`` functions on values (``getitem``, ``add``, ``mul``, ...), and ``getattr``
  of a tensor's plain attributes (``shape``, ``dtype``, ...);
- torch functions that take tensors (``torch.overrides.get_overridable_functions()``: what
  ``--tracer fx`` records, e.g. ``torch.flatten``), and public tensor methods by name, except
  those that reach storage, NumPy, hooks or Python callables.

- operators a model's own library registered through ``torch.library`` (transformers' ``grouped_mm_fallback``
  for mixture-of-experts layers): the plan records the module that defines each, and loading calls one only
  when its namespace is trusted (``TRUSTED_LIBRARIES``, or ``trust_ops``) and imports only a module of that
  library; it never imports anything the plan names otherwise.

Arguments are JSON values, node references and a few tagged torch values (dtype, device,
memory format, layout, slice, tuple). Anything else is refused when the plan is written, so a
plan that saves also loads. torch generates the GraphModule's Python from the checked graph;
the file's text is never compiled.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.fx

from fxpipe._compat import higher_order_op, op_overload, op_overload_name
from fxpipe.errors import PlanFileError

FORMAT = "fxpipe.graph/v1"

_OPERATORS = ("getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "invert",
              "and_", "or_", "xor", "lshift", "rshift", "not_", "lt", "le", "gt", "ge", "eq", "ne", "matmul",
              "contains", "is_", "is_not")
_BUILTINS: dict[str, Callable[..., Any]] = {
    **{f"_operator.{name}": getattr(operator, name) for name in _OPERATORS},
    "builtins.getattr": getattr,
    "math.ceil": math.ceil, "math.floor": math.floor, "math.sqrt": math.sqrt, "math.trunc": math.trunc,
    **{f"torch.{name}": getattr(torch, name) for name in ("sym_int", "sym_float", "sym_max", "sym_min", "sym_not")},
}
_BUILTIN_NAMES = {id(fn): key for key, fn in _BUILTINS.items()}
_TENSOR_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "T", "mT", "H", "mH", "layout", "requires_grad",
                           "is_cuda", "real", "imag"})
_UNSAFE_OPS = frozenset({"aten::save", "aten::from_file", "aten::_print"})
# Higher-order operators whose operands are nested graphs of the plan; each runs its graphs a bounded number of times
# (map_impl once per row of its input). while_loop is left out: its condition is a graph of the plan too, so a
# tampered plan could loop forever, and no rank's timeout sees a rank that is busy.
_HIGHER_ORDER = frozenset({"wrap_with_set_grad_enabled", "wrap_with_autocast", "cond", "map_impl",
                           "invoke_subgraph", "tag_activation_checkpoint"})
# Bounds on what a loaded graph may ask for before it runs: nesting of arguments and subgraphs, whole numbers
# (a C++ int64 holds what torch's operators take), and what Python's operators make of constants (7 ** 300000000
# takes minutes; "a" * 10**12 a terabyte).
MAX_DEPTH = 64
# Libraries whose torch.library operators a plan may call without being asked: their operators are the model's own
# layers (a plan compiled from a transformers mixture of experts calls transformers::grouped_mm_fallback).
TRUSTED_LIBRARIES: tuple[str, ...] = ("transformers",)
_TORCH_NAMESPACES = ("aten", "prims")
_INT_BOUND = 2**63
_SEQUENCE_BOUND = 1 << 24  # items a constant sequence operation may make
_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.pow, operator.neg,
               operator.pos, operator.abs, operator.invert, operator.and_, operator.or_, operator.xor,
               operator.lshift, operator.rshift}
_UNSAFE_METHODS = frozenset({"storage", "untyped_storage", "tolist", "numpy", "apply_", "map_", "map2_",
                             "register_hook", "register_post_accumulate_grad_hook", "data_ptr", "share_memory_",
                             "pin_memory", "item", "backward", "retain_grad", "requires_grad_"})


def dump(gm: torch.fx.GraphModule, where: str) -> dict[str, Any]:
    """``gm``'s graph, and the graphs its higher-order operators call, as JSON-able data.

    Parameters, buffers and tensor constants are named (``get_attr``), not stored: the caller
    saves them as tensors. Raises PlanFileError naming the node that cannot be written.
    """
    nodes, submodules, libraries = [], {}, {}
    for node in gm.graph.nodes:
        target: Any = node.target
        if node.op in ("call_function",):
            target = _target_name(node.target, f"{where} node {node.name}")
            if op_overload_name(node.target) is not None and target.partition(".")[0] not in _TORCH_NAMESPACES:
                libraries[target] = custom_op_module(node.target)
        elif node.op == "call_method":
            _check_method(str(target), f"{where} node {node.name}")
        elif node.op == "get_attr":
            value = _attr(gm, str(target))
            if isinstance(value, torch.fx.GraphModule):
                submodules[str(target)] = dump(value, f"{where} subgraph {target}")
        nodes.append({"name": node.name, "op": node.op, "target": target,
                      "args": _encode(node.args, f"{where} node {node.name}"),
                      "kwargs": _encode(dict(node.kwargs), f"{where} node {node.name}")})
    doc = {"format": FORMAT, "nodes": nodes, "submodules": submodules}
    if libraries:
        doc["libraries"] = libraries
    return doc


def load(doc: Any, root: torch.nn.Module, where: str, class_name: str = "GraphModule", *,
         depth: int = 0, trust_ops: Collection[str] = TRUSTED_LIBRARIES) -> torch.fx.GraphModule:
    """Rebuild a graph written by :func:`dump` over ``root``, which holds its tensors and leaf modules.

    Nested graphs are rebuilt first and set on ``root`` under their saved names. ``trust_ops``: the namespaces
    whose registered operators the graph may call. Raises PlanFileError naming what in ``doc`` is not allowed or
    not well formed.
    """
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("nodes"), list):
        raise PlanFileError(f"{where} is not an {FORMAT} graph")
    if depth > MAX_DEPTH:
        raise PlanFileError(f"{where} nests subgraphs more than {MAX_DEPTH} deep; re-run fxpipe compile")
    subs = doc.get("submodules", {})
    if not isinstance(subs, dict):
        raise PlanFileError(f"{where} has a malformed submodules table")
    for name, sub in subs.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise PlanFileError(f"{where} names a subgraph {name!r}, which is not an identifier")
        setattr(root, name, load(sub, torch.nn.Module(), f"{where} subgraph {name}", depth=depth + 1,
                                 trust_ops=trust_ops))
    libraries = doc.get("libraries", {})
    if not isinstance(libraries, dict):
        raise PlanFileError(f"{where} has a malformed libraries table")
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    constants: dict[str, int] = {}  # nodes whose value is a whole number known from the file (operators on constants)
    for i, entry in enumerate(doc["nodes"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise PlanFileError(f"{where} node {i} is malformed")
        name, op = entry["name"], entry.get("op")
        here = f"{where} node {name}"
        args = _decode(entry.get("args", []), env, here)
        kwargs = _decode(entry.get("kwargs", {}), env, here)
        if not isinstance(args, tuple) or not isinstance(kwargs, dict):
            raise PlanFileError(f"{here} has malformed arguments")
        target = entry.get("target")
        if op == "call_function":
            target = _resolve(target, here, libraries, trust_ops)
        elif op == "call_method":
            target = _check_method(target, here)
            if not args or not isinstance(args[0], torch.fx.Node):
                raise PlanFileError(f"{here} calls method {target!r} on a constant, not on a value")
        elif op == "get_attr":
            if not isinstance(target, str):
                raise PlanFileError(f"{here} has a malformed target")
            _attr(root, target, here)
        elif op in ("placeholder", "output", "call_module"):
            if not isinstance(target, str):
                raise PlanFileError(f"{here} has a malformed target")
            if op == "call_module":
                _attr(root, target, here)
        else:
            raise PlanFileError(f"{here} has unknown op {op!r}")
        if target in _ARITHMETIC:
            value = _constant_result(target, args, constants, here)
            if value is not None:
                constants[name] = value
        elif op == "call_function" and op_overload_name(target) is not None:
            _check_sizes(target, args, kwargs, here)
        elif op == "call_function" and (hop := higher_order_op(target)) is not None:
            _check_subgraphs(hop, args, root, here)
        if target == "builtins.getattr" or target is getattr:
            if len(args) != 2 or args[1] not in _TENSOR_ATTRS:
                raise PlanFileError(f"{here} reads attribute {args[1:]!r}, not one of a tensor's plain attributes")
        node = graph.create_node(op, target, args, kwargs, name=name)
        if node.name != name:
            raise PlanFileError(f"{where} repeats or mangles the node name {name!r}")
        env[name] = node
    try:
        graph.lint()
    except Exception as exc:  # torch raises RuntimeError for a malformed graph
        raise PlanFileError(f"{where} is not a well-formed graph ({exc})") from exc
    return torch.fx.GraphModule(root, graph, class_name=class_name)


# Where each stored higher-order operator takes its graphs, and how many arguments it takes at the least (at most):
# a call that names no graph of the plan there would fail only when it runs, deep inside torch.
_GRAPH_OPERANDS: dict[str, tuple[tuple[int, ...], int, int | None]] = {
    "wrap_with_set_grad_enabled": ((1,), 2, None), "wrap_with_autocast": ((4,), 5, None), "cond": ((1, 2), 4, 4),
    "map_impl": ((0,), 3, 3), "invoke_subgraph": ((0,), 2, None), "tag_activation_checkpoint": ((0,), 1, None)}


def _check_subgraphs(hop: str, args: tuple[Any, ...], root: torch.nn.Module, where: str) -> None:
    """A higher-order call's graph operands are get_attr nodes of this graph's subgraphs, in the places the operator
    takes them, with as many arguments as it takes."""
    at, least, most = _GRAPH_OPERANDS.get(hop, ((), 0, None))
    if len(args) < least or (most is not None and len(args) > most):
        raise PlanFileError(f"{where} calls higher-order operator {hop!r} with {len(args)} arguments, not "
                            f"{least if most == least else f'{least} or more'}; re-run fxpipe compile")
    for i in at:
        graph = args[i]
        if not (isinstance(graph, torch.fx.Node) and graph.op == "get_attr"
                and isinstance(_attr(root, str(graph.target), where), torch.fx.GraphModule)):
            raise PlanFileError(f"{where} calls higher-order operator {hop!r} with argument {i} not one of the plan's "
                                "subgraphs; re-run fxpipe compile")


def _digits(value: int) -> str:
    """A whole number as text, or its digit count when that would be long."""
    return str(value) if abs(value) < 10**24 else f"of {len(str(abs(value)))} digits"


def _constant_result(fn: Callable[..., Any], args: tuple[Any, ...], constants: dict[str, int],
                     where: str) -> int | None:
    """Python's operator ``fn`` on whole numbers known from the file (constants, or nodes made of them): its value,
    refused past 64 bits before it is computed; None when an operand is a runtime value. A sequence times a number
    is bounded by the items it makes."""
    known = [constants.get(a.name) if isinstance(a, torch.fx.Node) else a for a in args]
    if fn is operator.mul and len(known) == 2:
        seq = next((v for v in known if isinstance(v, (str, list, tuple))), None)
        times = next((v for v in known if isinstance(v, int) and not isinstance(v, bool)), None)
        if seq is not None and times is not None and len(seq) * times > _SEQUENCE_BOUND:
            raise PlanFileError(f"{where} repeats a constant of {len(seq)} items {_digits(times)} times, past "
                                f"{_SEQUENCE_BOUND:,} items; re-run fxpipe compile")
    numbers = [v for v in known if isinstance(v, int) and not isinstance(v, bool)]
    if not known or len(numbers) != len(known):
        return None
    too_big = PlanFileError(f"{where} computes {getattr(fn, '__name__', fn)}{tuple(_digits(v) for v in numbers)}, "
                            "beyond 64 bits (what torch's operators take); re-run fxpipe compile")
    if fn is operator.pow and len(numbers) == 2:
        base, exp = numbers
        if exp > 0 and abs(base) > 1 and exp * (abs(base).bit_length() - 1) >= 64:
            raise too_big
    if fn is operator.lshift and len(numbers) == 2 and numbers[0] != 0 and numbers[1] >= 64:
        raise too_big
    try:
        value = fn(*numbers)
    except (ArithmeticError, ValueError):  # 1 // 0, a negative shift: the graph fails when run, as it would have
        return None
    if not isinstance(value, int) or not -_INT_BOUND <= value < _INT_BOUND:
        if isinstance(value, int):
            raise too_big
        return None
    return value


def _check_sizes(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], where: str) -> None:
    """An ATen operator's ``size`` argument, when the file gives it as whole numbers: at most ``LIMITS.elements``
    elements (``aten.zeros([10**12])`` would allocate terabytes before any check)."""
    from fxpipe.plan import LIMITS, machine_memory

    for i, arg in enumerate(op._schema.arguments):
        if arg.name != "size":
            continue
        value = args[i] if i < len(args) else kwargs.get("size")
        if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            count = math.prod(value)
            if count > min(LIMITS.elements, machine_memory() or LIMITS.elements):  # a byte each at the least
                raise PlanFileError(f"{where} makes a tensor of shape {list(value)} ({count:,} elements), past "
                                    f"{LIMITS.elements:,}; re-run fxpipe compile")


def _target_name(target: Any, where: str) -> str:
    name = op_overload_name(target)
    hop = higher_order_op(target) if name is None else None
    if hop is not None:
        name = f"higher_order.{hop}"
    if name is None:
        name = _BUILTIN_NAMES.get(id(target)) or _torch_functions()[1].get(id(target))
    if name is None:
        raise PlanFileError(f"{where} calls {getattr(target, '__qualname__', target)!r}, which a plan cannot store "
                            "as data (only torch operators, torch functions on tensors and Python's operators)")
    if op_overload_name(target) is not None and name.partition(".")[0] not in _TORCH_NAMESPACES:
        return name  # a library's own operator: it exists (the graph calls it); load decides whether it is trusted
    _resolve(name, where, {}, ())  # refuse at save what load would refuse
    return name


def custom_op_module(op: Any) -> str:
    """The module that registered a ``torch.library`` operator (``transformers.integrations.moe`` for
    ``transformers::grouped_mm_fallback``), or its namespace when torch does not say."""
    from fxpipe._compat import custom_op_definer

    return custom_op_definer(op) or str(op.namespace)


def _library_op(name: str, where: str, libraries: dict[str, Any], trust_ops: Collection[str]) -> Any:
    """A library's own operator, by name: only in a trusted namespace, after importing the module the plan says
    defines it, which must belong to that library (``transformers.*`` for ``transformers::``)."""
    import importlib
    import sys

    namespace, _, rest = name.partition(".")
    if namespace not in trust_ops:
        raise PlanFileError(f"{where} calls {name!r}, an operator the {namespace!r} library registers, which this "
                            f"load does not trust; if you trust the plan's source, pass --trust-ops {namespace} "
                            f"to fxpipe run (fxpipe.load(..., trust_ops=[{namespace!r}]))")
    module = libraries.get(name, namespace)
    if not isinstance(module, str) or not all(part.isidentifier() for part in module.split(".")):
        raise PlanFileError(f"{where} names a malformed module for {name!r}")
    if module not in sys.modules:
        if module.split(".")[0] != namespace:
            raise PlanFileError(f"{where} says {name!r} is defined by {module!r}, outside the {namespace!r} library; "
                                "re-run fxpipe compile")
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001  (a missing or broken library: one line)
            raise PlanFileError(f"{where} calls {name!r}, defined by {module}, which does not import here "
                                f"({type(exc).__name__}: {exc}); install {namespace}") from None
    op_name, _, overload = rest.partition(".")
    op = op_overload(namespace, op_name, overload) if op_name and overload and "." not in overload else None
    if op is None:
        raise PlanFileError(f"{where} calls {name!r}, which {module} does not register here; install the "
                            f"{namespace} release the plan was compiled with")
    return op


def _resolve(name: Any, where: str, libraries: dict[str, Any], trust_ops: Collection[str]) -> Any:
    if not isinstance(name, str):
        raise PlanFileError(f"{where} has a malformed target")
    if name in _BUILTINS:
        return _BUILTINS[name]
    if name.startswith("higher_order."):
        hop_name = name.removeprefix("higher_order.")
        if hop_name == "while_loop":
            raise PlanFileError(f"{where} calls higher-order operator 'while_loop', a loop a plan cannot bound (a "
                                "tampered graph could run forever); a plan holds no while loops: re-run fxpipe compile")
        hop = higher_order_op(getattr(torch.ops.higher_order, hop_name, None)) if hop_name in _HIGHER_ORDER else None
        if hop is None:
            raise PlanFileError(f"{where} calls higher-order operator {name!r}, which a plan does not store")
        return getattr(torch.ops.higher_order, hop_name)
    namespace, _, rest = name.partition(".")
    if name in libraries:
        return _library_op(name, where, libraries, trust_ops)
    if namespace in _TORCH_NAMESPACES and rest.count(".") == 1:
        op_name, overload = rest.split(".")
        op = op_overload(namespace, op_name, overload)
        if op is None:
            raise PlanFileError(f"{where} calls {name!r}, which this torch does not have")
        if f"{namespace}::{op_name}" in _UNSAFE_OPS:
            raise PlanFileError(f"{where} calls {name!r}, which reads or writes files; a plan may not")
        return op
    fn = _torch_functions()[0].get(name)
    if fn is None:
        raise PlanFileError(f"{where} calls {name!r}, which is not an allowed torch operator or function")
    return fn


@functools.cache
def _torch_functions() -> tuple[dict[str, Callable[..., Any]], dict[int, str]]:
    """The torch functions on tensors a plan may call: by qualified name, and the name by function id."""
    by_name = {}
    for namespace, fns in torch.overrides.get_overridable_functions().items():
        module = getattr(namespace, "__name__", None)
        if module not in ("torch", "torch.functional", "torch.nn.functional", "torch.special", "torch.linalg",
                          "torch.fft"):
            continue
        for fn in fns:
            name = getattr(fn, "__name__", "")
            if name and not name.startswith("_"):
                by_name[f"{module}.{name}"] = fn
    by_id: dict[int, str] = {}
    for name, fn in by_name.items():
        by_id.setdefault(id(fn), name)  # a function listed under two names is saved by the first
    return by_name, by_id


def _check_method(name: Any, where: str) -> str:
    """``name``, a tensor method a graph may call."""
    if not isinstance(name, str) or name.startswith("_") or name in _UNSAFE_METHODS or \
            not callable(getattr(torch.Tensor, name, None)):
        raise PlanFileError(f"{where} calls method {name!r}, which is not an allowed tensor method")
    return name


def _attr(root: torch.nn.Module, target: str, where: str = "") -> Any:
    obj: Any = root
    for atom in target.split("."):
        if not (atom.isidentifier() or atom.isdigit()) or atom.startswith("__"):
            raise PlanFileError(f"{where} names attribute {target!r}, which is not a module path")
        if not hasattr(obj, atom):
            raise PlanFileError(f"{where} reads {target!r}, which the stage's tensors and modules do not have")
        obj = getattr(obj, atom)
    return obj


def encode_value(value: Any, where: str) -> Any:
    """A plain value (None, numbers, strings, tuples, lists, dicts, torch dtypes, ...) in the graph format's JSON."""
    return _encode(value, where)


def decode_value(value: Any, where: str) -> Any:
    """The value :func:`encode_value` wrote; PlanFileError naming ``where`` for anything else."""
    return _decode(value, {}, where)


def _encode(value: Any, where: str) -> Any:
    if isinstance(value, torch.fx.Node):
        return {"node": value.name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, tuple):  # torch.Size too
        return {"tuple": [_encode(v, where) for v in value]}
    if isinstance(value, list):
        return [_encode(v, where) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise PlanFileError(f"{where} has a dict argument with non-string keys")
        return {"dict": {k: _encode(v, where) for k, v in value.items()}}
    if isinstance(value, slice):
        return {"slice": [_encode(value.start, where), _encode(value.stop, where), _encode(value.step, where)]}
    if value is Ellipsis:
        return {"ellipsis": True}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    raise PlanFileError(f"{where} has an argument of type {type(value).__name__}, which a plan cannot store")


_TAGGED: dict[str, type] = {"dtype": torch.dtype, "memory_format": torch.memory_format, "layout": torch.layout}


def _decode(value: Any, env: dict[str, torch.fx.Node], where: str, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise PlanFileError(f"{where} nests its arguments more than {MAX_DEPTH} deep; a traced graph's arguments "
                            "are shallow: re-run fxpipe compile")
    if isinstance(value, int) and not isinstance(value, bool) and not -_INT_BOUND <= value < _INT_BOUND:
        raise PlanFileError(f"{where} has the whole number {_digits(value)}, beyond 64 bits (what torch's operators "
                            "take); re-run fxpipe compile")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_decode(v, env, where, depth + 1) for v in value]
    if not isinstance(value, dict) or len(value) != 1:
        raise PlanFileError(f"{where} has a malformed argument")
    (tag, body), = value.items()
    if tag == "node":
        if body not in env:
            raise PlanFileError(f"{where} reads {body!r} before it is defined")
        return env[body]
    if tag == "tuple" and isinstance(body, list):
        return tuple(_decode(v, env, where, depth + 1) for v in body)
    if tag == "dict" and isinstance(body, dict):
        return {k: _decode(v, env, where, depth + 1) for k, v in body.items()}
    if tag == "float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "slice" and isinstance(body, list) and len(body) == 3:
        return slice(*(_decode(v, env, where, depth + 1) for v in body))
    if tag == "ellipsis":
        return Ellipsis
    if tag == "device" and isinstance(body, str):
        try:
            return torch.device(body)
        except RuntimeError as exc:
            raise PlanFileError(f"{where} names device {body!r} ({exc})") from exc
    if tag in _TAGGED and isinstance(body, str) and body.isidentifier():
        found = getattr(torch, body, None)
        if isinstance(found, _TAGGED[tag]):
            return found
    raise PlanFileError(f"{where} has an argument {value!r} that is not a value a plan stores")
