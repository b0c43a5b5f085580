"""Worker for the asynchronous runtime test: one rank trains a plan on a stream per (schedule, weight policy)."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def main(rank: int, world: int, init: str, plan: str, out: str, cfg: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        from fxpipe import models
        from fxpipe.runtime import PipelineRuntime
        sys.path.insert(0, str(Path(__file__).parents[2]))
        from tests._helpers import stream

        zoo = models.build(cfg["model"], dtype=torch.float64)
        result = {}
        for name, policy in cfg["runs"]:
            rt = PipelineRuntime(plan, schedule=name, microbatches=cfg["microbatches"], loss_fn=zoo.loss_fn,
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), weights=policy,
                                 timeout=timedelta(seconds=60))
            losses = rt.train(stream(zoo, cfg["batches"], cfg["microbatches"]))
            reads = {(s, m, phase): (v, ahead) for s, m, phase, v, ahead in rt.versions.log}
            result[f"{name} {policy}"] = {
                "losses": [float(x) for x in losses],
                "params": {n: p.detach().clone() for s in rt.mine for n, p in rt.stages[s].module.named_parameters()},
                "reads": reads,
                "stages": list(rt.mine),
            }
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], json.loads(sys.argv[6]))
    from _leave import leave  # this script's own directory is on sys.path

    leave()
