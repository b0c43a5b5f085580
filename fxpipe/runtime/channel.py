"""One rank's point-to-point messages: asynchronous isend/irecv, on CPU and on CUDA.

On CPU (gloo) a send is an ``isend`` of the tensor itself and a receive an ``irecv`` into a buffer
allocated from the plan's shapes; streams are no-ops.

On CUDA the rank computes on its current stream and moves data on a communication stream of its
own, ordered by events, so copies overlap compute:

* NCCL sends and receives device tensors directly (NCCL orders its own stream after the current one
  at ``isend`` and makes the current stream wait at ``wait``).
* gloo cannot read device memory, so a message is staged through pinned host memory: the
  device-to-host copy runs on the communication stream after an event recorded on the compute
  stream, and the ``isend`` is issued once that copy's event completes (checked at each
  ``poll``, forced at ``flush``), so the compute thread never waits for it; a receive lands in
  pinned memory and is copied to the device on the communication stream, which the compute stream
  then waits for.

Tag-blind (``tag_blind``, always under NCCL, which ignores tags): every message between two ranks carries
one tag, so a pair's messages match first in, first out; the lowering posts each rank's receives in its
senders' order (``fxpipe.runtime.lower``). Sends are then held back and posted together with the next
receives in one ``batch_isend_irecv`` (NCCL runs a pair's sends and receives on one stream: two ranks that
each send before they receive would wait for each other, so the crossing pair goes out as one group).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class Received:
    """A posted receive: ``buf`` fills when ``work`` completes."""

    __slots__ = ("buf", "src", "work")

    def __init__(self, buf: torch.Tensor, work: Any, src: int) -> None:
        self.buf, self.work, self.src = buf, work, src


def backend_of(device: torch.device) -> str:
    """The process group's backend for ``device``'s tensors: ``nccl`` or ``gloo`` (a group started without a backend
    runs both, ``cpu:gloo,cuda:nccl``)."""
    name = str(dist.get_backend())
    if ":" in name:
        kinds = dict(part.split(":", 1) for part in name.split(","))
        name = kinds.get(device.type, kinds.get("cpu", name))
    return name


class Channel:
    def __init__(self, device: torch.device, timeout: timedelta | None = None, *,
                 yield_after_send: bool = False, tag_blind: bool | None = None) -> None:
        self.device = device
        self.timeout = timeout
        cuda = device.type == "cuda"
        nccl = backend_of(device) == "nccl"
        self.staged = cuda and not nccl  # gloo: through pinned host memory
        # One tag per pair (None: where the backend ignores tags, NCCL); sends wait to go out with the next receives.
        self.tag_blind = nccl if tag_blind is None else tag_blind
        self.batched = self.tag_blind and not self.staged
        self.pending: list[tuple[dist.P2POp, Received | None, int]] = []  # batched: (op, its receive, dst)
        if self.batched and nccl:  # every rank starts the group's NCCL communicator here, not in its first batch of
            dist.all_reduce(torch.zeros(1, device=device))  # sends and receives (batch_isend_irecv's caveat)
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.in_flight: list[tuple[Any, torch.Tensor, int]] = []  # (work, tensor kept alive, dst)
        self.copying: list[tuple[Any, torch.Tensor, int, int]] = []  # staged: (event, host, dst, tag)
        # gloo, where asked: yield the core once after each isend, so the socket thread can send it now rather than
        # when this rank next blocks (HostTuning.send_yield, fxpipe.calibration.threads.send_yields)
        self.yield_after_send = yield_after_send and not nccl

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int,
             buf: torch.Tensor | None = None, on_error: Callable[[Exception], BaseException] | None = None) -> Received:
        """Post a receive, into ``buf`` (a previous step's buffer for this message) or a new one. gloo refuses to post
        to a peer whose connection has closed: that error becomes ``on_error``'s, as a failed wait's does."""
        if buf is None and self.staged:
            buf = torch.empty(shape, dtype=dtype, pin_memory=True)
        elif buf is None:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
        if self.batched:
            item = Received(buf, None, src)
            self.pending.append((dist.P2POp(dist.irecv, buf, src, tag=0), item, -1))
            return item
        try:
            return Received(buf, dist.irecv(buf, src, tag=0 if self.tag_blind else tag), src)
        except Exception as exc:
            if on_error is None:
                raise
            raise on_error(exc) from exc

    def issue(self) -> None:
        """Batched: post the held sends and receives, in order, as one ``batch_isend_irecv``."""
        if not self.pending:
            return
        ops = [op for op, _, _ in self.pending]
        works = dist.batch_isend_irecv(ops)
        for k, (op, item, dst) in enumerate(self.pending):
            work = works[k] if len(works) == len(ops) else works[-1]  # NCCL: one work for the coalesced group
            if item is not None:
                item.work = work
            else:
                self.in_flight.append((work, op.tensor, dst))
        self.pending.clear()

    def wait(self, item: Received, on_error: Callable[[Exception], BaseException]) -> torch.Tensor:
        """The received tensor on this rank's device, ready for the compute stream."""
        # Staged sends still copying to the host go out first: a rank that blocks on a receive while holding
        # a message back can wait for a peer that waits for that message (1f1b, gpt-medium on one GPU: rank 0
        # held F3's activation waiting for B2's gradient, which rank 1 sends only after F3).
        self.issue_staged()
        self.issue()
        try:
            item.work.wait() if self.timeout is None else item.work.wait(self.timeout)
        except Exception as exc:
            raise on_error(exc) from exc
        if not self.staged:
            return item.buf
        assert self.stream is not None
        with torch.cuda.stream(self.stream):
            out = item.buf.to(self.device, non_blocking=True)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(self.stream)
        out.record_stream(compute)
        return out

    def send(self, tensor: torch.Tensor, dst: int, tag: int,
             on_error: Callable[[Exception, int], BaseException] | None = None) -> None:
        """Send ``tensor`` to ``dst``; a send gloo refuses to post (the peer's connection closed) raises ``on_error``'s
        error, as a failed completion does in :meth:`flush`."""
        tensor = tensor.detach().contiguous()
        if self.batched:
            self.pending.append((dist.P2POp(dist.isend, tensor, dst, tag=0), None, dst))
            return
        if not self.staged:
            try:
                self._isend(tensor, dst, tag)
            except Exception as exc:
                if on_error is None:
                    raise
                raise on_error(exc, dst) from exc
            return
        assert self.stream is not None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        tensor.record_stream(self.stream)
        self.copying.append((copied, host, dst, tag))
        self.poll()

    def poll(self) -> None:
        """Issue the staged sends whose device-to-host copies are done (in order)."""
        while self.copying and self.copying[0][0].query():
            _, host, dst, tag = self.copying.pop(0)
            self._isend(host, dst, tag)

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        """Post the ``isend`` of ``tensor`` (kept alive until it completes), then, where this rank yields after a
        send, give up the core once so gloo's socket thread can send it while this rank computes on."""
        self.in_flight.append((dist.isend(tensor, dst, tag=0 if self.tag_blind else tag), tensor, dst))
        if self.yield_after_send:
            os.sched_yield()

    def issue_staged(self) -> None:
        """Issue every staged send, waiting for the device-to-host copies still running (in order)."""
        for copied, host, dst, tag in self.copying:
            copied.synchronize()
            self.in_flight.append((dist.isend(host, dst, tag=0 if self.tag_blind else tag), host, dst))
        self.copying.clear()

    def flush(self, on_error: Callable[[Exception, int], BaseException]) -> None:
        """Complete every send (the end of a step)."""
        self.issue_staged()
        self.issue()
        try:
            for work, _, dst in self.in_flight:
                try:
                    work.wait() if self.timeout is None else work.wait(self.timeout)
                except Exception as exc:
                    raise on_error(exc, dst) from exc
        finally:
            self.in_flight.clear()
