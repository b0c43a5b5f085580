"""Every synchronous schedule, through eager and compiled stages, gives eager PyTorch's losses, outputs and gradients.

The F, B, W, W_set and W_acc graphs do not depend on the schedule, so each (model, stage count) pipeline is compiled
once (and, for ``codegen="inductor"``, through Inductor once) and every schedule's order runs on it in this process
(the reference executor, W writing ``.grad`` in place as the distributed runtime does: ``InPlaceW``). The zoo's tiny
families, a Hugging Face GPT-2 and skip-tied (a skip across two cuts, an embedding tied to the head), at 2 and 4
stages, in float64.

Inductor's compiles take seconds per graph on a fresh cache, so the compiled matrix runs a representative subset by
default (:data:`COMPILED_DEFAULT`) and all of it with ``FXPIPE_TEST_COMPILED=all``; compiled cases are skipped
without a C++ compiler.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import re
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe import models
from fxpipe._compat import pytree
from fxpipe.runtime import codegen
from fxpipe.runtime.reference import ReferenceExecutor
from fxpipe.schedules.generators import GENERATORS, generate
from tests._helpers import skip_tied, token_ce
from tests.schedules._gradients import every_generator_gives_eagers_gradients

SCHEDULES = [name for name in sorted(GENERATORS) if generate(name, 2, 2).synchronous]
MODELS = ["mlp-tiny", "gpt-tiny", "vgg-tiny", "resnet-tiny", "hf-gpt2", "skip-tied"]
MICROBATCHES = 4
# The compiled case run by default: weights tied across stages, so one stage's first W is plain W (the other's W_set
# wrote the tied weight's .grad) and every graph kind runs compiled: F, B, W, W_set, W_acc. skip-tied has that in the
# fewest Inductor kernels (each a C++ compile of about a second: gpt-tiny took 37 CPU-s more on a fresh cache).
COMPILED_DEFAULT = {("skip-tied", 2)}
COMPILED_ALL = os.environ.get("FXPIPE_TEST_COMPILED") == "all"


def _hf_gpt2() -> tuple[torch.nn.Module, Any, tuple[Any, ...], Any]:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=96, n_positions=16, use_cache=False,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train().to(torch.float64)

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    return model, loss_fn, (torch.randint(0, 96, (2, 16)),), torch.randint(0, 96, (2, 16))


def _model(name: str) -> tuple[torch.nn.Module, Any, tuple[Any, ...], Any]:
    if name == "hf-gpt2":
        return _hf_gpt2()
    if name == "skip-tied":
        model, inputs, target = skip_tied()
        return model.to(torch.float64), token_ce, inputs, target
    zoo = models.build(name, dtype=torch.float64)
    return zoo.model, zoo.loss_fn, zoo.example_inputs, zoo.example_target


def _microbatches(inputs: tuple[Any, ...], target: torch.Tensor) -> list[tuple[tuple[Any, ...], Any]]:
    gen = torch.Generator().manual_seed(3)

    def like(x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point():
            return torch.randn(x.shape, generator=gen, dtype=x.dtype)
        return torch.randint(0, int(x.max()) + 1, x.shape, generator=gen)

    return [(tuple(like(x) for x in inputs), like(target)) for _ in range(MICROBATCHES)]


def _schedules(stages: int) -> list[str]:
    # interleaved-1f1b puts two stages on a rank and runs whole rounds of microbatches
    return [s for s in SCHEDULES if s != "interleaved-1f1b" or (stages % 2 == 0 and MICROBATCHES % (stages // 2) == 0)]


def _cases() -> list[Any]:
    cases = []
    for name in MODELS:
        for stages in (2, 4):
            cases.append(pytest.param(name, stages, "eager", id=f"{name}-{stages}-eager"))
            marks = [pytest.mark.slow]
            if not COMPILED_ALL and (name, stages) not in COMPILED_DEFAULT:
                marks.append(pytest.mark.skip(reason="compiled matrix: set FXPIPE_TEST_COMPILED=all"))
            cases.append(pytest.param(name, stages, "inductor", id=f"{name}-{stages}-inductor", marks=marks))
    return cases


@functools.cache
def _pipeline(name: str, stages: int) -> tuple[Any, ...]:
    """The model's pipeline (compiled once for both codegens), its microbatches, and eager's losses, outputs and
    gradients of the mean loss over them."""
    model, loss_fn, inputs, target = _model(name)
    mbs = _microbatches(inputs, target)
    ref = copy.deepcopy(model)
    ref_losses, ref_outputs = [], []
    for xs, t in mbs:
        out = ref(*xs)
        ref_outputs.append([v.detach() for v in pytree.tree_flatten(out)[0] if isinstance(v, torch.Tensor)])
        ref_losses.append(loss_fn(out, t))
    (sum(ref_losses) / MICROBATCHES).backward()
    expected = {n: p.grad for n, p in ref.named_parameters()}
    mine = copy.deepcopy(model)
    pipe = fxpipe.compile(mine, inputs, stages=stages, granularity="1" if name == "skip-tied" else "auto")
    return mine, pipe, loss_fn, mbs, torch.stack(ref_losses).detach(), ref_outputs, expected


@pytest.mark.parametrize(("name", "stages", "gen"), _cases())
def test_every_schedule_gives_eagers_losses_outputs_and_gradients(name: str, stages: int, gen: str) -> None:
    if gen == "inductor" and codegen.cpp_compiler() is None:
        pytest.skip("needs a C++ compiler for Inductor's CPU code")
    if name == "hf-gpt2":
        pytest.importorskip("transformers")
    mine, pipe, loss_fn, mbs, ref_losses, ref_outputs, expected = _pipeline(name, stages)
    executor = ReferenceExecutor(pipe, loss_fn, codegen=gen, w_in_place=True)
    assert executor.codegen == gen
    for sched in _schedules(stages):
        mine.zero_grad(set_to_none=True)  # each schedule's first W writes .grad through W_set, later ones W_acc
        losses = executor.run_schedule(generate(sched, stages, MICROBATCHES), mbs)
        where = f"{name} {stages} stages {gen} {sched}"
        torch.testing.assert_close(torch.stack(losses), ref_losses, msg=lambda msg: f"{where} losses: {msg}")
        for m, (got, want) in enumerate(zip(executor.outputs, ref_outputs)):
            got = [v for v in got if isinstance(v, torch.Tensor)]
            assert len(got) == len(want), where
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, msg=lambda msg: f"{where} mb {m} output: {msg}")
        for pname, p in mine.named_parameters():
            assert p.grad is not None, f"{where}: {pname} got no gradient"
            torch.testing.assert_close(p.grad, expected[pname], msg=lambda msg: f"{where} {pname}: {msg}")


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("name", ["mlp-tiny", "gpt-tiny"])
def test_every_generator_and_microbatch_count_gives_eagers_gradients(name: str, stages: int) -> None:
    """Every generator (the asynchronous ones' orders too) at 1, ``stages`` and ``2 * stages + 1`` microbatches, W
    run as its own graph (not in place), gives eager's gradients of the mean loss. On the pipeline the test above
    compiled for this model and stage count; 3 stages: tests/schedules/test_generators.py."""
    mine, pipe, _, _, _, _, _ = _pipeline(name, stages)
    every_generator_gives_eagers_gradients(mine, pipe, models.build(name, dtype=torch.float64), stages)


def test_without_a_cpp_compiler_the_reference_runs_eagerly_with_one_warning(monkeypatch: pytest.MonkeyPatch,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(codegen, "cpp_compiler", lambda: None)
    zoo = models.build("mlp-tiny")
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2)
    with caplog.at_level(logging.WARNING, logger="fxpipe"):
        executor = ReferenceExecutor(pipe, zoo.loss_fn, codegen="inductor")
    said = [(r.name, r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith("fxpipe")]
    assert len(said) == 1 and said[0][:2] == ("fxpipe.runtime.reference", logging.WARNING)
    assert re.fullmatch(r"--codegen inductor needs a C\+\+ compiler .* so the stages run eagerly", said[0][2])
    assert executor.codegen == "eager"
    assert all(isinstance(g.forward, torch.fx.GraphModule) for g in executor.graphs)
