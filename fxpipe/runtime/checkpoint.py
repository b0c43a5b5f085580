"""Checkpoints as torch.distributed.checkpoint (DCP) directories, one per step, read as data and never as code.

    CK/step_000002/     .metadata, __R_0.distcp (one per rank), fxpipe-checkpoint.json (sizes, sha256)
    CK/.step_000004.partial/   a save under way or never finished: never loaded
    CK/.fxpipe.lock     held by the fxpipe run writing here: a second one is refused

A pipeline runtime's state is its stages' modules and optimizers as torch's
``torch.distributed.checkpoint.state_dict`` gives and takes them (``get_state_dict`` with
``flatten_optimizer_state_dict``, ``set_state_dict``): keys are the model's names (``model.<fqn>``,
``optim.state.<fqn>.<key>``; each parameter's optimizer hyperparameters go to fxpipe's JSON record), so a
checkpoint resumes under another stage count or replica count; each rank loads only its own stages' keys.
A runtime without modules (the strategy runtime: DTensor shards gathered whole) gives the same keys by
its ``state_dict()``. ``save(..., asynchronous=True)`` writes through ``dcp.async_save`` while training
goes on; :func:`wait` (or the next save) completes it. Nothing is unpickled as code: ``.metadata``
through an allow-list unpickler, tensors ``weights_only``, fxpipe's own record as bounded JSON. Resume
verifies every file's checksum and passes over a step whose bytes changed, naming it. A step is removed
(pruning, ``clear``) only when it is a real directory holding only regular files its record lists.
docs/internals/checkpoints.md draws the layout.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import re
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from fxpipe.errors import CheckpointError, OptionError, first_line
from fxpipe.plan_dir import read_json, sha256_file

if TYPE_CHECKING:  # torch.distributed.checkpoint costs 0.5 s to import: only when a checkpoint is read or written
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

SCHEMA = "fxpipe.checkpoint/v1"
MARKER = "fxpipe-checkpoint.json"
DEFAULT_KEEP = 3
LOCK_FILE = ".fxpipe.lock"
PARTIAL_MARK = ".fxpipe-partial"
MAX_MARKER_BYTES = 64 * 2**20  # the record lists files and optimizer groups: far less for any model
_STEP = re.compile(r"^step_(\d+)$")
_PARTIAL = re.compile(r"^\.step_(\d+)\.partial$")
_DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")
# What a step directory holds when fxpipe and DCP wrote it: only such a directory is ever deleted.
_OURS = re.compile(r"^(\.metadata(\.tmp)?|__\d+(_\d+\.distcp|\.metadata(\.tmp)?)|fxpipe-checkpoint\.json(\.tmp)?"
                   r"|\.fxpipe-partial)$")

# Every global DCP's .metadata pickle refers to (torch 2.13, found with pickletools on a real one; the
# test of the allow-list checks that a file just written names nothing else). Kept as names, not imported:
# the unpickler resolves them only after this check, and a torch that renames one makes the check refuse
# the file with a clear line, not import a private module. DCP gives no public reader of .metadata that
# would not unpickle it whole, so the three private names below are the ones loading any DCP file needs:
_METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
        "StorageMeta")
} | {
    # TensorProperties pickles its memory format as a member of this enum (its __getstate__): every tensor's entry.
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    # Metadata.storage_data maps each chunk to one of these: which file, at which offset, how long.
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # TensorProperties pickles its layout (torch.strided) as this call: it looks the name up in torch's own table.
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id
} | {("torch", name) for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)})


@dataclass(frozen=True)
class Found:
    """A complete step: its directory, DCP's index of it (read as data) and fxpipe's record of it."""

    step: int
    path: Path
    metadata: Metadata
    info: dict[str, Any]


@dataclass(frozen=True)
class Scan:
    """What a checkpoint directory holds: the newest complete step (or None), and why each newer one was passed over."""

    found: Found | None
    skipped: tuple[str, ...]


def step_dir(directory: str | os.PathLike[str], step: int) -> Path:
    return Path(directory) / f"step_{step:06d}"


# -- saving ---------------------------------------------------------------------------------


def save(rt: Any, directory: str | os.PathLike[str], step: int, *, keep: int = DEFAULT_KEEP,
         asynchronous: bool = False) -> Path:
    """Every rank: write ``rt``'s state as ``directory/step_NNNNNN`` and keep the newest ``keep`` steps.

    Collective (every rank calls it with the same step). The ranks write into
    ``.step_NNNNNN.partial``; after DCP's coordinator has written ``.metadata`` (which it does only
    once every rank's file is in), rank 0 adds ``fxpipe-checkpoint.json`` and renames the directory
    to its final name. Returns that path on every rank, once the step is complete.

    ``asynchronous``: ``dcp.async_save`` copies the state and writes it in a thread while training goes on;
    the step is completed (checksums, record, rename, pruning) by :func:`wait`, which the next save calls
    first, so a save never overlaps the one before. Returns the path the step will have. A failed write
    raises the one line a synchronous save would, from :func:`wait`.
    """
    if keep < 1:
        raise OptionError(f"keep is how many complete checkpoints to keep (keep: {keep}); pass 1 or more")
    wait(rt)  # the previous step is complete (or its error raised) before this one starts
    try:
        flat, groups = _flat_state(rt, step)
        error = None
    except CheckpointError as exc:
        flat, groups, error = {}, [], str(exc)
    seen = _all_gather((step, error))  # every rank learns of every rank's problem: none waits for a stopped one
    _raise_first([e for _, e in seen])
    steps = [s for s, _ in seen]
    if len(set(steps)) != 1:
        raise CheckpointError(f"the ranks save different steps ({_by_rank(steps)}); a checkpoint is one step of "
                              "every rank: call save_checkpoint with the same step on every rank")
    root = Path(directory)
    partial, final = root / f".step_{step:06d}.partial", step_dir(root, step)
    if _rank() == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if final.is_symlink() or partial.is_symlink():
                raise CheckpointError(f"{final if final.is_symlink() else partial} is a symbolic link, which fxpipe "
                                      "does not write through; move it out of the checkpoint directory")
            if partial.exists() and not _remove_step(partial):  # left by a save that never finished
                raise CheckpointError(f"{partial} holds files fxpipe did not write; move them out of the checkpoint "
                                      "directory")
            partial.mkdir()
            (partial / PARTIAL_MARK).write_bytes(b"")  # fxpipe made this directory: it may remove it
        except CheckpointError as exc:
            error = str(exc)
        except OSError as exc:
            error = f"cannot write checkpoints to {root} ({exc.strerror or exc}); pick a writable checkpoint directory"
    _raise_first(_all_gather(error))
    import torch.distributed.checkpoint as dcp

    pending = _Pending(root, partial, final, step, keep, groups, rt.pipe.num_stages, rt.schedule.name)
    writer = dcp.FileSystemWriter(partial)
    try:
        with _quiet():
            if asynchronous:  # the writer stages (copies) the state before async_save returns
                _PENDING[rt] = (dcp.async_save(flat, storage_writer=writer, process_group=_async_group(rt),
                                               no_dist=not _distributed()), pending)
                return final
            dcp.save(flat, storage_writer=writer, no_dist=not _distributed())
    except (Exception, dcp.CheckpointException) as exc:  # DCP gathers every rank's failure into one
        raise _one_line(exc, "saving") from None
    return _complete(pending)


def wait(rt: Any) -> Path | None:
    """Every rank: complete ``rt``'s asynchronous save, if one is under way, and return its step's path (None if
    there was none). Collective. Call it before the run ends (its ``.step_NNNNNN.partial`` is otherwise never
    completed, and a resume passes over it); :func:`save` and :func:`load` call it first. Raises the
    CheckpointError a synchronous save of that step would have."""
    entry = _PENDING.pop(rt, None)
    if entry is None:
        return None
    future, pending = entry
    import torch.distributed.checkpoint as dcp

    try:
        with _quiet():
            future.result()
    except (Exception, dcp.CheckpointException) as exc:
        raise _one_line(exc, "saving") from None
    return _complete(pending)


@dataclass(frozen=True)
class _Pending:
    """A step whose DCP files are written (or being written): what completing it needs."""

    root: Path
    partial: Path
    final: Path
    step: int
    keep: int
    groups: list[dict[str, Any]]
    stages: int
    schedule: str


# Each runtime's asynchronous save under way: (DCP's future, what completing it needs).
_PENDING: weakref.WeakKeyDictionary[Any, tuple[Any, _Pending]] = weakref.WeakKeyDictionary()
_ASYNC_GROUPS: dict[int, Any] = {}


def _async_group(rt: Any) -> Any:
    """The process group asynchronous saves coordinate on: a gloo group of every rank, made once, apart from the
    default group, whose order of collectives the training steps own (DCP's thread would interleave with them)."""
    if not _distributed():
        return None
    world = dist.group.WORLD
    if id(world) not in _ASYNC_GROUPS:
        from datetime import timedelta

        timeout = getattr(rt, "timeout", None)  # the runtime's own (a timedelta), else torch's default
        _ASYNC_GROUPS[id(world)] = dist.new_group(backend="gloo", timeout=timeout
                                                  if isinstance(timeout, timedelta) else None)
    return _ASYNC_GROUPS[id(world)]


def _complete(p: _Pending) -> Path:
    """Every rank, once DCP wrote ``p.partial``: checksums, fxpipe's record, the rename to the step's name, pruning."""
    rank, world = _rank(), _world()
    try:  # each rank its own file's checksum; rank 0 writes them all down
        mine: str | None = sha256_file(p.partial / f"__{rank}_0.distcp")
    except OSError:
        mine = None  # missing: rank 0 names it below
    all_groups, sums = zip(*_all_gather((p.groups, mine)))
    root, partial, final, step, error = p.root, p.partial, p.final, p.step, None
    if rank == 0:
        try:
            files = {f.name: f.stat().st_size for f in sorted(partial.iterdir()) if _DATA_FILE.match(f.name)}
            info = {"schema": SCHEMA, "step": step, "world": world, "stages": p.stages,
                    "schedule": p.schedule, "files": files,
                    "sha256": {f"__{r}_0.distcp": h for r, h in enumerate(sums) if h is not None}
                    | {".metadata": sha256_file(partial / ".metadata")},
                    "param_groups": [g for gs in all_groups for g in gs]}
            _write_json(partial / MARKER, info)
            (partial / PARTIAL_MARK).unlink()
            why = _owned(final) if final.exists() or final.is_symlink() else []
            if isinstance(why, str):  # a user's entry by that name: never renamed or replaced
                error = (f"{final} {why}, and fxpipe did not write it; move it out of the checkpoint directory "
                         f"(step {step} was saved as {partial.name})")
            elif final.exists():  # the same step again (a resumed run): replace it whole
                old = root / f".step_{step:06d}.replaced"
                if old.exists() and not old.is_symlink():
                    _remove_step(old)
                if old.exists() or old.is_symlink():
                    raise OSError(errno.EEXIST, f"{old} is in the way (not fxpipe's)")
                os.replace(final, old)
                os.replace(partial, final)
                if not _remove_step(old):
                    warnings.warn(f"{old} held files fxpipe did not write; it was left in place", stacklevel=2)
            else:
                os.replace(partial, final)
            _fsync_dir(root)
            _prune(root, step, p.keep)
        except OSError as exc:
            error = f"cannot complete checkpoint {final} ({exc.strerror or exc}); check the disk and the directory"
    _raise_first(_all_gather(error))
    return final


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


def _rank_state(rt: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, float]]:
    """This rank's model state (fqn -> tensor), its optimizer state flattened as torch's ``get_state_dict`` gives it
    with ``flatten_optimizer_state_dict`` (``state.<fqn>.<key>``, ``param_groups.<fqn>.<key>``), and the runtime's
    numbers (the lr schedule's step, fp16's scale, the data position)."""
    parts = getattr(rt, "stage_parts", None)
    if parts is None:  # a runtime without modules gives its state whole, by name
        state = rt.state_dict()
        optim = {f"state.{fqn}.{key}": value for fqn, values in state["optim"].items() for key, value in values.items()}
        optim |= {f"param_groups.{fqn}.{key}": value for group in state["param_groups"] for fqn in group["params"]
                  for key, value in group.items() if key != "params"}
        return {**state["params"], **state["buffers"]}, optim, dict(state.get("runtime", {}))
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model: dict[str, torch.Tensor] = {}
    optim = {}
    for module, optimizer in parts():
        if not module.state_dict():  # a stage of an activation alone: get_state_dict refuses an empty module
            continue
        try:
            m, o = get_state_dict(module, optimizer if optimizer is not None else (),
                                  options=_options(flatten_optimizer_state_dict=True))
        except NotImplementedError as exc:  # flattening refuses a state value that is not a tensor or a number
            raise CheckpointError(f"the optimizer state holds a value fxpipe checkpoints do not ({first_line(exc)}); "
                                  "they hold tensors and numbers only (nothing that loads as code)") from None
        # a module state dict holds tensors; torch types it as any state dict value (numbers, nested containers)
        model |= {k: cast(torch.Tensor, v).detach() for k, v in m.items()}
        optim |= o
    return model, optim, rt.runtime_state()


def _flat_state(rt: Any, step: int) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """This rank's part: tensors by DCP key, and its optimizers' hyperparameters (JSON values)."""
    flat: dict[str, torch.Tensor] = {f"fxpipe.step.rank{rt.rank}": torch.tensor(step, dtype=torch.int64)}
    if rt.dp_rank != 0:  # a stage's replicas hold the same state: replica 0 saves it, once per stage
        return flat, []
    model, optim, runtime = _rank_state(rt)
    for key, number in runtime.items():  # the lr schedule's step, fp16's scale: rank 0's is read
        flat[f"fxpipe.runtime.rank{rt.rank}.{key}"] = torch.tensor(number, dtype=torch.float64)
    # A parameter several pipeline ranks hold (tied) is saved by the first of them.
    skip = {name for name, holders in rt.pipe.shared_params.items()
            if rt.pp_rank != min(rt.where[k] for k in holders)}
    for fqn, tensor in model.items():
        if fqn not in skip:
            flat[f"model.{fqn}"] = tensor
    hyper: dict[str, dict[str, Any]] = {}
    for name, value in optim.items():
        section, _, rest = name.partition(".")
        fqn, _, key = rest.rpartition(".")
        if fqn in skip:
            continue
        if fqn not in model:  # a nested state (state.<fqn>.<key>.<part>): not a tensor or a number of a parameter
            raise CheckpointError(f"optimizer state {rest!r} is nested; fxpipe checkpoints hold tensors and numbers "
                                  "only (nothing that loads as code)")
        if section == "param_groups":
            if _plain(value):
                hyper.setdefault(fqn, {})[key] = list(value) if isinstance(value, tuple) else value
        elif isinstance(value, torch.Tensor):
            flat[f"optim.state.{fqn}.{key}"] = value
        elif isinstance(value, (bool, int, float)):
            flat[f"optim.number.{fqn}.{key}"] = torch.tensor(value)
        elif value is not None:
            raise CheckpointError(f"optimizer state {key!r} of {fqn} is a {type(value).__name__}; fxpipe "
                                  "checkpoints hold tensors and numbers only (nothing that loads as code)")
    groups: list[dict[str, Any]] = []  # parameters in a row with the same hyperparameters: one group, as saved
    for fqn, values in hyper.items():
        if groups and {k: v for k, v in groups[-1].items() if k != "params"} == values:
            groups[-1]["params"].append(fqn)
        else:
            groups.append({"params": [fqn], **values})
    return flat, groups


def _plain(value: Any) -> bool:
    """A hyperparameter that is a plain value (kept in the checkpoint's JSON)."""
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, (bool, int, float)) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _prune(root: Path, current: int, keep: int) -> None:
    """Remove the steps before the ``keep`` newest up to ``current``, and partial saves of earlier steps.

    Runs right after ``current`` was written and its checksums recorded, so the newest verified step is
    never among those removed; a step fxpipe did not write (a link, a user's file inside) is left.
    """
    steps = sorted((n, p) for n, p in _numbered(root, _STEP) if n <= current)
    for n, path in steps[:-keep]:
        if n != current:
            _remove_step(path)
    for n, path in _numbered(root, _PARTIAL):
        if n < current:
            _remove_step(path)


def clear(directory: str | os.PathLike[str]) -> list[str]:
    """Remove the step directories fxpipe wrote in ``directory`` (nothing else); returns their names.

    Raises CheckpointError, having removed nothing, when a step-named entry is a link, or holds a file
    that its fxpipe record does not list (a user's file, even one named like DCP's).
    """
    root = Path(directory)
    if root.is_symlink():
        raise CheckpointError(f"{root} is a symbolic link; fxpipe removes checkpoints only in the directory itself: "
                              "give the directory it points to")
    steps = sorted(_numbered(root, _STEP, links=True) + _numbered(root, _PARTIAL, links=True))
    for _, path in steps:
        owned = _owned(path)
        if isinstance(owned, str):
            raise CheckpointError(f"{path} {owned}; nothing was removed: move it out, or use another checkpoint "
                                  "directory")
    for _, path in steps:
        _remove_step(path)
    return [path.name for _, path in steps]


def lock(directory: str | os.PathLike[str]) -> Any:
    """Hold ``directory``'s lock file (made if missing) for one writer: an open file to close when done.

    The lock is an ``flock``, which the kernel releases when the process ends however it ends. Raises
    CheckpointError (one line) when another process holds it.
    """
    import fcntl

    root = Path(directory)
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise CheckpointError(f"cannot lock {root / LOCK_FILE} ({exc.strerror or exc}); pick a writable checkpoint "
                              "directory") from None
    held = os.fdopen(fd, "r+b")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        held.close()
        raise CheckpointError(f"{root} is in use by another fxpipe run (it holds {LOCK_FILE}); wait for that run to "
                              "end, or use another checkpoint directory") from None
    return held


def newest(directory: str | os.PathLike[str]) -> tuple[Found, tuple[str, ...]]:
    """:func:`scan`'s newest complete step and the newer ones passed over; CheckpointError (one line:
    why each step was passed over) when no step is complete."""
    result = scan(directory)
    if result.found is None:
        raise CheckpointError(_none_complete(Path(directory), result.skipped))
    return result.found, result.skipped


def _owned(path: Path) -> list[str] | str:
    """The files of the step directory ``path`` that fxpipe wrote (it may remove them all, then the directory),
    or why it may not: a link, not a directory, or an entry its record does not list."""
    if path.is_symlink():
        return "is a symbolic link, which fxpipe did not make"
    if not path.is_dir():
        return "is not a directory"
    try:
        entries = sorted(os.listdir(path))
    except OSError as exc:
        return f"cannot be listed ({exc.strerror or exc})"
    listed: set[str] = set()
    if PARTIAL_MARK in entries:  # a save that never finished: what fxpipe and DCP write while saving
        listed |= {n for n in entries if _OURS.match(n)}
    elif (path / MARKER).is_file() and not (path / MARKER).is_symlink():
        try:
            info = read_json(path / MARKER, max_bytes=MAX_MARKER_BYTES)
        except (OSError, ValueError):
            info = None
        if not isinstance(info, dict) or info.get("schema") != SCHEMA:
            return f"has a {MARKER} fxpipe cannot read, so it cannot tell its own files there from others"
        for key in ("files", "sha256"):
            if isinstance(info.get(key), dict):
                listed |= {n for n in info[key] if isinstance(n, str) and _OURS.match(n)}
        listed |= {MARKER, ".metadata"}
    foreign = [n for n in entries if n not in listed or (path / n).is_symlink() or not (path / n).is_file()]
    if foreign:
        return f"holds {_few(foreign)}, which fxpipe did not write"
    return entries


def _remove_step(path: Path) -> bool:
    """Delete a step directory if it holds only files its fxpipe record lists (never through a link); True if it did."""
    owned = _owned(path)
    if isinstance(owned, str):
        return False
    for name in owned:
        os.unlink(path / name)
    try:
        path.rmdir()
    except OSError:
        return False
    return True


def _numbered(root: Path, pattern: re.Pattern[str], *, links: bool = False) -> list[tuple[int, Path]]:
    """Step-named directories of ``root``; with ``links``, step-named links too (never followed)."""
    if not root.is_dir():
        return []
    return [(int(m.group(1)), p) for p in root.iterdir()
            if (m := pattern.match(p.name)) and ((links and p.is_symlink()) or (p.is_dir() and not p.is_symlink()))]


# -- finding the step to resume -------------------------------------------------------------


def scan(directory: str | os.PathLike[str]) -> Scan:
    """The newest complete step of ``directory``; every newer one passed over says why (incomplete,
    truncated, corrupt: a file whose checksum differs from the one recorded when it was written). Reads
    fxpipe's JSON, ``.metadata`` (as data), and every file's bytes to check them. A step that is a
    symbolic link is never read.

    Raises CheckpointError when a file refers to anything DCP's metadata is not made of (it was
    tampered with: it could run code), rather than passing over it to an older step.
    """
    root = Path(directory)
    skipped: list[str] = []
    found = None
    for n, path in sorted(_numbered(root, _STEP, links=True), reverse=True):
        result = _check(path, n) if not path.is_symlink() else "a symbolic link (fxpipe reads only the step " \
            "directories it wrote)"
        if isinstance(result, Found):
            found = result
            break
        skipped.append(f"{path.name} is {result}")
    newer = [(n, p) for n, p in _numbered(root, _PARTIAL) if found is None or n > found.step]
    skipped += [f"{p.name} is incomplete (a save that did not finish)" for _, p in sorted(newer, reverse=True)]
    return Scan(found, tuple(skipped))


def _check(path: Path, step: int) -> Found | str:
    """A Found, or why ``path`` is not a complete step."""
    marker = path / MARKER
    if not marker.is_file():
        return f"incomplete (no {MARKER})"
    try:
        info = read_json(marker, max_bytes=MAX_MARKER_BYTES)
    except ValueError as exc:
        return f"corrupt ({MARKER} {exc})"
    except OSError as exc:
        return f"unreadable ({MARKER}: {exc.strerror or exc})"
    if not isinstance(info, dict) or info.get("schema") != SCHEMA:
        return f"corrupt ({MARKER} is not of schema {SCHEMA})"
    files, world, groups = info.get("files"), info.get("world"), info.get("param_groups")
    if (info.get("step") != step or not isinstance(world, int) or not isinstance(files, dict)
            or len(files) != world or set(files) != {f"__{r}_0.distcp" for r in range(world)}  # one per rank
            or not all(isinstance(v, int) for v in files.values())
            or not isinstance(groups, list) or not all(_plain_group(g) for g in groups)):
        return f"corrupt ({MARKER} does not describe step {step} of every rank)"
    if not (path / ".metadata").is_file():
        return "incomplete (no .metadata)"
    try:
        metadata = read_metadata(path / ".metadata")
    except _NotData:
        raise
    except CheckpointError as exc:
        return f"corrupt ({exc})"
    for name, size in files.items():
        have = (path / name).stat().st_size if (path / name).is_file() else None
        if have != size:
            return f"truncated ({name} has {have or 0} of {size} bytes)"
    for index, where in metadata.storage_data.items():
        if where.relative_path not in files or where.offset + where.length > files[where.relative_path]:
            return f"corrupt (.metadata puts {index.fqn} outside the data files)"
    total = sum(files.values())
    for key, entry in metadata.state_dict_metadata.items():  # before anything is allocated to load it into
        item = cast("TensorStorageMetadata", entry)  # read_metadata refused any other kind of entry
        size = tuple(item.size)
        if not all(isinstance(d, int) and 0 <= d for d in size):
            return f"corrupt (.metadata gives {key} the shape {list(size)!r:.80})"
        numel = 1
        for d in size:
            numel *= d
        if numel * item.properties.dtype.itemsize > total:
            return (f"corrupt (.metadata says {key} holds {numel:,} elements, more than the {total:,} bytes of its "
                    "data files hold)")
    sums = info.get("sha256")
    if sums is not None:  # recorded since checkpoints carry checksums; older ones are checked by size only
        want = {".metadata", *files}
        if not isinstance(sums, dict) or set(sums) != want or not all(isinstance(v, str) for v in sums.values()):
            return f"corrupt ({MARKER} does not list a checksum for each file)"
        for name in sorted(want):
            try:
                got = sha256_file(path / name)
            except OSError as exc:
                return f"unreadable ({name}: {exc.strerror or exc})"
            if got != sums[name]:
                return f"corrupt ({name} does not match the checksum recorded when it was written)"
    return Found(step, path, metadata, info)


def _plain_group(group: Any) -> bool:
    """An optimizer group as saved: parameter names and plain hyperparameters."""
    if not isinstance(group, dict) or not isinstance(group.get("params"), list):
        return False
    if not all(isinstance(name, str) for name in group["params"]):
        return False
    return all(v is None or isinstance(v, (bool, int, float, str))
               or (isinstance(v, list) and all(isinstance(x, (bool, int, float)) for x in v))
               for k, v in group.items() if k != "params")


# -- .metadata as data ----------------------------------------------------------------------


class _NotData(CheckpointError):
    """A checkpoint file refers to code: refused, never passed over for an older step."""


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals DCP's metadata is made of; anything else stops the load before it is imported."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _METADATA_GLOBALS:
            raise _Refused(f"{module}.{name}")
        return super().find_class(module, name)


class _Refused(pickle.UnpicklingError):
    pass


def read_metadata(file: Path) -> Metadata:
    """DCP's ``.metadata`` read as data: its pickle may build only DCP's metadata classes, torch sizes,
    dtypes and layouts; the result must be an index of tensors in files of this directory."""
    try:
        data = file.read_bytes()
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise _NotData(f"{file} refers to {exc}, which DCP's metadata never does; it was not loaded (it could run "
                       f"code); remove {file.parent} to resume from the step before") from None
    except Exception as exc:  # a truncated or garbled pickle: any error of pickle's
        raise CheckpointError(f".metadata does not load: {first_line(exc)}") from None
    problem = _metadata_problem(metadata)
    if problem is not None:
        raise CheckpointError(f".metadata {problem}")
    return metadata


def _metadata_problem(md: Any) -> str | None:
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    if type(md) is not Metadata:
        return f"holds a {type(md).__name__}, not DCP's Metadata"
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        return "has no index of tensors"
    for key, item in md.state_dict_metadata.items():
        if type(item) is not TensorStorageMetadata or not isinstance(key, str):
            return f"lists {key!r} as a {type(item).__name__}: fxpipe checkpoints hold tensors only"
    for index, where in md.storage_data.items():
        if (not isinstance(getattr(where, "relative_path", None), str) or not _DATA_FILE.match(where.relative_path)
                or not isinstance(where.offset, int) or not isinstance(where.length, int)
                or where.offset < 0 or where.length < 0 or getattr(where, "transform_descriptors", None)):
            return f"puts {getattr(index, 'fqn', index)!r} in a file fxpipe does not write"
    return None


@cache
def _dcp_classes() -> tuple[Any, Any]:
    """DCP's file reader and load planner as fxpipe reads checkpoints (made on first use: DCP imports slowly)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
    from torch.futures import Future

    class _SafeReader(dcp.FileSystemReader):
        """DCP's file reader with fxpipe's checked ``.metadata`` and one-line errors naming the file."""

        def __init__(self, found: Found) -> None:
            super().__init__(found.path)
            self.found = found

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            return self.found.metadata  # already read as data by scan()

        def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
            per_file: dict[str, list[ReadItem]] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for name, items in per_file.items():
                file = self.found.path / name
                try:
                    super().read_data(replace(plan, items=items), planner).wait()
                except CheckpointError:
                    raise
                except pickle.UnpicklingError:
                    raise _NotData(f"{file} is not a file of tensors (torch.load(weights_only=True) refused it); it "
                                   f"was not loaded (it could run code); remove {file.parent} to resume from the step "
                                   "before") from None
                except Exception as exc:
                    raise CheckpointError(f"{file} is corrupt ({first_line(exc)}); remove "
                                          f"{file.parent} to resume from the step before") from None
            fut: Future[None] = Future()
            fut.set_result(None)
            return fut

    class _TensorsOnlyPlanner(DefaultLoadPlanner):
        """DCP's planner, but a non-tensor value (which it would ``torch.load`` with ``weights_only=False``) is
        refused."""

        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            raise _NotData(f"the checkpoint holds {read_item.dest_index.fqn} as pickled bytes, which fxpipe never "
                           "writes; it was not loaded (it could run code)")

    return _SafeReader, _TensorsOnlyPlanner


# -- loading --------------------------------------------------------------------------------


def load(rt: Any, directory: str | os.PathLike[str], *, warn: Callable[[str], None] | None = None) -> int:
    """Every rank: load the newest complete step of ``directory`` into ``rt``; returns its step.

    Collective. Newer steps that are incomplete, truncated or corrupt are passed over, each said
    in one line to ``warn`` (rank 0's). Each rank reads only its own stages' keys. Raises
    CheckpointError when no step is complete, a file was tampered with, the files are of different
    steps, or the checkpoint is of another model.
    """
    wait(rt)  # this runtime's own save under way is complete before anything is read
    root = Path(directory)
    try:
        result: Scan | str = scan(root)
    except CheckpointError as exc:
        result = str(exc)
    found = result.found if isinstance(result, Scan) else None
    seen = _all_gather((found.step if found else None, result if isinstance(result, str) else None))
    _raise_first([error for _, error in seen])
    if found is None:
        raise CheckpointError(_none_complete(root, result.skipped if isinstance(result, Scan) else ()))
    if len({s for s, _ in seen}) != 1:
        newest = _by_rank([s for s, _ in seen])
        raise CheckpointError(f"the ranks see different newest checkpoints in {root} ({newest}); every rank"
                              " must read the same directory (a shared file system)")
    if warn is not None and _rank() == 0 and isinstance(result, Scan):
        for line in result.skipped:
            warn(f"{line}; resuming from {found.path.name}")
    md, info = found.metadata.state_dict_metadata, found.info
    mine, optimized, whole = _held(rt)
    want: dict[str, torch.Tensor] = {f"fxpipe.step.rank{r}": torch.zeros((), dtype=torch.int64)
                                     for r in range(info["world"])}
    for fqn, tensor in mine.items():
        want[f"model.{fqn}"] = torch.empty_like(tensor, device="cpu")
    runtime = [k for k in md if k.startswith("fxpipe.runtime.rank0.")]  # none in a checkpoint saved without them
    for key in runtime:
        want[key] = torch.zeros((), dtype=torch.float64)
    optim_keys = _optim_keys(md)
    for fqn in optimized:
        for key, (kind, item) in optim_keys.get(fqn, {}).items():
            want[f"optim.{kind}.{fqn}.{key}"] = torch.empty(item.size, dtype=item.properties.dtype)
    # Every rank checks the whole model: the union of what the ranks hold is what the checkpoint holds.
    held = set().union(*_all_gather(sorted(mine)))
    _raise_first(_all_gather(_model_problem(md, held, mine, root=found.path)))
    import torch.distributed.checkpoint as dcp

    reader, planner = _dcp_classes()
    try:
        with _quiet():
            dcp.load(want, storage_reader=reader(found), planner=planner(), no_dist=not _distributed())
    except (Exception, dcp.CheckpointException) as exc:  # DCP gathers every rank's failure into one
        raise _one_line(exc, "loading") from None
    steps = [int(want[f"fxpipe.step.rank{r}"]) for r in range(info["world"])]
    if any(s != found.step for s in steps):
        raise CheckpointError(f"{found.path} mixes steps: its rank files are of steps {_by_rank(steps)}, its index of "
                              f"step {found.step}; it was not loaded; remove it to resume from the step before")
    optim: dict[str, dict[str, Any]] = {}  # parameter name -> its optimizer state, as saved
    for fqn in optimized:
        values: dict[str, Any] = {}
        for key, (kind, _) in optim_keys.get(fqn, {}).items():
            value = want[f"optim.{kind}.{fqn}.{key}"]
            values[key] = value if kind == "state" else value.item()  # a number is saved as a 0-d tensor
        if values:
            optim[fqn] = values
    model = {fqn: want[f"model.{fqn}"] for fqn in mine}
    numbers = {key.rsplit(".", 1)[1]: float(want[key]) for key in runtime}
    _set_state(rt, model, optim, info["param_groups"], numbers, whole)
    return found.step


def _held(rt: Any) -> tuple[dict[str, torch.Tensor], list[str], dict[str, Any] | None]:
    """This rank's model tensors by name (what it loads), the names of the parameters its optimizers step, and a
    runtime without modules' whole state (read once: the strategy runtime gathers it in a collective)."""
    parts = getattr(rt, "stage_parts", None)
    if parts is None:
        state = rt.state_dict()
        return ({**state["params"], **state["buffers"]}, [f for g in state["param_groups"] for f in g["params"]],
                state)
    mine: dict[str, torch.Tensor] = {}
    optimized: list[str] = []
    for module, optimizer in parts():
        mine |= module.state_dict()
        if optimizer is not None:
            names = {id(p): n for n, p in module.named_parameters()}
            optimized += [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    return mine, optimized, None


# How torch runs a step, not what it computes: the optimizer keeps its own (a state saved by torch's default
# implementation loads into a fused one, and the other way).
_IMPLEMENTATION = frozenset({"params", "fused", "foreach", "capturable", "differentiable"})


def saved_hyperparameters(fqns: list[str], saved: dict[str, dict[str, Any]], group: dict[str, Any]) -> dict[str, Any]:
    """The saved hyperparameters of a group's parameters, for the keys the group has (all must agree); a group
    saved by another kind of optimizer (SGD's momentum against AdamW's betas) is one CheckpointError."""
    found = [saved[f] for f in fqns if f in saved]
    if not found:
        return {}
    kinds = [("adamw" if "betas" in keys else "sgd" if "momentum" in keys else None) for keys in (found[0], group)]
    if None not in kinds and kinds[0] != kinds[1]:
        raise CheckpointError(f"the checkpoint's optimizer is {kinds[0]} and this run's is {kinds[1]}: its state "
                              f"(e.g. {fqns[0]}'s) fits only its own kind; resume with --optimizer {kinds[0]}, or "
                              "start a new run")
    values = {k: tuple(v) if isinstance(group[k], tuple) else v for k, v in found[0].items()
              if k not in _IMPLEMENTATION and k in group}
    for other in found[1:]:
        for k, v in values.items():
            got = other.get(k)
            theirs = tuple(got) if isinstance(v, tuple) and isinstance(got, list) else got
            if theirs != v:
                raise CheckpointError(f"parameters {fqns[0]} and {other['params'][0]} share an optimizer here but had "
                                      f"different {k} when saved ({v} and {theirs}); use one value, or one "
                                      "optimizer group per stage as saved")
    return values


def _set_state(rt: Any, model: dict[str, torch.Tensor], optim: dict[str, dict[str, Any]],
               saved_groups: list[dict[str, Any]], numbers: dict[str, float], whole: dict[str, Any] | None) -> None:
    """Load what this rank read: each stage's module and optimizer through torch's ``set_state_dict`` (the
    optimizer's hyperparameters as saved, its own implementation flags kept), then the runtime's numbers."""
    if whole is not None:  # a runtime without modules: its own load_state_dict, on the whole tensors
        rt.load_state_dict({"params": {n: model[n] for n in whole["params"]},
                            "buffers": {n: model[n] for n in whole["buffers"]}, "optim": optim,
                            "param_groups": saved_groups, "runtime": numbers})
        return
    from torch.distributed.checkpoint.state_dict import set_state_dict

    parts = rt.stage_parts
    by_fqn = {fqn: g for g in saved_groups for fqn in g["params"]}
    for module, optimizer in parts():
        own = module.state_dict()
        if not own:
            continue
        osd: dict[str, Any] = {}
        if optimizer is not None:  # torch's nested form, by parameter name: each group as this run made it
            names = {id(p): n for n, p in module.named_parameters()}
            groups = []
            for group in optimizer.param_groups:
                fqns = [names[id(p)] for p in group["params"]]
                values = {k: v for k, v in group.items() if k != "params"}
                groups.append({"params": fqns, **values, **saved_hyperparameters(fqns, by_fqn, values)})
            osd = {"state": {f: optim[f] for g in groups for f in g["params"] if f in optim}, "param_groups": groups}
        # strict=False: a parameter without saved optimizer state (never stepped) starts without one, as it was;
        # the model's keys are this module's own, all of them (_model_problem checked the checkpoint has them).
        set_state_dict(module, optimizer if optimizer is not None else (),
                       model_state_dict={k: model[k] for k in own}, optim_state_dict=osd,
                       options=_options(strict=False))
    rt.load_runtime_state(numbers)


def _optim_keys(md: dict[str, Any]) -> dict[str, dict[str, tuple[str, TensorStorageMetadata]]]:
    """Optimizer entries of the checkpoint: fqn -> key -> ("state" or "number", its tensor's metadata)."""
    out: dict[str, dict[str, tuple[str, TensorStorageMetadata]]] = {}
    for name, item in md.items():
        for kind in ("state", "number"):
            prefix = f"optim.{kind}."
            if name.startswith(prefix) and "." in name[len(prefix):]:
                fqn, key = name[len(prefix):].rsplit(".", 1)
                out.setdefault(fqn, {})[key] = (kind, item)
    return out


def _model_problem(md: dict[str, Any], held: set[str], mine: dict[str, torch.Tensor], *, root: Path) -> str | None:
    saved = {k[len("model."):] for k in md if k.startswith("model.")}
    missing, extra = sorted(held - saved), sorted(saved - held)
    if missing or extra:
        what = (f"lacks {_few(missing)}" if missing else "") + (" and " if missing and extra else "") + \
               (f"holds {_few(extra)}, which this plan does not" if extra else "")
        return f"{root} is of another model: it {what}; resume with a plan of the model it was saved from"
    for fqn, tensor in mine.items():
        item = md[f"model.{fqn}"]
        if tuple(item.size) != tuple(tensor.shape) or item.properties.dtype != tensor.dtype:
            return (f"{root} holds {fqn} as {item.properties.dtype} {list(item.size)}, this plan as {tensor.dtype} "
                    f"{list(tensor.shape)}; resume with a plan of the model it was saved from (same sizes, same dtype)")
    return None


def _none_complete(root: Path, skipped: Iterable[str]) -> str:
    why = list(skipped)
    if not root.is_dir():
        why = [f"{root} does not exist"]
    elif not why:
        why = [f"{root} holds no step_NNNNNN directory"]
    old = sorted(p.name for p in root.glob("rank*.pt")) if root.is_dir() else []
    if old:
        why.append(f"{', '.join(old)} {'is' if len(old) == 1 else 'are'} of fxpipe's old per-rank format, which is "
                   "no longer loaded (a pickle could run code)")
    return f"no complete checkpoint in {root} ({'; '.join(why)}); start without --resume"


def _one_line(exc: BaseException, doing: str) -> CheckpointError:
    """DCP's CheckpointException (every rank's failure with its traceback) as the first rank's one line."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        inner = first[0] if isinstance(first, tuple) else first
        if isinstance(inner, CheckpointError):
            return CheckpointError(str(inner))
        return CheckpointError(f"{doing} the checkpoint failed on rank {min(failures)}: "
                               f"{first_line(inner)}")
    if isinstance(exc, CheckpointError):
        return CheckpointError(str(exc))
    return CheckpointError(f"{doing} the checkpoint failed: {first_line(exc)}")


# -- small helpers --------------------------------------------------------------------------


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextmanager
def _quiet() -> Iterator[None]:
    """Without a process group DCP warns that it saves or loads in one process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


def _all_gather(value: Any) -> list[Any]:
    """Every rank's ``value`` (plain Python values fxpipe made, never read from a file), by rank."""
    if not _distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _raise_first(errors: list[str | None]) -> None:
    """Raise the first rank's error on every rank, so that no rank waits for one that stopped."""
    for error in errors:
        if error is not None:
            raise CheckpointError(error)


def _by_rank(values: list[Any]) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _write_json(file: Path, value: Any) -> None:
    tmp = file.with_name(file.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (where the platform allows opening a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


__all__ = ["DEFAULT_KEEP", "MARKER", "SCHEMA", "Found", "Scan", "clear", "load", "newest", "read_metadata", "save",
           "scan", "sha256_file", "lock", "step_dir", "wait", "LOCK_FILE"]
