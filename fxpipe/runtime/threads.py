"""The priority of gloo's socket threads, so they do not take the core from the rank that waits on them.

Each gloo process group runs one thread (``gloo_tcp_loop``) that reads and writes its sockets. When a
message arrives while the rank's own thread holds that pair's lock (posting a receive or a send, a few
microseconds of work), the loop thread cannot take the lock, skips, and polls again at once: it spins.
With the ranks sharing the cores (2 ranks on 2 cores here, each computing between messages) the
scheduler then preempts the rank's thread, lock held, in favour of the spinning loop thread, and the
rank waits out a whole time slice. Measured here (2 ranks, gloo, 2 cores; ``strace`` showed the main
thread in ``futex`` on the pair's lock while the loop thread polled ``epoll_wait`` in a loop): 5-7% of
``dist.irecv`` posts took 2-6 ms instead of 10-15 us, and in an ``fxpipe run`` of mlp-tiny a step's
receives at its start took 2-5.5 ms in about one step in four.

Run at the lowest priority (nice 19), the loop thread no longer preempts a thread holding its lock; it
still runs at once whenever a core is free, which is whenever its rank waits for a message. The same
posting probe then stalled in 1-4 of 1,200 posts. ``FXPIPE_GLOO_LOOP_NICE`` sets the niceness (0: leave
the threads as they are). Linux only (threads by name under ``/proc/self/task``); elsewhere nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

from fxpipe.errors import OptionError

__all__ = ["LOOP_THREAD", "SHORT_ACTION_S", "loop_nice", "loop_priorities", "lower_gloo_loops", "pin_local_rank",
           "pin_ranks", "pin_threads", "rank_cpus", "send_yield"]

LOOP_THREAD = "gloo_tcp_loop"
"""The name gloo's TCP transport gives the thread that runs its sockets' event loop."""

_DEFAULT_NICE = 19


def loop_nice() -> int:
    """The niceness for the loop threads: ``FXPIPE_GLOO_LOOP_NICE`` (0 to 19; 0 leaves them), else 19."""
    raw = os.environ.get("FXPIPE_GLOO_LOOP_NICE", "").strip()
    if not raw:
        return _DEFAULT_NICE
    if not raw.isdigit() or int(raw) > 19:
        raise OptionError(f"FXPIPE_GLOO_LOOP_NICE must be a whole number from 0 to 19 (got {raw!r}); 0 leaves gloo's "
                          "socket threads at their priority, 19 (the default) runs them below the ranks' own")
    return int(raw)


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


def lower_gloo_loops(nice: int | None = None) -> int:
    """Set every gloo loop thread of this process (one per process group made so far) to ``nice`` (default
    :func:`loop_nice`); returns how many threads it set. Raising a thread's niceness needs no privilege; a
    thread that ends meanwhile, or a platform without ``/proc``, is skipped."""
    nice = loop_nice() if nice is None else nice
    if nice <= 0 or not hasattr(os, "setpriority"):
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
"""By default a rank yields after its sends when its actions average less than this many seconds: about the longest a
send waited for its loop thread here (p75 of a busy sender's one-way time: up to 3.9 ms)."""


def send_yield(action_s: float | None = None) -> bool:
    """Whether a rank yields its core once after each gloo ``isend``: ``FXPIPE_SEND_YIELD`` 1 (always) or 0 (never);
    unset, where the rank's actions average under :data:`SHORT_ACTION_S` (``action_s``: seconds per action; None,
    unknown: yield).

    A send's bytes leave when the sender's gloo loop thread runs (a yield just after the ``isend`` lets them go, one
    just before it does not). With the rank computing its next action on the core, that thread (nice 19) waits for
    the rank to block or for a time slice: measured here (``benchmarks/send_yield.py``), a 64 B message from a sender
    that computes on after posting arrived in 0.13-1.4 ms (median; p75 0.17-3.3 ms) against 66-111 us when the sender
    is idle; with one ``os.sched_yield()`` after the ``isend``, 121-187 us (p75 135-813 us). The yield can also hand
    the core to the receiver's freshly woken thread, and the sender then waits about a millisecond (seen in a
    trace). Where actions are short, a message's wait is a large share of the step and the yield pays (gpt-tiny
    0.889-0.918x its step without it in four runs, mlp-tiny 0.922-1.009x); where they are long, the wait is small
    against them and the yield did not pay (gpt-base, 18-45 ms actions: 0.966-1.026x, 1.016 the median of five
    runs; mlp-deep, 4-8 ms: 0.978-1.119x)."""
    raw = os.environ.get("FXPIPE_SEND_YIELD", "").strip()
    if raw not in ("", "0", "1"):
        raise OptionError(f"FXPIPE_SEND_YIELD must be 0 or 1 (got {raw!r}); 1 yields the core once after each send so "
                          "gloo's socket thread can send it, 0 does not, unset yields where actions are short")
    if raw == "0" or not hasattr(os, "sched_yield"):
        return False
    return raw == "1" or action_s is None or action_s < SHORT_ACTION_S


def pin_ranks() -> bool:
    """Whether each local rank runs on CPUs of its own (:func:`pin_local_rank`): ``FXPIPE_PIN_RANKS`` 1 (the default)
    or 0 (the operating system places the ranks' threads)."""
    raw = os.environ.get("FXPIPE_PIN_RANKS", "").strip()
    if raw not in ("", "0", "1"):
        raise OptionError(f"FXPIPE_PIN_RANKS must be 0 or 1 (got {raw!r}); 1 (the default) runs each local rank on CPUs "
                          "of its own where there are at least as many as ranks, 0 leaves their placement to the system")
    return raw != "0"


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
    """Run this rank's threads on CPUs of its own (:func:`rank_cpus`) where :func:`pin_ranks` says so; the CPUs
    (none: left to the system). Call it before the process group starts, so gloo's threads start there too.

    Two ranks on this two-core machine, left to the system, are moved between the cores and at times share one: in
    ``fxpipe run`` gpt-tiny (2 stages, 1F1B, 4 microbatches, 40 steps) stepped in 7.66-11.14 ms (median of each
    run, four runs) unpinned against 6.06-7.08 pinned, runs interleaved, and its median step was 1.32-1.78x its
    fastest unpinned against 1.07-1.17 pinned (2026-11-27; ``benchmarks/pin_ranks.py`` compares them)."""
    if not pin_ranks():
        return ()
    cpus = rank_cpus(local_rank, local_world)
    return cpus if pin_threads(cpus) else ()
