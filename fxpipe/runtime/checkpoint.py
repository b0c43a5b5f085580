"""Checkpoints of a rank's state: one file per rank, written atomically, loaded as tensors only."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from fxpipe.errors import RankFailedError


def save(rt: Any, directory: str | os.PathLike[str], step: int) -> Path:
    """Write ``rt.state_dict()`` to ``directory/rank{R}.pt`` atomically (a temporary file, then a rename)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    final = path / f"rank{rt.rank}.pt"
    tmp = path / f".rank{rt.rank}.pt.tmp"
    torch.save({"step": step, **rt.state_dict()}, tmp)
    os.replace(tmp, final)  # a crash before this line leaves the previous checkpoint whole
    return final


def load(rt: Any, directory: str | os.PathLike[str]) -> int:
    """Load ``directory/rank{R}.pt`` into ``rt``; returns the step it was saved after."""
    file = Path(directory) / f"rank{rt.rank}.pt"
    if not file.is_file():
        raise RankFailedError(f"no checkpoint for rank {rt.rank} in {directory} (missing {file.name}); "
                              "start without --resume or point --checkpoint-dir at a run's checkpoints")
    state = torch.load(file, weights_only=False)
    rt.load_state_dict(state)
    return int(state["step"])
