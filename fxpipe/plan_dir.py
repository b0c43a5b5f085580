"""The plan directory: plan.json (versioned), and per stage its graph as JSON data, its tensors (.pt), its F, B and W
graphs as JSON data (.fbw.json, when compiled with them) and a readable .py rendering that is never executed."""

from __future__ import annotations

import errno
import hashlib
import importlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import types
from collections.abc import Collection, Container, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx

from fxpipe._compat import pytree, serialized_type_names
from fxpipe.errors import PlanFileError
from fxpipe.graphs import serialize, stored as fbw
from fxpipe.graphs.convention import RECORD_TYPE, StageGraphs, StageInterface, flatten_inputs
from fxpipe.graphs.fx import set_path
from fxpipe.pipeline import Pipeline, Stage
from fxpipe.plan import Plan, fxpipe_version
from fxpipe.report import Report

logger = logging.getLogger(__name__)

SCHEMA = "fxpipe.plan/v3"
PLAN_FILE = "plan.json"
_FXPIPE_FILE = re.compile(r"^stage_[0-9]+\.(json|pt|py|fbw\.json)$")


# Bounds of the JSON fxpipe reads (plans, stage graphs, checkpoint records): a file past them is refused in
# one line before it is parsed further, never a RecursionError or an allocation of the size it claims.
MAX_JSON_DEPTH = 100  # fxpipe's own files nest a dozen levels (graphs inside higher-order ops a few more)
MAX_PLAN_JSON_BYTES = 256 * 2**20
MAX_STAGE_JSON_BYTES = 2**30


def read_json(file: Path, *, max_bytes: int, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``file`` parsed as JSON, at most ``max_bytes`` long and ``max_depth`` arrays or objects deep.

    Raises ValueError whose text completes "FILE ..." in one line (the bound and the value found) for a
    file past either bound, or one that is not UTF-8 JSON; OSError as reading raises it. Shared by the
    plan directory and checkpoints.
    """
    size = os.stat(file).st_size
    if size > max_bytes:
        raise ValueError(f"is {size:,} bytes, more than the {max_bytes:,} fxpipe reads")
    return parse_json(Path(file).read_bytes(), max_depth)


def parse_json(data: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``data`` parsed as JSON at most ``max_depth`` deep; ValueError as :func:`read_json` (bytes read once, so that
    what was checksummed is what is parsed)."""
    try:
        value = json.loads(data.decode())
    except RecursionError:
        raise ValueError(f"nests arrays or objects deeper than the {max_depth} levels fxpipe reads") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"is not valid JSON ({exc})") from None
    check_depth(value, max_depth)
    return value


def check_depth(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuse (ValueError) a parsed JSON value nested deeper than ``max_depth``; iterative, so any depth is safe."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > max_depth:
            raise ValueError(f"nests arrays or objects deeper than the {max_depth} levels fxpipe reads")
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def save_pipeline(pipe: Any, out: Path, *, overwrite: bool = False,
                  replaced: list[str] | None = None) -> Path:
    """Write ``pipe`` to the directory ``out``: plan.json, and per stage its graph as data, its tensors and a
    readable (never executed) Python rendering.

    ``out`` may be missing, empty, or a plan directory fxpipe wrote. The new plan is written beside it
    (a temporary directory in the same parent) and swapped in by renames, so a failure leaves the old
    plan whole. A file in ``out`` is fxpipe's when plan.json's manifest lists it with its checksum and
    it still matches; anything else (notes, sub-folders, a user's ``stage_7.py``) is moved across
    untouched. A name the new plan writes that holds a file fxpipe did not write (or one changed since)
    is refused (PlanFileError, nothing changed) unless ``overwrite``; the names it then replaces are
    appended to ``replaced``. Symbolic links are never followed: they are moved as links.
    """
    out = Path(os.path.abspath(out))  # "." and "plan/.." name the directory itself: it is swapped by name
    check_out_dir(out, overwrite=overwrite)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        os.chmod(tmp, _dir_mode(out))  # mkdtemp's 0o700 would replace the directory's own mode
    except OSError as exc:
        raise _unwritable(out, exc) from exc
    try:
        stages, files, sums = [], [], {}
        splits = _storable_splits(pipe)
        for stage in pipe.stages:
            k = stage.index
            graph_file, weights_file, source_file = f"stage_{k}.json", f"stage_{k}.pt", f"stage_{k}.py"
            try:
                graph_doc = serialize.dump(stage.module, f"stage {k}")
            except PlanFileError as exc:
                raise PlanFileError(f"{exc}; the plan cannot be saved as data (try --tracer export)") from exc
            (tmp / graph_file).write_text(json.dumps(graph_doc, separators=(",", ":")) + "\n")
            state = {name: t.detach() for name, t in _named_tensors(stage.module)}
            _torch_save(state, tmp / weights_file)
            (tmp / source_file).write_text(stage_source(stage.module, k, pipe.num_stages))
            files += [graph_file, weights_file, source_file]
            sums.update({f: sha256_file(tmp / f) for f in (graph_file, weights_file, source_file)})
            stages.append({
                "index": k,
                "graph": graph_file,
                "weights": weights_file,
                "source": source_file,
                "inputs": list(stage.inputs),
                "outputs": list(stage.outputs),
                "parameters": [_tensor_info(n, p) | {"requires_grad": p.requires_grad}
                               for n, p in stage.module.named_parameters(remove_duplicate=False)],
                "buffers": [_tensor_info(n, b) for n, b in stage.module.named_buffers(remove_duplicate=False)],
                "modules": _leaf_modules(stage.module, k),
            })
            interface = _interface(pipe, stage)
            if interface is not None:
                stages[-1]["interface"] = interface.to_json()
            if splits is not None:  # F, B and W as data: a rank that runs the plan as compiled loads, not traces, them
                fbw_file, device = f"stage_{k}.fbw.json", fbw.split_device(splits[k])
                fbw_doc = fbw.dump_split(splits[k], f"stage {k}")
                (tmp / fbw_file).write_text(json.dumps(fbw_doc, separators=(",", ":")) + "\n")
                files.append(fbw_file)
                sums[fbw_file] = sha256_file(tmp / fbw_file)
                stages[-1]["fbw"] = {"file": fbw_file, "device": device, **fbw.interface_values(splits[k])}
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
            "files": files,
            "sha256": sums,
            "plan": pipe.plan.to_json(),
            "reports": [r.to_json() for r in pipe.report()],
        }
        (tmp / PLAN_FILE).write_text(json.dumps(doc, indent=2, default=_json_default) + "\n")
        names = {PLAN_FILE, *files}
        manifest = _manifest(out)
        foreign = sorted(n for n in names & set(_entries(out)) if not _ours(out, n, manifest))
        if foreign and not overwrite:
            raise PlanFileError(_foreign_line(out, foreign))
        not_files = [n for n in foreign if (out / n).is_symlink() or not (out / n).is_file()]
        if not_files:
            raise PlanFileError(f"{out / not_files[0]} is in the way of the plan's {not_files[0]} and is not a file "
                                "(a folder or a link); nothing was written: move it out or choose another --out")
        if replaced is not None:
            replaced.extend(foreign)
        _install(tmp, out, names)
    except OSError as exc:
        raise _unwritable(out, exc) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _torch_save(state: dict[str, torch.Tensor], file: Path) -> None:
    """torch.save, whose full disk is a RuntimeError from its zip writer: an OSError here."""
    try:
        torch.save(state, file)
    except RuntimeError as exc:
        if "unexpected pos" in str(exc):  # its zip writer's word for a short write
            raise OSError(errno.EFBIG, f"{file.name} could not be written whole: the disk is full, or a file-size "
                                       "limit (ulimit -f) stopped it") from exc
        raise OSError(errno.EIO, f"torch.save failed: {str(exc).splitlines()[0] if str(exc) else exc}") from exc


def _unwritable(out: Path, exc: OSError) -> PlanFileError:
    reason = exc.strerror or type(exc).__name__
    return PlanFileError(f"cannot write the plan to {out} ({reason}); free some space or choose another --out")


def sha256_file(path: Path) -> str:
    """The file's sha256, read in blocks (a plan's manifest and a checkpoint's record hold these)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _entries(out: Path) -> list[str]:
    try:
        return sorted(os.listdir(out)) if out.is_dir() and not out.is_symlink() else []
    except OSError:
        return []


def _manifest(out: Path) -> dict[str, str | None] | None:
    """The files ``out``'s plan.json says fxpipe wrote, with their checksums (None where it recorded none:
    plans written before every file had one); None when plan.json is not fxpipe's (missing, unreadable,
    of another schema). Names other than fxpipe's own (``stage_K.json``, ...) are ignored."""
    plan_file = out / PLAN_FILE
    if plan_file.is_symlink() or not plan_file.is_file():
        return None
    try:
        doc = read_json(plan_file, max_bytes=MAX_PLAN_JSON_BYTES)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        return None
    names, sums = doc.get("files"), doc.get("sha256")
    if not isinstance(names, list) or not isinstance(sums, dict):
        return None
    return {n: sums[n] if isinstance(sums.get(n), str) else None
            for n in names if isinstance(n, str) and _FXPIPE_FILE.match(n)}


def _ours(out: Path, name: str, manifest: dict[str, str | None] | None) -> bool:
    """Whether ``out/name`` is a regular file fxpipe wrote and nobody changed since (plan.json: a manifest)."""
    if manifest is None:
        return False
    if name == PLAN_FILE:
        return True
    path = out / name
    want = manifest.get(name)
    return want is not None and path.is_file() and not path.is_symlink() and sha256_file(path) == want


def _foreign_line(out: Path, names: list[str]) -> str:
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (f"{out} holds {shown}, which fxpipe did not write (or which changed since, or an older fxpipe wrote "
            "without a checksum); nothing was written: move it out, choose another --out, or pass --overwrite to "
            "replace it")


def _dir_mode(out: Path) -> int:
    """The mode ``out`` has, or a new directory there would get (the process's umask applied), never changing the
    umask: a directory made and removed again."""
    import stat

    if out.is_dir() and not out.is_symlink():
        return stat.S_IMODE(out.stat().st_mode)
    probe = Path(tempfile.mkdtemp(dir=out.parent)) / "mode"
    try:
        probe.mkdir()
        return stat.S_IMODE(probe.stat().st_mode)
    finally:
        if probe.exists():
            probe.rmdir()
        probe.parent.rmdir()


def _install(tmp: Path, out: Path, names: set[str]) -> None:
    """Swap the plan written to ``tmp`` in as ``out``: the user's entries of ``out`` (every name the new plan
    does not write, that is not an old plan file of fxpipe's) move across first, then two renames swap the
    directories, then the old plan's files are deleted. On an error every move is undone."""
    if not out.exists() and not out.is_symlink():
        os.replace(tmp, out)
        return
    manifest = _manifest(out)
    old_plan = set() if manifest is None else {PLAN_FILE} | {n for n in manifest if _ours(out, n, manifest)}
    keep = [n for n in _entries(out) if n not in names and n not in old_plan]
    moved: list[str] = []
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
    try:
        for name in keep:
            os.rename(out / name, tmp / name)  # a link moves as a link; a folder with everything in it
            moved.append(name)
        os.replace(out, aside)  # onto the empty directory made for it
        try:
            os.replace(tmp, out)
        except OSError:
            os.replace(aside, out)
            raise
    except OSError:
        for name in moved:
            os.rename(tmp / name, out / name)
        if aside.is_dir() and not any(aside.iterdir()):
            aside.rmdir()
        raise
    for name in _entries(aside):  # the old plan's files, and those --overwrite replaced: regular files only
        path = aside / name
        if path.is_file() and not path.is_symlink():
            path.unlink()
    try:
        aside.rmdir()
    except OSError:
        pass  # a file added meanwhile: left in the hidden directory rather than deleted


def load(path: str | Path, *, trust_ops: Collection[str] = serialize.TRUSTED_LIBRARIES) -> Pipeline:
    """Load a plan directory written by ``fxpipe.save`` / ``fxpipe compile``: no model source needed.

    Loading reads data only: plan.json, each stage's graph (JSON, its operators looked up in an
    allow-list, see ``fxpipe.graphs.serialize``) and its tensors (``torch.load(weights_only=True)``).
    The ``stage_K.py`` files are for people and are never read. ``trust_ops``: the libraries whose
    ``torch.library`` operators a stage may call (``fxpipe.graphs.serialize``).
    """
    path = Path(path)
    doc = read_plan_json(path)
    plan = read_plan(path, doc)
    try:
        stages = [Stage(s["index"], _load_stage(path, s, doc["sha256"], trust_ops), s["inputs"], s["outputs"],
                        interface=_read_interface(s, path)) for s in doc["stages"]]
        for stage, s in zip(stages, doc["stages"]):
            stage.stored_graphs = _read_stored(path, s, doc["sha256"], trust_ops)
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
            in_spec=_load_spec(doc["in_spec"], path),
            out_spec=_load_spec(doc["out_spec"], path),
            shared_params=doc.get("shared_params", {}),
            reports=[Report.from_json(r) for r in doc.get("reports", [])],
            plan=plan,
        )
    except PlanFileError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise PlanFileError(f"{path / PLAN_FILE} is corrupt ({type(exc).__name__}: {exc}); "
                            "re-run fxpipe compile") from exc


def _interface(pipe: Any, stage: Any) -> StageInterface | None:
    """The stage's gradients in and out, as a loaded plan's ranks will split it (``Pipeline.build_backward``
    splits without ``input_grads``): None when the pipeline has no split graphs or was compiled with
    ``input_grads``, and its ranks then split every stage as before."""
    graphs = stage.graphs
    if graphs is None or graphs.remote or pipe.plan.options.input_grads:
        return None
    return StageInterface.of(graphs)


def _read_interface(spec: dict[str, Any], path: Path) -> StageInterface | None:
    if "interface" not in spec:  # plans written before it was recorded: every rank splits every stage
        return None
    try:
        return StageInterface.from_json(spec["interface"])
    except ValueError as exc:
        raise PlanFileError(f"{Path(path) / PLAN_FILE} stage {spec['index']} has a malformed interface ({exc}); "
                            "re-run fxpipe compile") from exc


def _storable_splits(pipe: Any) -> list[StageGraphs] | None:
    """Every stage's F, B and W, when the plan can carry them: each stage split (none fused), traced on one device
    type, as a rank splits it (``Pipeline.build_backward``: without ``input_grads``); else None, and ranks trace."""
    graphs = [stage.graphs for stage in pipe.stages]
    if pipe.plan.options.input_grads or any(g is None for g in graphs):
        return None
    devices = {fbw.split_device(g) for g in graphs}
    return graphs if len(devices) == 1 and None not in devices else None


@dataclass(frozen=True)
class StoredGraphs:
    """A loaded plan's record of one stage's F, B and W graphs (``stage_K.fbw.json``): read when a rank runs the
    stage (:func:`stored_stage_graphs`), not when the plan is loaded."""

    file: Path
    sha256: str
    device: str  # the device type they were traced for
    values: dict[str, Any]  # the stage's inputs and outputs as traced (``fbw.interface_values``)
    trust_ops: tuple[str, ...]

    def load(self, stage: Stage) -> StageGraphs:
        """The stage's F, B and W over its own parameters; PlanFileError, one line, for a file that changed since
        the plan was loaded or that the graph loader refuses."""
        size = self.file.stat().st_size
        if size > MAX_STAGE_JSON_BYTES:
            raise PlanFileError(f"{self.file} is {size:,} bytes, more than the {MAX_STAGE_JSON_BYTES:,} fxpipe reads; "
                                "re-run fxpipe compile")
        data = self.file.read_bytes()
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise PlanFileError(f"{self.file} does not match the checksum in {PLAN_FILE} (edited, or a write was cut "
                                "short); re-run fxpipe compile")
        try:
            doc = parse_json(data)
        except ValueError as exc:
            raise PlanFileError(f"{self.file} {exc}; re-run fxpipe compile") from None
        try:
            return fbw.load_split(doc, stage.module, str(self.file), recorded=stage.interface,
                                  trust_ops=self.trust_ops)
        except PlanFileError as exc:
            fix = "" if str(exc).endswith("re-run fxpipe compile") else "; re-run fxpipe compile"
            raise PlanFileError(f"{exc}{fix}") from exc


def _read_stored(path: Path, spec: dict[str, Any], sums: dict[str, Any],
                 trust_ops: Collection[str]) -> StoredGraphs | None:
    """The stage's ``fbw`` record in plan.json, its file checked against its checksum now (as the stage files
    are); None for plans written without one."""
    entry = spec.get("fbw")
    if entry is None:
        return None
    name = entry.get("file") if isinstance(entry, dict) else None
    if not isinstance(name, str) or not _FXPIPE_FILE.match(name) or not name.endswith(".fbw.json") \
            or not isinstance(entry.get("device"), str):
        raise PlanFileError(f"{path / PLAN_FILE} stage {spec['index']} has a malformed fbw record; re-run fxpipe "
                            "compile")
    file = path / name
    if file.is_symlink() or not file.is_file():
        raise PlanFileError(f"{path} is missing the stage file {name!r}; re-run fxpipe compile")
    want = sums.get(name)
    if not isinstance(want, str) or want != sha256_file(file):
        raise PlanFileError(f"{file} does not match the checksum in {PLAN_FILE} (edited, or a write was cut short); "
                            "re-run fxpipe compile")
    values = {"inputs": entry.get("inputs"), "outputs": entry.get("outputs")}
    return StoredGraphs(file, want, entry["device"], values, tuple(trust_ops))


def stored_stage_graphs(pipe: Pipeline, only: Container[int], device_type: str,
                        example_inputs: Sequence[Any] | None = None) -> list[StageGraphs] | None:
    """Every stage's graphs as a rank that runs ``only`` needs them, read from the plan instead of traced: its own
    stages' F, B and W (kept on the stages, as ``Pipeline.build_backward`` keeps them), the others' interface.

    Returns None, and the caller traces as before, unless the plan carries every stage's graphs traced for
    ``device_type`` at the shapes and dtypes of ``example_inputs`` (None: the plan's inputs), with each stage's
    interface recorded. The graphs are the plan's as compiled, ``--balance-backward``'s moves already made.
    Raises PlanFileError, one line, for a file the loader refuses.
    """
    stages = pipe.stage_list()
    records = [getattr(stage, "stored_graphs", None) for stage in stages]
    if any(r is None or r.device != device_type for r in records) or any(st.interface is None for st in stages):
        return None
    if not _traced_for(pipe, [r for r in records if r is not None], example_inputs):
        return None
    graphs = []
    for k, (stage, record) in enumerate(zip(stages, records)):
        assert record is not None and stage.interface is not None  # checked above
        if k not in only:
            graphs.append(fbw.remote_split(record.values, stage.interface, f"{record.file} (plan.json's record)"))
            continue
        g = stage.graphs if stage.graphs is not None and not stage.graphs.remote else record.load(stage)
        stage.graphs = g
        object.__setattr__(stage, "forward", g.forward)
        graphs.append(g)
    return graphs


def _traced_for(pipe: Pipeline, records: Sequence[StoredGraphs], example_inputs: Sequence[Any] | None) -> bool:
    """Whether the stored graphs were traced at ``example_inputs``' shapes and dtypes (None: the plan's inputs): each
    model input a stage reads against that stage's recorded input."""
    if example_inputs is None:
        given = {s.name: (list(s.shape), s.dtype) for s in pipe.plan.inputs}
    else:
        try:
            flat = flatten_inputs(pipe.in_spec, tuple(example_inputs), {})
        except ValueError:  # OptionError: the tracing path says what is wrong
            return False
        if not all(isinstance(x, torch.Tensor) for x in flat):
            return False
        given = {n: (list(x.shape), str(x.dtype).removeprefix("torch.")) for n, x in zip(pipe.input_names, flat)}
    if set(given) != set(pipe.input_names):
        return False
    for stage, record in zip(pipe.stage_list(), records):
        traced = record.values.get("inputs")
        if not isinstance(traced, list) or len(traced) != len(stage.inputs):
            return False
        for name, val in zip(stage.inputs, traced):
            if name not in given:
                continue
            if not (isinstance(val, list) and len(val) == 4 and [val[0], val[2]] == list(given[name])):
                return False
    return True


def read_plan_json(path: Path) -> dict[str, Any]:
    """plan.json, checked for its schema version and its stage files."""
    plan_file = Path(path) / PLAN_FILE
    if plan_file.exists() and not plan_file.is_file():
        raise PlanFileError(f"{plan_file} is not a regular file (a directory, FIFO, device or socket); re-run "
                            f"`fxpipe compile MODEL --out {path}`")
    if not plan_file.is_file():
        raise PlanFileError(f"{path} is not a plan directory (no {PLAN_FILE}); "
                            f"run `fxpipe compile MODEL --out {path}` first")
    try:
        doc = read_json(plan_file, max_bytes=MAX_PLAN_JSON_BYTES)
    except ValueError as exc:
        raise PlanFileError(f"{plan_file} {exc}; re-run fxpipe compile") from None
    except OSError as exc:
        raise PlanFileError(f"{plan_file} cannot be read ({exc.strerror or exc}); re-run fxpipe compile") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise PlanFileError(f"{plan_file} has schema {found!r}, this fxpipe reads {SCHEMA!r}; re-run fxpipe compile")
    stages = doc.get("stages")
    if not isinstance(stages, list) or not stages:
        raise PlanFileError(f"{plan_file} has no stages list; re-run fxpipe compile")
    for i, s in enumerate(stages):
        if not isinstance(s, dict):
            raise PlanFileError(f"{plan_file} stage entry {i} is not an object; re-run fxpipe compile")
        for key in ("graph", "weights"):
            name = s.get(key)
            if not isinstance(name, str) or not _FXPIPE_FILE.match(name) or not (Path(path) / name).is_file():
                raise PlanFileError(f"{path} is missing the stage file {name!r}; re-run fxpipe compile")
        for key, kind in _STAGE_KEYS.items():
            if not isinstance(s.get(key), kind):
                raise PlanFileError(f"{plan_file} stage {i} lacks a valid {key!r}; re-run fxpipe compile")
        for info in [*s["parameters"], *s["buffers"]]:
            if not (isinstance(info, dict) and isinstance(info.get("name"), str) and isinstance(info.get("shape"), list)
                    and all(isinstance(d, int) and d >= 0 for d in info["shape"])):
                raise PlanFileError(f"{plan_file} stage {i} has a malformed tensor entry {info!r:.80}; "
                                    "re-run fxpipe compile")
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
    "inputs": list, "outputs": list, "output_constants": list, "reports": list, "shared_params": dict, "sha256": dict}


def check_out_dir(out: Path, *, overwrite: bool = False) -> None:
    """Refuse an ``out`` fxpipe may not write a plan into (before the compile, so no work is lost): a file,
    a link, or a non-empty directory whose plan.json is not fxpipe's manifest (a user's folder, a plan of
    another tool, or one written before every file had a checksum) unless ``overwrite``."""
    out = Path(out)
    if out.is_symlink():
        raise PlanFileError(f"{out} is a symbolic link; fxpipe writes a plan into a directory itself, never through a "
                            "link: give the directory it points to, or another --out path")
    if not out.exists():
        return
    if not out.is_dir():
        raise PlanFileError(f"{out} exists and is not an fxpipe plan directory; choose another --out path or remove it")
    entries = _entries(out)
    if not entries or overwrite:
        return
    manifest = _manifest(out)
    if manifest is not None:
        changed = sorted(n for n in manifest if n in entries and not _ours(out, n, manifest))
        if changed:  # an old plan's file that the new one may well write again: refused before the compile
            raise PlanFileError(_foreign_line(out, changed))
        return
    if PLAN_FILE in entries:
        raise PlanFileError(f"{out} holds a {PLAN_FILE} whose manifest fxpipe cannot check (not fxpipe's, or written "
                            "before each file had a checksum); nothing was written: remove the directory, choose "
                            "another --out, or pass --overwrite to replace its plan files")
    raise PlanFileError(f"{out} exists and is not an fxpipe plan directory; choose another --out path or remove it")


def stage_source(gm: torch.fx.GraphModule, index: int, num_stages: int) -> str:
    """A stage's forward as Python, for people to read; fxpipe never imports or runs it."""
    code = gm.graph.python_code(root_module="self")
    lines = [
        f'"""fxpipe stage {index} of {num_stages}: generated by fxpipe {fxpipe_version()} with torch '
        f'{torch.__version__}.',
        "",
        f"For reading only: fxpipe never imports or runs this file. It loads the stage from stage_{index}.json",
        f"(the graph as data, its operators looked up in an allow-list) and stage_{index}.pt (tensors only).",
        '"""',
        "import torch",
        "",
    ]
    for name, obj in sorted(code.globals.items()):
        if name != "torch":
            lines.append(f"# {name}: {_describe(obj)}")
    lines.extend(["", ""])
    lines.append(code.src.strip("\n"))
    return "\n".join(lines) + "\n"


def _describe(obj: Any) -> str:
    if isinstance(obj, types.ModuleType):
        return f"module {obj.__name__}"
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else repr(obj)


def _load_stage(path: Path, spec: dict[str, Any], sums: dict[str, Any],
                trust_ops: Collection[str]) -> torch.fx.GraphModule:
    k = spec["index"]
    size = (path / spec["graph"]).stat().st_size
    if size > MAX_STAGE_JSON_BYTES:  # before its checksum is computed
        raise PlanFileError(f"{path / spec['graph']} is {size:,} bytes, more than the {MAX_STAGE_JSON_BYTES:,} fxpipe "
                            "reads; re-run fxpipe compile")
    for key in ("graph", "weights"):
        name = spec[key]
        if sums.get(name) != sha256_file(path / name):
            raise PlanFileError(f"{path / name} does not match the checksum in {PLAN_FILE} (edited, or a write was "
                                "cut short); re-run fxpipe compile")
    graph_file = path / spec["graph"]
    try:
        graph_doc = read_json(graph_file, max_bytes=MAX_STAGE_JSON_BYTES)
    except ValueError as exc:
        raise PlanFileError(f"{graph_file} {exc}; re-run fxpipe compile") from None
    except OSError as exc:
        raise PlanFileError(f"{graph_file} cannot be read ({exc.strerror or exc}); re-run fxpipe compile") from None
    try:
        state = torch.load(path / spec["weights"], weights_only=True)
    except Exception as exc:  # torch raises several types for a file that is not its own
        raise PlanFileError(f"{path / spec['weights']} does not load ({exc}); re-run fxpipe compile") from exc
    if not isinstance(state, dict):
        raise PlanFileError(f"{path / spec['weights']} holds no tensors by name; re-run fxpipe compile")
    holder = torch.nn.Module()
    for info in spec.get("modules", []):
        set_path(holder, info["name"], _build_leaf(info, path))
    for info in spec["parameters"]:
        set_path(holder, info["name"], torch.nn.Parameter(_state(state, info, path),
                                                          requires_grad=bool(info.get("requires_grad", True))))
    for info in spec["buffers"]:
        set_path(holder, info["name"], _state(state, info, path))
    try:
        gm = serialize.load(graph_doc, holder, str(graph_file), class_name=f"Stage{k}", trust_ops=trust_ops)
    except PlanFileError as exc:
        raise PlanFileError(f"{exc}; re-run fxpipe compile") from exc
    gm.meta["fxpipe_stage_idx"] = k
    return gm


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
        attrs = {k: serialize.encode_value(v, f"stage {index} module {node.target}") for k, v in vars(mod).items()
                 if _encodable(v)}
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
        object.__setattr__(mod, key, serialize.decode_value(value, f"{path / PLAN_FILE} module {info['name']}"))
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


def _load_spec(text: str | None, path: Path) -> pytree.TreeSpec | None:
    """A saved input or output structure; types no imported library registers load as :class:`Record`."""
    if text is None:
        return None
    try:
        doc = json.loads(text)
        check_depth(doc)
    except (TypeError, ValueError, RecursionError) as exc:
        raise PlanFileError(f"{path / PLAN_FILE} has a malformed output structure; re-run fxpipe compile") from exc
    missing: set[str] = set()
    _plain_types(doc, missing)
    if missing and _import_output_modules(missing):
        missing = set()
    doc = _plain_types(doc, missing)
    if missing:  # a note, not a warning: a Record serves what a loss reads of such an output (keys, attributes,
        # positions); what it cannot serve raises, naming the way back (Record.__getattr__)
        logger.info("the plan's outputs were %s; loaded as fxpipe.Record (a dict whose keys are also attributes). "
                    "Import %s before loading to get those classes back", ", ".join(sorted(missing)),
                    ", ".join(sorted({m.split(".")[0] for m in missing})))
    try:
        return pytree.treespec_loads(json.dumps(doc))
    except (NotImplementedError, ValueError, TypeError, KeyError, IndexError) as exc:
        raise PlanFileError(f"{path / PLAN_FILE} has an output structure this torch cannot read ({exc}); "
                            "re-run fxpipe compile") from exc


def run_on_meta(pipe: Any, flat: list[Any], where: str | Path, limit_bytes: int | None = None) -> Any:
    """The pipeline ``pipe`` (on the meta device) called on its flat inputs ``flat``, stage by stage under
    :func:`meta_sizes`, each through ``torch.fx.Interpreter`` (a graph that fails raises without fx printing its
    generated code to stderr); returns its output. PlanFileError names ``where``/stage_K.json when a stage makes a
    tensor past the limit."""
    from fxpipe._compat import pytree

    env: dict[str, Any] = dict(zip(pipe.input_names, flat))
    for k, stage in enumerate(pipe.stage_list()):
        try:
            with torch.no_grad(), meta_sizes(str(Path(where) / f"stage_{k}.json"), limit_bytes):
                results = torch.fx.Interpreter(stage.module).run(*(env[name] for name in stage.inputs))
        except PlanFileError as exc:  # the Interpreter appends the node to the message: one line again
            raise PlanFileError(str(exc).splitlines()[0]) from exc
        env.update(zip(stage.outputs, results))
    leaves = [env[n] if n is not None else c for n, c in zip(pipe.output_names, pipe.output_constants)]
    return tuple(leaves) if pipe.out_spec is None else pytree.tree_unflatten(leaves, pipe.out_spec)


def meta_sizes(where: str, limit_bytes: int | None = None) -> Any:
    """A dispatch mode for running a plan's graphs on the meta device: a factory operator given no device makes its
    tensor on meta too (never on the CPU), and a tensor larger than ``limit_bytes`` (default: this machine's memory)
    is refused, PlanFileError naming ``where`` (the stage file), the operator and the shape. Nothing is allocated."""
    from fxpipe._compat import TorchDispatchMode, pytree
    from fxpipe.plan import machine_memory

    limit = limit_bytes if limit_bytes is not None else machine_memory()

    class _Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = dict(kwargs or {})
            if any(a.name == "device" and a.kwarg_only for a in func._schema.arguments):
                kwargs["device"] = torch.device("meta")  # a factory op with no device literal: never the CPU's
            out = func(*args, **kwargs)
            for t in pytree.tree_leaves(out):
                if limit is not None and isinstance(t, torch.Tensor) and t.numel() * t.element_size() > limit:
                    raise PlanFileError(f"{where} makes a tensor of shape {list(t.shape)} with {func} "
                                        f"({t.numel() * t.element_size():,} bytes), more than this machine's "
                                        f"{limit:,}; re-run fxpipe compile")
            return out

    return _Sizes()


def check_allocations(path: str | Path, *, trust_ops: Collection[str] = serialize.TRUSTED_LIBRARIES,
                      limit_bytes: int | None = None) -> None:
    """Run every stage of the plan at ``path`` on the meta device, on inputs of the plan's shapes, under
    :func:`meta_sizes`: a size the graph computes (``aten.ones(mul(10**5, 10**5))``, ``arange(1e11)``) passes the
    loader's literal checks and would reach every rank's allocator. Raises PlanFileError, one line."""
    pipe = load(path, trust_ops=trust_ops).to_device("meta")
    flat = [torch.zeros(s.shape, dtype=getattr(torch, s.dtype), device="meta") for s in pipe.plan.inputs]
    try:
        run_on_meta(pipe, flat, path, limit_bytes)
    except PlanFileError:
        raise
    except Exception:  # noqa: BLE001  (a graph meta cannot run, e.g. a data-dependent op: the ranks will say so)
        return


def _import_output_modules(names: set[str]) -> bool:
    """Import the modules that define output types of a trusted library the process has already imported
    (``transformers.modeling_outputs`` for ``CausalLMOutputWithPast``: transformers imports its submodules lazily,
    and a class registers its pytree node when its module runs); True if that was done. Nothing else is imported."""
    modules = {name.rpartition(".")[0] for name in names}
    if not all(m.split(".")[0] in serialize.TRUSTED_LIBRARIES and m.split(".")[0] in sys.modules
               and all(part.isidentifier() for part in m.split(".")) for m in modules):
        return False
    try:
        for module in sorted(modules):
            importlib.import_module(module)
    except ImportError:
        return False
    return True


def _plain_types(node: Any, missing: set[str]) -> Any:
    """Swap every node type no loaded library registered for Record (keyed) or tuple (positional)."""
    if isinstance(node, list):
        return [_plain_types(x, missing) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: _plain_types(v, missing) for k, v in node.items()}
    name = node.get("type")
    if isinstance(name, str) and name not in serialized_type_names():
        missing.add(name)
        try:
            keys = json.loads(node.get("context") or "null")
        except (TypeError, ValueError, RecursionError):
            keys = None
        keyed = isinstance(keys, list) and all(isinstance(x, str) for x in keys)
        node = node | {"type": RECORD_TYPE if keyed else "builtins.tuple",
                       "context": node["context"] if keyed else "null"}
    return node


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (tuple, set)):
        return list(obj)
    if isinstance(obj, float):
        return obj
    return str(obj)
