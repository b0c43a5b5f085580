"""Per-layer cost profiles of the zoo's models, as JSON data the paper comparisons read (benchmarks/papers.py).

For each model, on ``--device`` (cpu or cuda), one microbatch of ``MODELS``' batch:

- ``layers``: fxpipe's layers (``group_layers``, the partitioner's units) with their F, B and W seconds,
  measured (the fastest of ``--runs`` round-robin runs of each layer's forward and fused backward, synchronised
  on CUDA; the backward divided between B and W in the ratio of fxpipe's estimates, as ``--profile`` does),
  the estimates beside them, saved-activation and parameter bytes;
- ``cut_bytes``: the bytes crossing each layer boundary (its activations forward, their gradients back: skip
  connections included), from ``partition_stages`` at one stage per layer;
- ``specs`` and ``edges``: the per-layer strategy search's graph (``strategy_graph``: one layer per fx node) at
  the strategy batch ``STRATEGY_BATCH``, its FLOP-estimated seconds scaled by the model's measured / estimated
  ratio (so OptCNN and SplitBrain price compute as the profile measured it).

CPU profiles are named ``cpu-<model>.json`` (one thread), GPU ones ``gpu-<model>.json``; papers.py prefers GPU.
``--nodes``: instead, per fx node of ``NODE_MODELS``' strategy graphs, its train-mode forward + backward at each
``--batches`` (a rank's share), into ``cpu-<model>-nodes.json`` (what strategy_measured.py --profiles reads).

    python benchmarks/profile_layers.py --device cpu [--models vgg-16-512 ...] [--out benchmarks/profiles]
    python benchmarks/profile_layers.py --device cuda   # on an H100/H200
    python benchmarks/profile_layers.py --nodes --batches 16 8 --runs 9
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from fxpipe.api import PassControl, run_compile
from fxpipe.errors import OptionError
from fxpipe.models import build, resnet, vgg
from fxpipe.models.inception import make_example as inception_example
from fxpipe.models.inception import make_model as inception_model
from fxpipe.models.vgg import _VGG16, VGG
from fxpipe.passes.group_layers import layer_stats
from fxpipe.passes.partition_stages import partition_stages
from fxpipe.passes.split_stages import run_stages, split_by_layer
from fxpipe.passes.strategy_graph import strategy_graph
from fxpipe.plan import CompileOptions

STRATEGY_BATCH = 64
"""The global batch of the strategy graphs: 16 ranks divide it."""

# name: (builder(batch, device) -> (model, inputs), microbatch batch)
MODELS: dict[str, Any] = {
    "vgg-16-4096": (lambda: VGG(_VGG16, image_size=32, fc_width=4096, num_classes=10, dropout=0.0),
                    lambda b, g: (torch.randn(b, 3, 32, 32, generator=g),), 8),
    "vgg-16-512": (lambda: VGG(_VGG16, image_size=32, fc_width=512, num_classes=10, dropout=0.0),
                   lambda b, g: (torch.randn(b, 3, 32, 32, generator=g),), 8),
    "resnet-small": (lambda: build("resnet-small").model,
                     lambda b, g: (torch.randn(b, 3, 32, 32, generator=g),), 8),
    "inception-small": (lambda: inception_model("small"), lambda b, g: inception_example("small", b, g)[0], 8),
    "mlp-deep": (lambda: build("mlp-deep").model, lambda b, g: build("mlp-deep", batch_size=b).example_inputs, 8),
    "gpt-small": (lambda: build("gpt-small").model, lambda b, g: build("gpt-small", batch_size=b).example_inputs, 4),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_layer(stage: torch.fx.GraphModule, args: list[Any], device: torch.device) -> tuple[float, float]:
    """One run of one layer: its forward's seconds and its fused backward's (input and weight gradients)."""
    params = [p for p in stage.parameters() if p.requires_grad]
    inputs = [a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
              for a in args]
    _sync(device)
    start = time.perf_counter()
    outs = stage(*inputs)
    _sync(device)
    mid = time.perf_counter()
    diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    wrt = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad] + params
    if diff and wrt:
        torch.autograd.grad(diff, wrt, grad_outputs=[torch.ones_like(o) for o in diff], allow_unused=True)
    _sync(device)
    return mid - start, time.perf_counter() - mid


def profile(name: str, device: torch.device, runs: int) -> dict[str, Any]:
    make, example, batch = MODELS[name]
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = make()
    inputs = tuple(t.to(device) for t in example(batch, gen))
    model = model.to(device).train()
    compiled = run_compile(model, inputs, CompileOptions(stages=1), model_name=name,
                           control=PassControl(stop_after="group-layers"))
    gm = compiled.root
    assert gm is not None
    stats = layer_stats(gm)
    split = [(layer, args) for _, layer, _, args, _ in run_stages(split_by_layer(gm), inputs)]
    samples: list[list[tuple[float, float]]] = [[] for _ in split]
    for _ in range(runs + 1):  # round-robin; the first round warms up and is dropped
        for mine, (layer, args) in zip(samples, split):
            mine.append(_time_layer(layer, args, device))
    layers = []
    for s, mine in zip(stats, samples):
        fwd, bwd = min(f for f, _ in mine[1:]), min(b for _, b in mine[1:])
        share_b = s.time_bwd_input / (s.time_bwd_input + s.time_bwd_weight) \
            if s.time_bwd_input + s.time_bwd_weight > 0 else 1.0
        layers.append({"name": s.name, "f": fwd, "b": bwd * share_b, "w": bwd * (1 - share_b),
                       "est_f": s.time_fwd, "est_b": s.time_bwd_input, "est_w": s.time_bwd_weight,
                       "saved_bytes": s.saved_bytes, "param_bytes": s.param_bytes})
    per_layer = partition_stages(gm, num_stages=len(stats)).gm.meta["fxpipe_stage_costs"]
    cut_bytes = [float(c["send_bytes"]) for c in per_layer[:-1]]
    measured = sum(x["f"] + x["b"] + x["w"] for x in layers)
    estimated = sum(x["est_f"] + x["est_b"] + x["est_w"] for x in layers)
    ratio = measured / estimated if estimated > 0 else 1.0
    big_model = copy.deepcopy(model).to("meta")  # the strategy graph's shapes at the strategy batch, no memory
    big_inputs = tuple(t.to("meta") for t in example(STRATEGY_BATCH, torch.Generator().manual_seed(0)))
    try:
        g = strategy_graph(big_model, big_inputs)
    except OptionError:  # symbolic_trace cannot trace it (GPT's control flow): no strategy graph
        specs, edges = None, None
    else:
        specs = [dict(dataclasses.asdict(sp), seconds=sp.seconds * ratio, fixed_seconds=sp.fixed_seconds * ratio)
                 for sp in g.specs]
        edges = [list(e) for e in g.edges]
    return {"model": name, "device": str(device), "device_name": _device_name(device),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": "float32",
            "microbatch": batch, "runs": runs, "layers": layers, "cut_bytes": cut_bytes,
            "strategy_batch": STRATEGY_BATCH, "measured_over_estimated": ratio,
            "specs": specs, "edges": edges}


NODE_MODELS: dict[str, Any] = {"vgg-small": (vgg, "small"), "resnet-small": (resnet, "small")}
"""The models strategy_measured.py runs, built the same way (the zoo family's ``make_model(size)``)."""


def node_seconds(gm: torch.fx.GraphModule, example: torch.Tensor, runs: int) -> dict[str, float]:
    """Per call node of ``gm``: the median of ``runs`` (round-robin, after one warm-up round) of its train-mode
    forward and its backward (to its floating inputs and its module's parameters) on the values ``example`` gives it.

    Each node runs alone, on copies of its inputs, so the per-node time the strategy runtime adds (dispatch, the
    runtime's own host costs) is measured elsewhere; ``gm``'s buffers (BatchNorm statistics) are left as they were.
    """
    buffers = {n: b.clone() for n, b in gm.named_buffers()}
    env: dict[str, Any] = {}

    class _Keep(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            env[n.name] = super().run_node(n)
            return env[n.name]

    with torch.no_grad():
        _Keep(gm).run(example)
    calls = []
    for n in gm.graph.nodes:
        if n.op not in ("call_module", "call_function", "call_method"):
            continue
        args = torch.fx.node.map_arg(n.args, lambda a: env[a.name])
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: env[a.name])
        module = gm.get_submodule(n.target) if n.op == "call_module" else None
        grad = torch.ones_like(env[n.name]) if isinstance(env[n.name], torch.Tensor) else None
        calls.append((n, module, args, kwargs, grad))
    samples: dict[str, list[float]] = {n.name: [] for n, *_ in calls}
    for round_ in range(runs + 1):
        for n, module, args, kwargs, grad in calls:
            leaves: list[torch.Tensor] = []

            def fresh(a: Any) -> Any:  # a leaf to differentiate to, cloned so in-place ops may write it
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    leaves.append(a.detach().requires_grad_(True))
                    return leaves[-1].clone()
                return a

            a, kw = torch.fx.node.map_aggregate(args, fresh), torch.fx.node.map_aggregate(kwargs, fresh)
            params = [p for p in module.parameters() if p.requires_grad] if module is not None else []
            start = time.perf_counter()
            if module is not None:
                out = module(*a, **kw)
            elif n.op == "call_method":
                out = getattr(a[0], n.target)(*a[1:], **kw)
            else:
                out = n.target(*a, **kw)
            if isinstance(out, torch.Tensor) and out.requires_grad:
                torch.autograd.grad(out, leaves + params, grad_outputs=grad, allow_unused=True)
            if round_:
                samples[n.name].append(time.perf_counter() - start)
    with torch.no_grad():
        for name, b in gm.named_buffers():
            b.copy_(buffers[name])
    return {name: statistics.median(times) for name, times in samples.items()}


def profile_nodes(name: str, batches: list[int], runs: int) -> dict[str, Any]:
    """``NODE_MODELS[name]``'s per-node seconds at each batch (train mode, float32, this process's threads), and the
    whole model's forward + backward (cross-entropy; the median of ``runs`` after one) in ``model_seconds``."""
    family, size = NODE_MODELS[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = family.make_model(size).train()
    side = family.SIZES[size].image_size
    gm = torch.fx.symbolic_trace(model)
    gen = torch.Generator().manual_seed(0)
    seconds, whole = {}, {}
    for b in batches:
        x, t = torch.randn(b, 3, side, side, generator=gen), torch.randint(0, 10, (b,), generator=gen)
        seconds[str(b)] = node_seconds(gm, x, runs)
        times = []
        for _ in range(runs + 1):
            start = time.perf_counter()
            torch.nn.functional.cross_entropy(model(x), t).backward()
            times.append(time.perf_counter() - start)
        whole[str(b)] = statistics.median(times[1:])
    return {"model": name, "device": "cpu", "device_name": _device_name(torch.device("cpu")),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": "float32", "runs": runs,
            "seconds": seconds, "model_seconds": whole}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on cpu")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "profiles")
    parser.add_argument("--nodes", action="store_true", help="per fx node of NODE_MODELS (cpu-<model>-nodes.json)")
    parser.add_argument("--batches", nargs="+", type=int, default=[16, 8], help="--nodes: the batches to time at")
    args = parser.parse_args()
    if args.nodes:
        torch.set_num_threads(args.threads)
        args.out.mkdir(parents=True, exist_ok=True)
        for name in NODE_MODELS:
            started = time.perf_counter()
            doc = profile_nodes(name, args.batches, args.runs)
            path = args.out / f"cpu-{name}-nodes.json"
            path.write_text(json.dumps(doc, indent=1) + "\n")
            print(f"{path}: " + ", ".join(f"batch {b}: nodes {1e3 * sum(t.values()):.1f} ms, model "
                                          f"{1e3 * doc['model_seconds'][b]:.1f} ms" for b, t in doc["seconds"].items())
                  + f" over {len(doc['seconds'][str(args.batches[0])])} nodes ({time.perf_counter() - started:.1f} s)")
        return
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    prefix = "cpu" if device.type == "cpu" else "gpu"
    for name in args.models:
        started = time.perf_counter()
        doc = profile(name, device, args.runs)
        path = args.out / f"{prefix}-{name}.json"
        path.write_text(json.dumps(doc, indent=1) + "\n")
        total = sum(x["f"] + x["b"] + x["w"] for x in doc["layers"])
        print(f"{path}: {len(doc['layers'])} layers, {total * 1e3:.2f} ms per microbatch of {doc['microbatch']}, "
              f"{len(doc['specs'] or ())} strategy nodes ({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
