"""Pipeline: the compiled stages as one nn.Module that runs them in order in this process."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.fx
import torch.utils._pytree as pytree

from fxpipe.errors import OptionError
from fxpipe.graphs.convention import StageGraphs, flatten_inputs
from fxpipe.graphs.stages import build_stage_graphs
from fxpipe.passes import CompileOptions, History, build_steps, run_steps
from fxpipe.report import Report


class Stage(torch.nn.Module):
    """One pipeline stage: a GraphModule that owns its parameters, and the names of its values."""

    def __init__(self, index: int, module: torch.fx.GraphModule, inputs: Sequence[str], outputs: Sequence[str],
                 graphs: StageGraphs | None = None) -> None:
        super().__init__()
        self.index = index
        self.module = module
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.graphs = graphs
        if graphs is not None and graphs.forward is not None:
            # ``stage.forward`` is the F graph itself (stage inputs -> outputs + saved tensors), as
            # split_backward documents; it is kept out of _modules so its shared parameters are
            # not listed twice.
            object.__setattr__(self, "forward", graphs.forward)

    def forward(self, *args: Any) -> tuple[Any, ...]:
        """Without a split backward: the stage's outputs (with one, the F graph replaces this)."""
        return tuple(self.module(*args))

    @property
    def backward_input(self) -> torch.fx.GraphModule | None:
        """B: saved tensors and output gradients -> input gradients and what W needs."""
        return None if self.graphs is None else self.graphs.backward_input

    @property
    def backward_weight(self) -> torch.fx.GraphModule | None:
        """W: what B handed over and saved tensors -> every parameter's gradient."""
        return None if self.graphs is None else self.graphs.backward_weight


class Pipeline(torch.nn.Module):
    """The stages of a compiled model; calling it runs them one after another, equal to the model.

    >>> pipe = fxpipe.compile(model, (x,), stages=2)
    >>> torch.testing.assert_close(pipe(x), model(x))
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        *,
        input_names: Sequence[str],
        output_names: Sequence[str | None],
        output_constants: Sequence[Any],
        in_spec: pytree.TreeSpec | None,
        out_spec: pytree.TreeSpec | None,
        shared_params: dict[str, list[int]],
        reports: Sequence[Report] = (),
        history: History | None = None,
        info: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.stages = torch.nn.ModuleList(stages)
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)
        self.output_constants = tuple(output_constants)
        self.in_spec = in_spec
        self.out_spec = out_spec
        self.shared_params = dict(shared_params)
        self._reports = tuple(reports)
        self.extra_reports: list[Report] = []  # tables added after compiling (the schedule's)
        self.history = history
        self.info = dict(info or {})

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat = flatten_inputs(self.in_spec, args, kwargs)
        if len(flat) != len(self.input_names):
            raise OptionError(
                f"the pipeline takes {len(self.input_names)} inputs ({', '.join(self.input_names)}), got {len(flat)}; "
                "call it as you called the model at compile time"
            )
        env: dict[str, Any] = dict(zip(self.input_names, flat))
        for stage in self.stage_list():
            results = stage.module(*(env[name] for name in stage.inputs))
            env.update(zip(stage.outputs, results))
        leaves = [env[n] if n is not None else c for n, c in zip(self.output_names, self.output_constants)]
        if self.out_spec is None:
            return tuple(leaves)
        return pytree.tree_unflatten(leaves, self.out_spec)

    @property
    def stage_graphs(self) -> list[StageGraphs] | None:
        """Each stage's F, B and W graphs (split_backward), or None when they were not built."""
        graphs = [s.graphs for s in self.stage_list()]
        return None if any(g is None for g in graphs) else graphs  # type: ignore[return-value]

    def set_schedule(self, name: str, microbatches: int | None = None, memory_cap: float | None = None) -> Any:
        """Generate (or search, for ``auto``) a schedule on this plan's costs, simulate it, record it in ``info``.

        Returns the simulation result; its tables join :meth:`report` and the plan directory.
        """
        from fxpipe.schedules.auto import choose
        from fxpipe.schedules.simulate import report

        sched, result, extra = choose(name, self.num_stages, microbatches, self.schedule_costs(), memory_cap)
        self.info["schedule"] = {"name": sched.name, "requested": name, "microbatches": sched.num_microbatches,
                                 "csv": sched.to_csv(), "makespan_s": result.makespan,
                                 "max_stage_span_s": result.max_stage_span}
        self.extra_reports = [*extra, report(result, sched)]
        return result

    def build_backward(self, example_inputs: Sequence[Any]) -> None:
        """Build each stage's F, B and W graphs (split_backward) on a pipeline that has none, e.g. one loaded from disk."""
        stages = self.stage_list()
        wiring = {"inputs": list(self.input_names),
                  "stages": [{"inputs": list(s.inputs), "outputs": list(s.outputs)} for s in stages]}
        flat = flatten_inputs(self.in_spec, tuple(example_inputs), {})
        for stage, g in zip(stages, build_stage_graphs([s.module for s in stages], wiring, flat)):
            stage.graphs = g
            if g.forward is not None:
                object.__setattr__(stage, "forward", g.forward)

    def schedule_costs(self) -> Any:
        """``fxpipe.schedules.simulate.Costs`` for this plan: per-stage F/B/W seconds, bytes, link."""
        from fxpipe.schedules.simulate import costs_from_info

        return costs_from_info(self.info)

    def stage_list(self) -> list[Stage]:
        """The stages, typed (iterating the ModuleList gives plain Modules)."""
        return [cast(Stage, s) for s in self.stages]

    def report(self) -> list[Report]:
        """Every pass's tables, in pass order, then the per-pass timing table."""
        if self.history is None:
            return list(self._reports)
        tables = [r for rec in self.history.records for r in rec.reports]
        return tables + self.extra_reports + [self.history.report()]

    def save(self, path: str | Path) -> Path:
        """Write the plan directory: plan.json plus a .py and a .pt file per stage."""
        from fxpipe.plan_dir import save_pipeline

        return save_pipeline(self, Path(path))


def compile(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    stages: int = 2,
    example_kwargs: dict[str, Any] | None = None,
    **options: Any,
) -> Pipeline:
    """Trace ``model``, cost and partition it into ``stages`` stages; returns the Pipeline.

    ``options`` are the fields of :class:`fxpipe.passes.CompileOptions` (``tracer``,
    ``granularity``, ``bandwidth``, ``latency``, ``memory_per_stage``, ``profile``, ...).
    Verification after every pass is on unless ``verify_each=False``.
    """
    options.setdefault("verify_each", True)
    unknown = sorted(set(options) - set(CompileOptions.__dataclass_fields__))
    if unknown:
        raise OptionError(f"unknown compile option(s) {unknown}; known: {sorted(CompileOptions.__dataclass_fields__)}")
    if options.get("stop_after") not in (None, "split-stages", "split-backward"):
        raise OptionError("compile() builds a Pipeline, so it runs every pass; use fxpipe.passes.run_steps to stop early")
    opts = CompileOptions(stages=stages, **options)
    root, history = run_steps(build_steps(model, example_inputs, opts, example_kwargs),
                              verify_each=opts.verify_each, print_after=opts.print_after)
    return pipeline_from_root(root, history, info={"options": opts.to_json()})


def _stage_costs(root: torch.fx.GraphModule) -> list[dict[str, float]]:
    """Per-stage F, B, W seconds and bytes for schedules, with the split graphs' view of B and W.

    A stage whose inputs need no gradient has an empty B (its activation gradients are W's work),
    so its per-layer B time moves to W; the split graphs' F->B and B->W bytes give its memory.
    """
    costs = [dict(c) for c in root.meta["fxpipe_stage_costs"]]
    graphs = root.meta.get("fxpipe_stage_graphs")
    timings = root.meta.get("fxpipe_stage_timings") or [None] * len(costs)
    for c, g, timed in zip(costs, graphs or [None] * len(costs), timings):
        c["held_fb"] = c["saved_bytes"]
        c["held_bw"] = c["saved_bytes"]
        if g is not None and not g.fused:
            if not g.grad_inputs:
                c["w"] += c["b"]
                c["b"] = 0.0
            c["held_fb"] = float(g.bytes_f_to_b)
            c["held_bw"] = float(g.bytes_b_to_w)
        if timed is not None:  # profiled: the stage's own F, B and W graphs, timed whole (split-backward)
            c["f"], c["b"], c["w"] = (float(t) for t in timed)
    return costs


def pipeline_from_root(root: torch.fx.GraphModule, history: History | None, info: dict[str, Any] | None = None) -> Pipeline:
    """Wrap the split-stages root graph as a Pipeline."""
    wiring = root.meta["fxpipe_wiring"]
    graphs = root.meta.get("fxpipe_stage_graphs") or [None] * len(wiring["stages"])
    stage_list = [
        Stage(k, getattr(root, f"stage_{k}"), w["inputs"], w["outputs"], graphs[k]) for k, w in enumerate(wiring["stages"])
    ]
    plan = root.meta.get("fxpipe_stage_plan")
    extra = dict(info or {})
    if plan is not None:
        extra.update(bottleneck_s=plan.bottleneck, lower_bound_s=plan.lower_bound, bounds=list(plan.bounds),
                     stage_times_s=list(plan.stage_times))
    extra["tracer"] = root.meta.get("fxpipe_tracer")
    if "fxpipe_stage_costs" in root.meta:
        extra["stage_costs"] = _stage_costs(root)
        extra["link"] = root.meta.get("fxpipe_link", {})
    return Pipeline(
        stage_list,
        input_names=wiring["inputs"],
        output_names=wiring["outputs"],
        output_constants=wiring["constants"],
        in_spec=root.meta.get("fxpipe_in_spec"),
        out_spec=root.meta.get("fxpipe_out_spec"),
        shared_params=root.meta.get("fxpipe_shared_params", {}),
        history=history,
        info=extra,
    )
