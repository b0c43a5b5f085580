"""Where a rank's threads run: gloo's socket threads below the rank, a yield after each send, a CPU share per rank.

Each gloo process group runs one thread (``gloo_tcp_loop``) that reads and writes its sockets. When a message
arrives while the rank's own thread holds that pair's lock, the loop thread spins; with the ranks sharing the
cores, the scheduler can then preempt the rank's thread, lock held, and the rank waits out a time slice. At the
lowest priority (nice 19) the loop thread no longer preempts it, and still runs whenever its rank waits. Nothing
here runs unless asked (:class:`fxpipe.calibration.host.HostTuning`). Linux only (threads by name under
``/proc/self/task``); elsewhere nothing. Measurements: benchmarks/RESULTS.md, ``benchmarks/send_yield.py`` and
``benchmarks/pin_ranks.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

from fxpipe.errors import OptionError

__all__ = ["LOOP_THREAD", "SHORT_ACTION_S", "loop_priorities", "lower_gloo_loops", "pin_local_rank", "pin_threads",
           "rank_cpus", "send_yields"]

LOOP_THREAD = "gloo_tcp_loop"
"""The name gloo's TCP transport gives the thread that runs its sockets' event loop."""

_TASKS = Path("/proc/self/task")


def _thread_ids() -> list[int]:
    """This process's threads' ids (none where there is no ``/proc``)."""
    return [int(task.name) for task in _TASKS.iterdir()] if _TASKS.is_dir() else []


def _loop_threads() -> list[int]:
    """This process's gloo loop threads' ids (none where there is no ``/proc``)."""
    found = []
    for tid in _thread_ids():
        try:
            if (_TASKS / str(tid) / "comm").read_text().strip() == LOOP_THREAD:
                found.append(tid)
        except OSError:  # a thread that ended meanwhile
            continue
    return found


def loop_priorities() -> list[int]:
    """The niceness of each of this process's gloo loop threads."""
    out = []
    for tid in _loop_threads():
        try:
            out.append(os.getpriority(os.PRIO_PROCESS, tid))
        except OSError:
            continue
    return out


def lower_gloo_loops(nice: int) -> int:
    """Set every gloo loop thread of this process (one per process group made so far) to ``nice`` (0 to 19; 0 leaves
    them); returns how many threads it set. Raising a thread's niceness needs no privilege; a thread that ends
    meanwhile, or a platform without ``/proc``, is skipped."""
    if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
        raise OptionError(f"a gloo loop niceness is a whole number from 0 to 19 (got {nice!r})")
    if nice == 0 or not hasattr(os, "setpriority"):
        return 0
    done = 0
    for tid in _loop_threads():
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            done += 1
        except OSError:
            continue
    return done


SHORT_ACTION_S = 4e-3
"""``send_yield="auto"`` yields after sends where a rank's actions average less than this many seconds: about the
longest a send waited for its loop thread on the 2-core machine of benchmarks/RESULTS.md."""


def send_yields(setting: str, action_s: float | None = None) -> bool:
    """Whether a rank yields its core once after each gloo ``isend``: ``setting`` ``on`` (always), ``off`` (never) or
    ``auto`` (where its actions, ``action_s`` seconds each, are under :data:`SHORT_ACTION_S`; None, unknown: yield).

    A send's bytes leave when the sender's gloo loop thread runs; a yield just after the ``isend`` lets them go now,
    not when the rank next blocks. Where actions are short a message's wait is a large share of the step and the
    yield pays; where they are long it did not (``benchmarks/send_yield.py``)."""
    if setting not in ("auto", "on", "off"):
        raise OptionError(f"send_yield takes auto, on or off (got {setting!r})")
    if setting == "off" or not hasattr(os, "sched_yield"):
        return False
    return setting == "on" or action_s is None or action_s < SHORT_ACTION_S


def rank_cpus(local_rank: int, local_world: int, allowed: set[int] | None = None) -> tuple[int, ...]:
    """The CPUs local rank ``local_rank`` of ``local_world`` gets: its equal share of the ``allowed`` CPUs (default:
    this process's affinity), in order, the remainder left to no rank; none where there are fewer CPUs than ranks
    (ranks then time-share the cores, and the system balances them) or no affinity to read (not Linux).

    >>> rank_cpus(1, 2, {0, 1}), rank_cpus(1, 2, {0, 1, 2, 3, 4}), rank_cpus(0, 4, {0, 1})
    ((1,), (2, 3), ())
    """
    if allowed is None:
        if not hasattr(os, "sched_getaffinity"):
            return ()
        allowed = os.sched_getaffinity(0)
    cpus = sorted(allowed)
    share = len(cpus) // local_world if local_world > 0 else 0
    if share < 1 or not 0 <= local_rank < local_world:
        return ()
    return tuple(cpus[local_rank * share:(local_rank + 1) * share])


def pin_threads(cpus: tuple[int, ...]) -> int:
    """Bind every thread of this process (``/proc/self/task``; the calling one only where there is none) to ``cpus``;
    threads made later inherit their maker's CPUs. Returns how many threads it bound."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return 0
    done = 0
    for tid in _thread_ids() or [0]:
        try:
            os.sched_setaffinity(tid, cpus)
            done += 1
        except OSError:  # a thread that ended meanwhile
            continue
    return done


def pin_local_rank(local_rank: int, local_world: int) -> tuple[int, ...]:
    """Run this rank's threads on CPUs of its own (:func:`rank_cpus`); the CPUs (none: left to the system). Ranks
    left to the system on a small machine are moved between the cores and at times share one
    (``benchmarks/pin_ranks.py`` compares them)."""
    cpus = rank_cpus(local_rank, local_world)
    return cpus if pin_threads(cpus) else ()
