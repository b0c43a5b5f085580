"""Golden files: the printed pass tables, stage code and stage graph data of a small compile (pytest --update-golden rewrites them)."""

from __future__ import annotations

import json
from typing import Any

import fxpipe
from fxpipe import models
from fxpipe.graphs import serialize
from fxpipe.plan_dir import stage_source
from fxpipe.render import render_text


def test_gpt_tiny_tables_and_stage_code(golden: Any) -> None:
    zoo = models.build("gpt-tiny")
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=3)
    tables = [r for r in pipe.report() if r.title.split(":")[0] in ("group-layers", "count-backward", "partition-stages", "split-stages", "split-backward")]
    golden("gpt_tiny_3_stages.txt", "\n\n".join(render_text(r) for r in tables) + "\n")
    golden("gpt_tiny_stage_1.py.txt", stage_source(pipe.stages[1].module, 1, 3))
    golden("gpt_tiny_stage_1.json.txt", json.dumps(serialize.dump(pipe.stages[1].module, "stage 1"), indent=1) + "\n")
