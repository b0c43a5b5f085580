"""``torch.compile(model, backend="fxpipe")``: the model's stages run microbatch by microbatch, B and W split.

Registered through the ``torch_dynamo_backends`` entry point, so no ``import fxpipe`` is needed.
Dynamo hands the backend one graph per frame; fxpipe needs the whole model in one graph, so a
graph break is an error naming its source line. The backend then compiles the module whose
``forward`` Dynamo traced with the same passes as ``fxpipe compile`` (torch.export at the
microbatch shape, costs, partition, split, backward split), and returns a callable that:

    forward:  splits every batch-major input into microbatches and runs F of every stage for
              every microbatch (stage i where its parameters are, or on options devices[i % len],
              where it computes on copies of them: see _place; copies between devices go through
              fxpipe.runtime.streams), concatenating the outputs on the device eager would use;
    backward: (autograd reaches the compiled region) runs each microbatch's B from the last stage
              to the first, deferring each W by one microbatch into the gap, and returns every
              parameter's gradient to autograd.

On CUDA each stage's F, B and W graphs run compiled by Inductor (fxpipe.runtime.codegen: fused kernels), and the
step is replayed as CUDA graphs. On one device the batch is one microbatch unless the memory model says the step
does not fit (see _default_microbatches); on several, the pipeline is fed DEFAULTS.microbatches(stages).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from fxpipe import api
from fxpipe._compat import autocast_forward, dynamo_frame, outside_dynamo_tracing, pytree
from fxpipe.errors import FxpipeError, OptionError, TraceError, first_line
from fxpipe.graphs.convention import flatten_inputs, split_batch
from fxpipe.plan import DEFAULTS, LIMITS, check_schedule_size
from fxpipe.report import Report
from fxpipe.runtime.core import ActionRunner, GraphFacts
from fxpipe.schedules.generators import one_rank
from fxpipe.schedules.ir import Kind

_LAST: list[Any] = []  # the most recent compilation's Pipeline
logger = logging.getLogger(__name__)
_LAST_RUNNER: list[Any] = []  # and its _Runner (tests read whether its step ran as CUDA graphs)
# The keys of torch.compile(..., options={...}); fxpipe_backend's docstring says what each does.
OPTIONS = ("stages", "devices", "microbatches", "schedule", "cuda_graphs", "verbose", "precision", "inductor")


def last_report() -> list[Report]:
    """The pass tables of the most recent ``backend="fxpipe"`` compilation, as ``fxpipe compile`` shows them."""
    if not _LAST:
        raise FxpipeError("nothing has been compiled with backend='fxpipe' yet; call the compiled model first")
    return _LAST[-1].report()


def fxpipe_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
                   options: dict[str, Any] | None = None) -> Any:
    """The Dynamo backend (``torch.compile(model, backend="fxpipe", options={...})``); see the module docstring.

    Args:
        gm: The graph Dynamo traced; it must be the whole model (a graph break is an error).
        example_inputs: Dynamo's example inputs (the backend re-traces the module's own call).
        mode: Unused: ``torch.compile``'s mode.
        options: Any of these keys:

            - ``stages``: the stage count; default ``DEFAULTS.stages``.
            - ``devices``: where stage k runs (``devices[k % len]``); a stage away from its parameters runs on
              copies of them there, the model's parameters staying put. Unset: each stage runs where its
              parameters are.
            - ``microbatches``: per step; default 1 on one device unless the step would not fit, else
              ``DEFAULTS.microbatches(stages)`` or the largest count below it that divides the batch.
            - ``schedule``: ``zb-gpipe`` (each W deferred into the gaps; the default) or ``gpipe``.
            - ``cuda_graphs``: replay the step as CUDA graphs where every stage and input is on one CUDA device;
              default True.
            - ``verbose``: print the pass tables and the memory model's on stderr.
            - ``precision``: ``fp32``, or ``bf16``/``fp16``: every stage's F, B and W traced under autocast, as the
              module would run inside ``torch.autocast``; parameters and their gradients stay fp32.
            - ``inductor``: compile every stage's F, B and W with Inductor; default: where every stage runs on
              CUDA (on the CPU its C++ builds take longer than most steps save).

    Returns:
        The callable Dynamo runs in place of ``gm``: microbatched F forward, B and W in autograd's backward.

    Raises:
        OptionError: An unknown option, or a value of the wrong type or out of range.
        TraceError: A graph break, or a model fxpipe cannot trace.
    """
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
    stages = _count(opts, "stages", DEFAULTS.stages)  # bounded before any work
    devices = _devices(opts.get("devices"))
    if not isinstance(opts.get("verbose", False), bool):
        raise OptionError(f"options 'verbose' must be True or False (verbose: {str(opts['verbose'])[:40]!r})")
    module, args, kwargs = _traced_call()
    flat_args, spec = pytree.tree_flatten((args, kwargs))
    batch = next((a.shape[0] for a in flat_args if isinstance(a, torch.Tensor) and a.dim() > 0), 1)
    several = devices is not None and len(set(devices)) > 1
    if "microbatches" in opts or several:
        # Several devices: DEFAULTS.microbatches(stages), or the largest count below it that divides the batch.
        microbatches = _count(opts, "microbatches",
                              max(d for d in range(1, DEFAULTS.microbatches(stages) + 1) if batch % d == 0))
    else:
        microbatches = 1  # until the memory model says otherwise (below)
    check_schedule_size(stages, microbatches)
    schedule = str(opts.get("schedule", "zb-gpipe"))
    if schedule not in ("zb-gpipe", "gpipe"):
        raise OptionError(f"backend='fxpipe' runs schedule 'zb-gpipe' (W deferred into the gaps) or 'gpipe' "
                          f"(W right after B), not {schedule!r}")
    # On by default (used where every stage and input is on one CUDA device). In float64 the replayed step's
    # gradients equal eager's to 1.4e-15 over 10 x 5 SGD steps of resnet-tiny on an H200; in float32 resnet-tiny
    # differs from eager by up to 8e-2 with or without the graphs, as two eager runs do with cuDNN's
    # nondeterministic algorithms (benchmarks/gpu_repeatability.py).
    cuda_graphs = opts.get("cuda_graphs", True)
    if not isinstance(cuda_graphs, bool):
        raise OptionError(f"options 'cuda_graphs' must be True or False (cuda_graphs: {cuda_graphs!r})")
    inductor = opts.get("inductor")
    if inductor is not None and not isinstance(inductor, bool):
        raise OptionError(f"options 'inductor' must be True or False (inductor: {str(inductor)[:40]!r})")
    input_grads = any(isinstance(a, torch.Tensor) and a.requires_grad and not isinstance(a, torch.nn.Parameter)
                      for a in flat_args)

    autocast = _autocast(opts.get("precision", "fp32"), module, devices)

    def build(m: int) -> tuple[Any, list[Any], _Placement]:
        first = _microbatches(flat_args, m)[0]
        m_args, m_kwargs = pytree.tree_unflatten(first, spec)
        # Our compile is a separate trace of real tensors, not part of the frame Dynamo is compiling:
        # see _outside_dynamo.
        with _outside_dynamo():
            pipe = api.compile(module, m_args, example_kwargs=m_kwargs, stages=stages, input_grads=input_grads,
                               verify_each=False)
            if pipe.stage_graphs is None:
                raise FxpipeError("split_backward built no stage graphs; this is an fxpipe bug, please report it")
            if autocast is not None:  # the same stages, their graphs traced again under autocast
                for stage in pipe.stage_list():
                    _drop_dtype_asserts(stage.module)
                for stage, g in zip(pipe.stage_list(), pipe.build_backward(m_args, autocast=autocast,
                                                                           input_grads=input_grads,
                                                                           example_kwargs=m_kwargs)):
                    stage.graphs = g
                    if g.forward is not None:
                        object.__setattr__(stage, "forward", g.forward)
            with autocast_forward(*autocast) if autocast is not None else contextlib.nullcontext():
                placement = _place(pipe, devices, pytree.tree_unflatten(first, spec), input_grads)
        return pipe, first, placement

    pipe, first, placement = build(microbatches)
    choice = "set by options microbatches" if "microbatches" in opts else "several devices: the pipeline's default"
    if "microbatches" not in opts and not several:
        if len(set(placement.devices)) > 1:  # the user placed the model's layers on several devices
            default = max(d for d in range(1, DEFAULTS.microbatches(stages) + 1) if batch % d == 0)
            picked = default, choice
        else:
            picked = _default_microbatches(pipe, placement.devices[0], batch, schedule == "zb-gpipe")
        microbatches, choice = picked
        if microbatches != 1:
            check_schedule_size(stages, microbatches)
            pipe, first, placement = build(microbatches)
    if inductor is None:
        inductor = all(d.type == "cuda" for d in placement.devices)
    # Which of Dynamo's inputs are the call's tensors (by identity), and which are parameters.
    placeholders = list(example_inputs)
    arg_pos = {id(a): i for i, a in enumerate(flat_args) if isinstance(a, torch.Tensor)}
    user_slots = [(k, arg_pos[id(v)]) for k, v in enumerate(placeholders) if id(v) in arg_pos]
    param_slots = [k for k, v in enumerate(placeholders) if isinstance(v, torch.nn.Parameter)]
    out_values = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    graph_outputs = len(out_values)
    # Outputs go back where Dynamo's graph (and eager) makes them, whichever device ran the last stage.
    out_devices = [getattr(getattr(v, "meta", {}).get("example_value"), "device", None) for v in out_values]
    runner = _Runner(pipe, microbatches, spec, len(flat_args), [placeholders[k] for k in param_slots],
                     schedule == "zb-gpipe", placement, out_devices, inductor)
    runner.step_graphs = _step_graphs(runner, flat_args) if cuda_graphs else None
    _LAST_RUNNER[:] = [runner]
    pipe.extra_reports = [_memory_report(pipe, microbatches, placement.devices, runner.step_graphs is not None, choice,
                                         runner.inductor is not None)]
    _LAST[:] = [pipe]
    if opts.get("verbose"):
        from fxpipe.render import render_text

        print("\n\n".join(render_text(r) for r in pipe.report()), file=sys.stderr)

    def compiled(*inputs: Any) -> Any:
        flat = list(flat_args)
        for k, i in user_slots:
            flat[i] = inputs[k]
        params = [inputs[k] for k in param_slots]
        if any(p is not q for p, q in zip(params, runner.params)):
            # Dynamo reuses this code for another instance of the same model class (its guards
            # accept equal parameter shapes), but the pipeline computes with the stages it built.
            raise FxpipeError(f"backend='fxpipe' compiled this code for another {type(module).__name__} instance, and "
                              "Dynamo reuses it for this one, whose parameters the pipeline does not hold; call "
                              "torch._dynamo.reset() before compiling a second instance of one model class")
        outs = _Pipelined.apply(runner, len(flat), *flat, *params)
        outs = outs if isinstance(outs, tuple) else (outs,)
        if len(outs) != graph_outputs:
            raise FxpipeError(f"the pipeline returns {len(outs)} tensors where Dynamo's graph returns {graph_outputs}; "
                              "return tensors (or a structure of them) from forward")
        return outs

    return compiled


@contextlib.contextmanager
def _outside_dynamo() -> Iterator[None]:
    """Run fxpipe's own compile (torch.export, AOTAutograd) detached from the compile Dynamo is in.

    A backend runs inside Dynamo's ``TracingContext``, and ``torch._guards.detect_fake_mode``
    prefers that context's fake mode over everything else. AOTAutograd (our split_backward's
    ``aot_export_joint_with_descriptors``) would then fakify our real microbatch tensors in
    *Dynamo's* FakeTensorMode, giving them dynamic sizes as symbols of Dynamo's ShapeEnv with no
    source, and every shape check of our trace (e.g. conv's ``s0 < 16``) would become a guard
    there. Dynamo then fails building its guards (``produce_guards_verbose``:
    ``symbol_to_source[symbol][0]``, IndexError) on the first one it cannot fold away. With no
    tracing context, AOTAutograd builds its own fake mode, as under ``fxpipe compile``.
    """
    with outside_dynamo_tracing():
        yield


def _drop_dtype_asserts(module: torch.fx.GraphModule) -> None:
    """Remove torch.export's dtype checks from ``module`` (in place) before it is traced under autocast.

    Export records the input of a ``.to(dtype)`` as ``aten._assert_tensor_metadata(x, dtype=float32)``
    (Llama's RMSNorm: ``hidden_states.to(torch.float32)``); under autocast that input arrives in bf16
    from a matmul autocast ran, as it does in eager, and the check (which computes nothing) would fail.
    """
    from fxpipe._compat import op_overload

    check = op_overload("aten", "_assert_tensor_metadata", "default")
    if check is None:
        return
    dropped = [n for n in module.graph.nodes if n.target is check and not n.users]
    for node in dropped:
        module.graph.erase_node(node)
    if dropped:
        module.recompile()


def _traced_call() -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    """The module and arguments of the frame Dynamo is compiling (its ``forward`` call)."""
    code, loc = dynamo_frame()
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


class _Placement:
    """Where each stage runs, and the copies of parameters and buffers that stages placed elsewhere run on."""

    def __init__(self, devices: list[torch.device]) -> None:
        self.devices = devices
        # (the model's tensor, the stage's copy, is a buffer) for every tensor of a moved stage.
        self.mirrors: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
        # id(copy) -> (model tensor's version, its data_ptr, the copy's version) when they last agreed
        self._synced: dict[int, tuple[int, int, int]] = {}

    def refresh(self) -> None:
        """Copy each model parameter or buffer that changed (an optimizer step) into its stage copy."""
        with torch.no_grad():
            for src, dst, _ in self.mirrors:
                synced = self._synced.get(id(dst))
                if synced is None or synced[:2] != (src._version, src.data_ptr()):
                    dst.copy_(src)
                    self._synced[id(dst)] = (src._version, src.data_ptr(), dst._version)

    def write_back_buffers(self) -> None:
        """In-place buffer updates made on a stage copy (BatchNorm statistics) reach the model's buffers."""
        with torch.no_grad():
            for src, dst, is_buffer in self.mirrors:
                if is_buffer and dst._version != self._synced[id(dst)][2]:
                    src.copy_(dst)
                    self._synced[id(dst)] = (src._version, src.data_ptr(), dst._version)


def _device(d: Any) -> torch.device:
    device = torch.device(d)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise OptionError(f"options devices names {device} but CUDA is not available here; name 'cpu' or a "
                              "device this machine has")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def _place(pipe: Any, devices: Sequence[Any] | None, example: tuple[tuple[Any, ...], dict[str, Any]],
           input_grads: bool) -> _Placement:
    """Decide where stage k runs (``devices[k % len]``, else where its parameters are) and prepare it there.

    The model's own parameters never move: Dynamo guards their device, so a moved parameter would
    make the next call recompile a model whose layers sit on different devices. A stage placed
    away from its parameters instead runs on a copy of its GraphModule whose tensors live on its
    device (refreshed from the model's after every change, e.g. an optimizer step) and whose
    ``device=`` arguments name that device; its F, B and W graphs are rebuilt there, since
    AOTAutograd picks device-specific kernels (CUDA attention has no CPU kernel). Gradients
    travel back to the parameters' device.
    """
    from fxpipe.graphs.fx import preserved_buffers
    from fxpipe.graphs.split import split_stage

    stages = pipe.stage_list()
    own = [next((t.device for t in [*s.module.parameters(), *s.module.buffers()]), None) for s in stages]
    flat = flatten_inputs(pipe.in_spec, tuple(example[0]), dict(example[1]))
    # A stage with no tensors of its own is at home where the model is.
    model_home = next((h for h in own if h is not None),
                      next((a.device for a in flat if isinstance(a, torch.Tensor)), torch.device("cpu")))
    homes = [h if h is not None else model_home for h in own]
    if not devices:
        return _Placement(homes)
    wanted = [_device(devices[k % len(devices)]) for k in range(len(stages))]
    placement = _Placement(wanted)
    moved = [k for k in range(len(stages)) if wanted[k] != homes[k]]
    if not moved:
        return placement
    # Run the first microbatch through the stages, on their devices, to get each moved stage's inputs.
    env = dict(zip(pipe.input_names, flat))
    needs_grad = {n for n, v in env.items()
                  if input_grads and isinstance(v, torch.Tensor) and v.is_floating_point()}
    for k, stage in enumerate(stages):
        module = stage.module
        args = [a.to(wanted[k]) if isinstance(a, torch.Tensor) else a for a in (env[n] for n in stage.inputs)]
        g = stage.graphs
        if k in moved:
            module = _stage_copy(stage.module, homes[k], wanted[k], placement.mirrors)
            example_args = [a.detach().clone().requires_grad_(n in needs_grad and a.is_floating_point())
                            if isinstance(a, torch.Tensor) else a for a, n in zip(args, stage.inputs)]
            g = split_stage(module, example_args)
            stage.graphs = g
            if g.forward is not None:
                object.__setattr__(stage, "forward", g.forward)
        with torch.no_grad(), preserved_buffers(module):
            outs = tuple(module(*args))
        env.update(zip(stage.outputs, outs))
        diff = ([i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.is_floating_point()]
                if g is None or g.fused else list(g.grad_outputs))
        needs_grad.update(stage.outputs[i] for i in diff)
    placement.refresh()
    return placement


def _stage_copy(module: torch.fx.GraphModule, home: torch.device, device: torch.device,
                mirrors: list[tuple[torch.Tensor, torch.Tensor, bool]]) -> torch.fx.GraphModule:
    """``module`` with its parameters, buffers and constants copied to ``device`` and ``home`` renamed ``device``."""
    import copy

    from fxpipe.graphs.fx import copy_graph, device_copy, get_path, rename_device

    buffers = {id(b) for b in module.buffers()}
    made: dict[int, Any] = {}
    attrs: dict[str, Any] = {}
    graph = copy_graph(module.graph)
    for node in graph.nodes:
        if node.op == "get_attr":
            t = get_path(module, str(node.target))
            if isinstance(t, torch.Tensor):
                if id(t) not in made:
                    made[id(t)] = device_copy(t, device)
                    mirrors.append((t, made[id(t)], id(t) in buffers))
                attrs[str(node.target)] = made[id(t)]
            else:
                attrs[str(node.target)] = t
        elif node.op == "call_module":
            attrs[str(node.target)] = copy.deepcopy(get_path(module, str(node.target))).to(device)
    rename_device(graph, home, device)
    return torch.fx.GraphModule(attrs, graph, class_name=type(module).__name__)


def _autocast(precision: Any, module: torch.nn.Module, devices: list[torch.device] | None) -> tuple[str, Any] | None:
    """``options['precision']``: autocast's (device type, dtype) for the stages, or None (fp32)."""
    from fxpipe.runtime.optim import PRECISIONS, autocast_of

    if precision not in PRECISIONS:
        raise OptionError(f"options 'precision' must be one of {', '.join(PRECISIONS)} "
                          f"(precision: {str(precision)[:40]!r})")
    kinds = {d.type for d in devices} if devices else \
        {next((p.device.type for p in module.parameters()), "cpu")}
    if precision != "fp32" and len(kinds) > 1:
        raise OptionError(f"options 'precision' {precision} autocasts on one kind of device, and options 'devices' "
                          f"mixes {' and '.join(sorted(kinds))}; place every stage on one kind")
    return autocast_of(precision, kinds.pop())


def _count(opts: dict[str, Any], name: str, default: int) -> int:
    """A whole-number option from 1 to its bound in ``LIMITS`` (``stages`` or ``microbatches``)."""
    value = opts.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptionError(f"options {name!r} must be a whole number of at least 1 ({name}: {value!r:.40})")
    most = getattr(LIMITS, name)
    if value > most:
        raise OptionError(f"options {name!r} must be at most {most:,} ({name}: {value:,}): each is a graph or a "
                          "schedule entry built before the first step")
    return value


def _devices(value: Any) -> list[torch.device] | None:
    """``options['devices']``: a list of devices (``'cpu'``, ``'cuda:1'``, ``torch.device``), each one here."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value:
        raise OptionError(f"options 'devices' must be a non-empty list of devices, e.g. ['cuda:0', 'cuda:1'] "
                          f"(devices: {str(value)[:40]!r})")
    found = []
    for k, d in enumerate(value):
        if not isinstance(d, (str, torch.device)):
            raise OptionError(f"options devices[{k}] is {type(d).__name__} {str(d)[:40]}, not a device; name it as "
                              "'cpu', 'cuda:0' or torch.device(...)")
        try:
            device = torch.device(d)
        except (RuntimeError, ValueError) as exc:
            raise OptionError(f"options devices[{k}] {d!r} is not a device ({first_line(exc)}); name it as 'cpu' "
                              "or 'cuda:0'") from None
        device = _device(device)
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise OptionError(f"options devices[{k}] names {device}, but this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s); name one it has")
        if device.type not in ("cpu", "cuda"):
            raise OptionError(f"options devices[{k}] names {device}; the backend places stages on cpu or cuda")
        found.append(device)
    return found


def _microbatches(flat: list[Any], m: int) -> list[list[Any]]:
    """The flat call arguments of each of the m microbatches."""
    parts = [split_batch(a, m, fix="set options={'microbatches': k} with k dividing the batch") for a in flat]
    return [[p[i] for p in parts] for i in range(m)]


def _free_memory(device: torch.device) -> int | None:
    """Bytes free on ``device`` for the step's gradients and activations (CUDA: ``mem_get_info``); None: no cap
    known (the CPU)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def _step_bytes(pipe: Any, m: int, defer_w: bool) -> float:
    """Bytes the step needs beyond the parameters with ``m`` microbatches, ``pipe`` built for the whole batch:
    the parameters' gradients and the simulator's activation peak for the backend's one-rank schedule."""
    from fxpipe.schedules.simulate import Costs, simulate

    graphs = pipe.stage_graphs
    grads = sum(p.numel() * p.element_size() for stage in pipe.stage_list() for p in stage.module.parameters()
                if p.requires_grad)
    ones = (1.0,) * len(graphs)
    costs = Costs(ones, ones, ones, held_fb=tuple(g.bytes_f_to_b / m for g in graphs),
                  held_bw=tuple(g.bytes_b_to_w / m for g in graphs))
    return grads + simulate(one_rank(len(graphs), m, defer_w=defer_w), costs).ranks[0].peak_memory


def _default_microbatches(pipe: Any, device: torch.device, batch: int, defer_w: bool) -> tuple[int, str]:
    """The microbatch count on one device, and why: 1, unless the memory model says the step does not fit.

    One device runs the stages one after the other, so microbatches buy no overlap and cost kernels (each
    a fraction of the size, more launches, less fusion). The model: ``pipe`` was built for the whole batch
    as one microbatch; activations scale with the microbatch, so stage s holds ``bytes_f_to_b / m`` from
    F to B and ``bytes_b_to_w / m`` from B to W; the simulator's peak for the backend's one-rank schedule
    plus the parameters' gradients must fit in the device's free memory. The smallest count dividing the
    batch that fits, else the one with the lowest peak. (All F run before any B, as autograd runs the
    step, so microbatches shrink only what B keeps for W and each kernel's temporaries.)
    """
    free = _free_memory(device)
    if free is None:
        return 1, f"one device ({device}), no memory cap known"

    def need(m: int) -> float:
        return _step_bytes(pipe, m, defer_w)

    candidates = [m for m in range(1, min(batch, 256) + 1) if batch % m == 0]  # at most 256: each is a simulation
    fits = next((m for m in candidates if need(m) <= free), None)
    mib = f"{free / 2**20:,.0f} MiB free on {device}"
    if fits == 1:
        return 1, f"one device; the step fits in {mib}"
    if fits is not None:
        return fits, f"one device; the step needs {fits} microbatches to fit in {mib}"
    least = min(candidates, key=lambda m: (need(m), m))
    return least, f"one device; no count fits in {mib}, {least} needs the least"


def _memory_report(pipe: Any, m: int, devices: list[torch.device], graphs: bool, choice: str = "",
                   inductor: bool = False) -> Report:
    rows = []
    for stage, g, placed in zip(pipe.stage_list(), pipe.stage_graphs, devices):
        params = sum(p.numel() * p.element_size() for p in stage.module.parameters())
        device = str(placed)
        # Every microbatch's F->B tensors live until its B, B->W until its W (one microbatch later).
        peak = params * 2 + m * g.bytes_f_to_b + g.bytes_b_to_w
        measured: str | float = ""
        if device.startswith("cuda"):
            measured = round(torch.cuda.max_memory_allocated(torch.device(device)) / 2**20, 2)
        rows.append((stage.index, device, round(params / 2**20, 3), round(m * g.bytes_f_to_b / 2**20, 3),
                     round(peak / 2**20, 3), measured))
    return Report("backend memory per stage (estimated; measured on CUDA)",
                  ("stage", "device", "param MiB", "F->B MiB (all microbatches)", "peak MiB", "measured MiB"),
                  tuple(rows), (f"{m} microbatches ({choice}); peak = parameters + gradients + activations held "
                                "by the all-forward-first step",
                                "F, B and W compiled by Inductor (fused kernels)" if inductor else
                                "F, B and W run as traced, op by op (options inductor=True compiles them with "
                                "Inductor; the default where every stage runs on CUDA)",
                                "the step runs as two CUDA graphs (F; B and W) from its second call, their memory pool "
                                "held between steps, or op by op where a capture fails (options cuda_graphs=False: "
                                "always op by op)" if graphs else
                                "the step runs op by op (CUDA graphs need every stage and input on one CUDA device, "
                                "and options cuda_graphs=True, the default)"))


class _Runner:
    """Runs a one-rank Schedule (``zb-gpipe`` or ``gpipe-one-rank``) on one Pipeline's split graphs through
    the executor core: its F actions in autograd's forward, the rest in autograd's backward."""

    def __init__(self, pipe: Any, m: int, spec: Any, n_flat: int, params: list[torch.Tensor], defer_w: bool,
                 placement: _Placement, out_devices: Sequence[torch.device | None], inductor: bool = False) -> None:
        from fxpipe.runtime.codegen import Inductor, compile_stage
        from fxpipe.runtime.streams import Transfers

        self.pipe = pipe
        self.m = m
        self.spec = spec
        self.n_flat = n_flat
        self.params = params
        self.param_index = {id(p): i for i, p in enumerate(params)}
        self.stages = pipe.stage_list()
        self.graphs = pipe.stage_graphs
        for k, g in enumerate(self.graphs):
            if g.fused:
                raise FxpipeError(f"stage {k} has no split backward ({g.fused_reason}); backend='fxpipe' needs "
                                  "every stage split")
        # Inductor: each graph compiles at its first call (the first step, before any CUDA graph capture).
        self.inductor = Inductor() if inductor else None
        if self.inductor is not None:
            self.graphs = [compile_stage(g, self.inductor) for g in self.graphs]
        self.placement = placement
        self.devices = placement.devices
        self.out_devices = list(out_devices)
        self.transfers = Transfers(self.devices)
        self.schedule = one_rank(len(self.stages), m, defer_w=defer_w)
        self.step_graphs: _StepGraphs | None = None  # set when the step runs as CUDA graphs (see _step_graphs)
        # What the step's cores read of the graphs once (boxed graphs, fresh gradients): every step's core shares it.
        self.facts = GraphFacts.of(self.graphs)
        # Per stage, each gradient W returns: the index of its parameter in ``params`` (None: not one of them).
        self.w_targets = [[self.param_index.get(id(st.module.get_parameter(n))) for n in g.param_names]
                          for st, g in zip(self.stages, self.graphs)]
        actions = self.schedule.ranks[0]
        first_backward = next(i for i, a in enumerate(actions) if a.kind is not Kind.F)
        self.forward_actions, self.backward_actions = actions[:first_backward], actions[first_backward:]

    def forward(self, flat: list[Any]) -> tuple[tuple[torch.Tensor, ...], Any]:
        self.placement.refresh()
        graphs = self.step_graphs
        state: _StepToken | _BackendCore  # what backward reads: a replayed step's token, or the core that ran it
        if graphs is not None and graphs.can_replay(flat):
            try:
                outs, state = graphs.forward(flat, self.run_forward)
            except _CaptureFailed as exc:
                self._op_by_op(exc)
                outs, state = self.run_forward(flat)
        else:
            outs, state = self.run_forward(flat)
        self.placement.write_back_buffers()
        return outs, state

    def _op_by_op(self, exc: _CaptureFailed) -> None:
        """A step that cannot be captured (a host sync, a copy from pageable CPU memory) runs op by op from now on."""
        self.step_graphs = None
        logger.warning("backend='fxpipe': the step could not be captured as a CUDA graph (%s); it runs op by op from "
                       "now on (options cuda_graphs=False skips the attempt)", exc)

    def run_forward(self, flat: list[Any]) -> tuple[tuple[torch.Tensor, ...], _BackendCore]:
        """F of every stage for every microbatch: the outputs, and the core holding what B and W read."""
        inputs = []
        for part in _microbatches(flat, self.m):
            args, kwargs = pytree.tree_unflatten(part, self.spec)
            values = flatten_inputs(self.pipe.in_spec, tuple(args), dict(kwargs))
            inputs.append(dict(zip(self.pipe.input_names, values)))
        core = _BackendCore(self, [])
        core.begin(inputs, [None] * self.m)
        for action in self.forward_actions:
            core.run(action)
        per_mb = [[env[n] if n is not None else c for n, c in zip(self.pipe.output_names, self.pipe.output_constants)]
                  for env in core.values]
        outs = tuple(self.transfers.move(torch.cat([mb[j] for mb in per_mb]),
                                         self.out_devices[j] if j < len(self.out_devices) else None)
                     for j in range(len(per_mb[0])))
        core.input_devices = [a.device if isinstance(a, torch.Tensor) else None for a in flat]
        return outs, core

    def backward(self, state: Any, grads: Sequence[torch.Tensor | None]) -> tuple[list[Any], list[Any]]:
        if isinstance(state, _StepToken):
            try:
                return state.graphs.backward(state, grads, self.run_backward)
            except _CaptureFailed as exc:  # the forward replayed: its values are in the core, as before the capture
                self._op_by_op(exc)
                return self.run_backward(exc.core, grads)
        result = self.run_backward(state, grads)
        if self.step_graphs is not None:
            self.step_graphs.eager_steps += 1
        return result

    def run_backward(self, core: _BackendCore, grads: Sequence[torch.Tensor | None]) -> tuple[list[Any], list[Any]]:
        """B of every stage for every microbatch, last stage first, and every W: input and parameter gradients."""
        # A value's gradient stays where it was made until a stage reads it; shares from several
        # readers (skip connections) are summed on the device of the first.
        for name, g in zip(self.pipe.output_names, grads):
            if name is not None and g is not None:
                for i, part in enumerate(g.tensor_split(self.m)):
                    core.grads[i][name] = part
        core.param_grads = [None] * len(self.param_index)
        for action in self.backward_actions:
            core.run(action)
        input_grads: list[torch.Tensor | None] = [None] * self.n_flat
        for j, name in enumerate(self.pipe.input_names[: self.n_flat]):
            parts = [core.grads[i][name] for i in range(self.m) if name in core.grads[i]]
            if len(parts) == self.m:
                input_grads[j] = torch.cat([self.transfers.move(p, core.input_devices[j]) for p in parts])
        return input_grads, core.param_grads


class _BackendCore(ActionRunner):
    """The executor core with the backend's policies: stages read inputs on their own device, gradient
    shares are summed on the first share's device, and W's gradients go back to autograd."""

    def __init__(self, runner: _Runner, param_grads: list[Any]) -> None:
        super().__init__(runner.pipe, runner.graphs, None, facts=runner.facts)
        self.runner = runner
        self.param_grads = param_grads
        self.input_devices: list[torch.device | None] = []

    def value(self, s: int, m: int, name: str) -> Any:
        return self.runner.transfers.to(self.values[m][name], s)

    def output_grad(self, s: int, m: int, j: int) -> torch.Tensor:
        grad = self.grads[m].pop(self.stages[s].outputs[j], None)
        if grad is None:
            return torch.zeros_like(self.values[m][self.stages[s].outputs[j]])
        return self.runner.transfers.to(grad, s)

    def deliver(self, s: int, m: int, name: str, grad: torch.Tensor) -> None:
        have = self.grads[m].get(name)
        self.grads[m][name] = grad if have is None else have + self.runner.transfers.move(grad, have.device)

    def weight(self, s: int, m: int, args: list[Any]) -> None:
        for idx, grad in zip(self.runner.w_targets[s], self.graphs[s].split_graphs()[2](*args)):
            if idx is None:
                continue
            grad = self.runner.transfers.move(grad, self.runner.params[idx].device)
            have = self.param_grads[idx]
            self.param_grads[idx] = grad if have is None else have + grad


class _Pipelined(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, runner: _Runner, n_flat: int, *tensors: Any) -> Any:
        flat = list(tensors[:n_flat])
        with torch.no_grad():
            outs, state = runner.forward(flat)
        ctx.runner, ctx.state, ctx.n_flat = runner, state, n_flat
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        if ctx.state is None:
            raise FxpipeError("backward ran twice through one backend='fxpipe' forward, whose saved tensors the first "
                              "backward freed; run the forward again (retain_graph=True is not supported)")
        with torch.no_grad():
            input_grads, param_grads = ctx.runner.backward(ctx.state, grads)
        ctx.state = None
        return (None, None, *input_grads, *param_grads)


def _step_graphs(runner: _Runner, flat: Sequence[Any]) -> _StepGraphs | None:
    """CUDA graphs for the step when every stage and every input is on one CUDA device (else None: eager)."""
    devices = set(runner.devices) | {a.device for a in flat if isinstance(a, torch.Tensor)}
    if len(devices) != 1 or next(iter(devices)).type != "cuda" or runner.placement.mirrors:
        return None
    watched = [t for stage in runner.stages for t in (*stage.module.parameters(), *stage.module.buffers())]
    return _StepGraphs(watched)


class _CaptureFailed(Exception):
    """A CUDA graph capture failed; ``core`` holds the replayed forward's values when it was the backward's."""

    def __init__(self, cause: Exception, core: Any) -> None:
        super().__init__(first_line(cause))
        self.core = core


def _containers(obj: Any) -> dict[str, Any]:
    """Copies of ``obj``'s list and dict attributes, two levels deep (the tensors they hold are not copied)."""
    def copied(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: list(x) if isinstance(x, list) else dict(x) if isinstance(x, dict) else x for k, x in v.items()}
        return [list(x) if isinstance(x, list) else dict(x) if isinstance(x, dict) else x for x in v]

    return {k: copied(v) for k, v in vars(obj).items() if isinstance(v, (list, dict))}


class _StepToken:
    """What autograd keeps between a replayed forward and its backward: which graphs replay it. While it lives,
    the graphs' pool holds that forward's saved tensors (``_StepGraphs.owner`` is a weak reference to it)."""

    def __init__(self, graphs: _StepGraphs) -> None:
        self.graphs = graphs


class _StepGraphs:
    """The step as two CUDA graphs, F of every microbatch and B/W of every microbatch, replayed on static buffers.

    On a GPU these small models are bound by the host: every ATen op of every microbatch's F, B and
    W is one Python call and one kernel launch (gpt-medium, 4 microbatches: 58 ms a step for 5 ms of
    kernels on an H100). Captured once, a step is two graph launches and the copies in and out.

        step 1:            eager (warm-up: cuBLAS handles, lazy init; nothing captured)
        step 2 forward:    capture F of all microbatches (inputs copied into static buffers), replay
        step 2 backward:   capture B and W into the forward's memory pool, replay
        later steps:       copy inputs in, replay, clone outputs out; copy output grads in, replay,
                           clone input and parameter gradients out

    The graphs read the parameters and buffers where they were at capture (an optimizer steps them
    in place); if one moved (``load_state_dict`` with ``assign``, ``.to()``), both are captured again.
    The forward's saved tensors live in the pool until the backward replays: a second forward while
    one is waiting for its backward (two forwards, then one backward) runs eagerly, and so does a
    forward whose inputs differ in shape from the captured ones.
    """

    def __init__(self, watched: Sequence[torch.Tensor]) -> None:
        self.watched = list(watched)
        self.eager_steps = 0
        self._reset()

    def _reset(self) -> None:
        self.ptrs = [t.data_ptr() for t in self.watched]
        self.fwd: Any = None
        self.bwd: Any = None
        self.static_in: list[Any] = []
        self.fwd_out: tuple[torch.Tensor, ...] = ()
        self.core: Any = None
        self.static_grads: list[Any] = []
        self.bwd_out: tuple[list[Any], list[Any]] = ([], [])
        self.owner: Any = None  # weakref to the token of the forward whose backward has not run yet

    def can_replay(self, flat: Sequence[Any]) -> bool:
        if self.eager_steps < 1 or (self.owner is not None and self.owner() is not None):
            return False
        if self.fwd is not None and [t.data_ptr() for t in self.watched] != self.ptrs:
            self._reset()
        if self.fwd is None:
            return True
        return len(flat) == len(self.static_in) and all(
            (a.shape, a.dtype, a.device) == (s.shape, s.dtype, s.device) if isinstance(a, torch.Tensor)
            else not isinstance(s, torch.Tensor) and (a is s or a == s) for a, s in zip(flat, self.static_in))

    def forward(self, flat: Sequence[Any], body: Any) -> tuple[tuple[torch.Tensor, ...], _StepToken]:
        if self.fwd is None:
            self.static_in = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in flat]
            self.fwd = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(self.fwd):
                    self.fwd_out, self.core = body(self.static_in)
            except Exception as exc:  # nothing ran: a capture records kernels without running them
                raise _CaptureFailed(exc, None) from exc
        else:
            for s, a in zip(self.static_in, flat):
                if isinstance(a, torch.Tensor):
                    s.copy_(a)
        self.fwd.replay()
        token = _StepToken(self)
        self.owner = weakref.ref(token)
        return tuple(o.clone() for o in self.fwd_out), token

    def backward(self, token: _StepToken, grads: Sequence[Any], body: Any) -> tuple[list[Any], list[Any]]:
        if self.bwd is None:
            self.static_grads = [g.detach().clone() if isinstance(g, torch.Tensor) else None for g in grads]
            self.bwd = torch.cuda.CUDAGraph()
            kept = _containers(self.core)  # the core's step state, which a failed capture leaves half consumed
            try:
                with torch.cuda.graph(self.bwd, pool=self.fwd.pool()):
                    self.bwd_out = body(self.core, self.static_grads)
            except Exception as exc:
                vars(self.core).update(kept)
                raise _CaptureFailed(exc, self.core) from exc
            self.core = None  # what it held now lives in the pool, at the addresses the graphs use
        else:
            for s, g in zip(self.static_grads, grads):
                if s is None:
                    continue
                if g is None:
                    s.zero_()
                else:
                    s.copy_(g)
        self.bwd.replay()
        self.owner = None
        input_grads, param_grads = self.bwd_out
        # Copies out: the next replay overwrites the graphs' own outputs.
        return ([g.clone() if isinstance(g, torch.Tensor) else g for g in input_grads],
                [g.clone() if isinstance(g, torch.Tensor) else g for g in param_grads])
