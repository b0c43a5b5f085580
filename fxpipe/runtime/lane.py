"""A second lane for W: a rank's weight-gradient work on a thread of its own, beside its F and B (LayerPipe's W apart
from B, on CPU ranks).

The rank's main thread runs its F, B, sends and receives in the schedule's order; each W is handed to one worker
thread, which runs them in that order too, so the gradients add up exactly as on one lane. W computes while the main
thread waits for a message (a bubble) or shares the core with it; whoever reads W's gradients (an optimizer step, the
step's end) joins the lane first. torch's kernels release the GIL, so the two threads compute at once where a core is
free.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any


class WLane:
    """One worker thread running the callables it is given in order; :meth:`join` waits for all of them and lets the
    thread go (the next :meth:`submit` starts another), so a lane holds no thread between steps."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[Any]] = []

    def submit(self, fn: Callable[[], Any]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fxpipe-w")
        self._pending.append(self._pool.submit(fn))

    def join(self) -> list[Any]:
        """Every submitted callable's result, in order, once all have ended (the first one's error, raised then)."""
        pending, self._pending = self._pending, []
        wait(pending)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        return [f.result() for f in pending]


def refusal(*, synchronous: bool, dp: int, tied: bool, global_norm: bool, device: str, batched: bool) -> str | None:
    """Why a run cannot put its W's on a second lane (None: it can): what reads W's gradients, or where, must be this
    rank's own step end or optimizer step, on a CPU."""
    why = ("an asynchronous schedule's update after each W would race the next F" if not synchronous
           else "replicas sum each bucket's gradients as its last W ends" if dp > 1
           else "tied weights across ranks are summed after the last W" if tied
           else "clipping and fp16 read every gradient's norm" if global_norm
           else "CUDA ranks keep one stream (and CUDA graphs)" if device != "cpu"
           else "the schedule batches its W's" if batched else None)
    return None if why is None else (f"--w-lane runs each W on a second thread of a CPU rank, and here {why}: run it "
                                     "without --w-lane")
