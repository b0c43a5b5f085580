"""Golden stage boundaries: where partition-stages cuts every zoo model at 2 and 4 stages.

Each model is built on the meta device (no weights allocated, gpt-1.5b included), traced once up
to the pass before partition-stages, and then cut by the compile pipeline's own partition-stages
step: with no memory cap, and with the smallest cap any plan meets (so the 1F1B memory in flight
decides the cuts too). The golden records the bounds and each stage's memory in bytes, so a
refactor of the planner that moves a cut or changes the memory model shows up here.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from fxpipe import models
from fxpipe.api import build_steps
from fxpipe.errors import PlanError
from fxpipe.passes import Step, run_steps
from fxpipe.passes.group_layers import layer_stats
from fxpipe.passes.partition_stages import verify_stages
from fxpipe.plan import CompileOptions

STAGES = (2, 4)
ZOO = [f"{entry.family}-{size}" for entry in models.entries() for size in entry.sizes]


def _steps(zoo: models.ZooModel, **options: Any) -> list[Step]:
    return build_steps(zoo.model, zoo.example_inputs, CompileOptions(**options))


def _partition_step(zoo: models.ZooModel, **options: Any) -> Step:
    return next(s for s in _steps(zoo, **options) if s.name == "partition-stages")


def _smallest_cap(step: Step, gm: torch.fx.GraphModule) -> int:
    """The smallest --memory-per-stage that works, as the cap error states it."""
    with pytest.raises(PlanError, match="the smallest cap that works") as info:
        step.run(gm)
    found = re.search(r"the smallest cap that works is [^(]*\((\d+) bytes\)", str(info.value))
    assert found is not None, str(info.value)
    return int(found.group(1))


def _line(label: str, gm: torch.fx.GraphModule) -> str:
    assert verify_stages(gm) == []
    plan = gm.meta["fxpipe_stage_plan"]
    memory = ", ".join(str(int(m)) for m in plan.stage_memory)
    return f"{label}: bounds {plan.bounds}; memory bytes [{memory}]"


@pytest.mark.parametrize("name", ZOO)
def test_zoo_partition_bounds(name: str, golden: Any) -> None:
    zoo = models.build(name, device="meta")
    names = [s.name for s in _steps(zoo)]
    before = names[names.index("partition-stages") - 1]
    # Everything before partition-stages is the same for every stage count: run it once.
    gm, _ = run_steps(_steps(zoo), stop_after=before)
    num_layers = len(layer_stats(gm))
    lines = [f"{name}: {num_layers} layers"]
    for p in (p for p in STAGES if p <= num_layers):
        free = _partition_step(zoo, stages=p).run(gm).gm
        lines.append(_line(f"{p} stages", free))
        cap = _smallest_cap(_partition_step(zoo, stages=p, memory_per_stage=1.0), gm)
        capped = _partition_step(zoo, stages=p, memory_per_stage=float(cap)).run(gm).gm
        lines.append(_line(f"{p} stages, memory cap {cap} bytes (the smallest that works)", capped))
    golden(f"zoo_partitions/{name}.txt", "\n".join(lines) + "\n")
