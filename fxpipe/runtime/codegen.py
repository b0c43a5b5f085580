"""Compiled stages (``codegen="inductor"``, and ``backend="fxpipe"``'s ``inductor`` option): each stage's F, B and W
graphs, and W's accumulating variants, through Inductor, called on the graphs directly (no Dynamo: a Dynamo
backend's callable runs with Dynamo disabled, and the graphs have no Python to trace).

The graphs are the same ATen graphs the eager runtime calls, so what is computed does not change; Inductor fuses
their element-wise work (Triton on CUDA; on CPU, C++ that a compiler builds). A graph compiles on its first call,
for that call's shapes, strides and dtypes, and again for each new set; a graph Inductor cannot compile (no C++
compiler for CPU code, an op it refuses) runs eagerly, with one warning per :class:`Inductor`. Compiled code
is cached by Inductor's FX graph cache, where Inductor puts it; fxpipe run gives its ranks
``$XDG_CACHE_HOME/fxpipe/inductor`` (else ``~/.cache/fxpipe/inductor``, see :func:`cache_env`): a cache of this user
on this machine, shared by its ranks, never beside the plan: a plan directory is data someone may have handed over,
and fxpipe never executes code from one. Asynchronous schedules read weight versions through
``torch.func.functional_call`` and stay eager.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fxpipe._compat import cpp_compiler
from fxpipe.errors import OptionError

logger = logging.getLogger(__name__)

CODEGENS = ("eager", "inductor")


def check_codegen(codegen: str) -> str | None:
    """Refuse an unknown name; for ``inductor`` without a C++ compiler, the one line to show (then run eagerly)."""
    if codegen not in CODEGENS:
        raise OptionError(f"unknown codegen {codegen!r}; use {' or '.join(CODEGENS)}")
    if codegen != "inductor":
        return None
    if cpp_compiler() is None:
        return ("--codegen inductor needs a C++ compiler (g++ or clang on PATH) for CPU code; none found, so the "
                "stages run eagerly")
    return None


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    root = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "fxpipe" / "inductor"


def cache_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The Inductor cache fxpipe run's ranks get: ``TORCHINDUCTOR_CACHE_DIR`` as the user set it in ``environ`` (the
    launcher's environment before anything imported Inductor, whose first use sets it), else :func:`cache_dir`. The
    ranks' temporary folder (their default cache) is the run's report directory, removed after the run."""
    return {"TORCHINDUCTOR_CACHE_DIR": environ.get("TORCHINDUCTOR_CACHE_DIR") or str(cache_dir(environ))}


class Inductor:
    """The graphs one executor compiles: the first that Inductor cannot compile warns, later ones run eagerly
    quietly."""

    def __init__(self) -> None:
        self.compiled = 0  # graphs compiled (one per graph and input signature)
        self.failed: list[str] = []  # why each graph that runs eagerly could not compile

    def graph(self, gm: Any) -> InductorGraph:
        return InductorGraph(gm, self)

    def give_up(self, gm: Any, exc: Exception) -> None:
        from fxpipe.errors import first_line

        self.failed.append(f"{type(exc).__name__}: {first_line(exc)}")
        if len(self.failed) == 1:
            logger.warning("Inductor could not compile a stage graph (%s); it runs eagerly (op by op), as do any "
                           "others that fail", self.failed[0][:300])


def _signature(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Shapes, strides, dtypes and devices of the tensors; the device of a 0-dim tensor is left out: CUDA's
    attention kernels return their RNG seed and offset on the CPU when run eagerly and on the GPU inside a CUDA
    graph capture, and the compiled graph hands them to the same kernel either way."""
    import torch

    return tuple((tuple(a.shape), a.stride(), a.dtype, a.device if a.dim() else None) if isinstance(a, torch.Tensor)
                 else a if isinstance(a, (int, float, bool, str, type(None))) else type(a) for a in args)


class InductorGraph:
    """``gm`` through Inductor, compiled at its first call for that call's input signature (see the module docstring).

    The graph Inductor gets is a copy of ``gm``'s graph on ``gm`` itself (Inductor may rewrite the graph it is
    given), so it reads ``gm``'s parameters and buffers, where an optimizer updates them in place.
    """

    def __init__(self, gm: Any, owner: Inductor) -> None:
        self.gm = gm
        self.owner = owner
        self.by_signature: dict[tuple[Any, ...], Any] = {}
        self.mutated = _mutated_inputs(gm)

    def __call__(self, *args: Any) -> Any:
        import torch

        # Inputs the graph only reads are made contiguous, so one compiled graph serves every layout a value comes
        # in (an expanded loss gradient, a microbatch's slice of one, a CUDA graph's static copy of it).
        args = tuple(a.contiguous() if isinstance(a, torch.Tensor) and k not in self.mutated else a
                     for k, a in enumerate(args))
        key = _signature(args)
        fn = self.by_signature.get(key)
        if fn is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                # Compiling runs kernels and syncs: the capture fails, and its caller runs the step eagerly,
                # where this graph compiles for these inputs.
                raise RuntimeError(f"a stage graph met new inputs inside a CUDA graph capture ({self._changed(key)}); "
                                   "Inductor compiles it outside the capture")
            fn = self.by_signature[key] = self._compile(args)
        return fn(*args)

    def _changed(self, key: tuple[Any, ...]) -> str:
        """How ``key`` differs from the signature compiled first: what a capture's inputs changed."""
        if not self.by_signature:
            return "nothing compiled yet"
        first = next(iter(self.by_signature))
        diff = [f"input {k}: {a} -> {b}" for k, (a, b) in enumerate(zip(first, key)) if a != b]
        return "; ".join(diff[:3]) or f"{len(first)} -> {len(key)} inputs"

    def _compile(self, args: tuple[Any, ...]) -> Any:
        import torch

        from fxpipe._compat import inductor_compile
        from fxpipe.graphs.fx import copy_graph

        graph = copy_graph(self.gm.graph)
        rebuild = _flat_outputs(graph)
        copy = torch.fx.GraphModule(self.gm, graph, class_name=type(self.gm).__name__)
        try:
            # The graphs carry their own casts (autocast was applied when they were traced): none again here.
            with torch.no_grad(), torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
                fn = inductor_compile(copy, list(args))
        except Exception as exc:  # noqa: BLE001  (whatever Inductor refuses, the graph runs as it is)
            self.owner.give_up(self.gm, exc)
            return self.gm
        self.owner.compiled += 1
        return lambda *a: rebuild(fn(*a))


def _mutated_inputs(gm: Any) -> set[int]:
    """Positions of the placeholders some op of ``gm`` writes in place (W_acc's gradient accumulators)."""
    placeholders = {n: k for k, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    written: set[int] = set()
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            continue
        for arg, spec in zip(node.args, schema.arguments):
            if arg in placeholders and spec.alias_info is not None and spec.alias_info.is_write:
                written.add(placeholders[arg])
        for name, arg in node.kwargs.items():
            spec = next((a for a in schema.arguments if a.name == name), None)
            if arg in placeholders and spec is not None and spec.alias_info is not None and spec.alias_info.is_write:
                written.add(placeholders[arg])
    return written


def _flat_outputs(graph: Any) -> Any:
    """Make ``graph`` return a flat tuple of tensors (what AOTAutograd compiles), in place, and return the function
    that rebuilds the original outputs from it. B's handover may name a multi-output op's whole result (a tuple),
    and an output may be a constant (None)."""
    import operator

    from fxpipe._compat import pytree

    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    leaves, spec = pytree.tree_flatten(out.args[0])
    flat: list[Any] = []
    plan: list[Any] = []  # per leaf: ("node", k) / ("tuple", [k...], type) / ("const", value)
    with graph.inserting_before(out):
        for leaf in leaves:
            val = leaf.meta.get("val") if hasattr(leaf, "meta") else None
            if hasattr(leaf, "op") and isinstance(val, (tuple, list)):
                ks = []
                for i in range(len(val)):
                    ks.append(len(flat))
                    flat.append(graph.call_function(operator.getitem, (leaf, i)))
                plan.append(("tuple", ks, type(val)))
            elif hasattr(leaf, "op"):
                plan.append(("node", len(flat)))
                flat.append(leaf)
            else:
                plan.append(("const", leaf))
    out.args = (tuple(flat),)
    graph.lint()

    def rebuild(results: Any) -> Any:
        values = []
        for entry in plan:
            if entry[0] == "node":
                values.append(results[entry[1]])
            elif entry[0] == "tuple":
                values.append(entry[2](results[k] for k in entry[1]))
            else:
                values.append(entry[1])
        return pytree.tree_unflatten(values, spec)

    return rebuild


def compiled(gm: Any, inductor: Inductor | None = None) -> InductorGraph:
    """``gm`` through Inductor (compiled at its first call; see :class:`InductorGraph`)."""
    return (inductor or Inductor()).graph(gm)


def compile_stage(g: Any, inductor: Inductor | None = None) -> Any:
    """A stage's ``StageGraphs`` with its F, B and W compiled (a fused stage, without them, is returned as it is)."""
    if g.fused:
        return g
    inductor = inductor or Inductor()
    return dataclasses.replace(g, forward=compiled(g.forward, inductor),
                               backward_input=compiled(g.backward_input, inductor),
                               backward_weight=compiled(g.backward_weight, inductor))
