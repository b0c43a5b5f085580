"""Every command's options are its config's (fxpipe.cli.command_configs): --config FILE and --print-config on each,
a flag overriding the file, a bad key or type one line and exit 2; one flag, one meaning, one set of choices."""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import pytest
import typer.main

from fxpipe.cli import command_configs
from fxpipe.cli.config import keyed_params, leaves
from fxpipe.cli.main import app
from tests._helpers import fxpipe_cli, ok, one_line_error

tomllib = pytest.importorskip("tomllib")

# each command with the arguments --print-config needs besides its options
COMMANDS = {"compile": ("mlp-tiny",), "simulate": (), "strategy": ("vgg-tiny",), "inspect": ("plan",),
            "models": (), "export": ("plan",)}
CONFIGS = {"compile": command_configs.CompileConfig, "simulate": command_configs.SimulateConfig,
           "strategy": command_configs.StrategyConfig, "inspect": command_configs.InspectConfig,
           "models": command_configs.ModelsConfig, "export": command_configs.ExportConfig}


def _commands() -> dict[str, Any]:
    return typer.main.get_command(app).commands  # type: ignore[attr-defined,no-any-return]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_print_config_writes_what_config_reads_back(name: str, tmp_path: Path) -> None:
    printed = ok(fxpipe_cli(name, *COMMANDS[name], "--print-config")).stdout
    doc = tomllib.loads(printed)
    keys = {k for k, v in doc.items() if not isinstance(v, dict)} | {
        k for v in doc.values() if isinstance(v, dict) for k in v}
    options = {leaf.key for leaf in leaves(CONFIGS[name]) if leaf.meta["toml"] and not leaf.meta["hidden"]}
    assert keys <= options and set(keyed_params(_commands()[name])) == options
    (tmp_path / "c.toml").write_text(printed)
    assert ok(fxpipe_cli(name, "--config", tmp_path / "c.toml", "--print-config")).stdout == printed


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_bad_key_or_type_is_one_line_and_exit_2(name: str, tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("no-such-option = 1\n")
    line = one_line_error(fxpipe_cli(name, *COMMANDS[name], "--config", config))
    assert f"unknown key 'no-such-option'; the keys are fxpipe {name}'s flags" in line
    config.write_text("plain = 3\n" if name != "export" else 'out = true\n')
    line = one_line_error(fxpipe_cli(name, *COMMANDS[name], "--config", config))
    assert ("plain = 3 is an integer; plain takes true or false" if name != "export" else
            "out = true is true or false; out takes a string") in line


def test_simulate_print_config_resolves_the_file_and_the_flags(tmp_path: Path) -> None:
    config = tmp_path / "s.toml"
    config.write_text('uniform-costs = "1,2,1"\nstages = 4\noptimizer = "adamw"\n')
    doc = tomllib.loads(ok(fxpipe_cli("simulate", "--config", config, "--stages", "2", "--print-config")).stdout)
    assert (doc["uniform-costs"], doc["stages"], doc["optimizer"], doc["momentum"]) == ("1,2,1", 2, "adamw", 0.0)
    got = json.loads(ok(fxpipe_cli("simulate", "--config", config, "--stages", "2", "--json")).stdout)
    assert (got["stages"], got["makespan"]) == (2, 4 * 4 + 4)  # 1F1B, 2 stages, 4 microbatches of 1+2+1


def test_compile_reads_its_config_file_and_a_flag_overrides_it(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    out = tmp_path / "plan"
    config.write_text(f'target = "mlp-tiny"\n[partitioning]\nstages = 3\n[output]\nout = "{out}"\n')
    ok(fxpipe_cli("compile", "--config", config))
    assert json.loads((out / "plan.json").read_text())["num_stages"] == 3
    ok(fxpipe_cli("compile", "--config", config, "--stages", "2"))
    assert json.loads((out / "plan.json").read_text())["num_stages"] == 2
    config.write_text('[model]\nstages = 3\n')
    assert "unknown key [model] 'stages'; stages is in [partitioning]" in one_line_error(
        fxpipe_cli("compile", "mlp-tiny", "--config", config))


def test_strategy_reads_its_config_file(tmp_path: Path) -> None:
    config = tmp_path / "s.toml"
    config.write_text('target = "vgg-tiny"\nranks = 4\nbatch-size = 8\noptimizer = "sgd"\nmomentum = 0.9\n')
    sgd = json.loads(ok(fxpipe_cli("strategy", "--config", config, "--json", "--momentum", "0")).stdout)
    momentum = json.loads(ok(fxpipe_cli("strategy", "--config", config, "--json")).stdout)
    assert sgd["ranks"] == momentum["ranks"] == 4 and sgd["layers"]


def test_the_schedules_are_the_registry_s() -> None:
    from fxpipe.schedules.generators import GENERATORS

    assert typing.get_args(command_configs.ScheduleName) == (*GENERATORS, "auto")


def _choices(param: Any) -> frozenset[str] | None:
    """A parameter's choices: its annotation's Literal (or Literal | None)."""
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    for tp in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(tp) is typing.Literal:
            return frozenset(map(str, typing.get_args(tp)))
    return None


def test_one_flag_has_one_set_of_choices_in_every_command() -> None:
    """A flag that two commands share lists the same choices in both (or neither lists any); --optimizer is sgd or
    adamw with --momentum wherever it is; compile's model device is --build-device, not run's --device."""
    seen: dict[str, tuple[str, frozenset[str] | None]] = {}
    for name, command in _commands().items():
        for param in command.params:
            flag = next((o for o in param.opts if o.startswith("--")), None)
            if flag is None or flag in ("--help", "--config", "--print-config"):
                continue
            if (name, flag) == ("run", "--schedule"):  # run's is str (fxpipe/cli/run_config.py): any plan's name
                continue
            first = seen.setdefault(flag, (name, _choices(param)))
            assert first[1] == _choices(param), f"{flag}: {first[0]} {first[1]} but {name} {_choices(param)}"
    assert seen["--optimizer"][1] == {"sgd", "adamw"} and "--momentum" in seen
    assert seen["--device"] == ("run", {"cpu", "cuda"}) and seen["--build-device"][1] == {"cpu", "meta"}
    every = {o for c in _commands().values() for p in c.params for o in p.opts}
    assert "--memory-per-device" in every and "--activation-memory-per-stage" in every
    compile_flags = {o for p in _commands()["compile"].params for o in p.opts}
    assert "--memory-per-stage" in compile_flags and "--memory-per-device" not in compile_flags


def test_every_enumerated_option_lists_its_choices() -> None:
    from typer.testing import CliRunner

    wide = {"COLUMNS": "400", "TERMINAL_WIDTH": "400"}
    for name, flags in (("compile", ("<cpu|meta>", "<export|fx>", "<on|full|off>", "<float32|float64|bfloat16>",
                                     "<auto|dp|splitbrain>")),
                        ("simulate", ("<sgd|adamw>", "<none|stage|auto>")), ("strategy", ("<sgd|adamw>",))):
        shown = CliRunner().invoke(app, [name, "--help"], env=wide).stdout
        for choices in flags:
            assert choices in shown, (name, choices)


def test_simulate_prints_times_with_their_unit(tmp_path: Path) -> None:
    text = ok(fxpipe_cli("simulate", "--uniform-costs", "1,2,1", "--stages", "2")).stdout
    assert "makespan 20 units, 1 column = 0.2 units" in text
