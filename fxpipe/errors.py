"""Errors fxpipe raises: each states the rule, the values, then the fix, in one line."""

from __future__ import annotations


class FxpipeError(Exception):
    """Base of every error a user can cause; the CLI prints it as one line and exits 2."""


class TraceError(FxpipeError, RuntimeError):
    """The model could not be captured as one whole graph."""


class TargetError(FxpipeError, ValueError):
    """A CLI target (zoo name or `file.py:builder`) could not be resolved."""


class PlanError(FxpipeError, ValueError):
    """No valid stage plan exists for the request (stage count, memory cap, ...)."""


class PlanFileError(FxpipeError, ValueError):
    """A plan directory is missing, corrupt or of an unknown schema version."""


class VerifyError(FxpipeError, AssertionError):
    """A pass left the graph in a state that breaks one of fxpipe's invariants."""


class OptionError(FxpipeError, ValueError):
    """An option has a value fxpipe cannot use."""


class ScheduleError(FxpipeError, ValueError):
    """A schedule breaks a rule (counts, placement, a deadlock); the message shows the step x rank grid."""


class ScheduleOrderError(FxpipeError, ValueError):
    """An executor was asked to run an action before what it depends on, twice, or never."""


class LoweringError(FxpipeError, ValueError):
    """A plan and a schedule cannot be lowered together (they disagree, or a non-tensor crosses ranks)."""


class RankFailedError(FxpipeError, RuntimeError):
    """A rank could not finish its step: a peer failed or timed out, or the plan and schedule disagree."""


class NonFiniteError(FxpipeError, FloatingPointError):
    """Training met a NaN or infinite loss, gradient norm or weight: the run stops before any checkpoint holds it."""


class OutputError(FxpipeError, ValueError):
    """An output path holds something fxpipe may not replace or write through (a link, a user's file)."""


class CheckpointError(FxpipeError, ValueError):
    """A checkpoint cannot be saved or resumed: none complete, tampered, mixed steps, or of another model."""


def first_line(exc: BaseException) -> str:
    """``Type: the first line of its message`` (at most 160 characters): an error inside another's one line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"
