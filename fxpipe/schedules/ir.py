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
from collections.abc import Sequence
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
    def parse(cls, text: str) -> Action:
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
    # True: the runtime runs each run of one stage's adjacent W actions as one call over those microbatches
    # (fxpipe.runtime.batched_w); the order, and what each action computes, are the same
    batch_w: bool = False

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def split_backward(self) -> bool:
        return any(a.kind in (Kind.B, Kind.W) for r in self.ranks for a in r)

    def compute_only(self) -> Schedule:
        """The same schedule without its send and receive actions."""
        ranks = tuple(tuple(a for a in r if a.kind in COMPUTE) for r in self.ranks)
        return Schedule(self.name, self.num_stages, self.num_microbatches, self.rank_of_stage, ranks,
                        self.synchronous, self.notes, self.batch_w)

    def to_csv(self) -> str:
        """One line per rank: its actions separated by commas."""
        return "".join(",".join(str(a) for a in r) + "\n" for r in self.ranks)

    @classmethod
    def from_csv(cls, text: str, name: str = "csv", *, synchronous: bool = True, batch_w: bool = False) -> Schedule:
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
                   ranks, synchronous, batch_w=batch_w)

    def grid(self, mark: dict[int, int] | None = None, *, context: int | None = None) -> str:
        """The step x rank table; ``mark[rank] = step`` flags a cell with ``<<``.

        With ``context``, only the steps within ``context`` of a marked one (of the first and the
        last step when none is marked) are drawn, and each run of steps left out is one line that
        says so: a schedule of a million steps prints in a few lines::

            step  rank 0     rank 1
               0  0F0        1RECV_F0
              ... steps 1 to 9,997 not drawn (of 10,000) ...
            9998  0BW9999 <<
            9999
        """
        mark = mark or {}
        steps = max((len(r) for r in self.ranks), default=0)
        if context is None:
            drawn: Sequence[int] = range(steps)
        else:
            centres = sorted(set(mark.values())) or [0, steps - 1]
            drawn = sorted({i for c in centres for i in range(max(0, c - context), min(steps, c + context + 1))})
        width = max([len(str(r[i])) for r in self.ranks for i in drawn if i < len(r)] + [6]) + 3
        lines = ["step  " + "".join(f"rank {r}".ljust(width) for r in range(self.num_ranks))]
        previous = -1
        for i in [*drawn, steps]:
            if i > previous + 1:
                gap = f"step {i - 1:,}" if i == previous + 2 else f"steps {previous + 1:,} to {i - 1:,}"
                lines.append(f"  ... {gap} not drawn (of {steps:,}) ...")
            previous = i
            if i == steps:
                break
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
    makes it. Stages on the same rank hand values over in memory, with no action. A schedule that
    already has sends or receives is returned as it is.
    """
    where = schedule.rank_of_stage
    last = schedule.num_stages - 1
    cut_before = [s > 0 and where[s - 1] != where[s] for s in range(schedule.num_stages)]  # F receives, B sends
    cut_after = [s < last and where[s + 1] != where[s] for s in range(schedule.num_stages)]  # F sends, B receives
    forward, input_grad, fused, weight_grad = Kind.F, Kind.B, Kind.BW, Kind.W
    ranks = []
    for acts in schedule.ranks:
        out: list[Action] = []
        append = out.append
        for a in acts:
            kind = a.kind
            if kind is forward:
                s = a.stage
                if cut_before[s]:
                    append(Action(s, Kind.RECV_F, a.mb))
                append(a)
                if cut_after[s]:
                    append(Action(s, Kind.SEND_F, a.mb))
            elif kind is input_grad or kind is fused:
                s = a.stage
                if cut_after[s]:
                    append(Action(s, Kind.RECV_B, a.mb))
                append(a)
                if cut_before[s]:
                    append(Action(s, Kind.SEND_B, a.mb))
            elif kind is weight_grad:
                append(a)
            else:  # a send or receive: the schedule has its communication already
                return schedule
        ranks.append(tuple(out))
    return Schedule(schedule.name, schedule.num_stages, schedule.num_microbatches, schedule.rank_of_stage,
                    tuple(ranks), schedule.synchronous, schedule.notes, schedule.batch_w)
