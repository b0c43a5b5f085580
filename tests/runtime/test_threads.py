"""gloo's socket threads at a lower priority, and a yield after each send (fxpipe.runtime.threads): the settings and
their refusals. That the
runtime sets a real process group's threads is checked on two ranks in test_runtime_api."""

from __future__ import annotations

import os

import pytest

from fxpipe.errors import OptionError
from fxpipe.runtime.threads import SHORT_ACTION_S, loop_nice, loop_priorities, lower_gloo_loops, send_yield


@pytest.mark.parametrize(("value", "nice"), [(None, 19), ("", 19), ("0", 0), ("7", 7), (" 19 ", 19)])
def test_the_niceness_is_the_variable_s_else_19(monkeypatch: pytest.MonkeyPatch, value: str | None, nice: int) -> None:
    if value is None:
        monkeypatch.delenv("FXPIPE_GLOO_LOOP_NICE", raising=False)
    else:
        monkeypatch.setenv("FXPIPE_GLOO_LOOP_NICE", value)
    assert loop_nice() == nice


@pytest.mark.parametrize("value", ["-1", "20", "low", "1.5"])
def test_a_niceness_out_of_range_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("FXPIPE_GLOO_LOOP_NICE", value)
    with pytest.raises(OptionError, match=r"FXPIPE_GLOO_LOOP_NICE must be a whole number from 0 to 19") as info:
        loop_nice()
    assert "\n" not in str(info.value)


def test_a_process_without_gloo_threads_sets_none() -> None:
    # pytest's own process has made no process group in this test module's run (or, if another test did and
    # destroyed it, its threads are gone): whatever is there is set, and what it returns is what it found.
    found = loop_priorities()
    assert lower_gloo_loops(19) == len(found)
    assert lower_gloo_loops(0) == 0


@pytest.mark.parametrize(("value", "action_s", "on"), [
    (None, None, True), ("", 1e-3, True), (None, SHORT_ACTION_S * 2, False),  # unset: where actions are short
    ("1", 0.5, True), (" 0 ", 1e-4, False),  # set: always, never
])
def test_a_send_yields_where_actions_are_short_unless_the_variable_says(
        monkeypatch: pytest.MonkeyPatch, value: str | None, action_s: float | None, on: bool) -> None:
    if value is None:
        monkeypatch.delenv("FXPIPE_SEND_YIELD", raising=False)
    else:
        monkeypatch.setenv("FXPIPE_SEND_YIELD", value)
    assert send_yield(action_s) is on


def test_a_rank_s_mean_action_is_over_the_actions_that_do_anything() -> None:
    from types import SimpleNamespace

    from fxpipe.runtime.executor import _mean_action

    costs = [SimpleNamespace(f=0.004, b=0.0, w=0.008), SimpleNamespace(f=0.001, b=0.002, w=0.003)]
    assert _mean_action(costs, [0]) == pytest.approx(0.006)  # a first stage's empty B is not an action
    assert _mean_action(costs, [0, 1]) == pytest.approx(0.018 / 5)
    assert _mean_action(costs, [2]) is None and _mean_action([], [0]) is None


@pytest.mark.parametrize("value", ["2", "yes", "-1"])
def test_a_send_yield_setting_other_than_0_or_1_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                                       value: str) -> None:
    monkeypatch.setenv("FXPIPE_SEND_YIELD", value)
    with pytest.raises(OptionError, match=r"FXPIPE_SEND_YIELD must be 0 or 1") as info:
        send_yield()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("rank", "world", "allowed", "cpus"), [
    (0, 2, {0, 1}, (0,)), (1, 2, {0, 1}, (1,)),  # this machine: a core each
    (1, 2, {0, 1, 2, 3, 4}, (2, 3)), (0, 3, {4, 6, 9}, (4,)), (2, 3, {4, 6, 9}, (9,)),  # equal shares, in order
    (0, 4, {0, 1}, ()), (3, 4, {0, 1}, ()),  # fewer CPUs than ranks: the system balances them
    (2, 2, {0, 1}, ()),  # no such local rank
])
def test_each_local_rank_gets_an_equal_share_of_the_cpus_where_there_is_one(
        rank: int, world: int, allowed: set[int], cpus: tuple[int, ...]) -> None:
    from fxpipe.runtime.threads import rank_cpus

    assert rank_cpus(rank, world, allowed) == cpus


@pytest.mark.parametrize(("value", "on"), [(None, True), ("", True), ("1", True), (" 0 ", False)])
def test_ranks_are_pinned_unless_the_variable_says_0(monkeypatch: pytest.MonkeyPatch, value: str | None,
                                                      on: bool) -> None:
    from fxpipe.runtime.threads import pin_ranks

    if value is None:
        monkeypatch.delenv("FXPIPE_PIN_RANKS", raising=False)
    else:
        monkeypatch.setenv("FXPIPE_PIN_RANKS", value)
    assert pin_ranks() is on


@pytest.mark.parametrize("value", ["2", "on", "-1"])
def test_a_pin_setting_other_than_0_or_1_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    from fxpipe.runtime.threads import pin_ranks

    monkeypatch.setenv("FXPIPE_PIN_RANKS", value)
    with pytest.raises(OptionError, match=r"FXPIPE_PIN_RANKS must be 0 or 1") as info:
        pin_ranks()
    assert "\n" not in str(info.value)


PIN_CHILD = """
import json, os, sys, threading
from fxpipe.runtime.threads import pin_local_rank
before = threading.Thread(target=threading.Event().wait, daemon=True)  # a thread that exists before the pinning
before.start()
cpus = pin_local_rank(int(sys.argv[1]), int(sys.argv[2]))
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
    one made after it all run on the rank's CPUs; with FXPIPE_PIN_RANKS=0 none of them moves."""
    import json
    import subprocess
    import sys

    from fxpipe.runtime.threads import rank_cpus

    allowed = sorted(os.sched_getaffinity(0))
    run = subprocess.run([sys.executable, "-c", PIN_CHILD, "1", "2"], capture_output=True, text=True, check=True,
                         env={**os.environ, "FXPIPE_PIN_RANKS": setting})
    doc = json.loads(run.stdout)
    want = list(rank_cpus(1, 2)) if setting == "1" else allowed
    assert doc["cpus"] == (want if setting == "1" else [])
    assert doc["main"] == doc["before"] == doc["after"] == want
