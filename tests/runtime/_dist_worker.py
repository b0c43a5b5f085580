"""Worker for the multi-process runtime tests: one rank trains a model on its stages, then saves its parameters."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[2]))  # run as a script: make `tests` importable


def build(model: str, m: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor, Any]:
    """A model in float64 with a batch of 2 per microbatch: a zoo name, or ``skip-tied``."""
    if model == "skip-tied":
        from tests.passes.test_split_stages import SkipTied, _ce

        torch.manual_seed(0)
        net = SkipTied().double()
        gen = torch.Generator().manual_seed(1)
        return net, (torch.randint(0, 32, (2 * m, 5), generator=gen),), torch.randint(0, 32, (2 * m, 5), generator=gen), _ce
    from fxpipe import models

    zoo = models.build(model, dtype=torch.float64, batch_size=m * 2)
    return zoo.model, zoo.example_inputs, zoo.example_target, zoo.loss_fn


def die_mid_step(rt: Any, rank: int, cfg: dict[str, Any], out: str) -> Callable[[int], None]:
    """``kill_rank``: SIGKILL this process right after its ``kill_at``-th compute action (F, B, W or BW) of
    step ``kill_step`` (default 1), counting from 1, before that action's sends go out; ``kill_at`` -1 is
    the step's last action (after it come only the step's send completions and sums), 0 the step's start.
    The moment of death (``time.time()``) is written to ``OUT/killed-rank{R}`` first.

    The runtime's executor core's ``run`` (one compute action) is wrapped to count. Returns the function the
    training loop calls at the start of each step.
    """
    if rank != cfg.get("kill_rank", -1):
        return lambda step: None
    state = {"step": -1, "acts": 0, "per_step": 0}
    at, when = cfg.get("kill_at", 1), cfg.get("kill_step", 1)

    def die() -> None:
        (Path(out) / f"killed-rank{rank}").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    act = rt.core.run  # the bound method: the wrapper below shadows it on this instance only

    def counted(*args: Any, **kwargs: Any) -> Any:
        result = act(*args, **kwargs)
        state["acts"] += 1
        if state["step"] == when and state["acts"] == (state["per_step"] if at == -1 else at):
            die()
        return result

    rt.core.run = counted

    def start(step: int) -> None:
        state["per_step"] = max(state["per_step"], state["acts"])  # every step runs the same actions
        state["step"], state["acts"] = step, 0
        if step == when and at == 0:
            die()

    return start


def train(rank: int, world: int, init: str, out: str, cfg: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.get("pg_timeout", 20)))
    try:
        import fxpipe
        from fxpipe.runtime.executor import PipelineRuntime
        from fxpipe.schedules.generators import generate
        from fxpipe.schedules.simulate import Costs

        m = cfg["microbatches"]
        compiled: dict[int, Any] = {}
        for name in cfg["schedules"]:
            # interleaved-1f1b puts two stages on each rank; the others one.
            stages = 2 * world if name == "interleaved-1f1b" else world
            if stages not in compiled:
                model, inputs, target, loss_fn = build(cfg["model"], m)
                # Two stages per rank can need more layers than the blocks give: cut between nodes.
                granularity = "node" if stages > world else cfg.get("granularity", "auto")
                pipe = fxpipe.compile(model, tuple(x.tensor_split(m)[0] for x in inputs), stages=stages,
                                      granularity=granularity)
                state = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
                compiled[stages] = (model, inputs, target, loss_fn, pipe, state)
            model, inputs, target, loss_fn, pipe, state = compiled[stages]
            with torch.no_grad():  # every schedule starts from the same weights and statistics
                for k, v in model.state_dict(keep_vars=True).items():
                    v.copy_(state[k])
            if name == "auto":
                from fxpipe.schedules.auto import auto

                sched = auto(stages, Costs.from_plan(pipe.plan), microbatches=[m]).schedule
            else:
                sched = generate(name, stages, m, Costs.from_plan(pipe.plan))
            rt = PipelineRuntime(pipe, sched, loss_fn, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                                 timeout=timedelta(seconds=cfg.get("timeout", 10)))
            starting = die_mid_step(rt, rank, cfg, out)
            first = rt.load_checkpoint(cfg["resume"]) if cfg.get("resume") else 0
            losses = []
            for step in range(first, cfg["steps"]):
                if rank == cfg.get("fail_rank", -1) and step == 1:
                    raise ValueError(f"boom on rank {rank}")
                starting(step)
                losses.append(float(rt.step(inputs, target)))
                if cfg.get("checkpoint") and step + 1 == cfg.get("checkpoint_after"):
                    rt.save_checkpoint(cfg["checkpoint"], step + 1)
            torch.save({"losses": losses, "state": rt.state_dict()}, Path(out) / f"{name}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    train(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], json.loads(sys.argv[5]))
