"""HostTuning: the process-wide settings a rank may ask for, as one plain value.

fxpipe changes no thread priority, CPU affinity or allocator setting of the process unless its caller passes one
of these (``PipelineRuntime(..., host=HostTuning(...))``); ``HostTuning()`` touches nothing. ``fxpipe run`` asks for
:meth:`HostTuning.for_runs` (its flags ``--pin-ranks``, ``--gloo-loop-nice``, ``--send-yield`` and
``--keep-freed-memory`` change it). Why each helps is told where it is done: :mod:`fxpipe.calibration.threads`
and :mod:`fxpipe.calibration.host_memory`; what each measured is in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from fxpipe.errors import OptionError

__all__ = ["SEND_YIELDS", "HostTuning"]

SEND_YIELDS = ("auto", "on", "off")


@dataclass(frozen=True)
class HostTuning:
    """What a rank changes about its process; the defaults change nothing.

    ``pin_cpus``: run each local rank's threads on CPUs of its own (:func:`~fxpipe.calibration.threads.rank_cpus`).
    ``gloo_loop_nice``: 1 to 19 runs gloo's socket threads at that niceness (0 leaves them).
    ``send_yield``: ``on`` yields the core once after each gloo send, ``auto`` where the rank's actions are short
    (:data:`~fxpipe.calibration.threads.SHORT_ACTION_S`), ``off`` never.
    ``keep_freed_memory``: raise glibc's mmap and trim thresholds, so a step's large temporaries are reused.
    """

    pin_cpus: bool = False
    gloo_loop_nice: int = 0
    send_yield: str = "off"
    keep_freed_memory: bool = False

    def __post_init__(self) -> None:
        nice = self.gloo_loop_nice
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
            raise OptionError(f"gloo_loop_nice must be a whole number from 0 to 19 (got {nice!r}); 0 leaves gloo's "
                              "socket threads at their priority, 19 runs them below the rank's own")
        if self.send_yield not in SEND_YIELDS:
            raise OptionError(f"send_yield must be one of {', '.join(SEND_YIELDS)} (got {self.send_yield!r})")

    @classmethod
    def for_runs(cls) -> HostTuning:
        """What ``fxpipe run``'s ranks ask for unless its flags say otherwise."""
        return cls(pin_cpus=True, gloo_loop_nice=19, send_yield="auto", keep_freed_memory=True)

    def pin(self, local_rank: int, local_world: int) -> tuple[int, ...]:
        """With ``pin_cpus``: bind this process's threads to local rank ``local_rank``'s share of its CPUs; the CPUs
        (none: left to the system). Call it before the process group starts, so gloo's threads start there too."""
        from fxpipe.calibration.threads import pin_local_rank

        return pin_local_rank(local_rank, local_world) if self.pin_cpus else ()

    def apply(self, rank: int, world: int) -> tuple[int, bool]:
        """What a rank asks for once its process groups are made: its CPUs (:meth:`pin`; the local rank and world
        from torchrun's ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``, else ``rank`` of ``world``), gloo's socket threads at
        ``gloo_loop_nice``, freed memory kept. Returns (gloo threads reniced, whether freed memory is kept)."""
        from fxpipe.calibration.host_memory import keep_freed_memory
        from fxpipe.calibration.threads import lower_gloo_loops

        if self.pin_cpus:
            self.pin(int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        loops = lower_gloo_loops(self.gloo_loop_nice) if self.gloo_loop_nice else 0
        return loops, keep_freed_memory() if self.keep_freed_memory else False

    def yields_after_send(self, action_s: float | None) -> bool:
        """Whether a rank whose actions take ``action_s`` seconds each (None: unknown) yields after each send."""
        from fxpipe.calibration.threads import send_yields

        return send_yields(self.send_yield, action_s)
