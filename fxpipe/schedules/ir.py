"""The action IR: per rank, an ordered list of actions that print compactly (``1F3``) and parse back.

    stage 1, forward, microbatch 3          1F3
    stage 0, input gradient, microbatch 2   0B2
    stage 2, weight gradient, microbatch 0  2W0
    stage 1, fused backward, microbatch 5   1BW5
    stage 1 sends its F output of mb 3      1SEND_F3   (to the rank of stage 2)
    stage 2 receives its F input of mb 3    2RECV_F3
    stage 2 sends its input gradient of 3   2SEND_B3   (to the rank of stage 1)
    stage 1 receives its output gradient    1RECV_B3

A whole schedule reads and writes as CSV: one row per rank, one action per column.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

from fxpipe.errors import ScheduleError


class Kind(str, Enum):
    F = "F"
    B = "B"  # input gradient
    W = "W"  # weight gradient
    BW = "BW"  # fused backward
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


COMPUTE = frozenset({Kind.F, Kind.B, Kind.W, Kind.BW})
COMM = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
_PATTERN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|BW|F|B|W)(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.mb}"

    def __repr__(self) -> str:
        return str(self)

    @classmethod
    def parse(cls, text: str) -> "Action":
        match = _PATTERN.match(text.strip())
        if match is None:
            raise ScheduleError(f"cannot parse action {text!r}; write STAGE KIND MICROBATCH, e.g. 1F3, 0B2, 2W0, "
                                "1BW5, 1SEND_F3")
        return cls(int(match.group(1)), Kind(match.group(2)), int(match.group(3)))


@dataclass(frozen=True)
class Schedule:
    """Per rank, the actions it runs in order; ``rank_of_stage[s]`` is the rank holding stage s."""

    name: str
    num_stages: int
    num_microbatches: int
    rank_of_stage: tuple[int, ...]
    ranks: tuple[tuple[Action, ...], ...]
    synchronous: bool = True  # False: weights update after every microbatch (no flush), as in PipeDream
    notes: tuple[str, ...] = field(default=())

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def split_backward(self) -> bool:
        return any(a.kind in (Kind.B, Kind.W) for r in self.ranks for a in r)

    def compute_only(self) -> "Schedule":
        """The same schedule without its send and receive actions."""
        ranks = tuple(tuple(a for a in r if a.kind in COMPUTE) for r in self.ranks)
        return Schedule(self.name, self.num_stages, self.num_microbatches, self.rank_of_stage, ranks,
                        self.synchronous, self.notes)

    def to_csv(self) -> str:
        """One line per rank: its actions separated by commas."""
        return "".join(",".join(str(a) for a in r) + "\n" for r in self.ranks)

    @classmethod
    def from_csv(cls, text: str, name: str = "csv", *, synchronous: bool = True) -> "Schedule":
        """Parse :meth:`to_csv` output; stages, microbatches and placement are read off the actions."""
        ranks = tuple(tuple(Action.parse(cell) for cell in line.split(",") if cell.strip())
                      for line in text.strip("\n").split("\n"))
        actions = [a for r in ranks for a in r]
        if not actions:
            raise ScheduleError("the schedule has no actions; give one line of actions per rank")
        num_stages = 1 + max(a.stage for a in actions)
        rank_of: dict[int, int] = {}
        for r, acts in enumerate(ranks):
            for a in acts:
                if a.kind in COMPUTE:
                    if rank_of.setdefault(a.stage, r) != r:
                        raise ScheduleError(f"stage {a.stage} computes on ranks {rank_of[a.stage]} and {r}; "
                                            "a stage lives on one rank")
        missing = [s for s in range(num_stages) if s not in rank_of]
        if missing:
            raise ScheduleError(f"stages {missing} have no compute action; every stage needs its F")
        return cls(name, num_stages, 1 + max(a.mb for a in actions), tuple(rank_of[s] for s in range(num_stages)),
                   ranks, synchronous)

    def grid(self, mark: dict[int, int] | None = None) -> str:
        """The step x rank table; ``mark[rank] = step`` flags a cell with ``<<``."""
        mark = mark or {}
        steps = max((len(r) for r in self.ranks), default=0)
        width = max([len(str(a)) for r in self.ranks for a in r] + [6]) + 3
        lines = ["step  " + "".join(f"rank {r}".ljust(width) for r in range(self.num_ranks))]
        for i in range(steps):
            cells = []
            for r, acts in enumerate(self.ranks):
                text = str(acts[i]) if i < len(acts) else ""
                if mark.get(r) == i:
                    text += " <<"
                cells.append(text.ljust(width))
            lines.append(f"{i:>4}  " + "".join(cells).rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.grid()


def with_communication(schedule: Schedule) -> Schedule:
    """Insert the sends and receives a schedule of compute actions needs between ranks.

    A receive goes right before the compute that reads it; a send right after the compute that
    makes it. Stages on the same rank hand values over in memory, with no action.
    """
    if any(a.kind in COMM for r in schedule.ranks for a in r):
        return schedule
    where = schedule.rank_of_stage
    last = schedule.num_stages - 1
    ranks = []
    for acts in schedule.ranks:
        out: list[Action] = []
        for a in acts:
            s, m = a.stage, a.mb
            if a.kind is Kind.F and s > 0 and where[s - 1] != where[s]:
                out.append(Action(s, Kind.RECV_F, m))
            if a.kind in (Kind.B, Kind.BW) and s < last and where[s + 1] != where[s]:
                out.append(Action(s, Kind.RECV_B, m))
            out.append(a)
            if a.kind is Kind.F and s < last and where[s + 1] != where[s]:
                out.append(Action(s, Kind.SEND_F, m))
            if a.kind in (Kind.B, Kind.BW) and s > 0 and where[s - 1] != where[s]:
                out.append(Action(s, Kind.SEND_B, m))
        ranks.append(tuple(out))
    return Schedule(schedule.name, schedule.num_stages, schedule.num_microbatches, schedule.rank_of_stage,
                    tuple(ranks), schedule.synchronous, schedule.notes)
