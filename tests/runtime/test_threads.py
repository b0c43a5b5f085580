"""gloo's socket threads at a lower priority, and a yield after each send (fxpipe.runtime.threads): the settings and
their refusals. That the
runtime sets a real process group's threads is checked on two ranks in test_runtime_api."""

from __future__ import annotations

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
