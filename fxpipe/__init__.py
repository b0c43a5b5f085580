"""fxpipe: torch.fx passes that turn a PyTorch model into a pipeline-parallel training program.

Public API: ``compile``, ``load``, ``save``, ``Pipeline``, ``Stage``, ``Plan``, the errors, and ``export_torch`` /
``torch_schedule`` (a plan on torch.distributed.pipelining's runtime), ``RuntimeOptions`` (how
``fxpipe.runtime.PipelineRuntime`` trains). Attributes load
lazily so that ``fxpipe --help`` answers without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fxpipe.errors import (
    FxpipeError,
    LoweringError,
    OptionError,
    PlanError,
    PlanFileError,
    RankFailedError,
    ScheduleError,
    TargetError,
    TraceError,
    VerifyError,
)

if TYPE_CHECKING:
    from fxpipe.api import compile, load, save
    from fxpipe.graphs.convention import Record
    from fxpipe.pipeline import Pipeline, Stage
    from fxpipe.plan import Plan
    from fxpipe.runtime.options import RuntimeOptions
    from fxpipe.runtime.torch_export import export_torch, torch_schedule

_LAZY = {"compile": "fxpipe.api", "load": "fxpipe.api", "save": "fxpipe.api", "Pipeline": "fxpipe.pipeline",
         "Stage": "fxpipe.pipeline", "Plan": "fxpipe.plan", "Record": "fxpipe.graphs.convention",
         "DEFAULTS": "fxpipe.plan", "last_report": "fxpipe.backend", "export_torch": "fxpipe.runtime.torch_export",
         "torch_schedule": "fxpipe.runtime.torch_export", "RuntimeOptions": "fxpipe.runtime.options"}


def __getattr__(name: str) -> Any:
    if name == "__version__":  # read from the installed metadata only when asked (reading it is not free)
        from fxpipe.plan import fxpipe_version

        return fxpipe_version()
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fxpipe' has no attribute {name!r}")


__all__ = [
    "DEFAULTS", "FxpipeError", "LoweringError", "OptionError", "Pipeline", "Plan", "PlanError", "PlanFileError",
    "RankFailedError", "Record", "RuntimeOptions", "ScheduleError", "Stage", "TargetError", "TraceError",
    "VerifyError", "compile", "export_torch", "last_report", "load", "save", "torch_schedule",
]
