"""Moving values between the devices of in-process stages: a copy stream per device on CUDA, nothing on CPU."""

from __future__ import annotations

from typing import Any

import torch


class Transfers:
    """``to(value, stage)`` puts a value on stage's device.

    On CUDA the copy is issued on the destination device's copy stream, after an event recorded
    on the current stream (so it waits for the producer), and the consumer's stream waits on the
    copy; ``record_stream`` keeps the source alive until the copy is done. Values already on the
    stage's device, and everything on CPU, pass through untouched.
    """

    def __init__(self, devices: list[torch.device]) -> None:
        self.devices = devices
        self.streams = {d: torch.cuda.Stream(device=d) for d in set(devices) if d.type == "cuda"}

    def to(self, value: Any, stage: int) -> Any:
        device = self.devices[stage]
        if not isinstance(value, torch.Tensor) or value.device == device:
            return value
        stream = self.streams.get(device)
        if stream is None or value.device.type != "cuda":
            return value.to(device)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(value.device))
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            out = value.to(device, non_blocking=True)
        value.record_stream(stream)
        torch.cuda.current_stream(device).wait_stream(stream)
        return out
