"""trace: capture a model as one whole ATen-level GraphModule (torch.export; torch.fx as fallback)."""

from __future__ import annotations

import contextlib
import io
import linecache
import logging
import os
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

import torch
import torch.fx

from fxpipe.errors import TraceError
from fxpipe.graphs.fx import compute_nodes, inline_grad_regions
from fxpipe.passes.driver import PassResult
from fxpipe.report import Report

TRACERS = ("export", "fx")

_TORCH_DIR = os.path.dirname(torch.__file__)
_FXPIPE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STDLIB_DIR = os.path.dirname(os.__file__)


def trace(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    tracer: str = "export",
    example_kwargs: dict[str, Any] | None = None,
) -> PassResult:
    """Capture ``model`` called on ``example_inputs`` as a flat GraphModule.

    Reads: the model and example inputs (real, fake or ``meta`` tensors).
    Writes: a GraphModule whose placeholders are the flattened inputs, whose parameters are
    ``get_attr`` nodes with their original dotted names (shared with ``model``), and whose
    ``gm.meta["fxpipe_in_spec"]`` / ``["fxpipe_out_spec"]`` keep the pytree structure of the
    call, so a pipeline can be called exactly like the model.
    Raises: TraceError naming the user's source line, e.g. for data-dependent control flow.

        class M(nn.Module):                      graph():
            def forward(self, x):                    %x = placeholder[target=x]
                return self.fc(x).relu()   ──▶       %fc_weight = get_attr[target=fc.weight]
                                                     %linear = call_function[aten.linear](%x, ...)
                                                     %relu = call_function[aten.relu](%linear)
    """
    if tracer not in TRACERS:
        raise TraceError(f"unknown tracer {tracer!r} (known: {', '.join(TRACERS)}); use --tracer export or fx")
    kwargs = dict(example_kwargs or {})
    start = time.perf_counter()
    notes: list[str] = []
    with _cache_off(model) as cache_was_on:
        if tracer == "export":
            gm = _trace_export(model, tuple(example_inputs), kwargs)
        else:
            if kwargs:
                raise TraceError("--tracer fx takes positional example inputs only (kwargs given); use --tracer export")
            gm = _trace_fx(model)
    if cache_was_on:
        notes.append("traced with the model's config.use_cache off: training keeps no key/value cache")
    inlined = inline_grad_regions(gm) if tracer == "export" else 0
    if inlined:
        notes.append(f"{inlined} no-grad region(s) inlined, their outputs detached")
    n_params = sum(p.numel() for p in dict(model.named_parameters()).values())
    report = Report(
        title="trace",
        columns=("tracer", "graph nodes", "compute nodes", "parameters", "seconds"),
        rows=((tracer, len(gm.graph.nodes), sum(1 for _ in compute_nodes(gm.graph)), n_params,
               round(time.perf_counter() - start, 3)),),
        notes=tuple(notes),
    )
    return PassResult(gm, True, (report,))


@contextlib.contextmanager
def _cache_off(model: torch.nn.Module) -> Iterator[bool]:
    """A Hugging Face model whose config asks for a key/value cache returns it from ``forward`` (a ``DynamicCache``,
    which neither tracer can carry, and training never reads): its ``config.use_cache`` is off while it is traced,
    and put back after. Yields whether it was on."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "use_cache", None) is not True:
        yield False
        return
    config.use_cache = False
    try:
        yield True
    finally:
        config.use_cache = True


def _trace_export(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.fx.GraphModule:
    with _quiet_torch() as captured:
        try:
            ep = torch.export.export(model, args, kwargs, strict=False)
        except Exception as exc:  # torch raises many types here; all become one clear line
            raise TraceError(_explain_trace_failure(model, exc, "export")) from exc
    if captured.getvalue():
        sys.stderr.write(captured.getvalue())  # it worked: what torch printed is worth seeing
    gm = ep.module()
    graph = gm.graph
    codegen = graph._codegen
    pytree_info = getattr(codegen, "pytree_info", None)
    # The guard function checks input shapes against the example; stages get their inputs
    # from other stages, so it would only ever run on stage 0. Drop it.
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    graph._codegen = torch.fx.graph.CodeGen()
    graph.lint()
    out = torch.fx.GraphModule(gm, graph, class_name="Traced")
    out.meta["fxpipe_in_spec"] = pytree_info.in_spec if pytree_info is not None else None
    out.meta["fxpipe_out_spec"] = pytree_info.out_spec if pytree_info is not None else None
    out.meta["fxpipe_tracer"] = "export"
    return out


@contextlib.contextmanager
def _quiet_torch() -> Iterator[io.StringIO]:
    """Hold back what torch.export prints and logs while it runs.

    On failure it prints the partial graph to stderr and logs warnings before raising; the
    user should see one line naming their code instead.
    """
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    captured = io.StringIO()
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(captured):
            yield captured
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


_NOISY_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export", "torch._export",
                  "torch.fx.experimental.recording")


def _trace_fx(model: torch.nn.Module) -> torch.fx.GraphModule:
    try:
        gm = torch.fx.symbolic_trace(model)
    except Exception as exc:
        raise TraceError(_explain_trace_failure(model, exc, "fx")) from exc
    gm.meta["fxpipe_in_spec"] = None
    gm.meta["fxpipe_out_spec"] = None
    gm.meta["fxpipe_tracer"] = "fx"
    return gm


def _explain_trace_failure(model: torch.nn.Module, exc: BaseException, tracer: str) -> str:
    where = _user_frame(exc)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = f"{type(exc).__name__} {exc}"
    data_dependent = any(
        key in text
        for key in ("data-dependent", "DataDependent", "data dependent", "cannot be used as inputs to control flow",
                    "GuardOnDataDependent")
    )
    name = type(model).__name__
    at = f" at {where}" if where else ""
    if data_dependent:
        fix = ("write the branch with torch.cond, or make it depend on shapes only"
               + ("; --tracer fx cannot trace it either" if tracer == "export" else "; then use --tracer export"))
        return f"cannot trace {name}: data-dependent control flow{at}; {fix}"
    other = "fx" if tracer == "export" else "export"
    hint = f"fix the model or try --tracer {other}"
    if "Cache" in first and "not a known type" in first:  # a cache object in the output (--tracer fx cannot either)
        hint = "build the model with use_cache=False (its config's key/value cache cannot be traced)"
    return f"cannot trace {name} with --tracer {tracer}{at}: {_clip(first)}; {hint}"


def _clip(text: str, limit: int = 300) -> str:
    """``text`` cut to about ``limit`` characters at a word boundary, marked with an ellipsis."""
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " ..."


def _user_frame(exc: BaseException) -> str:
    """``file:line: code`` of the deepest frame in the user's own code, across chained exceptions."""
    best = ""
    seen: set[int] = set()
    chain: BaseException | None = exc
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        tb: TracebackType | None = chain.__traceback__
        for frame, lineno in traceback.walk_tb(tb):
            fname = frame.f_code.co_filename
            if _is_user_file(fname):
                code = linecache.getline(fname, lineno).strip()
                best = f"{fname}:{lineno}" + (f" `{code}`" if code else "")
        chain = chain.__cause__ or chain.__context__
    return best


def _is_user_file(fname: str) -> bool:
    if fname.startswith("<"):
        return False
    path = os.path.abspath(fname)
    fxpipe_models = os.path.join(_FXPIPE_DIR, "models")
    if path.startswith(fxpipe_models):
        return True  # the built-in zoo is "user code" too
    return not (path.startswith(_TORCH_DIR) or path.startswith(_FXPIPE_DIR) or path.startswith(_STDLIB_DIR))
