"""The fastest of several runs: how fxpipe times a piece of work on a machine others share.

Interference from other jobs only ever adds time, so the minimum over runs is the measurement it
disturbed least.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

__all__ = ["fastest"]


def fastest(fn: Callable[[], object], runs: int) -> float:
    """Seconds of the fastest of ``runs`` calls of ``fn``, after one untimed call (first-touch pages, kernel
    selection)."""
    fn()
    best = math.inf
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
