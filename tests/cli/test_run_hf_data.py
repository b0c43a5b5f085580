"""A Hugging Face dataset and tokenizer through ``fxpipe run``, offline: a parquet corpus written here, a byte-level
BPE tokenizer trained here with ``tokenizers``, a user's Llama-style file, ``--data hf:DIR --tokenizer TOK`` on
2 stages x 2 replicas. The losses equal one eager process on the same packed token stream (fp32, rtol 1e-5); bad
input is one line before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fxpipe import data
from tests._helpers import fxpipe_cli, import_file, ok, one_line_error

datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

USER_FILE = '''
import torch
import transformers


def build():
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=320, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).train(), (torch.randint(0, 320, (2, 16)),)


def loss(out, target):
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())
'''
STEPS, MICROBATCHES, ROWS, SEQ, DP = 3, 2, 2, 16, 2
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jovial bankers".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-data")
    docs = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(5 + i % 9)) + f" {i}." for i in range(400)]
    (root / "corpus").mkdir()
    datasets.Dataset.from_dict({"body": docs, "id": list(range(len(docs)))}).to_parquet(
        str(root / "corpus" / "part-0.parquet"))
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    tok.save(str(root / "tokenizer.json"))
    (root / "llama_user.py").write_text(USER_FILE)
    ok(fxpipe_cli("compile", f"{root / 'llama_user.py'}:build", "--stages", "2", "--microbatches", MICROBATCHES,
                  "--out", root / "plan"))
    return {"root": root, "corpus": root / "corpus", "tok": root / "tokenizer.json", "file": root / "llama_user.py",
            "plan": root / "plan"}


def test_the_packed_stream_is_the_documents_tokens_with_end_of_text_between(corpus: dict[str, Path]) -> None:
    text = data.load_hf(str(corpus["corpus"]), tokenizer=corpus["tok"], column="body")
    tok = tokenizers.Tokenizer.from_file(str(corpus["tok"]))
    eos = tok.token_to_id("<|endoftext|>")
    docs = datasets.load_dataset("parquet", data_files=[str(corpus["corpus"] / "part-0.parquet")], split="train")
    want = [i for doc in docs["body"] for i in (*tok.encode(doc).ids, eos)]
    assert torch.cat([text.train, text.heldout]).tolist() == want
    assert len(text.heldout) == len(want) // 10 and text.vocab_size == tok.get_vocab_size() <= 320
    idx, target = text.batch(0, 4, SEQ)
    assert torch.equal(idx[:, 1:], target[:, :-1])  # labels: the next tokens


def _one_process(corpus: dict[str, Path]) -> tuple[torch.nn.Module, Any, data.Text]:
    """What a one-process reference trains: the builder's model (compile's seed), the user's file as a module (its
    loss), and the same packed token stream."""
    from fxpipe.targets import resolve

    return (resolve(f"{corpus['file']}:build").model, import_file(corpus["file"], "hf_data_reference"),
            data.load_hf(str(corpus["corpus"]), tokenizer=corpus["tok"], column="body"))


def _step(model: torch.nn.Module, module: Any, opt: torch.optim.Optimizer, text: data.Text, k: int) -> float:
    """One eager step on step k's global batch, the loss the mean over its DP x MICROBATCHES microbatches."""
    n = MICROBATCHES * DP
    idx, target = text.batch(k, ROWS * n, SEQ, seed=0)
    loss = sum(module.loss(model(i), t) for i, t in zip(idx.tensor_split(n), target.tensor_split(n))) / n
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def reference(corpus: dict[str, Path]) -> tuple[list[float], list[float]]:
    """One eager process: the builder's model, the global batch of each step from the same stream (DP x
    MICROBATCHES x ROWS rows), the mean loss over every microbatch, torch's SGD; and after every second step, the
    mean loss over the held-out split's whole batches (each cut into the same microbatches), without gradients."""
    model, module, text = _one_process(corpus)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    n, losses, evaluated = MICROBATCHES * DP, [], []
    held = data.held_out_batches(text, ROWS * n, seq_len=SEQ)
    for k in range(STEPS):
        losses.append(_step(model, module, opt, text, k))
        if (k + 1) % 2 == 0:
            with torch.no_grad():
                evaluated.append(sum(float(module.loss(model(i), t)) for idx, target in held
                                     for i, t in zip(idx.tensor_split(n), target.tensor_split(n))) / (len(held) * n))
    return losses, evaluated


def test_a_dataset_and_tokenizer_train_a_causal_lm_as_one_process(corpus: dict[str, Path], tmp_path: Path) -> None:
    """Trains as one process (each rank's batches read ahead by a DataLoader worker), and --eval-every 2 scores the
    held-out split as one process does (metrics.jsonl's eval_loss on step 2 only)."""
    doc = json.loads(ok(fxpipe_cli("run", corpus["plan"], "--dp", DP, "--steps", STEPS, "--data",
                                   f"hf:{corpus['corpus']}", "--data-column", "body", "--tokenizer", corpus["tok"],
                                   "--loss", f"{corpus['file']}:loss", "--eval-every", 2, "--log-dir", tmp_path / "log",
                                   "--data-workers", 1, "--json")).stdout)
    assert (doc["ranks"], doc["batch"]) == (2 * DP, ROWS * MICROBATCHES * DP)
    losses, evaluated = reference(corpus)
    torch.testing.assert_close(doc["losses"], losses, rtol=1e-5, atol=0)
    assert [step for step, _ in doc["eval_losses"]] == [2] and len(evaluated) == 1
    torch.testing.assert_close([loss for _, loss in doc["eval_losses"]], evaluated, rtol=1e-5, atol=0)
    lines = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [m.get("eval_loss") for m in lines] == [None, doc["eval_losses"][0][1], None]
    assert doc["held_out"]["bits per token"] > 0 and "bits per byte" not in doc["held_out"]


def _bad_inputs(corpus: dict[str, Path]) -> dict[str, tuple[list[str], str]]:
    """Each bad input's flags (beyond --data hf:...) and the line it gets."""
    root = corpus["root"]
    if not (root / "empty").exists():
        (root / "empty").mkdir()
        datasets.Dataset.from_dict({"body": []}).to_parquet(str(root / "empty" / "part-0.parquet"))
        (root / "short").mkdir()
        datasets.Dataset.from_dict({"body": ["a few words"] * 3}).to_parquet(str(root / "short" / "part-0.parquet"))
        big = tokenizers.Tokenizer(tokenizers.models.BPE())
        big.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        big.train_from_iterator(["some text"], tokenizers.trainers.BpeTrainer(
            vocab_size=600, special_tokens=["<|endoftext|>", *(f"<x{i}>" for i in range(400))],
            initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
        big.save(str(root / "big.json"))
    tok = ["--tokenizer", str(corpus["tok"])]
    return {
        "column": ([f"hf:{corpus['corpus']}", "--data-column", "text", *tok],
                   "has no column 'text' (columns: body, id); name the text column with --data-column"),
        "tokenizer": ([f"hf:{corpus['corpus']}", "--data-column", "body", "--tokenizer", str(root / "nowhere.json")],
                      "no tokenizer.json there"),
        "no tokenizer": ([f"hf:{corpus['corpus']}", "--data-column", "body"], "is text; pass --tokenizer PATH"),
        "dataset": ([f"hf:{root / 'nowhere'}", "--data-column", "body", *tok], "does not load"),
        "empty": ([f"hf:{root / 'empty'}", "--data-column", "body", *tok], "holds no rows"),
        "short": ([f"hf:{root / 'short'}", "--data-column", "body", *tok], "is too short for one held-out sequence"),
        "vocabulary": ([f"hf:{corpus['corpus']}", "--data-column", "body", "--tokenizer", str(root / "big.json")],
                       "but the model's vocabulary is 320"),
        "eval": ([f"hf:{corpus['corpus']}", "--data-column", "body", *tok, "--eval-every", "1", "--eval-batches", "1",
                  "--schedule", "async-1f1b"], "--eval-every evaluates between steps"),
    }


@pytest.mark.parametrize("case", ["column", "tokenizer", "no tokenizer", "dataset", "empty", "short", "vocabulary",
                                  "eval"])
def test_bad_dataset_input_is_one_line_before_any_rank_starts(corpus: dict[str, Path], case: str,
                                                              no_rank_starts: list[list[str]]) -> None:
    flags, expected = _bad_inputs(corpus)[case]
    line = one_line_error(fxpipe_cli("run", corpus["plan"], "--steps", 1, "--data", *flags,
                                     "--loss", f"{corpus['file']}:loss"))
    assert expected in line, line


def scheduled_reference(corpus: dict[str, Path], steps: int, totals: list[int]) -> tuple[list[float], list[float]]:
    """One eager process, SGD with momentum 0.9 (state a resumed run must restore), 2 warm-up steps then cosine
    (Hugging Face's formula, written out): step k's learning rate from the schedule of ``totals[k]`` steps (a run
    resumed with a larger --steps follows its own). SGD: AdamW's first steps divide each gradient by its own size,
    so float noise in near-zero gradients (summation order) moves weights by a good part of the learning rate."""
    import math

    model, module, text = _one_process(corpus)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    losses, lrs = [], []
    for k in range(steps):
        lr = 0.01 * (k / 2 if k < 2 else 0.5 * (1 + math.cos(math.pi * (k - 2) / (totals[k] - 2))))
        for group in opt.param_groups:
            group["lr"] = lr
        losses.append(_step(model, module, opt, text, k))
        lrs.append(lr)
    return losses, lrs


def test_a_killed_rank_resumes_to_the_unbroken_losses_and_training_on_follows_the_longer_schedule(
        corpus: dict[str, Path], tmp_path: Path) -> None:
    """2 stages x 2 replicas, 6 steps, a checkpoint every 3: rank 1 is killed in step 5, torchrun restarts the ranks
    (--max-restarts 1 --resume auto), which resume from step 3 and end with the losses and learning rates of an
    unbroken run (one eager process); run again with --steps 9, the run trains on from step 6 on the 9-step curve."""
    flags = ["--dp", DP, "--data", f"hf:{corpus['corpus']}", "--data-column", "body", "--tokenizer", corpus["tok"],
             "--loss", f"{corpus['file']}:loss", "--momentum", 0.9, "--lr-schedule", "cosine", "--warmup-steps", 2,
             "--checkpoint-dir", tmp_path / "ckpt", "--checkpoint-every", 3, "--resume", "auto", "--timeout", 30,
             "--log-dir", tmp_path / "log", "--json"]
    killed = json.loads(ok(fxpipe_cli("run", corpus["plan"], "--steps", 6, "--max-restarts", 1, "--kill-rank", 1,
                                      "--fault-step", 4, *flags)).stdout)
    assert killed["restarts"] == 1 and killed["first_step"] == 3
    losses, lrs = scheduled_reference(corpus, 9, [6] * 6 + [9] * 3)
    lines = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5, 6]
    torch.testing.assert_close([m["loss"] for m in lines], losses[:6], rtol=1e-5, atol=0)
    torch.testing.assert_close([m["lr"] for m in lines], lrs[:6], rtol=1e-6, atol=0)
    on = json.loads(ok(fxpipe_cli("run", corpus["plan"], "--steps", 9, *flags)).stdout)
    assert on["first_step"] == 6
    torch.testing.assert_close(on["losses"], losses[6:], rtol=1e-5, atol=0)
    torch.testing.assert_close(on["lrs"], lrs[6:], rtol=1e-6, atol=0)


def test_each_replica_is_fed_its_rows_of_the_one_process_batches(corpus: dict[str, Path], tmp_path: Path) -> None:
    """What a rank reads (fxpipe.cli.feed.rank_batches through torch's DataLoader, from the launcher's token file)
    is its replica's rows of one process's batch k, for every step, on the first stage's rank (inputs) and the
    last's (targets); the replicas' rows are disjoint and together the whole batch."""
    from fxpipe.cli.feed import input_specs, rank_batches
    from fxpipe.cli.run_cmd import write_ids
    from fxpipe.plan_dir import read_plan

    text = data.load_hf(str(corpus["corpus"]), tokenizer=corpus["tok"], column="body")
    spec = f"jsonl:{write_ids(text, tmp_path / 'tokens.jsonl')}"  # what the ranks are given
    plan = read_plan(corpus["plan"])
    whole = [text.batch(k, ROWS * MICROBATCHES * DP, SEQ, seed=3) for k in range(4)]
    for replica in range(DP):
        for first_stage in (True, False):
            ctx = data.DataContext(0, first_stage, not first_stage, replica, DP, MICROBATCHES, ROWS, 3, 1, 4,
                                   input_specs(plan, MICROBATCHES))
            fed = list(data.step_loader(rank_batches(spec, plan, ctx, None), first=1, steps=4, workers=1))
            for (inputs, target), (idx, want) in zip(fed, whole[1:]):
                rows = slice(replica * ROWS * MICROBATCHES, (replica + 1) * ROWS * MICROBATCHES)
                if first_stage:
                    assert target is None and torch.equal(inputs[0], idx[rows])
                else:
                    assert inputs is None and torch.equal(target, want[rows])
