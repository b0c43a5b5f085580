"""fxpipe.data: splits, shapes, batches and errors of the real-data sources, and that each is learnable."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from fxpipe import data, models
from fxpipe.data import (
    DIGITS_ZOO,
    TEXT_ZOO,
    Digits,
    Synthetic,
    Text,
    check_fit,
    load_digits,
    load_stdlib_text,
    load_text,
    parse_data,
)
from fxpipe.errors import OptionError
from tests._helpers import skip_without

skip_without("sklearn")  # the dev extra installs it; a bare install without fxpipe[data] skips


@pytest.fixture(scope="module")
def digits() -> Digits:
    return load_digits()


@pytest.fixture(scope="module")
def stdlib() -> Text:
    return load_stdlib_text()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models train fastest on one thread, and far faster than on two when the CPU is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _seeded(make: Callable[[], nn.Module]) -> nn.Module:
    """A model whose initial weights come from seed 0, leaving the caller's RNG as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return make()


# --------------------------------------------------------------------------------------------- digits


def test_digits_split_is_deterministic_disjoint_and_complete(digits: Digits) -> None:
    again = load_digits()
    assert torch.equal(digits.train_index, again.train_index) and torch.equal(digits.train_x, again.train_x)
    assert (len(digits.train_y), len(digits.heldout_y)) == (1438, 359)  # 1797, one in five held out
    train, held = set(digits.train_index.tolist()), set(digits.heldout_index.tolist())
    assert not train & held and train | held == set(range(1797))
    other = load_digits(split_seed=1)
    assert not torch.equal(other.heldout_index, digits.heldout_index)


def test_digits_shapes_dtypes_and_scale(digits: Digits) -> None:
    assert digits.train_x.shape == (1438, 64) and digits.train_x.dtype == torch.float32
    assert float(digits.train_x.min()) == 0.0 and float(digits.train_x.max()) == 1.0
    assert digits.train_y.dtype == torch.int64 and set(digits.train_y.tolist()) == set(range(10))
    x, y = digits.batch(0, 16)
    assert x.shape == (16, 64) and x.dtype == torch.float32 and y.shape == (16,) and y.dtype == torch.int64
    image, _ = digits.batch(0, 16, layout="image", dtype=torch.float64)
    assert image.shape == (16, 1, 8, 8) and image.dtype == torch.float64
    assert torch.equal(image.reshape(16, 64).float(), x)


def test_digits_batches_cover_an_epoch_then_reshuffle(digits: Digits) -> None:
    batch_size = 100
    per_epoch = digits.steps_per_epoch(batch_size)
    assert per_epoch == 1438 // batch_size
    epochs = [list(digits.batches(batch_size, seed=3, start=e * per_epoch, steps=per_epoch)) for e in range(2)]
    for epoch in epochs:
        assert all(x.shape == (batch_size, 64) and y.shape == (batch_size,) for x, y in epoch)  # drop_last
    firsts = [epoch[0][0] for epoch in epochs]
    assert not torch.equal(firsts[0], firsts[1])  # a new order each epoch
    # the stream, random access and a resumed stream agree
    stream = list(digits.batches(batch_size, seed=3, steps=2 * per_epoch))
    for step in (0, per_epoch - 1, per_epoch, 2 * per_epoch - 1):
        assert torch.equal(stream[step][0], digits.batch(step, batch_size, seed=3)[0])
    assert torch.equal(next(digits.batches(batch_size, seed=3, start=per_epoch + 2))[0], stream[per_epoch + 2][0])
    assert not torch.equal(digits.batch(0, batch_size, seed=4)[0], stream[0][0])


def test_an_epoch_visits_each_training_sample_once(digits: Digits) -> None:
    # 1438 = 2 x 719: with batches of 719 nothing is dropped, so one epoch is the training set reordered
    for epoch in range(2):
        x = torch.cat([x for x, _ in digits.batches(719, seed=0, start=2 * epoch, steps=2)])
        y = torch.cat([y for _, y in digits.batches(719, seed=0, start=2 * epoch, steps=2)])
        rows = torch.cat([x, y[:, None].float()], 1)
        everything = torch.cat([digits.train_x, digits.train_y[:, None].float()], 1)
        assert all(torch.equal(a, b) for a, b in zip(rows.unique(dim=0, return_counts=True),
                                                      everything.unique(dim=0, return_counts=True)))
        assert not torch.equal(rows, everything)  # shuffled


def test_digits_evaluate_counts_every_heldout_sample_once(digits: Digits) -> None:
    seen: list[torch.Tensor] = []

    def oracle(x: torch.Tensor) -> torch.Tensor:
        assert x.shape == (64, 64)  # the last batch is filled up to the compiled shape
        seen.append(x)
        rows = (x[:, None, :] == digits.heldout_x[None]).all(-1).float().argmax(1)
        return nn.functional.one_hot(digits.heldout_y[rows], 10).float()

    result = digits.evaluate(oracle, 64)
    assert (result.correct, result.total, result.batches, result.padded) == (359, 359, 6, 6 * 64 - 359)
    assert result.accuracy == 1.0
    assert digits.evaluate(lambda x: torch.zeros(len(x), 10), 64).correct == int((digits.heldout_y == 0).sum())


def test_a_tiny_mlp_learns_digits(digits: Digits, one_thread: None) -> None:
    model = _seeded(lambda: nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in digits.batches(32, seed=0, steps=200):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert digits.evaluate(model, 32).accuracy > 0.90  # 0.969 measured (348 of 359)


def test_a_tiny_cnn_takes_digit_images(digits: Digits) -> None:
    model = _seeded(lambda: nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                                          nn.Linear(4 * 64, 10)))
    result = digits.evaluate(model, 50, layout="image")
    assert result.total == 359 and result.batches == 8


# --------------------------------------------------------------------------------------------- text


def test_text_split_is_contiguous_last_tenth(tmp_path: Path) -> None:
    raw = bytes(range(256)) * 4  # 1024 bytes
    (tmp_path / "t.bin").write_bytes(raw)
    text = load_text(tmp_path / "t.bin")
    assert text.vocab_size == 256 and text.train.dtype == torch.uint8
    assert len(text.heldout) == 102 and bytes(text.train.tolist()) + bytes(text.heldout.tolist()) == raw


def test_text_batches_are_shifted_windows_and_seeded(stdlib: Text) -> None:
    idx, target = stdlib.batch(5, 8, 32, seed=1)
    assert idx.shape == target.shape == (8, 32) and idx.dtype == target.dtype == torch.int64
    assert torch.equal(idx[:, 1:], target[:, :-1])
    train = bytes(stdlib.train.tolist())
    for row, tgt in zip(idx.tolist(), target.tolist()):  # each row is a window of the training bytes
        start = train.find(bytes(row + tgt[-1:]))
        assert start >= 0
    assert torch.equal(idx, stdlib.batch(5, 8, 32, seed=1)[0])
    assert not torch.equal(idx, stdlib.batch(6, 8, 32, seed=1)[0])
    assert not torch.equal(idx, stdlib.batch(5, 8, 32, seed=2)[0])
    stream = list(stdlib.batches(8, 32, seed=1, start=4, steps=2))
    assert torch.equal(stream[1][0], idx)


def test_stdlib_corpus_is_deterministic_and_capped(stdlib: Text) -> None:
    again = load_stdlib_text()
    assert again.files == stdlib.files and torch.equal(again.heldout, stdlib.heldout)
    size = len(stdlib.train) + len(stdlib.heldout)
    assert 100_000 < size <= 1 << 20
    small = load_stdlib_text(max_bytes=5000)
    assert len(small.train) + len(small.heldout) == 5000 and len(small.files) == 1


def test_text_evaluate_scores_every_heldout_window(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_bytes(b"ab" * 500)  # held out: the last 100 bytes
    text = load_text(tmp_path / "t.txt")

    def uniform(idx: torch.Tensor) -> torch.Tensor:
        assert idx.shape == (4, 8)
        return torch.zeros(*idx.shape, 256)

    result = text.evaluate(uniform, 4, 8)
    assert (result.windows, result.tokens, result.batches, result.padded) == (12, 96, 3, 0)
    assert result.loss == pytest.approx(math.log(256)) and result.bits_per_byte == pytest.approx(8.0)
    assert text.evaluate(uniform, 4, 8, max_batches=1).windows == 4
    assert text.evaluate(lambda i: torch.zeros(*i.shape, 256), 5, 8).padded == 3
    with pytest.raises(OptionError, match=r"needs logits \(4, 8, V >= 256\), but the model gave \(4, 8, 128\); "
                                          r"use one of gpt-small"):
        text.evaluate(lambda i: torch.zeros(*i.shape, 128), 4, 8)


def test_a_tiny_model_beats_the_unigram_on_text(stdlib: Text, one_thread: None) -> None:
    bigram = _seeded(lambda: nn.Embedding(256, 256))  # logits of the next byte given this one
    opt = torch.optim.Adam(bigram.parameters(), lr=0.1)
    for idx, target in stdlib.batches(32, 64, seed=0, steps=200):
        loss = nn.functional.cross_entropy(bigram(idx).reshape(-1, 256), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    unigram = stdlib.unigram_loss()
    assert 2.5 < unigram < 4.0  # nats per byte of Python source (3.16 measured)
    assert stdlib.evaluate(bigram, 64, 64).loss < unigram - 0.4  # 2.46 measured


# --------------------------------------------------------------------------------------------- parse_data


def test_parse_data_names_each_source(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("hello world\n" * 10)
    assert isinstance(parse_data("synthetic"), Synthetic)
    assert isinstance(parse_data(" Digits "), Digits)
    assert isinstance(parse_data(f"text:{tmp_path / 't.txt'}"), Text)
    assert parse_data("text:stdlib").spec == "text:stdlib"


@pytest.mark.parametrize(("spec", "match"), [
    ("mnist", r"unknown --data 'mnist' \(known: synthetic, digits, text:PATH, text:stdlib, jsonl:PATH, "
              r"FILE.py:FUNCTION\)"),
    ("digit", r"did you mean 'digits'\?"),
    ("text:", r"needs a file after the colon"),
    ("text:/no/such/file.txt", r"no such file .*; check the path"),
])
def test_parse_data_errors_are_one_line(spec: str, match: str) -> None:
    with pytest.raises(OptionError, match=match) as info:
        parse_data(spec)
    assert "\n" not in str(info.value)


def test_parse_data_refuses_empty_short_and_directory(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "short.txt").write_bytes(b"x" * 100)
    with pytest.raises(OptionError, match=r"is empty \(bytes: 0\); use a file with text in it"):
        parse_data(f"text:{tmp_path / 'empty.txt'}")
    with pytest.raises(OptionError, match=r"is a directory"):
        parse_data(f"text:{tmp_path}")
    with pytest.raises(OptionError, match=r"too short for one held-out sequence \(bytes: 100, held out \(last 10%\): "
                                          r"10, seq_len 32 needs 33\); use a text of at least 330 bytes"):
        parse_data(f"text:{tmp_path / 'short.txt'}", seq_len=32)
    assert isinstance(parse_data(f"text:{tmp_path / 'short.txt'}", seq_len=9), Text)
    short = parse_data(f"text:{tmp_path / 'short.txt'}")
    assert isinstance(short, Text)
    with pytest.raises(OptionError, match=r"too short"):
        short.batch(0, 2, 10)


def test_digits_without_scikit_learn_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn now raises ImportError
    with pytest.raises(OptionError, match=r"scikit-learn, which is not installed; "
                                          r"pip install -c constraints.txt -e '\.\[data\]'"):
        parse_data("digits")


def test_bad_batch_options(digits: Digits, stdlib: Text) -> None:
    with pytest.raises(OptionError, match=r"batch size exceeds digits' training set \(batch_size: 2000, samples: "
                                          r"1438\)"):
        digits.batch(0, 2000)
    with pytest.raises(OptionError, match=r"unknown digits layout 'nchw' \(known: flat, image\)"):
        digits.batches(8, layout="nchw")  # type: ignore[arg-type]
    with pytest.raises(OptionError, match=r"floating point \(dtype: torch.int64\)"):
        digits.batch(0, 8, dtype=torch.int64)
    with pytest.raises(OptionError, match=r"batch size must be at least 1"):
        stdlib.batch(0, 0, 8)


# --------------------------------------------------------------------------------------------- fitting


def _zoo_names() -> list[str]:
    return [f"{entry.family}-{size}" for entry in models.entries() for size in entry.sizes]


def _fits(source: Digits | Text, name: str) -> bool:
    zoo = models.build(name, device="meta")
    try:
        check_fit(source, zoo.example_inputs, zoo.model(*zoo.example_inputs).shape)
    except OptionError as error:
        assert "\n" not in str(error) and "; use " in str(error)
        return False
    return True


def test_which_zoo_models_fit(digits: Digits, stdlib: Text) -> None:
    names = _zoo_names()
    assert [n for n in names if _fits(digits, n)] == list(DIGITS_ZOO)
    # gpt-1.5b takes bytes too, but is no model to suggest for a CPU run
    assert [n for n in names if _fits(stdlib, n)] == [*TEXT_ZOO, "gpt-1.5b"]


def test_check_fit_says_what_to_use(digits: Digits, stdlib: Text) -> None:
    mlp = models.build("mlp-small", device="meta")
    fit = check_fit(digits, mlp.example_inputs, (8, 10))
    assert (fit.layout, fit.dtype) == ("flat", torch.float32)
    assert check_fit(digits, (torch.zeros(4, 1, 8, 8, dtype=torch.float64),), (4, 10)).layout == "image"
    with pytest.raises(OptionError, match=r"digits gives \(B, 64\) features or \(B, 1, 8, 8\) images, but the model "
                                          r"takes \(2, 3, 32, 32\); use mlp-small"):
        check_fit(digits, (torch.zeros(2, 3, 32, 32),), (2, 10))
    with pytest.raises(OptionError, match=r"digits has 10 classes and needs logits \(B, 10\), but the model gives "
                                          r"\(4, 1000\)"):
        check_fit(digits, (torch.zeros(4, 64),), (4, 1000))
    gpt = models.build("gpt-small", device="meta")
    fit = check_fit(stdlib, gpt.example_inputs, (4, 32, 256))
    assert (fit.layout, fit.seq_len, fit.dtype) == ("tokens", 32, torch.int64)
    with pytest.raises(OptionError, match=r"text:stdlib is bytes \(vocabulary 256\), but the model's vocabulary is "
                                          r"128; use gpt-small"):
        check_fit(stdlib, (torch.zeros(2, 16, dtype=torch.int64),), (2, 16, 128))
    with pytest.raises(OptionError, match=r"gives one int64 input of byte ids \(B, T\), but the model takes "
                                          r"\(4, 64\) of float32"):
        check_fit(stdlib, (torch.zeros(4, 64),), (4, 10))
    assert check_fit(Synthetic(), mlp.example_inputs, (8, 10)).layout == "synthetic"


def test_digits_batches_feed_a_zoo_mlp(digits: Digits) -> None:
    zoo = models.build("mlp-small")
    fit = check_fit(digits, zoo.example_inputs, zoo.model(*zoo.example_inputs).shape)
    x, y = digits.batch(0, zoo.example_inputs[0].shape[0], layout=fit.layout, dtype=fit.dtype)  # type: ignore[arg-type]
    assert zoo.loss_fn(zoo.model(x), y).isfinite()


def test_held_out_batches_are_the_split_s_consecutive_windows_in_order() -> None:
    heldout = torch.arange(100, 141)  # 41 tokens: 10 windows of 4 (+1 target token)
    text = data.Text("jsonl:x", ("x",), torch.arange(100), heldout, vocab_size=141)
    batches = data.held_out_batches(text, 3, seq_len=4, max_batches=2)
    assert len(batches) == 2
    idx, target = batches[1]
    assert idx.tolist() == [[112, 113, 114, 115], [116, 117, 118, 119], [120, 121, 122, 123]]
    assert target.tolist() == [[113, 114, 115, 116], [117, 118, 119, 120], [121, 122, 123, 124]]
    assert data.held_out_batches(text, 3, seq_len=4, shard=(1, 3))[0][0].tolist() == [[104, 105, 106, 107]]
    with pytest.raises(OptionError, match="less than one batch of 11 rows"):
        data.held_out_batches(text, 11, seq_len=4)


def test_the_step_loader_reads_steps_first_to_last_through_torch_s_dataloader() -> None:
    def batch(k: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        return (torch.full((2,), k),), torch.tensor(k)

    got = list(data.step_loader(batch, first=3, steps=6, workers=2))
    assert [int(target) for _, target in got] == [3, 4, 5]
    assert isinstance(got[0], tuple) and isinstance(got[0][0], tuple)  # as the source made it
    ctx = data.DataContext(0, True, True, 0, 1, 1, 2, 0, 1, 4, ())
    streamed = data.user_batches(iter([((torch.zeros(2),), torch.tensor(k)) for k in range(1, 4)]), ctx, "f.py:b")
    assert [int(t) for _, t in data.step_loader(streamed, first=1, steps=4, workers=2)] == [1, 2, 3]  # in order here


@pytest.mark.parametrize("kind", ["text", "jsonl"])
def test_a_data_file_must_be_a_regular_file(tmp_path: Path, kind: str) -> None:
    """A FIFO would block the read and a device never end it: both are one line, named as what they are."""
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero"), Path("/dev/urandom")):
        with pytest.raises(OptionError, match=r"is not a regular file \(a FIFO, device or socket\)"):
            data.parse_data(f"{kind}:{path}")
    with pytest.raises(OptionError, match="no such file"):
        data.parse_data(f"{kind}:{tmp_path / 'missing'}")


def test_a_token_id_past_64_bits_is_one_line(tmp_path: Path) -> None:
    ids = tmp_path / "ids.jsonl"
    ids.write_text("[1, 2, " + "9" * 30 + "]\n")
    with pytest.raises(OptionError, match="line 1 has a token id of 30 digits, past 64 bits"):
        data.parse_data(f"jsonl:{ids}")
