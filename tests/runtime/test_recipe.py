"""The README's torchrun recipe, copied as it stands into a script that imports only torch and fxpipe, trains a
saved plan of a Hugging Face model on 2 ranks exactly like one process trains the model."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fxpipe
from tests._helpers import HANG_S

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def _recipe() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- recipe:[^\n]*-->\n```python\n(.*?)```", text, re.S)
    assert match, "README.md lost its torchrun recipe"
    return match.group(1)


def _gpt2() -> torch.nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32, use_cache=False, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _llama() -> torch.nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=96, max_position_embeddings=32, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0))


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_readme_recipe_trains_a_hugging_face_plan_like_one_process(make, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = make().double().train()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 96, (8, 16), generator=gen), torch.randint(0, 96, (8, 16), generator=gen))
               for _ in range(STEPS)]
    eager = copy.deepcopy(model)
    plan = fxpipe.save(fxpipe.compile(model, (batches[0][0][:2],), stages=2), tmp_path / "plan")  # one microbatch
    torch.save(batches, tmp_path / "batches.pt")
    namespace: dict[str, object] = {}
    exec(compile(_recipe().split("# A plan directory")[0], "README recipe", "exec"), namespace)  # its loss_fn
    loss_fn = namespace["loss_fn"]

    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    expected = []
    for inputs, target in batches:
        opt.zero_grad()
        loss = loss_fn(eager(inputs), target)  # type: ignore[operator]
        loss.backward()
        opt.step()
        expected.append(loss.item())

    script = tmp_path / "train.py"
    script.write_text(_recipe() + '\nassert "transformers" not in sys.modules, "the recipe imported the model library"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(plan), str(tmp_path / "batches.pt")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^loss (\S+)$", proc.stdout, re.M)]
    assert len(losses) == STEPS, proc.stdout
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-7, atol=1e-8)
    assert len(set(expected)) == STEPS  # the weights moved between steps
