"""Hugging Face transformers GPT-2 and Llama (built from small configs, no download) compile, compose back and
round-trip through a plan directory."""

from __future__ import annotations

import pytest
import torch

import fxpipe
from tests._helpers import assert_composes, hf_gpt2 as _gpt2, hf_loss as _loss

transformers = pytest.importorskip("transformers")


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


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                      num_key_value_heads=2, vocab_size=96, max_position_embeddings=32,
                                      use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def test_hf_llama_with_a_nested_graph_composes_and_round_trips(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Llama's rotary embedding runs under no_grad: transformers 5.23's export wraps it in a higher-order op over a
    nested graph (5.25's does not), which trace inlines with its outputs detached; the stages hold plain operators,
    compose to eager's outputs and gradients, and round-trip (assert_composes round-trips every plan)."""
    idx = torch.randint(0, 96, (2, 16))
    target = torch.randint(0, 96, (2, 16))
    pipe = assert_composes(_llama(), (idx,), _loss, target, 2)
    def hops(p: fxpipe.Pipeline) -> list[str]:
        return [str(n.target) for st in p.stages for n in st.module.graph.nodes
                if n.op == "call_function" and type(n.target).__name__ == "WrapWithSetGradEnabled"]

    assert hops(pipe) == []
    assert hops(fxpipe.load(fxpipe.save(pipe, tmp_path / "plan"))) == []


def test_a_hf_plan_loads_without_transformers_as_a_record(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests._helpers import run_forked

    idx = torch.randint(0, 96, (2, 16))
    model = _gpt2()
    plan = fxpipe.save(fxpipe.compile(model, (idx,), stages=2), tmp_path / "plan")
    torch.save({"idx": idx, "logits": model(idx).logits.detach()}, tmp_path / "io.pt")
    script = f"""
import logging, sys, warnings
import torch, fxpipe
notes = []
handler = logging.Handler()
handler.emit = lambda record: notes.append(record.getMessage())
logging.getLogger("fxpipe").addHandler(handler)
logging.getLogger("fxpipe").setLevel(logging.INFO)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    pipe = fxpipe.load({str(plan)!r})
io = torch.load({str(tmp_path / "io.pt")!r})
out = pipe(io["idx"])
assert type(out).__name__ == "Record" and list(out) == ["logits"], out
torch.testing.assert_close(out.logits, io["logits"])
torch.testing.assert_close(out["logits"], io["logits"])
torch.testing.assert_close(out[0], io["logits"])  # by position, as a ModelOutput reads
assert out.to_tuple() == (out.logits,)
try:
    out.loss
except AttributeError as e:
    print("missing:", e)
assert "transformers" not in sys.modules
print("warnings:", [str(w.message) for w in caught])
print("notes:", notes)
"""
    proc = run_forked(["-c", script])  # a process of its own, forked from one that never imported transformers
    assert proc.returncode == 0, proc.stderr[-2000:]
    # a loss that reads the output's keys, attributes or positions works: the load is a note on fxpipe's logger,
    # not a UserWarning on every rank
    assert "warnings: []" in proc.stdout
    assert "CausalLMOutputWithCrossAttentions; loaded as fxpipe.Record" in proc.stdout
    assert "Import transformers before loading" in proc.stdout
    # what a Record cannot give names the way back
    assert "missing: this output has no 'loss'; it has logits. It is an fxpipe.Record" in proc.stdout
    assert "import its library (e.g. transformers) before fxpipe.load" in proc.stdout
