"""Tests for the ``fxpipe`` command line: compile, inspect and models, their output and their one-line errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import Result

import fxpipe
from fxpipe import models
from fxpipe.passes import DEFAULT_PASSES, PASS_NAMES
from tests._helpers import HANG_S, fxpipe_cli, ok, one_line_error


def titles_in(text: str) -> list[str]:
    return [name for name in DEFAULT_PASSES if re.search(rf"^{re.escape(name)}(:|\s*$)", text, re.MULTILINE)]


def report(doc: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The report whose title is ``prefix`` or starts with ``prefix:``."""
    found = [r for r in doc["reports"] if r["title"] == prefix or r["title"].startswith(f"{prefix}:")]
    assert len(found) == 1, [r["title"] for r in doc["reports"]]
    return found[0]


def column(rep: dict[str, Any], name: str) -> list[Any]:
    i = rep["columns"].index(name)
    return [row[i] for row in rep["rows"]]


def write_model(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source))
    return path


# -- compiled once per module ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_plan(tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path]:
    """``fxpipe compile gpt-tiny --stages 2 --out DIR`` with rich tables."""
    out = tmp_path_factory.mktemp("gpt") / "plan"
    return ok(fxpipe_cli("compile", "gpt-tiny", "--stages", "2", "--out", out)), out


@pytest.fixture(scope="module")
def mlp_plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path]:
    """``fxpipe compile mlp-tiny --plain --out DIR``: tabulate tables."""
    out = tmp_path_factory.mktemp("mlp") / "plan"
    return ok(fxpipe_cli("compile", "mlp-tiny", "--plain", "--out", out)), out


@pytest.fixture(scope="module")
def mlp_json(tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path]:
    """``fxpipe compile mlp-tiny --json --verify-each --out DIR``."""
    out = tmp_path_factory.mktemp("mlpjson") / "plan"
    return ok(fxpipe_cli("compile", "mlp-tiny", "--json", "--verify-each", "--out", out)), out


# -- compile -----------------------------------------------------------------------------------------


def test_compile_writes_the_plan_dir(gpt_plan: tuple[Result, Path]) -> None:
    result, out = gpt_plan
    assert sorted(p.name for p in out.iterdir()) == ["plan.json", "stage_0.fbw.json", "stage_0.json", "stage_0.pt",
                                                     "stage_0.py", "stage_1.fbw.json", "stage_1.json", "stage_1.pt",
                                                     "stage_1.py"]
    doc = json.loads((out / "plan.json").read_text())
    assert doc["schema"] == "fxpipe.plan/v3"
    assert isinstance(doc["stages"], list) and len(doc["stages"]) == 2 == doc["num_stages"]
    assert doc["plan"]["provenance"]["model"] == "gpt-tiny"
    assert doc["plan"]["options"]["stages"] == 2
    assert doc["shared_params"] == {"lm_head.weight": [0, 1]}
    assert f"wrote {out} (2 stages)" in result.stderr


def test_compiled_plan_loads_and_equals_the_zoo_model(gpt_plan: tuple[Result, Path]) -> None:
    zoo = models.build("gpt-tiny")  # the CLI's default seed is 0, as is build's
    pipe = fxpipe.load(gpt_plan[1])
    with torch.no_grad():
        torch.testing.assert_close(pipe(*zoo.example_inputs), zoo.model(*zoo.example_inputs))


def test_compile_prints_a_rich_table_per_pass(gpt_plan: tuple[Result, Path]) -> None:
    stdout = gpt_plan[0].stdout
    assert titles_in(stdout) == list(DEFAULT_PASSES)
    assert "partition-stages: chosen partition" in stdout
    assert "┏" in stdout  # rich box drawing, not tabulate
    assert re.search(r"^passes\s*$", stdout, re.MULTILINE)
    assert "shared parameter lm_head.weight is held by stages [0, 1]" in " ".join(stdout.split())


def test_plain_prints_tabulate_tables(mlp_plain: tuple[Result, Path]) -> None:
    stdout = mlp_plain[0].stdout
    assert titles_in(stdout) == list(DEFAULT_PASSES)
    assert "┏" not in stdout and "│" not in stdout
    # tabulate "simple": a header row, then a dashed rule under every column.
    assert re.search(r"^stage\s+layers\s+names\s+.*\n-+(\s+-+)+$", stdout, re.MULTILINE)
    assert re.search(r"^trace\ntracer\s+graph nodes\s+compute nodes", stdout, re.MULTILINE)


def test_json_is_one_object_and_nothing_else(mlp_json: tuple[Result, Path]) -> None:
    result, out = mlp_json
    assert result.stdout.count("\n") == 1 and result.stdout.endswith("}\n")
    doc = json.loads(result.stdout)
    assert isinstance(doc, dict)
    assert doc["schema"] == "fxpipe.compile/v1"
    assert doc["model"] == "mlp-tiny"
    assert doc["finished"] is True
    assert doc["plan_dir"] == str(out) and (out / "plan.json").is_file()
    assert doc["seconds"] >= 0
    assert doc["bottleneck_ratio"] >= 1
    titles = [r["title"] for r in doc["reports"]]
    for name in DEFAULT_PASSES:
        rep = report(doc, name)
        assert rep["columns"] and rep["rows"], name
        assert all(len(row) == len(rep["columns"]) for row in rep["rows"])
    assert titles[-1] == "passes"


def test_json_passes_table_lists_every_pass_verified(mlp_json: tuple[Result, Path]) -> None:
    doc = json.loads(mlp_json[0].stdout)
    passes = report(doc, "passes")
    assert column(passes, "pass") == list(DEFAULT_PASSES)
    assert column(passes, "verified") == [True] * len(DEFAULT_PASSES)
    assert all(ms >= 0 for ms in column(passes, "ms"))


def test_json_partition_matches_the_plan(mlp_json: tuple[Result, Path]) -> None:
    result, out = mlp_json
    doc = json.loads(result.stdout)
    plan = json.loads((out / "plan.json").read_text())
    assert column(report(doc, "partition-stages"), "stage") == [s["index"] for s in plan["stages"]] == [0, 1]
    info = plan["plan"]
    assert doc["bottleneck_ratio"] == pytest.approx(info["bottleneck_s"] / info["lower_bound_s"])


def test_verify_each_marks_every_pass_verified_in_the_passes_table() -> None:
    result = ok(fxpipe_cli("compile", "mlp-tiny", "--verify-each", "--plain"))
    rows = re.findall(r"^(\S+)\s+[\d.]+\s+(True|False)\s+\d+\s+(True|False)\s*$", result.stdout, re.MULTILINE)
    assert [name for name, _, _ in rows] == list(DEFAULT_PASSES)
    assert {verified for _, _, verified in rows} == {"True"}


def test_without_out_no_plan_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = ok(fxpipe_cli("compile", "mlp-tiny", "--json"))
    assert json.loads(result.stdout)["plan_dir"] is None
    assert list(tmp_path.iterdir()) == []


def test_stop_after_writes_no_plan_even_with_out(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    result = ok(fxpipe_cli("compile", "gpt-tiny", "--stop-after", "group-layers", "--out", out))
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []
    assert "stopped after group-layers: no plan written" in result.stderr
    assert titles_in(result.stdout) == ["trace", "annotate-costs", "group-layers"]


def test_stop_after_json_reports_unfinished(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    doc = json.loads(ok(fxpipe_cli("compile", "mlp-tiny", "--stop-after", "annotate-costs", "--json",
                                   "--out", out)).stdout)
    assert doc["finished"] is False and doc["plan_dir"] is None
    assert column(report(doc, "passes"), "pass") == ["trace", "annotate-costs"]
    assert not out.exists()


def test_print_after_prints_the_graph() -> None:
    result = ok(fxpipe_cli("compile", "mlp-tiny", "--print-after", "partition-stages", "--plain"))
    stdout = result.stdout
    assert stdout.count("graph after") == 1
    after = stdout.split("graph after partition-stages", 1)[1]
    assert "def forward(" in after
    assert "torch.ops.aten.linear.default" in after
    # Printed after the tables, and only for the pass named.
    assert stdout.index("graph after partition-stages") > stdout.index("partition-stages: chosen partition")


def test_print_after_is_repeatable() -> None:
    result = ok(fxpipe_cli("compile", "mlp-tiny", "--print-after", "trace", "--print-after", "split-stages",
                           "--plain"))
    assert re.findall(r"^graph after (\S+)$", result.stdout, re.MULTILINE) == ["trace", "split-stages"]


def test_tracer_fx_compiles_and_the_plan_loads(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    result = ok(fxpipe_cli("compile", "mlp-tiny", "--tracer", "fx", "--json", "--out", out))
    doc = json.loads(result.stdout)
    assert column(report(doc, "trace"), "tracer") == ["fx"]
    assert json.loads((out / "plan.json").read_text())["plan"]["provenance"]["tracer"] == "fx"
    zoo = models.build("mlp-tiny")
    with torch.no_grad():
        torch.testing.assert_close(fxpipe.load(out)(*zoo.example_inputs), zoo.model(*zoo.example_inputs))


def test_tracer_fx_costs_the_backward_like_export(mlp_json: tuple[Result, Path]) -> None:
    fx = json.loads(ok(fxpipe_cli("compile", "mlp-tiny", "--tracer", "fx", "--json")).stdout)
    export = json.loads(mlp_json[0].stdout)
    fx_layers, export_layers = report(fx, "group-layers"), report(export, "group-layers")
    assert column(fx_layers, "name") == column(export_layers, "name")
    assert column(fx_layers, "bwd MFLOP (est)") == column(export_layers, "bwd MFLOP (est)")


def test_seed_changes_the_weights(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    ok(fxpipe_cli("compile", "mlp-tiny", "--seed", "3", "--out", out))
    zoo0, zoo3 = models.build("mlp-tiny", seed=0), models.build("mlp-tiny", seed=3)
    with torch.no_grad():
        got = fxpipe.load(out)(*zoo3.example_inputs)
        torch.testing.assert_close(got, zoo3.model(*zoo3.example_inputs))
        assert not torch.allclose(got, zoo0.model(*zoo3.example_inputs))


def test_out_over_an_earlier_plan_replaces_it(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    ok(fxpipe_cli("compile", "mlp-tiny", "--stages", "3", "--out", out))
    assert (out / "stage_2.py").is_file()
    (out / "NOTES.txt").write_text("mine")
    (out / "sub").mkdir()
    ok(fxpipe_cli("compile", "mlp-tiny", "--stages", "2", "--out", out))
    assert not (out / "stage_2.py").exists() and not (out / "stage_2.json").exists()
    assert (out / "NOTES.txt").read_text() == "mine" and (out / "sub").is_dir()
    assert json.loads((out / "plan.json").read_text())["num_stages"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]


def test_build_device_meta_writes_a_meta_plan(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    ok(fxpipe_cli("compile", "gpt-tiny", "--build-device", "meta", "--out", out))
    doc = json.loads((out / "plan.json").read_text())
    assert {p["device"] for s in doc["stages"] for p in s["parameters"]} == {"meta"}
    assert all(p.is_meta for p in fxpipe.load(out).parameters())


def test_build_device_meta_with_profile_is_refused() -> None:
    line = one_line_error(fxpipe_cli("compile", "mlp-tiny", "--build-device", "meta", "--profile"))
    assert "--profile" in line and "meta" in line


def test_profile_adds_the_profile_layers_pass() -> None:
    doc = json.loads(ok(fxpipe_cli("compile", "mlp-tiny", "--profile", "--profile-runs", "1", "--json")).stdout)
    assert column(report(doc, "passes"), "pass") == [n for n in PASS_NAMES if n != "balance-backward"]
    assert report(doc, "profile-layers")["rows"]


def test_profile_threads_are_used_recorded_and_restored(tmp_path: Path) -> None:
    import torch

    before = torch.get_num_threads()
    ok(fxpipe_cli("compile", "mlp-tiny", "--profile", "--profile-runs", "1", "--profile-threads", "1",
                  "--out", tmp_path / "p"))
    provenance = json.loads((tmp_path / "p" / "plan.json").read_text())["plan"]["provenance"]
    assert provenance["profile_threads"] == 1
    # the memory bandwidth measured beside the layers, which the run charges the optimizer's passes at
    assert provenance["profile_mem_bw"] > 1e8
    assert torch.get_num_threads() == before


# -- user model files ----------------------------------------------------------------------------------


TUPLE_BUILDER = """\
    import torch
    from torch import nn


    class Tower(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

        def forward(self, x):
            return self.layers(x)


    def build():
        return Tower(), (torch.randn(3, 8),)
"""


def test_user_file_returning_model_and_inputs_compiles(tmp_path: Path) -> None:
    path = write_model(tmp_path / "my_model.py", TUPLE_BUILDER)
    out = tmp_path / "plan"
    result = ok(fxpipe_cli("compile", f"{path}:build", "--stages", "2", "--out", out))
    assert titles_in(result.stdout) == list(DEFAULT_PASSES)
    doc = json.loads((out / "plan.json").read_text())
    assert doc["plan"]["provenance"]["model"] == f"{path}:build"
    assert len(doc["stages"]) == 2
    # The plan equals the model the builder makes under the same seed (0).
    namespace: dict[str, Any] = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model, (x,) = namespace["build"]()
    with torch.no_grad():
        torch.testing.assert_close(fxpipe.load(out)(x), model(x))


def test_user_file_returning_a_bare_model_uses_its_example_inputs(tmp_path: Path) -> None:
    path = write_model(tmp_path / "bare_model.py", """\
        import torch
        from torch import nn


        def build():
            return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


        def example_inputs():
            return torch.randn(5, 8)
    """)
    result = ok(fxpipe_cli("compile", f"{path}:build", "--stages", "2", "--json"))
    doc = json.loads(result.stdout)
    assert doc["finished"] is True
    # The example batch of 5 x 8 is what was traced: fc0's forward FLOPs are 2 * 5 * 8 * 16.
    assert column(report(doc, "annotate-costs"), "fwd FLOPs")[0] == 2 * 5 * 8 * 16 + 2 * 5 * 16 * 4


# -- bad input: exit 2, one line, no traceback --------------------------------------------------------


def test_unknown_model() -> None:
    line = one_line_error(fxpipe_cli("compile", "nosuch"))
    assert "unknown model 'nosuch'" in line and "fxpipe models" in line


def test_unknown_model_size_suggests_one() -> None:
    line = one_line_error(fxpipe_cli("compile", "gpt-huge"))
    assert "unknown size 'huge'" in line and "gpt-small" in line


def test_more_stages_than_layers() -> None:
    line = one_line_error(fxpipe_cli("compile", "gpt-tiny", "--stages", "100"))
    assert re.search(r"cannot make 100 stages from \d+ layers", line)
    assert "lower --stages" in line


def test_memory_cap_too_small_names_the_smallest_cap_that_works() -> None:
    line = one_line_error(fxpipe_cli("compile", "gpt-tiny", "--memory-per-stage", "1KiB"))
    match = re.search(r"smallest cap that works is .*?\((\d+) bytes\)", line)
    assert match, line
    smallest = int(match.group(1))
    assert smallest > 1024
    # That cap does work, and one byte less does not.
    ok(fxpipe_cli("compile", "gpt-tiny", "--memory-per-stage", str(smallest), "--json"))
    again = one_line_error(fxpipe_cli("compile", "gpt-tiny", "--memory-per-stage", str(smallest - 1)))
    assert f"({smallest} bytes)" in again


@pytest.mark.parametrize("option, value", [
    ("--memory-per-stage", "banana"),
    ("--bandwidth", "fast"),
    ("--device-mem-bw", "12 parsecs"),
])
def test_a_size_that_is_not_a_size(option: str, value: str) -> None:
    line = one_line_error(fxpipe_cli("compile", "mlp-tiny", option, value))
    assert f"{option} {value!r} is not a size" in line


def test_unknown_granularity() -> None:
    line = one_line_error(fxpipe_cli("compile", "mlp-tiny", "--granularity", "banana"))
    assert "--granularity 'banana'" in line


def test_unknown_stop_after_pass() -> None:
    line = one_line_error(fxpipe_cli("compile", "mlp-tiny", "--stop-after", "nosuchpass"))
    assert "unknown pass 'nosuchpass'" in line
    assert ", ".join(DEFAULT_PASSES) in line


def test_unknown_print_after_pass() -> None:
    line = one_line_error(fxpipe_cli("compile", "mlp-tiny", "--print-after", "nosuchpass"))
    assert "unknown pass 'nosuchpass'" in line


def test_missing_model_file(tmp_path: Path) -> None:
    line = one_line_error(fxpipe_cli("compile", f"{tmp_path / 'absent.py'}:build"))
    assert "no such file" in line and "absent.py" in line


def test_model_file_without_the_builder(tmp_path: Path) -> None:
    path = write_model(tmp_path / "nobuild.py", TUPLE_BUILDER)
    line = one_line_error(fxpipe_cli("compile", f"{path}:make"))
    assert "has no callable 'make'" in line


def test_model_file_returning_a_bare_model_without_example_inputs(tmp_path: Path) -> None:
    path = write_model(tmp_path / "noinputs.py", """\
        from torch import nn


        def build():
            return nn.Linear(2, 2)
    """)
    line = one_line_error(fxpipe_cli("compile", f"{path}:build"))
    assert "no example inputs" in line


def test_model_file_that_raises_on_import(tmp_path: Path) -> None:
    path = write_model(tmp_path / "broken.py", "raise RuntimeError('boom at import')\n")
    line = one_line_error(fxpipe_cli("compile", f"{path}:build"))
    assert "RuntimeError: boom at import" in line


BRANCHY = """\
    import torch
    from torch import nn


    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:
                return self.fc(x)
            return -x


    def build():
        return Branchy(), (torch.ones(2, 4),)
"""


@pytest.fixture(scope="module")
def branchy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, Result]:
    path = write_model(tmp_path_factory.mktemp("branchy") / "branchy.py", BRANCHY)
    line = 1 + path.read_text().splitlines().index("        if x.sum() > 0:")
    return path, line, fxpipe_cli("compile", f"{path}:build")


def test_data_dependent_branch_names_the_file_line_and_torch_cond(branchy: tuple[Path, int, Result]) -> None:
    path, line, result = branchy
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    last = result.stderr.splitlines()[-1]
    assert last.startswith("error: cannot trace Branchy: data-dependent control flow")
    assert f"{path}:{line}" in last
    assert "`if x.sum() > 0:`" in last
    assert "torch.cond" in last


def test_data_dependent_branch_is_a_one_line_error(branchy: tuple[Path, int, Result]) -> None:
    one_line_error(branchy[2])


def test_data_dependent_branch_with_tracer_fx(branchy: tuple[Path, int, Result]) -> None:
    path, line, _ = branchy
    result = one_line_error(fxpipe_cli("compile", f"{path}:build", "--tracer", "fx"))
    assert f"{path}:{line}" in result
    assert "torch.cond" in result


def test_out_into_a_non_plan_dir_is_refused_and_its_files_untouched(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "sub").mkdir()
    (out / "sub" / "data.bin").write_bytes(b"\x01\x02")
    before = {p.relative_to(out).as_posix(): p.stat().st_mtime_ns for p in out.rglob("*")}
    line = one_line_error(fxpipe_cli("compile", "mlp-tiny", "--out", out))
    assert f"{out} exists and is not an fxpipe plan directory" in line
    assert {p.relative_to(out).as_posix(): p.stat().st_mtime_ns for p in out.rglob("*")} == before
    assert (out / "notes.txt").read_text() == "keep me"
    assert (out / "sub" / "data.bin").read_bytes() == b"\x01\x02"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no temporary directory left behind


@pytest.mark.parametrize("args", [
    ("compile", "mlp-tiny", "--tracer", "jit"),  # --stages 0 is fxpipe's own refusal (tests/cli/test_stages_auto.py)
    ("compile", "mlp-tiny", "--dtype", "int8"),
    ("compile", "mlp-tiny", "--microbatches", "0"),
    ("run", "plan", "--max-restarts", "1000000000"),  # bounded: 100 restarts at most
])
def test_option_values_click_rejects_exit_2_without_traceback(args: Sequence[str]) -> None:
    result = fxpipe_cli(*args)
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert result.stdout == ""
    assert "Invalid value" in result.stderr


# -- inspect -------------------------------------------------------------------------------------------


def test_inspect_prints_the_tables_and_the_summary(gpt_plan: tuple[Result, Path]) -> None:
    _, out = gpt_plan
    result = ok(fxpipe_cli("inspect", out))
    stdout = result.stdout
    assert titles_in(stdout) == list(DEFAULT_PASSES)
    assert "partition-stages: chosen partition" in stdout
    assert f"plan {out}" in stdout
    assert "schema fxpipe.plan/v3" in stdout and "model gpt-tiny" in stdout
    assert "stage_0.json" in stdout and "stage_1.json" in stdout


def test_inspect_plain_repeats_compiles_tables_exactly(mlp_plain: tuple[Result, Path]) -> None:
    compiled, out = mlp_plain
    result = ok(fxpipe_cli("inspect", out, "--plain"))
    assert result.stdout.startswith(compiled.stdout)
    summary = result.stdout[len(compiled.stdout):]
    assert summary.startswith(f"plan {out}\n")
    doc = json.loads((out / "plan.json").read_text())
    for stage in doc["stages"]:
        elements = sum(int(torch.Size(p["shape"]).numel()) for p in stage["parameters"])
        assert re.search(rf"^{stage['index']}\s+{stage['graph']}\s+{len(stage['inputs'])}\s+"
                         rf"{len(stage['outputs'])}\s+{len(stage['parameters'])}\s+{elements}\s*$",
                         summary, re.MULTILINE), summary


def test_inspect_json(gpt_plan: tuple[Result, Path]) -> None:
    _, out = gpt_plan
    result = ok(fxpipe_cli("inspect", out, "--json"))
    assert result.stdout.count("\n") == 1
    doc = json.loads(result.stdout)
    assert doc["schema"] == "fxpipe.inspect/v1"
    assert doc["plan"] == json.loads((out / "plan.json").read_text())
    assert len(doc["plan"]["stages"]) == 2


def test_inspect_shows_one_microbatchs_inputs_and_what_the_loss_takes(gpt_plan: tuple[Result, Path],
                                                                        mlp_plain: tuple[Result, Path]) -> None:
    """What a batch for PipelineRuntime.step needs, as the zoo builds it: gpt's token ids and next-token target
    below the vocabulary; mlp's float features and class targets below its classes."""
    gpt = json.loads(ok(fxpipe_cli("inspect", gpt_plan[1], "--json")).stdout)["batch"]
    zoo = models.build("gpt-tiny")
    vocab = zoo.model.wte.num_embeddings
    assert gpt["inputs"] == [{"name": "idx", "shape": list(zoo.example_inputs[0].shape), "dtype": "int64",
                              "values": f"[0, {vocab})"}]
    assert gpt["loss"]["target_shape"] == list(zoo.example_target.shape)
    assert (gpt["loss"]["target_dtype"], gpt["loss"]["target_values"]) == ("int64", f"[0, {vocab})")
    assert "cross entropy" in gpt["loss"]["loss"]
    mlp = json.loads(ok(fxpipe_cli("inspect", mlp_plain[1], "--json")).stdout)["batch"]
    zoo = models.build("mlp-tiny")
    classes = zoo.model(*zoo.example_inputs).shape[-1]
    assert [(i["shape"], i["dtype"], i["values"]) for i in mlp["inputs"]] == [
        (list(zoo.example_inputs[0].shape), "float32", "any")]
    assert (mlp["loss"]["target_shape"], mlp["loss"]["target_values"]) == ([zoo.example_inputs[0].shape[0]],
                                                                            f"[0, {classes})")
    text = ok(fxpipe_cli("inspect", gpt_plan[1], "--plain")).stdout
    shape = "x".join(map(str, gpt["inputs"][0]["shape"]))
    assert re.search(rf"^idx\s+{shape}\s+int64\s+\[0, {vocab}\)\s*$", text, re.M), text
    assert re.search(rf"^target\s+{shape}\s+int64\s+\[0, {vocab}\)\s*$", text, re.M), text


def test_inspect_of_a_python_api_plan_leaves_the_loss_to_the_caller(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3))
    fxpipe.save(fxpipe.compile(model, (torch.zeros(2, 5, dtype=torch.int64),), stages=1), tmp_path / "plan")
    doc = json.loads(ok(fxpipe_cli("inspect", tmp_path / "plan", "--json")).stdout)["batch"]
    assert [(i["shape"], i["dtype"], i["values"]) for i in doc["inputs"]] == [([2, 5], "int64", "integers")]
    assert doc["loss"] is None
    assert "the one you pass" in ok(fxpipe_cli("inspect", tmp_path / "plan", "--plain")).stdout


def test_inspect_a_dir_without_plan_json(tmp_path: Path) -> None:
    line = one_line_error(fxpipe_cli("inspect", tmp_path))
    assert f"{tmp_path} is not a plan directory (no plan.json)" in line


def test_inspect_a_missing_dir(tmp_path: Path) -> None:
    line = one_line_error(fxpipe_cli("inspect", tmp_path / "nowhere"))
    assert "not a plan directory" in line


def test_inspect_a_wrong_schema(mlp_plain: tuple[Result, Path], tmp_path: Path) -> None:
    out = Path(shutil.copytree(mlp_plain[1], tmp_path / "plan"))
    doc = json.loads((out / "plan.json").read_text())
    doc["schema"] = "fxpipe.plan/v999"
    (out / "plan.json").write_text(json.dumps(doc))
    line = one_line_error(fxpipe_cli("inspect", out))
    assert "has schema 'fxpipe.plan/v999', this fxpipe reads 'fxpipe.plan/v3'" in line


def test_inspect_invalid_json(tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_text("{not json")
    line = one_line_error(fxpipe_cli("inspect", tmp_path))
    assert "is not valid JSON" in line


def test_inspect_a_plan_whose_stage_file_was_deleted(mlp_plain: tuple[Result, Path], tmp_path: Path) -> None:
    out = Path(shutil.copytree(mlp_plain[1], tmp_path / "plan"))
    (out / "stage_1.json").unlink()
    line = one_line_error(fxpipe_cli("inspect", out))
    assert "missing the stage file 'stage_1.json'" in line


@pytest.mark.parametrize("corrupt", ["stage without parameters", "report without rows"])
def test_inspect_a_plan_json_missing_keys(mlp_plain: tuple[Result, Path], tmp_path: Path, corrupt: str) -> None:
    out = Path(shutil.copytree(mlp_plain[1], tmp_path / "plan"))
    doc = json.loads((out / "plan.json").read_text())
    if corrupt == "stage without parameters":
        del doc["stages"][0]["parameters"]
    else:
        del doc["reports"][0]["rows"]
    (out / "plan.json").write_text(json.dumps(doc))
    with pytest.raises(fxpipe.PlanFileError):  # the same file is refused by the Python API ...
        fxpipe.load(out)
    line = one_line_error(fxpipe_cli("inspect", out))  # ... and must be by the CLI
    assert "plan.json" in line


# -- models --------------------------------------------------------------------------------------------


def test_models_lists_every_size_with_its_parameter_count() -> None:
    stdout = ok(fxpipe_cli("models", "--plain")).stdout
    families = {entry.family for entry in models.entries()}
    assert families == {"gpt", "mlp", "resnet", "vgg"}
    for entry in models.entries():
        for size in entry.sizes:
            name = f"{entry.family}-{size}"
            count = models.parameter_count(name)
            default = "yes" if size == entry.default_size else ""
            assert re.search(rf"^{re.escape(name)}\s+{count}\s+{default}", stdout, re.MULTILINE), name


def test_models_rich_table_names_every_model() -> None:
    stdout = ok(fxpipe_cli("models")).stdout
    for entry in models.entries():
        for size in entry.sizes:
            name = f"{entry.family}-{size}"
            assert re.search(rf"│ {re.escape(name)}\s+│\s+{models.parameter_count(name):,} │", stdout), name


def test_models_json() -> None:
    result = ok(fxpipe_cli("models", "--json"))
    doc = json.loads(result.stdout)
    assert doc["schema"] == "fxpipe.models/v1"
    by_name = {m["name"]: m for m in doc["models"]}
    assert {"gpt-tiny", "mlp-tiny", "resnet-tiny", "vgg-tiny", "resnet-50", "vgg-16", "gpt-1.5b"} <= set(by_name)
    count = by_name["gpt-1.5b"]["parameters"]
    assert count >= 1.4e9 and count <= 1.7e9
    assert by_name["gpt-tiny"]["parameters"] == sum(p.numel() for p in models.build("gpt-tiny").model.parameters())
    for family in ("gpt", "mlp", "resnet", "vgg"):
        defaults = [name for name, m in by_name.items() if name.startswith(f"{family}-") and m["default"]]
        assert len(defaults) == 1, family
    assert all(isinstance(m["description"], str) and m["description"] for m in doc["models"])


# -- help and imports ----------------------------------------------------------------------------------


def _python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_console_script_error_is_one_line_on_the_real_stderr(tmp_path: Path) -> None:
    """Outside CliRunner too: torch's log handlers write to the process's real stderr."""
    script = Path(sys.executable).with_name("fxpipe")
    if not script.is_file():
        pytest.skip(f"no console script at {script}")
    proc = subprocess.run([str(script), "compile", "gpt-tiny", "--stages", "100"], capture_output=True, text=True,
                          timeout=HANG_S, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot make 100 stages"), proc.stderr


def test_help_does_not_import_torch() -> None:
    out = _python(textwrap.dedent("""\
        import sys
        from typer.testing import CliRunner
        from fxpipe.cli.main import app
        for args in (["--help"], ["compile", "--help"], ["inspect", "--help"], ["models", "--help"]):
            result = CliRunner().invoke(app, args)
            assert result.exit_code == 0, (args, result.output)
            assert "Usage" in result.output, (args, result.output)
        print("torch" in sys.modules)
    """))
    assert out == "False"


def test_console_script_help_does_not_import_torch() -> None:
    script = Path(sys.executable).with_name("fxpipe")
    if not script.is_file():
        pytest.skip(f"no console script at {script}")
    env = dict(os.environ, PYTHONPROFILEIMPORTTIME="1")
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=HANG_S, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "compile" in proc.stdout and "inspect" in proc.stdout and "models" in proc.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert "typer" in imported  # the profile did record the imports
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]


def test_import_fxpipe_loads_no_cli_dependencies() -> None:
    out = _python(textwrap.dedent("""\
        import sys
        import fxpipe
        bare = sorted(m for m in ("typer", "rich", "tabulate", "click", "torch") if m in sys.modules)
        fxpipe.compile, fxpipe.load, fxpipe.Pipeline
        import fxpipe.passes, fxpipe.plan_dir, fxpipe.models, fxpipe.targets
        core = sorted(m for m in ("typer", "rich", "tabulate", "click") if m in sys.modules)
        print(bare, core)
    """))
    assert out == "[] []"


def test_version_prints_the_installed_version() -> None:
    from importlib.metadata import version

    result = ok(fxpipe_cli("--version"))
    assert result.stdout == f"fxpipe {version('fxpipe')}\n"
