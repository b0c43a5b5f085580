"""PipelineRuntime: one rank's program of a schedule, run over torch.distributed with asynchronous send/recv.

Every rank builds the same Pipeline (same model, seed and options) and the same Schedule, and
runs only its own stages and actions. Receives are posted at the start of the step into buffers
shaped from the stage graphs; sends are ``isend`` and completed at the end of the step; each
message is tagged with its action, stage, microbatch and value, so any valid order matches.
Values that skip stages go straight from their producer's rank to every consumer's rank.
Gradients of parameters held by several ranks (tied weights) are summed across those ranks
before the optimizer step. A peer that fails makes the others stop at the process group's
timeout with an error naming the peer and the message they waited for.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import time

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from fxpipe.errors import FxpipeError
from fxpipe.schedules.ir import COMPUTE, Action, Kind, Schedule

class RuntimeError_(FxpipeError, RuntimeError):
    """A rank could not finish its step (a peer failed, timed out, or the plan and schedule disagree)."""


class PipelineRuntime:
    """Trains one mini-batch per :meth:`step` on this rank's stages of ``pipe`` under ``schedule``."""

    def __init__(self, pipe: Any, schedule: Schedule, loss_fn: Callable[[Any, Any], torch.Tensor], *,
                 optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
                 timeout: timedelta | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError_("PipelineRuntime needs torch.distributed initialised (torchrun, or init_process_group)")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
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
        self.program = [a for a in schedule.ranks[self.rank] if a.kind in COMPUTE]
        self.mine = [s for s in range(schedule.num_stages) if self.where[s] == self.rank]
        self.producer: dict[str, int] = {n: -1 for n in pipe.input_names}
        for s, st in enumerate(self.stages):
            for n in st.outputs:
                self.producer[n] = s
        self.consumers: dict[str, list[int]] = defaultdict(list)
        for s, st in enumerate(self.stages):
            for n in st.inputs:
                self.consumers[n].append(s)
        self.value_index = {n: k for k, n in enumerate(sorted(self.producer))}  # identical on every rank
        last_rank = self.where[-1]
        for n in pipe.output_names:
            if n is not None and self.producer.get(n, -1) >= 0 and self.where[self.producer[n]] != last_rank:
                raise RuntimeError_(f"model output {n} is made on rank {self.where[self.producer[n]]}, not on the last "
                                    "stage's rank; the runtime computes the loss on the last stage")
        params: dict[int, torch.nn.Parameter] = {}
        for s in self.mine:
            for p in self.stages[s].module.parameters():
                params.setdefault(id(p), p)
        self.params = list(params.values())
        # A rank whose stages hold no parameters (an activation alone) has nothing to step.
        self.optimizer = (optimizer or (lambda ps: torch.optim.SGD(ps, lr=0.01)))(self.params) if self.params else None
        # Tied parameters held on several ranks: one group each (created by every rank, in one order).
        self.shared: list[tuple[torch.nn.Parameter, Any]] = []
        for name, holders in sorted(pipe.shared_params.items()):
            ranks = sorted({self.where[k] for k in holders})
            if len(ranks) < 2:
                continue
            group = dist.new_group(ranks)
            if self.rank in ranks:
                k = next(k for k in holders if self.where[k] == self.rank)
                self.shared.append((self.stages[k].module.get_parameter(name), group))

    # -- one step -------------------------------------------------------------------------

    def step(self, inputs: Sequence[Any], target: Any) -> torch.Tensor:
        """One mini-batch: every microbatch's F, B and W on this rank's stages, then the optimizer step.

        Returns the mean loss over microbatches (the same value on every rank).
        """
        from fxpipe.pipeline import flatten_inputs, split_batch

        m = self.schedule.num_microbatches
        flat, spec = pytree.tree_flatten(tuple(inputs))
        fix = f"pick a batch that is a multiple of {m}"
        parts = [split_batch(x, m, fix=fix) for x in flat]
        targets = split_batch(target, m, fix=fix)
        env: list[dict[str, Any]] = []
        for i in range(m):
            args = pytree.tree_unflatten([p[i] for p in parts], spec)
            env.append(dict(zip(self.pipe.input_names, flatten_inputs(self.pipe.in_spec, tuple(args), {}))))
        grads: list[dict[str, torch.Tensor]] = [{} for _ in range(m)]
        saved: dict[tuple[int, int], list[Any]] = {}
        handover: dict[tuple[int, int], tuple[Any, ...]] = {}
        out_grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._waited: set[int] = set()
        recvs = self._post_receives()
        sends: list[Any] = []
        loss_sum = torch.zeros((), dtype=torch.float64)
        # Sends go out right after the compute that makes them, receives are waited for right
        # before the compute that reads them: the placement with_communication gives the
        # schedule's SEND/RECV actions, generalised to values that skip stages.
        self.events: list[tuple[Action, float, float]] = []  # this step's compute actions, seconds from its start
        start = time.perf_counter()
        for action in self.program:
            t0 = time.perf_counter() - start
            loss_sum += self._act(action, env, grads, saved, handover, out_grads, recvs, sends, targets, m)
            self.events.append((action, t0, time.perf_counter() - start))
        for work in sends:
            work.wait()
        for p, group in self.shared:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)
        return loss_sum / m  # float64: the mean over microbatches, summed in double

    def _act(self, action: Action, env: list[dict[str, Any]], grads: list[dict[str, torch.Tensor]],
             saved: dict[tuple[int, int], list[Any]], handover: dict[tuple[int, int], tuple[Any, ...]],
             out_grads: dict[tuple[int, int], list[torch.Tensor]], recvs: Any, sends: list[Any], targets: list[Any],
             m: int) -> torch.Tensor:
        """Run one compute action, with its receives before and its sends after; returns its loss (or 0)."""
        s, kind, i = action.stage, action.kind, action.mb
        st, g = self.stages[s], self.graphs[s]
        loss_sum = torch.zeros((), dtype=torch.float64)
        if kind is Kind.F:
            for name, buf in self._wait(recvs.pop((0, s, i), []), action):
                env[i][name] = buf
            result = g.forward(*(env[i][n] for n in st.inputs))  # type: ignore[misc]
            env[i].update(zip(st.outputs, result[: g.num_outputs]))
            saved[(s, i)] = list(result[g.num_outputs:])
            if s == self.schedule.num_stages - 1:
                loss_sum += self._loss(env[i], targets[i], grads[i], m).double()
            for name in st.outputs:
                for dst in sorted({self.where[c] for c in self.consumers[name]} - {self.rank}):
                    sends.append(dist.isend(env[i][name].contiguous(), dst, tag=self._tag(0, s, i, name)))
        elif kind in (Kind.B, Kind.BW):
            for name, buf in self._wait(recvs.pop((1, s, i), []), action):
                grads[i][name] = buf if name not in grads[i] else grads[i][name] + buf
            for name, grad in self._backward_input(s, i, env, grads, saved, handover, out_grads):
                src = self.producer[name]
                if src >= 0 and self.where[src] != self.rank:
                    # This stage's own share, sent on its own: another stage of this rank that
                    # reads the same value sends its share separately, and the producer sums them.
                    sends.append(dist.isend(grad.contiguous(), self.where[src], tag=self._tag(1, s, i, name)))
                else:
                    grads[i][name] = grad if name not in grads[i] else grads[i][name] + grad
            if kind is Kind.BW:
                self._backward_weight(s, i, saved, handover, out_grads)
        elif kind is Kind.W:
            self._backward_weight(s, i, saved, handover, out_grads)
        return loss_sum

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
        """This rank's stage parameters (by name) and optimizer state."""
        named = {n: p for s in self.mine for n, p in self.stages[s].module.named_parameters()}
        return {"rank": self.rank, "params": {n: p.detach().clone() for n, p in named.items()},
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        named = {n: p for s in self.mine for n, p in self.stages[s].module.named_parameters()}
        with torch.no_grad():
            for n, t in state["params"].items():
                named[n].copy_(t)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])

    # -- pieces ---------------------------------------------------------------------------

    def _loss(self, values: dict[str, Any], target: Any, grads: dict[str, torch.Tensor], m: int) -> torch.Tensor:
        leaves = [values[n].detach().requires_grad_(values[n].is_floating_point()) if n is not None else c
                  for n, c in zip(self.pipe.output_names, self.pipe.output_constants)]
        out = pytree.tree_unflatten(leaves, self.pipe.out_spec) if self.pipe.out_spec is not None else tuple(leaves)
        with torch.enable_grad():
            loss = self.loss_fn(out, target)
            diff = [(n, t) for n, t in zip(self.pipe.output_names, leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
            got = torch.autograd.grad(loss / m, [t for _, t in diff], allow_unused=True)
        for (name, _), g in zip(diff, got):
            if g is not None:
                grads[name] = g if name not in grads else grads[name] + g
        return loss.detach()

    def _backward_input(self, s: int, i: int, env: list[dict[str, Any]], grads: list[dict[str, torch.Tensor]],
                        saved: dict[tuple[int, int], list[Any]], handover: dict[tuple[int, int], tuple[Any, ...]],
                        out_grads: dict[tuple[int, int], list[torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Run B; returns the gradient of each of the stage's inputs that takes one."""
        st, g = self.stages[s], self.graphs[s]
        og = [grads[i][st.outputs[j]] if st.outputs[j] in grads[i] else torch.zeros_like(env[i][st.outputs[j]])
              for j in g.grad_outputs]
        sv = saved[(s, i)]
        result = g.backward_input(*(sv[k] if kind == "saved" else og[k] for kind, k in g.b_slots))  # type: ignore[misc]
        handover[(s, i)] = tuple(result[len(g.grad_inputs):])
        out_grads[(s, i)] = og
        return [(st.inputs[pos], grad) for pos, grad in zip(g.grad_inputs, result[: len(g.grad_inputs)])]

    def _backward_weight(self, s: int, i: int, saved: dict[tuple[int, int], list[Any]],
                         handover: dict[tuple[int, int], tuple[Any, ...]],
                         out_grads: dict[tuple[int, int], list[torch.Tensor]]) -> None:
        g, module = self.graphs[s], self.stages[s].module
        sv, og = saved.pop((s, i)), out_grads.pop((s, i))
        result = g.backward_weight(*handover.pop((s, i)),  # type: ignore[misc]
                                   *(sv[k] if kind == "saved" else og[k] for kind, k in g.w_slots))
        for name, grad in zip(g.param_names, result):
            p = module.get_parameter(name)
            p.grad = grad.detach().clone() if p.grad is None else p.grad.add_(grad)

    def _post_receives(self) -> dict[tuple[int, int, int], list[tuple[str, torch.Tensor, Any, int]]]:
        """Every message this rank will receive this step, posted now into buffers shaped from the graphs.

        Keyed (0, stage, mb) for a stage's inputs made on other ranks, (1, stage, mb) for the
        gradients of its outputs sent back by readers on other ranks.
        """
        posted: dict[tuple[int, int, int], list[tuple[str, torch.Tensor, Any, int]]] = defaultdict(list)
        for i in range(self.schedule.num_microbatches):
            # A value is sent once to each rank that reads it, however many of its stages do.
            arriving: dict[str, tuple[str, torch.Tensor, Any, int]] = {}
            for s in self.mine:
                st, g = self.stages[s], self.graphs[s]
                for pos, name in enumerate(st.inputs):
                    src = self.producer[name]
                    if src >= 0 and self.where[src] != self.rank:
                        if name not in arriving:
                            buf = _empty_like(_input_vals(g)[pos])
                            work = dist.irecv(buf, self.where[src], tag=self._tag(0, src, i, name))
                            arriving[name] = (name, buf, work, self.where[src])
                        posted[(0, s, i)].append(arriving[name])
                outs = _output_vals(g)
                for j in g.grad_outputs:
                    name = st.outputs[j]
                    for c in self.consumers[name]:
                        if self.where[c] == self.rank or name not in [self.stages[c].inputs[p]
                                                                       for p in self.graphs[c].grad_inputs]:
                            continue
                        buf = _empty_like(outs[j])
                        work = dist.irecv(buf, self.where[c], tag=self._tag(1, c, i, name))
                        posted[(1, s, i)].append((name, buf, work, self.where[c]))
        return posted

    def _wait(self, items: list[tuple[str, torch.Tensor, Any, int]], action: Action) -> list[tuple[str, torch.Tensor]]:
        out = []
        for name, buf, work, peer in items:
            if id(work) in self._waited:  # shared by two stages of this rank
                out.append((name, buf))
                continue
            self._waited.add(id(work))
            try:
                work.wait() if self.timeout is None else work.wait(self.timeout)
            except Exception as exc:
                raise RuntimeError_(f"rank {self.rank} waited for {name} from rank {peer} at {action} and gave up "
                                    f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); rank {peer} failed "
                                    "or is stuck: see its error") from exc
            out.append((name, buf))
        return out

    def _tag(self, direction: int, stage: int, mb: int, name: str) -> int:
        """The same number on sender and receiver: direction, sending stage, microbatch, value."""
        s, m = self.schedule.num_stages, self.schedule.num_microbatches
        return ((direction * s + stage) * m + mb) * len(self.value_index) + self.value_index[name]


def _input_vals(g: Any) -> list[Any]:
    return [n.meta.get("val") for n in g.forward.graph.nodes if n.op == "placeholder"]


def _output_vals(g: Any) -> list[Any]:
    out = next(n for n in reversed(g.forward.graph.nodes) if n.op == "output")
    return [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in out.args[0][: g.num_outputs]]


def _empty_like(val: Any) -> torch.Tensor:
    if not isinstance(val, torch.Tensor):
        raise RuntimeError_("a value crossing ranks is not a tensor; only tensors can be sent between stages")
    return torch.empty(tuple(val.shape), dtype=val.dtype, device="cpu" if val.device.type == "meta" else val.device)
