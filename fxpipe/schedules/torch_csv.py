"""torch.distributed.pipelining's schedule CSVs, read into fxpipe's action IR and written from it.

One row per rank, one action per cell, as ``_PipelineScheduleRuntime._load_csv`` and ``_dump_csv`` read and write::

    fxpipe      torch        what
    1F3         1F3          forward
    1B3         1I3          input gradient
    1W3         1W3          weight gradient
    1BW3        1B3          fused backward
    1SEND_F3    1SEND_F3     sends and receives (SEND_F, RECV_F, SEND_B, RECV_B) are spelled alike
    (none)      1UNSHARD     FSDP's unshard and reshard, and REDUCE_GRAD: no fxpipe action, skipped on reading
    (none)      (0F1;1B0)OVERLAP_F_B   DualPipeV's overlapped pair: read as its actions in order
    (none)      empty cell   a bubble: skipped

Torch's own generators build their orders here too (:func:`torch_generated`), on stand-in stages that carry only
the counts their constructors read, so a schedule of torch's is compared with fxpipe's without a process group.
"""

from __future__ import annotations

import csv
import io
import re
import types
from typing import Any

from fxpipe.errors import PlanError, ScheduleError
from fxpipe.schedules.ir import COMPUTE, Action, Kind, Schedule

TO_TORCH = {Kind.F: "F", Kind.B: "I", Kind.W: "W", Kind.BW: "B", Kind.SEND_F: "SEND_F", Kind.RECV_F: "RECV_F",
            Kind.SEND_B: "SEND_B", Kind.RECV_B: "RECV_B"}
FROM_TORCH = {v: k for k, v in TO_TORCH.items()}
SKIPPED = frozenset({"UNSHARD", "RESHARD", "REDUCE_GRAD"})  # torch's actions with no fxpipe counterpart
_CELL = re.compile(r"^(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)$")
_OVERLAP = re.compile(r"^\((.*)\)OVERLAP_F_B$")
GENERATORS = ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""Torch's schedule classes (``get_schedule_class`` names) :func:`torch_generated` builds."""


def read_torch_csv(text: str, name: str = "torch-csv") -> Schedule:
    """A torch schedule CSV (compute only, or with torch's communication actions) as an fxpipe Schedule.

    Raises ScheduleError naming the rank and column of a cell that is not torch's action format, a compute action
    without a microbatch, or a stage computed on two ranks.
    """
    ranks: list[tuple[Action, ...]] = []
    for r, row in enumerate(csv.reader(io.StringIO(text))):
        acts: list[Action] = []
        for col, cell in enumerate(row):
            acts += _read_cell(cell, r, col)
        ranks.append(tuple(acts))
    while ranks and not ranks[-1]:
        ranks.pop()
    actions = [a for row in ranks for a in row]
    if not actions:
        raise ScheduleError("the torch schedule CSV has no actions; give one row of actions per rank, e.g. 0F0,0B0")
    rank_of: dict[int, int] = {}
    for r, rank_actions in enumerate(ranks):
        for a in rank_actions:
            if a.kind in COMPUTE and rank_of.setdefault(a.stage, r) != r:
                raise ScheduleError(f"stage {a.stage} computes on ranks {rank_of[a.stage]} and {r} (row {r}: {a}); a "
                                    "stage lives on one rank: fix the CSV")
    num_stages = 1 + max(a.stage for a in actions)
    missing = [s for s in range(num_stages) if s not in rank_of]
    if missing:
        raise ScheduleError(f"stages {missing} have no compute action in the torch CSV (stages: {num_stages}); "
                            "every stage needs its F")
    return Schedule(name, num_stages, 1 + max(a.mb for a in actions), tuple(rank_of[s] for s in range(num_stages)),
                    tuple(ranks))


def check_comms(schedule: Schedule) -> None:
    """A schedule read with torch's communication actions sends and receives exactly what its compute needs: each
    value crossing ranks is sent once after the compute that makes it and received once before the compute that
    reads it, on the right ranks. A compute-only schedule passes. Raises ScheduleError naming the first action.

    Torch posts its receives ahead and waits only at the compute, so the simulator (whose receive blocks) runs the
    compute order and places its own messages: these actions are checked, then dropped (``compute_only``)."""
    where, last = schedule.rank_of_stage, schedule.num_stages - 1
    if not any(a.kind not in COMPUTE for row in schedule.ranks for a in row):
        return
    need: set[tuple[int, Action]] = set()
    for row in schedule.ranks:
        for a in row:
            if a.kind is Kind.F and a.stage < last and where[a.stage + 1] != where[a.stage]:
                need |= {(where[a.stage], Action(a.stage, Kind.SEND_F, a.mb)),
                         (where[a.stage + 1], Action(a.stage + 1, Kind.RECV_F, a.mb))}
            elif a.kind in (Kind.B, Kind.BW) and a.stage > 0 and where[a.stage - 1] != where[a.stage]:
                need |= {(where[a.stage], Action(a.stage, Kind.SEND_B, a.mb)),
                         (where[a.stage - 1], Action(a.stage - 1, Kind.RECV_B, a.mb))}
    have: dict[tuple[int, Action], int] = {}
    for r, row in enumerate(schedule.ranks):
        done: set[Action] = set()
        for step, a in enumerate(row):
            if a.kind in COMPUTE:
                done.add(a)
                continue
            if (r, a) not in need:
                raise ScheduleError(f"rank {r}, step {step}: {a} moves a value no compute action sends or reads there "
                                    f"(stage {a.stage} is on rank {where[a.stage] if a.stage <= last else '-'}); "
                                    "drop it, or write the CSV compute-only")
            if (r, a) in have:
                raise ScheduleError(f"rank {r}, step {step}: {a} appears twice (first at step {have[(r, a)]}); "
                                    "keep one")
            have[(r, a)] = step
            made = {Kind.SEND_F: (Kind.F,), Kind.SEND_B: (Kind.B, Kind.BW)}.get(a.kind, ())
            if made and not any(Action(a.stage, k, a.mb) in done for k in made):
                raise ScheduleError(f"rank {r}, step {step}: {a} sends before the compute that makes it; move it after")
    missing = sorted(need - set(have), key=lambda item: (item[0], item[1]))
    if missing:
        r, a = missing[0]
        raise ScheduleError(f"rank {r} never runs {a} ({len(missing)} sends or receives missing); the CSV's compute "
                            "crosses ranks there: add them, or write the CSV compute-only")


def _read_cell(cell: str, rank: int, col: int) -> list[Action]:
    text = cell.strip()
    if not text:
        return []
    overlap = _OVERLAP.match(text)
    if overlap is not None:
        return [a for sub in overlap.group(1).split(";") for a in _read_cell(sub, rank, col)]
    match = _CELL.match(text)
    if match is None:
        raise ScheduleError(f"row {rank}, column {col}: {text!r} is not a torch action; write STAGE TYPE MICROBATCH "
                            "with TYPE one of F, I, W, B, SEND_F, RECV_F, SEND_B, RECV_B (e.g. 1I0)")
    stage, kind, mb = match.groups()
    if kind in SKIPPED:
        return []
    if not mb:
        raise ScheduleError(f"row {rank}, column {col}: {text!r} has no microbatch; a {kind} action needs one, e.g. "
                            f"{stage}{kind}0")
    return [Action(int(stage), FROM_TORCH[kind], int(mb))]


def torchable(schedule: Schedule) -> None:
    """Raise PlanError, in one line, where torch's runtime cannot run ``schedule`` (it flushes every step)."""
    if not schedule.synchronous:
        raise PlanError(f"schedule {schedule.name} is asynchronous (weights update after every microbatch, no flush); "
                        "torch's pipelining runtime runs synchronous schedules only: compile with --schedule 1f1b, "
                        "zb-h1, zb-h2, interleaved-1f1b or gpipe")


def torch_rows(schedule: Schedule, *, comms: bool = False) -> list[list[str]]:
    """Each rank's actions in torch's spelling; without ``comms``, its compute actions only (``_load_csv``'s
    ``compute_only``: torch's lowering adds the rest)."""
    torchable(schedule)
    return [[f"{a.stage}{TO_TORCH[a.kind]}{a.mb}" for a in row if comms or a.kind in COMPUTE] for row in schedule.ranks]


def write_csv(rows: list[list[str]]) -> str:
    """Rows as torch's ``csv.writer`` writes them (``_dump_csv``)."""
    buf = io.StringIO()
    csv.writer(buf).writerows(rows)
    return buf.getvalue()


def to_torch_csv(schedule: Schedule) -> str:
    """The compute-only CSV ``_PipelineScheduleRuntime._load_csv(path, format="compute_only")`` reads."""
    return write_csv(torch_rows(schedule))


def torch_actions(schedule: Schedule) -> dict[int, list[Any]]:
    """The compute-only schedule as torch's ``_Action``s per rank."""
    sch = _schedules()
    return {r: [sch._Action.from_str(cell) for cell in row] for r, row in enumerate(torch_rows(schedule))}


def check_with_torch(schedule: Schedule) -> dict[int, int]:
    """Torch's own validation (``_validate_schedule``) of the exported actions: the stage -> rank map it infers.
    Raises ScheduleError with torch's first line where torch refuses."""
    try:
        return dict(_schedules()._validate_schedule(torch_actions(schedule), schedule.num_ranks, schedule.num_stages,
                                                    schedule.num_microbatches))
    except (AssertionError, RuntimeError, ValueError) as exc:
        raise ScheduleError(f"torch refuses schedule {schedule.name}: {str(exc).splitlines()[0]}") from None


def lowered_torch_csv(schedule: Schedule) -> str:
    """The CSV with communication, as torch's own lowering makes it from the compute-only one (UNSHARD/RESHARD,
    REDUCE_GRAD, then the sends and receives): what ``_dump_csv(format="compute_comms")`` writes for it and
    ``_load_csv(format="compute_comms")`` reads."""
    sch = _schedules()
    where = check_with_torch(schedule)
    actions = torch_actions(schedule)
    lowered = {r: sch._add_reduce_grad(sch._add_unshard_reshard(acts), schedule.num_microbatches)
               for r, acts in actions.items()}
    lowered = sch._add_send_recv(lowered, stage_to_rank=lambda s: where[s], num_stages=schedule.num_stages)
    return write_csv([[str(a) for a in lowered[r]] for r in range(schedule.num_ranks)])


def torch_generated(name: str, ranks: int, microbatches: int, *, stages_per_rank: int | None = None) -> Any:
    """An instance of torch's schedule class ``name`` (a ``GENERATORS`` name) whose order its own code built, for
    ``ranks`` ranks; its ``pipeline_order`` (and, for the runtime's subclasses, ``pipeline_order_with_comms``) and
    ``_dump_csv`` are torch's. The stages are stand-ins holding the counts the constructors read; the instance
    cannot ``step``."""
    if name not in GENERATORS:
        raise ScheduleError(f"torch schedule {name!r} is not one fxpipe builds; choose one of {', '.join(GENERATORS)}")
    sch = _schedules()
    cls = sch.get_schedule_class(name)
    single = issubclass(cls, sch.PipelineScheduleSingle)
    local = 1 if single else stages_per_rank or (1 if name == "LoopedBFS" else 2)
    if name in ("ZBVZeroBubble", "DualPipeV") and local != 2:
        raise ScheduleError(f"torch's {name} takes exactly 2 stages per rank (got {local})")
    import torch

    stages = [types.SimpleNamespace(group_size=ranks, group_rank=0, num_stages=ranks * local, stage_index=k,
                                    submod=torch.nn.Module(), stage_index_to_group_rank=None) for k in range(local)]
    try:
        if single:
            obj = cls(stages[0], n_microbatches=microbatches)
            obj.pp_group_size = ranks
            obj.pipeline_order = obj._get_pipeline_order()
            return obj
        return cls(stages, n_microbatches=microbatches)
    except (ValueError, AssertionError, RuntimeError) as exc:
        raise ScheduleError(f"torch's {name} does not build for {ranks} ranks x {local} stages and {microbatches} "
                            f"microbatches: {str(exc).splitlines()[0]}") from None


def torch_generated_csv(name: str, ranks: int, microbatches: int, *, comms: bool = False,
                        stages_per_rank: int | None = None) -> str:
    """What torch's ``_dump_csv`` writes for its schedule ``name``: compute only, or (``comms``, the runtime's
    subclasses) with the communication its lowering added."""
    obj = torch_generated(name, ranks, microbatches, stages_per_rank=stages_per_rank)
    order = getattr(obj, "pipeline_order_with_comms", None) if comms else obj.pipeline_order
    if order is None:
        raise ScheduleError(f"torch's {name} has no {'lowered' if comms else 'compute'} order to write; drop --comms")
    return write_csv([["" if a is None else str(a) for a in order[r]] for r in sorted(order)])


def _schedules() -> Any:
    from fxpipe._compat import pipelining_schedules

    return pipelining_schedules()
