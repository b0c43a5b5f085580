"""A model nobody in the project wrote trains through the command line: a user file building a Hugging Face GPT-2
from a config, ``fxpipe compile file.py:build``, then ``fxpipe run --data text:PATH --loss file.py:loss`` with AdamW,
a cosine schedule after 2 warm-up steps, the global gradient norm clipped to 1 and a log directory, on 2 stages and
on 2 stages x 2 replicas: its losses, learning rates and gradient norms equal one process on the same batches
(rtol 1e-5), and metrics.jsonl has them, one line per step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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

STEPS, MICROBATCHES, ROWS, SEQ = 4, 4, 2, 32
FLAGS = ("--optimizer", "adamw", "--lr", 0.01, "--weight-decay", 0.1, "--lr-schedule", "cosine", "--warmup-steps", 2,
         "--clip-grad-norm", 1.0)


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


def reference_hf(hf: dict[str, Path], dp: int, bf16: bool = False) -> tuple[list[float], list[float], list[float]]:
    """One process, eager: the user's model built as compile built it, the same text batches (the global batch of
    dp x microbatches x rows), the mean loss over every microbatch, torch's AdamW, a LambdaLR of warm-up then cosine
    (written out here, not fxpipe's), torch's clip_grad_norm_; the losses, learning rates and gradient norms. With
    ``bf16`` each microbatch's forward and loss run under CPU autocast (bf16), its backward outside, as in eager
    mixed-precision training: fp32 weights, optimizer state and gradients."""
    import importlib.util
    import math

    from fxpipe.targets import resolve

    model = resolve(f"{hf['file']}:build").model
    spec = importlib.util.spec_from_file_location("gpt2_user_reference", hf["file"])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = data.parse_data(f"text:{hf['corpus']}")
    assert isinstance(text, data.Text)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.999), weight_decay=0.1)
    warmup = 2
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: k / warmup if k < warmup else
                                              0.5 * (1 + math.cos(math.pi * (k - warmup) / (STEPS - warmup))))
    n = MICROBATCHES * dp
    losses, lrs, norms = [], [], []
    for k in range(STEPS):
        idx, target = text.batch(k, ROWS * n, SEQ, seed=0)
        parts = []
        for i, t in zip(idx.tensor_split(n), target.tensor_split(n)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                parts.append(module.loss(model(i), t))
        loss = sum(parts) / n
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, lrs, norms


# bf16: the pipeline runs the same bf16 operations as one process under autocast (each stage's graphs traced under
# it); only fp32 sums in another order differ (~2^-24 relative per term), which can move a later bf16 rounding by at
# most one bf16 unit in the last place, 2^-8 relative. So rtol 2^-8 (fp32: 1e-5).
@pytest.mark.parametrize(("dp", "precision"), [(1, "fp32"), (2, "fp32"), (1, "bf16")])
def test_a_hugging_face_gpt2_from_a_user_file_trains_as_one_process(hf: dict[str, Path], dp: int, precision: str,
                                                                     tmp_path: Path) -> None:
    doc = run_hf(hf, dp, *FLAGS, "--precision", precision, "--log-dir", tmp_path / "log")
    assert (doc["ranks"], doc["dp"], doc["batch"]) == (2 * dp, dp, ROWS * MICROBATCHES * dp)
    losses, lrs, norms = reference_hf(hf, dp, bf16=precision == "bf16")
    rtol = 2**-8 if precision == "bf16" else 1e-5
    torch.testing.assert_close(doc["losses"], losses, rtol=rtol, atol=0)
    torch.testing.assert_close(doc["lrs"], lrs, rtol=1e-5, atol=0)
    torch.testing.assert_close(doc["grad_norms"], norms, rtol=rtol, atol=0)
    assert max(norms) > 1.0  # the clip did something: some step's norm was over 1
    if precision == "bf16":  # and it ran in bf16: well nearer the bf16 reference than the fp32 one (which the 2^-8
        fp32 = reference_hf(hf, dp)[2]  # bound, a worst case, would also admit: they differ by ~3e-4 here)

        def off(got: list[float], want: list[float]) -> float:
            return max(abs(g / w - 1) for g, w in zip(got, want))

        assert off(doc["grad_norms"], norms) < off(doc["grad_norms"], fp32) / 3, (doc["grad_norms"], norms, fp32)
    assert doc["held_out"]["held-out loss"] > 0  # the text's held-out split, scored with every stage's weights
    lines = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    torch.testing.assert_close([m["loss"] for m in lines], losses, rtol=rtol, atol=0)
    torch.testing.assert_close([m["grad_norm"] for m in lines], norms, rtol=rtol, atol=0)
    torch.testing.assert_close([m["lr"] for m in lines], lrs, rtol=1e-5, atol=0)
    assert all(m["tokens_per_s"] > 0 and len(m["peak_memory_mib"]) == 2 * dp for m in lines), lines[0]


def test_a_user_models_synthetic_data_is_shaped_from_the_plan(hf: dict[str, Path]) -> None:
    """Without --data, a user model's batch is drawn from what the launcher found on the meta device: token ids
    below the embedding's 256 rows, and the first target its loss takes (class ids below the logits' 256)."""
    from fxpipe.cli.feed import RunShape, check_feed, synthetic_batches
    from fxpipe.plan_dir import read_plan

    plan = read_plan(hf["plan"])
    feed = check_feed(hf["plan"], plan, None, "synthetic", f"{hf['file']}:loss", RunShape(MICROBATCHES, 1, 0, STEPS))
    assert feed.synthetic is not None
    assert json.loads(feed.synthetic) == {"bounds": {"0": 256}, "target": [[ROWS, SEQ], "int64", 256]}
    (idx,), target = synthetic_batches(plan, MICROBATCHES, feed.synthetic)
    for ids in (idx, target):  # token ids over the whole vocabulary (the embedding's rows, the logits' width)
        assert ids.shape == (ROWS * MICROBATCHES, SEQ) and ids.dtype == torch.int64
        assert 0 <= int(ids.min()) and 200 < int(ids.max()) < 256
