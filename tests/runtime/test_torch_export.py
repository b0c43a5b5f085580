"""An exported plan trains under torch.distributed.pipelining's ``_PipelineScheduleRuntime`` as under fxpipe's runtime
and as one process: gpt-tiny (1f1b and zb-h1, 2 and 4 stages, 4 and 8 microbatches) and a user's Hugging Face Llama
file compiled with ``fxpipe compile file.py:build``, 3 steps, every loss and every parameter's gradient equal (rtol
1e-5); and gpt-tiny's interleaved-1f1b (4 stages on 2 ranks). One launch per world size runs every case of that
size (tests/runtime/_torch_export_worker.py)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import fxpipe
from tests._helpers import assert_ranks_ok, fxpipe_cli, launch_ranks, ok, session_dir
from tests.runtime._torch_export_worker import reference

WORKER = Path(__file__).parent / "_torch_export_worker.py"
STEPS = 3

LLAMA_FILE = '''
import torch
import transformers


def build():
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                      num_key_value_heads=2, vocab_size=96, max_position_embeddings=32,
                                      use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double().train()
    return model, (torch.randint(0, 96, (2, 16)),)


def loss(out, target):
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())
'''

# (model, stages, schedule, microbatches); the world is the stage count (half of it for interleaved-1f1b)
GPT = [("gpt-tiny", s, sched, m) for s in (2, 4) for sched in ("1f1b", "zb-h1") for m in (4, 8)]
LLAMA = [("llama", 2, "zb-h1", 4), ("llama", 2, "1f1b", 8), ("llama", 4, "zb-h1", 4)]
INTERLEAVED = [("gpt-tiny", 4, "interleaved-1f1b", 4)]  # 2 stages per rank, the tied weight on both ranks
CASES = GPT + LLAMA + INTERLEAVED


def _world(case: tuple[str, int, str, int]) -> int:
    return case[1] // 2 if case[2] == "interleaved-1f1b" else case[1]


def _name(case: tuple[str, int, str, int]) -> str:
    return "-".join(map(str, case))


@functools.cache
def _llama_file() -> Path:
    pytest.importorskip("transformers")
    path = session_dir("llama") / "llama_user.py"
    path.write_text(LLAMA_FILE)
    return path


@functools.cache
def _compiled(model: str, stages: int) -> fxpipe.Pipeline:
    """gpt-tiny compiled in this process, or the Llama file compiled by ``fxpipe compile file.py:build``."""
    if model == "gpt-tiny":
        from tests.runtime._dist_worker import build

        net, inputs, _, _ = build("gpt-tiny", 1)
        return fxpipe.compile(net, inputs, stages=stages)
    out = session_dir("llama-plan") / "plan"
    ok(fxpipe_cli("compile", f"{_llama_file()}:build", "--stages", stages, "--out", out))
    return fxpipe.load(out)


@functools.cache
def _plan(case: tuple[str, int, str, int]) -> str:
    """The case's plan directory: its model's stages with the case's schedule recorded."""
    from fxpipe.api import set_schedule

    model, stages, sched, m = case
    pipe = _compiled(model, stages)
    set_schedule(pipe, sched, m)
    return str(fxpipe.save(pipe, session_dir("export") / "plan"))


def _cfg(case: tuple[str, int, str, int]) -> dict[str, Any]:
    return {"model": case[0], "plan": _plan(case), "microbatches": case[3], "steps": STEPS,
            **({"file": str(_llama_file())} if case[0] == "llama" else {})}


@functools.cache
def _launch(world: int) -> Path:
    """One launch of ``world`` ranks that runs every case of that many stages."""
    out = session_dir(f"torch-export{world}")
    cases = {_name(c): _cfg(c) for c in CASES if _world(c) == world}
    assert_ranks_ok(launch_ranks(out, world, {"cases": cases}, worker=WORKER))
    return out


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_exported_plan_trains_as_fxpipe_and_one_process(case: tuple[str, int, str, int]) -> None:
    if case[0] == "llama":
        pytest.importorskip("transformers")
    world = _world(case)
    out = _launch(world)
    losses, grads = reference(_cfg(case))
    saved = [torch.load(out / f"{_name(case)}-rank{r}.pt", weights_only=False) for r in range(world)]
    for runtime in ("torch", "fxpipe"):
        got_losses = [x for s in saved for x in s[runtime]["losses"][:STEPS]] if runtime == "torch" else \
            saved[0][runtime]["losses"]
        torch.testing.assert_close(got_losses, losses, rtol=1e-5, atol=0, msg=lambda msg: f"{runtime} losses: {msg}")
        for step in range(STEPS):
            seen: set[str] = set()
            for s in saved:
                for name, g in s[runtime]["grads"][step].items():
                    torch.testing.assert_close(g, grads[step][name], rtol=1e-5, atol=1e-12,
                                               msg=lambda msg: f"{runtime} step {step} {name}: {msg}")
                    seen.add(name)
            # every parameter has its gradient on some rank (a tied weight under either of its names)
            ids = {id(p) for p in dict(_model_params(case)).values()}
            assert {id(_model_params(case)[n]) for n in seen} == ids, (runtime, step)


@functools.cache
def _model_params(case: tuple[str, int, str, int]) -> dict[str, torch.nn.Parameter]:
    from tests.runtime._torch_export_worker import data

    return dict(data(_cfg(case))[0].named_parameters(remove_duplicate=False))
