"""A fuzzer over the command line (issue 11): hypothesis picks option values at and past their edges (0,
negative, nan, inf, huge, empty and bracketed strings, missing and unwritable paths) for compile, simulate,
inspect, models and the checks ``run`` makes before any rank starts. Whatever it picks, fxpipe exits 0 or 2
and prints no traceback."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from hypothesis import HealthCheck, given, settings, strategies as st
from typer.testing import CliRunner

from fxpipe.cli.main import app

FUZZ = settings(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

EDGE_NUMBERS = ["0", "1", "2", "3", "-1", "nan", "-nan", "inf", "-inf", "1e308", "1e-320", "1e7", "9" * 30, "0.5",
                "1.5", "0x10", "1_000", "", " ", "[/bold]", "2[bold]"]
numbers = st.one_of(st.sampled_from(EDGE_NUMBERS), st.integers(-3, 9).map(str),
                    st.floats(allow_nan=True, allow_infinity=True).map(repr))
sizes = st.one_of(numbers, st.sampled_from(["8GiB", "1KB", "0B", "-1MB", "nanGB", "infGiB", "1e400", "1.5e9", "1 mib"]))
strings = st.one_of(st.sampled_from(["", " ", "[/bold]", "[bold]x[/]", "auto", "1f1b", "gpipe", "zb-h1", "zb-h2",
                                     "interleaved-1f1b", "layerpipe", "async-1f1b", "node", "1", "2", "trace",
                                     "split-stages", "nope", "-", "--json"]),
                    st.text(max_size=6))
costs = st.one_of(st.tuples(numbers, numbers, numbers).map(",".join), strings)


@dataclass(frozen=True)
class Places:
    plan: Path  # a compiled mlp-tiny plan
    pipeline: Any  # the pipeline saved there (its save is what compile --out runs)
    outputs: tuple[str, ...]  # output paths: fine, missing directory, unwritable, a directory, bracketed


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> Places:
    root = tmp_path_factory.mktemp("fuzz")
    plan = root / "plan"
    import fxpipe
    from fxpipe import models

    zoo = models.build("mlp-tiny")
    pipeline = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2)
    fxpipe.save(pipeline, plan)
    (root / "a-file").write_text("")
    return Places(plan, pipeline, (str(root / "t.out"), str(root / "missing" / "t.out"), str(root / "a-file" / "t.out"),
                         str(root), str(root / "x[/bold]y.out"), ""))


def check(args: list[str]) -> Result:
    result = CliRunner().invoke(app, args)
    assert result.exit_code in (0, 2), f"fxpipe {' '.join(map(repr, args))}: exit {result.exit_code}\n{result.output}"
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        f"fxpipe {' '.join(map(repr, args))}: {result.exception!r}\n{result.output}"
    assert "Traceback" not in result.output, f"fxpipe {' '.join(map(repr, args))}\n{result.output}"
    return result


def options(draw: Any, pairs: dict[str, st.SearchStrategy[str]]) -> list[str]:
    """Some of ``pairs``' options, each with a drawn value."""
    chosen = draw(st.lists(st.sampled_from(sorted(pairs)), unique=True, max_size=4))
    return [item for name in chosen for item in (name, draw(pairs[name]))]


@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_simulate(places: Places, data: st.DataObject) -> None:
    outputs = st.sampled_from(places.outputs)
    target = data.draw(st.sampled_from([[], [str(places.plan)], ["[/bold]"], [places.outputs[1]]]))
    args = ["simulate", *target, *options(data.draw, {
        "--schedule": strings, "--microbatches": numbers, "--stages": numbers, "--uniform-costs": costs,
        "--activation-memory-per-stage": sizes, "--trace": outputs, "--svg": outputs, "--optimizer": strings,
        "--momentum": numbers})]
    args += data.draw(st.sampled_from([[], ["--json"], ["--plain"]]))
    check(args)


@settings(FUZZ, max_examples=20)
@given(data=st.data())
def test_compile(places: Places, data: st.DataObject) -> None:
    outputs = st.sampled_from(places.outputs[1:])  # never a real plan written per example (slow), but every refusal
    args = ["compile", "mlp-tiny", *options(data.draw, {
        "--stages": numbers, "--granularity": strings, "--bandwidth": sizes, "--latency": numbers,
        "--memory-per-stage": sizes, "--microbatches": numbers, "--schedule": strings, "--device-flops": numbers,
        "--device-mem-bw": sizes, "--batch-size": numbers, "--seed": numbers, "--stop-after": strings,
        "--print-after": strings, "--out": outputs, "--profile-threads": numbers}), "--json"]
    check(args)


@settings(FUZZ, max_examples=25)
@given(data=st.data())
def test_inspect_and_models(places: Places, data: st.DataObject) -> None:
    path = data.draw(st.sampled_from([str(places.plan), *places.outputs]) | strings)
    fmt = data.draw(st.sampled_from([[], ["--json"], ["--plain"]]))
    check(["inspect", path, *fmt])
    check(["models", *fmt])


@settings(FUZZ, max_examples=25)
@given(data=st.data())
def test_run_refuses_before_any_rank_starts(places: Places, data: st.DataObject) -> None:
    # --data is never a known source, so every run is refused before a rank starts; the fuzzer shows that the
    # checks before it (schedule, microbatches, ranks, checkpoint and trace paths) refuse in one line too.
    # (no ':' beyond the known prefixes: MODULE:FUNCTION would import and call whatever it names)
    bad_data = strings.filter(lambda s: s.strip() not in ("synthetic", "digits") and not s.startswith(("-", "text:"))
                              and ":" not in s)
    args = ["run", str(places.plan), "--data", data.draw(bad_data), *options(data.draw, {
        "--nproc": numbers, "--steps": numbers, "--schedule": strings, "--microbatches": numbers, "--lr": numbers,
        "--timeout": numbers, "--trace": st.sampled_from(places.outputs)}), "--json"]
    result = check(args)
    assert result.exit_code == 2


# -- files (issue 41): mutated plan and checkpoint directories --------------------------------------------------
#
# Each example copies a good directory, mutates it (JSON structure, nesting depth, sizes, symbolic links into a
# sibling "user" directory, foreign files, bytes changed at the same size) and runs what reads or rewrites it:
# inspect and simulate (in this process, as the CLI), the save behind compile --out, and checkpoint resume,
# clear and pruning. Whatever the mutation: exit 0 or 2 and no traceback (or an fxpipe error from the API), no
# file outside the command's own output changed (the user directory hashed before and after), a checkpoint is
# either refused or loads the very values saved at its step, and the process's peak memory stays bounded.

import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import struct  # noqa: E402

from tests._helpers import tree as _tree  # noqa: E402

BOUNDS = {"plan.json": 256 * 2**20, "fxpipe-checkpoint.json": 64 * 2**20}
MEMORY_BOUND_MIB = 3 * 1024  # far above what these small plans need; a claimed 10^13 elements would pass it



def tree(root: Path) -> dict[str, str]:
    """Every entry under ``root`` without following links; a file by its size and the sha256 of its head."""
    return _tree(root, lambda path: f"{path.stat().st_size} {_head_sha256(path)}")


def _head_sha256(path: Path) -> str:
    """The sha256 of the first 16 MiB (the sparse files past the size bounds are larger, and all zeros there)."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(16 * 2**20)).hexdigest()


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                                     st.text(max_size=5)),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                        max_size=3),
                           max_leaves=8)


def _json_paths(doc: Any, prefix: tuple[Any, ...] = (), depth: int = 0) -> list[tuple[Any, ...]]:
    paths = [prefix]
    if depth < 4 and isinstance(doc, dict):
        for k, v in doc.items():
            paths += _json_paths(v, (*prefix, k), depth + 1)
    elif depth < 4 and isinstance(doc, list):
        for i, v in enumerate(doc[:3]):
            paths += _json_paths(v, (*prefix, i), depth + 1)
    return paths


def mutate(data: st.DataObject, root: Path, user: Path, names: list[str]) -> str:
    """Apply one drawn mutation to the files ``names`` of ``root``; returns what it did (for the failure message)."""
    kind = data.draw(st.sampled_from(["json", "nest", "size", "bytes", "tensor", "link-file", "link-dir", "foreign",
                                      "truncate"]))
    if kind == "tensor":  # a checkpoint's tensor values themselves, changed at the same size
        name = data.draw(st.sampled_from([n for n in names if n.endswith(".distcp")] or names))
    else:
        name = data.draw(st.sampled_from(names))
    path = root / name
    if kind == "tensor":
        raw = bytearray(path.read_bytes())
        step = int(path.parent.name.split("_")[-1]) if path.parent.name.startswith("step_") else 0
        at = raw.find(struct.pack("<d", float(step)) * 6)  # the step's weight, as _OneRank saved it
        if at >= 0:
            raw[at + data.draw(st.integers(0, 47))] ^= data.draw(st.sampled_from([0x01, 0x80, 0xFF]))
            path.write_bytes(bytes(raw))
    elif kind == "json" and path.suffix == ".json":
        try:
            doc = json.loads(path.read_bytes())
        except ValueError:  # an earlier mutation broke it
            return f"{kind} {name} (not JSON)"
        where = data.draw(st.sampled_from(_json_paths(doc)))
        value = data.draw(json_values)
        if not where:
            doc = value
        else:
            parent = doc
            for k in where[:-1]:
                parent = parent[k]
            parent[where[-1]] = value
        path.write_text(json.dumps(doc))
    elif kind == "nest":
        depth = data.draw(st.sampled_from([99, 101, 1000, 200_000]))
        path.write_text("[" * depth + "]" * depth)
    elif kind == "size" and path.name in BOUNDS:
        with open(path, "ab") as f:  # sparse: just past its size bound without writing it
            f.truncate(BOUNDS[path.name] + 1)
    elif kind == "bytes" and path.stat().st_size > 0:
        raw = bytearray(path.read_bytes())
        at = data.draw(st.integers(0, 2**20)) % len(raw)  # drawn independently of the size (which varies by a byte)
        for i in range(at, min(len(raw), at + data.draw(st.integers(1, 10_000)))):
            raw[i] ^= data.draw(st.sampled_from([0x01, 0x5A, 0xFF]))
        path.write_bytes(bytes(raw))  # the same size
    elif kind == "link-file":
        path.unlink() if path.is_file() else shutil.rmtree(path)
        path.symlink_to(user / "data.txt")
    elif kind == "link-dir":
        target = root / data.draw(st.sampled_from(["stage_9.json", "notes", "step_000009", "step_000002"]))
        if target.exists() or target.is_symlink():
            shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
        target.symlink_to(user)
    elif kind == "foreign":
        target = root / data.draw(st.sampled_from(["plan.json", "stage_1.py", "stage_2.py", "stage_0.pt",
                                                   "step_000002/notes.txt", "step_000004/.metadata", ".metadata"]))
        target.parent.mkdir(exist_ok=True)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        target.write_text("the user's")
    elif kind == "truncate":
        path.write_bytes(path.read_bytes()[: data.draw(st.integers(0, 64))])
    return f"{kind} {name}"


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    user = tmp_path_factory.mktemp("user")
    (user / "data.txt").write_text("the user's data")
    (user / "step_000007").mkdir()
    (user / "step_000007" / ".metadata").write_text("the user's")
    (user / "step_000007" / "__0_0.distcp").write_text("the user's")
    return user


@settings(FUZZ, max_examples=30)
@given(data=st.data())
def test_mutated_plan_directories(places: Places, user_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                                  data: st.DataObject) -> None:
    import fxpipe
    from fxpipe.errors import FxpipeError

    work = tmp_path_factory.mktemp("plan-fuzz")
    plan = work / "plan"
    shutil.copytree(places.plan, plan)
    done = [mutate(data, plan, user_dir, sorted(os.listdir(places.plan)))
            for _ in range(data.draw(st.integers(1, 2)))]
    user_before, plan_before = tree(user_dir), tree(plan)
    for args in (["inspect", str(plan), "--json"], ["simulate", str(plan), "--json"]):
        check(args)
        assert tree(plan) == plan_before, (done, args)  # read-only commands
    try:
        fxpipe.load(plan)
    except FxpipeError:
        pass
    pipe = places.pipeline
    overwrite = data.draw(st.booleans())
    try:
        fxpipe.save(pipe, plan, overwrite=overwrite)
    except FxpipeError as exc:
        assert "\n" not in str(exc)
        assert tree(plan) == plan_before, (done, str(exc))  # refused: nothing changed
    else:
        fxpipe.load(plan)  # what it wrote loads
    assert tree(user_dir) == user_before, done
    assert peak_mib() < MEMORY_BOUND_MIB
    shutil.rmtree(work)


@settings(FUZZ, max_examples=30)
@given(data=st.data())
def test_mutated_checkpoint_directories(places: Places, user_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                                        data: st.DataObject) -> None:
    from fxpipe.errors import CheckpointError
    from fxpipe.runtime import checkpoint
    from tests._helpers import OneRank as _OneRank, saved_checkpoints as _saved

    work = tmp_path_factory.mktemp("ck-fuzz")
    root = _saved(work / "ck", range(1, 4))
    names = sorted(f"{step.name}/{f}" for step in root.iterdir() for f in os.listdir(step))
    done = [mutate(data, root, user_dir, names) for _ in range(data.draw(st.integers(1, 2)))]
    user_before = tree(user_dir)
    rt = _OneRank(0.0)
    try:
        step = checkpoint.load(rt, root)
    except CheckpointError as exc:
        assert "\n" not in str(exc), done
    else:  # a step that loads holds what was saved at that step, never damaged values
        assert rt.loaded is not None, done
        assert torch_equal_full(rt.loaded["params"]["a.weight"], float(step)), (done, step)
    # fxpipe run --resume checks the directory before any rank starts; every step here is at or past --steps 1, so
    # it is always refused, in one line; with the lock held by another run, refused before reading anything
    held = checkpoint.lock(root) if data.draw(st.booleans()) else None
    try:
        result = check(["run", str(places.plan), "--checkpoint-dir", str(root), "--resume", "always", "--steps", "1"])
        assert result.exit_code == 2 and (held is None or "in use by another fxpipe run" in result.output), done
    finally:
        if held is not None:
            held.close()
    action = data.draw(st.sampled_from(["clear", "prune"]))
    try:
        if action == "clear":
            checkpoint.clear(root)
        else:
            checkpoint.save(_OneRank(9.0), root, 9, keep=1)
    except CheckpointError as exc:
        assert "\n" not in str(exc), done
    assert tree(user_dir) == user_before, (done, action)
    assert peak_mib() < MEMORY_BOUND_MIB
    shutil.rmtree(work, ignore_errors=True)


def torch_equal_full(tensor: Any, value: float) -> bool:
    import torch

    return bool(torch.equal(tensor, torch.full_like(tensor, value)))


# -- outputs: log directories, configs and traces ---------------------------------------------------------------
#
# Each example lays out what a user may leave where fxpipe writes: a link (to a user's file, dangling, to a device),
# a FIFO, a user's own file, a directory, at the names fxpipe writes (config.toml, metrics.jsonl, their old
# temporary names, a trace, an SVG), then runs the writers fxpipe run and simulate use. Whatever it finds: each
# writer succeeds or raises one fxpipe error, and no file outside what fxpipe owns changes.

OUTPUT_NAMES = ["config.toml", "metrics.jsonl", ".config.toml.tmp", ".metrics.jsonl.tmp", "t.json", "t.svg"]


def lay_out(data: st.DataObject, root: Path, user: Path) -> list[str]:
    done = []
    for name in data.draw(st.lists(st.sampled_from(OUTPUT_NAMES), max_size=3, unique=True)):
        kind = data.draw(st.sampled_from(["link", "dangling", "device", "fifo", "user", "dir"]))
        path = root / name
        if kind == "link":
            path.symlink_to(user / "data.txt")
        elif kind == "dangling":
            path.symlink_to(user / "made-by-a-link.txt")
        elif kind == "device":
            path.symlink_to("/dev/zero")
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "user":
            path.write_text("the user's")
        else:
            path.mkdir()
        done.append(f"{kind} {name}")
    return done


def write_outputs(root: Path) -> None:
    """What fxpipe run and simulate write into a log directory and trace paths, each allowed to refuse."""
    from fxpipe.cli import run_log
    from fxpipe.errors import FxpipeError
    from fxpipe.schedules.generators import generate
    from fxpipe.schedules.simulate import Costs, simulate
    from fxpipe.schedules.timeline import write_chrome_trace, write_svg

    result = simulate(generate("1f1b", 2, 2), Costs.uniform(2, 1.0, 1.0, 1.0))
    writers = [lambda: run_log.check_log_dir(root, continuing=True),
               lambda: run_log.write_config(root, f"{run_log.MARK}\nsteps = 3\n"),
               lambda: run_log.StepLog(root, rank=0, world=1, device=None, samples=1, tokens=None, first=1)
               .write(2, 1.0, 0.01, None, (None, __import__("torch").zeros(2))),
               lambda: write_chrome_trace(result, root / "t.json"),
               lambda: write_svg(result, root / "t.svg")]
    for write in writers:
        try:
            write()
        except FxpipeError as exc:
            assert "\n" not in str(exc), str(exc)


@settings(FUZZ, max_examples=40)
@given(data=st.data())
def test_mutated_output_places(user_dir: Path, tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    work = tmp_path_factory.mktemp("out-fuzz")
    done = lay_out(data, work, user_dir)
    user_before = tree(user_dir)
    write_outputs(work)
    assert tree(user_dir) == user_before, done
    assert not (user_dir / "made-by-a-link.txt").exists(), done
    shutil.rmtree(work)


def test_the_output_fuzzer_finds_a_write_through_a_link_without_the_safe_writer(
        user_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: with fxpipe.files' writer swapped for a plain one (open and write, as before),
    one of its layouts (a link at the trace's name) changes the user's file."""
    import fxpipe.files
    import fxpipe.schedules.timeline as timeline

    def plain(path: Any, data: Any, **_: Any) -> Path:
        Path(path).write_text(data if isinstance(data, str) else data.decode())
        return Path(path)

    monkeypatch.setattr(timeline, "write_file", plain)
    monkeypatch.setattr(fxpipe.files, "write_file", plain)
    user = tmp_path / "user"
    shutil.copytree(user_dir, user)
    before = tree(user)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "t.json").symlink_to(user / "data.txt")
    write_outputs(tmp_path / "out")
    assert tree(user) != before


# -- inputs: config files and data files ----------------------------------------------------------------------
#
# What a user may hand fxpipe run as --config or as a --data file: mutated TOML (wrong types, unknown keys, deep
# nesting, long lines and keys, bytes that are not text), FIFOs, devices, links to them, directories, token-id
# files with huge or negative ids. Whatever it is: exit 0 or 2, no traceback, no hang, bounded memory; the ranks
# are never reached (their start is replaced by a refusal, so a valid combination ends in exit 2 too).

CONFIG_LINES = ["steps = 2", "steps = \"2\"", "steps = -1", "steps = 1e400", "lr = nan", "lr = inf", "nproc = 0",
                "checkpoint_every = 2", "unknown-key = 1", "schedule = \"zb-h1\"", "microbatches = 1000000",
                "a.b.c = 1", "steps = [1, 2]", "[table]", "x = {a = {b = 1}}", "resume = \"sometimes\"",
                "data = \"text:/dev/zero\"", "data = \"jsonl:/dev/urandom\"", "timeout = 0", "trace = \"\"",
                "max-restarts = 1000000000", "=", "\"unterminated = 1", "steps = 2 # a comment with ' and \""]


def _config_text(data: st.DataObject) -> bytes:
    lines = data.draw(st.lists(st.sampled_from(CONFIG_LINES), max_size=6))
    kind = data.draw(st.sampled_from(["lines", "deep", "long-line", "long-key", "binary"]))
    text = "\n".join(lines) + "\n"
    if kind == "deep":
        depth = data.draw(st.sampled_from([31, 33, 1000, 100_000]))
        text += "x = " + "[" * depth + "]" * depth + "\n"
    elif kind == "long-line":
        text += "x = \"" + "a" * data.draw(st.sampled_from([4090, 5000, 2_000_000])) + "\"\n"
    elif kind == "long-key":
        text += ".".join(["k"] * data.draw(st.sampled_from([100, 50_000]))) + " = 1\n"
    elif kind == "binary":
        return text.encode() + bytes(data.draw(st.lists(st.integers(0, 255), max_size=64)))
    return text.encode()


@pytest.fixture
def ranks_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpipe.cli import ranks
    from fxpipe.errors import RankFailedError

    def refuse(*_: Any, **__: Any) -> Any:
        raise RankFailedError("the fuzzer starts no ranks")

    monkeypatch.setattr(ranks, "run_ranks", refuse)


@settings(FUZZ, max_examples=40, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_config_files(places: Places, tmp_path_factory: pytest.TempPathFactory, ranks_refused: None,
                              data: st.DataObject) -> None:
    work = tmp_path_factory.mktemp("config-fuzz")
    config = work / "run.toml"
    place = data.draw(st.sampled_from(["file", "fifo", "link-to-device", "directory"]))
    if place == "file":
        config.write_bytes(_config_text(data))
    elif place == "fifo":
        os.mkfifo(config)
    elif place == "link-to-device":
        config.symlink_to(data.draw(st.sampled_from(["/dev/zero", "/dev/urandom", "/dev/null"])))
    else:
        config.mkdir()
    result = check(["run", str(places.plan), "--config", str(config), "--json"])
    assert result.exit_code == 2, (place, result.output)
    assert peak_mib() < MEMORY_BOUND_MIB
    shutil.rmtree(work)


@settings(FUZZ, max_examples=40, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_data_files(places: Places, tmp_path_factory: pytest.TempPathFactory, ranks_refused: None,
                            data: st.DataObject) -> None:
    work = tmp_path_factory.mktemp("data-fuzz")
    target = work / "data"
    place = data.draw(st.sampled_from(["text", "ids", "fifo", "device", "directory", "missing", "empty"]))
    if place == "text":
        target.write_bytes(bytes(data.draw(st.lists(st.integers(0, 255), max_size=200))))
    elif place == "ids":
        ids = data.draw(st.lists(st.one_of(st.integers(-5, 300), st.just(10**30), st.just("x"), st.none()),
                                 max_size=40))
        target.write_text(json.dumps(ids) + "\n" + data.draw(st.sampled_from(["", "[1, 2", "{}", "[]"])))
    elif place == "fifo":
        os.mkfifo(target)
    elif place == "device":
        target.symlink_to(data.draw(st.sampled_from(["/dev/zero", "/dev/urandom"])))
    elif place == "directory":
        target.mkdir()
    elif place == "empty":
        target.write_bytes(b"")
    kind = data.draw(st.sampled_from(["text", "jsonl", "hf"]))
    result = check(["run", str(places.plan), "--data", f"{kind}:{target}", "--json"])
    assert result.exit_code == 2, (place, kind, result.output)
    assert peak_mib() < MEMORY_BOUND_MIB
    shutil.rmtree(work)


# -- stage graphs: control flow and computed sizes --------------------------------------------------------------
#
# A plan whose stage graph was edited, its checksum updated as an attacker would: a node turned into a control-flow
# operator (a loop that may never end, a branch, a map or scan over subgraphs it does not have), or a tensor whose
# size is computed from an input's at run time (what only a run on the meta device sees), or a random real operator
# with the node's own arguments. inspect loads the plan and runs it on the meta device, as fxpipe run's launcher
# does: exit 0 or 2, one line naming the stage file where refused, no traceback, bounded memory and no hang.

CONTROL_FLOW = ["higher_order.while_loop", "higher_order.cond", "higher_order.map_impl", "higher_order.scan",
                "higher_order.associative_scan", "higher_order.invoke_subgraph", "higher_order.flex_attention",
                "torch.cond", "torch._higher_order_ops.while_loop.while_loop"]
ANY_OPS = ["aten.ones.default", "aten.arange.default", "aten.empty.memory_format", "aten.full.default",
           "aten.repeat.default", "aten.expand.default", "aten.randn.default", "aten.mm.default"]


def _graph_edit(data: st.DataObject, doc: dict[str, Any]) -> str:
    nodes = doc["nodes"]
    calls = [n for n in nodes if n["op"] == "call_function"]
    node = data.draw(st.sampled_from(calls))
    tensor = next(n["name"] for n in nodes if n["op"] == "placeholder")
    kind = data.draw(st.sampled_from(["control-flow", "computed-size", "literal-size", "any-op"]))
    if kind == "control-flow":
        node["target"] = data.draw(st.sampled_from(CONTROL_FLOW))
        return f"{kind} {node['target']}"
    if kind == "computed-size":  # batch rows x 10^10 elements: known only when the graph runs
        factor = data.draw(st.sampled_from([10**10, 10**11, 2**40]))
        rows = {"name": "fz_rows", "op": "call_function", "target": "aten.sym_size.int",
                "args": {"tuple": [{"node": tensor}, 0]}, "kwargs": {"dict": {}}}
        size = {"name": "fz_size", "op": "call_function", "target": "_operator.mul",
                "args": {"tuple": [{"node": "fz_rows"}, factor]}, "kwargs": {"dict": {}}}
        nodes[nodes.index(node):nodes.index(node)] = [rows, size]
        node.update(target=data.draw(st.sampled_from(["aten.ones.default", "aten.empty.memory_format"])),
                    args={"tuple": [[{"node": "fz_size"}]]}, kwargs={"dict": {}})
        return f"{kind} x{factor}"
    if kind == "literal-size":
        node.update(target="aten.arange.default", args={"tuple": [data.draw(st.sampled_from([1e11, 10**11]))]},
                    kwargs={"dict": {}})
        return kind
    node["target"] = data.draw(st.sampled_from(ANY_OPS))
    return f"{kind} {node['target']}"


@settings(FUZZ, max_examples=30)
@given(data=st.data())
def test_mutated_stage_graphs(places: Places, tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    work = tmp_path_factory.mktemp("graph-fuzz")
    plan = work / "plan"
    shutil.copytree(places.plan, plan)
    stages = sorted(p.name for p in plan.glob("stage_*.json") if not p.name.endswith(".fbw.json"))
    name = data.draw(st.sampled_from(stages))
    doc = json.loads((plan / name).read_text())
    done = _graph_edit(data, doc)
    (plan / name).write_text(json.dumps(doc))
    index = json.loads((plan / "plan.json").read_text())
    index["sha256"][name] = hashlib.sha256((plan / name).read_bytes()).hexdigest()
    (plan / "plan.json").write_text(json.dumps(index))
    result = check(["inspect", str(plan), "--json"])
    if not done.startswith("any-op"):  # every loop, branch and oversized tensor is refused at load
        assert result.exit_code == 2, (done, result.output)
        message = result.output.strip()
        assert name in message and len(message.splitlines()) == 1, (done, message)
    assert peak_mib() < MEMORY_BOUND_MIB
    shutil.rmtree(work)
