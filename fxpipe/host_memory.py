"""Keep freed host memory in the process, so that a step's large temporaries do not fault in fresh pages each call.

glibc hands an allocation above its mmap threshold (128 KiB, rising to the largest such block freed, at most
32 MiB) to ``mmap`` and returns it to the kernel when freed, and trims the heap's free top above twice that
threshold. A training step allocates and frees the same large buffers every microbatch (a convolution's weight
gradient, its scratch space, a layer's activations), so each call then faults every page of them in again. Measured
here (one core): the weight gradient of a 3x3 convolution over 2 x 512 x 7 x 7 (9.4 MB) took 17-18 ms with 4,600
page faults per call, and 8.5-8.9 ms with none once the thresholds were raised (``benchmarks/host_memory.py`` has the
whole-step numbers).

:func:`keep_freed_memory` raises both thresholds (``mallopt``) for the whole process: blocks up to
``MMAP_THRESHOLD`` come from the heap, and up to ``TRIM_THRESHOLD`` of free heap stays mapped, to be reused by the
next microbatch. The price is that the process's resident memory stays at its peak instead of shrinking between
steps, as a GPU caching allocator's does. The runtime calls it when it starts (``PipelineRuntime``), and so do the
calibration and the profiler that time the work the runtime then runs. ``FXPIPE_KEEP_FREED_MEMORY=0`` leaves
glibc's defaults. Linux with glibc only; elsewhere nothing.
"""

from __future__ import annotations

import ctypes
import os

from fxpipe.errors import OptionError

__all__ = ["ENV", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

ENV = "FXPIPE_KEEP_FREED_MEMORY"
MMAP_THRESHOLD = 256 << 20  # blocks below this come from the heap, not a fresh mapping
TRIM_THRESHOLD = 1 << 30  # free heap kept mapped before glibc returns it to the kernel
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)

_kept: bool | None = None  # what the first call did (None: not called yet)


def _enabled() -> bool:
    value = os.environ.get(ENV, "1").strip()
    if value not in ("0", "1"):
        raise OptionError(f"{ENV} takes 0 or 1 (got {value!r}); set 1 to keep freed memory (default), 0 to leave it")
    return value == "1"


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once; later calls return the first's result).
    Returns whether they are raised: False with ``FXPIPE_KEEP_FREED_MEMORY=0``, or without glibc."""
    global _kept
    if _kept is None:
        _kept = _enabled() and _raise_thresholds()
    return _kept


def _raise_thresholds() -> bool:
    try:  # the process's own symbols, the C library's among them (no ldconfig run, as ctypes.util.find_library does)
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # a C library without mallopt (musl, macOS)
        return False
    return all(mallopt(ctypes.c_int(param), ctypes.c_int(value))
               for param, value in ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
