"""Tests for the plan directory: Pipeline.save / fxpipe.load round trips, corrupt plans, replacing plans."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe import models
from fxpipe.errors import PlanFileError
from tests._helpers import run_forked


@dataclasses.dataclass
class RoundTrip:
    """A zoo model run eagerly, through its compiled pipeline and through that pipeline saved and loaded.

    Each ran one forward and backward on the same batch, in train mode; the plan was saved before.
    """

    zoo: models.ZooModel
    plan_dir: Path
    eager: torch.nn.Module
    pipe: fxpipe.Pipeline
    loaded: fxpipe.Pipeline
    outputs: dict[str, Any]


def _round_trip(name: str, root: Path) -> RoundTrip:
    zoo = models.build(name)
    eager = copy.deepcopy(zoo.model)
    pipe = fxpipe.compile(copy.deepcopy(zoo.model), zoo.example_inputs, stages=2)
    plan_dir = fxpipe.save(pipe, root / name)
    loaded = fxpipe.load(plan_dir)
    outputs = {}
    for label, module in (("eager", eager), ("pipe", pipe), ("loaded", loaded)):
        torch.manual_seed(0)
        out = module(*zoo.example_inputs)
        zoo.loss_fn(out, zoo.example_target).backward()
        outputs[label] = out.detach()
    return RoundTrip(zoo, plan_dir, eager, pipe, loaded, outputs)


ROUND_TRIP_MODELS = ("gpt-tiny", "resnet-tiny", "mlp-tiny")


# Loading rebuilds each stage's graph from data: ops whose inputs are all constants or attributes
# (arange, randn, BatchNorm's counter update) must stay ops, not results computed once at load time.


@pytest.fixture(scope="module")
def trips(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``trips(name)``: the RoundTrip of a zoo model, built once per module."""
    cache: dict[str, RoundTrip] = {}
    root = tmp_path_factory.mktemp("plans")

    def get(name: str) -> RoundTrip:
        if name not in cache:
            cache[name] = _round_trip(name, root)
        return cache[name]

    return get


@pytest.fixture(params=ROUND_TRIP_MODELS)
def trip(request: pytest.FixtureRequest, trips: Any) -> RoundTrip:
    return trips(request.param)


@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory: pytest.TempPathFactory) -> tuple[models.ZooModel, fxpipe.Pipeline, Path]:
    """A saved mlp-tiny plan, never modified: tests that corrupt a plan corrupt a copy."""
    zoo = models.build("mlp-tiny")
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2)
    return zoo, pipe, fxpipe.save(pipe, tmp_path_factory.mktemp("mlp") / "plan")


@pytest.fixture
def plan_copy(mlp_plan: tuple[models.ZooModel, fxpipe.Pipeline, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(mlp_plan[2], tmp_path / "plan"))


def _stage_items(pipe: fxpipe.Pipeline, kind: str) -> list[tuple[int, str, torch.Tensor]]:
    return [(stage.index, name, t) for stage in pipe.stages
            for name, t in getattr(stage.module, f"named_{kind}")(remove_duplicate=False)]


def _leftovers(parent: Path, name: str) -> list[str]:
    """Temporary or backup directories a save might have left next to ``name``."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


# -- round trip --------------------------------------------------------------------------------------


def test_loaded_output_equals_pipeline_and_eager(trip: RoundTrip) -> None:
    torch.testing.assert_close(trip.outputs["pipe"], trip.outputs["eager"])
    torch.testing.assert_close(trip.outputs["loaded"], trip.outputs["pipe"])


def test_loaded_gradients_equal_pipeline_and_eager(trip: RoundTrip) -> None:
    # Tied weights have several names in the model (gpt: wte.weight and lm_head.weight); export keeps one.
    eager_params = dict(trip.eager.named_parameters(remove_duplicate=False))
    pipe_params = _stage_items(trip.pipe, "parameters")
    loaded_params = _stage_items(trip.loaded, "parameters")
    assert [(k, n) for k, n, _ in loaded_params] == [(k, n) for k, n, _ in pipe_params]
    assert {n for _, n, _ in pipe_params} <= set(eager_params)
    assert len({n for _, n, _ in pipe_params}) == len(list(trip.eager.parameters()))
    for (k, name, mine), (_, _, theirs) in zip(loaded_params, pipe_params):
        assert mine.grad is not None, f"stage {k} {name} got no gradient after load"
        torch.testing.assert_close(mine.grad, theirs.grad, msg=lambda m: f"stage {k} {name}: {m}")
        torch.testing.assert_close(mine.grad, eager_params[name].grad, msg=lambda m: f"stage {k} {name}: {m}")


def test_loaded_parameters_keep_their_values_and_requires_grad(trip: RoundTrip) -> None:
    for (k, name, mine), (_, _, theirs) in zip(_stage_items(trip.loaded, "parameters"),
                                               _stage_items(trip.pipe, "parameters")):
        assert isinstance(mine, torch.nn.Parameter)
        assert mine is not theirs
        assert mine.requires_grad == theirs.requires_grad
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
        # No optimizer step ran, so the values are still the saved ones.
        torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=0, atol=0, msg=lambda m: f"{k} {name}: {m}")


@pytest.mark.parametrize("name", [
    "gpt-tiny",
    "resnet-tiny",
    "mlp-tiny",
])
def test_loaded_buffers_equal_pipeline_and_eager(name: str, trips: Any) -> None:
    trip = trips(name)
    pipe_buffers = _stage_items(trip.pipe, "buffers")
    loaded_buffers = _stage_items(trip.loaded, "buffers")
    assert [(k, n) for k, n, _ in loaded_buffers] == [(k, n) for k, n, _ in pipe_buffers]
    eager_buffers = dict(trip.eager.named_buffers())
    for (k, name, mine), (_, _, theirs) in zip(loaded_buffers, pipe_buffers):
        # After one train-mode step each, BatchNorm statistics moved the same way in all three.
        torch.testing.assert_close(mine, theirs, msg=lambda m: f"stage {k} buffer {name}: {m}")
        torch.testing.assert_close(mine, eager_buffers[name], msg=lambda m: f"stage {k} buffer {name}: {m}")


def test_resnet_stages_hold_batchnorm_statistics(trips: Any) -> None:
    names = [n for _, n, _ in _stage_items(trips("resnet-tiny").pipe, "buffers")]
    assert any(n.endswith("running_mean") for n in names) and any(n.endswith("num_batches_tracked") for n in names)


@pytest.mark.parametrize("name", [
    "gpt-tiny",
    "resnet-tiny",
    "mlp-tiny",
])
def test_loaded_stage_graphs_run_the_same_ops(name: str, trips: Any) -> None:
    trip = trips(name)

    def ops(pipe: fxpipe.Pipeline) -> list[list[str]]:
        return [[str(n.target) for n in stage.module.graph.nodes if n.op == "call_function"] for stage in pipe.stages]

    assert ops(trip.loaded) == ops(trip.pipe)


class Noisy(torch.nn.Module):
    """Adds fresh noise on every call: a factory op (aten.randn) with only constant inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h + torch.randn(h.shape))


def test_loaded_pipeline_draws_fresh_random_numbers_each_call(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = Noisy(), torch.randn(2, 4)
    pipe = fxpipe.compile(model, (x,), stages=2)
    assert not torch.equal(pipe(x), pipe(x))
    loaded = fxpipe.load(fxpipe.save(pipe, tmp_path / "plan"))
    assert not torch.equal(loaded(x), loaded(x))


def test_buffers_listed_in_plan_json_are_in_the_weights_file(trip: RoundTrip) -> None:
    doc = json.loads((trip.plan_dir / "plan.json").read_text())
    for stage in doc["stages"]:
        state = torch.load(trip.plan_dir / stage["weights"], weights_only=True)
        names = [p["name"] for p in stage["parameters"]] + [b["name"] for b in stage["buffers"]]
        assert sorted(names) == sorted(state)
        for info in stage["parameters"] + stage["buffers"]:
            assert list(state[info["name"]].shape) == info["shape"]


def test_loaded_gpt_shares_the_tied_parameter_across_stages(tmp_path: Path) -> None:
    zoo = models.build("gpt-tiny")
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2)
    loaded = fxpipe.load(fxpipe.save(pipe, tmp_path / "plan"))
    assert loaded.shared_params == pipe.shared_params == {"lm_head.weight": [0, 1]}
    first = loaded.stages[0].module.get_parameter("lm_head.weight")
    last = loaded.stages[1].module.get_parameter("lm_head.weight")
    assert first is last
    assert isinstance(first, torch.nn.Parameter)
    assert first is not zoo.model.lm_head.weight
    # One Parameter: counted once, and a gradient from both stages lands in one .grad.
    assert sum(1 for p in loaded.parameters() if p is first) == 1
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in zoo.model.parameters())


def test_load_keeps_names_specs_reports_and_info(trip: RoundTrip) -> None:
    loaded, pipe = trip.loaded, trip.pipe
    assert loaded.num_stages == pipe.num_stages == 2
    assert loaded.input_names == pipe.input_names
    assert loaded.output_names == pipe.output_names
    assert [(s.inputs, s.outputs) for s in loaded.stages] == [(s.inputs, s.outputs) for s in pipe.stages]
    assert loaded.in_spec == pipe.in_spec and loaded.out_spec == pipe.out_spec
    assert loaded.history is None
    assert [r.to_json() for r in loaded.report()] == json.loads(json.dumps([r.to_json() for r in pipe.report()]))
    assert list(loaded.plan.bounds) == list(pipe.plan.bounds)


@pytest.mark.parametrize("name", [
    "mlp-tiny",
    "resnet-tiny",
])
def test_fx_traced_plan_round_trips(name: str, tmp_path: Path) -> None:
    zoo = models.build(name)
    eager = copy.deepcopy(zoo.model)
    pipe = fxpipe.compile(copy.deepcopy(zoo.model), zoo.example_inputs, stages=2, tracer="fx")
    assert any(n.op == "call_module" for s in pipe.stages for n in s.module.graph.nodes)
    loaded = fxpipe.load(fxpipe.save(pipe, tmp_path / "plan"))
    expected = eager(*zoo.example_inputs)
    out = loaded(*zoo.example_inputs)
    torch.testing.assert_close(out, expected)
    zoo.loss_fn(expected, zoo.example_target).backward()
    zoo.loss_fn(out, zoo.example_target).backward()
    eager_params = dict(eager.named_parameters())
    loaded_params = _stage_items(loaded, "parameters")
    assert sorted(n for _, n, _ in loaded_params) == sorted(eager_params)
    for k, pname, param in loaded_params:
        torch.testing.assert_close(param.grad, eager_params[pname].grad, msg=lambda m: f"stage {k} {pname}: {m}")


# -- the stage files ---------------------------------------------------------------------------------


def test_stage_files_are_graph_data_tensors_and_readable_python(trip: RoundTrip) -> None:
    doc = json.loads((trip.plan_dir / "plan.json").read_text())
    assert doc["schema"] == "fxpipe.plan/v3"
    assert doc["num_stages"] == len(doc["stages"]) == 2
    for k, stage in enumerate(doc["stages"]):
        assert stage["index"] == k
        assert (stage["graph"], stage["weights"], stage["source"]) == (f"stage_{k}.json", f"stage_{k}.pt",
                                                                        f"stage_{k}.py")
        assert json.loads((trip.plan_dir / stage["graph"]).read_text())["format"] == "fxpipe.graph/v1"
        source = (trip.plan_dir / stage["source"]).read_text()
        compile(source, stage["source"], "exec")  # raises SyntaxError if it is not Python
        assert "\ndef forward(self" in source
        assert source.startswith(f'"""fxpipe stage {k} of 2')
        assert "fxpipe never imports or runs this file" in source
    assert sorted(doc["files"]) == sorted(p.name for p in trip.plan_dir.iterdir() if p.name != "plan.json")


def test_load_does_not_need_the_model_source(tmp_path: Path) -> None:
    source = tmp_path / "my_model.py"
    source.write_text(textwrap.dedent("""\
        import torch
        from torch import nn


        class Residual(nn.Module):
            def __init__(self, width):
                super().__init__()
                self.fc = nn.Linear(width, width)

            def forward(self, x):
                return x + torch.tanh(self.fc(x))


        class MyModel(nn.Module):
            def __init__(self):
                super().__init__()
                self.inp = nn.Linear(6, 12)
                self.blocks = nn.Sequential(Residual(12), Residual(12), Residual(12))
                self.out = nn.Linear(12, 3)

            def forward(self, x):
                return self.out(self.blocks(self.inp(x)))
    """))
    spec = importlib.util.spec_from_file_location("fxpipe_test_my_model", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = module.MyModel()
    x = torch.randn(5, 6)
    pipe = fxpipe.compile(model, (x,), stages=2)
    plan_dir = fxpipe.save(pipe, tmp_path / "plan")
    torch.save({"x": x, "expected": model(x).detach()}, tmp_path / "io.pt")
    source.unlink()
    del module, model, pipe

    script = textwrap.dedent(f"""\
        import sys
        import torch
        import fxpipe
        pipe = fxpipe.load({str(plan_dir)!r})
        io = torch.load({str(tmp_path / "io.pt")!r})
        torch.testing.assert_close(pipe(io["x"]), io["expected"])
        assert not any("my_model" in name for name in sys.modules), "the model's module was imported"
        print("ok", len(pipe.stages))
    """)
    proc = run_forked(["-c", script], cwd=tmp_path)  # forked from a process that never imported my_model
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok 2"


# -- corrupt plans -----------------------------------------------------------------------------------


def _edit_plan(plan_dir: Path, edit: Any) -> None:
    doc = json.loads((plan_dir / "plan.json").read_text())
    edit(doc)
    (plan_dir / "plan.json").write_text(json.dumps(doc))


def test_load_of_a_dir_without_plan_json(plan_copy: Path) -> None:
    (plan_copy / "plan.json").unlink()
    with pytest.raises(PlanFileError, match=r"is not a plan directory \(no plan.json\)"):
        fxpipe.load(plan_copy)


def test_load_of_a_plan_json_that_is_a_fifo(plan_copy: Path) -> None:
    import os

    (plan_copy / "plan.json").unlink()
    os.mkfifo(plan_copy / "plan.json")
    with pytest.raises(PlanFileError, match=r"plan.json is not a regular file \(a directory, FIFO, device or socket\)"):
        fxpipe.load(plan_copy)


def test_load_of_a_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(PlanFileError, match="not a plan directory"):
        fxpipe.load(tmp_path / "nowhere")


def test_load_of_invalid_json(plan_copy: Path) -> None:
    (plan_copy / "plan.json").write_text('{"schema": "fxpipe.plan/v2", "stages": [')
    with pytest.raises(PlanFileError, match="plan.json is not valid JSON"):
        fxpipe.load(plan_copy)


@pytest.mark.parametrize("schema", ["fxpipe.plan/v0", "fxpipe.plan/v1", "fxpipe.plan/v2", None])
def test_load_of_a_wrong_schema(plan_copy: Path, schema: str | None) -> None:
    _edit_plan(plan_copy, lambda doc: doc.update(schema=schema))
    with pytest.raises(PlanFileError, match=rf"has schema {schema!r}, this fxpipe reads 'fxpipe.plan/v3'"):
        fxpipe.load(plan_copy)


def test_load_of_a_json_list(plan_copy: Path) -> None:
    (plan_copy / "plan.json").write_text("[1, 2]")
    with pytest.raises(PlanFileError, match="has schema 'list'"):
        fxpipe.load(plan_copy)


@pytest.mark.parametrize("missing", ["stage_0.json", "stage_1.pt"])
def test_load_with_a_missing_stage_file(plan_copy: Path, missing: str) -> None:
    (plan_copy / missing).unlink()
    with pytest.raises(PlanFileError, match=rf"missing the stage file '{missing}'"):
        fxpipe.load(plan_copy)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_plan_with_a_non_finite_cost_is_one_line_everywhere(plan_copy: Path, value: float) -> None:
    """NaN or infinity edited into a stage's time: loading, simulate and inspect say so in one line (simulate
    printed a traceback)."""
    from tests._helpers import fxpipe_cli, one_line_error

    _edit_plan(plan_copy, lambda doc: doc["plan"]["stages"][0].update(f=value))
    with pytest.raises(PlanFileError, match=rf"plan.stages\[0\].f is {value}, not a finite number"):
        fxpipe.load(plan_copy)
    for command in ("simulate", "inspect"):
        assert "not a finite number" in one_line_error(fxpipe_cli(command, plan_copy))


def test_load_with_no_stages(plan_copy: Path) -> None:
    _edit_plan(plan_copy, lambda doc: doc.update(stages=[]))
    with pytest.raises(PlanFileError, match="no stages list"):
        fxpipe.load(plan_copy)


def test_load_with_a_weight_of_the_wrong_shape(plan_copy: Path) -> None:
    def edit(doc: dict[str, Any]) -> None:
        info = doc["stages"][1]["parameters"][0]
        info["shape"] = [s + 1 for s in info["shape"]]

    _edit_plan(plan_copy, edit)
    name = json.loads((plan_copy / "plan.json").read_text())["stages"][1]["parameters"][0]["name"]
    with pytest.raises(PlanFileError, match=rf"weight '{name}' has shape \[.*\], plan.json says \[.*\]"):
        fxpipe.load(plan_copy)


def test_load_with_a_weight_missing_from_the_weights_file(plan_copy: Path) -> None:
    _edit_plan(plan_copy, lambda doc: doc["stages"][0]["parameters"].append(
        {"name": "ghost.weight", "shape": [1], "dtype": "float32", "device": "cpu", "requires_grad": True}))
    with pytest.raises(PlanFileError, match="stage weights lack 'ghost.weight'"):
        fxpipe.load(plan_copy)


def test_the_readable_stage_file_is_never_run(plan_copy: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    for path in plan_copy.glob("stage_*.py"):
        path.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n" + path.read_text()
                        + "\ndef broken(:\n")
    loaded = fxpipe.load(plan_copy)
    assert len(loaded.stages) == 2
    assert not marker.exists()


def test_load_with_a_corrupt_weights_file(plan_copy: Path) -> None:
    (plan_copy / "stage_0.pt").write_bytes(b"not a torch file")
    with pytest.raises(PlanFileError, match="stage_0.pt does not match the checksum in plan.json"):
        fxpipe.load(plan_copy)
    _edit_plan(plan_copy, lambda doc: doc["sha256"].update({"stage_0.pt": _sha256(plan_copy / "stage_0.pt")}))
    with pytest.raises(PlanFileError, match="stage_0.pt does not load"):
        fxpipe.load(plan_copy)


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_load_with_a_stage_entry_missing_a_key(plan_copy: Path) -> None:
    _edit_plan(plan_copy, lambda doc: doc["stages"][0].pop("inputs"))
    with pytest.raises(PlanFileError, match=r"stage 0 lacks a valid .inputs."):
        fxpipe.load(plan_copy)


# -- saving over directories -------------------------------------------------------------------------


def test_save_over_an_earlier_plan_replaces_it(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    big = models.build("mlp-tiny")
    fxpipe.save(fxpipe.compile(big.model, big.example_inputs, stages=3), out)
    assert (out / "stage_2.py").is_file()

    small = models.build("gpt-tiny")
    pipe = fxpipe.compile(small.model, small.example_inputs, stages=2)
    assert fxpipe.save(pipe, out) == out

    assert sorted(p.name for p in out.iterdir()) == ["plan.json", "stage_0.fbw.json", "stage_0.json", "stage_0.pt",
                                                     "stage_0.py", "stage_1.fbw.json", "stage_1.json", "stage_1.pt",
                                                     "stage_1.py"]
    assert json.loads((out / "plan.json").read_text())["num_stages"] == 2
    assert _leftovers(tmp_path, "plan") == []
    loaded = fxpipe.load(out)
    torch.testing.assert_close(loaded(*small.example_inputs), pipe(*small.example_inputs))


def test_save_over_an_earlier_plan_keeps_the_users_files(tmp_path: Path) -> None:
    """Only the files the old plan's manifest lists are replaced or removed."""
    out = tmp_path / "plan"
    big = models.build("mlp-tiny")
    fxpipe.save(fxpipe.compile(big.model, big.example_inputs, stages=3), out)
    (out / "NOTES.txt").write_text("written by hand into the old plan")
    (out / "runs").mkdir()
    (out / "runs" / "log.txt").write_text("a run's log")
    (out / "stage_7.py").write_text("# the user's, not in the manifest")

    pipe = fxpipe.compile(big.model, big.example_inputs, stages=2)
    fxpipe.save(pipe, out)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [
        "NOTES.txt", "plan.json", "runs", "runs/log.txt", "stage_0.fbw.json", "stage_0.json", "stage_0.pt",
        "stage_0.py", "stage_1.fbw.json", "stage_1.json", "stage_1.pt", "stage_1.py", "stage_7.py"]
    assert (out / "NOTES.txt").read_text() == "written by hand into the old plan"
    assert _leftovers(tmp_path, "plan") == []
    torch.testing.assert_close(fxpipe.load(out)(*big.example_inputs), pipe(*big.example_inputs))


def test_a_manifest_naming_other_files_deletes_nothing_else(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    zoo = models.build("mlp-tiny")
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2)
    fxpipe.save(pipe, out)
    (tmp_path / "precious.txt").write_text("keep")
    (out / "keep.txt").write_text("keep")
    _edit_plan(out, lambda doc: doc.update(files=[*doc["files"], "../precious.txt", "keep.txt", "/etc/hostname"]))
    fxpipe.save(pipe, out)
    assert (tmp_path / "precious.txt").read_text() == "keep" and (out / "keep.txt").read_text() == "keep"


def test_a_plan_written_to_a_read_only_directory_is_one_error(
    mlp_plan: tuple[models.ZooModel, fxpipe.Pipeline, Path], tmp_path: Path,
) -> None:
    import os

    _, pipe, _ = mlp_plan
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    # root writes into read-only directories; sysfs refuses even root
    target = Path("/sys/fxpipe-test/plan") if os.geteuid() == 0 else locked / "plan"
    try:
        with pytest.raises(PlanFileError, match=rf"cannot write the plan to {target} \((Permission denied|"
                                                r"Operation not permitted)\); free some space or choose another"):
            fxpipe.save(pipe, target)
    finally:
        locked.chmod(0o700)


def test_a_full_disk_is_one_error(mlp_plan: tuple[models.ZooModel, fxpipe.Pipeline, Path], tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    _, pipe, _ = mlp_plan

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(PlanFileError, match=r"cannot write the plan to .* \(No space left on device\); free some"):
        fxpipe.save(pipe, tmp_path / "plan")
    assert not (tmp_path / "plan").exists() and _leftovers(tmp_path, "plan") == []


def test_save_into_an_empty_dir(mlp_plan: tuple[models.ZooModel, fxpipe.Pipeline, Path], tmp_path: Path) -> None:
    zoo, pipe, _ = mlp_plan
    out = tmp_path / "empty"
    out.mkdir()
    fxpipe.save(pipe, out)
    torch.testing.assert_close(fxpipe.load(out)(*zoo.example_inputs), pipe(*zoo.example_inputs))


def test_save_creates_missing_parents(mlp_plan: tuple[models.ZooModel, fxpipe.Pipeline, Path], tmp_path: Path) -> None:
    _, pipe, _ = mlp_plan
    out = fxpipe.save(pipe, tmp_path / "a" / "b" / "plan")
    assert (out / "plan.json").is_file()


def test_save_into_a_non_plan_dir_is_refused_and_leaves_its_files(
    mlp_plan: tuple[models.ZooModel, fxpipe.Pipeline, Path], tmp_path: Path,
) -> None:
    _, pipe, _ = mlp_plan
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    (out / "sub").mkdir()
    (out / "sub" / "data.bin").write_bytes(b"\x00\x01")
    with pytest.raises(PlanFileError, match="exists and is not an fxpipe plan directory"):
        fxpipe.save(pipe, out)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["sub", "sub/data.bin", "thesis.tex"]
    assert (out / "thesis.tex").read_text() == "precious"
    assert (out / "sub" / "data.bin").read_bytes() == b"\x00\x01"
    assert _leftovers(tmp_path, "mine") == []


def test_save_onto_a_file_is_refused(mlp_plan: tuple[models.ZooModel, fxpipe.Pipeline, Path], tmp_path: Path) -> None:
    _, pipe, _ = mlp_plan
    out = tmp_path / "plan"
    out.write_text("a file")
    with pytest.raises(PlanFileError, match="not an fxpipe plan directory"):
        fxpipe.save(pipe, out)
    assert out.read_text() == "a file"


# -- meta device -------------------------------------------------------------------------------------


def test_meta_model_compiles_saves_and_loads_on_meta(tmp_path: Path) -> None:
    zoo = models.build("gpt-tiny", device="meta")
    assert all(p.device.type == "meta" for p in zoo.model.parameters())
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2)
    out = fxpipe.save(pipe, tmp_path / "plan")
    doc = json.loads((out / "plan.json").read_text())
    assert {p["device"] for s in doc["stages"] for p in s["parameters"]} == {"meta"}

    loaded = fxpipe.load(out)
    params = list(loaded.parameters())
    assert params and all(p.device.type == "meta" for p in params)
    assert [(k, n, tuple(t.shape)) for k, n, t in _stage_items(loaded, "parameters")] == \
        [(k, n, tuple(t.shape)) for k, n, t in _stage_items(pipe, "parameters")]
    assert loaded.stages[0].module.get_parameter("lm_head.weight") is \
        loaded.stages[1].module.get_parameter("lm_head.weight")
    out_meta = loaded(*zoo.example_inputs)
    assert out_meta.device.type == "meta"
    assert out_meta.shape == pipe(*zoo.example_inputs).shape


def test_a_pipelined_strategy_record_round_trips_and_is_checked_as_data() -> None:
    """StrategyRecord.stages / microbatches (fxpipe compile --stages P --strategy): exact through JSON, each stage's
    nodes after the previous one's, covering the record; a one-stage record encodes without them, and an old
    record without them loads as one stage."""
    from fxpipe.plan import Plan, StrategyRecord, StrategyStage

    nodes = (("x", "s2"), ("a", "c2"), ("b", "s2"), ("c", "r2"), ("output", "s2"))
    stages = (StrategyStage("x", "a", "elimination", 1e-3), StrategyStage("b", "output", "elimination", 2e-3))
    record = StrategyRecord("auto", 2, 2, "elimination", 3e-3, nodes, stages=stages, microbatches=2)
    assert record.problems() == [] and record.cuts == ("a",) and record.world == 4
    plan = dataclasses.replace(_plan_of_two_stages(), strategy=record)
    doc = plan.to_json()
    assert doc["strategy"]["stages"][1] == {"first": "b", "last": "output", "method": "elimination", "cost": 2e-3}
    assert Plan.from_json(json.loads(json.dumps(doc))) == plan
    one = dataclasses.replace(record, stages=(), microbatches=1)
    assert set(dataclasses.replace(plan, strategy=one).to_json()["strategy"]) == {
        "name", "ranks", "group", "method", "cost", "nodes"}  # as written before pipelined records existed
    assert Plan.from_json(dataclasses.replace(plan, strategy=one).to_json()).strategy == one
    for bad, words in [((stages[0],), "at least 2"),
                       ((stages[0], StrategyStage("c", "output", "e", 0.0)), "not the nodes after the previous"),
                       ((stages[0], StrategyStage("b", "c", "e", 0.0)), "not at the last node 'output'"),
                       ((stages[0], StrategyStage("b", "zz", "e", 0.0)), "'zz', which has no configuration"),
                       ((stages[0], StrategyStage("b", "output", "e", -1.0)), "cost -1.0")]:
        broken = dataclasses.replace(plan, strategy=dataclasses.replace(record, stages=bad)).to_json()
        with pytest.raises(PlanFileError, match="strategy is corrupt") as info:
            Plan.from_json(broken)
        assert words in str(info.value) and "\n" not in str(info.value)
    assert "microbatches 2 without pipeline stages" in dataclasses.replace(record, stages=()).problems()[0]


def _plan_of_two_stages() -> Any:
    from fxpipe.plan import CompileOptions, Link, Mesh, Plan, Provenance, StageCost

    return Plan(Provenance(None, "export", "2.13.0", "0.1.0"), CompileOptions(stages=2, dp=2), (), (),
                (StageCost(0, 0, 1, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 3.0),
                 StageCost(1, 1, 2, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 3.0)), Link(1e9, 1e-4),
                Mesh.from_rank_of_stage((0, 1), 2), 3.0, 3.0)
