"""The optimizer step as ``fxpipe run`` builds it (``OptimizerSpec``: torch's fused kernel where it applies) against
torch's default implementation, and an asynchronous schedule's per-microbatch update in its two forms, on one
thread, in one process, interleaved (A B A B ...) so that the machine's drift falls on both alike.

1. **One step** over ``--mib`` MiB of fp32 parameters in 20 tensors (a stage's): momentum SGD and AdamW, default
   (``foreach`` off on the CPU: one kernel per tensor and op) and fused (one pass over parameter, gradient and
   state); each pass's bytes over the memory bandwidth ``fxpipe compile --profile`` records
   (``calibration.compute.measure_mem_bw``), as "passes".
2. **One asynchronous update** (W's new gradient applied alone): the gradient added into zeroed ``.grad`` buffers,
   then the default step and a zeroing pass (fxpipe before this benchmark), against the gradient taken as ``.grad``
   and the fused step (``ActionRunner.take_grads``). W's own output is made in both and timed apart.

    OMP_NUM_THREADS=1 python benchmarks/optimizer_step.py [--mib 30] [--reps 25]
                                                          [--out benchmarks/results/optimizer_step/FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fxpipe.calibration.compute import measure_mem_bw
from fxpipe.runtime.optim import OptimizerSpec

TENSORS = 20


def _params(numel: int) -> list[torch.nn.Parameter]:
    ps = [torch.nn.Parameter(torch.randn(numel)) for _ in range(TENSORS)]
    for p in ps:
        p.grad = torch.randn(numel)
    return ps


def _default(spec: OptimizerSpec, ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if spec.name == "adamw":
        return torch.optim.AdamW(ps, lr=spec.lr, betas=spec.betas)
    return torch.optim.SGD(ps, lr=spec.lr, momentum=spec.momentum)


def _interleaved(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """Median milliseconds of each callable over ``reps`` rounds, one call of each per round (two rounds unmeasured)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(reps + 2):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r >= 2:
                times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=30.0, help="parameter MiB of the stage")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    numel = int(args.mib * 2**20 / 4 / TENSORS)
    nbytes = numel * 4 * TENSORS
    mem_bw = measure_mem_bw()
    one_pass_ms = nbytes / mem_bw * 1e3
    rows = []
    for spec in (OptimizerSpec("sgd", lr=1e-3, momentum=0.9), OptimizerSpec("adamw", lr=1e-3)):
        fused, default = spec(_params(numel)), _default(spec, _params(numel))
        assert fused.param_groups[0]["fused"] and not default.param_groups[0]["fused"]
        ms = _interleaved({"default": default.step, "fused": fused.step}, args.reps)
        name = "momentum SGD" if spec.name == "sgd" else "AdamW"
        rows.append({"what": f"{name} step", "before_ms": ms["default"], "after_ms": ms["fused"],
                     "before_passes": ms["default"] / one_pass_ms, "after_passes": ms["fused"] / one_pass_ms})

    src = [torch.randn(numel) for _ in range(TENSORS)]
    old_ps, new_ps = _params(numel), _params(numel)
    spec = OptimizerSpec("sgd", lr=1e-3, momentum=0.9)
    old_opt, new_opt = _default(spec, old_ps), spec(new_ps)

    def w() -> list[torch.Tensor]:  # W's gradients: new tensors
        return [t.mul(1.0) for t in src]

    def before() -> None:
        for p, g in zip(old_ps, w()):
            p.grad.add_(g)  # type: ignore[union-attr]
        old_opt.step()
        old_opt.zero_grad(set_to_none=False)

    def after() -> None:
        for p, g in zip(new_ps, w()):
            p.grad = g
        new_opt.step()

    ms = _interleaved({"before": before, "after": after, "w": w}, args.reps)
    rows.append({"what": "asynchronous update, momentum SGD (W's output apart)", "before_ms": ms["before"] - ms["w"],
                 "after_ms": ms["after"] - ms["w"], "before_passes": (ms["before"] - ms["w"]) / one_pass_ms,
                 "after_passes": (ms["after"] - ms["w"]) / one_pass_ms})
    doc = {"mib": args.mib, "tensors": TENSORS, "reps": args.reps, "mem_bw_gb_s": mem_bw / 1e9,
           "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}
    print(f"{args.mib:g} MiB of parameters in {TENSORS} tensors, 1 thread; one pass at {mem_bw / 1e9:.1f} GB/s "
          f"= {one_pass_ms:.2f} ms")
    print("| | before ms | after ms | speedup | passes before / after |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['what']} | {r['before_ms']:.1f} | {r['after_ms']:.1f} | {r['before_ms'] / r['after_ms']:.2f}x "
              f"| {r['before_passes']:.1f} / {r['after_passes']:.1f} |")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    main(sys.argv[1:])
