"""A model nobody in the project wrote trains through the command line: a user file building a Hugging Face GPT-2
from a config, ``fxpipe compile file.py:build``, then ``fxpipe run --data text:PATH --loss file.py:loss`` on 2
stages and on 2 stages x 2 replicas; its losses equal one process on the same batches (rtol 1e-5)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from fxpipe import data
from tests._helpers import fxpipe_cli, ok

pytest.importorskip("transformers")

USER_FILE = '''
import torch
import transformers


def build():
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32, use_cache=False,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).train()
    return model, (torch.randint(0, 256, (2, 32)),)


def loss(out, target):
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())
'''

STEPS, MICROBATCHES, ROWS, SEQ = 3, 4, 2, 32


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    (root / "gpt2_user.py").write_text(USER_FILE)
    (root / "corpus.txt").write_text(" ".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * i}."
                                              for i in range(200)))
    ok(fxpipe_cli("compile", f"{root / 'gpt2_user.py'}:build", "--stages", "2", "--microbatches", MICROBATCHES,
                  "--out", root / "plan"))
    return {"file": root / "gpt2_user.py", "corpus": root / "corpus.txt", "plan": root / "plan"}


def run_hf(hf: dict[str, Path], dp: int, *extra: Any) -> dict[str, Any]:
    """``fxpipe run`` of the GPT-2 plan on 2 stages x ``dp`` replicas with the user's loss and a text file."""
    args = ["run", hf["plan"], "--steps", STEPS, "--data", f"text:{hf['corpus']}", "--loss", f"{hf['file']}:loss",
            "--json", *extra]
    if dp > 1:
        args += ["--dp", dp]
    return json.loads(ok(fxpipe_cli(*args)).stdout)


def reference_hf(hf: dict[str, Path], dp: int,
                 optimizer: Callable[[Any], torch.optim.Optimizer] = lambda ps: torch.optim.SGD(ps, lr=0.01),
                 ) -> list[float]:
    """One process, eager: the user's model built as compile built it, the same text batches (the global batch of
    dp x microbatches x rows), the mean loss over every microbatch, one optimizer step per batch."""
    import importlib.util

    from fxpipe.targets import resolve

    model = resolve(f"{hf['file']}:build").model
    spec = importlib.util.spec_from_file_location("gpt2_user_reference", hf["file"])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = data.parse_data(f"text:{hf['corpus']}")
    assert isinstance(text, data.Text)
    opt = optimizer(list(model.parameters()))
    n = MICROBATCHES * dp
    losses = []
    for k in range(STEPS):
        idx, target = text.batch(k, ROWS * n, SEQ, seed=0)
        loss = sum(module.loss(model(i), t) for i, t in zip(idx.tensor_split(n), target.tensor_split(n))) / n
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("dp", [1, 2])
def test_a_hugging_face_gpt2_from_a_user_file_trains_as_one_process(hf: dict[str, Path], dp: int) -> None:
    doc = run_hf(hf, dp)
    assert (doc["ranks"], doc["dp"], doc["batch"]) == (2 * dp, dp, ROWS * MICROBATCHES * dp)
    torch.testing.assert_close(doc["losses"], reference_hf(hf, dp), rtol=1e-5, atol=0)
    assert doc["held_out"]["held-out loss"] > 0  # the text's held-out split, scored with every stage's weights


def test_a_user_models_synthetic_data_is_shaped_from_the_plan(hf: dict[str, Path]) -> None:
    """Without --data, a user model's batch is drawn from what the launcher found on the meta device: token ids
    below the embedding's 256 rows, and the first target its loss takes (class ids below the logits' 256)."""
    from fxpipe.cli.feed import check_feed, synthetic_batches
    from fxpipe.plan_dir import read_plan

    plan = read_plan(hf["plan"])
    feed = check_feed(hf["plan"], plan, None, "synthetic", f"{hf['file']}:loss", MICROBATCHES, 1, 0, STEPS)
    assert feed.rank_args[0] == "--synthetic"
    assert json.loads(feed.rank_args[1]) == {"bounds": {"0": 256}, "target": [[ROWS, SEQ], "int64", 256]}
    (idx,), target = synthetic_batches(plan, MICROBATCHES, feed.rank_args[1])
    for ids in (idx, target):  # token ids over the whole vocabulary (the embedding's rows, the logits' width)
        assert ids.shape == (ROWS * MICROBATCHES, SEQ) and ids.dtype == torch.int64
        assert 0 <= int(ids.min()) and 200 < int(ids.max()) < 256
