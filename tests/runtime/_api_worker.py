"""Worker for the PipelineRuntime API test: the issue's shape, a plan directory and an optimizer class, nothing else."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def _process_state() -> dict[str, dict[int, object]]:
    """Every thread's niceness and CPU affinity (Linux: the threads under /proc/self/task), and the environment."""
    import os

    nice, cpus = {}, {}
    for task in Path("/proc/self/task").iterdir():
        tid = int(task.name)
        try:
            nice[tid], cpus[tid] = os.getpriority(os.PRIO_PROCESS, tid), sorted(os.sched_getaffinity(tid))
        except OSError:  # a thread that ended meanwhile
            continue
    return {"nice": nice, "cpus": cpus, "environ": dict(os.environ)}


def main(rank: int, world: int, init: str, plan: str, out: str, cfg: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    try:
        from fxpipe import models
        from fxpipe.cli.rank_common import synthetic_batch
        from fxpipe.runtime import PipelineRuntime

        if cfg.get("device"):  # two ranks on one GPU: gloo, staged through pinned memory on a comm stream
            import fxpipe

            torch.manual_seed(0)
            zoo = models.build(cfg["model"], dtype=torch.float64, device=cfg["device"])
            plan = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2)
        else:
            zoo = models.build(cfg["model"], dtype=torch.float64)
        loss_fn = zoo.loss_fn  # the runtime imports no model zoo: the script says its loss
        from fxpipe.calibration import host_memory
        from fxpipe.calibration.host import HostTuning

        mallopts: list[int] = []  # calls of fxpipe's one mallopt wrapper, counted (mallopt cannot be read back)
        raise_thresholds = host_memory._raise_thresholds
        host_memory._raise_thresholds = lambda: mallopts.append(1) or raise_thresholds()
        found = _process_state()
        rt = PipelineRuntime(plan, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3), loss_fn=loss_fn,
                             schedule=cfg.get("schedule"), microbatches=cfg.get("microbatches"),
                             prefetch=cfg.get("prefetch"), cuda_graphs=cfg.get("cuda_graphs", False),
                             host=HostTuning(**cfg["host"]) if "host" in cfg else None)
        zoo = models.build(cfg["model"], dtype=torch.float64)
        if cfg.get("device"):
            assert rt.device.type == "cuda" and rt.channel.staged and rt.channel.stream is not None
        inputs, target = synthetic_batch(zoo, rt.schedule.num_microbatches)
        losses = [float(rt.step(inputs, target)) for _ in range(cfg.get("steps", 3))]
        graphs = rt.graph_set
        from fxpipe.calibration.threads import loop_priorities

        torch.save({"losses": losses, "gloo_loops": rt.gloo_loops, "send_yield": rt.channel.yield_after_send,
                    "loop_priorities": loop_priorities(), "found": found, "after": _process_state(),
                    "mallopts": len(mallopts), "state": rt.state_dict(), "optimizers": sorted(rt.optimizers),
                    "schedule": rt.schedule.name,
                    "graphs": None if graphs is None else {"captured": graphs.captured, "fallbacks": graphs.fallbacks}},
                   Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], json.loads(sys.argv[6]))
    from _leave import leave  # this script's own directory is on sys.path

    leave()
