"""Schedules as data: an action IR per rank, generators, a validator, an event simulator and timelines."""

from fxpipe.schedules.ir import Action, Kind, Schedule, ScheduleValidationError

__all__ = ["Action", "Kind", "Schedule", "ScheduleValidationError"]
