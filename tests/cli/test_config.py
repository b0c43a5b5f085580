"""Each option is declared once, in its command's config: the typer options, the --config TOML keys, --print-config,
what the ranks of fxpipe run read and the runtime's options all come from it. Changing a default in the config
changes the help, the TOML template and what the runtime does."""

from __future__ import annotations

import copy
import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
import typer
import typer.main
from typer.testing import CliRunner

from fxpipe.cli import run_config
from fxpipe.cli.config import Config, command, keyed_params, leaves, read_json, write_json
from fxpipe.cli.run_config import RunConfig
from fxpipe.errors import OptionError

ROOT = Path(__file__).parents[2]
WIDE = {"COLUMNS": "400", "TERMINAL_WIDTH": "400"}


def _app(cls: type[Config]) -> typer.Typer:
    app = typer.Typer()
    app.command("run")(command(cls, lambda ctx, config: None, "run"))
    app.command("other")(lambda: None)  # a group, so that "run" is a subcommand as in fxpipe's app
    return app


def _params(cls: type[Config]) -> dict[str, Any]:
    group = typer.main.get_command(_app(cls))
    return {p.name: p for p in group.commands["run"].params}  # type: ignore[attr-defined]


def test_the_typer_options_the_toml_keys_and_the_ranks_options_are_the_config_s() -> None:
    names = {leaf.name for leaf in leaves(RunConfig)}
    assert set(_params(RunConfig)) == names | {"config", "print_config"}
    group = typer.main.get_command(_app(RunConfig))
    keys = set(keyed_params(group.commands["run"]))  # type: ignore[attr-defined]
    assert keys == {leaf.key for leaf in leaves(RunConfig) if leaf.meta["toml"] and not leaf.meta["hidden"]}
    written = RunConfig().replace(nproc=2, dp=1, trace=Path("t.json")).to_toml("test")
    assert {m.group(1) for m in re.finditer(r"^#? ?([a-z][a-z0-9-]*)(?: =|:)", written, re.M)} == keys


def test_the_ranks_read_the_config_itself(tmp_path: Path) -> None:
    from fxpipe.cli.rank import rank_args

    config = RunConfig(plan_dir=tmp_path).replace(steps=7, lr=0.25, optimizer="adamw", cuda_graphs=False)
    args = rank_args(write_json(config, tmp_path / "run.json", trust_ops=["transformers"], synthetic=None),
                     str(tmp_path))
    assert args.config == config and (args.steps, args.lr, args.optimizer, args.plan) == (7, 0.25, "adamw",
                                                                                          str(tmp_path))
    assert {leaf.name for leaf in leaves(RunConfig)} <= set(vars(args))
    assert read_json(RunConfig, tmp_path / "run.json")[1] == {"trust_ops": ["transformers"], "synthetic": None}


def test_the_rank_program_declares_no_option_of_its_own() -> None:
    """No run option is declared a second time in the rank program (it once rebuilt all of them with argparse)."""
    text = (ROOT / "fxpipe" / "cli" / "rank.py").read_text()
    assert re.findall(r"add_argument\(\"(--?[\w-]+)\"", text) == ["--out"]


def test_a_bad_value_is_refused_alike_by_the_api_the_cli_and_the_ranks(tmp_path: Path) -> None:
    with pytest.raises(OptionError, match="--optimizer 'adam' is not one of sgd, adamw"):
        RunConfig().replace(optimizer="adam")
    with pytest.raises(OptionError, match="--steps is at least 1"):
        RunConfig().replace(steps=0)
    with pytest.raises(OptionError, match="--clip-grad-norm is the largest global gradient norm"):
        RunConfig().replace(clip_grad_norm=-1.0)
    with pytest.raises(TypeError, match="no option 'stepz'"):
        RunConfig().replace(stepz=3)
    (tmp_path / "run.json").write_text('{"config": {"steps": 0}}')
    with pytest.raises(OptionError, match="--steps is at least 1"):
        read_json(RunConfig, tmp_path / "run.json")


def test_the_weight_policies_are_the_runtime_s() -> None:
    from fxpipe.schedules.versions import POLICIES

    assert typing.get_args(run_config.WeightPolicy) == POLICIES


def _with_default(name: str, value: Any) -> type[RunConfig]:
    """RunConfig with one option's default changed, as an edit of run_config.py would change it."""
    hints = typing.get_type_hints(RunConfig)
    top = []
    for f in dataclasses.fields(RunConfig):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp) and name in {g.name for g in dataclasses.fields(tp)}:
            inner = typing.get_type_hints(tp)
            tp = dataclasses.make_dataclass(tp.__name__, [
                (g.name, inner[g.name], dataclasses.field(default=value if g.name == name else g.default,
                                                           metadata=g.metadata)) for g in dataclasses.fields(tp)],
                frozen=True)
            top.append((f.name, tp, dataclasses.field(default_factory=tp)))
        elif dataclasses.is_dataclass(tp):
            top.append((f.name, tp, dataclasses.field(default_factory=tp)))
        else:
            top.append((f.name, tp, dataclasses.field(default=f.default, metadata=f.metadata)))
    return dataclasses.make_dataclass("RunConfig", top, bases=(RunConfig,), frozen=True)


def test_a_default_changed_in_the_config_changes_the_help_the_toml_and_the_runtime(world1: None) -> None:
    import fxpipe
    from fxpipe import models
    from fxpipe.cli.rank_common import synthetic_batch
    from fxpipe.runtime import PipelineRuntime
    from fxpipe.schedules.generators import one_rank

    changed = _with_default("lr", 0.375)
    rendered = CliRunner().invoke(_app(changed), ["run", "--help"], env=WIDE).stdout
    row = next(line for line in rendered.splitlines() if "--lr " in line)
    assert "[default: 0.375]" in row and "[default: 0.375]" not in CliRunner().invoke(
        _app(RunConfig), ["run", "--help"], env=WIDE).stdout
    assert "\nlr = 0.375\n" in changed().to_toml("test")
    # what the runtime does: one SGD step moves each weight by -lr x its gradient
    zoo = models.build("mlp-tiny")
    pipe = fxpipe.compile(copy.deepcopy(zoo.model), zoo.example_inputs, stages=2)
    rt = PipelineRuntime(pipe, one_rank(2, 2), zoo.loss_fn, options=changed().runtime_options())
    before = {n: p.detach().clone() for s in rt.stages for n, p in s.module.named_parameters()}
    inputs, target = synthetic_batch(zoo, 2)
    rt.step(inputs, target)
    for s in rt.stages:
        for n, p in s.module.named_parameters():
            assert p.grad is not None
            torch.testing.assert_close(p.detach(), before[n] - 0.375 * p.grad)
