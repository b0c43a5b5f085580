"""Lowering: a compiled plan and a schedule become one program per rank.

A rank's program is its compute actions in schedule order, each with the messages it waits for
before it runs and the messages it sends right after. Every message carries a tag that sender and
receiver compute alike (direction, sending stage, microbatch, value), so any valid order matches
its pair, and ``check_programs`` proves, without running anything, that every send on one rank has
exactly one receive on its destination with the same tag, shape and dtype.

NCCL ignores tags: between two ranks the k-th receive posted matches the k-th send. So every rank's
program also lists its receives in the order it posts them (``posts``): from each source, the order
that source sends in, each posted no later than the action that reads it. ``check_pair_order``
proves it for every ordered pair of ranks; :func:`lower` lowers every rank and runs both checks.

Two rules keep the traffic minimal:

* a value is sent once to each rank that reads it, however many of that rank's stages read it,
  and straight from its producer's rank, however many stages it skips;
* each reading stage sends its own gradient share back to the producer's rank, which sums them
  (a rank's shares are not pre-summed: its stages run B at different times).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fxpipe.errors import LoweringError
from fxpipe.runtime.core import output_vals
from fxpipe.schedules.ir import COMPUTE, Action, Kind, Schedule

FORWARD, BACKWARD = 0, 1


@dataclass(frozen=True)
class Message:
    """One tensor crossing ranks: a value going forward, or a gradient share going back."""

    direction: int  # FORWARD or BACKWARD
    name: str  # the value (or the value whose gradient this is)
    stage: int  # the sending stage
    mb: int
    src: int  # ranks
    dst: int
    tag: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    # A forward value the receiving stage was traced with in a dense non-contiguous layout
    # (after attention, ``view(transpose(x))`` only works on attention's own strides): the
    # strides to restore after the (contiguous) receive. None: use the buffer as it is.
    stride: tuple[int, ...] | None = None

    def __str__(self) -> str:
        what = self.name if self.direction == FORWARD else f"grad of {self.name}"
        return f"{what} of microbatch {self.mb} from rank {self.src} (stage {self.stage}) to rank {self.dst}"


@dataclass
class Op:
    """A compute action with the receives it waits for first and the sends it makes after."""

    action: Action
    recvs: list[Message] = field(default_factory=list)
    sends: list[Message] = field(default_factory=list)


@dataclass
class RankProgram:
    rank: int
    stages: list[int]  # the stages this rank holds
    ops: list[Op]
    producer: dict[str, int]  # value -> the stage that makes it (-1: a model input)
    # Every receive in the order the rank posts it: from each source rank, the order that rank sends in (NCCL, and
    # gloo without tags, match a pair's messages first in, first out); each before the op that waits for it.
    posts: list[Message] = field(default_factory=list)

    @functools.cached_property
    def posted_by(self) -> list[int]:
        """``posted_by[k]``: how many of :attr:`posts` are posted before op k runs (every one it or an earlier op
        waits for, and those the posting order puts before them). Derived once: a program is fixed once it runs."""
        at = {msg.tag: n for n, msg in enumerate(self.posts)}
        out, last = [], 0
        for op in self.ops:
            last = max([last, *(at[msg.tag] + 1 for msg in op.recvs)])
            out.append(last)
        return out

    @functools.cached_property
    def reader(self) -> dict[int, Action]:
        """Each received message's tag -> the action that reads it."""
        return {msg.tag: op.action for op in self.ops for msg in op.recvs}

    @property
    def receives(self) -> list[Message]:
        """Every message this rank receives, in the order its ops wait for them."""
        return [msg for op in self.ops for msg in op.recvs]

    @property
    def sends(self) -> list[Message]:
        return [msg for op in self.ops for msg in op.sends]


def lower(pipe: Any, schedule: Schedule, rank: int, graphs: Sequence[Any] | None = None) -> RankProgram:
    """Rank ``rank``'s program for ``schedule`` over ``pipe``'s stages (which need their F/B/W graphs).

    ``graphs``: the stages' graphs, if not the pipeline's own (the runtime's: another rank's stage
    may be its interface only). Every rank is lowered (a rank's posting order follows its senders'),
    and the programs are checked together: tags (:func:`check_programs`), per-pair order
    (:func:`check_pair_order`)."""
    return lower_all(pipe, schedule, graphs)[rank]


def lower_all(pipe: Any, schedule: Schedule, graphs: Sequence[Any] | None = None) -> list[RankProgram]:
    """Every rank's program, each with its posting order, checked (see :func:`lower`)."""
    programs = [_lower_rank(pipe, schedule, r, graphs) for r in range(schedule.num_ranks)]
    for p in programs:
        p.posts = _posting_order(p, programs)
    check_programs(programs)
    check_pair_order(programs)
    return programs


def _posting_order(program: RankProgram, programs: list[RankProgram]) -> list[Message]:
    """``program``'s receives in posting order: walking its ops, each receive posts first every message its source
    sends to this rank before it (so each source's messages are posted in the order it sends them)."""
    queues = {src.rank: [m for m in src.sends if m.dst == program.rank] for src in programs if src.rank != program.rank}
    where = {r: {m.tag: k for k, m in enumerate(q)} for r, q in queues.items()}
    taken = dict.fromkeys(queues, 0)
    mine = {m.tag: m for m in program.receives}  # the receiver's own (with the strides it restores)
    posts: list[Message] = []
    for msg in program.receives:
        k = where.get(msg.src, {}).get(msg.tag)
        if k is None:  # no rank sends it: posted where it is read (check_programs names it)
            posts.append(msg)
        elif k >= taken[msg.src]:
            posts += [mine.get(m.tag, m) for m in queues[msg.src][taken[msg.src]:k + 1]]
            taken[msg.src] = k + 1
    return posts


def _lower_rank(pipe: Any, schedule: Schedule, rank: int, graphs: Sequence[Any] | None = None) -> RankProgram:
    """Rank ``rank``'s ops with their receives and sends (its posting order not yet derived)."""
    stages, where = pipe.stage_list(), schedule.rank_of_stage
    graphs = pipe.stage_graphs if graphs is None else graphs
    producer: dict[str, int] = {n: -1 for n in pipe.input_names}
    for s, st in enumerate(stages):
        for n in st.outputs:
            producer[n] = s
    readers: dict[str, list[int]] = defaultdict(list)
    for s, st in enumerate(stages):
        for n in st.inputs:
            readers[n].append(s)
    index = {n: k for k, n in enumerate(sorted(producer))}  # identical on every rank
    nvals, ns, nm = len(index), schedule.num_stages, schedule.num_microbatches

    def tag(direction: int, stage: int, mb: int, name: str) -> int:
        return ((direction * ns + stage) * nm + mb) * nvals + index[name]

    def meta(s: int, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of a value made (or read) by stage s, from its F graph."""
        st, g = stages[s], graphs[s]
        if name in st.outputs:
            val = output_vals(g)[st.outputs.index(name)]
        else:
            val = _input_vals(g)[st.inputs.index(name)]
        if not isinstance(val, torch.Tensor):
            raise LoweringError(f"value {name} crosses from rank {where[producer[name]]} to another rank but is not a "
                                "tensor; only tensors can be sent between stages: cut the model elsewhere")
        return tuple(val.shape), val.dtype

    def takes_grad(c: int, name: str) -> bool:
        return name in [stages[c].inputs[p] for p in graphs[c].grad_inputs]

    def message(direction: int, name: str, stage: int, mb: int, src: int, dst: int) -> Message:
        shape, dtype = meta(producer[name], name)
        return Message(direction, name, stage, mb, src, dst, tag(direction, stage, mb, name), shape, dtype)

    mine = [s for s in range(ns) if where[s] == rank]
    ops: list[Op] = []
    received: set[tuple[str, int]] = set()  # forward values this rank already waits for, per microbatch
    for action in schedule.ranks[rank]:
        if action.kind not in COMPUTE:
            continue
        s, i, op = action.stage, action.mb, Op(action)
        st, g = stages[s], graphs[s]
        if action.kind is Kind.F:
            for name in st.inputs:
                src = producer[name]
                if src >= 0 and where[src] != rank and (name, i) not in received:
                    received.add((name, i))
                    msg = message(FORWARD, name, src, i, where[src], rank)
                    stride = _dense_strides(_input_vals(g)[st.inputs.index(name)], msg.shape)
                    op.recvs.append(dataclasses.replace(msg, stride=stride) if stride else msg)
            for name in st.outputs:
                for dst in sorted({where[c] for c in readers[name]} - {rank}):
                    op.sends.append(message(FORWARD, name, s, i, rank, dst))
        if action.kind in (Kind.B, Kind.BW):
            for j in g.grad_outputs:
                name = st.outputs[j]
                for c in readers[name]:
                    if where[c] != rank and takes_grad(c, name):
                        op.recvs.append(message(BACKWARD, name, c, i, where[c], rank))
            for pos in g.grad_inputs:
                name = st.inputs[pos]
                src = producer[name]
                if src >= 0 and where[src] != rank:
                    op.sends.append(message(BACKWARD, name, s, i, rank, where[src]))
        ops.append(op)
    return RankProgram(rank, mine, ops, producer)


def check_programs(programs: list[RankProgram]) -> None:
    """Every send has exactly one matching receive on its destination (tag, shape, dtype), and vice versa."""
    sent = defaultdict(list)
    for p in programs:
        for msg in p.sends:
            sent[(msg.dst, msg.tag)].append(msg)
    got = {(p.rank, msg.tag): msg for p in programs for msg in p.receives}
    for key, msgs in sent.items():
        if len(msgs) != 1:
            raise LoweringError(f"{len(msgs)} messages share tag {key[1]} to rank {key[0]}: {msgs[0]}")
        if key not in got:
            raise LoweringError(f"rank {msgs[0].src} sends {msgs[0]} but rank {key[0]} never receives it")
        if (got[key].shape, got[key].dtype) != (msgs[0].shape, msgs[0].dtype):
            raise LoweringError(f"{msgs[0]} is sent as {msgs[0].shape} {msgs[0].dtype} but received as "
                                f"{got[key].shape} {got[key].dtype}")
    for key, msg in got.items():
        if key not in sent:
            raise LoweringError(f"rank {key[0]} waits for {msg} but no rank sends it")


def check_pair_order(programs: list[RankProgram]) -> None:
    """For every ordered pair of ranks (A, B), the messages A sends to B, in A's order, are the receives B posts from
    A, in B's posting order (NCCL, and gloo without tags, match them first in, first out)."""
    by_rank = {p.rank: p for p in programs}
    for a in programs:
        for b in programs:
            if a.rank == b.rank:
                continue
            sent = [m for m in a.sends if m.dst == b.rank]
            posted = [m for m in by_rank[b.rank].posts if m.src == a.rank]
            for k in range(max(len(sent), len(posted))):
                s = sent[k] if k < len(sent) else None
                r = posted[k] if k < len(posted) else None
                if s is None or r is None or _identity(s) != _identity(r):
                    raise LoweringError(
                        f"ranks {a.rank} -> {b.rank} disagree on their message {k + 1}: rank {a.rank} sends "
                        f"{_describe(s)}, rank {b.rank} posts its receive for {_describe(r)}; without tags (NCCL) "
                        "messages match in order, so the receiver must post in the sender's order (the program was "
                        "changed after lowering, or fxpipe's lowering has a bug)")


def _identity(msg: Message) -> tuple[Any, ...]:
    return msg.direction, msg.name, msg.stage, msg.mb, msg.shape, msg.dtype


def _describe(msg: Message | None) -> str:
    return "nothing" if msg is None else f"{msg} ({list(msg.shape)} {str(msg.dtype).removeprefix('torch.')})"


def _dense_strides(val: Any, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """``val``'s strides when they are a dense non-contiguous layout of ``shape``, else None."""
    if not isinstance(val, torch.Tensor) or tuple(val.shape) != shape or val.is_contiguous():
        return None
    stride, dense = tuple(val.stride()), 1
    for st, sz in sorted((st, sz) for st, sz in zip(stride, shape) if sz != 1):
        if st != dense:
            return None  # overlapping or with gaps: no layout to restore
        dense *= sz
    return stride


def _input_vals(g: Any) -> list[Any]:
    if g.interface is not None:
        return list(g.interface[0])
    return [n.meta.get("val") for n in g.forward.graph.nodes if n.op == "placeholder"]
