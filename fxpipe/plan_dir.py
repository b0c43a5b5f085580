"""The plan directory: plan.json (versioned) plus one readable .py module and one .pt file per stage."""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import tempfile
import types
from pathlib import Path
from typing import Any

import torch
import torch.fx

from fxpipe._compat import is_op_namespace, pytree
from fxpipe.errors import PlanFileError
from fxpipe.graphs.fx import set_path
from fxpipe.pipeline import Pipeline, Stage
from fxpipe.plan import Plan, fxpipe_version
from fxpipe.report import Report

SCHEMA = "fxpipe.plan/v2"
PLAN_FILE = "plan.json"


def save_pipeline(pipe: Any, out: Path) -> Path:
    """Write ``pipe`` to the directory ``out`` atomically: a crash leaves the old plan or the new, never half.

    ``out`` may be missing, empty, or an earlier plan directory (which is replaced); any other
    existing directory is refused, so fxpipe never deletes files it did not write.
    """
    out = Path(out)
    check_out_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        stages = []
        for stage in pipe.stages:
            k = stage.index
            module_file, weights_file = f"stage_{k}.py", f"stage_{k}.pt"
            (tmp / module_file).write_text(stage_source(stage.module, k, pipe.num_stages))
            state = {name: t.detach() for name, t in _named_tensors(stage.module)}
            torch.save(state, tmp / weights_file)
            stages.append({
                "index": k,
                "module": module_file,
                "weights": weights_file,
                "inputs": list(stage.inputs),
                "outputs": list(stage.outputs),
                "parameters": [_tensor_info(n, p) | {"requires_grad": p.requires_grad}
                               for n, p in stage.module.named_parameters(remove_duplicate=False)],
                "buffers": [_tensor_info(n, b) for n, b in stage.module.named_buffers(remove_duplicate=False)],
                "modules": _leaf_modules(stage.module, k),
            })
        doc = {
            "schema": SCHEMA,
            "fxpipe_version": fxpipe_version(),
            "torch_version": torch.__version__,
            "num_stages": pipe.num_stages,
            "inputs": list(pipe.input_names),
            "outputs": list(pipe.output_names),
            "output_constants": list(pipe.output_constants),
            "in_spec": _dump_spec(pipe.in_spec),
            "out_spec": _dump_spec(pipe.out_spec),
            "shared_params": pipe.shared_params,
            "stages": stages,
            "plan": pipe.plan.to_json(),
            "reports": [r.to_json() for r in pipe.report()],
        }
        (tmp / PLAN_FILE).write_text(json.dumps(doc, indent=2, default=_json_default) + "\n")
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load(path: str | Path) -> Pipeline:
    """Load a plan directory written by ``fxpipe.save`` / ``fxpipe compile``: no model source needed."""
    path = Path(path)
    doc = read_plan_json(path)
    plan = read_plan(path, doc)
    try:
        stages = [Stage(s["index"], _load_stage(path, s), s["inputs"], s["outputs"]) for s in doc["stages"]]
        # Tied parameters: each stage file holds a copy; make them one Parameter again.
        for name, ks in doc.get("shared_params", {}).items():
            first = stages[ks[0]].module.get_parameter(name)
            for k in ks[1:]:
                set_path(stages[k].module, name, first)
        return Pipeline(
            stages,
            input_names=doc["inputs"],
            output_names=doc["outputs"],
            output_constants=doc["output_constants"],
            in_spec=_load_spec(doc["in_spec"]),
            out_spec=_load_spec(doc["out_spec"]),
            shared_params=doc.get("shared_params", {}),
            reports=[Report.from_json(r) for r in doc.get("reports", [])],
            plan=plan,
        )
    except PlanFileError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise PlanFileError(f"{path / PLAN_FILE} is corrupt ({type(exc).__name__}: {exc}); re-run fxpipe compile") from exc


def read_plan_json(path: Path) -> dict[str, Any]:
    """plan.json, checked for its schema version and its stage files."""
    plan_file = Path(path) / PLAN_FILE
    if not plan_file.is_file():
        raise PlanFileError(f"{path} is not a plan directory (no {PLAN_FILE}); run `fxpipe compile MODEL --out {path}` first")
    try:
        doc = json.loads(plan_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlanFileError(f"{plan_file} is not valid JSON ({exc}); re-run fxpipe compile") from exc
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise PlanFileError(f"{plan_file} has schema {found!r}, this fxpipe reads {SCHEMA!r}; re-run fxpipe compile")
    stages = doc.get("stages")
    if not isinstance(stages, list) or not stages:
        raise PlanFileError(f"{plan_file} has no stages list; re-run fxpipe compile")
    for i, s in enumerate(stages):
        if not isinstance(s, dict):
            raise PlanFileError(f"{plan_file} stage entry {i} is not an object; re-run fxpipe compile")
        for key in ("module", "weights"):
            name = s.get(key)
            if not isinstance(name, str) or not (Path(path) / name).is_file():
                raise PlanFileError(f"{path} is missing the stage file {name!r}; re-run fxpipe compile")
        for key, kind in _STAGE_KEYS.items():
            if not isinstance(s.get(key), kind):
                raise PlanFileError(f"{plan_file} stage {i} lacks a valid {key!r}; re-run fxpipe compile")
    for key, kind in _PLAN_KEYS.items():
        if not isinstance(doc.get(key), kind):
            raise PlanFileError(f"{plan_file} lacks a valid {key!r}; re-run fxpipe compile")
    for i, r in enumerate(doc.get("reports", [])):
        if not (isinstance(r, dict) and isinstance(r.get("title"), str) and isinstance(r.get("columns"), list)
                and isinstance(r.get("rows"), list)):
            raise PlanFileError(f"{plan_file} report {i} lacks a title, columns or rows; re-run fxpipe compile")
    return doc


def read_plan(path: Path, doc: dict[str, Any] | None = None) -> Plan:
    """The :class:`fxpipe.plan.Plan` in a plan directory's plan.json (checked field by field)."""
    doc = read_plan_json(path) if doc is None else doc
    plan = Plan.from_json(doc.get("plan"), where=f"{Path(path) / PLAN_FILE} plan")
    if plan.num_stages != len(doc["stages"]):
        raise PlanFileError(f"{Path(path) / PLAN_FILE} plan has {plan.num_stages} stages but {len(doc['stages'])} "
                            "stage files; re-run fxpipe compile")
    return plan


_STAGE_KEYS: dict[str, type | tuple[type, ...]] = {
    "index": int, "inputs": list, "outputs": list, "parameters": list, "buffers": list}
_PLAN_KEYS: dict[str, type | tuple[type, ...]] = {
    "inputs": list, "outputs": list, "output_constants": list, "reports": list, "shared_params": dict}


def check_out_dir(out: Path) -> None:
    """Refuse an ``--out`` that exists and is not a plan directory (fxpipe never deletes files it did not write)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / PLAN_FILE).exists())):
        raise PlanFileError(f"{out} exists and is not an fxpipe plan directory; choose another --out path or remove it")


def stage_source(gm: torch.fx.GraphModule, index: int, num_stages: int) -> str:
    """A stage's forward as a standalone Python module: imports, then ``def forward(self, ...)``."""
    code = gm.graph.python_code(root_module="self")
    lines = [
        f'"""fxpipe stage {index} of {num_stages}: generated by fxpipe {fxpipe_version()} with torch {torch.__version__}."""',
        "import importlib",
        "import torch",
        "",
        "",
        "def _resolve(module, qualname):",
        "    obj = importlib.import_module(module)",
        "    for atom in qualname.split('.'):",
        "        obj = getattr(obj, atom)",
        "    return obj",
        "",
        "",
    ]
    for name, obj in sorted(code.globals.items()):
        lines.append(_global_line(name, obj, index))
    lines.extend(["", ""])
    lines.append(code.src.strip("\n"))
    return "\n".join(lines) + "\n"


def _global_line(name: str, obj: Any, index: int) -> str:
    if isinstance(obj, types.ModuleType):
        return f"{name} = importlib.import_module({obj.__name__!r})"
    if isinstance(obj, float):
        return f"{name} = float({repr(obj) if math.isfinite(obj) else repr(str(obj))})"
    if obj is type(None):
        return f"{name} = type(None)"
    if obj is None or isinstance(obj, (bool, int, str)):
        return f"{name} = {obj!r}"
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if module and qualname and "<" not in qualname:
        try:
            found: Any = importlib.import_module(module)
            for atom in qualname.split("."):
                found = getattr(found, atom)
        except (ImportError, AttributeError):
            found = None
        if found is obj:
            return f"{name} = _resolve({module!r}, {qualname!r})"
    raise PlanFileError(
        f"stage {index} calls {obj!r}, which cannot be imported by name, so the stage cannot be saved; "
        "define it at module level in an importable module"
    )


def _load_stage(path: Path, spec: dict[str, Any]) -> torch.fx.GraphModule:
    source_file = path / spec["module"]
    namespace: dict[str, Any] = {"__name__": f"fxpipe_stage_{spec['index']}"}
    try:
        exec(compile(source_file.read_text(), str(source_file), "exec"), namespace)
        forward = namespace["forward"]
    except Exception as exc:  # a hand-edited or truncated stage file
        raise PlanFileError(f"{source_file} does not load ({type(exc).__name__}: {exc}); re-run fxpipe compile") from exc
    try:
        state = torch.load(path / spec["weights"], weights_only=True)
    except Exception as exc:
        raise PlanFileError(f"{path / spec['weights']} does not load ({exc}); re-run fxpipe compile") from exc
    holder_cls = type(f"Stage{spec['index']}Source", (torch.nn.Module,), {"forward": forward})
    holder = holder_cls()
    for info in spec.get("modules", []):
        set_path(holder, info["name"], _build_leaf(info, path))
    grads = {p["name"]: p.get("requires_grad", True) for p in spec["parameters"]}
    for info in spec["parameters"]:
        set_path(holder, info["name"], torch.nn.Parameter(_state(state, info, path), requires_grad=grads[info["name"]]))
    for info in spec["buffers"]:
        set_path(holder, info["name"], _state(state, info, path))
    try:
        graph = _trace_source(holder, namespace)
    except Exception as exc:
        raise PlanFileError(f"{source_file} does not trace ({type(exc).__name__}: {exc}); re-run fxpipe compile") from exc
    gm = torch.fx.GraphModule(holder, graph, class_name=f"Stage{spec['index']}")
    gm.meta["fxpipe_stage_idx"] = spec["index"]
    return gm


def _trace_source(holder: torch.nn.Module, namespace: dict[str, Any]) -> torch.fx.Graph:
    """Trace a stage's saved forward back into a graph, recording every op it calls.

    Plain symbolic tracing runs an op whose arguments hold no traced value (``arange(5)``,
    ``randn``, an in-place update of a buffer) once, at load time, and keeps its result as a
    constant. During this trace the stage source sees a ``torch`` whose callables always
    record a node instead.
    """
    tracer = torch.fx.Tracer()
    tracer.proxy_buffer_attributes = True
    real = namespace.get("torch", torch)
    namespace["torch"] = _Recording(real, tracer)
    try:
        return tracer.trace(holder)
    finally:
        namespace["torch"] = real


class _Recording:
    """Stand-in for a module or op namespace: callables reached through it record call_function nodes."""

    def __init__(self, target: Any, tracer: torch.fx.Tracer) -> None:
        self._target = target
        self._tracer = tracer

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if isinstance(value, types.ModuleType) or is_op_namespace(value):
            return _Recording(value, self._tracer)
        if callable(value) and not isinstance(value, type):
            tracer = self._tracer

            def record(*args: Any, **kwargs: Any) -> Any:
                return tracer.create_proxy("call_function", value, args, kwargs)

            return record
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # an OpOverloadPacket called directly
        return self._tracer.create_proxy("call_function", self._target, args, kwargs)


def _leaf_modules(gm: torch.fx.GraphModule, index: int) -> list[dict[str, Any]]:
    """Modules a stage calls (``--tracer fx`` keeps torch.nn layers as calls): class and plain attributes.

    Only torch.nn classes are saved, as their import path and their configuration values
    (ints, floats, strings, tuples); the tensors go into the .pt file. Loading rebuilds them
    without unpickling code.
    """
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        mod = gm.get_submodule(str(node.target))
        cls = type(mod)
        if not cls.__module__.startswith("torch.nn."):
            raise PlanFileError(
                f"stage {index} calls module {node.target} of class {cls.__qualname__}, which is not a torch.nn layer, "
                "so the plan cannot be saved without its source; use --tracer export"
            )
        attrs = {k: _encode(v) for k, v in vars(mod).items() if _encodable(v)}
        found.append({
            "name": str(node.target),
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "attrs": attrs,
            # Conv2d(bias=False) has a parameter slot holding None, which forward reads.
            "none_parameters": sorted(k for k, v in mod._parameters.items() if v is None),
            "none_buffers": sorted(k for k, v in mod._buffers.items() if v is None),
        })
    return found


def _encodable(v: Any) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    return isinstance(v, (tuple, list)) and all(_encodable(x) for x in v)


def _encode(v: Any) -> Any:
    if isinstance(v, tuple):
        return {"tuple": [_encode(x) for x in v]}
    if isinstance(v, list):
        return [_encode(x) for x in v]
    return v


def _decode(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"tuple"}:
        return tuple(_decode(x) for x in v["tuple"])
    if isinstance(v, list):
        return [_decode(x) for x in v]
    return v


def _build_leaf(info: dict[str, Any], path: Path) -> torch.nn.Module:
    module_name, _, qualname = str(info["class"]).rpartition(".")
    if not module_name.startswith("torch.nn."):
        raise PlanFileError(f"{path / PLAN_FILE} names module class {info['class']!r}, not a torch.nn layer; "
                            "re-run fxpipe compile")
    try:
        cls = getattr(importlib.import_module(module_name), qualname)
    except (ImportError, AttributeError) as exc:
        raise PlanFileError(f"{path / PLAN_FILE} names unknown class {info['class']!r}; re-run fxpipe compile") from exc
    mod = cls.__new__(cls)
    torch.nn.Module.__init__(mod)
    for key, value in info["attrs"].items():
        object.__setattr__(mod, key, _decode(value))
    for key in info.get("none_parameters", []):
        mod.register_parameter(key, None)
    for key in info.get("none_buffers", []):
        mod.register_buffer(key, None)
    return mod


def _state(state: dict[str, torch.Tensor], info: dict[str, Any], path: Path) -> torch.Tensor:
    name = info["name"]
    if name not in state:
        raise PlanFileError(f"{path} stage weights lack {name!r}; re-run fxpipe compile")
    t = state[name]
    if list(t.shape) != info["shape"]:
        raise PlanFileError(f"{path} weight {name!r} has shape {list(t.shape)}, plan.json says {info['shape']}; "
                            "re-run fxpipe compile")
    return t


def _named_tensors(gm: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]


def _tensor_info(name: str, t: torch.Tensor) -> dict[str, Any]:
    return {"name": name, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "device": str(t.device)}


def _dump_spec(spec: pytree.TreeSpec | None) -> str | None:
    if spec is None:
        return None
    try:
        return pytree.treespec_dumps(spec)
    except Exception:  # a type without a serialized name (some libraries' output classes)
        return None


def _load_spec(text: str | None) -> pytree.TreeSpec | None:
    return None if text is None else pytree.treespec_loads(text)


def _replace_dir(new: Path, out: Path) -> None:
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(new, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, out)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (tuple, set)):
        return list(obj)
    if isinstance(obj, float):
        return obj
    return str(obj)
