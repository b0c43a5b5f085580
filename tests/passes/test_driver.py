"""The pass driver: order, timing, history, verify-each, stop-after and print-after."""

from __future__ import annotations

import pytest
import torch

from fxpipe import models
from fxpipe.api import build_steps
from fxpipe.errors import OptionError, VerifyError
from fxpipe.graphs.fx import clone, compute_nodes
from fxpipe.meta import update_meta
from fxpipe.passes import DEFAULT_PASSES, PassResult, Step, run_steps
from fxpipe.plan import CompileOptions


def _steps(**options: object) -> list[Step]:
    zoo = models.build("mlp-tiny")
    return build_steps(zoo.model, zoo.example_inputs, CompileOptions(stages=2, **options))  # type: ignore[arg-type]


def test_pipeline_order_and_history() -> None:
    steps = _steps()
    assert [s.name for s in steps] == list(DEFAULT_PASSES)
    root, history = run_steps(steps, verify_each=True)
    assert [r.name for r in history.records] == [s.name for s in steps]
    assert all(r.seconds >= 0 and r.verified for r in history.records)
    table = history.report()
    assert table.column("pass") == [s.name for s in steps]
    assert hasattr(root, "stage_1")


def test_stop_after_and_print_after() -> None:
    gm, history = run_steps(_steps(), stop_after="group-layers", print_after=("annotate-costs",))
    assert [r.name for r in history.records] == ["trace", "annotate-costs", "group-layers"]
    printed = history.records[1].printed
    assert printed is not None and "def forward" in printed
    assert history.records[0].printed is None
    assert not hasattr(gm, "stage_0")


def test_unknown_pass_name() -> None:
    with pytest.raises(OptionError, match="unknown pass 'nope'.*annotate-costs"):
        run_steps(_steps(), stop_after="nope")


def test_verify_each_catches_a_pass_that_breaks_an_invariant() -> None:
    steps = _steps()

    def unstage(gm: torch.fx.GraphModule | None) -> PassResult:
        assert gm is not None
        out = clone(gm)
        last = list(compute_nodes(out.graph))[-1]
        update_meta(last, stage_idx=-1)  # a node with no stage
        return PassResult(out, True)

    partition = next(s for s in steps if s.name == "partition-stages")
    broken = Step("partition-stages", lambda gm: unstage(partition.run(gm).gm), partition.verify)
    bad = [broken if s.name == "partition-stages" else s
           for s in steps if s.name not in ("split-stages", "split-backward")]
    with pytest.raises(VerifyError, match="pass 'partition-stages' broke 1 invariant.*has no stage"):
        run_steps(bad, verify_each=True)
    run_steps(bad, verify_each=False)  # without verification the broken graph goes through


def test_profile_step_is_added_only_when_asked() -> None:
    assert "profile-layers" in [s.name for s in _steps(profile=True)]
    assert "profile-layers" not in [s.name for s in _steps()]
