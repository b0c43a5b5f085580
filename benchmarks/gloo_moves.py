"""What gloo's collectives and DTensor's redistributes cost per byte, against the all-reduce link the strategy model
prices every move at.

On ``--ranks`` gloo ranks: ``calibrate_allreduce`` (the link ``strategy_measured.py`` gives the search), then for
activation-shaped tensors of ``--sizes`` bytes the median of ``--iters`` runs (after 2, each after a barrier, the
slowest rank's) of ``all_gather_single``, ``reduce_scatter_single``, ``all_reduce``, and DTensor's redistributes
between the strategy runtime's placements on a 1-D mesh. The model's time is ``planning.strategies.transfer``'s
bytes and steps at that link (an all-gather or reduce-scatter receives (d - 1) / d of the tensor in d - 1 steps, an
all-reduce twice that); the ratio is measured / model.

    OMP_NUM_THREADS=1 python benchmarks/gloo_moves.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fxpipe.calibration.runtime_costs import calibrate_allreduce

MOVES = (("S(0) -> S(1)", Shard(0), Shard(1)), ("S(1) -> S(0)", Shard(1), Shard(0)), ("S(1) -> R", Shard(1), Replicate()),
         ("P -> S(0)", Partial(), Shard(0)), ("P -> R", Partial(), Replicate()))


def _slowest(runs: list[float]) -> float:
    t = torch.tensor(statistics.median(runs[2:]), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed(fn: Any, iters: int) -> float:
    runs = []
    for _ in range(iters + 2):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return _slowest(runs)


def worker(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    link = calibrate_allreduce()
    mesh = DeviceMesh("cpu", torch.arange(world))
    rows = []
    for nbytes in args.sizes:
        channels = 64 * world
        whole = torch.ones(max(world, nbytes // 4 // channels // world * world), channels)
        size = whole.numel() * 4
        flat, part = whole.reshape(-1).clone(), torch.empty(whole.numel() // world)
        cases: list[tuple[str, Any, int]] = [
            ("all_gather_single", lambda: dist.all_gather_single(flat, part), 1),
            ("reduce_scatter_single", lambda: dist.reduce_scatter_single(part, flat), 1),
            ("all_reduce", lambda: dist.all_reduce(flat), 2)]
        for name, held, needed in MOVES:
            local = whole / world if isinstance(held, Partial) else whole.tensor_split(world, held.dim)[rank]
            value = DTensor.from_local(local.contiguous(), mesh, (held,), run_check=False)
            cases.append((f"redistribute {name}", lambda v=value, n=needed: v.redistribute(mesh, (n,)).to_local().add_(0),
                          2 if name == "P -> R" else 1))
        for name, fn, rounds in cases:
            model = rounds * ((world - 1) * link.latency + (world - 1) / world * size / link.bandwidth)
            seconds = _timed(fn, args.iters)
            rows.append((name, round(size / 2**20, 2), round(seconds * 1e3, 2), round(model * 1e3, 2),
                         round(seconds / model, 2)))
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"{world} ranks; all-reduce link {link.bandwidth / 1e9:.2f} GB/s, {link.latency * 1e6:.0f} us per "
                    "step\n\n")
            f.write(tabulate(rows, headers=("what", "MiB", "measured ms", "model ms", "measured / model"),
                             tablefmt="github") + "\n")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 19, 1 << 21, 1 << 23], help="bytes")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "table.txt")
        mp.spawn(worker, args=(args.ranks, f"file://{tmp}/pg", args, out), nprocs=args.ranks)
        print(open(out).read(), end="")
    print(f"load average (1, 5, 15 min): {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
