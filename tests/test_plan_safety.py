"""A plan directory is data: a tampered one is refused with one line naming the file, or loads as data; no code runs.

The attacker here edits the stage graph (and, since they control the directory, plan.json's checksums
too), the tensors file and plan.json; each payload would create a marker file if it ever ran.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import fxpipe
from fxpipe import models
from fxpipe.cli.main import app
from fxpipe.errors import PlanFileError


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    zoo = models.build("mlp-tiny")
    return fxpipe.save(fxpipe.compile(zoo.model, zoo.example_inputs, stages=2), tmp_path_factory.mktemp("p") / "plan")


@pytest.fixture
def plan(plan_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(plan_dir, tmp_path / "plan"))


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "pwned"


class _Payload:
    """Unpickling this runs Path(marker).write_text("ran")."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (Path(self.marker), "ran"))


def _edit_graph(plan: Path, k: int, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit stage k's graph JSON and, as an attacker would, plan.json's checksum of it."""
    path = plan / f"stage_{k}.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    _rehash(plan, path.name)


def _rehash(plan: Path, name: str) -> None:
    doc = json.loads((plan / "plan.json").read_text())
    doc["sha256"][name] = hashlib.sha256((plan / name).read_bytes()).hexdigest()
    (plan / "plan.json").write_text(json.dumps(doc))


def _first(doc: dict[str, Any], op: str) -> dict[str, Any]:
    return next(n for n in doc["nodes"] if n["op"] == op)


def _retarget(op: str, target: Any, args: Any = None) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        node = _first(doc, "call_function")
        node["op"], node["target"] = op, target
        if args is not None:
            node["args"] = args
    return edit


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def _chain(doc: dict[str, Any]) -> None:
    """Two nodes: a = 2**40 * 2**20 (fits), then a * a (2**120, does not): the bound follows constants through
    nodes."""
    node = _first(doc, "call_function")
    first = {"name": "big_a", "op": "call_function", "target": "_operator.mul", "args": {"tuple": [2**40, 2**20]},
             "kwargs": {"dict": {}}}
    node.update(target="_operator.mul", args={"tuple": [{"node": "big_a"}, {"node": "big_a"}]}, kwargs={"dict": {}})
    doc["nodes"].insert(doc["nodes"].index(node), first)


TAMPERED_GRAPHS = {
    "os.system": (_retarget("call_function", "os.system", {"tuple": ["touch /tmp/x"]}),
                  "'os.system', which is not an allowed"),
    "builtins.exec": (_retarget("call_function", "builtins.exec", {"tuple": ["1"]}), "'builtins.exec', which is not"),
    "torch.load": (_retarget("call_function", "torch.load"), "'torch.load', which is not an allowed"),
    "aten.from_file": (_retarget("call_function", "aten.from_file.default"), "reads or writes files"),
    "aten.save": (_retarget("call_function", "aten.save.default"), "reads or writes files"),
    "unknown higher-order op": (_retarget("call_function", "higher_order.run_const_graph"), "higher-order operator"),
    "an endless while_loop": (_retarget("call_function", "higher_order.while_loop"), "a loop a plan cannot bound"),
    "a cond without its graphs": (_retarget("call_function", "higher_order.cond"), "'cond' with 3 arguments, not 4"),
    "a cond on constants": (_retarget("call_function", "higher_order.cond", {"tuple": [True, 1, 2, []]}),
                            "argument 1 not one of the plan's subgraphs"),
    "method __reduce_ex__": (_retarget("call_method", "__reduce_ex__"), "not an allowed tensor method"),
    "method untyped_storage": (_retarget("call_method", "untyped_storage"), "not an allowed tensor method"),
    "method on a constant": (_retarget("call_method", "split", {"tuple": ["a b"]}), "on a constant, not on a value"),
    "getattr __class__": (lambda doc: _retarget("call_function", "builtins.getattr", {
        "tuple": [{"node": _first(doc, "placeholder")["name"]}, "__class__"]})(doc),
                          "not one of a tensor's plain attributes"),
    "get_attr __dict__": (lambda doc: _first(doc, "get_attr").update(target="__dict__"), "not a module path"),
    "get_attr missing": (lambda doc: _first(doc, "get_attr").update(target="nowhere.weight"), "do not have"),
    "unknown op kind": (lambda doc: _first(doc, "call_function").update(op="exec"), "unknown op 'exec'"),
    "node read before defined": (lambda doc: _first(doc, "call_function").update(args={"tuple": [{"node": "zz"}]}),
                                 "reads 'zz' before it is defined"),
    "a pickled argument": (lambda doc: _first(doc, "call_function").update(args={"pickle": "gASV"}),
                           "not a value a plan stores"),
    "bad dtype": (lambda doc: _first(doc, "call_function").update(kwargs={"dict": {"dtype": {"dtype": "load"}}}),
                  "not a value a plan stores"),
    "not a graph": (lambda doc: doc.update(format="pickle"), "is not an fxpipe.graph/v1 graph"),
    # sizes: each would pin the ranks for minutes or ask for terabytes before the first step (issue 41)
    "pow of constants past 64 bits": (_retarget("call_function", "_operator.pow", {"tuple": [7, 300000000]}),
                                      "computes pow"),
    "a chain of constants past 64 bits": (lambda doc: _chain(doc), "computes mul"),
    "a whole number past 64 bits": (_retarget("call_function", "_operator.add", {"tuple": [2**70, 1]}),
                                    "beyond 64 bits"),
    "a constant repeated a trillion times": (_retarget("call_function", "_operator.mul", {"tuple": ["ab", 10**12]}),
                                             "repeats a constant of 2 items"),
    "a shape of 10^14 elements": (_retarget("call_function", "aten.zeros.default", {"tuple": [[10**7, 10**7]]}),
                                  "makes a tensor of shape [10000000, 10000000]"),
    "arguments nested 70 deep": (_retarget("call_function", "_operator.add", {"tuple": [_nested(70), 1]}),
                                  "nests its arguments more than"),
}


@pytest.mark.parametrize("case", sorted(TAMPERED_GRAPHS))
def test_a_tampered_graph_is_refused_with_one_line(plan: Path, case: str) -> None:
    edit, message = TAMPERED_GRAPHS[case]
    _edit_graph(plan, 1, edit)
    with pytest.raises(PlanFileError, match="stage_1.json") as info:
        fxpipe.load(plan)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_graph_edited_without_its_checksum_is_refused(plan: Path) -> None:
    path = plan / "stage_0.json"
    path.write_text(path.read_text().replace('"aten.', '"os.'))
    with pytest.raises(PlanFileError, match="stage_0.json does not match the checksum in plan.json"):
        fxpipe.load(plan)


def _edit_fbw(plan: Path, k: int, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit stage k's F/B/W JSON (stage_K.fbw.json) and, as an attacker would, plan.json's checksum of it."""
    path = plan / f"stage_{k}.fbw.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    _rehash(plan, path.name)


def _rank_loads(plan: Path) -> None:
    """What a rank running every stage does with the plan: its F, B and W read from the files."""
    from fxpipe.plan_dir import stored_stage_graphs

    assert stored_stage_graphs(fxpipe.load(plan), {0, 1}, "cpu") is not None


def _fbw_values(doc: dict[str, Any]) -> None:
    doc["vals"]["forward"][0] = [[10**7, 10**7], [10**7, 1], "float32", False]


def _fbw_parameter(doc: dict[str, Any]) -> None:
    doc["convention"]["param_names"][0] = "nowhere.weight"


def _fbw_slot(doc: dict[str, Any]) -> None:
    doc["convention"]["w_slots"][0] = ["saved", 10**6]


TAMPERED_FBW = {
    **{f"forward: {case}": (lambda doc, e=edit: e(doc["graphs"]["forward"]), message)
       for case, (edit, message) in TAMPERED_GRAPHS.items()},
    # F's first call takes one argument (the stage graph's takes three)
    "forward: a cond without its graphs": (lambda doc: TAMPERED_GRAPHS["a cond without its graphs"][0](
        doc["graphs"]["forward"]), "'cond' with 1 arguments, not 4"),
    "a value of 10^14 elements": (_fbw_values, "has a value of shape [10000000, 10000000]"),
    "a parameter the stage lacks": (_fbw_parameter, "names parameter 'nowhere.weight', which the stage does not"),
    "a slot past F's saved tensors": (_fbw_slot, "reads slot (saved, 1000000), which the stage does not have"),
    "another format": (lambda doc: doc.update(format="pickle"), "is not an fxpipe.stage-fbw/v1 document"),
}


def test_a_loaded_plan_rank_loads_its_fbw_graphs(plan: Path) -> None:
    _rank_loads(plan)


@pytest.mark.parametrize("case", sorted(TAMPERED_FBW))
def test_a_tampered_fbw_graph_is_refused_with_one_line(plan: Path, case: str) -> None:
    """The F/B/W a rank loads instead of tracing go through the stage graphs' allow-list and bounds."""
    edit, message = TAMPERED_FBW[case]
    _edit_fbw(plan, 1, edit)
    with pytest.raises(PlanFileError, match="stage_1.fbw.json") as info:
        _rank_loads(plan)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_an_fbw_graph_edited_without_its_checksum_is_refused(plan: Path) -> None:
    path = plan / "stage_0.fbw.json"
    path.write_text(path.read_text().replace('"aten.', '"os.'))
    with pytest.raises(PlanFileError, match="stage_0.fbw.json does not match the checksum in plan.json"):
        fxpipe.load(plan)


def test_a_pickle_payload_in_the_tensors_file_does_not_run(plan: Path, marker: Path) -> None:
    (plan / "stage_0.pt").write_bytes(pickle.dumps({"fc.weight": _Payload(marker)}))
    _rehash(plan, "stage_0.pt")
    with pytest.raises(PlanFileError, match="stage_0.pt does not load"):
        fxpipe.load(plan)
    assert not marker.exists()


def test_a_plan_json_naming_a_non_torch_module_class_is_refused(plan: Path) -> None:
    doc = json.loads((plan / "plan.json").read_text())
    doc["stages"][0]["modules"] = [{"name": "evil", "class": "os.system", "attrs": {}}]
    (plan / "plan.json").write_text(json.dumps(doc))
    with pytest.raises(PlanFileError, match="not a torch.nn layer"):
        fxpipe.load(plan)


def test_a_plan_json_naming_a_file_outside_the_plan_is_refused(plan: Path) -> None:
    doc = json.loads((plan / "plan.json").read_text())
    doc["stages"][0]["weights"] = "../../etc/passwd"
    (plan / "plan.json").write_text(json.dumps(doc))
    with pytest.raises(PlanFileError, match="missing the stage file '../../etc/passwd'"):
        fxpipe.load(plan)


def test_tampered_plans_run_no_code_in_the_cli(plan: Path, marker: Path) -> None:
    """inspect, simulate and run read the tampered plan as data: the .py payload never runs."""
    for path in plan.glob("stage_*.py"):
        path.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    runner = CliRunner()
    for args in (["inspect", str(plan)], ["simulate", str(plan)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, (args, result.output)
    assert not marker.exists()
    (plan / "stage_1.pt").write_bytes(pickle.dumps(_Payload(marker)))
    _rehash(plan, "stage_1.pt")
    loss = plan.parent / "loss.py"  # a plan compiled through the Python API: fxpipe run needs its loss
    loss.write_text("import torch\n\n"
                    "def loss(out, target):\n    return torch.nn.functional.cross_entropy(out, target)\n")
    result = runner.invoke(app, ["run", str(plan), "--steps", "1", "--timeout", "20", "--loss", f"{loss}:loss"])
    assert result.exit_code == 2, result.output
    assert "stage_1.pt does not load" in result.output and "Traceback" not in result.output
    assert not marker.exists()


def test_a_loaded_graph_is_the_saved_graph(plan_dir: Path) -> None:
    zoo = models.build("mlp-tiny")
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2)
    loaded = fxpipe.load(plan_dir)
    for a, b in zip(pipe.stages, loaded.stages):
        assert [(n.op, str(n.target), n.name) for n in a.module.graph.nodes] == \
            [(n.op, str(n.target), n.name) for n in b.module.graph.nodes]
    torch.testing.assert_close(loaded(*zoo.example_inputs), pipe(*zoo.example_inputs))


def _computed_size(doc: dict[str, Any]) -> None:
    """Two nodes before the output: a size computed from constants (no literal for the loader to check), and
    arange of it: 10^11 int64 elements, 800 GB."""
    at = doc["nodes"].index(_first(doc, "output"))
    doc["nodes"][at:at] = [
        {"name": "big_n", "op": "call_function", "target": "_operator.mul", "args": {"tuple": [100000, 1000000]},
         "kwargs": {"dict": {}}},
        {"name": "big", "op": "call_function", "target": "aten.arange.default", "args": {"tuple": [{"node": "big_n"}]},
         "kwargs": {"dict": {}}}]


def test_a_computed_size_is_refused_before_any_rank_allocates_it(plan: Path) -> None:
    """The loader sees no literal size; running the stages on the meta device with the plan's shapes does: fxpipe
    inspect and fxpipe run refuse it in one line, having allocated nothing."""
    from fxpipe.plan_dir import check_allocations
    from tests._helpers import fxpipe_cli, one_line_error

    _edit_graph(plan, 1, _computed_size)
    fxpipe.load(plan)  # loads: the size is a node's value, known only when run
    with pytest.raises(PlanFileError, match=r"stage_1.json makes a tensor of shape \[100000000000\] with "
                                            r"aten.arange.default "
                                            r"\(800,000,000,000 bytes\), more than this machine's"):
        check_allocations(plan)
    assert "800,000,000,000 bytes" in one_line_error(fxpipe_cli("inspect", plan))
    (plan.parent / "loss.py").write_text("import torch\n\n\ndef loss(out, target):\n    return out.sum()\n")
    assert "800,000,000,000 bytes" in one_line_error(fxpipe_cli("run", plan, "--steps", 1, "--loss",
                                                                f"{plan.parent / 'loss.py'}:loss"))
    check_allocations(plan, limit_bytes=10**12)  # under a larger limit it passes: the check is the size
