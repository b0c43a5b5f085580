"""Worker for tests/runtime/test_torch_export.py: one rank trains every case's exported plan under torch's
``_PipelineScheduleRuntime`` and then under fxpipe's runtime, and saves each step's loss and gradients by name."""

from __future__ import annotations

import importlib.util
import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[2]))  # run as a script: make `tests` importable

LR = 0.05


def data(case: dict[str, Any]) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor, Any]:
    """The case's model (as compiled: same seed, float64), whole batch (2 rows per microbatch), target and loss."""
    m = case["microbatches"]
    if case["model"] == "gpt-tiny":
        from tests.runtime._dist_worker import build

        return build("gpt-tiny", m)
    spec = importlib.util.spec_from_file_location("llama_user", case["file"])
    assert spec is not None and spec.loader is not None
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)
    model, _ = user.build()
    gen = torch.Generator().manual_seed(1)
    idx, target = torch.randint(0, 96, (2 * m, 16), generator=gen), torch.randint(0, 96, (2 * m, 16), generator=gen)
    return model, (idx,), target, user.loss


def reference(case: dict[str, Any]) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """One process: each step's mean loss over the microbatches and every parameter's gradient (tied ones under
    each name), plain SGD."""
    model, inputs, target, loss_fn = data(case)
    m = case["microbatches"]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    xs, ts = [x.tensor_split(m) for x in inputs], target.tensor_split(m)
    losses, grads = [], []
    for _ in range(case["steps"]):
        loss = sum(loss_fn(model(*(x[i] for x in xs)), ts[i]) for i in range(m)) / m
        loss.backward()
        losses.append(float(loss))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)})
        opt.step()
        opt.zero_grad()
    return losses, grads


class Recording(torch.optim.SGD):
    """SGD that keeps each step's gradients (by parameter id) before it steps."""

    def __init__(self, params: Any, log: list[dict[int, torch.Tensor]]) -> None:
        super().__init__(params, lr=LR)
        self.log = log

    def step(self, closure: Any = None) -> Any:
        self.log.append({id(p): p.grad.clone() for g in self.param_groups for p in g["params"] if p.grad is not None})
        return super().step(closure)


def run_torch(case: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    from fxpipe.runtime.torch_export import torch_schedule

    _, inputs, target, loss_fn = data(case)
    stages, schedule = torch_schedule(case["plan"], rank, world, loss_fn)
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    params = {n: p for s in stages for n, p in s.submod.named_parameters()}
    opt = torch.optim.SGD(params.values(), lr=LR) if params else None  # gpt-tiny's dropout stage has none
    losses, grads = [], []
    for _ in range(case["steps"]):
        mb_losses: list[torch.Tensor] = []
        schedule.step(*(inputs if first else ()), target=target if last else None, losses=mb_losses)
        if last:
            losses.append(float(sum(mb_losses).detach() / len(mb_losses)))
        grads.append({n: p.grad.clone() for n, p in params.items() if p.grad is not None})
        if opt is not None:
            opt.step()
            opt.zero_grad()
    return {"losses": losses, "grads": grads}


def run_fxpipe(case: dict[str, Any], rank: int) -> dict[str, Any]:
    import fxpipe
    from fxpipe.runtime.executor import PipelineRuntime

    _, inputs, target, loss_fn = data(case)
    pipe = fxpipe.load(case["plan"])
    log: list[dict[int, torch.Tensor]] = []
    rt = PipelineRuntime(pipe, None, loss_fn, optimizer=lambda ps: Recording(ps, log), timeout=timedelta(seconds=30))
    names = {id(p): n for s in pipe.stage_list() for n, p in s.module.named_parameters()}
    losses, grads = [], []
    for _ in range(case["steps"]):
        before = len(log)
        losses.append(float(rt.step(inputs, target)))
        grads.append({names[i]: g for entry in log[before:] for i, g in entry.items()})
    return {"losses": losses, "grads": grads}


def main() -> None:
    rank, world, init, out, cfg = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        for name, case in cfg["cases"].items():
            result = {"torch": run_torch(case, rank, world), "fxpipe": run_fxpipe(case, rank)}
            torch.save(result, Path(out) / f"{name}-rank{rank}.pt")
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
