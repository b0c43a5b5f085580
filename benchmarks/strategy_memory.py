"""VGG-16's memory per rank under pure data parallelism, the SplitBrain preset and the strategy search (issue 14).

VGG-16 is built on the ``meta`` device (nothing allocated) twice: with the ImageNet classifier
(224x224 input, 4096-wide, 1000 classes: 138M parameters, 124M of them in the classifier) and with a
CIFAR-10 one (32x32 input, the usual 512-wide classifier, 10 classes: 15.2M parameters, 0.5M in
the classifier). Each is compiled by fxpipe (one stage, ``granularity="2"``: one layer per conv,
ReLU, pool, Linear, dropout), turned into the search's ``LayerSpec`` chain
(``fxpipe.passes.strategy_specs``), and its layer graph built on d = K ranks (one SplitBrain group
of K: the fully-connected layers column/row-sharded K ways, everything else data-parallel).
Per rank and strategy: parameters, gradients, optimizer state (SGD with momentum: one buffer) and
saved activations, from ``layer_memory`` (the search's own memory rule), summed over layers, for
a global batch of ``--batch`` samples. ``search`` is ``solve`` (least time on the default gloo
link, no memory cap); its memory is whatever its fastest strategy holds.

    python benchmarks/strategy_memory.py [--batch 64] [--ranks 2 4 8] [--out benchmarks/results/strategy_memory]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from tabulate import tabulate

import fxpipe
from fxpipe.models.vgg import _VGG16, VGG
from fxpipe.passes.strategy_specs import strategy_specs
from fxpipe.plan import DEFAULTS
from fxpipe.planning.strategies import build_graph, data_parallel, layer_memory, solve, splitbrain

MODELS = {  # name: (image side, classifier width, classes)
    "vgg-16 imagenet": (224, 4096, 1000),
    "vgg-16 cifar-10": (32, 512, 10),
}
GIB = 2.0**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="global batch (samples), split over the ranks")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/strategy_memory"))
    args = parser.parse_args()
    start = time.perf_counter()
    rows = []
    for model_name, (side, width, classes) in MODELS.items():
        with torch.device("meta"):
            model = VGG(_VGG16, image_size=side, fc_width=width, num_classes=classes, dropout=0.0)
        x = torch.empty(args.batch, 3, side, side, device="meta")
        plan = fxpipe.compile(model, (x,), stages=1, granularity="2").plan
        specs, edges = strategy_specs(plan, model, (x,))
        fc_share = sum(s.param_bytes for s in specs if s.kind == "matmul" and not s.spatial) / \
            sum(s.param_bytes for s in specs)
        for d in args.ranks:
            graph = build_graph(specs, edges, d, bandwidth=DEFAULTS.bandwidth, latency=DEFAULTS.latency,
                                optimizer="momentum")
            strategies = {"data parallel": data_parallel(graph), f"splitbrain K={d}": splitbrain(graph, specs, d),
                          "search": solve(graph)}
            base = None
            for label, strategy in strategies.items():
                parts = [layer_memory(spec, graph.layers[v].configs[c].degrees, "momentum")  # type: ignore[arg-type]
                         for v, (spec, c) in enumerate(zip(specs, strategy.choice))]
                p, g, o, a = (math.fsum(getattr(m, f) for m in parts) for f in ("params", "grads", "optimizer",
                                                                                    "activations"))
                static, total = p + g + o, p + g + o + a
                if base is None:
                    base = (static, total)
                fc = [strategy.names(graph)[v] for v, s in enumerate(specs) if s.kind == "matmul" and not s.spatial]
                conv = [strategy.names(graph)[v] for v, s in enumerate(specs) if s.kind == "matmul" and s.spatial]
                rows.append((model_name, d, label, "/".join(dict.fromkeys(conv)), "/".join(dict.fromkeys(fc)), p / GIB, g / GIB, o / GIB, a / GIB,
                             total / GIB, f"{1 - static / base[0]:.0%}", f"{1 - total / base[1]:.0%}",
                             strategy.cost))
        print(f"{model_name}: {len(specs) - 1} layers, classifier {fc_share:.1%} of the parameters")
    headers = ("model", "ranks", "strategy", "conv configs", "fc configs", "params GiB", "grads GiB", "momentum GiB", "activ. GiB",
               "total GiB", "saved (w+g+opt)", "saved (total)", "model step s")
    table = tabulate(rows, headers=headers, floatfmt=".3f", tablefmt="github")
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    note = (f"Global batch {args.batch}, fp32, SGD with momentum, d = K ranks (one SplitBrain group). "
            "Saved: against data parallelism on the same ranks. Model step: the search's cost (compute + sync + "
            "transfers) with fxpipe's default CPU and gloo link, not a measurement.\n\n")
    (args.out / "table.md").write_text(note + table + "\n")
    print(f"{time.perf_counter() - start:.1f} s; wrote {args.out / 'table.md'}")


if __name__ == "__main__":
    main()
