"""Moving values between the devices of in-process stages: a copy stream per CUDA device, plain copies otherwise."""

from __future__ import annotations

from typing import Any

import torch


class Transfers:
    """``to(value, stage)`` puts a value on the stage's device; ``move(value, device)`` on any device.

    A copy between two CUDA devices runs on a side stream of the *source* device (``copy_`` between
    devices always runs on the source device's current stream): it waits for an event recorded
    on the producer's stream, so the producer's stream can go on computing while the copy runs,
    and ``copy_`` itself makes the destination's current stream wait for the copy.
    ``record_stream`` keeps the source's memory from being reused before the copy has read it.
    A copy to or from the CPU is a plain ``.to`` (it synchronises with the CUDA stream it
    reads). Values already on the device, and anything that is not a tensor, pass through
    untouched, so a single-device pipeline pays nothing.
    """

    def __init__(self, devices: list[torch.device]) -> None:
        self.devices = [_normal(d) for d in devices]
        cuda = {d for d in self.devices if d.type == "cuda"}
        # Side streams only where a copy can leave a CUDA device for another CUDA device.
        self.streams = {d: torch.cuda.Stream(device=d) for d in cuda} if len(cuda) > 1 else {}

    def to(self, value: Any, stage: int) -> Any:
        return self.move(value, self.devices[stage])

    def move(self, value: Any, device: torch.device | None) -> Any:
        if device is None or not isinstance(value, torch.Tensor):
            return value
        device = _normal(device)
        if value.device == device:
            return value
        stream = self.streams.get(value.device)
        if stream is None or device.type != "cuda":
            return value.to(device)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(value.device))
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            out = value.to(device, non_blocking=True)
        value.record_stream(stream)
        return out


def _normal(device: torch.device | str) -> torch.device:
    """``cuda`` as ``cuda:N`` (the current device), so devices compare equal to tensors' ``.device``."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
