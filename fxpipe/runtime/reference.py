"""The single-process reference executor: runs F, B and W of every stage for a list of microbatches in any valid order.

It is the oracle the schedules and the distributed runtime are checked against: all stages
live in this process, values pass by name, and gradients accumulate into the stages' own
parameters (``param.grad``), so after a step they equal eager autograd on the same microbatches.

    ex = ReferenceExecutor(pipe, loss_fn)
    losses = ex.run([(inputs_0, target_0), (inputs_1, target_1)],
                    order=[(0, "F", 0), (1, "F", 0), (1, "B", 0), (0, "B", 0), (1, "W", 0), (0, "W", 0), ...])
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from fxpipe.errors import FxpipeError, OptionError, ScheduleOrderError
from fxpipe.graphs.convention import StageGraphs, flatten_inputs
from fxpipe.runtime.core import ActionRunner, GraphFacts, HeldBytes, InPlaceW, recompute_graphs
from fxpipe.schedules.ir import Action, Kind

logger = logging.getLogger(__name__)

Order = tuple[int, str, int]  # (stage_idx, "F" | "B" | "W" | "BW", mb_idx)


class ReferenceExecutor:
    """Runs a Pipeline's stages action by action; see the module docstring."""

    def __init__(self, pipe: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *, loss_scale: float | None = None,
                 track_memory: bool = False, codegen: str = "eager", w_in_place: bool = False,
                 recompute: Iterable[int] = ()) -> None:
        graphs = getattr(pipe, "stage_graphs", None)
        if graphs is None:
            raise FxpipeError("this pipeline has no F/B/W graphs; compile it with split_backward=True")
        self.pipe = pipe
        self.graphs: list[StageGraphs] = list(graphs)
        self.loss_fn = loss_fn
        self.loss_scale = loss_scale
        self.input_grads: list[dict[str, torch.Tensor]] = []
        self.outputs: list[list[Any]] = []  # after a run: each microbatch's model outputs, in pipe.output_names order
        # track_memory: after a run, each stage's peak bytes kept between actions (fxpipe.runtime.core.HeldBytes).
        self.track_memory = track_memory
        self.peak_held_bytes: list[int] = []
        # w_in_place: W writes .grad as the distributed runtime's does (InPlaceW); codegen: the graphs it runs.
        self.w_in_place: dict[int, InPlaceW] = {}
        if w_in_place:
            stages = pipe.stage_list()
            self.w_in_place = {s: InPlaceW(g, [stages[s].module.get_parameter(n) for n in g.param_names])
                               for s, g in enumerate(self.graphs) if not g.fused}
        # recompute: these stages keep only their inputs from F to B, where B runs their eager F again first
        self.recompute = recompute_graphs(self.graphs, recompute)
        self.codegen = self._compile(codegen)
        self._facts: GraphFacts | None = None  # what every run's core reads of the graphs once (set by the first)

    def _compile(self, codegen: str) -> str:
        """``codegen="inductor"``: every split stage's F, B, W (and W_set, W_acc with ``w_in_place``) through Inductor
        (``fxpipe.runtime.codegen``), as ``PipelineRuntime(codegen=)`` compiles its own; without a C++ compiler one
        warning and the eager graphs. Returns the codegen that runs."""
        from fxpipe.runtime.codegen import check_codegen, compile_stage, compiled

        fallback = check_codegen(codegen)
        if codegen == "eager":
            return codegen
        if fallback is not None:  # the machine's, not the caller's doing: a note on the logger, not a warning
            logger.warning(fallback)
            return "eager"
        self.graphs = [compile_stage(g) for g in self.graphs]
        for w in self.w_in_place.values():
            w.w_set, w.w_acc = compiled(w.w_set), compiled(w.w_acc)
        return codegen

    def default_order(self, num_microbatches: int) -> list[Order]:
        """Every microbatch's F through all stages, then B (and W right after) from the last stage back."""
        stages = range(len(self.graphs))
        order: list[Order] = [(s, "F", m) for m in range(num_microbatches) for s in stages]
        for m in range(num_microbatches):
            for s in reversed(stages):
                if self.graphs[s].fused:
                    order.append((s, "BW", m))
                else:
                    order += [(s, "B", m), (s, "W", m)]
        return order

    def run_schedule(self, schedule: Any, microbatches: Sequence[tuple[Sequence[Any], Any]]) -> list[torch.Tensor]:
        """Run a ``fxpipe.schedules.Schedule``'s compute actions in the order its simulation executes them."""
        if schedule.num_stages != len(self.graphs) or schedule.num_microbatches != len(microbatches):
            raise ScheduleOrderError(f"the schedule is for {schedule.num_stages} stages x {schedule.num_microbatches} "
                                f"microbatches, the pipeline has {len(self.graphs)} stages and {len(microbatches)} "
                                "microbatches were given")
        return self.run(microbatches, order=_simulated_order(schedule))

    def run_async(self, schedule: Any, microbatches: Sequence[tuple[Sequence[Any], Any]],
                  optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], *,
                  weights: str = "stash") -> list[torch.Tensor]:
        """Train on an asynchronous schedule (``schedule.synchronous`` is False): every stage steps its own
        optimizer (``optimizer(params)``) after each microbatch's W, and each phase reads the weights the
        ``weights`` policy gives (``fxpipe.runtime.weights``). Returns each microbatch's loss.

        ``self.optimizers`` and ``self.versions`` (its ``log`` of what each phase read) stay for inspection.
        """
        from fxpipe.runtime.weights import WeightVersions

        if schedule.synchronous:
            raise OptionError(f"{schedule.name} is synchronous; use run_schedule")
        if schedule.num_stages != len(self.graphs) or schedule.num_microbatches != len(microbatches):
            raise ScheduleOrderError(f"the schedule is for {schedule.num_stages} stages x {schedule.num_microbatches} "
                                     f"microbatches, the pipeline has {len(self.graphs)} stages and "
                                     f"{len(microbatches)} microbatches were given")
        check_async(self.pipe, self.graphs)
        if self.recompute:
            raise OptionError("asynchronous schedules read weight versions a recomputed forward would not see; "
                              "make the executor with recompute=()")
        run = self._runner(1.0)
        stages = {s: st.module for s, st in enumerate(self.pipe.stage_list())}
        run.optimizers = {s: optimizer(list(mod.parameters())) for s, mod in stages.items()
                          if any(True for _ in mod.parameters())}
        run.versions = WeightVersions(schedule, weights, stages, run.optimizers)
        self.optimizers, self.versions = run.optimizers, run.versions
        run.begin([dict(zip(self.pipe.input_names, _flatten(self.pipe, inputs))) for inputs, _ in microbatches],
                  [target for _, target in microbatches])
        with torch.no_grad():
            for stage_idx, kind, mb in _simulated_order(schedule):
                run.checked(stage_idx, kind, mb)
        run.check_finished()
        self.peak_held_bytes = list(run.held.peak) if run.held is not None else []
        return [loss if loss is not None else torch.tensor(float("nan")) for loss in run.losses]

    def _runner(self, loss_scale: float) -> _Checked:
        run = _Checked(self.pipe, self.graphs, self.loss_fn, loss_scale=loss_scale, facts=self._facts)
        self._facts = run.facts
        run.w_in_place = self.w_in_place
        run.again = self.recompute
        if self.track_memory:
            run.held = HeldBytes([st.module for st in run.stages])
        return run

    def run(self, microbatches: Sequence[tuple[Sequence[Any], Any]],
            order: Sequence[Order] | None = None) -> list[torch.Tensor]:
        """Run ``order`` (default: :meth:`default_order`) over ``(inputs, target)`` microbatches; returns the losses.

        The loss of each microbatch is scaled by ``loss_scale`` (default ``1 / len(microbatches)``)
        before its gradient flows back, so the accumulated gradients are those of the mean loss.
        """
        scale = self.loss_scale if self.loss_scale is not None else 1.0 / len(microbatches)
        run = self._runner(scale)
        run.begin([dict(zip(self.pipe.input_names, _flatten(self.pipe, inputs))) for inputs, _ in microbatches],
                  [target for _, target in microbatches])
        with torch.no_grad():  # the graphs are the backward; fused stages enable grad themselves
            for stage_idx, kind, mb in order if order is not None else self.default_order(len(microbatches)):
                run.checked(stage_idx, kind, mb)
        run.check_finished()
        self.peak_held_bytes = list(run.held.peak) if run.held is not None else []
        # Gradients of the model's own inputs, per microbatch (compiled with input_grads=True).
        self.input_grads = [{n: g[n] for n in self.pipe.input_names if n in g} for g in run.grads]
        self.outputs = [[v.get(n, c) if n is not None else c for n, c in zip(self.pipe.output_names,
                                                                             self.pipe.output_constants)]
                        for v in run.values]
        return [loss if loss is not None else torch.tensor(float("nan")) for loss in run.losses]


class _Checked(ActionRunner):
    """The core, refusing any action that runs before what it depends on, twice, or never."""

    w_in_place: dict[int, InPlaceW] = {}

    def weight(self, s: int, m: int, args: list[Any]) -> None:
        w = self.w_in_place.get(s)
        if w is None or not w.run(args):
            super().weight(s, m, args)

    def begin(self, inputs: Sequence[dict[str, Any]], targets: Sequence[Any]) -> None:
        super().begin(inputs, targets)
        self.done: set[tuple[int, str, int]] = set()
        # Who reads each value with a gradient: later stages (their B hands it back) and the loss.
        self.readers: dict[str, list[int]] = defaultdict(list)
        for k, st in enumerate(self.stages):
            for name in st.inputs:
                self.readers[name].append(k)

    def checked(self, stage_idx: int, kind: str, mb: int) -> None:
        action = (stage_idx, kind, mb)
        if action in self.done:
            raise ScheduleOrderError(f"{_fmt(action)} runs twice; every action runs once")
        if not 0 <= stage_idx < len(self.stages) or not 0 <= mb < len(self.values):
            raise ScheduleOrderError(f"{_fmt(action)} names a stage or microbatch that does not exist")
        if kind not in ("F", "B", "W", "BW"):
            raise ScheduleOrderError(f"{_fmt(action)}: unknown kind {kind!r}; use F, B, W or BW")
        g = self.graphs[stage_idx]
        if kind in ("B", "W") and g.fused:
            raise ScheduleOrderError(f"{_fmt(action)}: stage {stage_idx} has a fused backward ({g.fused_reason}); "
                                     "use BW")
        if kind == "BW" and not g.fused:
            ran = [k for k in ("B", "W") if (stage_idx, k, mb) in self.done]
            if ran:
                raise ScheduleOrderError(f"{_fmt(action)} repeats {stage_idx}{ran[0]}{mb}, which already ran; "
                                         "every action runs once")
        if kind == "F":
            missing = [n for n in self.stages[stage_idx].inputs if n not in self.values[mb]]
            if missing:
                raise ScheduleOrderError(f"{_fmt(action)} needs {missing}, made by an earlier stage's F that has "
                                         "not run")
        if kind in ("B", "BW"):
            self._check_output_grads(stage_idx, mb, kind)
        if kind == "W" and (stage_idx, "B", mb) not in self.done:
            raise ScheduleOrderError(f"{_fmt(action)} runs before {_fmt((stage_idx, 'B', mb))}; W needs what B "
                                     "hands over")
        self.run(Action(stage_idx, Kind(kind), mb))
        self.done.add(action)
        if kind == "BW" and not g.fused:
            self.done.update({(stage_idx, "B", mb), (stage_idx, "W", mb)})

    def _check_output_grads(self, s: int, m: int, kind: str) -> None:
        if (s, "F", m) not in self.done:
            raise ScheduleOrderError(f"{_fmt((s, kind, m))} runs before {_fmt((s, 'F', m))}")
        g, st = self.graphs[s], self.stages[s]
        positions = range(len(st.outputs)) if g.fused else g.grad_outputs
        for name in (st.outputs[j] for j in positions):
            waiting = [k for k in self.readers[name] if (k, "B", m) not in self.done and (k, "BW", m) not in self.done]
            if waiting:
                raise ScheduleOrderError(f"{_fmt((s, kind, m))} needs the gradient of {name} from stage {waiting[0]}'s "
                                         "backward, which has not run; "
                                         "B of a stage runs after B of the stages it feeds")
            if name in self.outputs and self.losses[m] is None:
                raise ScheduleOrderError(f"{_fmt((s, kind, m))} runs before the loss of microbatch {m}")

    def check_finished(self) -> None:
        missing = [(s, kind, m) for s, g in enumerate(self.graphs) for m in range(len(self.values))
                   for kind in (("F", "BW") if g.fused else ("F", "B", "W")) if (s, kind, m) not in self.done
                   and not (kind in ("B", "W") and (s, "BW", m) in self.done)]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ScheduleOrderError(f"the order never runs {_fmt(missing[0])}{more}; "
                                     "every microbatch needs F and B and W (or BW) on every stage")


def check_async(pipe: Any, graphs: Sequence[StageGraphs]) -> None:
    """Asynchronous training needs every stage split into F, B and W and no parameter shared by two stages."""
    fused = [s for s, g in enumerate(graphs) if g.fused]
    if fused:
        raise OptionError(f"stage {fused[0]} has a fused backward ({graphs[fused[0]].fused_reason}); asynchronous "
                          "training reads weight versions through the F, B and W graphs: compile with split_backward")
    if pipe.shared_params:
        name = next(iter(pipe.shared_params))
        raise OptionError(f"{name} is shared by stages {pipe.shared_params[name]}; asynchronous training steps each "
                          "stage on its own, which would update a tied weight from part of its gradient: untie it "
                          "or use a synchronous schedule")


def _simulated_order(schedule: Any) -> list[Order]:
    """A schedule's compute actions in the order its simulation (uniform costs) starts them."""
    from fxpipe.schedules.simulate import Costs, simulate

    result = simulate(schedule, Costs.uniform(schedule.num_stages, 1.0, 1.0, 1.0))
    events = sorted((e for e in result.events if e.action.kind.value in ("F", "B", "W", "BW")),
                    key=lambda e: (e.start, e.rank))
    return [(e.action.stage, e.action.kind.value, e.action.mb) for e in events]


def _flatten(pipe: Any, inputs: Sequence[Any]) -> list[Any]:
    return flatten_inputs(pipe.in_spec, tuple(inputs), {})


def _fmt(action: tuple[int, str, int]) -> str:
    s, kind, m = action
    return f"{s}{kind}{m}"
