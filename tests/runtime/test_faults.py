"""A rank killed (SIGKILL) in the middle of a step: every other rank sees its connection close and stops, naming it.

Each case starts the ranks of ``_dist_worker.py`` as separate processes over gloo. The killed rank
dies right after one of its compute actions, before that action's sends (so mid-step: a forward
whose output it never sends, or its last W, before the step's sums), and writes the moment it died
first. Each place a survivor can be waiting on the dead rank gets a case: a posted receive, the tied
weight's gradient sum, the loss sum, and (4 ranks) a receive from a rank that itself stopped because of
the dead one. ``destroy_process_group`` runs in every survivor before it exits, so a hang there fails too.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests._helpers import HANG_S, Forked, with_plans

WORKER = Path(__file__).with_name("_dist_worker.py")
TIMEOUT_S = 10  # the runtime's and the process group's timeout in these runs
# A rank still running HANG_S after the launch (start-up included, which alone can take minutes on a loaded machine)
# is hung: the test kills it and fails.


def _launch(tmp_path: Path, world: int, cfg: dict[str, Any]) -> tuple[list[tuple[int | None, str, float]], float]:
    """Run the ranks; returns (returncode, stderr, exit time) per rank and the time the killed rank died. The ranks
    load the session's compiled plans (what they do after a kill does not depend on where the stages came from;
    compiling on every rank is tests/runtime/test_distributed.py's failing-rank case and test_checkpoint.py's)."""
    init = f"file://{tmp_path / 'pg'}"
    cfg = with_plans(world, {"timeout": TIMEOUT_S, "pg_timeout": TIMEOUT_S, **cfg})
    procs = [Forked([str(WORKER), str(r), str(world), init, str(tmp_path), json.dumps(cfg)]) for r in range(world)]
    deadline = time.time() + HANG_S
    ended: dict[int, float] = {}
    try:
        while len(ended) < world and time.time() < deadline:
            for r, p in enumerate(procs):
                if r not in ended and p.poll() is not None:
                    ended[r] = time.time()
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # hung: end it so the test fails instead of hanging
    results = [(p.returncode if r in ended else None, p.communicate()[1], ended.get(r, float("inf")))
               for r, p in enumerate(procs)]
    killed = tmp_path / f"killed-rank{cfg['kill_rank']}"
    assert killed.is_file(), f"rank {cfg['kill_rank']} was never killed:\n" + results[cfg["kill_rank"]][1][-3000:]
    return results, float(killed.read_text())


def _error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if "RankFailedError: " in ln]
    assert lines, stderr[-3000:]
    return lines[-1].split("RankFailedError: ", 1)[1]


def _check(tmp_path: Path, world: int, cfg: dict[str, Any], waiting: dict[int, str]) -> None:
    """Every rank but the killed one exits non-zero; its one-line error names the killed rank and, from ``waiting``,
    what it was waiting for. That the dead peer was seen at once, not waited out, is what the line says: "stopped
    responding (connection closed)", where a wait that ran out would say "did not answer within 10 s" (a wall-clock
    bound on the exit would depend on the machine's load; HANG_S only keeps a hang from stalling the suite)."""
    results, killed_at = _launch(tmp_path, world, cfg)
    dead = cfg["kill_rank"]
    assert results[dead][0] == -9, results[dead][1][-3000:]
    for rank, (code, err, ended) in enumerate(results):
        if rank == dead:
            continue
        assert code is not None, f"rank {rank} hung (killed after {HANG_S} s):\n{err[-3000:]}"
        assert code != 0, err[-3000:]
        line = _error_line(err)
        took = ended - killed_at
        print(f"rank {rank}: exited {took:.2f} s after rank {dead} was killed: {line}")
        assert line.startswith(f"rank {dead} stopped responding (connection closed)"), line
        assert f"while rank {rank} waited for" in line and line.endswith(f"see rank {dead}'s log"), line
        assert re.search(waiting[rank], line), (waiting[rank], line)


@pytest.mark.slow
@pytest.mark.parametrize("dead, at, waiting", [
    (1, 1, r"waited for grad of \w+ of microbatch 0 \(stage 1\) from rank 1 at 0B"),  # a posted receive
    (0, 1, r"waited for \w+ of microbatch 0 \(stage 0\) from rank 0 at 1F0"),
    (1, -1, r"waited for the sum of the loss"),  # the last stage died after its last W
], ids=["receive-grad", "receive-activation", "loss-sum"])
def test_a_killed_rank_stops_the_other_with_its_name(tmp_path: Path, dead: int, at: int, waiting: str) -> None:
    _check(tmp_path, 2, {"model": "mlp-tiny", "schedules": ["zb-h1"], "microbatches": 4, "steps": 2,
                         "kill_rank": dead, "kill_at": at}, {1 - dead: waiting})


@pytest.mark.slow
def test_a_rank_killed_before_the_tied_weight_sum(tmp_path: Path) -> None:
    """gpt's embedding and head share a weight across ranks 0 and 1: the survivor waits in that sum."""
    _check(tmp_path, 2, {"model": "gpt-tiny", "schedules": ["zb-h1"], "microbatches": 4, "steps": 2,
                         "kill_rank": 1, "kill_at": -1}, {0: r"waited for the sum of the tied weight's gradient"})


@pytest.mark.slow
def test_four_ranks_all_name_the_killed_one(tmp_path: Path) -> None:
    """Rank 1 dies after its first forward of the step: ranks 0 and 2 see its links close; rank 3 sees rank
    2 stop, and names rank 1 too (rank 2 recorded it in the store before exiting)."""
    _check(tmp_path, 4, {"model": "mlp-tiny", "schedules": ["1f1b"], "microbatches": 4, "steps": 2,
                         "kill_rank": 1, "kill_at": 1},
           {0: r"waited for grad of \w+ of microbatch 0 \(stage 1\) from rank 1 at 0BW0",
            2: r"waited for \w+ of microbatch 0 \(stage 1\) from rank 1 at 2F0",
            3: r", seen by rank [02] while rank 3 waited for \w+ of microbatch 0 \(stage 2\) from rank 2 at 3F0; "
               r"rank 2 stopped because of it"})


@pytest.mark.slow
def test_a_killed_replica_is_named_by_every_survivor(tmp_path: Path) -> None:
    """2 stages x 2 replicas: rank 1 (stage 0, replica 1) dies after its first forward. Its pipeline peer (rank
    3) sees the link close; its replica peer (rank 0) finishes the step with rank 2 and finds it gone in the
    gradients' sum over the dp group; rank 2 waits in the sum with rank 3, which stopped because of it."""
    _check(tmp_path, 4, {"model": "mlp-tiny", "schedules": ["1f1b"], "microbatches": 4, "steps": 2, "dp": 2,
                         "kill_rank": 1, "kill_at": 1},
           {0: r"while rank 0 waited for the sum of the replicas' gradients \(dp group\)",
            2: r"while rank 2 waited for the sum of the replicas' gradients \(dp group\)",
            3: r"waited for \w+ of microbatch 0 \(stage 0\) from rank 1 at 1F0"})


def test_a_peer_whose_connection_closed_before_a_post_is_named_too(world1: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """gloo refuses to post a receive or a send to a peer whose connection has already closed (a loaded machine: the
    peer died before this rank posted, not while it waited): the post raises, and the runtime's error names the peer
    as a failed wait does, instead of leaving gloo's traceback."""
    import torch
    import torch.distributed as dist

    from fxpipe.errors import RankFailedError
    from fxpipe.runtime.channel import Channel

    def closed(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")

    monkeypatch.setattr(dist, "irecv", closed)
    monkeypatch.setattr(dist, "isend", closed)
    channel = Channel(torch.device("cpu"))
    named = lambda exc, dst=1: RankFailedError(f"rank {dst} stopped responding ({exc})")  # noqa: E731
    with pytest.raises(RankFailedError, match="rank 1 stopped responding .*Connection closed by peer"):
        channel.recv((2,), torch.float32, 1, 7, on_error=named)
    with pytest.raises(RankFailedError, match="rank 1 stopped responding .*Connection closed by peer"):
        channel.send(torch.zeros(2), 1, 7, on_error=named)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):  # without on_error: gloo's own error
        channel.recv((2,), torch.float32, 1, 7)
