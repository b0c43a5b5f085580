"""LayerPipe's inter-layer balance on the zoo: the bottleneck with activation derivatives moved across cuts chosen inside
the partitioner's DP, against the same moves chosen after the cuts (the best moves across the cuts the DP makes
without them) and against no moves. Estimated costs; nothing is run.

    python benchmarks/inter_layer_balance.py [--names mlp-tiny resnet-tiny] [--stages 2 3 4 6 8]

"moved after" is the least bottleneck over every choice of moves across the plain plan's cuts (what a pass after
partitioning can do at best); "moved inside" is the DP's own plan (``fxpipe compile --balance-backward``). Without
``--input-grads``, as here, nothing moves out of the first stage (it has no B).
"""

from __future__ import annotations

import argparse

import torch

from fxpipe import models
from fxpipe.api import CompileOptions, build_steps, run_steps
from fxpipe.passes.group_layers import layer_stats
from fxpipe.passes.partition_stages import movable_derivatives
from fxpipe.planning.stage_dp import Moves, plan_for_bounds

_DEFAULT_NAMES = ("mlp-tiny", "mlp-small", "vgg-tiny", "vgg-small", "resnet-tiny", "resnet-small")


def _partitioned(zoo: models.ZooModel, stages: int, balance: bool) -> torch.fx.GraphModule:
    options = CompileOptions(stages=stages, balance_backward=balance)
    root, _ = run_steps(build_steps(zoo.model, zoo.example_inputs, options, None), stop_after="partition-stages")
    return root


def row(zoo: models.ZooModel, stages: int) -> dict[str, object]:
    plain = _partitioned(zoo, stages, balance=False)
    inside = _partitioned(zoo, stages, balance=True).meta["fxpipe_stage_plan"]
    plan = plain.meta["fxpipe_stage_plan"]
    movable = movable_derivatives(plain, layer_stats(plain))
    # each stage one "layer" of its own time (transfers included): the best moves across the plain plan's cuts
    after = plan_for_bounds(list(plan.stage_times), tuple(range(stages + 1)),
                            moves=Moves([movable[c - 1] for c in plan.bounds[1:-1]], first=False))
    return {"model": zoo.name, "stages": stages, "plain_ms": plan.bottleneck * 1e3, "after_ms": after.bottleneck * 1e3,
            "inside_ms": inside.bottleneck * 1e3, "cuts_moved": inside.bounds != plan.bounds,
            "moves": len(inside.moves), "movable_cuts": sum(1 for m in movable if m)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--names", nargs="*", default=list(_DEFAULT_NAMES))
    parser.add_argument("--stages", nargs="*", type=int, default=[2, 3, 4, 6, 8])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | stages | cuts where a derivative can move | plain ms | moved after the cuts ms | moved inside the DP ms "
          "| inside against after | the DP's cuts differ | derivatives moved |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.names:
        zoo = models.build(name)
        for stages in args.stages:
            r = row(zoo, stages)
            gain = 1 - r["inside_ms"] / r["after_ms"]  # type: ignore[operator]
            print(f"| {r['model']} | {stages} | {r['movable_cuts']} | {r['plain_ms']:.4f} | {r['after_ms']:.4f} "
                  f"| {r['inside_ms']:.4f} | {gain * 100:+.2f}% | {'yes' if r['cuts_moved'] else 'no'} | {r['moves']} |",
                  flush=True)


if __name__ == "__main__":
    main()
