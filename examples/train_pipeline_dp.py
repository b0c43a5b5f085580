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

The data is a stand-in for yours, drawn from what the plan records (``fxpipe inspect PLAN`` shows it): inputs
shaped like its inputs, integer ones (token ids) within the embedding they index, labelled by a fixed random
"teacher" over the output's classes, so the loss falls as the model learns it. A plan whose inputs it cannot
draw is refused in one line. Only rank 0 prints: ``step K loss L`` per step, then one summary line.
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
from fxpipe.data import index_bounds
from fxpipe.runtime import PipelineRuntime


def teacher_batches(shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], bounds: dict[int, int], classes: int,
                    rows: int, seed: int):  # type: ignore[no-untyped-def]
    """``batch(k)``: step k's global batch of ``rows`` rows, the same on every rank (a function of seed and k).

    Float inputs are standard normal and integer ones uniform in ``[0, bounds[i])``. With float inputs only, the
    label of a row is the class a fixed random linear "teacher" gives its features; with an integer input (token
    ids), each position's label is a fixed random function of its token.
    """
    teacher_gen = torch.Generator().manual_seed(seed)
    ints = [i for i, d in enumerate(dtypes) if not d.is_floating_point]
    if ints:
        table = torch.randint(0, classes, (bounds[ints[0]],), generator=teacher_gen)
    else:
        features = sum(math.prod(s[1:]) for s in shapes)
        teacher = torch.randn(features, classes, generator=teacher_gen, dtype=dtypes[0])

    def batch(k: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + k + 1)
        xs = tuple(torch.randint(0, bounds[i], (rows, *s[1:]), generator=gen, dtype=d) if i in bounds
                   else torch.randn((rows, *s[1:]), generator=gen, dtype=d)
                   for i, (s, d) in enumerate(zip(shapes, dtypes)))
        if ints:
            return xs, table[xs[ints[0]]]
        return xs, (torch.cat([x.reshape(rows, -1) for x in xs], 1) @ teacher).argmax(-1)
    return batch


def plan_batches(pipe: fxpipe.Pipeline, rows: int, seed: int):  # type: ignore[no-untyped-def]
    """``teacher_batches`` for any plan whose inputs this example can draw: its recorded input shapes and dtypes,
    integer inputs within the embedding they index (one forward of one microbatch finds it), and the output's
    last dimension as the classes. Anything else stops here in one line."""
    specs = pipe.plan.inputs
    shapes = [tuple(s.shape) for s in specs]
    dtypes = [getattr(torch, s.dtype) for s in specs]
    output, bounds = index_bounds(pipe, [torch.zeros(s, dtype=d) for s, d in zip(shapes, dtypes)])
    if not isinstance(output, torch.Tensor) or output.dim() < 2:
        raise SystemExit(f"this example trains models whose output is one tensor of logits (rows, ..., classes); "
                         f"the plan's is {type(output).__name__} {tuple(getattr(output, 'shape', ()))}: write your "
                         "own loop (docs/python.md)")
    ints = [i for i, d in enumerate(dtypes) if not d.is_floating_point]
    if any(i not in bounds for i in ints) or len(ints) > 1:
        raise SystemExit(f"the plan's integer inputs {[specs[i].name for i in ints]} must be one input that an "
                         "embedding indexes (token ids), for this example to know their values' range: write your "
                         "own loop (docs/python.md)")
    want = tuple(output.shape[1:-1])
    got = shapes[ints[0]][1:] if ints else ()
    if want != got:
        raise SystemExit(f"this example labels {'each token' if ints else 'each row'}, so the output must be "
                         f"(rows, {', '.join(map(str, (*got, 'classes')))}), not {tuple(output.shape)}: write your "
                         "own loop (docs/python.md)")
    return teacher_batches(shapes, dtypes, bounds, int(output.shape[-1]), rows, seed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plan", help="a plan directory (fxpipe compile ... --out PLAN)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--schedule", default="1f1b", help="a synchronous schedule with one stage per pipeline rank")
    parser.add_argument("--microbatches", type=int, default=4, help="per replica")
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
    rows = world // pp * args.microbatches * pipe.plan.inputs[0].shape[0]  # the global batch (the plan: one microbatch)
    batch = plan_batches(pipe, rows, args.seed)  # before the runtime takes the stages
    mesh = init_device_mesh("cpu", (pp, world // pp), mesh_dim_names=("pp", "dp"))

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # rows (x positions) by classes
        return torch.nn.functional.cross_entropy(logits.flatten(0, -2), target.flatten())

    rt = PipelineRuntime(pipe, schedule=args.schedule, microbatches=args.microbatches, loss_fn=loss_fn, mesh=mesh,
                         optimizer=lambda params: torch.optim.Adam(params, lr=args.lr), timeout=timeout)
    first = 0
    if args.checkpoint_dir and os.path.isdir(args.checkpoint_dir) and os.listdir(args.checkpoint_dir):
        first = rt.load_checkpoint(args.checkpoint_dir)  # written once per stage; loads onto any dp degree
    start = time.perf_counter()
    for k in range(first, args.steps):
        inputs, target = batch(k)
        loss = rt.step(inputs, target)  # the mean over the whole global batch, the same on every rank
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
