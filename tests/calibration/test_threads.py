"""gloo's socket threads at a lower priority, a yield after each send, a CPU share per rank (fxpipe.calibration.threads,
HostTuning): the settings and their refusals. That the runtime sets a real process group's threads only when asked is
checked on two ranks in tests/runtime/test_runtime_api.py."""

from __future__ import annotations

import os

import pytest

from fxpipe.calibration.host import HostTuning
from fxpipe.calibration.threads import SHORT_ACTION_S, loop_priorities, lower_gloo_loops, send_yields
from fxpipe.errors import OptionError


@pytest.mark.parametrize("nice", [-1, 20, "low", 1.5, True])
def test_a_niceness_out_of_range_is_refused_in_one_line(nice: object) -> None:
    with pytest.raises(OptionError, match=r"niceness is a whole number from 0 to 19") as info:
        lower_gloo_loops(nice)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)
    with pytest.raises(OptionError, match=r"gloo_loop_nice must be a whole number from 0 to 19") as info:
        HostTuning(gloo_loop_nice=nice)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_a_process_without_gloo_threads_sets_none() -> None:
    # pytest's own process has made no process group in this test module's run (or, if another test did and
    # destroyed it, its threads are gone): whatever is there is set, and what it returns is what it found.
    found = loop_priorities()
    assert lower_gloo_loops(19) == len(found)
    assert lower_gloo_loops(0) == 0


@pytest.mark.parametrize(("setting", "action_s", "on"), [
    ("auto", None, True), ("auto", 1e-3, True), ("auto", SHORT_ACTION_S * 2, False),  # auto: where actions are short
    ("on", 0.5, True), ("off", 1e-4, False),  # always, never
])
def test_a_send_yields_where_actions_are_short_unless_told(setting: str, action_s: float | None, on: bool) -> None:
    assert send_yields(setting, action_s) is on
    assert HostTuning(send_yield=setting).yields_after_send(action_s) is on


def test_host_tuning_touches_nothing_by_default_and_runs_ask_for_today_s_settings() -> None:
    assert HostTuning() == HostTuning(pin_cpus=False, gloo_loop_nice=0, send_yield="off", keep_freed_memory=False)
    assert not HostTuning().yields_after_send(None)  # not even where nothing is known of the actions
    assert HostTuning.for_runs() == HostTuning(pin_cpus=True, gloo_loop_nice=19, send_yield="auto",
                                               keep_freed_memory=True)
    assert HostTuning().pin(1, 2) == ()  # not asked: no CPU is bound


def test_a_rank_s_mean_action_is_over_the_actions_that_do_anything() -> None:
    from types import SimpleNamespace

    from fxpipe.runtime.executor import _mean_action

    costs = [SimpleNamespace(f=0.004, b=0.0, w=0.008), SimpleNamespace(f=0.001, b=0.002, w=0.003)]
    assert _mean_action(costs, [0]) == pytest.approx(0.006)  # a first stage's empty B is not an action
    assert _mean_action(costs, [0, 1]) == pytest.approx(0.018 / 5)
    assert _mean_action(costs, [2]) is None and _mean_action([], [0]) is None


@pytest.mark.parametrize("value", ["2", "yes", "1", True])
def test_a_send_yield_setting_other_than_auto_on_off_is_refused_in_one_line(value: object) -> None:
    with pytest.raises(OptionError, match=r"send_yield takes auto, on or off") as info:
        send_yields(value)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)
    with pytest.raises(OptionError, match=r"send_yield must be one of auto, on, off"):
        HostTuning(send_yield=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(("rank", "world", "allowed", "cpus"), [
    (0, 2, {0, 1}, (0,)), (1, 2, {0, 1}, (1,)),  # this machine: a core each
    (1, 2, {0, 1, 2, 3, 4}, (2, 3)), (0, 3, {4, 6, 9}, (4,)), (2, 3, {4, 6, 9}, (9,)),  # equal shares, in order
    (0, 4, {0, 1}, ()), (3, 4, {0, 1}, ()),  # fewer CPUs than ranks: the system balances them
    (2, 2, {0, 1}, ()),  # no such local rank
])
def test_each_local_rank_gets_an_equal_share_of_the_cpus_where_there_is_one(
        rank: int, world: int, allowed: set[int], cpus: tuple[int, ...]) -> None:
    from fxpipe.calibration.threads import rank_cpus

    assert rank_cpus(rank, world, allowed) == cpus


PIN_CHILD = """
import json, os, sys, threading
from fxpipe.calibration.host import HostTuning
before = threading.Thread(target=threading.Event().wait, daemon=True)  # a thread that exists before the pinning
before.start()
cpus = HostTuning(pin_cpus=sys.argv[3] == "1").pin(int(sys.argv[1]), int(sys.argv[2]))
seen = {}
after = threading.Thread(target=lambda: seen.update(after=sorted(os.sched_getaffinity(0))))
after.start(); after.join()
print(json.dumps({"cpus": list(cpus), "main": sorted(os.sched_getaffinity(0)),
                  "before": sorted(os.sched_getaffinity(before.native_id)), "after": seen["after"]}))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two CPUs")
@pytest.mark.parametrize("setting", ["1", "0"])
def test_a_pinned_rank_s_threads_all_run_on_its_cpus(setting: str) -> None:
    """In a process of its own (pytest's must keep its CPUs): the thread that pins, one that was there before it and
    one made after it all run on the rank's CPUs; not asked (``HostTuning()``), none of them moves."""
    import json
    import subprocess
    import sys

    from fxpipe.calibration.threads import rank_cpus

    allowed = sorted(os.sched_getaffinity(0))
    run = subprocess.run([sys.executable, "-c", PIN_CHILD, "1", "2", setting], capture_output=True, text=True,
                         check=True)
    doc = json.loads(run.stdout)
    want = list(rank_cpus(1, 2)) if setting == "1" else allowed
    assert doc["cpus"] == (want if setting == "1" else [])
    assert doc["main"] == doc["before"] == doc["after"] == want
