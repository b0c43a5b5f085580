"""The fastest of several runs: how fxpipe times a piece of work on a machine others share.

Interference from other jobs only ever adds time, so the minimum over runs is the measurement it
disturbed least.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch

__all__ = ["fastest", "least_disturbed", "mixed_loop", "windows"]


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


def windows(times: Sequence[float], size: int) -> list[Sequence[float]]:
    """``times`` in consecutive windows of ``size`` (the last may be shorter), for :func:`least_disturbed`."""
    return [times[i:i + size] for i in range(0, len(times), size)]


def mixed_loop(*, seed: int = 0, matmul: int = 256, matmul_reps: int = 20, stream_bytes: int = 8 << 20,
               stream_reps: int = 4) -> Callable[[], float]:
    """A fixed piece of work, returned as a call that runs it once and returns its seconds: ``matmul_reps`` products
    of two ``matmul`` x ``matmul`` float32 matrices (cache-resident), then ``stream_reps`` in-place adds of two
    ``stream_bytes`` tensors (``matmul`` or ``matmul_reps`` 0: the adds alone). ``fxpipe.runtime.calibrate`` times it on
    every rank alone and at once (contention); the compute calibration times it too, so that a run can say how fast
    the machine is now against when its plan's rates were measured (``ComputeRates.loop_s``)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(matmul, matmul, generator=gen)
    b = torch.randn(matmul, matmul, generator=gen)
    out = torch.empty(matmul, matmul)
    acc = torch.zeros(max(1, stream_bytes // 4))
    grad = torch.full_like(acc, 1e-3)

    def loop() -> float:
        t0 = time.perf_counter()
        for _ in range(matmul_reps):
            torch.mm(a, b, out=out)
        for _ in range(stream_reps):
            acc.add_(grad)
        return time.perf_counter() - t0

    return loop
