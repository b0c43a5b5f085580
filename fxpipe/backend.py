"""``torch.compile(model, backend="fxpipe")``: the model's stages run microbatch by microbatch, B and W split.

Registered through the ``torch_dynamo_backends`` entry point, so no ``import fxpipe`` is needed.
Dynamo hands the backend one graph per frame; fxpipe needs the whole model in one graph, so a
graph break is an error naming its source line. The backend then compiles the module whose
``forward`` Dynamo traced with the same passes as ``fxpipe compile`` (torch.export at the
microbatch shape, costs, partition, split, backward split), and returns a callable that:

    forward:  splits every batch-major input into microbatches and runs F of every stage for
              every microbatch (stage i on the device of its parameters; copies between devices
              go through fxpipe.runtime.streams), concatenating the outputs;
    backward: (autograd reaches the compiled region) runs each microbatch's B from the last stage
              to the first, deferring each W by one microbatch into the gap, and returns every
              parameter's gradient to autograd.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.errors import FxpipeError, OptionError, TraceError
from fxpipe.report import Report

_LAST: list[Any] = []  # the most recent compilation's Pipeline
# devices: where stage k runs (devices[k % len]); its parameters are moved there. Unset: each stage
# runs where its parameters already are (the whole model's device, unless the user placed layers).
OPTIONS = ("stages", "devices", "microbatches", "schedule", "verbose")


def last_report() -> list[Report]:
    """The pass tables of the most recent ``backend="fxpipe"`` compilation, as ``fxpipe compile`` shows them."""
    if not _LAST:
        raise FxpipeError("nothing has been compiled with backend='fxpipe' yet; call the compiled model first")
    return _LAST[-1].report()


def fxpipe_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
                   options: dict[str, Any] | None = None) -> Any:
    """The Dynamo backend: see the module docstring."""
    opts = dict(options or {})
    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown:
        raise OptionError(f"unknown fxpipe backend option(s) {unknown}; known: {', '.join(OPTIONS)}")
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is not None and getattr(reason, "graph_break", False):
        where = reason.user_stack[-1] if reason.user_stack else None
        at = f" at {where.filename}:{where.lineno} `{(where.line or '').strip()}`" if where else ""
        raise TraceError(f"backend='fxpipe' needs the whole model in one graph, but Dynamo broke it{at} "
                         f"({reason.reason.splitlines()[0]}); remove the break (torch.compile(..., fullgraph=True) "
                         "shows it) or write data-dependent branches with torch.cond")
    module, args, kwargs = _traced_call()
    stages = int(opts.get("stages", 2))
    flat_args, spec = pytree.tree_flatten((args, kwargs))
    batch = next((a.shape[0] for a in flat_args if isinstance(a, torch.Tensor) and a.dim() > 0), 1)
    # Default: the stage count, or the largest count below it that divides the batch.
    microbatches = int(opts.get("microbatches", max(d for d in range(1, stages + 1) if batch % d == 0)))
    schedule = str(opts.get("schedule", "zb-gpipe"))
    if schedule not in ("zb-gpipe", "gpipe"):
        raise OptionError(f"backend='fxpipe' runs schedule 'zb-gpipe' (W deferred into the gaps) or 'gpipe' "
                          f"(W right after B), not {schedule!r}")
    first = _microbatches(flat_args, microbatches)[0]
    m_args, m_kwargs = pytree.tree_unflatten(first, spec)
    input_grads = any(isinstance(a, torch.Tensor) and a.requires_grad and not isinstance(a, torch.nn.Parameter)
                      for a in flat_args)

    from fxpipe.pipeline import compile as fx_compile

    pipe = fx_compile(module, m_args, example_kwargs=m_kwargs, stages=stages, input_grads=input_grads,
                      verify_each=False)
    if pipe.stage_graphs is None:
        raise FxpipeError("split_backward built no stage graphs; this is an fxpipe bug, please report it")
    if opts.get("devices"):
        _place(pipe, [torch.device(d) for d in opts["devices"]])
    pipe.extra_reports = [_memory_report(pipe, microbatches)]
    _LAST[:] = [pipe]
    if opts.get("verbose"):
        from fxpipe.render import render_text

        print("\n\n".join(render_text(r) for r in pipe.report()), file=sys.stderr)

    # Which of Dynamo's inputs are the call's tensors (by identity), and which are parameters.
    placeholders = list(example_inputs)
    arg_pos = {id(a): i for i, a in enumerate(flat_args) if isinstance(a, torch.Tensor)}
    user_slots = [(k, arg_pos[id(v)]) for k, v in enumerate(placeholders) if id(v) in arg_pos]
    param_slots = [k for k, v in enumerate(placeholders) if isinstance(v, torch.nn.Parameter)]
    graph_outputs = len(next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0])
    runner = _Runner(pipe, microbatches, spec, len(flat_args), [placeholders[k] for k in param_slots],
                     schedule == "zb-gpipe")

    def compiled(*inputs: Any) -> Any:
        flat = list(flat_args)
        for k, i in user_slots:
            flat[i] = inputs[k]
        params = [inputs[k] for k in param_slots]
        outs = _Pipelined.apply(runner, len(flat), *flat, *params)
        outs = outs if isinstance(outs, tuple) else (outs,)
        if len(outs) != graph_outputs:
            raise FxpipeError(f"the pipeline returns {len(outs)} tensors where Dynamo's graph returns {graph_outputs}; "
                              "return tensors (or a structure of them) from forward")
        return outs

    return compiled


def _traced_call() -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    """The module and arguments of the frame Dynamo is compiling (its ``forward`` call)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    code, loc = tx.f_code, tx.f_locals
    names = code.co_varnames
    pos = [loc[names[i]] for i in range(code.co_argcount)]
    n = code.co_argcount + code.co_kwonlyargcount
    kwargs = {names[i]: loc[names[i]] for i in range(code.co_argcount, n)}
    if code.co_flags & inspect.CO_VARARGS:
        pos += list(loc[names[n]])
        n += 1
    if code.co_flags & inspect.CO_VARKEYWORDS:
        kwargs.update(loc[names[n]])
    if pos and isinstance(pos[0], torch.nn.Module):
        return pos[0], tuple(pos[1:]), kwargs
    # Dynamo may enter through a wrapper that calls the module (``inner(*args, **kwargs)`` with the
    # module as ``fn``): the module is the one nn.Module among the frame's locals.
    held = [v for v in loc.values() if isinstance(v, torch.nn.Module)]
    if len(held) != 1:
        raise TraceError(f"backend='fxpipe' compiles an nn.Module's forward, but Dynamo is compiling "
                         f"{code.co_name}() of {code.co_filename}; compile the module: torch.compile(model, ...)")
    return held[0], tuple(pos), kwargs


def _place(pipe: Any, devices: list[torch.device]) -> None:
    """Put stage k's parameters and buffers on ``devices[k % len(devices)]`` (in place: same Parameter objects)."""
    for stage in pipe.stage_list():
        device = devices[stage.index % len(devices)]
        for t in [*stage.module.parameters(), *stage.module.buffers()]:
            if t.device != device:
                t.data = t.data.to(device)


def _microbatches(flat: list[Any], m: int) -> list[list[Any]]:
    """The flat call arguments of each of the m microbatches."""
    from fxpipe.pipeline import split_batch

    parts = [split_batch(a, m, fix="set options={'microbatches': k} with k dividing the batch") for a in flat]
    return [[p[i] for p in parts] for i in range(m)]


def _memory_report(pipe: Any, m: int) -> Report:
    rows = []
    for stage, g in zip(pipe.stage_list(), pipe.stage_graphs):
        params = sum(p.numel() * p.element_size() for p in stage.module.parameters())
        device = next((str(p.device) for p in stage.module.parameters()), "cpu")
        # Every microbatch's F->B tensors live until its B, B->W until its W (one microbatch later).
        peak = params * 2 + m * g.bytes_f_to_b + g.bytes_b_to_w
        measured: str | float = ""
        if device.startswith("cuda"):
            measured = round(torch.cuda.max_memory_allocated(torch.device(device)) / 2**20, 2)
        rows.append((stage.index, device, round(params / 2**20, 3), round(m * g.bytes_f_to_b / 2**20, 3),
                     round(peak / 2**20, 3), measured))
    return Report("backend memory per stage (estimated; measured on CUDA)",
                  ("stage", "device", "param MiB", "F->B MiB (all microbatches)", "peak MiB", "measured MiB"),
                  tuple(rows), (f"{m} microbatches; peak = parameters + gradients + activations held by the "
                                "all-forward-first step",))


class _Runner:
    """Runs F for every microbatch, then B (and deferred W) back, on one Pipeline's split graphs."""

    def __init__(self, pipe: Any, m: int, spec: Any, n_flat: int, params: list[torch.Tensor], defer_w: bool) -> None:
        from fxpipe.runtime.streams import Transfers

        self.pipe = pipe
        self.m = m
        self.spec = spec
        self.n_flat = n_flat
        self.param_index = {id(p): i for i, p in enumerate(params)}
        self.defer_w = defer_w
        self.stages = pipe.stage_list()
        self.graphs = pipe.stage_graphs
        self.devices = [next((p.device for p in s.module.parameters()), torch.device("cpu")) for s in self.stages]
        self.transfers = Transfers(self.devices)

    def forward(self, flat: list[Any]) -> tuple[tuple[torch.Tensor, ...], Any]:
        from fxpipe.pipeline import flatten_inputs

        state: dict[str, Any] = {"values": [], "saved": {}}
        per_mb_outputs = []
        for i, part in enumerate(_microbatches(flat, self.m)):
            args, kwargs = pytree.tree_unflatten(part, self.spec)
            env = dict(zip(self.pipe.input_names, flatten_inputs(self.pipe.in_spec, tuple(args), dict(kwargs))))
            for k, (stage, g) in enumerate(zip(self.stages, self.graphs)):
                inputs = [self.transfers.to(env[n], k) for n in stage.inputs]
                if g.fused:
                    raise FxpipeError(f"stage {k} has no split backward ({g.fused_reason}); backend='fxpipe' needs "
                                      "every stage split")
                result = g.forward(*inputs)
                env.update(zip(stage.outputs, result[: g.num_outputs]))
                state["saved"][(k, i)] = list(result[g.num_outputs:])
            state["values"].append(env)
            per_mb_outputs.append([env[n] if n is not None else c
                                   for n, c in zip(self.pipe.output_names, self.pipe.output_constants)])
        outs = tuple(torch.cat([mb[j] for mb in per_mb_outputs]) for j in range(len(per_mb_outputs[0])))
        return outs, state

    def backward(self, state: dict[str, Any], grads: Sequence[torch.Tensor | None]) -> tuple[list[Any], list[Any]]:
        m = self.m
        value_grads: list[dict[str, torch.Tensor]] = [{} for _ in range(m)]
        for name, g in zip(self.pipe.output_names, grads):
            if name is not None and g is not None:
                for i, part in enumerate(g.tensor_split(m)):
                    value_grads[i][name] = part
        param_grads: list[Any] = [None] * len(self.param_index)
        pending_w: list[tuple[int, int, tuple[Any, ...], list[Any]]] = []
        for i in range(m):
            for k in reversed(range(len(self.stages))):
                stage, g = self.stages[k], self.graphs[k]
                env = state["values"][i]
                outs_grad = [value_grads[i].get(stage.outputs[j]) for j in g.grad_outputs]
                outs_grad = [x if x is not None else torch.zeros_like(env[stage.outputs[j]])
                             for x, j in zip(outs_grad, g.grad_outputs)]
                saved = state["saved"][(k, i)]
                slot = [saved[s] if kind == "saved" else outs_grad[s] for kind, s in g.b_slots]
                result = g.backward_input(*slot)
                for pos, grad in zip(g.grad_inputs, result[: len(g.grad_inputs)]):
                    name = stage.inputs[pos]
                    grad = self.transfers.to(grad, max(k - 1, 0))
                    value_grads[i][name] = grad if name not in value_grads[i] else value_grads[i][name] + grad
                w_args = [*result[len(g.grad_inputs):],
                          *(saved[s] if kind == "saved" else outs_grad[s] for kind, s in g.w_slots)]
                pending_w.append((k, i, tuple(w_args), saved))
                # zb-gpipe: stage k runs the W of the previous microbatch after this B (W fills the gap
                # while gradients travel); gpipe: right away.
                ready = [w for w in pending_w if w[0] == k and (not self.defer_w or w[1] < i)]
                for w in ready:
                    self._run_w(w, param_grads)
                    pending_w.remove(w)
        for w in pending_w:
            self._run_w(w, param_grads)
        input_grads: list[torch.Tensor | None] = [None] * self.n_flat
        for j, name in enumerate(self.pipe.input_names[: self.n_flat]):
            parts = [value_grads[i][name] for i in range(m) if name in value_grads[i]]
            if len(parts) == m:
                input_grads[j] = torch.cat(parts)
        return input_grads, param_grads

    def _run_w(self, w: tuple[int, int, tuple[Any, ...], list[Any]], param_grads: list[Any]) -> None:
        k, _, args, _ = w
        g, module = self.graphs[k], self.stages[k].module
        for name, grad in zip(g.param_names, g.backward_weight(*args)):
            idx = self.param_index.get(id(module.get_parameter(name)))
            if idx is None:
                continue
            param_grads[idx] = grad if param_grads[idx] is None else param_grads[idx] + grad


class _Pipelined(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, runner: _Runner, n_flat: int, *tensors: Any) -> Any:  # type: ignore[override]
        flat = list(tensors[:n_flat])
        with torch.no_grad():
            outs, state = runner.forward(flat)
        ctx.runner, ctx.state, ctx.n_flat = runner, state, n_flat
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        with torch.no_grad():
            input_grads, param_grads = ctx.runner.backward(ctx.state, grads)
        ctx.state = None
        return (None, None, *input_grads, *param_grads)
