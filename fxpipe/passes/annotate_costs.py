"""annotate_costs: shapes, bytes and FLOPs of every node, on fake tensors (no real compute)."""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.utils.flop_counter import FlopCounterMode

from fxpipe._compat import data_dependent_output_error, fake_tensor_mode, flop_counter_mode
from fxpipe.errors import TraceError
from fxpipe.graphs.fx import COMPUTE_OPS, clone, get_path, tensors_in, value_bytes
from fxpipe.meta import get_meta, update_meta
from fxpipe.passes.driver import PassResult
from fxpipe.plan import DEFAULTS, ComputeRates
from fxpipe.report import Report

# A CPU core of this machine does ~1.8e11 FLOP/s in a 512^3 matmul on one thread and streams
# ~4e9 B/s through an element-wise op; these round defaults model "one busy core" (see
# docs/architecture.md). ``compute`` (fxpipe.calibration.compute: fxpipe compile measures it unless
# FXPIPE_CALIBRATION=off) replaces them with this machine's rates and adds each node's host time;
# --profile replaces the estimates with measured times.

_CONVOLUTIONS = {"convolution", "conv1d", "conv2d", "conv3d", "_convolution"}
_GEMMS = {"linear", "mm", "addmm", "matmul"}


def annotate_costs(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    device_flops: float | None = None,
    device_mem_bw: float | None = None,
    compute: ComputeRates | None = None,
) -> PassResult:
    """Write shape, bytes, FLOPs and estimated times into each call node's NodeMeta.

    Reads: the graph and example inputs (converted to fake tensors: nothing is allocated, so
    models on the ``meta`` device work).
    Writes: NodeMeta.shape, dtype, out_bytes, saved_bytes, param_bytes, flops_fwd,
    flops_bwd_input and flops_bwd_weight (estimates: a node's B costs its forward FLOPs when
    an activation input needs a gradient, its W costs its forward FLOPs when it reads a
    trainable parameter), and time_* = max(FLOPs / device_flops, bytes / device_mem_bw).
    With ``compute`` (this machine, calibrated) its rates replace both (a convolution's FLOPs at
    its conv rate by its FLOPs per call, a linear/mm's at the rate for its smallest dimension, W's at the
    weight gradient's: ``ComputeRates.conv_rate`` and ``gemm_rate``; the part of its weights the cache cannot hold
    when the model's parameters outgrow it (``ComputeRates.cold``) at the uncached rates), the bytes count the
    parameters a node reads (F, B and W alike), and every node
    but ``getitem`` adds its host time: ``op_fwd`` to F, and
    ``op_bwd`` on the gradient path, to B and W in halves (all of it to the one it has alone); a
    convolution adds its per-call time too (``conv_fwd``, ``conv_bwd``).
    Raises: TraceError when a node reads a tensor's value as a Python number (``.item()``): its
    cost, and every later shape, would depend on the data.

        %linear = call_function[aten.linear](%x, %w, %b)
          ──▶ NodeMeta(shape=((4, 64),), flops_fwd=32768, flops_bwd_input=32768, ...)
    """
    device_flops = DEFAULTS.device_flops if device_flops is None else device_flops
    device_mem_bw = DEFAULTS.device_mem_bw if device_mem_bw is None else device_mem_bw
    if compute is not None:
        device_flops, device_mem_bw = compute.gemm_flops, compute.mem_bw
    out = clone(gm)
    fake_mode = fake_tensor_mode(allow_non_fake_inputs=True)
    interp = _CostInterpreter(out, fake_mode)
    with fake_mode:
        fake_inputs = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    try:
        interp.run_costs(fake_inputs)
    except data_dependent_output_error() as exc:
        raise _data_dependent(interp.current, exc) from None

    # A model whose parameters outgrow the last-level cache reads part of each GEMM's weight (W: its gradient) from
    # memory
    cold = 0.0 if compute is None else compute.cold(sum(value_bytes(p) for p in out.parameters()))
    typical = compute.sustained if compute is not None else 1.0  # the machine as a step finds it, not at its best
    needs_grad: set[torch.fx.Node] = set()
    by_op: Counter[str] = Counter()
    flops_by_op: Counter[str] = Counter()
    for node in out.graph.nodes:
        if node.op == "get_attr":
            val = get_path(out, node.target)
            if isinstance(val, torch.nn.Parameter) and val.requires_grad:
                needs_grad.add(node)
            continue
        if node.op not in COMPUTE_OPS:
            continue
        inputs = node.all_input_nodes
        param_inputs = [n for n in inputs if n.op == "get_attr"]
        act_inputs = [n for n in inputs if n.op != "get_attr"]
        val = interp.values.get(node)
        flops = interp.flops.get(node, 0)
        param_bytes = sum(value_bytes(get_path(out, n.target)) for n in param_inputs)
        own_params = False  # --tracer fx: a torch.nn layer called as a module holds its parameters
        if node.op == "call_module":
            sub = get_path(out, str(node.target))
            own_params = any(p.requires_grad for p in sub.parameters())
            param_bytes += sum(value_bytes(t) for t in [*sub.parameters(), *sub.buffers()])
        if own_params or any(n in needs_grad for n in inputs):
            needs_grad.add(node)
        grad_to_act = any(n in needs_grad for n in act_inputs)
        grad_to_param = own_params or any(n in needs_grad for n in param_inputs)
        out_bytes = value_bytes(val)
        saved = 0 if _is_view(node) or node.target is operator.getitem else out_bytes
        tensors = tensors_in(val)
        flops_b = flops if grad_to_act else 0
        flops_w = flops if grad_to_param else 0
        traffic = out_bytes + sum(value_bytes(interp.values.get(n)) for n in act_inputs)
        rate = rate_b = rate_w = device_flops
        # a GEMM's (F, B, W) rates with none / all of its weight cached
        ends: tuple[tuple[float, float, float], ...] = ()
        host_f = host_b = host_w = 0.0
        per_node = (0.0, 0.0, 0.0)  # the part of host_* that is per node (not a convolution's per-call time)
        share_b = (0.5 if grad_to_param else 1.0) if grad_to_act else 0.0  # of the backward's host time, B's
        share_w = (0.5 if grad_to_act else 1.0) if grad_to_param else 0.0
        if compute is not None:  # the node also reads its parameters (a skinny GEMM is bound by its weight's bytes)
            traffic += param_bytes
            kind = _op_name(node).split(".")[0]
            conv = kind in _CONVOLUTIONS
            smallest = _gemm_smallest(node, kind, val, interp.values) if kind in _GEMMS else None
            if smallest is not None:  # a skinny GEMM runs slower (calibrated by its smallest dimension)
                # F reads the weight transposed (a linear's x @ W.T) exactly where B (grad @ W) reads it as stored
                t = _reads_transposed(node, kind)

                def rates_at(miss: float, smallest: float = smallest, t: bool = t) -> tuple[float, float, float]:
                    assert compute is not None
                    return (compute.gemm_rate(smallest, cold=miss, transposed=t),
                            compute.gemm_rate(smallest, cold=miss, transposed=not t),
                            compute.gemm_rate(smallest, weight=True, cold=miss))

                (rate, rate_b, rate_w), ends = rates_at(cold), (rates_at(0.0), rates_at(1.0))
            if node.target is not operator.getitem:
                host_f, host_bw = compute.op_fwd, compute.op_bwd
                if conv:
                    rate = compute.conv_rate(flops)
                    host_f, host_bw = host_f + compute.conv_fwd, host_bw + compute.conv_bwd
                    rate_b = rate_w = rate
                    shape = _conv_shape(node, val, out, interp.values)
                    grad = None if shape is None else compute.conv_grad_rates(*shape)
                    if grad is not None:  # few output pixels: the gradients run below the forward's rate
                        rate_b, rate_w = min(rate, grad[0]), min(rate, grad[1])
                elif "scaled_dot_product" in kind:  # attention: its own kernel, far below the GEMMs' rate here
                    rate, rate_b = compute.sdpa_rates(flops)
                host_b, host_w = host_bw * share_b, host_bw * share_w
                per_node = (compute.op_fwd, compute.op_bwd * share_b, compute.op_bwd * share_w)
        bytes_w = traffic if compute is not None else param_bytes
        mem_f, mem_b, mem_w = traffic / device_mem_bw, traffic / device_mem_bw, bytes_w / device_mem_bw
        kernel = None if compute is None else compute.kernel_rates(_kernel_name(node))
        if kernel is not None:  # a kernel far below the memory bandwidth (batch norm, max pool): its own rates, and
            # one backward call for both gradients, shared between B and W as its host time is
            mem_f = traffic / kernel[0]
            mem_b, mem_w = share_b * traffic / kernel[1], share_w * traffic / kernel[1]

        def seconds(r_f: float, r_b: float, r_w: float) -> tuple[float, float, float]:
            return (typical * (host_f + max(flops / r_f, mem_f)),
                    typical * (host_b + max(flops_b / r_b, mem_b)) if grad_to_act else 0.0,
                    typical * (host_w + max(flops_w / r_w, mem_w)) if grad_to_param else 0.0)

        times = seconds(rate, rate_b, rate_w)
        # What reading all of the weight from memory, not none of it, adds (the chord's slope): how a plan whose ranks
        # hold more copies of the model on one cache (partition_stages, dp replicas) moves this node's times
        slope = tuple(c - w for w, c in zip(seconds(*ends[0]), seconds(*ends[1]))) if ends else (0.0, 0.0, 0.0)
        update_meta(
            node,
            shape=tuple(tuple(int(s) for s in t.shape) for t in tensors),
            dtype=str(tensors[0].dtype).replace("torch.", "") if tensors else "",
            out_bytes=out_bytes,
            saved_bytes=saved if node in needs_grad else 0,
            param_bytes=param_bytes,
            flops_fwd=flops,
            flops_bwd_input=flops_b,
            flops_bwd_weight=flops_w,
            time_fwd=times[0],
            host_fwd=typical * per_node[0],
            host_bwd_input=typical * per_node[1],
            host_bwd_weight=typical * per_node[2],
            time_bwd_input=times[1],
            time_bwd_weight=times[2],
            cold_fwd=slope[0],
            cold_bwd_input=slope[1],
            cold_bwd_weight=slope[2],
        )
        name = _op_name(node)
        by_op[name] += 1
        flops_by_op[name] += flops
    total = sum(flops_by_op.values()) or 1
    rows = tuple(
        (op, by_op[op], flops_by_op[op], round(100.0 * flops_by_op[op] / total, 1))
        for op, _ in sorted(flops_by_op.items(), key=lambda kv: (-kv[1], kv[0]))[:12]
    )
    metas = [get_meta(n) for n in out.graph.nodes if n.op in COMPUTE_OPS]
    report = Report(
        title="annotate-costs: top ops by forward FLOPs",
        columns=("op", "count", "fwd FLOPs", "% of fwd"),
        rows=rows,
        notes=(
            f"forward {sum(m.flops_fwd for m in metas):,} FLOPs; backward estimate "
            f"{sum(m.flops_bwd_input for m in metas):,} (input grad) + {sum(m.flops_bwd_weight for m in metas):,} "
            "(weight grad)",
            "B/W FLOPs are estimates (forward FLOPs of ops on the gradient path); "
            "split_backward will count the real graphs",
        ),
    )
    if compute is not None:  # the planners (partition_stages) look up the runtime's fixed costs for these rates
        out.meta["fxpipe_compute"] = compute
        out.meta["fxpipe_cache_miss"] = cold  # what the times above assume (partition_stages moves it with dp)
    else:
        out.meta.pop("fxpipe_compute", None)
        out.meta.pop("fxpipe_cache_miss", None)
    return PassResult(out, True, (report,))


def verify_costs(gm: torch.fx.GraphModule) -> list[str]:
    problems = []
    for node in gm.graph.nodes:
        if node.op in COMPUTE_OPS and "fxpipe" not in node.meta:
            problems.append(f"node {node.name} has no cost annotation")
        meta = get_meta(node)
        if min(meta.flops_fwd, meta.flops_bwd_input, meta.flops_bwd_weight, meta.out_bytes) < 0:
            problems.append(f"node {node.name} has a negative cost")
    return problems


class _CostInterpreter(torch.fx.Interpreter):
    """Runs the graph on fake tensors under FlopCounterMode, recording each node's value and FLOPs."""

    def __init__(self, gm: torch.fx.GraphModule, fake_mode: Any) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.fake_mode = fake_mode
        self.values: dict[torch.fx.Node, Any] = {}
        self.flops: dict[torch.fx.Node, int] = {}
        self._fake_attrs: dict[str, Any] = {}
        self._counter: FlopCounterMode | None = None
        self.current: torch.fx.Node | None = None  # the node being run (named when it fails)

    def fetch_attr(self, target: str) -> Any:
        if target not in self._fake_attrs:
            val = super().fetch_attr(target)
            if isinstance(val, torch.Tensor):
                val = self.fake_mode.from_tensor(val, static_shapes=True)
            self._fake_attrs[target] = val
        return self._fake_attrs[target]

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        # --tracer fx keeps torch.nn layers as calls: run them on fake copies of their state,
        # so in-place updates (BatchNorm's counters) cannot touch the real buffers.
        module = self.fetch_attr(target)
        state = {name: self.fetch_attr(f"{target}.{name}")
                 for name, _ in [*module.named_parameters(), *module.named_buffers()]}
        return torch.func.functional_call(module, state, tuple(args), dict(kwargs))

    def run_costs(self, inputs: list[Any]) -> None:
        self._counter = flop_counter_mode()
        with self.fake_mode, self._counter:
            self.run(*inputs)

    def run_node(self, n: torch.fx.Node) -> Any:
        self.current = n
        counter = self._counter
        before = counter.get_total_flops() if counter is not None else 0
        result = super().run_node(n)
        if counter is not None and n.op in COMPUTE_OPS:
            self.flops[n] = int(counter.get_total_flops() - before)
            self.values[n] = _shallow(result)
        elif n.op == "placeholder":
            self.values[n] = _shallow(result)
        return result


def _data_dependent(node: torch.fx.Node | None, exc: Exception) -> TraceError:
    """The one-line error for a node that turns a tensor into a Python number (``.item()``)."""
    what = f"node {node.name} ({_op_name(node)})" if node is not None else "a node"
    where = ""
    trace = node.meta.get("stack_trace") if node is not None else None
    if trace:  # the last frame is the user's line: '  File "m.py", line 9, in forward\n    s = y.item()'
        frames = [line.strip() for line in str(trace).strip().splitlines()]
        files = [i for i, line in enumerate(frames) if line.startswith("File ")]
        if files:
            i = files[-1]
            where = f" at {frames[i].removeprefix('File ')}" + (f": {frames[i + 1]}" if i + 1 < len(frames) else "")
    op = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return TraceError(f"{what}{where} reads a tensor's value as a Python number ({op}), so the stages' shapes and "
                      "costs would depend on the data; keep it a tensor (e.g. y * y.sum() instead of "
                      "y * y.sum().item()), or move the conversion out of forward")


def _conv_shape(node: torch.fx.Node, out: Any, root: torch.fx.GraphModule,
                values: dict[torch.fx.Node, Any]) -> tuple[int, float] | None:
    """A convolution's kernel area and its output pixels per call (batch x spatial: what its weight gradient sums
    over), or None where its weight or output is not a tensor of a known shape."""
    if node.op == "call_module":
        weight = getattr(get_path(root, str(node.target)), "weight", None)
    else:
        arg = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        if not isinstance(arg, torch.fx.Node):
            return None
        weight = get_path(root, str(arg.target)) if arg.op == "get_attr" else values.get(arg)
    if not isinstance(weight, torch.Tensor) or not isinstance(out, torch.Tensor) or weight.dim() < 3 or out.dim() < 3:
        return None
    area = math.prod(int(s) for s in weight.shape[2:])
    return area, float(out.numel() // max(1, int(out.shape[1])))


def _gemm_smallest(node: torch.fx.Node, kind: str, out: Any, values: dict[torch.fx.Node, Any]) -> int | None:
    """The smallest of a GEMM node's M, K and N (rows, contracted, columns), or None when its shapes are not known."""
    args = [a for a in node.args if isinstance(a, torch.fx.Node)]
    first = args[1] if kind == "addmm" and len(args) > 1 else (args[0] if args else None)
    x = values.get(first) if first is not None else None
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or x.dim() < 1 or out.dim() < 1:
        return None
    n, k = int(out.shape[-1]), int(x.shape[-1])
    if min(n, k) < 1:
        return None
    return min(out.numel() // n, k, n)


_TRANSPOSES = {"t", "transpose", "permute", "numpy_T"}


def _reads_transposed(node: torch.fx.Node, kind: str) -> bool:
    """Whether a GEMM node's forward reads its second operand transposed: ``linear`` always (x @ W.T); ``mm``,
    ``addmm`` and ``matmul`` where that operand is a transpose of another node."""
    if kind == "linear":
        return True
    args = [a for a in node.args if isinstance(a, torch.fx.Node)]
    second = args[2] if kind == "addmm" and len(args) > 2 else (args[1] if len(args) > 1 else None)
    return second is not None and second.op == "call_function" and _op_name(second).split(".")[0] in _TRANSPOSES


def _shallow(val: Any) -> Any:
    """Keep only what costing needs (tensors, ints) so the record stays small."""
    if isinstance(val, (torch.Tensor, int, float, bool)):
        return val
    if isinstance(val, (tuple, list)):
        return tuple(_shallow(v) for v in val)
    return None


def _is_view(node: torch.fx.Node) -> bool:
    target = node.target
    return bool(getattr(target, "is_view", False))


def _kernel_name(node: torch.fx.Node) -> str:
    """The name ``ComputeRates.kernels`` times this node's kernel under: its op (in-place or not), a max pool's with
    its window (``max_pool2d 3x3``)."""
    kind = _op_name(node).split(".")[0].rstrip("_")
    if kind == "dropout":  # timed at p = 0.1, its mask drawn; at p = 0 (GPT's here) or in eval nothing is drawn
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return kind if train and p != 0 else f"{kind} (none drawn)"
    if kind != "max_pool2d":
        return kind
    size = node.args[1] if len(node.args) > 1 else node.kwargs.get("kernel_size", 0)
    if not isinstance(size, (int, list, tuple)):
        return kind
    hw = [size, size] if isinstance(size, int) else list(size) * (2 if len(size) == 1 else 1)
    return f"max_pool2d {hw[0]}x{hw[1]}" if len(hw) == 2 and all(isinstance(v, int) for v in hw) else kind


def _op_name(node: torch.fx.Node) -> str:
    if node.op == "call_module":
        return f"module:{node.target}"
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    if hasattr(target, "_schema"):
        name = str(target).replace("aten.", "").replace(".default", "")
    return name
