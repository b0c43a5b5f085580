"""Executors of compiled pipelines: the distributed runtime (``PipelineRuntime``) and the
single-process reference executor (the oracle for schedules)."""

from typing import Any

__all__ = ["PipelineRuntime", "RuntimeOptions"]


def __getattr__(name: str) -> Any:  # lazy: importing the reference executor needs no torch.distributed
    if name == "PipelineRuntime":
        from fxpipe.runtime.executor import PipelineRuntime

        return PipelineRuntime
    if name == "RuntimeOptions":
        from fxpipe.runtime.options import RuntimeOptions

        return RuntimeOptions
    raise AttributeError(f"module 'fxpipe.runtime' has no attribute {name!r}")
