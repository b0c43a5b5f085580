"""The fastest of several runs: how fxpipe times a piece of work on a machine others share.

Interference from other jobs only ever adds time, so the minimum over runs is the measurement it
disturbed least.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

__all__ = ["fastest", "least_disturbed", "windows"]


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


def least_disturbed(runs: Sequence[Sequence[float]]) -> float:
    """The smallest of the runs' medians: each run's typical value (a median, robust to its own outliers),
    from the run another job on the machine disturbed least (another job only ever adds time, and under
    load every run's median rises: a median over all runs measures the load, not what is measured)."""
    return min(statistics.median(run) for run in runs if run)


def typical(runs: Sequence[Sequence[float]]) -> float:
    """The median of the runs' medians: what a run typically takes, for costs a run pays at whatever speed the
    machine then has (where :func:`least_disturbed` keeps the quietest run's)."""
    return statistics.median(statistics.median(run) for run in runs if run)


def windows(times: Sequence[float], size: int) -> list[Sequence[float]]:
    """``times`` in consecutive windows of ``size`` (the last may be shorter), for :func:`least_disturbed`."""
    return [times[i:i + size] for i in range(0, len(times), size)]
