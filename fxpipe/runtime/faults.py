"""Naming the rank that failed: survivors of a dead or stuck peer agree, through the store, on one culprit."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from fxpipe._compat import default_store
from fxpipe.errors import RankFailedError, first_line


def peer_down(exc: Exception, peers: Sequence[int], waited: str, *, rank: int,
              timeout: timedelta | None) -> RankFailedError:
    """The error of a wait on ``peers`` that failed: one line naming the rank that failed first.

    A dead rank closes its connections, so its peers' waits fail at once; a stuck one makes them
    time out. The ranks agree through the process group's store: each survivor marks itself
    (``fxpipe/fault/rank{R}``), and the first to see a peer's link break names that peer under
    ``fxpipe/fault/down`` (before its own exit closes its links), so a rank whose own peer merely
    stopped with it, or that fails inside a collective, names the same rank. A collective of
    more than two ranks waits a little for that name, or for every other member but one to mark
    itself. Without a store, the peer itself is named.
    """
    why = why_failed(exc, timeout)
    store = default_store()
    record: str | None = None
    try:
        if store is not None:
            store.set(f"fxpipe/fault/rank{rank}", why)
            if len(peers) == 1:
                record = store.compare_set("fxpipe/fault/down", "", f"{peers[0]}\t{rank}\t{why}").decode()
            else:
                record = _await_culprit(store, peers, rank, why, timeout)
    except Exception:  # the store is gone too (it lived on the dead rank): name what this rank saw
        record = None
    if record is None and len(peers) == 1:
        record = f"{peers[0]}\t{rank}\t{why}"
    if record is None:
        return RankFailedError(f"rank {rank} waited for {waited} and gave up ({first_line(exc)}); one of "
                               f"ranks {list(peers)} failed or is stuck: see their logs")
    dead, seen, why_dead = record.split("\t", 2)
    seen_by = "" if int(seen) == rank else f", seen by rank {seen}"
    also = f"; rank {peers[0]} stopped because of it" if len(peers) == 1 and int(dead) != peers[0] else ""
    return RankFailedError(f"rank {dead} {why_dead}{seen_by} while rank {rank} waited for {waited}{also}; "
                           f"see rank {dead}'s log")


def why_failed(exc: Exception, timeout: timedelta | None) -> str:
    """What a failed wait says about the peer, in a few words."""
    text = str(exc).lower()
    if any(k in text for k in ("connection closed", "connection reset", "broken pipe", "read error", "eof",
                               "socket closed", "connection refused")):
        return "stopped responding (connection closed)"
    if "timed out" in text or "timeout" in text:
        return f"did not answer within {timeout.total_seconds():g} s" if timeout is not None else "did not answer"
    return f"failed ({first_line(exc)})"


def _await_culprit(store: Any, peers: Sequence[int], rank: int, why: str, timeout: timedelta | None) -> str | None:
    """For a failed collective: the rank another survivor named, or the one member that never marked itself."""
    deadline = time.monotonic() + min(3.0, timeout.total_seconds() if timeout is not None else 3.0)
    while True:
        if store.check(["fxpipe/fault/down"]):
            return store.get("fxpipe/fault/down").decode()
        silent = [r for r in peers if not store.check([f"fxpipe/fault/rank{r}"])]
        if len(silent) == 1:  # every other member is alive and failing too
            return store.compare_set("fxpipe/fault/down", "", f"{silent[0]}\t{rank}\t{why}").decode()
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
