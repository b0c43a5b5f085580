"""``examples/``: train_pipeline_dp.py, run as docs/distributed.md says (torchrun, 4 ranks, a zoo plan in 2 stages:
2 x 2), trains like one process on the whole batch, and its checkpoint resumes onto 2 ranks (dp 1); its batches
fit any plan whose inputs it can draw (token ids within their embedding) and it refuses the others in one line;
the Slurm script parses and starts that script."""

from __future__ import annotations

import copy
import importlib.util
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

import fxpipe
from fxpipe import models
from tests._helpers import forked_ranks

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_pipeline_dp.py"
SLURM = ROOT / "examples" / "slurm_pipeline_dp.sh"


def _example_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("train_pipeline_dp", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Two of three clean-clone CI runs on 2026-11-23 saw one rank of this example abort in gloo/c10d's C++ at its end
# ("terminate called without an active exception", SIGABRT), after its last step; d1d64a2 frees the runtime before
# the process group, and it has not been seen since (22 runs in a row here on 2026-11-27, 10 of them beside two busy
# loops on the 2 cores). The test is strict again: the one thing it lets pass is that abort at teardown, and only once
# rank 0 has printed the run's last line, so every loss (and the checkpoint the resumed run reads) is still checked.
TEARDOWN_ABORT = "terminate called without an active exception"


def _torchrun(nproc: int, *args: str | Path) -> list[float]:
    """The example on ``nproc`` ranks started as torchrun starts them (forked, without torchrun's agent: the docs'
    own torchrun command runs in tests/test_docs.py); rank 0's losses."""
    ranks = forked_ranks(nproc, [str(EXAMPLE), *map(str, args)])
    stdout, stderr = "".join(r.stdout for r in ranks), "".join(r.stderr for r in ranks)
    returncode = next((r.returncode for r in ranks if r.returncode != 0), 0)
    finished = re.search(rf"on {nproc} ranks: pp 2 x dp {nproc // 2}, global batch 64 rows", stdout)
    if returncode != 0 and finished and TEARDOWN_ABORT in stderr:
        warnings.warn(f"a rank aborted in gloo/c10d at its end, after training ({TEARDOWN_ABORT!r})", stacklevel=2)
    else:
        assert returncode == 0, stderr[-3000:]
    assert finished, stdout
    return [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", stdout, re.M)]


def test_the_example_trains_2x2_like_one_process_and_resumes_onto_dp_1(tmp_path: Path) -> None:
    zoo = models.build("mlp-small")
    plan = fxpipe.save(fxpipe.compile(zoo.model, zoo.example_inputs, stages=2), tmp_path / "plan")
    ckpt = tmp_path / "ckpt"
    # 4 ranks: 2 stages x 2 replicas, 4 microbatches each: a global batch of 2 x 4 x 8 rows.
    first = _torchrun(4, plan, "--steps", "3", "--checkpoint-dir", ckpt)
    # The checkpoint (written once per stage) resumes onto 2 ranks, dp 1, with the same global batch.
    resumed = _torchrun(2, plan, "--steps", "4", "--microbatches", "8", "--checkpoint-dir", ckpt)

    example = _example_module()
    batch = example.teacher_batches([(8, 64)], [torch.float32], {}, 10, 64, 0)
    ref = copy.deepcopy(zoo.model)
    opt = torch.optim.Adam(ref.parameters(), lr=3e-3)
    expected = []
    for k in range(4):
        (x,), y = batch(k)
        loss = torch.nn.functional.cross_entropy(ref(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        expected.append(loss.item())
    assert first == pytest.approx(expected[:3], rel=1e-5)
    assert resumed == pytest.approx(expected[3:], rel=1e-5)
    assert len(set(expected)) == 4  # the weights moved


def test_the_example_draws_token_ids_within_the_vocabulary_and_labels_every_position(tmp_path: Path) -> None:
    """A gpt plan (integer token inputs): the batches are token ids in [0, vocab) with one label per position,
    shaped like the plan's inputs, and one process trains on them with the example's loss (docs/distributed.md
    runs the same plan on 4 ranks)."""
    zoo = models.build("gpt-tiny")
    pipe = fxpipe.load(fxpipe.save(fxpipe.compile(zoo.model, zoo.example_inputs, stages=2), tmp_path / "plan"))
    vocab = zoo.model.wte.num_embeddings
    (tokens,), target = _example_module().plan_batches(pipe, 8, 0)(0)
    assert tokens.dtype == torch.int64 and tokens.shape == (8, *zoo.example_inputs[0].shape[1:])
    assert int(tokens.min()) >= 0 and int(tokens.max()) < vocab and int(tokens.max()) > vocab // 2
    assert target.shape == tokens.shape and int(target.max()) < vocab
    rows = zoo.example_inputs[0].shape[0]  # the stages take one compiled microbatch at a time
    loss = torch.nn.functional.cross_entropy(pipe(tokens[:rows]).flatten(0, -2), target[:rows].flatten())
    assert torch.isfinite(loss)


class _TwoOutputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * ids.unsqueeze(-1).float())


def test_the_example_refuses_in_one_line_a_plan_whose_inputs_it_cannot_draw(tmp_path: Path) -> None:
    """An integer input that no embedding indexes has no known range: one line, no traceback."""
    model = _TwoOutputs()
    pipe = fxpipe.compile(model, (torch.randn(2, 4), torch.ones(2, dtype=torch.int64)), stages=2)
    with pytest.raises(SystemExit) as stop:
        _example_module().plan_batches(pipe, 8, 0)
    message = str(stop.value)
    assert "\n" not in message and "['ids']" in message and "embedding" in message


def test_the_slurm_script_parses_and_starts_the_example() -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    assert subprocess.run([bash, "-n", str(SLURM)], capture_output=True).returncode == 0
    text = SLURM.read_text()
    assert "examples/train_pipeline_dp.py" in text and "--rdzv-backend c10d" in text
    page = (ROOT / "docs" / "distributed.md").read_text()
    assert "examples/slurm_pipeline_dp.sh" in page and "examples/train_pipeline_dp.py" in page


STRATEGY = ROOT / "examples" / "train_strategy.py"


def test_the_strategy_example_trains_two_searched_stages_on_four_ranks() -> None:
    """examples/train_strategy.py as documented (its env:// rendezvous, started here without torchrun's agent):
    VGG-tiny in 2 stages of 2 ranks, each stage's strategy searched; both tables print and the loss falls."""
    # (the 4 ranks forked from the preloaded forkserver, each with the environment torchrun would give it)
    ranks = forked_ranks(4, [str(STRATEGY), "--model", "vgg-tiny", "--stages", "2", "--cut", "flatten", "--steps", "6",
                             "--lr", "0.05"], cwd=ROOT)
    for r in ranks:
        assert r.returncode == 0, r.stderr[-3000:]
    stdout = ranks[0].stdout
    assert stdout.count("strategy (elimination)") == 2, stdout  # one table per stage
    assert re.search(r"^classifier_0\s+\S+", stdout, re.M)
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", stdout, re.M)]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
