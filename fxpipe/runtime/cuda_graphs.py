"""CUDA graphs for the runtime's stage graphs: one graph per call slot (the n-th call of a step), on static buffers.

On a GPU the runtime is bound by the host: every ATen op of every microbatch's F, B and W is a
Python call and a kernel launch, which at small batches take longer than the kernels. A
:class:`SlotGraphs` wraps one graph callable (F, B, W, W_acc or W_set of a stage). Calls are
numbered from each step's start (``new_step``): microbatch m's F is the m-th call of F, so a slot
is a microbatch's place in the schedule, and the same action lands on the same slot every step.

    step 1:   every call runs eagerly (warm-up: cuBLAS handles, the first W makes .grad)
    step 2:   each call is captured into its slot's graph, then replayed
    later:    each call copies its new arguments into the slot's static inputs and replays

An argument that lives across steps at one address (a parameter, its ``.grad``, a buffer, or an
output of an already captured graph) is read where it is, not copied: W_acc adds into ``.grad``
in place, and B reads F's saved tensors from F's own static outputs. Anything else (a received
activation, a gradient the loss made) is copied into a buffer of the slot's own. Outputs are the
graph's static tensors, rewritten when the same slot replays next step: the runtime is done with
a step's values before the next step starts. Where a call's arguments are not where its graph
reads them (a parameter moved, say), the call runs eagerly, and ``fallbacks`` counts it. A call that
cannot be captured (an op that syncs with the host, a copy from pageable memory) runs eagerly, then
and at every later step, with one warning per rank: a failed capture ran nothing, and the graph
callables are pure functions of their arguments, so running the call again is the same call.
All graphs of a rank share one memory pool: a graph's temporaries are free again when it ends,
and what outlives it (its outputs) stays referenced here, so the pool never hands it out twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from fxpipe.errors import first_line

logger = logging.getLogger(__name__)


class GraphSet:
    """The slot graphs of one rank: their shared pool, the addresses read in place, and the step count."""

    def __init__(self, persistent: Callable[[], Iterable[torch.Tensor | None]]) -> None:
        self.persistent = persistent  # parameters, their .grad, buffers: read in place by the graphs
        self.pool: Any = None
        self.outputs: set[int] = set()  # data_ptr of every captured graph's output
        self.members: list[SlotGraphs] = []
        self.steps = 0
        self.fallbacks = 0
        self.captured = 0
        self.failed: list[str] = []  # why each slot that could not be captured failed

    def wrap(self, fn: Any) -> SlotGraphs:
        graphs = SlotGraphs(fn, self)
        self.members.append(graphs)
        return graphs

    def new_step(self) -> None:
        self.steps += 1
        for m in self.members:
            m.calls = 0

    def give_up(self, exc: Exception) -> None:
        """A slot that could not be captured: counted, and said once per rank."""
        self.fallbacks += 1
        self.failed.append(first_line(exc))
        if len(self.failed) == 1:
            logger.warning("cuda_graphs: a call could not be captured as a CUDA graph (%s); it runs op by op "
                           "(cuda_graphs=False skips the attempt)", self.failed[0])

    def in_place(self) -> set[int]:
        return self.outputs | {t.data_ptr() for t in self.persistent() if isinstance(t, torch.Tensor)}


class _Slot:
    __slots__ = ("graph", "inputs", "borrowed", "out")

    def __init__(self, graph: Any, inputs: list[Any], borrowed: list[bool], out: Any) -> None:
        self.graph, self.inputs, self.borrowed, self.out = graph, inputs, borrowed, out


_EAGER = object()  # a slot whose capture failed: its call runs eagerly


class SlotGraphs:
    """``fn`` captured once per call slot and replayed (see the module docstring)."""

    def __init__(self, fn: Any, owner: GraphSet) -> None:
        self.fn = fn
        self.owner = owner
        self.slots: dict[int, Any] = {}  # call slot -> _Slot, or _EAGER
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        n = self.calls
        self.calls += 1
        if self.owner.steps < 2:
            return self.fn(*args)
        slot = self.slots.get(n)
        if slot is None:
            try:
                slot = self.slots[n] = self._capture(args)
            except Exception as exc:  # noqa: BLE001  (whatever the op, the call runs eagerly from now on)
                self.slots[n] = _EAGER
                self.owner.give_up(exc)
                return self.fn(*args)
        if slot is _EAGER:
            self.owner.fallbacks += 1
            return self.fn(*args)
        if not self._load(slot, args):
            self.owner.fallbacks += 1
            return self.fn(*args)
        slot.graph.replay()
        out = slot.out
        return type(out)(out) if isinstance(out, (list, tuple)) else out

    def _capture(self, args: tuple[Any, ...]) -> _Slot:
        owner = self.owner
        in_place = owner.in_place()
        borrowed = [isinstance(a, torch.Tensor) and a.data_ptr() in in_place for a in args]
        inputs = [a if b or not isinstance(a, torch.Tensor) else a.detach().clone() for a, b in zip(args, borrowed)]
        if owner.pool is None:
            owner.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=owner.pool, capture_error_mode="thread_local"):
            out = self.fn(*inputs)
        outs = out if isinstance(out, (list, tuple)) else (out,)
        owner.outputs.update(t.data_ptr() for t in outs if isinstance(t, torch.Tensor))
        owner.captured += 1
        return _Slot(graph, inputs, borrowed, out)

    @staticmethod
    def _load(slot: _Slot, args: tuple[Any, ...]) -> bool:
        """Put ``args`` where the slot's graph reads them; False where a read-in-place argument moved."""
        if len(args) != len(slot.inputs):
            return False
        for a, s, b in zip(args, slot.inputs, slot.borrowed):
            if not isinstance(s, torch.Tensor):
                if a is not s and a != s:
                    return False
            elif not isinstance(a, torch.Tensor) or a.shape != s.shape or a.dtype != s.dtype:
                return False
            elif b:
                if a.data_ptr() != s.data_ptr() or a.stride() != s.stride():
                    return False
        for a, s, b in zip(args, slot.inputs, slot.borrowed):
            if isinstance(s, torch.Tensor) and not b and a.data_ptr() != s.data_ptr():
                s.copy_(a)
        return True
