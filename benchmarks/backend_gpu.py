"""torch.compile(model, backend="fxpipe") against eager and inductor: one training step on one GPU.

A step is forward, the zoo loss, backward and an SGD step (lr 0.01, no momentum). Every method
trains its own copy of the same zoo model on the same batch:

  eager          : the model as written
  fxpipe         : torch.compile(model, backend="fxpipe", options={"stages": S, "microbatches": M}) (the
                   default on one GPU: the step as two CUDA graphs from its second call)
  fxpipe-nograph : the same with options cuda_graphs=False (every op launched from Python)
  inductor       : torch.compile(model) (the default backend, mode "default": no CUDA graphs)
  inductor-cg    : torch.compile(model, mode="reduce-overhead") (Inductor with its own CUDA graphs)
  --methods picks some; --no-inductor drops both inductor methods.

After --warmup steps each (the first step of a compiled method is its compile time, reported on
its own), the methods run interleaved, one step each per iteration in a rotating order, for
--iters iterations; each step is bracketed by torch.cuda.synchronize(). The table gives the
median and the 10th/90th percentiles. Memory is one more step per method after
torch.cuda.reset_peak_memory_stats(): max_memory_allocated minus what was allocated before the
step (every method's weights stay resident throughout, so they are excluded). kernel_ms is the GPU time of
one step's kernels (torch.profiler): where it is far below the median, the step is bound by
host-side overhead (Python, kernel launches), not by the GPU. fp32, TF32 off (torch's default).

    python benchmarks/backend_gpu.py [--models gpt-medium mlp-large] [--batch-sizes 0 64] [--iters 50]

A batch size of 0 means the zoo's default (gpt-medium 4 x 64 tokens, mlp-large 32).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from typing import Any

import torch

from fxpipe import models


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _kernel_ms(step: Any, device: torch.device) -> float | None:
    """GPU time of one step's kernels (torch.profiler, CUDA activity): what the step costs without host overhead."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            _sync(device)
        total = 0.0
        for e in prof.key_averages():
            us: Any = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
            total += float(us)
        return total / 1e3
    except Exception as exc:  # noqa: BLE001 - the profiler is optional here
        print(f"profiler: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def bench(name: str, batch_size: int, device: torch.device, methods: list[str], stages: int, microbatches: int,
          warmup: int, iters: int) -> list[dict[str, Any]]:
    torch._dynamo.reset()  # fxpipe binds one instance; a fresh Dynamo cache per configuration
    zoo = models.build(name, batch_size=batch_size or None, device=device)
    inputs, target = zoo.example_inputs, zoo.example_target
    runs: dict[str, dict[str, Any]] = {}
    for method in methods:
        model = copy.deepcopy(zoo.model)
        options = {"stages": stages, "microbatches": microbatches}
        if method == "fxpipe":
            fn: Any = torch.compile(model, backend="fxpipe", options=options)
        elif method == "fxpipe-nograph":
            fn = torch.compile(model, backend="fxpipe", options={**options, "cuda_graphs": False})
        elif method == "inductor":
            fn = torch.compile(model)
        elif method == "inductor-cg":
            fn = torch.compile(model, mode="reduce-overhead")
        else:
            fn = model
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(fn: Any = fn, opt: Any = opt, method: str = method) -> torch.Tensor:
            if method == "inductor-cg":
                torch.compiler.cudagraph_mark_step_begin()  # its graphs' outputs are reused each step
            loss = zoo.loss_fn(fn(*inputs), target)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        _sync(device)
        t0 = time.perf_counter()
        try:
            first_loss = step()
        except Exception as exc:  # noqa: BLE001 - one method failing still leaves the others' numbers
            print(f"{name} {method}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}", file=sys.stderr)
            continue
        runs[method] = {"step": step, "times": [], "model": model}
        _sync(device)
        runs[method]["first_step_s"] = time.perf_counter() - t0
        runs[method]["first_loss"] = float(first_loss)
        for _ in range(warmup):
            step()
    methods = [m for m in methods if m in runs]
    for it in range(iters):
        order = methods[it % len(methods):] + methods[: it % len(methods)]
        for method in order:
            _sync(device)
            t0 = time.perf_counter()
            runs[method]["step"]()
            _sync(device)
            runs[method]["times"].append(time.perf_counter() - t0)
    rows = []
    eager_ms = None
    medians = {m: statistics.median(runs[m]["times"]) * 1e3 for m in methods}
    for method in methods:
        r = runs[method]
        peak = None
        if device.type == "cuda":
            _sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            r["step"]()
            _sync(device)
            peak = torch.cuda.max_memory_allocated(device) - before
        kernel_ms = _kernel_ms(r["step"], device)
        times = sorted(r["times"])
        q = statistics.quantiles(times, n=10, method="inclusive") if len(times) >= 2 else [times[0]] * 9
        median = statistics.median(times) * 1e3
        if method == "eager":
            eager_ms = median
        rows.append({
            "model": name, "batch": inputs[0].shape[0], "method": method, "median_ms": round(median, 3),
            "p10_ms": round(q[0] * 1e3, 3), "p90_ms": round(q[-1] * 1e3, 3),
            "vs_eager": round(median / eager_ms, 3) if eager_ms else None,
            "vs_inductor": round(median / medians["inductor"], 3) if "inductor" in medians else None,
            "first_step_s": round(r["first_step_s"], 2), "first_loss": round(r["first_loss"], 6),
            "step_peak_mib": None if peak is None else round(peak / 2**20, 1),
            "kernel_ms": None if kernel_ms is None else round(kernel_ms, 3),
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt-medium", "mlp-large"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[0], help="0: the zoo's default")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-inductor", action="store_true")
    parser.add_argument("--methods", nargs="+", default=["eager", "fxpipe", "fxpipe-nograph", "inductor",
                                                          "inductor-cg"])
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("error: CUDA is not available here; run on a GPU machine or pass --device cpu")
        device = torch.device("cuda", torch.cuda.current_device())
    methods = [m for m in args.methods if not (args.no_inductor and m.startswith("inductor"))]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; "
          f"fxpipe stages={args.stages} microbatches={args.microbatches}; warmup {args.warmup}, iters {args.iters}",
          flush=True)
    rows = []
    for name in args.models:
        for batch in args.batch_sizes:
            new = bench(name, batch, device, methods, args.stages, args.microbatches, args.warmup, args.iters)
            for r in new:
                print(json.dumps(r), flush=True)
            rows += new
    cols = ["model", "batch", "method", "median_ms", "p10_ms", "p90_ms", "vs_eager", "vs_inductor", "kernel_ms", "step_peak_mib",
            "first_step_s", "first_loss"]
    print("\n| " + " | ".join(cols) + " |\n|" + " --- |" * len(cols))
    for r in rows:
        print("| " + " | ".join("" if r[c] is None else str(r[c]) for c in cols) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": str(device), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
