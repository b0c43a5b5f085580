"""Inputs that used to end in a traceback (issue 11): each is one ``error:`` line and exit code 2."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest
import torch

from fxpipe.errors import FxpipeError, OptionError
from tests._helpers import MLP_PLAN, fxpipe_cli, one_line_error, plan_fixture

plan = plan_fixture(*MLP_PLAN)


@pytest.fixture
def unwritable(tmp_path: Path) -> Path:
    """A path no one can write, root included: its parent is a file."""
    (tmp_path / "a-file").write_text("")
    return tmp_path / "a-file" / "out"


@pytest.mark.parametrize("tracer", ["export", "fx"])
def test_item_in_forward_names_the_line_and_the_fix(tmp_path: Path, tracer: str) -> None:
    model = tmp_path / "item_model.py"
    model.write_text(textwrap.dedent("""\
        import torch

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

            def forward(self, x):
                y = self.a(x)
                return self.b(y) * y.sum().item()

        def build():
            return M(), (torch.randn(4, 8),)
        """))
    line = one_line_error(fxpipe_cli("compile", f"{model}:build", "--tracer", tracer))
    assert "reads a tensor's value as a Python number" in line and "keep it a tensor" in line
    if tracer == "export":
        assert "item_model.py\", line 10" in line and "y.sum().item()" in line


@pytest.mark.parametrize("option", ["--device-flops", "--device-mem-bw"])
@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_device_model_at_zero_or_below(option: str, value: str) -> None:
    line = one_line_error(fxpipe_cli("compile", "mlp-tiny", option, value))
    assert (f"{option} must be a positive number" in line or f"{option} {value!r} is not a size" in line
            or f"{option} is nan; give a number" in line), line


@pytest.mark.parametrize("costs", ["nan,1,1", "1,inf,1", "1,1,-inf", "-1,1,1", "1e308,1e308,1", "1e7,1,1"])
def test_uniform_costs_that_are_not_finite_non_negative_and_small_enough(costs: str) -> None:
    started = time.monotonic()
    line = one_line_error(fxpipe_cli("simulate", "--uniform-costs", costs, "--stages", "2", "--schedule", "zb-h2"))
    assert "--uniform-costs" in line
    # a hang guard, not a speed check: 1e7 used to hang the zero-bubble generator; the refusal takes well under
    # a second quiet, but 12.7 s was seen at load 4-7, so the bound is far above any load
    assert time.monotonic() - started < 120


@pytest.mark.parametrize("option", ["--trace", "--svg"])
def test_simulate_refuses_an_unwritable_output_before_the_work(option: str, unwritable: Path) -> None:
    line = one_line_error(fxpipe_cli("simulate", "--uniform-costs", "1,1,1", "--stages", "2", option, unwritable))
    assert line.startswith(f"error: {option} '{unwritable}'") and "is not a directory" in line


def test_simulate_refuses_a_missing_directory_and_a_directory(tmp_path: Path) -> None:
    line = one_line_error(fxpipe_cli("simulate", "--uniform-costs", "1,1,1", "-s", "2", "--trace",
                                     tmp_path / "no" / "t.json"))
    assert "does not exist" in line
    assert "is a directory" in one_line_error(fxpipe_cli("simulate", "--uniform-costs", "1,1,1", "-s", "2", "--svg",
                                                         tmp_path))


def test_run_refuses_an_unwritable_trace_before_any_rank_starts(plan: Path, unwritable: Path,
                                                                 no_rank_starts: list[list[str]]) -> None:
    line = one_line_error(fxpipe_cli("run", plan, "--trace", unwritable))
    assert line.startswith(f"error: --trace '{unwritable}'")


def test_compile_refuses_an_unwritable_out_before_compiling(unwritable: Path) -> None:
    line = one_line_error(fxpipe_cli("compile", "mlp-tiny", "--out", unwritable / "plan"))
    assert line.startswith(f"error: --out '{unwritable / 'plan'}' cannot be created")


def test_backend_with_zero_stages_is_an_option_error() -> None:
    torch._dynamo.reset()
    model = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)),
                          backend="fxpipe", options={"stages": 0})
    with pytest.raises(Exception, match=r"options 'stages' must be a whole number of at least 1 \(stages: 0\)") as err:
        model(torch.randn(4, 8))
    inner = getattr(err.value, "inner_exception", err.value)  # Dynamo wraps what a backend raises
    assert isinstance(inner, OptionError)
    assert len(str(inner).splitlines()) == 1


@pytest.mark.parametrize("command", [["compile", "mlp-tiny", "--schedule", "1f1b"], ["run", "PLAN"],
                                     ["simulate", "--uniform-costs", "1,1,1", "--stages", "2"]])
def test_a_schedule_too_big_to_generate_is_refused_at_once(command: list[str], plan: Path) -> None:
    started = time.monotonic()
    args = [str(plan) if a == "PLAN" else a for a in command]
    line = one_line_error(fxpipe_cli(*args, "--microbatches", "99999999"))
    assert "is too big to generate and simulate" in line
    assert time.monotonic() - started < 120  # a hang guard (see above): 1e8 microbatches used to hang


# -- every size bounded before work starts (issue 41): each was accepted, or ended in a traceback -------------------

@pytest.mark.parametrize("args, says", [
    (["compile", "mlp-tiny", "--microbatches", "1000000000"], "--microbatches must be at most 10,000"),
    (["compile", "mlp-tiny", "--stages", "1000000000"], "--stages must be at most 1,024"),
    (["compile", "mlp-tiny", "--dp", "1000000"], "--dp must be at most 1,024"),
    (["compile", "mlp-tiny", "--batch-size", "100000000000"], "--batch-size must be at most 1,048,576"),
    (["compile", "mlp-tiny", "--seed", "-99999999999999999999999"], "--seed must be at least"),
    (["compile", "mlp-tiny", "--stages", "1", "--dp", "2", "--strategy", "dp", "--latency", "-5"],
     "Invalid value for '--latency': Input should be greater than or equal to 0"),
    (["compile", "mlp-tiny", "--device-flops", "inf"], "--device-flops must be a positive number, and finite"),
    (["strategy", "mlp-small", "--latency", "-5"], "Invalid value for '--latency': Input should be greater than or "
                                                   "equal to 0"),
    (["run", "PLAN", "--dp", "1000000"], "--dp must be at most 1,024"),
    (["run", "PLAN", "--nproc", "1000000", "--dp", "500000"], "--dp must be at most 1,024"),
    (["run", "PLAN", "--seed", "-99999999999999999999999"], "--seed must be at least"),
    (["run", "PLAN", "--timeout", "inf"], "--timeout is seconds a rank waits, more than 0 and at most a week"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_size_past_its_bound_is_refused_before_any_work(args: list[str], says: str, plan: Path) -> None:
    started = time.monotonic()
    line = one_line_error(fxpipe_cli(*[str(plan) if a == "PLAN" else a for a in args]))
    assert says in line, line
    assert time.monotonic() - started < 120  # a hang guard: each used to run for minutes or grow to gigabytes


def test_a_plan_naming_another_model_than_its_stages_is_refused_before_any_rank(plan: Path, tmp_path: Path) -> None:
    """plan.json says gpt-1.5b over mlp-tiny's stages: every rank would build 1.5 B parameters first (36 s)."""
    import json
    import shutil

    forged = Path(shutil.copytree(plan, tmp_path / "forged"))
    doc = json.loads((forged / "plan.json").read_text())
    doc["plan"]["provenance"]["model"] = "gpt-1.5b"
    (forged / "plan.json").write_text(json.dumps(doc))
    started = time.monotonic()
    line = one_line_error(fxpipe_cli("run", forged))
    assert "is not a plan of gpt-1.5b" in line and "is not a parameter of gpt-1.5b" in line, line
    assert time.monotonic() - started < 60  # no rank started, no 1.5 B parameters built


@pytest.mark.parametrize("call", ["sys.exit(7)", "os._exit(1)", "sys.exit(0)"])
@pytest.mark.parametrize("where", ["import", "builder"])
def test_a_model_file_that_exits_is_one_line_naming_it(tmp_path: Path, call: str, where: str) -> None:
    model = tmp_path / "exits.py"
    body = f"    {call}\n" if where == "builder" else "    pass\n"
    model.write_text(f"import os, sys\nimport torch\n{call if where == 'import' else ''}\n\n"
                     f"def build():\n{body}    return torch.nn.Linear(4, 4), (torch.randn(2, 4),)\n")
    line = one_line_error(fxpipe_cli("compile", f"{model}:build"))
    assert str(model) in line and call.split("(")[0] in line, line


def test_a_full_disk_under_out_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """torch.save raises RuntimeError, not OSError, when the disk fills (what a small full filesystem gives)."""
    def full(*args: object, **kwargs: object) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    monkeypatch.setattr(torch, "save", full)
    line = one_line_error(fxpipe_cli("compile", "mlp-tiny", "--out", tmp_path / "plan"))
    assert "--out" in line and "file write failed" in line, line


def test_api_and_backend_refuse_wrong_types_in_one_line() -> None:
    import fxpipe

    model, x = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)), torch.randn(4, 8)
    for kwargs, says in [({"stages": "abc"}, "stages must be a whole number"),
                         ({"stages": True}, "stages must be a whole number"),
                         ({"stages": 10**9}, "stages must be at most 1,024"),
                         ({"microbatches": 10**9}, "--microbatches must be at most 10,000"),
                         ({"latency": -5.0}, "--latency must be 0 to"),
                         ({"device_flops": float("inf")}, "--device-flops must be a positive number, and finite"),
                         ({"profile": "yes"}, "profile must be True or False")]:
        with pytest.raises(FxpipeError) as info:
            fxpipe.compile(model, (x,), **kwargs)
        assert says in str(info.value) and "\n" not in str(info.value), (kwargs, str(info.value))
    for options, says in [({"stages": 10**9}, "options 'stages' must be at most 1,024"),
                          ({"devices": "cuda"}, "options 'devices' must be a non-empty list"),
                          ({"devices": [42]}, "options devices[0] is int 42, not a device"),
                          ({"devices": ["nowhere"]}, "options devices[0] 'nowhere' is not a device"),
                          ({"verbose": "yes"}, "options 'verbose' must be True or False")]:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fxpipe", options=options)
        started = time.monotonic()
        with pytest.raises(Exception) as info:
            compiled(x)
        inner = getattr(info.value, "inner_exception", info.value)  # Dynamo wraps what a backend raises
        assert isinstance(inner, OptionError) and says in str(inner) and "\n" not in str(inner), (options, inner)
        assert time.monotonic() - started < 60  # stages 10**9 grew to 24 GB


def test_torch_logged_tracebacks_stay_off_the_terminal(tmp_path: Path) -> None:
    """An example that does not fit the model: torch's fake-tensor logger printed 19 lines of traceback before the
    error line. They go to $FXPIPE_TORCH_LOG when it is set. (A process of its own, forked from the tests' preloaded
    fork server: torch's handler holds the real stderr.)"""
    import os

    from tests._helpers import run_forked

    model = tmp_path / "misfit.py"
    model.write_text("import torch\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(8, 8)), "
                     "(torch.randn(4, 5),)\n")
    log = tmp_path / "torch.log"
    for env in ({}, {"FXPIPE_TORCH_LOG": str(log)}):
        done = run_forked(["-m", "fxpipe.cli.main", "compile", f"{model}:build"], env={**os.environ, **env})
        assert done.returncode == 2, done.stderr
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: cannot trace"), done.stderr
    assert "Traceback" in log.read_text()


def test_a_port_in_use_is_named(plan: Path) -> None:
    """--master-port held by another program: torchrun fails in seconds, and the line said "waited up to 300 s"."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        line = one_line_error(fxpipe_cli("run", plan, "--master-addr", "127.0.0.1", "--master-port", port))
    assert f"--master-port {port}" in line and "already in use" in line, line
    assert "waited" not in line, line
