"""Planning algorithms on plain values (no torch): the cost model and the exact stage DP."""

from fxpipe.planning.cost import SCHEDULES, InFlight, activation_memory, in_flight, limited_in_flight, transfer_time
from fxpipe.planning.stage_dp import (
    Moves,
    StagePlan,
    format_bytes,
    min_memory_cap,
    plan_stages,
    stage_memory,
    stage_time,
)

__all__ = [
    "SCHEDULES",
    "InFlight",
    "Moves",
    "StagePlan",
    "activation_memory",
    "format_bytes",
    "in_flight",
    "limited_in_flight",
    "min_memory_cap",
    "plan_stages",
    "stage_memory",
    "stage_time",
    "transfer_time",
]
