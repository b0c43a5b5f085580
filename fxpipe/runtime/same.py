"""Whether every rank runs the same program: one all-gather of a digest per entry, at start.

Ranks started apart (a node with a stale plan, another ``--microbatches``, a search run on each rank from its own
timings) post different messages and collectives and wait on each other until the timeout, or train apart. A
runtime compares ``(what, value)`` entries across ranks before its first collective, and names the first rank and
entry that differ from this rank's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["differing_rank", "first_difference", "gathered", "hash64"]


def hash64(text: str) -> int:
    """A signed 64-bit digest of ``text`` (sha256's first 8 bytes): what ranks compare."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def gathered(row: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``row`` (the same shape and dtype on every rank), in rank order; collective over the world."""
    got = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(got, row)
    return got


def first_difference(mine: Sequence[int], others: Sequence[Sequence[int]]) -> tuple[int, int] | None:
    """(rank, index) of the first rank whose digests differ from ``mine``, at its first differing entry; None.

    >>> first_difference([1, 2], [[1, 2], [1, 3]]), first_difference([1, 2], [[1, 2], [1, 2]])
    ((1, 1), None)
    """
    for q, theirs in enumerate(others):
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if a != b:
                return q, i
    return None


def differing_rank(items: Sequence[tuple[str, str]]) -> tuple[int, str, str] | None:
    """Compare ``items`` (``(what, value)``, the same whats in the same order on every rank) across the world's
    ranks; collective. ``(rank, what, this rank's value)`` for the first rank that differs from this one, else None.
    The same number of entries on every rank (the all-gather needs equal sizes)."""
    mine = torch.tensor([hash64(value) for _, value in items], dtype=torch.int64)
    found = first_difference(mine.tolist(), [g.tolist() for g in gathered(mine)])
    if found is None:
        return None
    q, i = found
    return q, items[i][0], items[i][1]
