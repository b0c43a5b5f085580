"""Warm launches (fxpipe.cli.agent.warm_launches): each fxpipe run's root is a fork of one warm root, the runs train
like one process, an environment torch reads at import gets a root of its own, a dead root costs no run, and none
outlives the block."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fxpipe.cli import agent
from tests._helpers import MLP_PLAN, fxpipe_cli, ok, plan_fixture, reference_losses

plan = plan_fixture(*MLP_PLAN)


def _losses(plan: Path) -> list[float]:
    return json.loads(ok(fxpipe_cli("run", plan, "--nproc", "2", "--steps", "2", "--json")).stdout)["losses"]


def _parent(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rindex(")") + 2:].split()[1])


def test_launches_fork_their_roots_from_one_warm_root_per_import_environment(
        plan: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    roots: list[Any] = []
    parents: list[int] = []
    make, popen = agent._Warm, agent._popen

    def warm(env: dict[str, str]) -> Any:
        roots.append(make(env))
        return roots[-1]

    def started(process: Any, server: Any) -> Any:
        handle = popen(process, server)
        parents.append(_parent(handle.pid))  # the launch's root runs on (it waits for its agent) as this reads it
        return handle

    monkeypatch.setattr(agent, "_Warm", warm)
    monkeypatch.setattr(agent, "_popen", started)
    expected = pytest.approx(reference_losses(2, model="mlp-tiny"), rel=1e-5)
    with agent.warm_launches():
        assert _losses(plan) == expected
        assert _losses(plan) == expected
        assert len(roots) == 1 and parents == [roots[0].proc.pid] * 2
        monkeypatch.setenv("TORCH_SHOW_CPP_STACKTRACES", "1")  # read as torch is imported: another warm root
        assert _losses(plan) == expected
        assert len(roots) == 2 and parents[2] == roots[1].proc.pid
        monkeypatch.delenv("TORCH_SHOW_CPP_STACKTRACES")
        roots[0].proc.kill()  # a warm root that died: the launch starts a new Python, as without warm launches
        roots[0].proc.wait()
        assert _losses(plan) == expected
        assert len(parents) == 3
    assert all(root.proc.poll() is not None for root in roots)  # the block ended: no warm root is left


class _Refused(Exception):
    pass


@pytest.mark.parametrize("fails", ["bind", "popen"])
def test_a_warm_root_that_cannot_start_leaves_no_descriptor_socket_or_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: str) -> None:
    """Its socket cannot be bound, or its Python cannot start: the error goes to the caller (warm_start then starts
    a new Python), and the pipes, socket and folder made for it are gone."""
    import os
    import socket

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise _Refused(fails)

    if fails == "bind":
        class Unbindable(socket.socket):
            def bind(self, address: Any) -> None:
                refuse()

        monkeypatch.setattr(agent.socket, "socket", Unbindable)
    else:
        monkeypatch.setattr(agent.subprocess, "Popen", refuse)
    monkeypatch.setattr(agent, "_short_dir", lambda: str(tmp_path))
    fds = sorted(os.listdir("/proc/self/fd"))
    with pytest.raises(_Refused):
        agent._Warm(dict(os.environ))
    assert sorted(os.listdir("/proc/self/fd")) == fds
    assert list(tmp_path.iterdir()) == []
