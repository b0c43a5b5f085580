"""The one executor core: a schedule's compute actions (F, B, W, BW) run on the stages this process holds.

Every executor runs its schedule through :meth:`ActionRunner.run`: the reference executor (every
stage in one process), the distributed runtime and the per-layer strategy runtime (this rank's
stages; what crosses ranks arrives and leaves as messages around each action) and
``backend="fxpipe"`` (F inside autograd's forward, B and W inside its backward). They differ only
in four overridable policies:

    value(stage, mb, name)          the input F reads (default: this process's value)
    deliver(stage, mb, name, grad)  where B's input gradient goes (default: summed here)
    weight(stage, mb, args)         what W does with the parameter gradients (default: add to .grad)
    zeros(stage, mb, j)             the gradient of an output nothing differentiated (default: zeros)

Asynchronous schedules set ``versions`` and ``optimizers``: each phase reads the weights its
policy gives, and each stage steps its optimizer after every microbatch's W (or BW).

    F(s, m):  values[m][inputs]  ──F──▶ values[m][outputs], saved[s, m]   (then the loss)
    B(s, m):  saved, grads[m][outputs] ──B──▶ deliver(input grads), handover[s, m]
    W(s, m):  handover, saved, output grads ──▶ weight(s, m, W's arguments)
    BW(s, m): B then W (a stage without split graphs: one autograd backward)

Once B ran, only what W reads stays; :class:`HeldBytes` counts per stage the bytes kept between
actions and the step's peak. A stage in ``recompute`` (:meth:`ActionRunner.recomputing`) keeps only its
inputs from F to B, and its B first runs F again on them (:mod:`fxpipe.graphs.recompute`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch

from fxpipe._compat import boxed
from fxpipe.errors import OptionError
from fxpipe.graphs.accumulate import grads_are_fresh
from fxpipe.graphs.convention import StageGraphs, loss_and_output_grads
from fxpipe.graphs.recompute import draws_random, recompute_graph
from fxpipe.schedules.ir import Action, Kind


@dataclass
class GraphFacts:
    """What a core reads of its graphs that no step changes: whether each gradient a stage's W returns is a new
    tensor (``fresh``), and each stage's boxed graphs (``boxes``, made at first use: boxing copies and recompiles a
    graph). Cores of the same graphs share one, so a caller that makes a core per step (``backend="fxpipe"``) pays
    for these once."""

    graphs: tuple[StageGraphs, ...]  # what they were read from: a core of other graphs reads its own
    fresh: list[list[bool]]
    boxes: dict[tuple[int, str], tuple[Any, Any]] = field(default_factory=dict)  # (stage, name) -> (graph, boxed)

    @classmethod
    def of(cls, graphs: Sequence[StageGraphs], given: GraphFacts | None = None) -> GraphFacts:
        """``given`` where it was read from these very graphs, else read from them now."""
        if given is not None and len(given.graphs) == len(graphs) and all(a is b for a, b in zip(given.graphs, graphs)):
            return given
        return cls(tuple(graphs), [grads_are_fresh(g.backward_weight, len(g.param_names))
                                   if isinstance(g.backward_weight, torch.fx.GraphModule)
                                   else [False] * len(g.param_names)
                                   for g in graphs])


class ActionRunner:
    """Per-microbatch values, gradients, saved tensors and handovers of one step, and the four actions."""

    def __init__(self, pipe: Any, graphs: Sequence[StageGraphs], loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                 *, loss_scale: float = 1.0, loss_divisor: int = 1, facts: GraphFacts | None = None) -> None:
        self.pipe = pipe
        self.stages = pipe.stage_list()
        self.graphs = list(graphs)
        self.loss_fn = loss_fn
        self.loss_scale = loss_scale
        self.loss_divisor = loss_divisor
        self.outputs = [n for n in pipe.output_names if n is not None]
        self.versions: Any = None  # WeightVersions when the schedule is asynchronous
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        # What W reads of F's saved tensors and of the output gradients: the rest is dropped after B.
        self.w_saved = [frozenset(i for k, i in g.w_slots if k == "saved") for g in self.graphs]
        self.w_grads = [frozenset(i for k, i in g.w_slots if k == "grad") for g in self.graphs]
        self.w_saved_list = [sorted(w) for w in self.w_saved]
        self.held: HeldBytes | None = None  # set to count the bytes kept between actions (off: no cost)
        # Recomputing stages: stage -> its F again (inputs -> saved), and whether F draws random numbers
        self.again: dict[int, tuple[Any, bool]] = {}
        # Per stage, whether each gradient W returns is a new tensor (``fresh_grads``): read from the fx graphs now,
        # before an executor swaps in compiled ones; ``facts`` of a core of the same graphs, given, are not read again.
        self.facts = GraphFacts.of(self.graphs, facts)
        self.begin([], [])

    def begin(self, inputs: Sequence[dict[str, Any]], targets: Sequence[Any]) -> None:
        """A new step: ``inputs[m]`` holds microbatch m's model inputs by name, ``targets[m]`` its target."""
        self.values: list[dict[str, Any]] = [dict(x) for x in inputs]
        self.grads: list[dict[str, torch.Tensor]] = [{} for _ in inputs]
        self.targets = list(targets)
        self.losses: list[torch.Tensor | None] = [None] * len(inputs)
        self.saved: dict[tuple[int, int], list[Any]] = {}
        self.handover: dict[tuple[int, int], tuple[Any, ...]] = {}
        self.out_grads: dict[tuple[int, int], list[Any]] = {}  # None where W reads no gradient
        self.autograd: dict[tuple[int, int], tuple[list[Any], list[Any]]] = {}  # fused stages: outputs, leaves
        self.kept: dict[tuple[int, int], tuple[list[Any], Any]] = {}  # recomputing stages: F's inputs, its RNG state
        if self.held is not None:
            self.held.reset(x for d in self.values for x in d.values())

    # -- the one dispatch -------------------------------------------------------------------

    def run(self, action: Action) -> None:
        s, kind, m = action.stage, action.kind, action.mb
        self._run(s, kind, m, action)
        if self.held is not None:
            self.held.settle(s)

    def _run(self, s: int, kind: Kind, m: int, action: Action) -> None:
        if kind is Kind.F:
            self.forward(s, m)
        elif kind is Kind.B:
            self.backward_input(s, m)
        elif kind is Kind.W:
            self.backward_weight(s, m)
        elif kind is Kind.BW:
            if self.graphs[s].fused:
                self.fused_backward(s, m)
            else:
                self.backward_input(s, m)
                self.backward_weight(s, m)
        else:
            raise OptionError(f"{action} is not a compute action; run compute actions only (F, B, W, BW)")

    # -- the actions ------------------------------------------------------------------------

    def forward(self, s: int, m: int) -> None:
        st, g = self.stages[s], self.graphs[s]
        args = [self.value(s, m, n) for n in st.inputs]
        if g.fused:
            leaves = [a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point()
                      and n not in self.pipe.input_names else a for a, n in zip(args, st.inputs)]
            with torch.enable_grad():
                outs = list(st.module(*leaves))
            self.autograd[(s, m)] = (outs, leaves)
            outputs: Sequence[Any] = [o.detach() if isinstance(o, torch.Tensor) else o for o in outs]
        elif self.versions is None:
            again = self.again.get(s)
            rng = rng_state(self.stage_device(s)) if again is not None and again[1] else None
            outputs, self.saved[(s, m)] = g.run_forward(args)
            if again is not None:  # only the inputs stay until B, which remakes the rest
                del self.saved[(s, m)]
                self.kept[(s, m)] = (args, rng)
        else:
            if s in self.again:
                raise OptionError(f"stage {s} recomputes its forward, and asynchronous schedules read weight versions "
                                  "a recomputed forward would not see; recompute none, or pick a synchronous schedule")
            weights = self.versions.weights(s, m, "F")
            outputs, self.saved[(s, m)] = g.run_forward(args, weights)
            self.versions.remember_aliases(s, weights, self.saved[(s, m)])
            if weights and self.versions.policy != "stash":  # a prediction: F's saved tensors keep the live weights
                self.saved[(s, m)] = self.versions.rebase_saved(s, self.saved[(s, m)], None)
        if self.held is not None and not g.fused:
            self.held.hold(s, ("F", m), self.kept[(s, m)][0] if (s, m) in self.kept else self.saved[(s, m)])
            if self.versions is not None and weights:
                if self.versions.policy == "stash":  # the snapshot F read, until W (shared storages count once)
                    self.held.hold(s, ("V", m), weights.values())
                    self.hold_spare(s)
                else:
                    self.predicted(s, weights)
        self.values[m].update(zip(st.outputs, outputs))
        self.maybe_loss(m)

    def maybe_loss(self, m: int) -> torch.Tensor | None:
        """The loss of microbatch m once every model output exists (once); its output gradients join ``grads``."""
        if self.loss_fn is None or self.losses[m] is not None or any(n not in self.values[m] for n in self.outputs):
            return None
        loss, leaf_grads = loss_and_output_grads(self.pipe, self.loss_fn, self.values[m], self.targets[m],
                                                 scale=self.loss_scale, divisor=self.loss_divisor)
        for name, grad in leaf_grads:
            self.add_grad(m, name, grad)
        self.losses[m] = loss
        return loss

    def backward_input(self, s: int, m: int) -> None:
        st, g = self.stages[s], self.graphs[s]
        if (s, m) in self.kept:
            self.forward_again(s, m)
        grad_outs = [self.output_grad(s, m, j) for j in g.grad_outputs]
        box = self.boxed(s, "backward_input") if self.versions is None else None
        if box is not None:
            # B owns its arguments: what only B reads of F's saved tensors is freed as B goes, not after it
            args = g.input_args(self.saved[(s, m)], grad_outs)
            w_saved = self.w_saved[s]
            self.saved[(s, m)] = [x if i in w_saved else None for i, x in enumerate(self.saved[(s, m)])]
            result = box(args)
            n = len(g.grad_inputs)
            input_grads, self.handover[(s, m)] = result[:n], tuple(result[n:])
        elif self.versions is None:
            input_grads, self.handover[(s, m)] = g.run_backward_input(self.saved[(s, m)], grad_outs)
        else:
            weights = self.versions.weights(s, m, "B")
            saved = self.versions.rebase_saved(s, self.saved[(s, m)], weights)
            input_grads, self.handover[(s, m)] = g.run_backward_input(saved, grad_outs, weights)
            del saved  # a prediction's tensors go with it; F's saved tensors keep the live weights
        # Until W, keep only what W reads: B's own inputs would otherwise live as long as a deferred W.
        w_saved, w_grads = self.w_saved[s], self.w_grads[s]
        self.saved[(s, m)] = [x if i in w_saved else None for i, x in enumerate(self.saved[(s, m)])]
        self.out_grads[(s, m)] = [x if j in w_grads else None for j, x in enumerate(grad_outs)]
        if self.held is not None:
            self.held.hold(s, ("B", m), chain(self.handover[(s, m)], self.out_grads[(s, m)]),
                           again=(("F", m), self.w_saved_list[s]))
            self.held.release(s, ("F", m))
        if self.versions is not None and self.versions.policy not in ("stale", "stash") and weights:
            self.predicted(s, weights)
        for pos, grad in zip(g.grad_inputs, input_grads):
            self.deliver(s, m, st.inputs[pos], grad)

    def recomputing(self, stages: Iterable[int]) -> None:
        """From now on, ``stages`` recompute: F keeps only their inputs, and B runs F again on them first (with the
        RNG state F started from, where F draws random numbers). Synchronous schedules, split stages."""
        self.again = recompute_graphs(self.graphs, stages)

    def forward_again(self, s: int, m: int) -> None:
        """Stage s recomputes microbatch m's forward from its kept inputs: F's saved tensors, for B and W."""
        args, rng = self.kept.pop((s, m))
        graph = self.again[s][0]
        if rng is None:
            saved = list(graph(*args))
        else:
            now = rng_state(self.stage_device(s))
            set_rng_state(rng)
            try:
                saved = list(graph(*args))
            finally:
                set_rng_state(now)
        self.saved[(s, m)] = saved
        if self.held is not None:
            self.held.release(s, ("F", m))
            self.held.hold(s, ("F", m), saved)

    def backward_weight(self, s: int, m: int) -> None:
        if self.versions is None:
            self.weight(s, m, self.weight_args(s, m))
            return
        g = self.graphs[s]
        if self.held is not None:
            self.held.release(s, ("B", m))
        weights = self.versions.weights(s, m, "W")
        if self.held is not None:
            self.held.release(s, ("V", m))
        saved = self.versions.rebase_saved(s, self.saved.pop((s, m)), weights)
        grads = g.run_backward_weight(self.handover.pop((s, m)), saved, self.out_grads.pop((s, m)), weights)
        if weights and self.versions.policy != "stash":
            self.predicted(s, weights)
        self.step(s, self.take_grads(s, grads))
        self.hold_spare(s)

    def take_grads(self, s: int, grads: Sequence[Any]) -> set[int]:
        """Asynchronous schedules: W's gradients (``param_names`` order) become stage s's ``.grad`` as they are, since
        each microbatch's update applies its own gradient alone: no pass adding them to the last one, none zeroing
        that (a gradient W returns as an input or a view of one, or laid out unlike its parameter, is copied:
        :func:`grad_like`; a parameter returned twice, summed).
        Returns the ids of the parameters written."""
        g, module = self.graphs[s], self.stages[s].module
        written: set[int] = set()
        for name, grad, new in zip(g.param_names, grads, self.fresh_grads(s)):
            p = module.get_parameter(name)
            if id(p) in written:
                p.grad.add_(grad)
            else:
                p.grad = grad_like(p, grad, fresh=new)
                written.add(id(p))
        return written

    def fresh_grads(self, s: int) -> list[bool]:
        """Whether each gradient stage s's W returns is a new tensor (``graphs.accumulate.grads_are_fresh``, read
        from its fx graph as the runner was made); all False where W was no fx graph."""
        return self.facts.fresh[s]

    def hold_spare(self, s: int) -> None:
        """Stash: stage s's spare snapshot (kept for the next one) counts as held while it is kept."""
        if self.held is not None and self.versions is not None and self.versions.policy == "stash":
            self.held.release(s, ("spare",))
            self.held.hold(s, ("spare",), self.versions.spare(s))

    def predicted(self, s: int, weights: dict[str, torch.Tensor]) -> None:
        """At the end of a phase that read a prediction: it counts towards stage s's peak while alive, then goes."""
        if self.held is not None:
            self.held.hold(s, ("P",), weights.values())
            self.held.settle(s)
            self.held.release(s, ("P",))

    def run_weights(self, s: int, mbs: Sequence[int]) -> None:
        """W of stage s for microbatches ``mbs`` (a run of adjacent W actions the schedule batches:
        ``Schedule.batch_w``), handed to the ``weights`` policy together. Synchronous schedules only."""
        assert self.versions is None, "batched W runs synchronous schedules only"
        self.weights(s, mbs, [self.weight_args(s, m) for m in mbs])
        if self.held is not None:
            self.held.settle(s)

    def weight_args(self, s: int, m: int) -> list[Any]:
        """Microbatch m's W arguments for stage s, taken from what B left (and no longer counted as held)."""
        if self.held is not None:
            self.held.release(s, ("B", m))
        return self.graphs[s].weight_args(self.handover.pop((s, m)), self.saved.pop((s, m)), self.out_grads.pop((s, m)))

    def step(self, s: int, written: set[int]) -> None:
        """Asynchronous schedules: stage s applies this microbatch's gradient now. The next W's replace the
        ``written`` ones (:meth:`take_grads`); any other parameter's is zeroed, so no gradient is applied twice."""
        opt = self.optimizers.get(s)
        if opt is not None:
            opt.step()
            with torch.no_grad():
                for group in opt.param_groups:
                    for p in group["params"]:
                        if p.grad is not None and id(p) not in written:
                            p.grad.zero_()
        self.versions.updated(s)

    def fused_backward(self, s: int, m: int) -> None:
        """A stage without split graphs: one autograd backward through its module, its parameters' gradients added to
        their ``.grad``."""
        st = self.stages[s]
        outs, leaves = self.autograd.pop((s, m))
        pairs = [(o, j) for j, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
        grad_outs = [self.output_grad(s, m, j) for _, j in pairs]
        params = [p for p in st.module.parameters() if p.requires_grad]
        wrt = [(t, n) for t, n in zip(leaves, st.inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        # Into .grad (autograd's accumulation): a DTensor parameter's gradient keeps the placements autograd gives it
        # (a pending sum stays pending), which ``torch.autograd.grad`` would make whole.
        torch.autograd.backward([o for o, _ in pairs], grad_outs, inputs=[t for t, _ in wrt] + params)
        for t, name in wrt:
            if t.grad is not None:
                self.deliver(s, m, name, t.grad)

    # -- policies (override) ----------------------------------------------------------------

    def value(self, s: int, m: int, name: str) -> Any:
        return self.values[m][name]

    def output_grad(self, s: int, m: int, j: int) -> torch.Tensor:
        """The gradient of stage s's j-th output for microbatch m: what its readers and the loss sent, summed."""
        grad = self.grads[m].pop(self.stages[s].outputs[j], None)
        return grad if grad is not None else self.zeros(s, m, j)

    def zeros(self, s: int, m: int, j: int) -> torch.Tensor:
        if self.graphs[s].fused:
            return torch.zeros_like(self.values[m][self.stages[s].outputs[j]])
        val = output_vals(self.graphs[s])[j]
        return torch.zeros(val.shape, dtype=val.dtype, device=self.stage_device(s))

    def stage_device(self, s: int) -> torch.device:
        """Where stage s computes (default: where its parameters are)."""
        return next((p.device for p in self.stages[s].module.parameters()), torch.device("cpu"))

    def deliver(self, s: int, m: int, name: str, grad: torch.Tensor) -> None:
        self.add_grad(m, name, grad)

    def add_grad(self, m: int, name: str, grad: torch.Tensor) -> None:
        have = self.grads[m].get(name)
        self.grads[m][name] = grad if have is None else have + grad

    def weight(self, s: int, m: int, args: list[Any]) -> None:
        """W on ``args`` (``StageGraphs.weight_args``, a list W owns and empties), into the parameters' ``.grad``."""
        g, module = self.graphs[s], self.stages[s].module
        box = self.boxed(s, "backward_weight")
        grads = box(args) if box is not None else g.split_graphs()[2](*args)
        for name, grad in zip(g.param_names, grads):
            accumulate(module.get_parameter(name), grad)

    def weights(self, s: int, mbs: Sequence[int], args: list[list[Any]]) -> None:
        """W for several microbatches of stage s (:meth:`run_weights`); default: one after another."""
        for m, a in zip(mbs, args):
            self.weight(s, m, a)

    def boxed(self, s: int, which: str, graph: Any = None) -> Any:
        """Stage s's graph ``which`` (``graph`` if given) taking one list of its inputs that it empties, so each
        input is freed after its last use when the caller keeps no other reference (``_compat.boxed``; on HF
        GPT-2's first stage, W holding every saved tensor to its end made B+W 1.10-1.19x the fused backward,
        freeing them as it goes 0.98x); None when the graph is not an fx GraphModule (compiled stages)."""
        gm = getattr(self.graphs[s], which) if graph is None else graph
        have = self.facts.boxes.get((s, which))
        if have is None or have[0] is not gm:
            have = self.facts.boxes[(s, which)] = (gm, boxed(gm) if isinstance(gm, torch.fx.GraphModule) else None)
        return have[1]


class HeldBytes:
    """Per stage, the bytes of the tensors kept for a microbatch's later actions, and their peak over a step.

    An entry is what one action keeps for later ones (F: its saved tensors; B: what W reads). Each
    storage counts once per stage however many entries or views hold it, and not at all when it is
    a parameter's or buffer's (F saves ``t(weight)`` for B: a view, no new memory). The step's
    model inputs are one batch cut into microbatch views: a view of one counts its own bytes, as
    the cost model counts a saved input per microbatch. ``settle`` after each action records the
    peak, so an entry replaced within an action does not count twice.

    A counted storage is kept alive until its last entry is released: storages are told apart by
    address, and one freed while counted (a prediction's bias that F does not save) could otherwise
    hand its address to a new tensor that would then count as the same storage, bytes short of
    what the schedule keeps (a 512 B miss seen once in four CI runs). With tracking on, the bytes
    counted are therefore bytes really held.

    >>> held = HeldBytes([torch.nn.Linear(2, 2)])
    >>> x = torch.zeros(4, dtype=torch.float64)
    >>> held.hold(0, ("F", 0), [x, x[:2], None]); held.settle(0); held.release(0, ("F", 0)); held.settle(0)
    >>> held.now, held.peak
    ([0], [32])
    """

    def __init__(self, stages: Sequence[torch.nn.Module]) -> None:
        self.weights = [frozenset(t.untyped_storage().data_ptr() for t in chain(mod.parameters(), mod.buffers()))
                        for mod in stages]
        self.reset()

    def reset(self, inputs: Iterable[Any] = ()) -> None:
        """A new step over microbatches whose model inputs are ``inputs``: nothing held (the core starts a step with
        empty state), the peak from zero."""
        n = len(self.weights)
        self.entries: list[dict[Any, list[Any]]] = [{} for _ in range(n)]
        self.refs: list[dict[Any, list[Any]]] = [{} for _ in range(n)]  # address -> [holders, bytes, storage]
        self.now, self.peak = [0] * n, [0] * n
        self.batches = frozenset(t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor))

    def hold(self, s: int, key: Any, values: Iterable[Any], *, again: tuple[Any, Sequence[int]] | None = None) -> None:
        """Stage s keeps ``values`` (tensors, also in tuples: a multi-output op handed over whole; anything else
        is ignored) under ``key`` until ``release``. ``again``: (an entry's key, positions in its values) held
        once more, by the storages found when that entry was made (B keeps what W reads of F's)."""
        refs, skip, batches = self.refs[s], self.weights[s], self.batches
        entry: list[list[Any]] = []
        for v in values:
            found: list[Any] = []
            for t in (v,) if isinstance(v, torch.Tensor) else v if isinstance(v, (tuple, list)) else ():
                if not isinstance(t, torch.Tensor):
                    continue
                storage = t.untyped_storage()
                ptr: Any = storage.data_ptr()
                if ptr in skip or ptr == 0:
                    continue
                if ptr in batches:  # a microbatch's view of the batch: its own bytes
                    ptr, nbytes = (ptr, t.storage_offset(), t.numel()), t.numel() * t.element_size()
                else:
                    nbytes = storage.nbytes()
                found.append(ptr)
                ref = refs.get(ptr)
                if ref is None:
                    refs[ptr] = [1, nbytes, storage]
                    self.now[s] += nbytes
                else:
                    ref[0] += 1
            entry.append(found)
        if again is not None:
            old = self.entries[s][again[0]]
            for i in again[1]:
                for ptr in old[i]:
                    refs[ptr][0] += 1
                entry.append(old[i])
        self.entries[s][key] = entry

    def release(self, s: int, key: Any) -> None:
        refs = self.refs[s]
        for found in self.entries[s].pop(key, ()):
            for ptr in found:
                ref = refs[ptr]
                ref[0] -= 1
                if ref[0] == 0:
                    self.now[s] -= ref[1]
                    del refs[ptr]

    def settle(self, s: int) -> None:
        """After an action of stage s: its peak so far."""
        if self.now[s] > self.peak[s]:
            self.peak[s] = self.now[s]


def recompute_graphs(graphs: Sequence[StageGraphs], stages: Iterable[int]) -> dict[int, tuple[Any, bool]]:
    """Per stage of ``stages``: its recompute graph (``fxpipe.graphs.recompute``, from its eager F) and whether F draws
    random numbers; what :attr:`ActionRunner.again` holds."""
    out = {}
    for s in sorted(set(stages)):
        if not 0 <= s < len(graphs):
            raise OptionError(f"stage {s} cannot recompute: there are {len(graphs)} stages; name stages 0 .. "
                              f"{len(graphs) - 1}")
        out[s] = (recompute_graph(graphs[s]), draws_random(graphs[s].forward))
    return out


def rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None, torch.device]:
    """The RNG state a stage's random ops draw from on ``device``: the CPU generator's, and the device's own."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None, device


def set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None, torch.device]) -> None:
    """Put back a state :func:`rng_state` took."""
    cpu, cuda, device = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def accumulate(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """``param.grad += grad`` (a copy the first time)."""
    if param.grad is None:
        param.grad = grad_like(param, grad, fresh=False)
    else:
        param.grad.add_(grad)


def grad_like(param: torch.Tensor, grad: torch.Tensor, *, fresh: bool) -> torch.Tensor:
    """``grad`` as ``param``'s ``.grad``: in the parameter's own layout (autograd's gradient layout contract), taken
    as it is where it is ``fresh`` (no other reference) and so already, else copied into it. torch's fused optimizer
    kernels read parameter, gradient and state element by element in memory order: a gradient strided otherwise
    (a transposed W output) is stepped into the wrong elements, silently."""
    if fresh and grad.stride() == param.stride():
        return grad.detach()
    return torch.empty_like(param).copy_(grad)


class InPlaceW:
    """A stage's W writing ``.grad`` in place as the distributed runtime's does (``PipelineRuntime.backward_weight``),
    for the reference executor: a parameter's first gradient through W_set into a new contiguous buffer, every later
    one added inside the GEMMs by W_acc (:mod:`fxpipe.graphs.accumulate`). ``w_set`` and ``w_acc`` are attributes so
    an executor can swap in compiled ones."""

    def __init__(self, g: StageGraphs, params: Sequence[torch.nn.Parameter]) -> None:
        from fxpipe.graphs.accumulate import accumulating_weight_graph

        n = len(g.param_names)
        w = g.split_graphs()[2]
        self.params = list(params)
        self.w_acc: Any = accumulating_weight_graph(w, n)[0]
        self.w_set: Any = accumulating_weight_graph(w, n, overwrite=True)[0]
        self.unique = len({id(p) for p in self.params}) == len(self.params)

    def run(self, args: Sequence[Any]) -> bool:
        """W on ``args`` into the parameters' ``.grad``; False (nothing run) where some parameter has a gradient and
        another none yet, or a parameter W returns twice has none (the caller runs plain W then)."""
        have = [p.grad is not None for p in self.params]
        if not self.params:
            return False
        if all(have):
            self.w_acc(*args, *(p.grad for p in self.params))
            return True
        if any(have) or not self.unique:
            return False
        grads = [torch.empty_like(p) for p in self.params]  # the parameters' own layout (``grad_like``)
        self.w_set(*args, *grads)
        for p, grad in zip(self.params, grads):
            p.grad = grad
        return True


def output_vals(g: StageGraphs) -> list[Any]:
    """The traced values (shape, dtype) of a stage's outputs, from its F graph (another rank's stage: its interface)."""
    if g.interface is not None:
        return list(g.interface[1])
    assert g.forward is not None  # split stages only
    out = next(n for n in reversed(g.forward.graph.nodes) if n.op == "output")
    return [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in out.args[0][: g.num_outputs]]
