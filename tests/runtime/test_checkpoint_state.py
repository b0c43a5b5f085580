"""Checkpoints of a real runtime: its state through torch's ``get_state_dict``/``set_state_dict`` into DCP resumes
bit for bit, asynchronous saves (``dcp.async_save``) give the same run, and the previous format still loads.

One process, one gloo rank, gpt-tiny on 3 stages (its tied weight on two of them), AdamW with a cosine schedule
and clipping: every kind of state a checkpoint holds (weights, AdamW's step and moments, the lr schedule's step)
changes every step. The multi-rank cases are tests/runtime/test_checkpoint.py's launches.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe import models
from fxpipe.cli.rank_common import synthetic_batch
from fxpipe.errors import CheckpointError
from fxpipe.runtime import checkpoint
from fxpipe.runtime.optim import LRSchedule, OptimizerSpec
from fxpipe.schedules.generators import one_rank

M = 4  # microbatches
STEPS = 4
ROOT = Path(__file__).resolve().parents[2]
# The last commit whose checkpoint.py flattened the runtime's state by hand (fxpipe.checkpoint/v1's first writer).
PREVIOUS = "132476a"


@functools.cache
def _compiled() -> tuple[Any, fxpipe.Pipeline]:
    zoo = models.build("gpt-tiny")
    return zoo, fxpipe.compile(copy.deepcopy(zoo.model), zoo.example_inputs, stages=3)


def _runtime(**options: Any) -> Any:
    from fxpipe.runtime import PipelineRuntime

    zoo, pipe = _compiled()
    return PipelineRuntime(copy.deepcopy(pipe), one_rank(3, M), zoo.loss_fn,
                           optimizer=OptimizerSpec("adamw", lr=1e-2, weight_decay=0.1),
                           lr_schedule=LRSchedule("cosine", warmup_steps=1, total_steps=STEPS), clip_grad_norm=0.5,
                           **options)


def _losses(rt: Any, steps: range, *, save: Any = None) -> list[float]:
    """``rt``'s losses over ``steps`` (each step's batch is the same seeded batch); ``save(rt, k)`` after step k."""
    zoo, _ = _compiled()
    inputs, target = synthetic_batch(zoo, M)
    out = []
    for k in steps:
        out.append(float(rt.step(inputs, target)))
        if save is not None:
            save(rt, k + 1)
    return out


@functools.cache
def _unbroken() -> tuple[float, ...]:
    return tuple(_losses(_runtime(), range(STEPS)))


def _assert_same(got: list[float], want: tuple[float, ...] | list[float]) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=0, atol=0)


def _resumed(directory: Path, first: int) -> list[float]:
    rt = _runtime()
    assert rt.load_checkpoint(directory) == first
    return _losses(rt, range(first, STEPS))


def test_a_checkpoint_through_get_state_dict_resumes_bit_for_bit(world1: None, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    rt = _runtime()
    before = _losses(rt, range(2), save=lambda rt, k: rt.save_checkpoint(ck, k))
    _assert_same(before, _unbroken()[:2])
    # The DCP keys are torch's flattened optimizer state under optim.; each parameter's hyperparameters in the JSON.
    md = checkpoint.read_metadata(ck / "step_000002" / ".metadata").state_dict_metadata
    assert {"model.lm_head.weight", "optim.state.lm_head.weight.exp_avg", "optim.state.lm_head.weight.step",
            "fxpipe.runtime.rank0.lr_step"} <= set(md)
    groups = json.loads((ck / "step_000002" / checkpoint.MARKER).read_text())["param_groups"]
    assert {f for g in groups for f in g["params"]} == {k[len("model."):] for k in md if k.startswith("model.")}
    assert all(g["betas"] == [0.9, 0.999] and g["weight_decay"] == 0.1 for g in groups)
    _assert_same(before + _resumed(ck, 2), _unbroken())


def test_asynchronous_saves_give_the_losses_and_checkpoints_of_synchronous_ones(world1: None, tmp_path: Path) -> None:
    sync, asyn = tmp_path / "sync", tmp_path / "async"
    _losses(_runtime(), range(3), save=lambda rt, k: rt.save_checkpoint(sync, k))
    rt = _runtime(async_checkpoint=True)
    got = _losses(rt, range(3), save=lambda rt, k: rt.save_checkpoint(asyn, k))
    # Step 3's save is under way: its partial directory is not a step yet; waiting completes it.
    assert sorted(p.name for p in asyn.iterdir()) == [".step_000003.partial", "step_000001", "step_000002"]
    assert rt.wait_checkpoint() == asyn / "step_000003" and rt.wait_checkpoint() is None
    _assert_same(got, _unbroken()[:3])
    # The weights went on changing while step 3 was written: the files hold step 3's state, as the synchronous ones.
    data = [d / "step_000003" / "__0_0.distcp" for d in (asyn, sync)]
    assert data[0].read_bytes() == data[1].read_bytes()
    index = [checkpoint.read_metadata(d / "step_000003" / ".metadata") for d in (asyn, sync)]
    assert index[0].state_dict_metadata == index[1].state_dict_metadata  # (.metadata also names its directory)
    _assert_same(got + _resumed(asyn, 3), _unbroken())


def test_a_failed_asynchronous_save_says_what_a_synchronous_one_says(world1: None, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_FileSystemWriter, "write_data", full)
    rt = _runtime()
    with pytest.raises(CheckpointError) as sync:
        rt.save_checkpoint(tmp_path / "sync", 1)
    rt.save_checkpoint(tmp_path / "async", 1, asynchronous=True)  # the failure comes when the save is waited for
    with pytest.raises(CheckpointError) as asyn:
        rt.wait_checkpoint()
    assert str(asyn.value) == str(sync.value) == ("saving the checkpoint failed on rank 0: OSError: [Errno 28] No "
                                                   "space left on device")
    rt.save_checkpoint(tmp_path / "async", 1, asynchronous=True)
    with pytest.raises(CheckpointError, match="^saving the checkpoint failed on rank 0: "):
        rt.save_checkpoint(tmp_path / "async", 2)  # or when the next save starts: the steps never overlap
    monkeypatch.undo()
    assert rt.wait_checkpoint() is None  # nothing is left under way
    with pytest.raises(CheckpointError, match=r"\.step_000001\.partial is incomplete \(a save that did not finish\)"):
        checkpoint.newest(tmp_path / "async")


def _previous_module(tmp_path: Path) -> Any:
    """fxpipe.runtime.checkpoint as of PREVIOUS (it hand-flattened ``rt.state_dict()``), loaded from git."""
    try:
        source = subprocess.run(["git", "show", f"{PREVIOUS}:fxpipe/runtime/checkpoint.py"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"needs the git history (commit {PREVIOUS})")
    file = tmp_path / "checkpoint_v1.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location("fxpipe_checkpoint_v1", file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_a_checkpoint_of_the_previous_format_resumes_and_an_unknown_one_is_one_line(world1: None,
                                                                                      tmp_path: Path) -> None:
    previous, ck = _previous_module(tmp_path), tmp_path / "ck"
    rt = _runtime()
    before = _losses(rt, range(2), save=lambda rt, k: previous.save(rt, ck, k))
    assert json.loads((ck / "step_000002" / checkpoint.MARKER).read_text())["schema"] == checkpoint.SCHEMA
    _assert_same(before + _resumed(ck, 2), _unbroken())
    # A record of a schema this fxpipe does not know (a newer one) is never loaded: one line says why.
    for step in (1, 2):
        marker = ck / f"step_{step:06d}" / checkpoint.MARKER
        marker.write_text(json.dumps({**json.loads(marker.read_text()), "schema": "fxpipe.checkpoint/v9"}))
    with pytest.raises(CheckpointError) as refused:
        _runtime().load_checkpoint(ck)
    assert str(refused.value) == (
        f"no complete checkpoint in {ck} (step_000002 is corrupt (fxpipe-checkpoint.json is not of schema "
        f"{checkpoint.SCHEMA}); step_000001 is corrupt (fxpipe-checkpoint.json is not of schema "
        f"{checkpoint.SCHEMA})); start without --resume")
