"""Pipeline x data parallel training of an fxpipe plan with ``PipelineRuntime``: one process per rank.

    fxpipe compile mlp-small --stages 2 --out plan/
    torchrun --standalone --nproc-per-node 4 examples/train_pipeline_dp.py plan/ --steps 20

The world is the pipeline's ranks x dp replicas: 2 stages on 4 ranks is 2 replicas of a 2-rank
pipeline. The mesh is torch's ``init_device_mesh`` with dimensions ("pp", "dp"), so rank = pp x dp
+ replica and a stage's replicas are neighbouring ranks (on one machine, when a node holds whole
dp groups). Every rank builds the same global batch (dp x microbatches x the rows of the plan's
compiled microbatch) from the seed; replica d trains on the d-th slice, and each stage's gradients
are averaged over its replicas before the optimizer steps. ``slurm_pipeline_dp.sh`` starts it on
several machines.

The data is a stand-in for yours: inputs shaped like the plan's, labelled by a fixed random linear
"teacher" (``--classes`` outputs), so the loss falls as the model learns it. Only rank 0 prints:
``step K loss L`` per step, then one summary line.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fxpipe
from fxpipe.runtime import PipelineRuntime


def teacher_batches(shape: tuple[int, ...], dtype: torch.dtype, classes: int, rows: int, seed: int):  # type: ignore[no-untyped-def]
    """``batch(k)``: step k's global batch of ``rows`` rows, the same on every rank (a function of seed and k)."""
    features = math.prod(shape[1:])
    teacher = torch.randn(features, classes, generator=torch.Generator().manual_seed(seed), dtype=dtype)

    def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + k + 1)
        x = torch.randn((rows, *shape[1:]), generator=gen, dtype=dtype)
        return x, (x.reshape(rows, features) @ teacher).argmax(-1)
    return batch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plan", help="a plan directory (fxpipe compile ... --out PLAN)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--schedule", default="1f1b", help="a synchronous schedule with one stage per pipeline rank")
    parser.add_argument("--microbatches", type=int, default=4, help="per replica")
    parser.add_argument("--classes", type=int, default=10, help="the model's outputs (mlp-small: 10)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a rank waits for a peer")
    parser.add_argument("--checkpoint-dir", default=None, help="save here every step; resume from its newest step")
    args = parser.parse_args(argv)

    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)  # torchrun (or srun + torchrun) set RANK, WORLD_SIZE, MASTER_*
    pipe = fxpipe.load(args.plan)  # the stages, their F/B/W graphs and weights; no model source needed
    pp = pipe.num_stages  # 1f1b, gpipe, zb-h1, zb-h2: one stage per pipeline rank
    world = dist.get_world_size()
    if world % pp:
        raise SystemExit(f"{world} ranks do not make whole replicas of a {pp}-rank pipeline; start a multiple of {pp}")
    mesh = init_device_mesh("cpu", (pp, world // pp), mesh_dim_names=("pp", "dp"))

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits, target)

    rt = PipelineRuntime(pipe, schedule=args.schedule, microbatches=args.microbatches, loss_fn=loss_fn, mesh=mesh,
                         optimizer=lambda params: torch.optim.Adam(params, lr=args.lr), timeout=timeout)
    spec = pipe.plan.inputs[0]  # one compiled microbatch: (rows, features)
    rows = rt.dp * args.microbatches * spec.shape[0]  # the global batch
    batch = teacher_batches(tuple(spec.shape), getattr(torch, spec.dtype), args.classes, rows, args.seed)
    first = 0
    if args.checkpoint_dir and os.path.isdir(args.checkpoint_dir) and os.listdir(args.checkpoint_dir):
        first = rt.load_checkpoint(args.checkpoint_dir)  # written once per stage; loads onto any dp degree
    start = time.perf_counter()
    for k in range(first, args.steps):
        x, y = batch(k)
        loss = rt.step((x,), y)  # the mean over the whole global batch, the same on every rank
        if args.checkpoint_dir:
            rt.save_checkpoint(args.checkpoint_dir, k + 1)
        if rt.rank == 0:
            print(f"step {k} loss {loss.item():.8f}", flush=True)
    if rt.rank == 0:
        seconds = time.perf_counter() - start
        print(f"trained steps {first}..{args.steps - 1} on {world} ranks: pp {pp} x dp {rt.dp}, global batch {rows} "
              f"rows, {max(args.steps - first, 0) * rows / max(seconds, 1e-9):.0f} samples/s", flush=True)
    del rt  # the runtime's communication buffers and works go before the process group does
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
