"""Executors of compiled pipelines: the single-process reference executor (the oracle for schedules)."""
