"""``fxpipe run --config FILE`` and ``--log-dir DIR``: the run's options as TOML, and its per-step metrics.

``DIR/config.toml`` is the run's :class:`~fxpipe.cli.run_config.RunConfig` as TOML (``fxpipe.cli.config``
reads and writes it), so ``--config DIR/config.toml`` runs the same training again.

``DIR/metrics.jsonl`` gets one JSON line per finished step from rank 0 (:class:`StepLog`): every rank's
peak memory and step time reach it in one all-reduce per step, issued right after the step and read when
its loss is. TensorBoard scalars go beside it when ``tensorboard`` is installed
(``pip install -c constraints.txt -e '.[tensorboard]'``).
"""

from __future__ import annotations

import json
import math
import os
import resource
from pathlib import Path
from typing import Any

from fxpipe.cli.config import MARK  # the first line of every config.toml fxpipe writes (one it may replace)

CONFIG = "config.toml"
METRICS = "metrics.jsonl"


MAX_METRICS_BYTES = 256 << 20  # a resumed run reads its metrics.jsonl back
def is_own_config(config: Path | None, log_dir: Path | None) -> bool:
    """``config`` is ``log_dir``'s own config.toml, written by fxpipe run: running it again as written reuses the
    directory (the file is rewritten with the values it was read for)."""
    if config is None or log_dir is None:
        return False
    mine = log_dir / CONFIG
    try:
        same = mine.is_file() and not mine.is_symlink() and os.path.samefile(config, mine)
    except OSError:
        return False
    return same and _ours(mine)


def check_log_dir(log_dir: Path, *, continuing: bool, rerun: bool = False) -> None:
    """Before any rank starts: ``log_dir`` may be made, and holds no file fxpipe run may not replace (a config.toml
    it did not write; a metrics.jsonl of another run, unless this one resumes it). ``rerun``: the run is the
    directory's own config.toml again, so an earlier metrics.jsonl is kept beside it as ``metrics.N.jsonl``."""
    from fxpipe.cli.common import check_writable_dir
    from fxpipe.errors import OptionError

    if log_dir.exists() and not log_dir.is_dir():
        raise OptionError(f"--log-dir {str(log_dir)!r} is a file; name a directory")
    check_writable_dir(log_dir, "--log-dir")
    config = log_dir / CONFIG
    if config.is_symlink() or (config.exists() and not _ours(config)):
        raise OptionError(f"--log-dir {str(log_dir)!r} holds a {CONFIG} that fxpipe run did not write; move it, or "
                          "choose another --log-dir")
    metrics = log_dir / METRICS
    if metrics.is_symlink() or (metrics.exists() and not metrics.is_file()):
        raise OptionError(f"--log-dir {str(log_dir)!r} holds a {METRICS} that is a link or not a regular file, which "
                          "fxpipe does not write through; move it, or choose another --log-dir")
    if rerun and not continuing and metrics.is_file() and not metrics.is_symlink():
        _keep_aside(metrics)
    if (metrics.exists() or metrics.is_symlink()) and not continuing:
        raise OptionError(f"--log-dir {str(log_dir)!r} holds the {METRICS} of an earlier run; choose another "
                          "--log-dir, or resume that run (--checkpoint-dir with --resume auto) to continue its log")


def _keep_aside(metrics: Path) -> Path:
    """``metrics`` renamed to the first free ``metrics.N.jsonl`` beside it (a hard link made without replacing
    anything, then the old name removed): an earlier run's log is never overwritten."""
    for n in range(1, 10_000):
        kept = metrics.with_name(f"{metrics.stem}.{n}{metrics.suffix}")
        try:
            os.link(metrics, kept, follow_symlinks=False)
        except FileExistsError:
            continue
        metrics.unlink()
        return kept
    from fxpipe.errors import OptionError

    raise OptionError(f"--log-dir {str(metrics.parent)!r} holds 9,999 earlier logs; choose another --log-dir")


def absolute_spec(spec: str | None) -> str | None:
    """A ``--data`` or ``--loss`` spec with its file made absolute (``text:PATH``, ``jsonl:PATH``, ``hf:PATH`` of an
    existing path, ``FILE.py:FUNCTION``), so a config file runs from any directory; other specs as they are."""
    if spec is None:
        return None
    kind, colon, rest = spec.partition(":")
    if colon and kind in ("text", "jsonl", "hf") and rest != "stdlib" and Path(rest).expanduser().exists():
        return f"{kind}:{os.path.abspath(Path(rest).expanduser())}"
    where, colon, attr = spec.rpartition(":")
    if colon and where.endswith(".py"):
        return f"{os.path.abspath(Path(where).expanduser())}:{attr}"
    return spec


def _ours(path: Path) -> bool:
    """Whether ``path`` is a config.toml fxpipe run wrote: a regular file (never opened otherwise: a FIFO would
    block) whose first line is ``MARK``."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline().startswith(MARK)
    except OSError:
        return False


def write_config(log_dir: Path, text: str) -> Path:
    """``log_dir/config.toml`` (made with its directory, ``text`` from ``RunConfig.to_toml``), replaced whole: a
    reader never sees half of it."""
    from fxpipe.files import write_file

    log_dir.mkdir(parents=True, exist_ok=True)
    return write_file(log_dir / CONFIG, text, what="--log-dir's config", ours=_ours)


def tensorboard_missing() -> bool:
    """Whether TensorBoard's writer cannot be imported (the ``tensorboard`` extra is not installed)."""
    import importlib.util

    return importlib.util.find_spec("tensorboard") is None


class StepLog:
    """Rank 0's record of a run, one line per finished step; every rank takes part in :meth:`share`.

    ``samples`` and ``tokens`` (None: the inputs are not token ids) are one step's, the whole batch's over
    every replica. ``first`` is the step the run starts after (a resumed run's checkpoint): lines of later
    steps left by a killed attempt are dropped, so the file holds each step once.
    """

    def __init__(self, log_dir: Path | None, *, rank: int, world: int, device: Any, samples: int,
                 tokens: int | None, first: int) -> None:
        self.dir, self.rank, self.world, self.device = log_dir, rank, world, device
        self.samples, self.tokens = samples, tokens
        self.board: Any = None
        if log_dir is None or rank != 0:
            return
        metrics = log_dir / METRICS
        if metrics.exists() or metrics.is_symlink():  # this run's own log: keep the steps up to its checkpoint
            from fxpipe.data import regular_file
            from fxpipe.files import write_file

            regular_file(metrics, f"--log-dir's {METRICS}", MAX_METRICS_BYTES)
            kept = [ln for ln in metrics.read_text().splitlines() if _step_of(ln) is not None
                    and _step_of(ln) <= first]  # type: ignore[operator]
            write_file(metrics, "".join(ln + "\n" for ln in kept), what=f"--log-dir's {METRICS}", ours=lambda p: True)
        if not tensorboard_missing():
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(str(log_dir), purge_step=first + 1 if first else None)

    @property
    def on(self) -> bool:
        return self.dir is not None

    def peak_bytes(self) -> int:
        """This rank's peak memory so far: the process's peak RSS on the CPU, the allocator's peak on CUDA."""
        import torch

        if getattr(self.device, "type", "cpu") == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    def share(self, ms: float) -> Any:
        """Start the all-reduce that brings every rank's peak memory and ``ms`` to every rank (None when not
        logging); collective, in the same place on every rank."""
        if self.dir is None:
            return None
        import torch
        import torch.distributed as dist

        shared = torch.zeros(2 * self.world, dtype=torch.float64)
        shared[self.rank], shared[self.world + self.rank] = float(self.peak_bytes()), ms
        work = dist.all_reduce(shared, async_op=True) if dist.is_initialized() and self.world > 1 else None
        return work, shared

    def write(self, step: int, loss: float, lr: Any, grad_norm: Any, shared: Any, eval_loss: float | None = None,
              skipped: bool = False) -> None:
        """Rank 0 appends step ``step``'s line (and its TensorBoard scalars); the others only wait for ``shared``.
        ``eval_loss``: the held-out loss after the step, where it was evaluated (``--eval-every``); ``skipped``: its
        update was skipped (``--skip-nonfinite``), said as ``"skipped": true``."""
        if shared is None:
            return
        work, values = shared
        if work is not None:
            work.wait()
        if self.rank != 0 or self.dir is None:
            return
        vals = values.tolist()
        ms = max(vals[self.world:])
        per_s = 1e3 / ms if ms > 0 else None
        record = {"step": step, "loss": _number(loss), "lr": _number(lr), "grad_norm": _number(grad_norm),
                  "step_ms": ms, "samples_per_s": self.samples * per_s if per_s else None,
                  "tokens_per_s": self.tokens * per_s if per_s and self.tokens else None,
                  "peak_memory_mib": [v / 2**20 for v in vals[:self.world]],
                  "memory": "cuda_max_allocated" if getattr(self.device, "type", "cpu") == "cuda" else "rss"}
        if eval_loss is not None:
            record["eval_loss"] = _number(eval_loss)
        if skipped:
            record["skipped"] = True
        from fxpipe.files import append_line

        # one write per line: a killed run keeps every finished step; never through a link
        append_line(self.dir / METRICS, json.dumps(record, allow_nan=False, default=str) + "\n")
        if self.board is not None:
            for name in ("loss", "lr", "grad_norm", "step_ms", "samples_per_s", "tokens_per_s"):
                if record[name] is not None:
                    self.board.add_scalar(f"train/{name}", record[name], step)
            self.board.add_scalar("train/peak_memory_mib_max", max(record["peak_memory_mib"]), step)
            if record.get("eval_loss") is not None:
                self.board.add_scalar("eval/loss", record["eval_loss"], step)
            self.board.flush()

    def close(self) -> None:
        if self.board is not None:
            self.board.close()


def token_ids(spec: Any) -> bool:
    """Whether a model input (``plan.TensorSpec``) is token ids: integers of (batch, sequence, ...)."""
    return len(spec.shape) >= 2 and any(t in str(spec.dtype) for t in ("int64", "int32", "long"))


def _number(value: Any) -> float | None:
    """A float for JSON (a tensor's item), or None when absent or not finite."""
    if value is None:
        return None
    x = float(value)
    return x if math.isfinite(x) else None


def _step_of(line: str) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None
