"""The action IR: compact printing, parsing back, CSV round trips and golden schedules."""

from __future__ import annotations

from typing import Any

import pytest

from fxpipe.errors import ScheduleError
from fxpipe.schedules.generators import GENERATORS, generate
from fxpipe.schedules.ir import Action, Kind, Schedule, with_communication


@pytest.mark.parametrize("text, action", [
    ("1F3", Action(1, Kind.F, 3)), ("0B2", Action(0, Kind.B, 2)), ("2W0", Action(2, Kind.W, 0)),
    ("1BW5", Action(1, Kind.BW, 5)), ("12SEND_F30", Action(12, Kind.SEND_F, 30)),
    ("3RECV_B1", Action(3, Kind.RECV_B, 1)),
])
def test_actions_print_compactly_and_parse_back(text: str, action: Action) -> None:
    assert str(action) == text
    assert Action.parse(text) == action


@pytest.mark.parametrize("bad", ["F3", "1X3", "1F", "", "1 F 3"])
def test_bad_actions_are_refused(bad: str) -> None:
    with pytest.raises(ScheduleError, match="cannot parse action"):
        Action.parse(bad)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_csv_round_trip(name: str) -> None:
    stages = 4
    sched = generate(name, stages, 8)
    back = Schedule.from_csv(sched.to_csv(), name, synchronous=sched.synchronous)
    assert back.ranks == sched.ranks
    assert back.rank_of_stage == sched.rank_of_stage
    assert (back.num_stages, back.num_microbatches) == (sched.num_stages, sched.num_microbatches)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "interleaved-1f1b"])
def test_golden_schedules(name: str, golden: Any) -> None:
    golden(f"schedule_{name}_p4_m8.csv", generate(name, 4, 8).to_csv())


def test_communication_is_inserted_around_cross_rank_computes() -> None:
    sched = with_communication(generate("1f1b", 2, 2))
    assert [str(a) for a in sched.ranks[0]] == ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0BW0", "0RECV_B1",
                                                 "0BW1"]
    assert [str(a) for a in sched.ranks[1]] == ["1RECV_F0", "1F0", "1BW0", "1SEND_B0", "1RECV_F1", "1F1", "1BW1",
                                                 "1SEND_B1"]


def test_from_csv_refuses_a_stage_on_two_ranks() -> None:
    with pytest.raises(ScheduleError, match="stage 0 computes on ranks 0 and 1"):
        Schedule.from_csv("0F0,0BW0\n0F1,0BW1\n")
