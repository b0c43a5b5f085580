"""Hugging Face causal LMs nobody here wrote, from a user's file through the command line, under two transformers
releases: Llama-, Qwen2-, GPT-NeoX- and Mixtral-style files (4 layers, hidden 64, the configs' defaults, so
``use_cache=True``) compile with ``fxpipe compile file.py:build`` into 2 stages and train with ``fxpipe run`` to the
losses of one eager process on the same batches (fp32, rtol 1e-5); the Llama file's run resumes from its checkpoint
to the same losses.

The releases differ where it matters: transformers 5.23 (``constraints.txt``'s pin) wraps the rotary embedding in a
no-grad region (``wrap_with_set_grad_enabled`` in the exported graph), 5.25 does not; Mixtral's experts call
transformers' own ``torch.library`` operator ``grouped_mm_fallback``. The installed release runs in this process; the
other is installed once (``pip install --target``, no dependencies: the rest of the stack is the same) and runs this
module again in a child process with it first on the path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxpipe import data
from tests._helpers import fxpipe_cli, import_file, ok, one_line_error

transformers = pytest.importorskip("transformers")

OTHER_RELEASE = "5.25.0"  # the newer release beside constraints.txt's pin: its exported graphs have no no-grad wrap
EXPECT = os.environ.get("FXPIPE_TEST_TRANSFORMERS")  # set by the child run: the release it must be running

CONFIGS = {
    "llama": "transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, "
             "intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256, "
             "max_position_embeddings=64))",
    "qwen2": "transformers.Qwen2ForCausalLM(transformers.Qwen2Config(num_hidden_layers=4, hidden_size=64, "
             "intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256, "
             "max_position_embeddings=64))",
    "neox": "transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(num_hidden_layers=4, hidden_size=64, "
            "intermediate_size=128, num_attention_heads=4, vocab_size=256, max_position_embeddings=64, "
            "hidden_dropout=0.0, attention_dropout=0.0))",
    "mixtral": "transformers.MixtralForCausalLM(transformers.MixtralConfig(num_hidden_layers=4, hidden_size=64, "
               "intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256, "
               "max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2))",
}
USER_FILE = '''
import torch
import transformers


def build():
    model = {model}.train()
    return model, (torch.randint(0, 256, (2, 32)),)


def loss(out, target):
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())
'''
STEPS, MICROBATCHES, ROWS, SEQ, LR = 2, 2, 2, 32, 0.01


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf-archs") / "corpus.txt"
    path.write_text(" ".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * i}." for i in range(200)))
    return path


def reference(user: Path, corpus: Path, steps: int = STEPS) -> list[float]:
    """One eager process: the model the builder makes (compile's seed), the same text batches, the mean loss over
    the microbatches, torch's SGD."""
    from fxpipe.targets import resolve

    model = resolve(f"{user}:build").model
    module = import_file(user, f"reference_{user.stem}")
    text = data.parse_data(f"text:{corpus}")
    assert isinstance(text, data.Text)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for k in range(steps):
        idx, target = text.batch(k, ROWS * MICROBATCHES, SEQ, seed=0)
        loss = sum(module.loss(model(i), t) for i, t in zip(idx.tensor_split(MICROBATCHES),
                                                            target.tensor_split(MICROBATCHES))) / MICROBATCHES
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_a_causal_lm_file_compiles_and_trains_as_one_process(arch: str, corpus: Path, tmp_path: Path) -> None:
    if EXPECT is not None:
        assert transformers.__version__ == EXPECT  # the child run really has the other release
    user = tmp_path / f"{arch}_user.py"
    user.write_text(USER_FILE.format(model=CONFIGS[arch]))
    compiled = ok(fxpipe_cli("compile", f"{user}:build", "--stages", "2", "--microbatches", MICROBATCHES,
                             "--out", tmp_path / "plan", "--json"))
    notes = [n for r in json.loads(compiled.stdout)["reports"] if r["title"] == "trace" for n in r["notes"]]
    assert any("use_cache off" in n for n in notes), notes  # the configs' default: traced without the cache
    if arch == "mixtral":  # transformers' own operator, recorded with the module that defines it
        stage_docs = [json.loads(p.read_text()) for p in sorted((tmp_path / "plan").glob("stage_*.json"))
                      if not p.name.endswith(".fbw.json")]
        assert any(d.get("libraries", {}).get("transformers.grouped_mm_fallback.default")
                   == "transformers.integrations.moe" for d in stage_docs)
    run = ["run", tmp_path / "plan", "--nproc", "2", "--data", f"text:{corpus}", "--loss", f"{user}:loss", "--json",
           "--checkpoint-dir", tmp_path / "ckpt"]
    doc = json.loads(ok(fxpipe_cli(*run, "--steps", STEPS)).stdout)
    want = reference(user, corpus, STEPS + 1)
    torch.testing.assert_close(doc["losses"], want[:STEPS], rtol=1e-5, atol=0)
    if arch == "llama":  # the whole path: a resumed run trains on from the checkpoint as an unbroken one would
        on = json.loads(ok(fxpipe_cli(*run, "--steps", STEPS + 1, "--resume", "always")).stdout)
        assert on["first_step"] == STEPS
        torch.testing.assert_close(on["losses"], want[STEPS:], rtol=1e-5, atol=0)


OWN_OP_FILE = '''
import torch


@torch.library.custom_op("fxpipe_demo::halve", mutates_args=())
def halve(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5


@halve.register_fake
def _(x):
    return torch.empty_like(x)


def build():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))

    class Halved(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = model

        def forward(self, x):
            return self.body(torch.ops.fxpipe_demo.halve(x))

    return Halved(), (torch.randn(4, 8),)


def loss(out, target):
    return torch.nn.functional.cross_entropy(out, target)
'''


def test_an_operator_of_an_untrusted_library_is_refused_in_one_line(tmp_path: Path) -> None:
    """A plan may call a library's own operator only when the load trusts that library: transformers' (Mixtral's
    experts) by default, another only by name, and then only from a module of that library. A user file's own
    operator is recorded in the plan; fxpipe run refuses it in one line naming the operator and the flag, and with
    the flag still refuses to import the user's file from the plan's word (it is not the library's)."""
    import fxpipe
    from fxpipe.errors import PlanFileError

    user = tmp_path / "own_op.py"
    user.write_text(OWN_OP_FILE)
    ok(fxpipe_cli("compile", f"{user}:build", "--stages", "2", "--out", tmp_path / "plan"))
    stage_docs = [json.loads(p.read_text()) for p in sorted((tmp_path / "plan").glob("stage_*.json"))
                      if not p.name.endswith(".fbw.json")]
    assert stage_docs[0]["libraries"] == {"fxpipe_demo.halve.default": "fxpipe_user_own_op"}
    line = one_line_error(fxpipe_cli("run", tmp_path / "plan", "--loss", f"{user}:loss", "--steps", 1))
    assert line.endswith("calls 'fxpipe_demo.halve.default', an operator the 'fxpipe_demo' library registers, which "
                         "this load does not trust; if you trust the plan's source, pass --trust-ops fxpipe_demo to "
                         "fxpipe run (fxpipe.load(..., trust_ops=['fxpipe_demo'])); re-run fxpipe compile"), line
    with pytest.raises(PlanFileError, match="does not trust"):
        fxpipe.load(tmp_path / "plan")
    module = sys.modules.pop("fxpipe_user_own_op")  # as in a new process: the user's file is not imported
    try:
        with pytest.raises(PlanFileError, match=r"says 'fxpipe_demo.halve.default' is defined by "
                                                r"'fxpipe_user_own_op', outside the 'fxpipe_demo' library"):
            fxpipe.load(tmp_path / "plan", trust_ops=["fxpipe_demo"])
    finally:
        sys.modules["fxpipe_user_own_op"] = module
    pipe = fxpipe.load(tmp_path / "plan", trust_ops=["fxpipe_demo"])  # its module imported: the op is registered
    from fxpipe.targets import resolve

    x = torch.randn(4, 8)
    torch.testing.assert_close(pipe(x), resolve(f"{user}:build").model(x))  # the plan computes the user's model


@pytest.mark.slow
@pytest.mark.skipif(EXPECT is not None, reason="the child run itself")
def test_the_other_transformers_release(tmp_path_factory: pytest.TempPathFactory) -> None:
    """This module's training test again, under transformers 5.25 (installed for it) in a child process."""
    if transformers.__version__ == OTHER_RELEASE:
        pytest.skip(f"transformers {OTHER_RELEASE} is the installed release: the tests above ran under it")
    target = tmp_path_factory.mktemp("transformers") / OTHER_RELEASE
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                          f"transformers=={OTHER_RELEASE}"], capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]),
           "FXPIPE_TEST_TRANSFORMERS": OTHER_RELEASE}
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", __file__,
                            "-k", "compiles_and_trains"], capture_output=True, text=True, env=env, timeout=900,
                           cwd=Path(__file__).resolve().parents[2])
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    assert f"{len(CONFIGS)} passed" in child.stdout, child.stdout[-2000:]
