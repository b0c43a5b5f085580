"""RuntimeOptions: PipelineRuntime's knobs in one frozen record, its defaults read from DEFAULTS, and the keyword
arguments of before it mapped onto it."""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect

import pytest

import fxpipe
from fxpipe import models
from fxpipe.plan import DEFAULTS
from fxpipe.runtime import PipelineRuntime, RuntimeOptions
from fxpipe.schedules.generators import one_rank


@functools.cache
def _compiled() -> tuple[object, fxpipe.Pipeline]:
    zoo = models.build("mlp-tiny")
    return zoo, fxpipe.compile(copy.deepcopy(zoo.model), zoo.example_inputs, stages=2)


def _lrs(rt: PipelineRuntime) -> set[float]:
    return {group["lr"] for opt in rt.optimizers.values() for group in opt.param_groups}


def test_the_options_are_frozen_and_exported() -> None:
    assert fxpipe.RuntimeOptions is RuntimeOptions
    with pytest.raises(dataclasses.FrozenInstanceError):
        RuntimeOptions().lr = 1.0  # type: ignore[misc]
    named = [p for p in inspect.signature(PipelineRuntime).parameters.values() if p.kind is not p.VAR_KEYWORD]
    assert len(named) <= 10


def test_the_learning_rate_follows_DEFAULTS(monkeypatch: pytest.MonkeyPatch, world1: None) -> None:
    assert RuntimeOptions().lr == DEFAULTS.lr
    monkeypatch.setattr(DEFAULTS, "lr", 0.25)
    assert RuntimeOptions().lr == 0.25
    zoo, pipe = _compiled()
    rt = PipelineRuntime(copy.deepcopy(pipe), one_rank(2, 2), zoo.loss_fn)  # type: ignore[attr-defined]
    assert _lrs(rt) == {0.25}


def test_options_and_keyword_arguments_are_the_same_runtime(world1: None) -> None:
    zoo, pipe = _compiled()
    by_options = PipelineRuntime(copy.deepcopy(pipe), one_rank(2, 2), zoo.loss_fn,  # type: ignore[attr-defined]
                                 options=RuntimeOptions(optimizer="adamw", lr=0.5, w_lane=True))
    by_keywords = PipelineRuntime(copy.deepcopy(pipe), one_rank(2, 2), zoo.loss_fn,  # type: ignore[attr-defined]
                                  optimizer="adamw", lr=0.5, w_lane=True)
    assert by_options.options == by_keywords.options
    assert _lrs(by_options) == _lrs(by_keywords) == {0.5}
    assert by_options.w_lane is not None and by_keywords.w_lane is not None
    # a keyword argument overrides the options' field
    over = PipelineRuntime(copy.deepcopy(pipe), one_rank(2, 2), zoo.loss_fn,  # type: ignore[attr-defined]
                           options=RuntimeOptions(lr=0.5), lr=0.125)
    assert _lrs(over) == {0.125}


def test_an_unknown_keyword_argument_is_a_type_error(world1: None) -> None:
    zoo, pipe = _compiled()
    with pytest.raises(TypeError, match="PipelineRuntime\\(\\) got an unexpected keyword argument 'learning_rate'"):
        PipelineRuntime(copy.deepcopy(pipe), one_rank(2, 2), zoo.loss_fn, learning_rate=0.1)  # type: ignore[attr-defined]


def test_the_runtime_holds_the_collectives_it_waited_for(monkeypatch: pytest.MonkeyPatch, world1: None) -> None:
    """Gloo's worker thread lets go of a work after ``wait`` returns: the runtime keeps each one, so that thread never
    frees the last reference to a tensor (which takes the GIL, and aborts the process at a script's end)."""
    import gc
    import types

    import torch.distributed as dist

    works: list[object] = []
    real = dist.all_reduce

    def recorded(*args: object, **kwargs: object) -> object:
        work = real(*args, **kwargs)  # type: ignore[arg-type]
        works.append(work)
        return work

    monkeypatch.setattr(dist, "all_reduce", recorded)
    zoo, pipe = _compiled()
    rt = PipelineRuntime(copy.deepcopy(pipe), one_rank(2, 2), zoo.loss_fn)  # type: ignore[attr-defined]
    import torch

    batch = ([torch.cat([x, x]) for x in zoo.example_inputs], torch.cat([zoo.example_target] * 2))  # type: ignore[attr-defined]
    rt.step(*batch)
    rt.evaluate([batch])
    assert len(works) == 2  # the step's loss and the evaluation's

    def held() -> list[bool]:
        """Whether anything but this list (and this frame) holds each work: a plain loop, no generator's frame."""
        out = []
        for w in works:
            out.append(any(r is not works and not isinstance(r, types.FrameType) for r in gc.get_referrers(w)))
        return out

    assert held() == [True, True], "a waited work's only reference is this test's list"
    del rt
    gc.collect()  # the runtime holds cycles (its runner refers back to it)
    assert held() == [False, False]  # they go with the runtime
