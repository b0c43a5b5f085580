"""fxpipe: torch.fx passes that turn a PyTorch model into a pipeline-parallel training program.

Public API: ``compile``, ``load``, ``Pipeline``, ``Stage`` and the errors. Attributes load
lazily so that ``fxpipe --help`` answers without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fxpipe.errors import FxpipeError, OptionError, PlanError, PlanFileError, TargetError, TraceError, VerifyError

__version__ = "0.1.0"

if TYPE_CHECKING:
    from fxpipe.pipeline import Pipeline, Stage, compile
    from fxpipe.plan_dir import load

_LAZY = {"compile": "fxpipe.pipeline", "Pipeline": "fxpipe.pipeline", "Stage": "fxpipe.pipeline", "load": "fxpipe.plan_dir",
         "last_report": "fxpipe.backend"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fxpipe' has no attribute {name!r}")


__all__ = [
    "FxpipeError", "OptionError", "Pipeline", "PlanError", "PlanFileError", "Stage", "TargetError", "TraceError",
    "VerifyError", "compile", "last_report", "load",
]
