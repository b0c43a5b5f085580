"""From a model to the per-layer strategy search's layer graph: one layer per operation (OptCNN's granularity).

``strategy_graph(model, example_inputs)`` traces ``model`` with ``torch.fx.symbolic_trace`` (leaf
modules stay calls) and runs the trace once on ``example_inputs`` (``meta`` tensors allocate
nothing), recording every node's output bytes and forward FLOPs. Each node becomes a ``LayerSpec``:

    node                                     kind          parameters                 seconds (F + B + W)
    the model's input (placeholder)          input         -                          0
    nn.Linear                                matmul        weight, bias (bias_bytes)  3 x FLOPs / device_flops
    nn.Conv1d/2d/3d (groups=1)               matmul, spatial  weight, bias            3 x FLOPs / device_flops
    nn.BatchNorm1d/2d/3d                     elementwise   weight, bias, stat_bytes   2 x bytes / device_mem_bw
    any other parameter-free module/function elementwise   -                          2 x bytes / device_mem_bw
    the model's output                       loss          -                          0

(each at least its bytes over ``device_mem_bw``; ``spatial`` when the output has a height, i.e.
three or more dims). Edges follow the data: one per (producer, consumer) tensor argument. The
traced module and the node names come back with the specs, so the runtime
(``fxpipe.runtime.strategy``) runs the same nodes in the configurations the search picks.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from fxpipe._compat import flop_counter_mode
from fxpipe.errors import OptionError
from fxpipe.plan import DEFAULTS, ComputeRates
from fxpipe.planning.strategies import LayerSpec

__all__ = ["OpGraph", "strategy_graph"]

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_VIEWS = {"flatten", "view", "reshape", "add", "iadd", "contiguous"}


@dataclass(frozen=True)
class OpGraph:
    """``specs[i]`` describes fx node ``nodes[i]`` of ``module`` (``nodes[-1]`` is the output node: the
    loss reads it); ``edges`` are ``(producer, consumer)`` indices into ``specs``."""

    module: fx.GraphModule
    specs: tuple[LayerSpec, ...]
    edges: tuple[tuple[int, int], ...]
    nodes: tuple[str, ...]


def _nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


class _Recorder(fx.Interpreter):
    def __init__(self, module: fx.GraphModule, runs: int = 0) -> None:
        super().__init__(module)
        self.out: dict[str, int] = {}
        self.dims: dict[str, int] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.inputs: dict[str, int] = {}
        self.flops: dict[str, int] = {}
        self.runs = runs
        self.seconds: dict[str, float] = {}

    def run_node(self, n: fx.Node) -> Any:
        args = [a for a in n.all_input_nodes]
        counter = flop_counter_mode()
        with counter:
            value = super().run_node(n)
        self.flops[n.name] = counter.get_total_flops()
        if self.runs and n.op not in ("placeholder", "output"):
            times = []
            for _ in range(self.runs):
                start = time.perf_counter()
                super().run_node(n)
                times.append(time.perf_counter() - start)
            self.seconds[n.name] = statistics.median(times)
        self.out[n.name] = _nbytes(value)
        self.dims[n.name] = value.dim() if isinstance(value, torch.Tensor) else 0
        self.shape[n.name] = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
        self.inputs[n.name] = sum(self.out.get(a.name, 0) for a in args)
        return value


def _target_name(gm: fx.GraphModule, n: fx.Node) -> str:
    if n.op == "call_module":
        return type(gm.get_submodule(str(n.target))).__name__
    return getattr(n.target, "__name__", str(n.target))


def strategy_graph(model: nn.Module, example_inputs: Sequence[Any], *, device_flops: float | None = None,
                   device_mem_bw: float | None = None, profile_runs: int = 0,
                   compute: ComputeRates | None = None) -> OpGraph:
    """The layer graph of ``model`` on ``example_inputs`` (the whole batch), one spec per fx node.

    ``compute`` (``fxpipe.calibration.compute``'s rates for this machine) replaces ``device_flops`` / ``device_mem_bw``:
    a Linear's FLOPs at the GEMM rate, a convolution's at the convolution rate plus its per-call time
    (``fixed_seconds``: it does not shrink with the split), every roofline's bytes (parameters included) at
    the measured bandwidth. Its per-node host times are not used: the strategy runtime's own per-node cost
    is ``planning.strategies.HostCosts``, measured on the ranks that run it.

    ``profile_runs > 0`` (real tensors): each node's forward is timed (the median of that many runs, in
    eval mode) and its F + B + W is that time x 3 for a matmul, x 2 for the rest, instead of the
    FLOP and byte estimates.

    Raises ``OptionError`` when the model does not trace symbolically, has more than one input
    or output tensor, or holds parameters in a module other than Linear, a convolution (groups=1)
    or BatchNorm.
    """
    flops_rate = DEFAULTS.device_flops if device_flops is None else device_flops
    mem_bw = DEFAULTS.device_mem_bw if device_mem_bw is None else device_mem_bw
    if compute is not None:
        flops_rate, mem_bw = compute.gemm_flops, compute.mem_bw
    try:
        gm = fx.symbolic_trace(model)
    except Exception as err:  # symbolic tracing fails in many ways (control flow, proxies in len(), ...)
        raise OptionError(f"the per-layer strategy search traces the model with torch.fx.symbolic_trace, which "
                          f"failed ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
                          "use a model without data-dependent control flow") from err
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1 or len(example_inputs) != 1:
        raise OptionError(f"the per-layer strategy search takes a model of one input tensor (it has "
                          f"{len(placeholders)}); wrap the others into the model")
    recorder = _Recorder(gm, profile_runs)
    modes = {m: m.training for m in gm.modules()}
    gm.eval()  # the trace shares the model's modules: a training-mode run would move its BatchNorm statistics
    try:
        with torch.no_grad():
            recorder.run(*example_inputs)
    finally:
        for m, training in modes.items():
            m.train(training)

    specs: list[LayerSpec] = []
    names: list[str] = []
    index: dict[str, int] = {}
    edges: list[tuple[int, int]] = []
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            raise OptionError(f"node {n.name!r} reads a tensor attribute ({n.target}) outside a module; the "
                              "strategy search places module parameters only")
        if n.op == "output":
            produced = [a for a in n.all_input_nodes]
            if len(produced) != 1:
                raise OptionError(f"the per-layer strategy search takes a model of one output tensor (it returns "
                                  f"{len(produced)}); return the logits")
            spec = LayerSpec("loss", kind="loss", shape=recorder.shape[produced[0].name][:1])
        elif n.op == "placeholder":
            spec = LayerSpec(n.name, out_bytes=recorder.out[n.name], kind="input", shape=recorder.shape[n.name])
        else:
            spec = _spec(gm, n, recorder, flops_rate, mem_bw, compute)
            if n.name in recorder.seconds:
                spec = dataclasses.replace(spec, seconds=recorder.seconds[n.name] * (3 if spec.kind == "matmul" else 2))
        index[n.name] = len(specs)
        for a in dict.fromkeys(n.all_input_nodes):
            if recorder.out.get(a.name, 0) or a.op == "placeholder":
                edges.append((index[a.name], len(specs)))
        specs.append(spec)
        names.append(n.name)
    return OpGraph(gm, tuple(specs), tuple(edges), tuple(names))


def _spec(gm: fx.GraphModule, n: fx.Node, rec: _Recorder, flops_rate: float, mem_bw: float,
          compute: ComputeRates | None = None) -> LayerSpec:
    out, inp, flops = rec.out[n.name], rec.inputs[n.name], rec.flops[n.name]
    spatial = rec.dims[n.name] >= 3
    shape = rec.shape[n.name]
    traffic = 2 * (out + inp) / mem_bw  # forward and backward, each reads its inputs and writes its output
    module = gm.get_submodule(str(n.target)) if n.op == "call_module" else None
    params = list(module.parameters()) if module is not None else []
    param_bytes = float(sum(_nbytes(p) for p in params))
    if isinstance(module, nn.Linear) or (isinstance(module, _CONV) and module.groups == 1):
        bias = float(_nbytes(module.bias)) if module.bias is not None else 0.0
        conv = isinstance(module, _CONV)
        rate, fixed = flops_rate, 0.0
        if compute is not None:  # calibrated: a skinny GEMM reads its weight too; a conv has its own rate and call time
            traffic += 2 * param_bytes / mem_bw
            if conv:
                rate, fixed = compute.conv_flops, compute.conv_fwd + compute.conv_bwd
        return LayerSpec(n.name, max(3 * flops / rate, traffic), param_bytes, out, inp, "matmul",
                         conv, bias_bytes=bias, shape=shape,
                         in_features=module.in_features if isinstance(module, nn.Linear) else module.in_channels,
                         fixed_seconds=fixed)
    if isinstance(module, _NORM):
        stats = 2.0 * module.num_features * (params[0].element_size() if params else 4)
        return LayerSpec(n.name, traffic, param_bytes, out, inp, "elementwise", spatial, stat_bytes=stats,
                         shape=shape)
    if params:
        raise OptionError(f"node {n.name!r} is a {type(module).__name__} with parameters; the strategy search knows "
                          "Linear, convolutions (groups=1) and BatchNorm (keep other modules parameter-free)")
    saved = 0 if _target_name(gm, n).lower() in _VIEWS else inp
    return LayerSpec(n.name, traffic, 0.0, out, saved, "elementwise", spatial, shape=shape)
