"""Bottleneck ratio of every zoo model's default size at P stages (estimated costs, or measured with --profile).

    python benchmarks/zoo_partition.py [--stages 4] [--profile]

ratio = bottleneck stage time (compute + transfers) / lower bound max(sum/P, max layer), where the
lower bound counts compute only; "compute ratio" leaves the transfers out of the bottleneck too.
"""

from __future__ import annotations

import argparse
import json

import torch

import fxpipe
from fxpipe import models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--names", nargs="*", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = args.names or [f"{e.family}-{e.default_size}" for e in models.entries()]
    rows = []
    for name in names:
        zoo = models.build(name)
        pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=args.stages, profile=args.profile)
        table = next(r for r in pipe.report() if r.title.startswith("partition-stages"))
        layers = next(r for r in pipe.report() if r.title.startswith("group-layers"))
        compute = max(table.column("compute ms"))
        lower = pipe.plan.lower_bound_s * 1e3
        rows.append({
            "model": name,
            "layers": len(layers.rows),
            "stages": args.stages,
            "bottleneck_ms": round(pipe.plan.bottleneck_s * 1e3, 4),
            "lower_bound_ms": round(lower, 4),
            "ratio": round(pipe.plan.bottleneck_s * 1e3 / lower, 4),
            "compute_ratio": round(compute / lower, 4),
            "layers_per_stage": [int(b) - int(a) for a, b in zip(list(pipe.plan.bounds), list(pipe.plan.bounds)[1:])],
        })
    print(json.dumps({"costs": "profiled" if args.profile else "estimated", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
