"""``fxpipe run`` across machines, as two "nodes" on 127.0.0.1: each ``fxpipe run`` starts its own ranks, the node
holding rank 0 prints the results (the same as one node's run), a rank killed on one node is named on both, and a
node whose peer never comes gives up in bounded time, in one line naming where it waited."""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path

import pytest

from tests._helpers import DP_STEPS as STEPS, Forked, cli_plan, dp_plan, four_rank_run

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds rank processes in /proc")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_node(*args: str | int | Path) -> Forked:
    """``fxpipe run ARGS`` as its own process (a node; forked from the preloaded forkserver, as ``python -m
    fxpipe.cli.main run ARGS`` would run), outside any torchrun environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    return Forked(["-m", "fxpipe.cli.main", "run", *map(str, args)], env=env)


def two_nodes(*args: str | int | Path, timeout: float = 600,
              plans: tuple[Path, Path] | None = None) -> list[tuple[int, str, str]]:
    """Node 0 and node 1 of a static rendezvous on 127.0.0.1, started together (each with its plan of ``plans``,
    default both :func:`dp_plan`): (exit code, stdout, stderr) each. ``timeout`` only keeps a hang from stalling the
    suite (far above a run at any load): the bounds a test checks are the ones its lines state."""
    port = free_port()
    plans = plans or (dp_plan(), dp_plan())
    procs = [start_node(plans[node], "--nnodes", 2, "--node-rank", node, "--master-addr", "127.0.0.1", "--master-port",
                        port, "--nproc", 2, *args) for node in (0, 1)]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:  # a node that hangs fails the test, and leaves nothing behind (fxpipe run stops its ranks)
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
                p.wait(30)
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]


def test_two_nodes_train_like_one() -> None:
    (rc0, out0, err0), (rc1, out1, err1) = two_nodes("--steps", STEPS, "--json")
    assert rc0 == 0 and rc1 == 0, (err0, err1)
    doc = json.loads(out0)
    alone, _ = four_rank_run()  # the same 2 x 2 ranks on one node
    assert doc["nodes"] == 2 and doc["ranks"] == 4 and doc["mesh"] == alone["mesh"]
    assert doc["losses"] == alone["losses"]  # the same ranks doing the same arithmetic: bit for bit
    assert json.loads(out1) == {"schema": "fxpipe.run.node/v1", "node_rank": 1, "ranks": [2, 3], "world": 4,
                                "results": "printed by the node that holds rank 0"}


def test_a_rank_killed_on_one_node_is_named_on_both() -> None:
    """Rank 3 (node 1; stage 1's second replica) is SIGKILLed mid-step: node 1 saw it die, node 0's ranks
    waited for it in vain; both name rank 3 (node 0 from its ranks' 10 s --timeout, not torch's default wait)."""
    (rc0, out0, err0), (rc1, out1, err1) = two_nodes("--steps", "3", "--timeout", "10", "--kill-rank", "3")
    assert (rc0, out0, rc1, out1) == (2, "", 2, ""), (err0, err1)
    assert err1.startswith("error: rank 3 died (killed by signal 9, SIGKILL") and err1.count("\n") == 1, err1
    assert err0.startswith("error: rank 3 failed without an error report; rank ") and err0.count("\n") == 1, err0
    assert err0.rstrip().endswith("(rank 3 ran on another node: its fxpipe run says more)"), err0


def test_nodes_that_loaded_different_plans_are_refused_in_one_line() -> None:
    """Node 1 loads a plan compiled with another seed (a stale copy): every rank refuses at start, before any
    message, and both nodes say so in one line, instead of training apart or waiting on each other until the
    timeout."""
    other = cli_plan("mlp-small", "--stages", "2", "--dp", "2", "--seed", "1")
    (rc0, out0, err0), (rc1, out1, err1) = two_nodes("--steps", "3", "--timeout", "20", plans=(dp_plan(), other))
    assert (rc0, out0, rc1, out1) == (2, "", 2, ""), (err0, err1)
    for err in (err0, err1):
        assert err.count("\n") == 1 and "PlanFileError: rank " in err, err
        assert "every rank must load the same plan: copy the directory fxpipe compile wrote to every node" in err, err


def test_a_node_whose_peer_never_comes_gives_up_in_one_line() -> None:
    """Static (node 1 alone: node 0's address never answers) and c10d (one of two nodes), concurrently."""
    static_port, c10d_port = free_port(), free_port()
    static = start_node(dp_plan(), "--nnodes", 2, "--node-rank", 1, "--master-addr", "127.0.0.1", "--master-port",
                        static_port, "--rdzv-timeout", 3, "--steps", 1)
    c10d = start_node(dp_plan(), "--nnodes", 2, "--rdzv-endpoint", f"127.0.0.1:{c10d_port}", "--rdzv-timeout", 3,
                      "--steps", 1)
    lines = []
    try:
        for proc in (static, c10d):
            # The bound: each gives up after its 3 s --rdzv-timeout (its line says so), not torch's default 15 min;
            # the wait here only keeps a hang from stalling the suite, and holds at any load.
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err, err
            lines.append(err.strip())
    finally:
        for proc in (static, c10d):
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    assert lines[0].startswith(f"error: this node waited up to 3 s at --master-addr 127.0.0.1 --master-port "
                               f"{static_port} and the 2 nodes never all met (DistNetworkError: "), lines[0]
    assert lines[0].endswith(f"start fxpipe run on all 2 nodes with the same --nnodes, --master-addr and --master-port "
                             f"(--node-rank 0 on the machine at --master-addr), check that 127.0.0.1:{static_port} is "
                             "reachable from every node, or raise --rdzv-timeout"), lines[0]
    assert lines[1] == (f"error: this node waited up to 3 s at --rdzv-endpoint 127.0.0.1:{c10d_port} and the 2 nodes "
                        "never all met (RendezvousTimeoutError); start fxpipe run on all 2 nodes with the same "
                        f"--nnodes, --rdzv-endpoint and --rdzv-id, check that 127.0.0.1:{c10d_port} is reachable from "
                        "every node, or raise --rdzv-timeout")
