"""profile_layers: measured layer times replace the estimates; real state is left as it was."""

from __future__ import annotations

import pytest
import torch

from fxpipe import models
from fxpipe.api import build_steps
from fxpipe.errors import OptionError
from fxpipe.passes import run_steps
from fxpipe.passes.group_layers import layer_stats
from fxpipe.plan import CompileOptions


def test_profile_measures_every_layer_and_restores_buffers() -> None:
    zoo = models.build("resnet-tiny")
    buffers = {n: b.clone() for n, b in zoo.model.named_buffers()}
    steps = build_steps(zoo.model, zoo.example_inputs, CompileOptions(stages=2, profile=True, profile_runs=2))
    gm, history = run_steps(steps, verify_each=True, stop_after="profile-layers")
    report = history.records[-1].reports[0]
    stats = layer_stats(gm)
    assert report.column("name") == [s.name for s in stats]
    measured_f = report.column("measured F ms")
    assert all(t > 0 for t in measured_f)
    for s, f in zip(stats, measured_f):
        assert s.time_fwd * 1e3 == pytest.approx(f, rel=1e-3, abs=1e-4)
    for name, b in zoo.model.named_buffers():
        assert torch.equal(b, buffers[name]), f"profiling changed buffer {name}"


def test_profile_refuses_meta_models() -> None:
    zoo = models.build("mlp-tiny", device="meta")
    steps = build_steps(zoo.model, zoo.example_inputs, CompileOptions(stages=2, profile=True))
    with pytest.raises(OptionError, match="meta device; drop --profile"):
        run_steps(steps)
