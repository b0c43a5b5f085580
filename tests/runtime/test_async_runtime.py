"""Asynchronous training on ranks (gloo): ``PipelineRuntime(..., schedule="async-1f1b" or "layerpipe-async",
weights=...).train`` equals the one-process reference executor's asynchronous run exactly (losses and weights),
and reads exactly the versions the schedule implies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fxpipe
from fxpipe import models
from fxpipe.runtime.reference import ReferenceExecutor
from fxpipe.schedules.generators import generate
from fxpipe.schedules.versions import reads
from tests._helpers import HANG_S, Forked, stream

WORKER = Path(__file__).with_name("_async_worker.py")
# every policy on PipeDream's async-1f1b, and LayerPipe's delayed-gradient schedule (W apart from B) with prediction
RUNS = [("async-1f1b", p) for p in ("stale", "stash", "predict", "predict-consistent")] + \
    [("layerpipe-async", "predict")]


# one launch (~30 s: every rank builds its graphs); 2 and 4 stages: test_async_reference.py
@pytest.mark.parametrize("world", [3])
def test_async_runtime_equals_the_reference_for_every_policy(tmp_path: Path, world: int) -> None:
    zoo = models.build("mlp-tiny", dtype=torch.float64)
    plan = fxpipe.save(fxpipe.compile(zoo.model, zoo.example_inputs, stages=world), tmp_path / "plan")
    cfg = {"model": "mlp-tiny", "runs": RUNS, "batches": 3, "microbatches": 2}
    procs = [Forked([str(WORKER), str(r), str(world), f"file://{tmp_path / 'pg'}", str(plan), str(tmp_path),
                     json.dumps(cfg)]) for r in range(world)]
    for p in procs:
        _, err = p.communicate(timeout=HANG_S)
        assert p.returncode == 0, err[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]

    batches = stream(zoo, cfg["batches"], cfg["microbatches"])
    micro = [((x,), t) for (xb,), tb in batches for x, t in zip(xb.tensor_split(2), tb.tensor_split(2))]
    for name, policy in RUNS:
        schedule = generate(name, world, len(micro))
        pipe = fxpipe.load(plan)
        pipe.build_backward(zoo.example_inputs)
        ex = ReferenceExecutor(pipe, zoo.loss_fn)
        losses = ex.run_async(schedule, micro, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), weights=policy)
        want_losses = torch.stack(losses).view(cfg["batches"], 2).mean(dim=1)
        want = {n: p for st in pipe.stages for n, p in st.module.named_parameters()}
        table = reads(schedule, policy)
        for r in ranks:
            got = r[f"{name} {policy}"]
            torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64), want_losses)
            for n, value in got["params"].items():
                torch.testing.assert_close(value, want[n].detach(), msg=lambda msg, n=n: f"{policy} {n}: {msg}")
            # every phase of this rank's stages read the version (and prediction distance) the schedule implies
            mine = {k: (v.version, v.ahead) for k, v in table.items() if k[0] in got["stages"]}
            assert got["reads"] == mine
