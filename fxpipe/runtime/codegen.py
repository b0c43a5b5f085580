"""Compiled stages (``codegen="inductor"``): each stage's F, B and W graphs, and W's accumulating variants, through
``torch.compile`` (Inductor), with static shapes and one graph each (``fullgraph``).

The graphs are the same ATen graphs the eager runtime calls, so what is computed does not change; Inductor fuses
their element-wise work and, on CPU, emits C++ that a compiler builds. Without a C++ compiler (``g++``/``clang``
on PATH, what Inductor looks for) the stages run eagerly and one line says so. Compiled code is cached by
Inductor in ``$XDG_CACHE_HOME/fxpipe/inductor`` (else ``~/.cache/fxpipe/inductor``): a cache of this user on this
machine, shared by its ranks, never beside the plan: a plan directory is data someone may have handed over, and
fxpipe never executes code from one. Asynchronous schedules read weight versions through
``torch.func.functional_call`` and stay eager.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from fxpipe._compat import cpp_compiler
from fxpipe.errors import OptionError

CODEGENS = ("eager", "inductor")


def check_codegen(codegen: str) -> str | None:
    """Refuse an unknown name; for ``inductor`` without a C++ compiler, the one line to show (then run eagerly)."""
    if codegen not in CODEGENS:
        raise OptionError(f"unknown codegen {codegen!r}; use {' or '.join(CODEGENS)}")
    if codegen != "inductor":
        return None
    use_cache_dir()  # before the probe imports Inductor's config, which sets its own default that the ranks inherit
    if cpp_compiler() is None:
        return ("--codegen inductor needs a C++ compiler (g++ or clang on PATH) for CPU code; none found, so the "
                "stages run eagerly")
    return None


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "fxpipe" / "inductor"


def use_cache_dir() -> None:
    """Point Inductor's cache at :func:`cache_dir`, unless this process already set ``TORCHINDUCTOR_CACHE_DIR``."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir()))


def compiled(gm: Any) -> Any:
    """``gm`` through Inductor: static shapes, one graph (the graphs have no Python control flow to break on)."""
    import torch

    use_cache_dir()
    return torch.compile(gm, backend="inductor", dynamic=False, fullgraph=True)


def compile_stage(g: Any) -> Any:
    """A stage's ``StageGraphs`` with its F, B and W compiled (a fused stage, without them, is returned as it is)."""
    if g.fused:
        return g
    return dataclasses.replace(g, forward=compiled(g.forward), backward_input=compiled(g.backward_input),
                               backward_weight=compiled(g.backward_weight))
