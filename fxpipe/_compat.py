"""The one place fxpipe reaches into torch internals whose names change between releases."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch.utils import (
    _pytree as pytree,  # no public pytree module in torch 2.13; every fxpipe module uses this one
    flop_counter,
)
from torch.utils._python_dispatch import TorchDispatchMode  # the base of a mode that sees every dispatched op

__all__ = ["TorchDispatchMode", "autocast_forward", "cpu_attention_ops", "custom_op_definer", "default_store",
           "descriptor_kind", "dynamo_frame", "fake_tensor_mode", "flatten_mesh", "flop_counter_mode",
           "higher_order_op", "inductor_compile", "is_op_namespace", "load_dynamo", "op_overload", "op_overload_name",
           "serialized_type_names", "joint_graph", "outside_dynamo_tracing", "partition_joint",
           "process_group_size", "pytree", "tracing_state"]


def flop_counter_mode() -> flop_counter.FlopCounterMode:
    """FlopCounterMode that also counts CPU attention.

    torch's registry knows the CUDA flash/efficient/cudnn attention kernels but not
    ``_scaled_dot_product_flash_attention_for_cpu`` (torch 2.13), so attention on CPU and on
    fake CPU tensors would count 0 FLOPs; map it to the same formula.
    """
    aten: Any = torch.ops.aten
    mapping: dict[Any, Any] = {}
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None:
        mapping[fwd] = _raw(flop_counter.flop_registry[aten._scaled_dot_product_flash_attention])
    if bwd is not None:
        mapping[bwd] = _raw(flop_counter.flop_registry[aten._scaled_dot_product_flash_attention_backward])
    return flop_counter.FlopCounterMode(display=False, custom_mapping=mapping)


def load_dynamo() -> None:
    """Import Dynamo now: ``torch.optim`` imports it on an optimizer's first ``add_param_group``
    (``torch._disable_dynamo``), and a process that forks workers imports it once for them all."""
    import torch._dynamo  # noqa: F401


def cpu_attention_ops() -> tuple[Any, Any] | None:
    """The CPU flash-attention kernel's forward and backward ops (``_scaled_dot_product_flash_attention_for_cpu``
    and its ``_backward``), which autograd runs for ``scaled_dot_product_attention`` on CPU; None where this torch
    has not both. The calibration times the backward kernel alone, without autograd's own host time."""
    aten: Any = torch.ops.aten
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    return None if fwd is None or bwd is None else (fwd.default, bwd.default)


def _raw(registered: Any) -> Any:
    """Registry entries already convert tensors to shapes; mark the alias so it is not wrapped twice."""

    def count(*args: Any, **kwargs: Any) -> int:
        return int(registered(*args, **kwargs))

    count._get_raw = True  # type: ignore[attr-defined]
    return count


def joint_graph(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, Any]:
    """The joint forward+backward ATen graph of ``module(*args)`` with typed descriptors, and its fake mode.

    Wraps ``torch._functorch.aot_autograd.aot_export_joint_with_descriptors`` (private, its
    signature still changes between releases). Every placeholder and the output node carry
    ``meta["desc"]``: ParamAOTInput(target=...), PlainAOTInput(idx=...), TangentAOTInput(...),
    PlainAOTOutput(idx=...), GradAOTOutput(grad_of=...), InputMutationAOTOutput(...).
    The returned graph must be run outside the export (fake mode is active inside it).
    """
    import contextlib

    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    with contextlib.ExitStack() as stack:
        if any(t.is_meta for t in (*pytree.tree_leaves(args), *module.parameters(), *module.buffers())
               if isinstance(t, torch.Tensor)):
            stack.enter_context(_FusedAttentionOnMeta())  # off meta, the trace is exactly torch's own
        joint = aot_export_joint_with_descriptors(stack, module, args)
        return joint.graph_module, joint.fake_mode


class _FusedAttentionOnMeta(torch.overrides.TorchFunctionMode):
    """``scaled_dot_product_attention`` on meta tensors as a CPU runs it.

    On meta its dispatch always takes the math path, whose backward keeps the T x T attention weights; a device runs
    a fused kernel that keeps the output and its log-sum-exp. A model planned on meta (too big to hold) would be
    costed with memory no device spends. Where the CPU would choose its fused kernel for these shapes and dtypes
    (``torch._fused_sdp_choice`` on stand-ins of no storage), the trace calls that kernel instead; elsewhere, and off
    meta, nothing changes. Scoped to one trace: no global dispatch table is touched.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _SDPA and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            fused = _cpu_fused_attention(*args, **kwargs)
            if fused is not None:
                return fused
        return func(*args, **kwargs)


_SDPA = (torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)


def _stand_in(t: Any) -> Any:
    """A CPU tensor of ``t``'s shape and dtype over one row of storage (the choice reads shapes, dtypes and the last
    stride only)."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.dim() == 0:
        return torch.empty((), dtype=t.dtype)
    return torch.empty(t.shape[-1], dtype=t.dtype).as_strided(t.shape, (0,) * (t.dim() - 1) + (1,))


def _cpu_fused_attention(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                         is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Any:
    """The CPU fused kernel's output for these arguments, or None where the CPU would not run it."""
    from torch.nn.attention import SDPBackend

    ops = cpu_attention_ops()
    if ops is None or query.dim() != 4 or (enable_gqa and key.shape[-3] != query.shape[-3]):
        return None
    from torch.utils._python_dispatch import _disable_current_modes

    # the trace's fake and proxy modes would make the stand-ins fake and trace the choice
    with _disable_current_modes():
        choice = torch._fused_sdp_choice(_stand_in(query), _stand_in(key), _stand_in(value), _stand_in(attn_mask),
                                         dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if choice != SDPBackend.FLASH_ATTENTION.value:
        return None
    return ops[0](query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


@contextlib.contextmanager
def autocast_forward(device_type: str, dtype: Any) -> Iterator[None]:
    """``torch.autocast`` for tracing joint graphs whose forward autocasts and whose backward does not, as eager's
    ``loss.backward()`` after an autocast region (AOTAutograd's ``backward_pass_autocast="off"``; its default
    traces the backward under the ambient autocast too)."""
    from torch._functorch import config

    with torch.autocast(device_type, dtype=dtype), config.patch(backward_pass_autocast="off"):
        yield


def tracing_state() -> str:
    """What a joint graph traced now depends on beyond the module and its inputs: the autocast regions entered
    (device, dtype), the default dtype, and AOTAutograd's ``backward_pass_autocast`` (``autocast_forward`` sets it)."""
    from torch._functorch import config

    autocast = [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    return f"{autocast} {torch.get_default_dtype()} {config.backward_pass_autocast}"


def partition_joint(joint: torch.fx.GraphModule,
                    num_fwd_outputs: int) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """Forward and backward graphs of a joint graph, saving (not recomputing) what backward needs."""
    from torch._functorch.partitioners import default_partition

    return default_partition(joint, None, num_fwd_outputs=num_fwd_outputs)


def descriptor_kind(desc: Any) -> str:
    """The class name of an AOTAutograd descriptor ("ParamAOTInput", "GradAOTOutput", ...)."""
    return type(desc).__name__


def default_store() -> Any:
    """The default process group's store (``torch.distributed.distributed_c10d._get_default_store``), or None."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # no process group, or the private name moved
        return None


def outside_dynamo_tracing() -> Any:
    """A context with no Dynamo tracing context (``torch._guards.tracing(None)``): see
    fxpipe.backend._outside_dynamo."""
    import torch._guards

    return torch._guards.tracing(None)


def dynamo_frame() -> tuple[Any, dict[str, Any]]:
    """The code object and locals of the frame Dynamo is compiling right now (inside a backend call)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    return tx.f_code, tx.f_locals


def fake_tensor_mode(**kwargs: Any) -> Any:
    """A new ``torch._subclasses.fake_tensor.FakeTensorMode``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**kwargs)


def is_op_namespace(value: Any) -> bool:
    """Whether ``value`` is ``torch.ops.aten``-like (an op namespace) or an op overload packet."""
    import torch._ops

    return isinstance(value, (torch._ops._OpNamespace, torch._ops.OpOverloadPacket))


def op_overload_name(value: Any) -> str | None:
    """``"aten.add.Tensor"`` for the operator overload ``torch.ops.aten.add.Tensor``; None for anything else."""
    import torch._ops

    if not isinstance(value, torch._ops.OpOverload):
        return None
    return f"{value.namespace}.{value._opname}.{value._overloadname}"


def op_overload(namespace: str, name: str, overload: str) -> Any:
    """``torch.ops.<namespace>.<name>.<overload>`` if this torch has it (an OpOverload), else None."""
    import torch._ops

    try:
        found = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    except (AttributeError, RuntimeError):
        return None
    return found if isinstance(found, torch._ops.OpOverload) else None


def custom_op_definer(op: Any) -> str | None:
    """The module whose ``torch.library.custom_op`` defined the operator ``op`` (an OpOverload), if torch records it."""
    from torch._library import custom_ops

    opdef = custom_ops.OPDEFS.get(f"{op.namespace}::{op._opname}")
    fn = getattr(opdef, "_init_fn", None)
    module = getattr(fn, "__module__", None)
    return module if isinstance(module, str) else None


def higher_order_op(value: Any) -> str | None:
    """The name of a higher-order operator (``torch.ops.higher_order.cond`` -> ``"cond"``); None for anything else."""
    import torch._ops

    return value.name() if isinstance(value, torch._ops.HigherOrderOperator) else None


def serialized_type_names() -> frozenset[str]:
    """The type names ``pytree.treespec_loads`` can read now (registered by torch and the imported libraries)."""
    return frozenset(pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE)


def data_dependent_output_error() -> type[Exception]:
    """``torch._subclasses.fake_tensor.DataDependentOutputException``: a fake tensor was asked for its value
    (``.item()``, ``.tolist()``, ``bool(tensor)``), which fake execution cannot know."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    return DataDependentOutputException


def boxed(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` taking its inputs as one list, which it empties on entry: each input is then freed right after its
    last use (the generated code ``del``s it) unless the caller keeps another reference, as AOTAutograd's boxed
    calling convention does (``torch.fx.graph._BoxedCodeGen``, private in torch 2.13). Shares ``gm``'s
    parameters and submodules."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph.set_codegen(torch.fx.graph._BoxedCodeGen())
    return torch.fx.GraphModule(gm, graph, class_name=f"Boxed{type(gm).__name__}")


def flatten_mesh(mesh: Any, name: str, options: Any = None) -> Any:
    """A 1-D DeviceMesh over all the ranks of ``mesh`` (a sub-mesh): ``DeviceMesh._flatten`` (torch 2.13), the
    group a collective over several mesh dimensions at once runs on (made with ``options``: ``gloo_options``)."""
    return mesh._flatten(name, backend_override=(None, options)) if options is not None else mesh._flatten(name)


def gloo_options(timeout: Any) -> Any:
    """Gloo process-group options that wait ``timeout`` (a timedelta; None: no options, torch's default) for a
    collective, for a DeviceMesh's groups (``backend_override``): DeviceMesh makes its groups with torch's default
    timeout (30 minutes for gloo), not the world's. ``ProcessGroupGloo._Options`` is private in torch 2.13."""
    if timeout is None:
        return None
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # bound in C++, absent from the stubs
    options._timeout = timeout
    return options


def process_group_size(group: Any) -> int:
    """The size of a process group given as a group name (functional collectives' argument), a ProcessGroup, or
    the boxed one a c10d op is dispatched with."""
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

        group = _resolve_process_group(GroupName(group))
    elif isinstance(group, torch.ScriptObject):  # the boxed ProcessGroup a c10d op receives
        import torch.distributed as dist

        group = dist.ProcessGroup.unbox(group)
    return int(group.size())


def cpp_compiler() -> str | None:
    """The C++ compiler Inductor would use on CPU (its ``config.cpp.cxx`` candidates, found on PATH), or None."""
    import shutil

    from torch._inductor import config

    for name in config.cpp.cxx:
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def inductor_compile(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """``gm`` compiled by Inductor for these inputs' shapes, strides and dtypes, without Dynamo: a callable of
    ``*args``.

    ``torch._inductor.compile_fx.compile_fx`` is what ``torch.compile``'s Inductor backend calls on Dynamo's
    graph (AOTAutograd, then ``compile_fx_inner``; vLLM's piecewise backend calls it the same way inside its
    own Dynamo backend). It takes the graph's ``get_attr`` parameters and buffers as inputs read on each call,
    so the compiled code sees an optimizer's in-place updates. It may mutate the graph it is given: the caller
    passes a copy. ``torch._inductor.standalone_compile`` deep-copies the module, parameters included, so its
    code would read stale copies. Called outside any Dynamo tracing context; under ``no_grad`` the graph
    compiles for inference (no autograd graph around the already split F, B and W).
    """
    from torch._inductor.compile_fx import compile_fx

    with outside_dynamo_tracing():
        return compile_fx(gm, example_inputs)  # called as Dynamo calls a backend's result: fn(*args)


def pipelining_schedules() -> Any:
    """``torch.distributed.pipelining.schedules``, whose schedule IR is private (``_Action``, ``_validate_schedule``,
    the lowering passes ``_add_send_recv`` and the others, ``_PipelineScheduleRuntime``): fxpipe's torch export and
    its reader of torch's schedule CSVs (``fxpipe.schedules.torch_csv``) reach them through this one module."""
    from torch.distributed.pipelining import schedules

    return schedules
