"""Keep freed host memory in the process, so that a step's large temporaries do not fault in fresh pages each call.

glibc hands an allocation above its mmap threshold to ``mmap`` and returns it to the kernel when freed, and trims
the heap's free top above twice that threshold. A training step allocates and frees the same large buffers every
microbatch, so each call then faults every page of them in again. :func:`keep_freed_memory` raises both thresholds
(``mallopt``) for the whole process: the process's resident memory then stays at its peak between steps, as a GPU
caching allocator's does. Called only where asked (:class:`fxpipe.calibration.host.HostTuning`); Linux with glibc
only, elsewhere nothing. Measurements: ``benchmarks/host_memory.py`` and benchmarks/RESULTS.md.
"""

from __future__ import annotations

import ctypes

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

MMAP_THRESHOLD = 256 << 20  # blocks below this come from the heap, not a fresh mapping
TRIM_THRESHOLD = 1 << 30  # free heap kept mapped before glibc returns it to the kernel
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)

_kept: bool | None = None  # what the first call did (None: not called yet)


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once; later calls return the first's result).
    Returns whether they are raised: False without glibc."""
    global _kept
    if _kept is None:
        _kept = _raise_thresholds()
    return _kept


def _raise_thresholds() -> bool:
    """The one place fxpipe calls ``mallopt`` (tests count the calls through it)."""
    try:  # the process's own symbols, the C library's among them (no ldconfig run, as ctypes.util.find_library does)
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # a C library without mallopt (musl, macOS)
        return False
    return all(mallopt(ctypes.c_int(param), ctypes.c_int(value))
               for param, value in ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
