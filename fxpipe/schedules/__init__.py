"""Schedules as data: an action IR per rank, generators, a validator, an event simulator and timelines."""

from fxpipe.schedules.ir import Action, Kind, Schedule

__all__ = ["Action", "Kind", "Schedule"]
