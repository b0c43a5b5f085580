"""Fixtures every test module may ask for; the helpers themselves live in tests/_helpers.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Plans in tests never depend on the machine: fxpipe compile keeps the fixed device model instead of calibrating
# this machine's compute (tests/calibration/test_compute.py turns it on where it tests it).
os.environ["FXPIPE_CALIBRATION"] = "off"

# no_rank_starts and world1: fixtures, shared with every test module from here
from tests._helpers import assert_composes, no_rank_starts, world1  # noqa: E402, F401

# Test modules that share a session-cached launch (tests/_helpers.py: shared_launch, four_rank_run) run in one
# pytest-xdist
# worker, so the launch runs once; every other module is a group of its own (its module fixtures are made once).
_SHARED_LAUNCHES = {"tests/runtime/test_distributed.py": "dist", "tests/runtime/test_replicas.py": "dist",
                    "tests/cli/test_run_dp.py": "dp", "tests/cli/test_multinode.py": "dp"}


@pytest.hookimpl
def pytest_configure(config: pytest.Config) -> None:
    # Under pytest-xdist each worker computes on one thread: several workers of two threads each on two cores spend
    # their time waiting on each other's spinning threads. (Ranks are processes of their own and keep theirs.)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


# The longest groups first (their summed test times in a clean-clone run: test_run_hf_archs.py 144 s down to
# test_strategy_runtime.py 27 s); longest-first keeps one worker from finishing alone on a long module.
_LONGEST = ("tests/cli/test_run_hf_archs.py", "tests/test_docs.py", "tests/cli/test_run_restart.py",
            "tests/cli/test_run_cli.py", "tests/cli/test_signals.py", "dp", "tests/cli/test_run_strategy.py",
            "tests/runtime/test_codegen.py", "dist", "tests/runtime/test_schedules_eager.py",
            "tests/cli/test_run_hf_data.py", "tests/cli/test_run_data.py", "tests/test_backend_inductor.py",
            "tests/cli/test_run_hf.py", "tests/runtime/test_strategy_runtime.py")


def _group(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0].split("@", 1)[0]
    return _SHARED_LAUNCHES.get(module, module)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: k for k, name in enumerate(_LONGEST)}
    items.sort(key=lambda item: rank.get(_group(item.nodeid), len(rank)))  # stable: each module keeps its own order


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: none without it (-p no:xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Each group of :func:`_group` whole on one worker, the groups in collection order (longest first). xdist's own
    ``--dist loadgroup`` reads a group from a suffix it adds to ``item._nodeid``, which pytest 9 no longer reads
    (its node ids come from ``item._id``): every test went wherever a worker was free, and each worker made the
    shared launches and module fixtures again."""
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return Groups(config, log)


@pytest.fixture
def composes():  # type: ignore[no-untyped-def]
    return assert_composes


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/golden/* from the current output")


@pytest.fixture
def golden(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """``golden("name.txt", text)``: compare with tests/golden/name.txt (or rewrite it with --update-golden)."""
    root = Path(__file__).parent / "golden"
    update = bool(request.config.getoption("--update-golden"))

    def check(name: str, text: str) -> None:
        path = root / name
        if update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            return
        assert path.exists(), f"no golden file {path}; run pytest --update-golden to create it"
        assert text == path.read_text(), (f"{name} differs from its golden file; if the change is right, "
                                          "run --update-golden")

    return check
