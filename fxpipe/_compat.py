"""The one place fxpipe reaches into torch internals whose names change between releases."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import flop_counter


def flop_counter_mode() -> flop_counter.FlopCounterMode:
    """FlopCounterMode that also counts CPU attention.

    torch's registry knows the CUDA flash/efficient/cudnn attention kernels but not
    ``_scaled_dot_product_flash_attention_for_cpu`` (torch 2.13), so attention on CPU and on
    fake CPU tensors would count 0 FLOPs; map it to the same formula.
    """
    aten: Any = torch.ops.aten
    mapping: dict[Any, Any] = {}
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None:
        mapping[fwd] = _raw(flop_counter.flop_registry[aten._scaled_dot_product_flash_attention])
    if bwd is not None:
        mapping[bwd] = _raw(flop_counter.flop_registry[aten._scaled_dot_product_flash_attention_backward])
    return flop_counter.FlopCounterMode(display=False, custom_mapping=mapping)


def _raw(registered: Any) -> Any:
    """Registry entries already convert tensors to shapes; mark the alias so it is not wrapped twice."""

    def count(*args: Any, **kwargs: Any) -> int:
        return int(registered(*args, **kwargs))

    count._get_raw = True  # type: ignore[attr-defined]
    return count
