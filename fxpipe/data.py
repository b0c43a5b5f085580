"""data: training data for ``fxpipe run``: built-in sources with no download, split, batched, scored; and the
context a user's data function (``--data file.py:function``) is called with.

``parse_data(spec)`` turns ``--data`` into a source:

    parse_data("digits")           # 1797 8x8 images, 10 classes: 1438 train, 359 held out
    parse_data("text:notes.txt")   # the file's bytes (vocabulary 256), the last 10% held out
    parse_data("text:stdlib")      # a few of Python's own source files, 1 MiB at most
    parse_data("jsonl:ids.jsonl")  # token ids, one JSON document a line, the last 10% held out
    load_hf("corpus/", tokenizer="tok.json")  # --data hf:corpus/ --tokenizer tok.json: a dataset's text, tokenized
    parse_data("my_data.py:batches")  # UserData: the CLI imports the function and calls it with a DataContext

Every batch has the same shape (pipeline stages are compiled for fixed shapes), and batch ``step`` is a pure
function of ``(seed, step)``, so a resumed run or another rank draws the same batch without replaying earlier
ones; ``shard=(d, dp)`` draws only replica d's rows of it. ``check_fit(source, example_inputs, output_shape)``
says in one line when a model cannot take the data.
"""

from __future__ import annotations

import difflib
import json
import math
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch.nn import functional as F

from fxpipe.errors import OptionError, first_line

__all__ = [
    "DIGITS_ZOO",
    "STDLIB_FILES",
    "STDLIB_MAX_BYTES",
    "TEXT_ZOO",
    "Accuracy",
    "DataContext",
    "DataSource",
    "Digits",
    "Fit",
    "StepBatches",
    "Synthetic",
    "Text",
    "TextLoss",
    "UserData",
    "check_fit",
    "held_out_batches",
    "index_bounds",
    "load_digits",
    "load_hf",
    "load_jsonl",
    "load_stdlib_text",
    "step_loader",
    "step_seed",
    "load_text",
    "parse_data",
    "user_batches",
]

DIGITS_FEATURES = 64  # 8 x 8 pixels
DIGITS_CLASSES = 10
DIGITS_HELDOUT = 5  # one sample in 5 is held out
TEXT_HELDOUT = 10  # the last tenth of a text is held out
BYTE_VOCAB = 256

#: The standard library files ``text:stdlib`` reads, in this order (those missing are passed over): large,
#: present since Python 3.8, and plain code and prose rather than data tables.
STDLIB_FILES = (
    "argparse.py", "dataclasses.py", "functools.py", "inspect.py", "os.py", "subprocess.py", "typing.py",
    "textwrap.py", "collections/__init__.py", "json/decoder.py", "string.py", "random.py",
)
STDLIB_MAX_BYTES = 1 << 20

#: The zoo models that take each source as they are (``fxpipe models``); tests/test_data.py checks the list
#: against the zoo, so a new size that fits shows up there.
DIGITS_ZOO = ("mlp-small",)
TEXT_ZOO = ("gpt-small", "gpt-medium", "gpt-base")

DigitsLayout = Literal["flat", "image"]


# --------------------------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class Synthetic:
    """Random batches shaped like the model's example batch: what ``fxpipe run`` trains on without ``--data``."""

    spec: str = "synthetic"


@dataclass(frozen=True)
class Accuracy:
    """Held-out classification accuracy: ``correct`` of ``total`` samples, in ``batches`` fixed-shape batches.

    ``padded`` rows filled the last batch (copies of the first held-out samples) and were not counted.
    """

    correct: int
    total: int
    batches: int
    padded: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.total


@dataclass(frozen=True)
class TextLoss:
    """Held-out next-byte cross entropy: mean ``loss`` in nats over ``tokens`` predictions (``windows`` x seq_len)."""

    loss: float
    tokens: int
    windows: int
    batches: int
    padded: int

    @property
    def bits_per_byte(self) -> float:
        return self.loss / math.log(2)


@dataclass(frozen=True, eq=False)
class Digits:
    """scikit-learn's handwritten digits: features in [0, 1] (float32), labels 0..9 (int64), split once by a seed.

    ``train_index`` / ``heldout_index`` are the samples' rows in ``sklearn.datasets.load_digits()``, sorted.
    Compared by identity: its fields are tensors.
    """

    train_x: torch.Tensor  # (N, 64)
    train_y: torch.Tensor  # (N,)
    heldout_x: torch.Tensor
    heldout_y: torch.Tensor
    train_index: torch.Tensor
    heldout_index: torch.Tensor
    split_seed: int
    spec: str = "digits"

    def steps_per_epoch(self, batch_size: int) -> int:
        """Full batches in one pass over the training set (the last ``N % batch_size`` samples are dropped)."""
        _check_batch_size(batch_size, len(self.train_y), "digits' training set")
        return len(self.train_y) // batch_size

    def batch(self, step: int, batch_size: int, *, seed: int = 0, layout: DigitsLayout = "flat",
              dtype: torch.dtype = torch.float32, shard: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``step``: ``(x, y)``, x ``(B, 64)`` for ``flat`` or ``(B, 1, 8, 8)`` for ``image``, y ``(B,)`` int64.

        Epoch ``step // steps_per_epoch`` visits the training set in its own seeded order, so the samples
        dropped to keep batches full differ from epoch to epoch. ``shard=(d, n)``: only the d-th of n equal
        parts of the batch's rows (replica d's), read alone.
        """
        per_epoch = self.steps_per_epoch(batch_size)
        _check_start(step)
        epoch, pos = divmod(step, per_epoch)
        rows = _shard(_epoch_order(len(self.train_y), seed, epoch)[pos * batch_size:(pos + 1) * batch_size], shard)
        return _shape(self.train_x[rows], layout, dtype), self.train_y[rows]

    def batches(self, batch_size: int, *, seed: int = 0, start: int = 0, steps: int | None = None,
                layout: DigitsLayout = "flat", dtype: torch.dtype = torch.float32,
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches ``start, start + 1, ...`` (``steps`` of them, or without end), as ``batch`` draws them."""
        per_epoch = self.steps_per_epoch(batch_size)
        _check_start(start)
        _shape(self.train_x[:1], layout, dtype)  # a bad layout or dtype fails here, not at the first next()
        return self._batches(batch_size, per_epoch, seed, start, steps, layout, dtype)

    def _batches(self, batch_size: int, per_epoch: int, seed: int, start: int, steps: int | None,
                 layout: DigitsLayout, dtype: torch.dtype) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        step, order, order_epoch = start, torch.empty(0, dtype=torch.int64), -1
        while steps is None or step < start + steps:
            epoch, pos = divmod(step, per_epoch)
            if epoch != order_epoch:  # one permutation per epoch, not one per batch
                order, order_epoch = _epoch_order(len(self.train_y), seed, epoch), epoch
            rows = order[pos * batch_size:(pos + 1) * batch_size]
            yield _shape(self.train_x[rows], layout, dtype), self.train_y[rows]
            step += 1

    def evaluate(self, model: Callable[[torch.Tensor], Any], batch_size: int, *, layout: DigitsLayout = "flat",
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Accuracy:
        """Accuracy of ``model`` (logits ``(B, 10)``) on every held-out sample, in batches of ``batch_size``.

        The last batch is filled up with the first held-out samples so it has the compiled shape too; their
        predictions are not counted. Runs under ``torch.no_grad``; put a model with dropout or BatchNorm in
        eval mode first (in train mode BatchNorm would also see the filler rows).
        """
        _check_batch_size(batch_size, None, "digits' held-out set")
        _shape(self.heldout_x[:1], layout, dtype)
        total = len(self.heldout_y)
        correct = batches = 0
        for rows, real in _padded_batches(total, batch_size):
            with torch.no_grad():
                logits = model(_shape(self.heldout_x[rows], layout, dtype).to(device))
            predicted = _tensor_output(logits, "digits").argmax(-1).cpu()
            correct += int((predicted[:real] == self.heldout_y[rows[:real]]).sum())
            batches += 1
        return Accuracy(correct, total, batches, batches * batch_size - total)


@dataclass(frozen=True, eq=False)
class Text:
    """A token stream split into train and the last 10% held out: a file's bytes (``text:``, vocabulary 256, the
    same for every file) or the token ids of a JSON-lines file (``jsonl:``, vocabulary its largest id + 1).

    ``train`` and ``heldout`` are uint8 (bytes) or int64 tensors; batches hold int64 ids. Compared by identity.
    """

    spec: str
    files: tuple[str, ...]
    train: torch.Tensor
    heldout: torch.Tensor
    vocab_size: int = BYTE_VOCAB

    def check_seq_len(self, seq_len: int) -> None:
        """Raise OptionError unless train and held-out each hold one sequence of ``seq_len`` plus its target."""
        if seq_len < 1:
            raise OptionError(f"a sequence holds at least one token (seq_len: {seq_len}); pass seq_len >= 1")
        need = seq_len + 1
        if len(self.heldout) < need:
            size = len(self.train) + len(self.heldout)
            unit = "bytes" if self.spec.startswith("text:") else "tokens"
            raise OptionError(
                f"{self.spec} is too short for one held-out sequence ({unit}: {size}, held out (last 10%): "
                f"{len(self.heldout)}, seq_len {seq_len} needs {need}); use a text of at least "
                f"{need * TEXT_HELDOUT} {unit} or a shorter sequence"
            )

    def batch(self, step: int, batch_size: int, seq_len: int, *, seed: int = 0,
              shard: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``step``: ``(idx, target)``, both ``(B, seq_len)`` int64, target = idx shifted left by one token.

        Each row starts at its own random offset in the training tokens, drawn from ``(seed, step)``.
        ``shard=(d, n)``: only the d-th of n equal parts of the batch's rows (replica d's), read alone.
        """
        self.check_seq_len(seq_len)
        _check_batch_size(batch_size, None, self.spec)
        _check_start(step)
        generator = torch.Generator().manual_seed(_mix(seed, step))
        starts = _shard(torch.randint(0, len(self.train) - seq_len, (batch_size,), generator=generator), shard)
        windows = self.train[starts[:, None] + torch.arange(seq_len + 1)].to(torch.int64)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def batches(self, batch_size: int, seq_len: int, *, seed: int = 0, start: int = 0, steps: int | None = None,
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches ``start, start + 1, ...`` (``steps`` of them, or without end), as ``batch`` draws them."""
        self.check_seq_len(seq_len)
        _check_batch_size(batch_size, None, self.spec)
        _check_start(start)
        return (self.batch(step, batch_size, seq_len, seed=seed)
                for step in (range(start, start + steps) if steps is not None else _count(start)))

    def evaluate(self, model: Callable[[torch.Tensor], Any], batch_size: int, seq_len: int, *,
                 max_batches: int | None = None, device: str | torch.device = "cpu") -> TextLoss:
        """Mean next-byte cross entropy of ``model`` (logits ``(B, T, V)``, V >= 256) on the held-out bytes.

        The held-out bytes are cut into consecutive windows of ``seq_len`` (each predicting the byte after
        every position), batched in order; the last batch is filled up with the first windows, which are not
        counted. ``max_batches`` scores only the first that many batches. Runs under ``torch.no_grad``.
        """
        self.check_seq_len(seq_len)
        _check_batch_size(batch_size, None, self.spec)
        windows = (len(self.heldout) - 1) // seq_len
        if max_batches is not None:
            if max_batches < 1:
                raise OptionError(f"max_batches must be at least 1 (max_batches: {max_batches}); raise it")
            windows = min(windows, max_batches * batch_size)
        offsets = torch.arange(seq_len + 1)
        total = 0.0
        batches = 0
        for rows, real in _padded_batches(windows, batch_size):
            chunk = self.heldout[rows[:, None] * seq_len + offsets].to(torch.int64)
            with torch.no_grad():
                logits = _tensor_output(model(chunk[:, :-1].to(device)), self.spec)
            if logits.dim() != 3 or logits.shape[:2] != (batch_size, seq_len) or logits.size(-1) < self.vocab_size:
                raise OptionError(
                    f"{self.spec} needs logits ({batch_size}, {seq_len}, V >= {self.vocab_size}), but the model "
                    f"gave {tuple(logits.shape)}; use one of {', '.join(TEXT_ZOO)}"
                )
            logits = logits[:real].float()
            total += float(F.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                           chunk[:real, 1:].reshape(-1).to(logits.device), reduction="sum"))
            batches += 1
        tokens = windows * seq_len
        return TextLoss(total / tokens, tokens, windows, batches, batches * batch_size - windows)

    def unigram_loss(self) -> float:
        """Held-out cross entropy (nats per byte) of the training bytes' frequencies, add-one smoothed.

        The loss of a model that ignores context: what a trained model must beat.
        """
        counts = torch.bincount(self.train.to(torch.int64), minlength=self.vocab_size).double() + 1.0
        log_p = (counts / counts.sum()).log()
        return float(-log_p[self.heldout.to(torch.int64)].mean())


@dataclass(frozen=True)
class UserData:
    """``--data file.py:function`` or ``package.module:function``: the CLI imports the function (``fxpipe.targets``)
    and each rank calls it once with its :class:`DataContext`."""

    spec: str


@dataclass(frozen=True)
class DataContext:
    """What one rank of ``fxpipe run`` asks of a data function: ``function(ctx)`` returns the rank's batches.

    The return value is a sequence (batch of step k: item ``k % len``) or an iterable (one item per step, the
    first for step ``start``). Each item is ``(inputs, target)``: ``inputs`` a tensor or a tuple of them (the
    model's positional inputs, each with ``batch_size`` rows: ``microbatches`` x ``rows``), ``target`` what the
    loss takes for those rows (a tensor whose first dimension is ``batch_size``). A rank reads only what its
    stages consume: ``needs_inputs`` (it runs the first stage) and ``needs_targets`` (it computes the loss);
    the part it does not need may be None, and a rank that needs neither is never called. Replica ``replica``
    of ``replicas`` reads its own rows: shard the data by it. ``inputs`` lists each input's (name, shape of
    one replica's batch, dtype). The launcher calls the function once before any rank starts (with
    ``rank`` -1, needing both) to check the first batch's shapes.
    """

    rank: int
    needs_inputs: bool
    needs_targets: bool
    replica: int
    replicas: int
    microbatches: int
    rows: int
    seed: int
    start: int
    steps: int
    inputs: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] = ()

    @property
    def batch_size(self) -> int:
        """Rows of one step's batch on this replica: its microbatches x one microbatch's rows."""
        return self.microbatches * self.rows


def user_batches(made: Any, ctx: DataContext, spec: str) -> Callable[[int], tuple[Any, Any]]:
    """``batch(step)`` of what a data function returned for ``ctx``: ``(inputs, target)`` with ``inputs`` a
    tuple, the part this rank does not need None. One line (OptionError) when it is neither a sequence nor an
    iterable, ends before the last step, or an item is not a pair."""
    if isinstance(made, Sequence) and not isinstance(made, (str, bytes)):
        if len(made) == 0:
            raise OptionError(f"--data {spec} returned an empty {type(made).__name__}; return at least one "
                              "(inputs, target) batch")

        def indexed(k: int) -> tuple[Any, Any]:
            return _item(made[k % len(made)], ctx, spec, k)
        return indexed
    try:
        it = iter(made)
    except TypeError:
        raise OptionError(f"--data {spec} returned a {type(made).__name__}; return a list or an iterable of "
                          "(inputs, target) batches") from None
    at = [ctx.start]

    def streamed(k: int) -> tuple[Any, Any]:
        if k != at[0]:
            raise OptionError(f"--data {spec} is an iterable, read in order from step {ctx.start}, and step {k} was "
                              f"asked after step {at[0] - 1}; return a sequence to read steps out of order")
        try:
            item = next(it)
        except StopIteration:
            raise OptionError(f"--data {spec} ran out of batches at step {k} (--steps {ctx.steps}); yield one "
                              "batch per step, or return a sequence (it repeats)") from None
        at[0] += 1
        return _item(item, ctx, spec, k)
    streamed.in_order = True  # type: ignore[attr-defined]  # one reader, in step order: no DataLoader workers
    return streamed


class StepBatches(torch.utils.data.Dataset[Any]):
    """Step k's batch as item k of a map-style dataset: ``batch(k)`` for a rank, its replica's rows of step k's
    global batch (disjoint across replicas), so a ``DataLoader`` over steps ``first..steps`` reads them ahead in
    worker processes and a resumed run starts at its checkpoint's step."""

    def __init__(self, batch: Callable[[int], tuple[Any, Any]], steps: int) -> None:
        self.batch, self.steps = batch, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, k: int) -> tuple[Any, Any]:
        return self.batch(k)


def step_loader(batch: Callable[[int], tuple[Any, Any]], *, first: int, steps: int, workers: int = 0,
                pin_memory: bool = False) -> Iterator[tuple[Any, Any]]:
    """Steps ``first, first + 1, ... steps - 1``'s batches through ``torch.utils.data.DataLoader``: ``workers``
    processes read ahead (0: this process), pinned on CUDA with ``pin_memory``. A data function's iterable is read
    in order by this process (``workers`` does not apply to it)."""
    import multiprocessing

    if getattr(batch, "in_order", False) or "fork" not in multiprocessing.get_all_start_methods():
        workers = 0  # workers are forked: the batch functions close over the rank's sources, which do not pickle
    loader = torch.utils.data.DataLoader(StepBatches(batch, steps), batch_size=None, sampler=range(first, steps),
                                         num_workers=workers, pin_memory=pin_memory, collate_fn=_as_is,
                                         prefetch_factor=2 if workers else None, persistent_workers=False,
                                         multiprocessing_context="fork" if workers else None)
    return iter(loader)


def _as_is(item: Any) -> Any:
    """The DataLoader's collate: the batch as the source made it (tuples stay tuples, None stays None)."""
    return item


def _item(item: Any, ctx: DataContext, spec: str, step: int) -> tuple[Any, Any]:
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise OptionError(f"--data {spec} gave a {type(item).__name__} for step {step}, not a pair; give "
                          "(inputs, target) per step")
    inputs, target = item
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    return (tuple(inputs) if ctx.needs_inputs and inputs is not None else None,
            target if ctx.needs_targets else None)


DataSource = Synthetic | Digits | Text


# --------------------------------------------------------------------------------------------- loading


def parse_data(spec: str, *, seq_len: int | None = None) -> DataSource | UserData:
    """The source ``--data`` names: ``synthetic``, ``digits``, ``text:PATH``, ``text:stdlib``, ``jsonl:PATH``, or
    a function (``file.py:function``, ``package.module:function``: a :class:`UserData` the caller resolves).

    A text must hold one held-out sequence of ``seq_len`` bytes (1 when not given) and its target
    (``Text.check_seq_len``). A file named ``stdlib`` is ``text:./stdlib``.

    Raises: OptionError (one line) for an unknown spec, a missing, unreadable, empty or too short file, or
    scikit-learn missing for ``digits``.
    """
    text = spec.strip()
    kind, colon, rest = text.partition(":")
    kind = kind.lower()
    if not colon and kind == "synthetic":
        return Synthetic()
    if not colon and kind == "digits":
        return load_digits()
    if colon and kind in ("text", "jsonl"):
        if not rest:
            raise OptionError(f"--data {kind}: needs a file after the colon (spec: '{kind}:'); "
                              + ("use text:PATH or text:stdlib" if kind == "text" else "use jsonl:PATH"))
        source = load_jsonl(rest) if kind == "jsonl" else load_stdlib_text() if rest == "stdlib" else load_text(rest)
        source.check_seq_len(1 if seq_len is None else seq_len)
        return source
    if colon and rest and kind:
        return UserData(text)
    known = ["synthetic", "digits", "text:PATH", "text:stdlib", "jsonl:PATH", "FILE.py:FUNCTION"]
    close = difflib.get_close_matches(text.lower(), ["synthetic", "digits", "text:stdlib"], n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise OptionError(f"unknown --data {spec!r} (known: {', '.join(known)}); use one of them{hint}")


def load_digits(*, split_seed: int = 0) -> Digits:
    """scikit-learn's digits (bundled with it, no download), one in five samples held out by ``split_seed``.

    Raises: OptionError when scikit-learn is not installed.
    """
    try:
        from sklearn import datasets
    except ImportError:
        raise OptionError("--data digits reads the digits bundled with scikit-learn, which is not installed; "
                          "pip install -c constraints.txt -e '.[data]' (README.md)") from None
    bunch = datasets.load_digits()
    x = torch.from_numpy(bunch.data).to(torch.float32) / 16.0  # pixel counts 0..16
    y = torch.from_numpy(bunch.target).to(torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(split_seed))
    held = len(y) // DIGITS_HELDOUT
    heldout_index, train_index = order[:held].sort().values, order[held:].sort().values
    return Digits(x[train_index], y[train_index], x[heldout_index], y[heldout_index],
                  train_index, heldout_index, split_seed)


def load_text(path: str | Path, *, max_bytes: int | None = None) -> Text:
    """The bytes of the file at ``path`` (the first ``max_bytes``), the last 10% held out.

    Raises: OptionError for a missing, unreadable or empty file.
    """
    file = Path(path).expanduser()
    spec = f"text:{path}"
    size = regular_file(file, f"--data {spec}", MAX_TEXT_BYTES if max_bytes is None else None)
    try:
        with file.open("rb") as handle:
            raw = handle.read(min(size, max_bytes) if max_bytes is not None else size)
    except OSError as error:
        raise OptionError(f"--data {spec} cannot be read ({error.strerror}); check its permissions") from None
    if not raw:
        raise OptionError(f"--data {spec} is empty (bytes: 0); use a file with text in it")
    return _split_text(spec, (str(file),), raw)


MAX_TEXT_BYTES = 1 << 30  # text: is held in memory, one byte a token
MAX_JSONL_BYTES = 256 << 20  # jsonl: becomes a list of Python ints first (about 10x its bytes)


def regular_file(file: Path, what: str, max_bytes: int | None) -> int:
    """``file``'s size, once it is known to be a regular file of at most ``max_bytes``: a FIFO would block the
    read, a device (``/dev/zero``) never end it. OptionError (one line) naming ``what`` otherwise."""
    import os
    import stat

    try:
        st = os.stat(file)
    except FileNotFoundError:
        raise OptionError(f"{what}: no such file ({file.absolute()}); check the path") from None
    except OSError as error:
        raise OptionError(f"{what} cannot be read ({error.strerror}); check its permissions") from None
    if stat.S_ISDIR(st.st_mode):
        raise OptionError(f"{what} is a directory; name a file in it")
    if not stat.S_ISREG(st.st_mode):
        raise OptionError(f"{what} is not a regular file (a FIFO, device or socket), which could block or never end; "
                          "give a file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise OptionError(f"{what} is {st.st_size:,} bytes, more than the {max_bytes:,} fxpipe reads; give a smaller "
                          "file (or a Hugging Face dataset, hf:PATH)")
    return st.st_size


#: The fields of a JSON-lines object that hold its token ids (the first present is read)
JSONL_FIELDS = ("input_ids", "tokens", "ids")


def load_jsonl(path: str | Path) -> Text:
    """Token ids from a JSON-lines file: each line a list of ids (``[5, 17, 3]``) or an object holding them under
    one of ``JSONL_FIELDS`` (``{"input_ids": [5, 17, 3], ...}``; other fields are ignored). The documents are
    concatenated in order into one stream, the last 10% held out; the vocabulary is the largest id + 1.

    Raises: OptionError for a missing or unreadable file, a line that is not such a document (naming its
    number), a negative id, or no ids at all.
    """
    file = Path(path).expanduser()
    spec = f"jsonl:{path}"
    regular_file(file, f"--data {spec}", MAX_JSONL_BYTES)
    ids: list[int] = []
    try:
        with file.open("r", encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if line.strip():
                    ids += _jsonl_ids(line, spec, number)
    except OSError as error:
        raise OptionError(f"--data {spec} cannot be read ({error.strerror}); check its permissions") from None
    except UnicodeDecodeError as error:
        raise OptionError(f"--data {spec} is not UTF-8 text ({error.reason}); write one JSON document per line") \
            from None
    if not ids:
        raise OptionError(f"--data {spec} holds no token ids (lines: 0 with ids); write one JSON list of ids per line")
    tokens = torch.tensor(ids, dtype=torch.int64)
    held = len(tokens) // TEXT_HELDOUT
    cut = len(tokens) - held
    return Text(spec, (str(file),), tokens[:cut], tokens[cut:], vocab_size=int(tokens.max()) + 1)


HF_FORMATS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text"}
EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "[SEP]")


def load_hf(path: str, *, tokenizer: str | Path | None, column: str = "text") -> Text:
    """A Hugging Face dataset's ``column`` tokenized by a local tokenizer into one stream, the last 10% held out:
    each document's ids followed by the end-of-text token, so batches (windows of ``seq_len + 1`` tokens, labels
    the next tokens) are packed across documents. ``path``: a ``save_to_disk`` directory, a parquet / json /
    jsonl / csv / txt file or a directory of them (``datasets.load_dataset(format, data_files=...)``), else a hub
    name (where the network allows). ``tokenizer``: a ``tokenizer.json`` or a ``save_pretrained`` directory.

    Raises: OptionError (one line) without the ``hf`` extra, or for a missing dataset, column or tokenizer, a
    tokenizer without an end-of-text token, or an empty dataset.
    """
    spec = f"hf:{path}"
    try:
        import datasets
        import tokenizers
    except ImportError as exc:
        raise OptionError(f"--data {spec} needs the {exc.name} package; pip install -c constraints.txt -e '.[hf]' "
                          "(README.md)") from None
    if tokenizer is None:
        raise OptionError(f"--data {spec} is text; pass --tokenizer PATH (a tokenizer.json or a save_pretrained "
                          "directory) to turn it into token ids")
    tok_file = Path(tokenizer).expanduser()
    tok_file = tok_file / "tokenizer.json" if tok_file.is_dir() else tok_file
    if not tok_file.is_file():
        raise OptionError(f"--tokenizer {tokenizer}: no tokenizer.json there ({tok_file.absolute()}); give a "
                          "tokenizer.json or a directory a tokenizer was saved to with save_pretrained")
    try:
        tok = tokenizers.Tokenizer.from_file(str(tok_file))
    except Exception as exc:  # noqa: BLE001  (the Rust library raises its own exception type)
        raise OptionError(f"--tokenizer {tokenizer} does not load ({first_line(exc)}); give a tokenizer.json") \
            from None
    eos = next((tok.token_to_id(t) for t in EOS_TOKENS if tok.token_to_id(t) is not None), None)
    if eos is None:
        raise OptionError(f"--tokenizer {tokenizer} has no end-of-text token (none of {', '.join(EOS_TOKENS)}); "
                          "add one, e.g. special_tokens=['<|endoftext|>'] when training it")
    table = _hf_table(datasets, path, spec)
    if column not in table.column_names:
        raise OptionError(f"--data {spec} has no column {column!r} (columns: {', '.join(table.column_names)}); "
                          "name the text column with --data-column")
    if len(table) == 0:
        raise OptionError(f"--data {spec} holds no rows; give a dataset with text in {column!r}")
    ids: list[int] = []
    for start in range(0, len(table), 1024):
        texts = [t for t in table[start:start + 1024][column] if isinstance(t, str) and t]
        for encoding in tok.encode_batch(texts):
            ids += encoding.ids
            ids.append(eos)
    if not ids:
        raise OptionError(f"--data {spec} holds no text in column {column!r}; give a dataset with text there")
    tokens = torch.tensor(ids, dtype=torch.int64)
    cut = len(tokens) - len(tokens) // TEXT_HELDOUT
    return Text(spec, (str(path), str(tok_file)), tokens[:cut], tokens[cut:], vocab_size=tok.get_vocab_size())


def _hf_table(datasets: Any, path: str, spec: str) -> Any:
    """The dataset at ``path`` (its ``train`` split where it has splits)."""
    where = Path(path).expanduser()
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # its bars would break fxpipe's one-line errors and tables; put back below
    try:
        if where.is_dir() and any((where / f).is_file() for f in ("dataset_info.json", "state.json",
                                                                  "dataset_dict.json")):
            table = datasets.load_from_disk(str(where))
        elif where.exists():
            files = [where] if where.is_file() else sorted(f for f in where.iterdir() if f.suffix in HF_FORMATS)
            formats = {HF_FORMATS.get(f.suffix) for f in files}
            if not files or None in formats or len(formats) != 1:
                raise OptionError(f"--data {spec}: no dataset there (a save_to_disk directory, or files of one of "
                                  f"{', '.join(sorted(HF_FORMATS))}); check the path")
            table = datasets.load_dataset(formats.pop(), data_files=[str(f) for f in files], split="train")
        else:
            table = datasets.load_dataset(path, split="train")
    except OptionError:
        raise
    except Exception as exc:  # noqa: BLE001  (datasets raises many types: a missing hub name, a broken file)
        if "corresponds to no data" in str(exc):  # files with no rows
            raise OptionError(f"--data {spec} holds no rows; give a dataset with text in it") from None
        raise OptionError(f"--data {spec} does not load ({first_line(exc)}); give a local "
                          "dataset directory or file, or a hub name where the network allows") from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    if isinstance(table, datasets.DatasetDict):
        if "train" not in table:
            raise OptionError(f"--data {spec} has splits {', '.join(table)} and no train split; save the split to "
                              "train on")
        table = table["train"]
    return table


def _jsonl_ids(line: str, spec: str, number: int) -> list[int]:
    where = f"--data {spec} line {number}"
    try:
        doc = json.loads(line)
    except ValueError as error:
        raise OptionError(f"{where} is not JSON ({error}); write one JSON document per line") from None
    if isinstance(doc, dict):
        field = next((f for f in JSONL_FIELDS if f in doc), None)
        if field is None:
            raise OptionError(f"{where} has no token ids (fields: {', '.join(sorted(doc)[:5]) or 'none'}); put them "
                              f"under one of {', '.join(JSONL_FIELDS)}")
        doc = doc[field]
    if not isinstance(doc, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in doc):
        raise OptionError(f"{where} is not a list of integer token ids (got {type(doc).__name__}); write e.g. "
                          "[5, 17, 3] or {\"input_ids\": [5, 17, 3]}")
    if any(t < 0 for t in doc):
        raise OptionError(f"{where} has a negative token id ({min(doc)}); ids index a vocabulary from 0")
    if any(t >= 1 << 63 for t in doc):
        raise OptionError(f"{where} has a token id of {len(str(max(doc)))} digits, past 64 bits; ids index a "
                          "vocabulary from 0")
    return doc


def load_stdlib_text(*, max_bytes: int = STDLIB_MAX_BYTES) -> Text:
    """``STDLIB_FILES`` from this Python's standard library, concatenated in order and cut at ``max_bytes``.

    The same on every machine with the same Python version. Raises: OptionError when none is found (a
    Python installed without its sources).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[bytes] = []
    files: list[str] = []
    size = 0
    for name in STDLIB_FILES:
        if size >= max_bytes:
            break
        file = root / name
        if not file.is_file():
            continue
        data = file.read_bytes()[:max_bytes - size]
        parts.append(data)
        files.append(str(file))
        size += len(data)
    if not parts:
        raise OptionError(f"--data text:stdlib found none of its files in {root} (a Python without its "
                          "sources?); use --data text:PATH with any text file")
    return _split_text("text:stdlib", tuple(files), b"".join(parts))


def _split_text(spec: str, files: tuple[str, ...], raw: bytes) -> Text:
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    held = len(data) // TEXT_HELDOUT
    cut = len(data) - held
    return Text(spec, files, data[:cut], data[cut:])


# --------------------------------------------------------------------------------------------- fitting


@dataclass(frozen=True)
class Fit:
    """How a source's batches must look for a model: ``layout`` (flat, image, tokens), dtype and ``seq_len``."""

    spec: str
    layout: str
    dtype: torch.dtype
    seq_len: int | None = None


def check_fit(source: DataSource, example_inputs: Sequence[Any], output_shape: Sequence[int] | None) -> Fit:
    """How ``source`` feeds a model compiled for ``example_inputs`` whose output is ``output_shape``.

    digits takes one float input ``(B, 64)`` (an MLP) or ``(B, 1, 8, 8)`` (a CNN) and 10 outputs ``(B, 10)``;
    text takes one integer input ``(B, T)`` and logits ``(B, T, V)`` with ``V >= 256``, and its batches then
    have ``seq_len = T``; synthetic takes anything. The output shape is cheap to get on the meta device:

        zoo = fxpipe.models.build("mlp-small", device="meta")
        check_fit(parse_data("digits"), zoo.example_inputs, zoo.model(*zoo.example_inputs).shape)

    ``output_shape`` None checks the inputs only (a rank, after the launcher checked the whole).

    Raises: OptionError, one line naming what the model takes and the zoo models to use instead.
    """
    if isinstance(source, Synthetic):
        return Fit(source.spec, "synthetic", _first_dtype(example_inputs))
    inputs = [tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in example_inputs]
    takes = f"takes {', '.join(map(str, inputs)) or 'no inputs'}"
    out = tuple(int(d) for d in output_shape) if output_shape is not None else None
    if isinstance(source, Digits):
        instead = (f"use {' or '.join(DIGITS_ZOO)}; the zoo has no CNN for 1x8x8 images yet (a model of your "
                   "own that takes (B, 1, 8, 8) works)")
        x = example_inputs[0] if len(example_inputs) == 1 else None
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise OptionError(f"digits gives one float input, (B, 64) or (B, 1, 8, 8), but the model {takes}"
                              f"{_dtypes(example_inputs)}; {instead}")
        shape = tuple(x.shape[1:])
        if shape not in ((DIGITS_FEATURES,), (1, 8, 8)):
            raise OptionError(f"digits gives (B, 64) features or (B, 1, 8, 8) images, but the model {takes}; "
                              f"{instead}")
        if out is not None and out[1:] != (DIGITS_CLASSES,):
            raise OptionError(f"digits has 10 classes and needs logits (B, 10), but the model gives {out}; "
                              f"{instead}")
        return Fit(source.spec, "flat" if len(shape) == 1 else "image", x.dtype)
    byte = source.spec.startswith("text:")
    instead = f"use {', '.join(TEXT_ZOO)} (vocabulary 256 or more)" if byte else \
        f"use a language model with {source.vocab_size} or more logits per token"
    x = example_inputs[0] if len(example_inputs) == 1 else None
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.is_floating_point() or x.dtype == torch.bool:
        raise OptionError(f"{source.spec} gives one int64 input of {'byte' if byte else 'token'} ids (B, T), but the "
                          f"model {takes}{_dtypes(example_inputs)}; {instead}")
    seq_len = int(x.shape[1])
    if out is None:  # a rank: the launcher checked the output
        source.check_seq_len(seq_len)
        return Fit(source.spec, "tokens", torch.int64, seq_len)
    if len(out) != 3 or out[1] != seq_len:
        raise OptionError(f"{source.spec} needs next-{'byte' if byte else 'token'} logits (B, {seq_len}, V), but the "
                          f"model gives {out}; {instead}")
    if out[2] < source.vocab_size:
        what = f"is bytes (vocabulary {source.vocab_size})" if source.spec.startswith("text:") else \
            f"has token ids up to {source.vocab_size - 1} (vocabulary {source.vocab_size})"
        raise OptionError(f"{source.spec} {what}, but the model's vocabulary is {out[2]}; {instead}")
    source.check_seq_len(seq_len)
    return Fit(source.spec, "tokens", torch.int64, seq_len)


def index_bounds(fn: Callable[..., Any], inputs: Sequence[Any]) -> tuple[Any, dict[int, int]]:
    """``fn(*inputs)``'s output and, for each integer input that an embedding indexes as it is (or through views
    of it: a Hugging Face model's ``input_ids.view(-1, T)``), the table's rows: that input's values must lie in
    ``[0, rows)`` (a GPT's token ids and its vocabulary).

    Cheap on the meta device (nothing is computed); an input that feeds no embedding this way is absent.
    """
    from fxpipe._compat import TorchDispatchMode

    positions = {id(x): i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and not x.is_floating_point()}
    bounds: dict[int, int] = {}
    keep: list[torch.Tensor] = []

    class _Embeddings(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.embedding.default and len(args) >= 2 and id(args[1]) in positions:
                i = positions[id(args[1])]
                bounds[i] = min(bounds.get(i, args[0].shape[0]), int(args[0].shape[0]))
            out = func(*args, **(kwargs or {}))
            if func.is_view and args and isinstance(out, torch.Tensor) and id(args[0]) in positions:
                positions[id(out)] = positions[id(args[0])]  # a view of an input holds its values
                keep.append(out)  # alive, so that its id is not reused
            return out

    with torch.no_grad(), _Embeddings():
        output = fn(*inputs)
    return output, bounds


# --------------------------------------------------------------------------------------------- helpers


def held_out_batches(source: DataSource, batch_size: int, *, seq_len: int | None = None, max_batches: int = 16,
                     layout: DigitsLayout = "flat", dtype: torch.dtype = torch.float32,
                     shard: tuple[int, int] = (0, 1)) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The held-out split as whole batches of ``batch_size`` rows, in order, at most ``max_batches``: a text's
    consecutive windows of ``seq_len + 1`` tokens (target: the next tokens), digits' held-out samples.
    ``shard=(d, n)``: replica d's rows of each. What ``fxpipe run --eval-every`` scores.

    Raises: OptionError when the split holds less than one batch.
    """
    if isinstance(source, Text):
        if seq_len is None:
            raise OptionError(f"{source.spec}'s held-out batches need the sequence length; pass seq_len")
        windows = (len(source.heldout) - 1) // seq_len
        count = min(max_batches, windows // batch_size)
        offsets = torch.arange(seq_len + 1)
        out = []
        for b in range(count):
            rows = _shard(torch.arange(b * batch_size, (b + 1) * batch_size), shard)
            chunk = source.heldout[rows[:, None] * seq_len + offsets].to(torch.int64)
            out.append((chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()))
        what, have = f"{windows} windows of {seq_len + 1} tokens", windows
    elif isinstance(source, Digits):
        count = min(max_batches, len(source.heldout_y) // batch_size)
        out = []
        for b in range(count):
            rows = _shard(torch.arange(b * batch_size, (b + 1) * batch_size), shard)
            out.append((_shape(source.heldout_x[rows], layout, dtype), source.heldout_y[rows]))
        what, have = f"{len(source.heldout_y)} samples", len(source.heldout_y)
    else:
        raise OptionError(f"{getattr(source, 'spec', source)} has no held-out split to evaluate on; use digits, "
                          "text:, jsonl: or hf: data")
    if not out:
        raise OptionError(f"{source.spec}'s held-out split holds {what}, less than one batch of {batch_size} rows "
                          f"(have {have}); use more data or a smaller batch")
    return out


def step_seed(seed: int, step: int, rank: int) -> int:
    """The seed of torch's generator on ``rank`` for ``step`` (dropout and other random ops in the stage graphs): a
    function of ``(seed, step, rank)`` alone, so identical command lines, and a resumed run, draw the same masks."""
    return _mix(_mix(seed, step), rank)


def _mix(seed: int, index: int) -> int:
    """A 63-bit generator seed from ``(seed, index)`` (splitmix64), so neighbouring pairs do not collide."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + index + 0x632BE59BD9B4E019) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _epoch_order(size: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(size, generator=torch.Generator().manual_seed(_mix(seed, epoch)))


def _padded_batches(total: int, batch_size: int) -> Iterator[tuple[torch.Tensor, int]]:
    """Rows ``0..total-1`` in batches of ``batch_size``, the last filled up from row 0 on; yields (rows, real)."""
    for first in range(0, total, batch_size):
        real = min(batch_size, total - first)
        rows = torch.arange(first, first + batch_size)
        rows[real:] = torch.arange(batch_size - real) % total
        yield rows, real


def _shape(x: torch.Tensor, layout: str, dtype: torch.dtype) -> torch.Tensor:
    if not dtype.is_floating_point:
        raise OptionError(f"digits' features are floating point (dtype: {dtype}); "
                          "pass torch.float32, torch.float64, torch.bfloat16 or torch.float16")
    if layout == "flat":
        return x.to(dtype)
    if layout == "image":
        return x.reshape(-1, 1, 8, 8).to(dtype)
    raise OptionError(f"unknown digits layout {layout!r} (known: flat, image); use flat for an MLP, image for a CNN")


def _check_batch_size(batch_size: int, size: int | None, what: str) -> None:
    if batch_size < 1:
        raise OptionError(f"batch size must be at least 1 (batch_size: {batch_size}); raise it")
    if size is not None and batch_size > size:
        raise OptionError(f"batch size exceeds {what} (batch_size: {batch_size}, samples: {size}); lower it")


def _shard(rows: torch.Tensor, shard: tuple[int, int]) -> torch.Tensor:
    """The d-th of n equal parts of ``rows`` (``shard=(d, n)``)."""
    d, n = shard
    if not 0 <= d < n or len(rows) % n:
        raise OptionError(f"a batch of {len(rows)} rows does not split into {n} equal shards with shard {d} among "
                          f"them; pass a batch that is a multiple of {n} and 0 <= shard < {n}")
    size = len(rows) // n
    return rows[d * size:(d + 1) * size]


def _check_start(step: int) -> None:
    if step < 0:
        raise OptionError(f"batch steps count from 0 (step: {step}); pass a step >= 0")


def _tensor_output(output: Any, spec: str) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)  # a Hugging Face ModelOutput
    if isinstance(logits, torch.Tensor):
        return logits
    raise OptionError(f"{spec} scores a model's logits tensor, but it returned {type(output).__name__}; "
                      "return the logits")


def _first_dtype(example_inputs: Sequence[Any]) -> torch.dtype:
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.dtype
    return torch.float32


def _dtypes(example_inputs: Sequence[Any]) -> str:
    dtypes = [str(x.dtype).removeprefix("torch.") for x in example_inputs if isinstance(x, torch.Tensor)]
    return f" of {', '.join(dtypes)}" if dtypes else ""


def _count(start: int) -> Iterator[int]:
    while True:
        yield start
        start += 1
