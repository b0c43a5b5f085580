"""PipelineRuntime: one rank's program of a schedule, run over torch.distributed with asynchronous send/recv.

Every rank builds the same plan and schedule, lowers them to its own program
(:func:`fxpipe.runtime.lower.lower`: its compute actions, each with the messages it waits for and
the messages it sends), and runs only that. Receives are posted at the start of the step into
buffers shaped from the stage graphs and waited for right before the compute that reads them;
sends go out right after the compute that makes them and are completed at the end of the step
(:class:`fxpipe.runtime.channel.Channel`, which also owns the CUDA streams). A microbatch's values
are dropped once no stage of the rank reads them again, its saved tensors once W ran. Gradients
accumulate over microbatches; gradients of parameters held by several ranks (tied weights) are
summed across those ranks; then each stage's optimizer steps. A peer that fails or dies makes the
others stop at the timeout with an error naming the peer and the message they waited for.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from fxpipe.errors import FxpipeError
from fxpipe.graphs.accumulate import accumulating_weight_graph, grads_are_fresh
from fxpipe.graphs.convention import loss_and_output_grads
from fxpipe.runtime.channel import Channel
from fxpipe.runtime.lower import FORWARD, LoweringError, Message, _output_vals, lower
from fxpipe.schedules.ir import Action, Kind, Schedule


class RuntimeError_(FxpipeError, RuntimeError):
    """A rank could not finish its step (a peer failed, timed out, or the plan and schedule disagree)."""


class PipelineRuntime:
    """Trains one mini-batch per :meth:`step` on this rank's stages of a plan under a schedule.

    ``plan`` is a compiled :class:`fxpipe.Pipeline` or a plan directory (``fxpipe compile --out``).
    ``schedule`` is a :class:`Schedule`, a schedule name (``fxpipe simulate``'s names, ``auto``
    included) or None: the schedule recorded in the plan, else 1F1B. ``optimizer`` makes one
    optimizer per stage from that stage's parameters (any ``torch.optim`` class or factory;
    default SGD, lr 0.01). ``loss_fn(outputs, target)`` defaults to the built-in model's loss for
    plans of the zoo. Every rank builds the same plan and schedule and runs only its own part.
    ``prefetch``: None posts all of a step's receives at its start into buffers reused every
    step (fastest; one buffer per message of the step); K posts each action's receives K
    actions ahead into new buffers, so receive memory follows the schedule's in-flight count.
    """

    def __init__(self, plan: Any, schedule: Schedule | str | None = None,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, *,
                 optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
                 microbatches: int | None = None, example_inputs: Sequence[Any] | None = None,
                 timeout: timedelta | None = None, device: torch.device | str | None = None,
                 prefetch: int | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError_("PipelineRuntime needs torch.distributed initialised (torchrun, or init_process_group)")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        pipe = _resolve_plan(plan, example_inputs)
        schedule = _resolve_schedule(pipe, schedule, microbatches)
        if loss_fn is None:
            loss_fn = _zoo_needed(pipe, "no loss function: pass loss_fn=(outputs, target) -> loss (only plans of "
                                        "built-in models have a default)").loss_fn
        if schedule.num_ranks != self.world or schedule.num_stages != pipe.num_stages:
            raise RuntimeError_(f"the schedule has {schedule.num_stages} stages on {schedule.num_ranks} ranks; the plan "
                                f"has {pipe.num_stages} stages and the world has {self.world} ranks; make them agree")
        graphs = pipe.stage_graphs
        if graphs is None or any(g.fused for g in graphs):
            raise RuntimeError_("every stage needs its F, B and W graphs; compile with split_backward (the default)")
        self.pipe, self.schedule, self.loss_fn, self.graphs = pipe, schedule, loss_fn, graphs
        self.timeout = timeout
        self.stages = pipe.stage_list()
        self.where = schedule.rank_of_stage
        try:
            self.program = lower(pipe, schedule, self.rank)
        except LoweringError as exc:
            raise RuntimeError_(str(exc)) from exc
        self.mine = self.program.stages
        last_rank = self.where[-1]
        producer = {n: s for s, st in enumerate(self.stages) for n in st.outputs}
        for n in pipe.output_names:
            if n is not None and n in producer and self.where[producer[n]] != last_rank:
                raise RuntimeError_(f"model output {n} is made on rank {self.where[producer[n]]}, not on the last "
                                    "stage's rank; the runtime computes the loss on the last stage")
        # How many of this rank's stages read each value: a microbatch's value is dropped once the last has.
        self.readers: dict[str, int] = defaultdict(int)
        for s in self.mine:
            for n in self.stages[s].inputs:
                self.readers[n] += 1
        # One optimizer per stage, over the parameters that stage is first on this rank to hold (a
        # parameter two of this rank's stages share is stepped once).
        make = optimizer or (lambda ps: torch.optim.SGD(ps, lr=0.01))
        owned: set[int] = set()
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        for s in self.mine:
            ps = [p for p in self.stages[s].module.parameters() if id(p) not in owned]
            owned.update(id(p) for p in ps)
            if ps:  # a stage with no parameters (an activation alone) has nothing to step
                self.optimizers[s] = make(ps)
        # W's gradients in its order (a parameter may come twice), and W_acc, which adds them in place.
        self.stage_params = {s: [self.stages[s].module.get_parameter(n) for n in graphs[s].param_names]
                             for s in self.mine}
        self.w_acc = {s: accumulating_weight_graph(graphs[s].backward_weight, len(graphs[s].param_names))[0]
                      for s in self.mine}
        self.w_set = {s: accumulating_weight_graph(graphs[s].backward_weight, len(graphs[s].param_names),
                                                   overwrite=True)[0] for s in self.mine}
        self._written: set[int] = set()  # parameters whose .grad this step has written
        self._buffers: dict[int, torch.Tensor] = {}  # receive buffers by tag, reused every step
        self.w_fresh = {s: grads_are_fresh(graphs[s].backward_weight, len(graphs[s].param_names)) for s in self.mine}
        # Tied parameters held on several ranks: one group each (created by every rank, in one order).
        self.shared: list[tuple[torch.nn.Parameter, Any, list[int]]] = []
        for name, holders in sorted(pipe.shared_params.items()):
            ranks = sorted({self.where[k] for k in holders})
            if len(ranks) < 2:
                continue
            group = dist.new_group(ranks)
            if self.rank in ranks:
                k = next(k for k in holders if self.where[k] == self.rank)
                self.shared.append((self.stages[k].module.get_parameter(name), group, ranks))
        if device is None:
            first = next((p for s in self.mine for p in self.stages[s].module.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.channel = Channel(self.device, timeout)
        if prefetch is not None and prefetch < 0:
            raise RuntimeError_(f"prefetch is how many actions ahead receives are posted (prefetch: {prefetch}); "
                                "pass 0 or more, or None for all of a step's at its start")
        # None: every receive posted at the step's start into buffers kept across steps (fastest);
        # K: receives posted K actions ahead into new buffers (memory bounded by the window).
        self.prefetch = prefetch
        self.events: list[tuple[Action, float, float]] = []

    # -- one step -------------------------------------------------------------------------

    def step(self, inputs: Sequence[Any], target: Any) -> torch.Tensor:
        """One mini-batch: every microbatch's F, B and W on this rank's stages, then the optimizer step.

        Returns the mean loss over microbatches (the same value on every rank).
        """
        from fxpipe.graphs.convention import flatten_inputs, split_batch

        m = self.schedule.num_microbatches
        if not isinstance(inputs, (tuple, list)):
            inputs = (inputs,)
        flat, spec = pytree.tree_flatten(tuple(inputs))
        fix = f"pick a batch that is a multiple of {m}"
        parts = [split_batch(self._here(x), m, fix=fix) for x in flat]
        targets = split_batch(self._here(target), m, fix=fix)
        env: list[dict[str, Any]] = []
        for i in range(m):
            args = pytree.tree_unflatten([p[i] for p in parts], spec)
            env.append(dict(zip(self.pipe.input_names, flatten_inputs(self.pipe.in_spec, tuple(args), {}))))
        self._left = [dict(self.readers) for _ in range(m)]  # local reads still to come, per microbatch
        grads: list[dict[str, torch.Tensor]] = [{} for _ in range(m)]
        saved: dict[tuple[int, int], list[Any]] = {}
        handover: dict[tuple[int, int], tuple[Any, ...]] = {}
        out_grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        # Receives are posted ahead into buffers shaped from the graphs (all at once, into the
        # previous step's buffers; or, with ``prefetch``, the next ``prefetch`` actions' into new
        # ones); each is waited for right before the compute that reads it, and each send goes
        # out right after the compute that makes it.
        ops = self.program.ops
        posted: list[list[Any] | None] = [None] * len(ops)
        ahead = len(ops) if self.prefetch is None else self.prefetch + 1

        def post_until(j: int) -> None:
            for k in range(j, min(j + ahead, len(ops))):
                if posted[k] is None:
                    reuse = self.prefetch is None
                    items = [self.channel.recv(msg.shape, msg.dtype, msg.src, msg.tag,
                                               self._buffers.get(msg.tag) if reuse else None)
                             for msg in ops[k].recvs]
                    if reuse:
                        self._buffers.update((msg.tag, item.buf) for msg, item in zip(ops[k].recvs, items))
                    posted[k] = items

        self._written = set()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.events = []  # this step's compute actions (start, end), seconds from its start
        self.waits: list[tuple[Action, float, float]] = []  # the waits for their messages before them
        start = time.perf_counter()
        with torch.no_grad():  # the graphs are the backward: autograd would only record and slow them
            for j, op in enumerate(ops):
                post_until(j)
                items = posted[j]
                assert items is not None
                posted[j] = []  # let the buffers go with their values
                waited = time.perf_counter() - start
                received = [(msg, self.channel.wait(item, self._failed_recv(msg, op.action)))
                            for msg, item in zip(op.recvs, items)]
                t0 = time.perf_counter() - start
                if op.recvs:
                    self.waits.append((op.action, waited, t0))
                loss = self._act(op.action, received, env, grads, saved, handover, out_grads, targets, m)
                if loss is not None:
                    loss_sum += loss
                for msg in op.sends:
                    value = env[msg.mb][msg.name] if msg.direction == FORWARD else self._share[msg.name]
                    self.channel.send(value, msg.dst, msg.tag)
                self._drop_dead(op.action, env)
                self.channel.poll()
                self.events.append((op.action, t0, time.perf_counter() - start))
        self.channel.flush(self._failed_send)
        for p, group, ranks in self.shared:
            if p.grad is not None:
                self._collective(partial(dist.all_reduce, p.grad, group=group),
                                 f"the tied weight's gradient (ranks {ranks})")
        for opt in self.optimizers.values():
            opt.step()  # no zero_grad: the next step's first W writes over the gradients (W_set)
        total = loss_sum.cpu()
        self._collective(partial(dist.all_reduce, total), "the loss (every rank)")
        return total / m  # float64: the mean over microbatches, summed in double

    def _here(self, value: Any) -> Any:
        """A batch tensor on this rank's device (the stages compute where their parameters are)."""
        return value.to(self.device, non_blocking=True) if isinstance(value, torch.Tensor) else value

    def _act(self, action: Action, received: list[tuple[Message, torch.Tensor]], env: list[dict[str, Any]],
             grads: list[dict[str, torch.Tensor]], saved: dict[tuple[int, int], list[Any]],
             handover: dict[tuple[int, int], tuple[Any, ...]], out_grads: dict[tuple[int, int], list[torch.Tensor]],
             targets: list[Any], m: int) -> torch.Tensor | None:
        """Run one compute action on its received values; returns its loss (the last stage's F), else None."""
        s, kind, i = action.stage, action.kind, action.mb
        st, g = self.stages[s], self.graphs[s]
        loss_sum = None
        self._share: dict[str, torch.Tensor] = {}
        if kind is Kind.F:
            for msg, buf in received:
                env[i][msg.name] = buf if msg.stride is None else \
                    torch.empty_strided(msg.shape, msg.stride, dtype=buf.dtype, device=buf.device).copy_(buf)
            outputs, saved[(s, i)] = g.run_forward([env[i][n] for n in st.inputs])
            env[i].update(zip(st.outputs, outputs))
            if s == self.schedule.num_stages - 1:
                loss, leaf_grads = loss_and_output_grads(self.pipe, self.loss_fn, env[i], targets[i], divisor=m)
                for name, grad in leaf_grads:
                    grads[i][name] = grad if name not in grads[i] else grads[i][name] + grad
                loss_sum = loss.double()
        elif kind in (Kind.B, Kind.BW):
            for msg, buf in received:
                grads[i][msg.name] = buf if msg.name not in grads[i] else grads[i][msg.name] + buf
            for name, grad in self._backward_input(s, i, grads, saved, handover, out_grads):
                src = self.program.producer.get(name, -1)
                if src >= 0 and self.where[src] != self.rank:
                    # This stage's own share, sent on its own: another stage of this rank that
                    # reads the same value sends its share separately, and the producer sums them.
                    self._share[name] = grad
                else:
                    grads[i][name] = grad if name not in grads[i] else grads[i][name] + grad
            if kind is Kind.BW:
                self._backward_weight(s, i, saved, handover, out_grads)
        elif kind is Kind.W:
            self._backward_weight(s, i, saved, handover, out_grads)
        return loss_sum

    def _drop_dead(self, action: Action, env: list[dict[str, Any]]) -> None:
        """After a forward, drop the microbatch's values no stage of this rank will read again."""
        if action.kind is not Kind.F:
            return
        st, left, values = self.stages[action.stage], self._left[action.mb], env[action.mb]
        for name in st.inputs:
            left[name] -= 1
            if left[name] == 0:
                values.pop(name, None)
        for name in st.outputs:
            if left.get(name, 0) == 0:  # read only on other ranks (sent already) or by the loss
                values.pop(name, None)

    def save_checkpoint(self, directory: str | Any, step: int) -> Any:
        """Write this rank's state to ``directory/rank{R}.pt`` atomically (a temporary file, then a rename)."""
        import os
        from pathlib import Path

        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        final = path / f"rank{self.rank}.pt"
        tmp = path / f".rank{self.rank}.pt.tmp"
        torch.save({"step": step, **self.state_dict()}, tmp)
        os.replace(tmp, final)  # a crash before this line leaves the previous checkpoint whole
        return final

    def load_checkpoint(self, directory: str | Any) -> int:
        """Load ``directory/rank{R}.pt``; returns the step it was saved after."""
        from pathlib import Path

        file = Path(directory) / f"rank{self.rank}.pt"
        if not file.is_file():
            raise RuntimeError_(f"no checkpoint for rank {self.rank} in {directory} (missing {file.name}); "
                                "start without --resume or point --checkpoint-dir at a run's checkpoints")
        state = torch.load(file, weights_only=False)
        self.load_state_dict(state)
        return int(state["step"])

    def state_dict(self) -> dict[str, Any]:
        """This rank's stages: parameters and buffers by name, and each stage's optimizer state."""
        return {"rank": self.rank,
                "params": {n: p.detach().clone() for n, p in self._named(lambda mod: mod.named_parameters())},
                "buffers": {n: b.detach().clone() for n, b in self._named(lambda mod: mod.named_buffers())},
                "optimizers": {s: opt.state_dict() for s, opt in self.optimizers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        params = dict(self._named(lambda mod: mod.named_parameters()))
        buffers = dict(self._named(lambda mod: mod.named_buffers()))
        if set(state["params"]) != set(params) or set(state.get("optimizers", {})) != set(self.optimizers):
            raise RuntimeError_(f"this state is of other stages than rank {self.rank}'s {self.mine}; load the state "
                                "saved by this rank of a run with the same plan and schedule")
        with torch.no_grad():
            for n, t in state["params"].items():
                params[n].copy_(t)
            for n, t in state.get("buffers", {}).items():
                buffers[n].copy_(t)
        for s, opt in self.optimizers.items():
            opt.load_state_dict(state["optimizers"][s])

    def _named(self, items: Callable[[torch.nn.Module], Any]) -> list[tuple[str, torch.Tensor]]:
        return [(n, t) for s in self.mine for n, t in items(self.stages[s].module)]

    # -- pieces ---------------------------------------------------------------------------

    def _backward_input(self, s: int, i: int, grads: list[dict[str, torch.Tensor]],
                        saved: dict[tuple[int, int], list[Any]], handover: dict[tuple[int, int], tuple[Any, ...]],
                        out_grads: dict[tuple[int, int], list[torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Run B; returns the gradient of each of the stage's inputs that takes one."""
        st, g = self.stages[s], self.graphs[s]
        outs = _output_vals(g)
        og = [grads[i].pop(st.outputs[j]) if st.outputs[j] in grads[i]
              else torch.zeros(outs[j].shape, dtype=outs[j].dtype, device=self.device) for j in g.grad_outputs]
        input_grads, handover[(s, i)] = g.run_backward_input(saved[(s, i)], og)
        out_grads[(s, i)] = og
        return [(st.inputs[pos], grad) for pos, grad in zip(g.grad_inputs, input_grads)]

    def _backward_weight(self, s: int, i: int, saved: dict[tuple[int, int], list[Any]],
                         handover: dict[tuple[int, int], tuple[Any, ...]],
                         out_grads: dict[tuple[int, int], list[torch.Tensor]]) -> None:
        """Run W; the first microbatch's gradients become ``.grad``, later ones are added in place
        (inside the weight-gradient GEMMs, with W_acc: see ``fxpipe.graphs.accumulate``)."""
        g = self.graphs[s]
        args = g.weight_args(handover.pop((s, i)), saved.pop((s, i)), out_grads.pop((s, i)))
        params = self.stage_params[s]
        ids = [id(p) for p in params]
        if params and all(p.grad is not None for p in params):
            if all(k in self._written for k in ids):  # later microbatches: add inside the GEMMs
                self.w_acc[s](*args, *(p.grad for p in params))
                return
            if not any(k in self._written for k in ids) and len(set(ids)) == len(ids):
                self.w_set[s](*args, *(p.grad for p in params))  # a step's first: over last step's buffers
                self._written.update(ids)
                return
        result = g.backward_weight(*args)  # type: ignore[misc]
        for p, grad, fresh in zip(params, result, self.w_fresh[s]):
            if id(p) not in self._written:
                # Contiguous: W_set and W_acc then write plain row-major buffers (a transposed view
                # would make every GEMM into it strided).
                p.grad = grad.detach().contiguous() if fresh else grad.detach().clone(memory_format=torch.contiguous_format)
                self._written.add(id(p))
            else:
                p.grad.add_(grad)  # type: ignore[union-attr]

    def _failed_recv(self, msg: Message, action: Action) -> Callable[[Exception], BaseException]:
        what = msg.name if msg.direction == FORWARD else f"grad of {msg.name}"
        return lambda exc: self._peer_down(exc, [msg.src], f"{what} of microbatch {msg.mb} (stage {msg.stage}) "
                                                           f"from rank {msg.src} at {action}")

    def _failed_send(self, exc: Exception, dst: int) -> BaseException:
        return self._peer_down(exc, [dst], f"its sends to rank {dst} to complete")

    def _collective(self, fn: Callable[..., Any], what: str) -> None:
        """Run a collective (``fn``, a ``partial`` of one), bounded by the runtime's timeout."""
        group = fn.keywords.get("group") if isinstance(fn, partial) else None
        try:
            if self.timeout is None:
                fn()
            else:
                fn(async_op=True).wait(self.timeout)
        except Exception as exc:
            ranks = dist.get_process_group_ranks(group) if group is not None else range(self.world)
            raise self._peer_down(exc, [r for r in ranks if r != self.rank], f"the sum of {what}") from exc

    def _peer_down(self, exc: Exception, peers: Sequence[int], waited: str) -> RuntimeError_:
        """The error of a wait on ``peers`` that failed: one line naming the rank that failed first.

        A dead rank closes its connections, so its peers' waits fail at once; a stuck one makes them
        time out. The ranks agree through the process group's store: each survivor marks itself
        (``fxpipe/fault/rank{R}``), and the first to see a peer's link break names that peer under
        ``fxpipe/fault/down`` (before its own exit closes its links), so a rank whose own peer merely
        stopped with it, or that fails inside a collective, names the same rank. A collective of
        more than two ranks waits a little for that name, or for every other member but one to mark
        itself. Without a store, the peer itself is named.
        """
        why = _why(exc, self.timeout)
        store = _default_store()
        record: str | None = None
        try:
            if store is not None:
                store.set(f"fxpipe/fault/rank{self.rank}", why)
                if len(peers) == 1:
                    record = store.compare_set("fxpipe/fault/down", "", f"{peers[0]}\t{self.rank}\t{why}").decode()
                else:
                    record = _await_culprit(store, peers, self.rank, why, self.timeout)
        except Exception:  # the store is gone too (it lived on the dead rank): name what this rank saw
            record = None
        if record is None and len(peers) == 1:
            record = f"{peers[0]}\t{self.rank}\t{why}"
        if record is None:
            return RuntimeError_(f"rank {self.rank} waited for {waited} and gave up ({_first_line(exc)}); one of "
                                 f"ranks {list(peers)} failed or is stuck: see their logs")
        dead, seen, why_dead = record.split("\t", 2)
        seen_by = "" if int(seen) == self.rank else f", seen by rank {seen}"
        also = f"; rank {peers[0]} stopped because of it" if len(peers) == 1 and int(dead) != peers[0] else ""
        return RuntimeError_(f"rank {dead} {why_dead}{seen_by} while rank {self.rank} waited for {waited}{also}; "
                             f"see rank {dead}'s log")


def _resolve_plan(plan: Any, example_inputs: Sequence[Any] | None) -> Any:
    """The Pipeline of a Pipeline or a plan directory, with its F/B/W graphs built."""
    import os

    from fxpipe.pipeline import Pipeline

    if isinstance(plan, (str, os.PathLike)):
        from fxpipe.plan_dir import load

        plan = load(os.fspath(plan))
    if not isinstance(plan, Pipeline):
        raise RuntimeError_(f"plan is a {type(plan).__name__}; pass a Pipeline (fxpipe.compile) or a plan directory")
    if plan.stage_graphs is None:
        if example_inputs is None:
            example_inputs = _zoo_needed(plan, "this plan has no F/B/W graphs yet; pass example_inputs= (the inputs "
                                               "it was compiled with, one microbatch)").example_inputs
        plan.build_backward(example_inputs)
    return plan


def _zoo_of(pipe: Any) -> Any:
    """The built-in model a plan was compiled from (built as ``fxpipe compile`` built it), or None."""
    from fxpipe import models

    name, build = pipe.info.get("model"), pipe.info.get("build") or {}
    try:
        return models.build(str(name), dtype=getattr(torch, str(build.get("dtype") or "float32")),
                            batch_size=build.get("batch_size"), seed=int(build.get("seed") or 0)) if name else None
    except FxpipeError:  # not a zoo name: the user's own model
        return None


def _zoo_needed(pipe: Any, otherwise: str) -> Any:
    """The plan's built-in model; raises ``otherwise`` for a plan of the user's own model."""
    zoo = _zoo_of(pipe)
    if zoo is None:
        raise RuntimeError_(otherwise)
    return zoo


def _resolve_schedule(pipe: Any, schedule: Schedule | str | None, microbatches: int | None) -> Schedule:
    """A Schedule as given; else ``fxpipe.schedules.auto.plan_schedule`` (the plan's recorded one, or a named one)."""
    from fxpipe.errors import OptionError
    from fxpipe.schedules.auto import plan_schedule

    if isinstance(schedule, Schedule):
        return schedule
    try:
        return plan_schedule(pipe.info, pipe.num_stages, schedule, microbatches)
    except OptionError as exc:
        raise RuntimeError_(str(exc)) from exc


def _default_store() -> Any:
    """The default process group's store, or None."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def _why(exc: Exception, timeout: timedelta | None) -> str:
    """What a failed wait says about the peer, in a few words."""
    text = str(exc).lower()
    if any(k in text for k in ("connection closed", "connection reset", "broken pipe", "read error", "eof",
                               "socket closed", "connection refused")):
        return "stopped responding (connection closed)"
    if "timed out" in text or "timeout" in text:
        return f"did not answer within {timeout.total_seconds():g} s" if timeout is not None else "did not answer"
    return f"failed ({_first_line(exc)})"


def _await_culprit(store: Any, peers: Sequence[int], rank: int, why: str, timeout: timedelta | None) -> str | None:
    """For a failed collective: the rank another survivor named, or the one member that never marked itself."""
    deadline = time.monotonic() + min(3.0, timeout.total_seconds() if timeout is not None else 3.0)
    while True:
        if store.check(["fxpipe/fault/down"]):
            return store.get("fxpipe/fault/down").decode()
        silent = [r for r in peers if not store.check([f"fxpipe/fault/rank{r}"])]
        if len(silent) == 1:  # every other member is alive and failing too
            return store.compare_set("fxpipe/fault/down", "", f"{silent[0]}\t{rank}\t{why}").decode()
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"
