"""The single-process reference executor: runs F, B and W of every stage for a list of microbatches in any valid order.

It is the oracle the schedules and the distributed runtime are checked against: all stages
live in this process, values pass by name, and gradients accumulate into the stages' own
parameters (``param.grad``), so after a step they equal eager autograd on the same microbatches.

    ex = ReferenceExecutor(pipe, loss_fn)
    losses = ex.run([(inputs_0, target_0), (inputs_1, target_1)],
                    order=[(0, "F", 0), (1, "F", 0), (1, "B", 0), (0, "B", 0), (1, "W", 0), (0, "W", 0), ...])
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fxpipe.errors import FxpipeError
from fxpipe.graphs.convention import StageGraphs, loss_and_output_grads

Action = tuple[int, str, int]  # (stage_idx, "F" | "B" | "W" | "BW", mb_idx)


class ScheduleError(FxpipeError, ValueError):
    """An action ran before what it depends on, or twice."""


class ReferenceExecutor:
    """Runs a Pipeline's stages action by action; see the module docstring."""

    def __init__(self, pipe: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *, loss_scale: float | None = None) -> None:
        graphs = getattr(pipe, "stage_graphs", None)
        if graphs is None:
            raise FxpipeError("this pipeline has no F/B/W graphs; compile it with split_backward=True")
        self.pipe = pipe
        self.graphs: list[StageGraphs] = list(graphs)
        self.loss_fn = loss_fn
        self.loss_scale = loss_scale
        self.input_grads: list[dict[str, torch.Tensor]] = []

    def default_order(self, num_microbatches: int) -> list[Action]:
        """Every microbatch's F through all stages, then B (and W right after) from the last stage back."""
        stages = range(len(self.graphs))
        order: list[Action] = [(s, "F", m) for m in range(num_microbatches) for s in stages]
        for m in range(num_microbatches):
            for s in reversed(stages):
                if self.graphs[s].fused:
                    order.append((s, "BW", m))
                else:
                    order += [(s, "B", m), (s, "W", m)]
        return order

    def run_schedule(self, schedule: Any, microbatches: Sequence[tuple[Sequence[Any], Any]]) -> list[torch.Tensor]:
        """Run a ``fxpipe.schedules.Schedule``'s compute actions in the order its simulation executes them."""
        from fxpipe.schedules.simulate import Costs, simulate

        if schedule.num_stages != len(self.graphs) or schedule.num_microbatches != len(microbatches):
            raise ScheduleError(f"the schedule is for {schedule.num_stages} stages x {schedule.num_microbatches} "
                                f"microbatches, the pipeline has {len(self.graphs)} stages and {len(microbatches)} "
                                "microbatches were given")
        result = simulate(schedule, Costs.uniform(schedule.num_stages, 1.0, 1.0, 1.0))
        events = sorted((e for e in result.events if e.action.kind.value in ("F", "B", "W", "BW")),
                        key=lambda e: (e.start, e.rank))
        order = [(e.action.stage, e.action.kind.value, e.action.mb) for e in events]
        return self.run(microbatches, order=order)

    def run(self, microbatches: Sequence[tuple[Sequence[Any], Any]], order: Sequence[Action] | None = None) -> list[torch.Tensor]:
        """Run ``order`` (default: :meth:`default_order`) over ``(inputs, target)`` microbatches; returns the losses.

        The loss of each microbatch is scaled by ``loss_scale`` (default ``1 / len(microbatches)``)
        before its gradient flows back, so the accumulated gradients are those of the mean loss.
        """
        run = _Run(self, microbatches, self.loss_scale if self.loss_scale is not None else 1.0 / len(microbatches))
        for action in order if order is not None else self.default_order(len(microbatches)):
            run.do(action)
        run.check_finished()
        # Gradients of the model's own inputs, per microbatch (compiled with input_grads=True).
        self.input_grads = [{n: grad for n in self.pipe.input_names if (grad := g[n]) is not None} for g in run.grads]
        return run.losses


class _Run:
    def __init__(self, ex: ReferenceExecutor, microbatches: Sequence[tuple[Sequence[Any], Any]], scale: float) -> None:
        self.ex = ex
        self.pipe = ex.pipe
        self.mbs = microbatches
        self.scale = scale
        self.stages = self.pipe.stage_list()
        self.done: set[Action] = set()
        self.values: list[dict[str, Any]] = []
        for inputs, _ in microbatches:
            flat = _flatten(self.pipe, inputs)
            self.values.append(dict(zip(self.pipe.input_names, flat)))
        self.saved: dict[tuple[int, int], list[Any]] = {}
        self.handover: dict[tuple[int, int], tuple[Any, ...]] = {}
        self.grad_outs: dict[tuple[int, int], list[torch.Tensor]] = {}  # B's incoming gradients, for W's slots
        self.autograd: dict[tuple[int, int], tuple[list[torch.Tensor], list[Any]]] = {}
        self.grads: list[dict[str, torch.Tensor | None]] = [defaultdict(lambda: None) for _ in microbatches]
        self.losses: list[torch.Tensor] = [torch.tensor(float("nan")) for _ in microbatches]
        self.loss_done: set[int] = set()
        # Who reads each value with a gradient: later stages (their B hands it back) and the loss.
        self.readers: dict[str, list[int]] = defaultdict(list)
        for k, st in enumerate(self.stages):
            for name in st.inputs:
                self.readers[name].append(k)

    def do(self, action: Action) -> None:
        stage_idx, kind, mb = action
        if action in self.done:
            raise ScheduleError(f"{_fmt(action)} runs twice; every action runs once")
        if not 0 <= stage_idx < len(self.stages) or not 0 <= mb < len(self.mbs):
            raise ScheduleError(f"{_fmt(action)} names a stage or microbatch that does not exist")
        graphs = self.ex.graphs[stage_idx]
        if kind in ("B", "W") and graphs.fused:
            raise ScheduleError(f"{_fmt(action)}: stage {stage_idx} has a fused backward ({graphs.fused_reason}); use BW")
        if kind == "BW" and not graphs.fused:
            # A fused-backward schedule on split graphs: B then W, back to back.
            ran = [k for k in ("B", "W") if (stage_idx, k, mb) in self.done]
            if ran:
                raise ScheduleError(f"{_fmt(action)} repeats {stage_idx}{ran[0]}{mb}, which already ran; "
                                    "every action runs once")
            self._B(stage_idx, mb, graphs)
            self.done.add((stage_idx, "B", mb))
            self._W(stage_idx, mb, graphs)
            self.done.add((stage_idx, "W", mb))
        else:
            getattr(self, f"_{kind}")(stage_idx, mb, graphs)
        self.done.add(action)

    def check_finished(self) -> None:
        missing = [(s, kind, m) for s, g in enumerate(self.ex.graphs) for m in range(len(self.mbs))
                   for kind in (("F", "BW") if g.fused else ("F", "B", "W")) if (s, kind, m) not in self.done
                   and not (kind in ("B", "W") and (s, "BW", m) in self.done)]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ScheduleError(f"the order never runs {_fmt(missing[0])}{more}; "
                                "every microbatch needs F and B and W (or BW) on every stage")

    # -- actions ---------------------------------------------------------------------------

    def _F(self, s: int, m: int, g: StageGraphs) -> None:
        stage = self.stages[s]
        missing = [n for n in stage.inputs if n not in self.values[m]]
        if missing:
            raise ScheduleError(f"{_fmt((s, 'F', m))} needs {missing}, made by an earlier stage's F that has not run")
        args = [self.values[m][n] for n in stage.inputs]
        if g.fused:
            leaves = [a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point()
                      and n not in self.pipe.input_names else a for a, n in zip(args, stage.inputs)]
            with torch.enable_grad():
                outs = list(stage.module(*leaves))
            self.autograd[(s, m)] = (outs, leaves)
            outs = [o.detach() if isinstance(o, torch.Tensor) else o for o in outs]
        else:
            with torch.no_grad():
                result, self.saved[(s, m)] = g.run_forward(args)
            outs = list(result)
        self.values[m].update(zip(stage.outputs, outs))
        self._maybe_loss(m)

    def _maybe_loss(self, m: int) -> None:
        if m in self.loss_done or any(n is not None and n not in self.values[m] for n in self.pipe.output_names):
            return
        loss, grads = loss_and_output_grads(self.pipe, self.ex.loss_fn, self.values[m], self.mbs[m][1], scale=self.scale)
        for name, grad in grads:
            self._add_grad(m, name, grad)
        self.losses[m] = loss
        self.loss_done.add(m)

    def _B(self, s: int, m: int, g: StageGraphs) -> None:
        grad_outs = self._output_grads(s, m, [self.stages[s].outputs[i] for i in g.grad_outputs], "B")
        with torch.no_grad():
            input_grads, self.handover[(s, m)] = g.run_backward_input(self.saved[(s, m)], grad_outs)
        self.grad_outs[(s, m)] = grad_outs
        for pos, grad in zip(g.grad_inputs, input_grads):
            self._add_grad(m, self.stages[s].inputs[pos], grad)

    def _W(self, s: int, m: int, g: StageGraphs) -> None:
        if (s, "B", m) not in self.done:
            raise ScheduleError(f"{_fmt((s, 'W', m))} runs before {_fmt((s, 'B', m))}; W needs what B hands over")
        with torch.no_grad():
            grads = g.run_backward_weight(self.handover.pop((s, m)), self.saved.pop((s, m)), self.grad_outs.pop((s, m)))
        module = self.stages[s].module
        for name, grad in zip(g.param_names, grads):
            _accumulate(module.get_parameter(name), grad)

    def _BW(self, s: int, m: int, g: StageGraphs) -> None:
        stage = self.stages[s]
        outs, leaves = self.autograd.pop((s, m))
        pairs = [(o, stage.outputs[i]) for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
        grad_outs = self._output_grads(s, m, [n for _, n in pairs], "BW")
        params = [p for p in stage.module.parameters() if p.requires_grad]
        wrt_inputs = [(t, n) for t, n in zip(leaves, stage.inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], [t for t, _ in wrt_inputs] + params,
                                    grad_outputs=grad_outs, allow_unused=True)
        for (_, name), grad in zip(wrt_inputs, grads[: len(wrt_inputs)]):
            if grad is not None:
                self._add_grad(m, name, grad)
        for p, grad in zip(params, grads[len(wrt_inputs):]):
            if grad is not None:
                _accumulate(p, grad)

    # -- gradients of values ---------------------------------------------------------------

    def _output_grads(self, s: int, m: int, names: list[str], kind: str) -> list[torch.Tensor]:
        if (s, "F", m) not in self.done:
            raise ScheduleError(f"{_fmt((s, kind, m))} runs before {_fmt((s, 'F', m))}")
        grads = []
        for name in names:
            waiting = [k for k in self.readers[name] if not self._backward_done(k, m)]
            if waiting:
                raise ScheduleError(f"{_fmt((s, kind, m))} needs the gradient of {name} from stage {waiting[0]}'s "
                                    "backward, which has not run; B of a stage runs after B of the stages it feeds")
            if name in self.pipe.output_names and m not in self.loss_done:
                raise ScheduleError(f"{_fmt((s, kind, m))} runs before the loss of microbatch {m}")
            grad = self.grads[m][name]
            grads.append(grad if grad is not None else torch.zeros_like(self.values[m][name]))
        return grads

    def _backward_done(self, k: int, m: int) -> bool:
        return (k, "B", m) in self.done or (k, "BW", m) in self.done

    def _add_grad(self, m: int, name: str, grad: torch.Tensor) -> None:
        current = self.grads[m][name]
        self.grads[m][name] = grad if current is None else current + grad


def _accumulate(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad.detach().clone()
    else:
        param.grad.add_(grad)


def _flatten(pipe: Any, inputs: Sequence[Any]) -> list[Any]:
    from fxpipe.graphs.convention import flatten_inputs

    return flatten_inputs(pipe.in_spec, tuple(inputs), {})


def _fmt(action: Action) -> str:
    s, kind, m = action
    return f"{s}{kind}{m}"
