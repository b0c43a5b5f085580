"""A Hugging Face transformers GPT-2 (built from a small config, no download) compiles and composes back."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_composes

transformers = pytest.importorskip("transformers")


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=96, n_positions=32, use_cache=False,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).train()


def _loss(out: object, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits  # type: ignore[attr-defined]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_hf_gpt2_composes(stages: int) -> None:
    torch.manual_seed(0)
    idx = torch.randint(0, 96, (2, 16))
    target = torch.randint(0, 96, (2, 16))
    pipe = assert_composes(_gpt2(), (idx,), _loss, target, stages)
    names = pipe.report()[2].column("name")
    assert [n for n in names if n.startswith("transformer.h.")] == ["transformer.h.0", "transformer.h.1",
                                                                   "transformer.h.2"]
    assert type(pipe(idx)).__name__ == "CausalLMOutputWithCrossAttentions"
