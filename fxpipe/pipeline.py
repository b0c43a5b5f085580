"""Pipeline: the compiled stages as one nn.Module that runs them in order in this process."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, cast

import torch
import torch.fx

from fxpipe._compat import autocast_forward, pytree
from fxpipe.errors import OptionError
from fxpipe.graphs.convention import StageGraphs, StageInterface, flatten_inputs
from fxpipe.graphs.moves import apply_recorded
from fxpipe.graphs.stages import build_stage_graphs
from fxpipe.plan import Plan
from fxpipe.report import Report


class Stage(torch.nn.Module):
    """One pipeline stage: a GraphModule that owns its parameters, and the names of its values."""

    def __init__(self, index: int, module: torch.fx.GraphModule, inputs: Sequence[str], outputs: Sequence[str],
                 graphs: StageGraphs | None = None, interface: StageInterface | None = None) -> None:
        super().__init__()
        self.index = index
        self.module = module
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.graphs = graphs
        # A loaded plan's record of the stage's gradients in and out (plan.json), so that a rank can
        # build the F, B and W of its own stages only; None when the plan has none.
        self.interface = interface
        # A loaded plan's record of the stage's F, B and W graphs (``plan_dir.StoredGraphs``): a rank running the
        # plan as compiled reads them instead of tracing (``plan_dir.stored_stage_graphs``); None when it has none.
        self.stored_graphs: Any = None
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

    Made by :func:`fxpipe.compile` and :func:`fxpipe.load`, not by hand; the arguments are what the passes decided.

    >>> pipe = fxpipe.compile(model, (x,), stages=2)
    >>> torch.testing.assert_close(pipe(x), model(x))

    Args:
        stages: The stages in order.
        input_names: The model's flat inputs, as the stages name them.
        output_names: Each flat output's value name; None where the output is a constant.
        output_constants: The constant of each output whose name is None.
        in_spec: How the call's args and kwargs flatten (pytree); None: a flat tuple.
        out_spec: How the flat outputs rebuild the model's output structure; None: a tuple.
        shared_params: Tied parameters: name -> the stages that hold it.
        plan: What was decided: costs, stages, link, mesh, schedule (:class:`fxpipe.plan.Plan`).
        reports: The passes' tables of a loaded pipeline (a compiled one reads them from ``history``).
        history: The passes' History of the compile that made it; None when loaded.
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
        plan: Plan,
        reports: Sequence[Report] = (),
        history: Any = None,
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
        self.history = history  # the passes' History of the compile that made it (None when loaded)
        self.plan = plan  # what was decided: costs, stages, link, mesh, schedule (fxpipe.plan.Plan)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the stages in order in this process.

        Args:
            *args: The model's positional inputs, as at compile time.
            **kwargs: Its keyword inputs.

        Returns:
            The model's outputs, in the model's structure.

        Raises:
            OptionError: A call whose inputs do not flatten to the compiled ones.
        """
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

    def build_backward(self, example_inputs: Sequence[Any], *, only: Collection[int] | None = None,
                       autocast: tuple[str, torch.dtype] | None = None, input_grads: bool = False,
                       example_kwargs: dict[str, Any] | None = None) -> list[StageGraphs]:
        """Build each stage's F, B and W graphs (split_backward) on a pipeline that has none, e.g. one loaded from disk.

        ``only``: the stages one rank runs. Of the others, where the plan records their interface
        (``Stage.interface``), only that is built (``StageGraphs.remote``) and they keep no graphs;
        this rank skips tracing them. A stage that already has graphs keeps them (a second runtime on
        the same pipeline, with another placement, splits only what it lacks). The plan's
        ``--balance-backward`` moves (``Plan.backward_moves``) are made again on the graphs split here:
        a move changes the stages on both sides of its cut, so a rank splits its neighbours across
        moved cuts too.

        Args:
            example_inputs: One microbatch's inputs, to trace with.
            only: The stages one rank runs; None: all.
            autocast: ``(device type, dtype)`` for mixed precision. Every needed stage is traced afresh under
                ``torch.autocast``, so F holds the casts and B/W their gradients (back to the fp32 parameters);
                the graphs are returned, not kept (the stages keep their fp32 ones).
            input_grads: Whether the first stage's inputs take a gradient, as compile's.
            example_kwargs: Keyword inputs of the example, as compile's.

        Returns:
            Every stage's graphs, interface-only ones included.

        Raises:
            OptionError: ``autocast`` on a plan compiled with ``--balance-backward`` (its moves are made on fp32
                graphs).
        """
        if autocast is not None:
            if self.plan is not None and self.plan.backward_moves:
                raise OptionError("this plan was compiled with --balance-backward, whose moves are made on fp32 "
                                  "graphs; train it in fp32, or compile it again without --balance-backward")
            stages = self.stage_list()
            wiring = {"inputs": list(self.input_names),
                      "stages": [{"inputs": list(s.inputs), "outputs": list(s.outputs)} for s in stages]}
            with autocast_forward(*autocast):
                flat = flatten_inputs(self.in_spec, tuple(example_inputs), dict(example_kwargs or {}))
                return build_stage_graphs([s.module for s in stages], wiring, flat, only=only,
                                          interfaces=[s.interface for s in stages], input_grads=input_grads)
        stages = self.stage_list()
        wiring = {"inputs": list(self.input_names),
                  "stages": [{"inputs": list(s.inputs), "outputs": list(s.outputs)} for s in stages]}
        flat = flatten_inputs(self.in_spec, tuple(example_inputs), {})
        moves = [(m.cut, m.value) for m in (self.plan.backward_moves if self.plan is not None else ())
                 if stages[m.cut].graphs is None or stages[m.cut + 1].graphs is None]  # made already where both are
        mine = set(range(len(stages))) if only is None else set(only)
        needed = set(mine)  # and, through moved cuts, the stages whose moves change them (as compile made them)
        while grown := {k + d for k, _ in moves for d in (0, 1) if {k, k + 1} & needed} - needed:
            needed |= grown
        built = [s.graphs for s in stages]
        for k, _ in moves:  # both sides of a cut still to move are split afresh, then moved together
            built[k] = built[k + 1] = None
        graphs = build_stage_graphs([s.module for s in stages], wiring, flat, only=needed,
                                    interfaces=[s.interface for s in stages], built=built)
        if moves:
            made = [(k, v) for k, v in moves if not (graphs[k].remote or graphs[k + 1].remote)]
            graphs = apply_recorded(graphs, wiring, made)
        for stage, g in zip(stages, graphs):
            if g.remote:
                continue
            stage.graphs = g
            if g.forward is not None:
                object.__setattr__(stage, "forward", g.forward)
        return graphs

    def to_device(self, device: torch.device | str) -> Pipeline:
        """Move the pipeline to ``device`` in place, e.g. a plan loaded on the CPU to a rank's GPU; returns it.

        Every stage module's parameters, buffers and the tensor constants its get_attr nodes read
        (which ``Module.to`` leaves behind) become copies on ``device``; a parameter several stages
        share (``shared_params``: tied weights) stays one Parameter that they all hold. The
        ``torch.device`` literals the graphs recorded where the pipeline was (``device=cpu`` of
        factory ops such as arange or full, traced at compile time) name ``device``, and the
        modules are recompiled. F, B and W graphs already built are moved the same way; move
        before a runtime is built on the pipeline (its optimizers hold the parameters). Gradients
        are not kept.

        Args:
            device: Where the pipeline goes.

        Returns:
            The pipeline itself.

        Raises:
            OptionError: A pipeline whose tensors are on more than one device.
        """
        from fxpipe.graphs.fx import move_module

        stages = self.stage_list()
        modules = [s.module for s in stages]
        for s in stages:
            if s.graphs is not None and not s.graphs.remote:
                modules += [m for m in (s.graphs.forward, s.graphs.backward_input, s.graphs.backward_weight)
                            if m is not None]
        homes = {t.device for m in modules for t in (*m.parameters(), *m.buffers())}
        if len(homes) > 1:
            raise OptionError(f"the pipeline's tensors are on {', '.join(sorted(map(str, homes)))}; to_device moves a "
                              "pipeline that is on one device (fxpipe.load and fxpipe.compile make one)")
        home = homes.pop() if homes else torch.device("cpu")
        target = torch.empty(0, device=device).device  # "cuda" -> cuda:N, as tensors report it
        made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for m in modules:
            move_module(m, home, target, made)
        self.output_constants = tuple(c.to(target) if isinstance(c, torch.Tensor) else c
                                      for c in self.output_constants)
        return self

    def stage_list(self) -> list[Stage]:
        """The stages, typed (iterating the ModuleList gives plain Modules)."""
        return [cast(Stage, s) for s in self.stages]

    def report(self) -> list[Report]:
        """Every pass's tables, in pass order, then the per-pass timing table."""
        if self.history is None:
            return list(self._reports)
        tables = [r for rec in self.history.records for r in rec.reports]
        return tables + self.extra_reports + [self.history.report()]

