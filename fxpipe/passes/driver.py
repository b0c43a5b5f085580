"""The pass driver: runs the ordered passes, verifies after each, times them, keeps the history."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch.fx

from fxpipe.errors import OptionError, VerifyError
from fxpipe.report import Report


@dataclass(frozen=True)
class PassResult:
    """What every pass returns: a new graph, whether it changed anything, and its tables."""

    gm: torch.fx.GraphModule
    changed: bool
    reports: tuple[Report, ...] = ()


@dataclass(frozen=True)
class PassRecord:
    """One entry of a compilation's history."""

    name: str
    seconds: float
    changed: bool
    num_nodes: int
    reports: tuple[Report, ...]
    verified: bool
    printed: str | None = None  # the graph after the pass, when --print-after named it


@dataclass(frozen=True)
class Step:
    """A named pass in the pipeline, with the invariant checker that runs after it."""

    name: str
    run: Callable[[torch.fx.GraphModule | None], PassResult]
    verify: Callable[[torch.fx.GraphModule], list[str]] | None = None


@dataclass
class History:
    records: list[PassRecord] = field(default_factory=list)

    def report(self) -> Report:
        return Report(
            title="passes",
            columns=("pass", "ms", "changed", "nodes", "verified"),
            rows=tuple((r.name, round(r.seconds * 1e3, 1), r.changed, r.num_nodes, r.verified) for r in self.records),
        )


def run_steps(
    steps: Sequence[Step],
    *,
    verify_each: bool = False,
    stop_after: str | None = None,
    print_after: Sequence[str] = (),
    on_start: Callable[[str, int, int], None] | None = None,
) -> tuple[torch.fx.GraphModule, History]:
    """Run ``steps`` in order; returns the final graph and the history of every step run.

    ``verify_each`` runs ``graph.lint()`` and the step's own invariant checker after it;
    ``stop_after`` ends the run after the named step; ``print_after`` keeps the printed graph.
    """
    names = [s.name for s in steps]
    for name in [stop_after, *print_after]:
        if name is not None and name not in names:
            raise OptionError(f"unknown pass {name!r} (passes: {', '.join(names)}); use one of those names")
    history = History()
    gm: torch.fx.GraphModule | None = None
    for i, step in enumerate(steps):
        if on_start is not None:
            on_start(step.name, i, len(steps))
        start = time.perf_counter()
        result = step.run(gm)
        seconds = time.perf_counter() - start
        gm = result.gm
        if verify_each:
            verify(gm, step)
        printed = gm.print_readable(print_output=False) if step.name in print_after else None
        history.records.append(
            PassRecord(step.name, seconds, result.changed, len(gm.graph.nodes), result.reports, verify_each, printed)
        )
        if step.name == stop_after:
            break
    assert gm is not None  # steps is never empty: the caller passes the trace step
    return gm, history


def verify(gm: torch.fx.GraphModule, step: Step) -> None:
    """Raise one VerifyError listing every broken invariant after ``step``."""
    problems: list[str] = []
    try:
        gm.graph.lint()
    except Exception as exc:  # lint raises RuntimeError/AssertionError variants
        problems.append(f"graph.lint: {exc}")
    if step.verify is not None:
        problems.extend(step.verify(gm))
    if problems:
        shown = "; ".join(problems[:10]) + (f"; ... {len(problems) - 10} more" if len(problems) > 10 else "")
        raise VerifyError(f"pass {step.name!r} broke {len(problems)} invariant(s): {shown}; this is an fxpipe bug, "
                          "please report it")
