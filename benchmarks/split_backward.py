"""B+W time of fxpipe's compiled split against torch.distributed.pipelining's run-time split and a fused backward.

Per stage, in one process, interleaved A/B/C each iteration so machine drift cancels:

  fused : eager forward of the stage module, then one autograd backward to inputs and weights
  peer  : eager forward, then pipelining._backward.stage_backward_input + stage_backward_weight
  fxpipe: the F graph, then the B graph + the W graph (split at compile time by split_backward)

Only the backward part is timed (median over --runs after --warmup). One thread.

    python benchmarks/split_backward.py [--models mlp-large gpt-medium] [--stages 2] [--runs 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

import fxpipe
from fxpipe import models


def _inputs(stage: Any, env: dict[str, Any], needs_grad: set[str]) -> list[Any]:
    return [env[n].detach().requires_grad_(n in needs_grad) if isinstance(env[n], torch.Tensor) else env[n]
            for n in stage.inputs]


def bench_stage(stage: Any, graphs: Any, env: dict[str, Any], needs_grad: set[str], runs: int, warmup: int) -> dict:
    params = [p for p in stage.module.parameters() if p.requires_grad]
    with torch.no_grad():
        outs0 = stage.module(*_inputs(stage, env, set()))
    grads_out = [torch.randn_like(outs0[i]) for i in graphs.grad_outputs]

    def fused() -> float:
        args = _inputs(stage, env, needs_grad)
        outs = stage.module(*args)
        diff = [outs[i] for i in graphs.grad_outputs]
        wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad] + params
        t0 = time.perf_counter()
        torch.autograd.grad(diff, wrt, grad_outputs=grads_out, allow_unused=True)
        return time.perf_counter() - t0

    def peer() -> float:
        if not any(n in needs_grad for n in stage.inputs):
            # torch.distributed.pipelining does not split a stage whose inputs need no gradient
            # (the first stage): it runs the fused backward there.
            return fused()
        args = _inputs(stage, env, needs_grad)
        outs = stage.module(*args)
        diff = [outs[i] for i in graphs.grad_outputs]
        t0 = time.perf_counter()
        _, param_groups = stage_backward_input(diff, grads_out, [a for a in args if isinstance(a, torch.Tensor)
                                                                  and a.requires_grad], iter(params))
        stage_backward_weight(iter(params), param_groups)
        t1 = time.perf_counter()
        for p in params:
            p.grad = None
        return t1 - t0

    def ours() -> float:
        args = _inputs(stage, env, set())
        with torch.no_grad():
            result = graphs.forward(*args)
            saved = list(result[graphs.num_outputs:])
            del result
            t0 = time.perf_counter()
            b_args = [saved[i] if k == "saved" else grads_out[i] for k, i in graphs.b_slots]
            w_args = [saved[i] if k == "saved" else grads_out[i] for k, i in graphs.w_slots]
            b = graphs.backward_input(*b_args)
            del b_args
            w_args[:0] = b[len(graphs.grad_inputs):]
            del b
            saved.clear()  # what autograd.grad frees at its end (retain_graph=False), freed here too
            graphs.backward_weight(*w_args)
            del w_args
            return time.perf_counter() - t0

    times: dict[str, list[float]] = {"fused": [], "peer": [], "fxpipe": []}
    for it in range(warmup + runs):
        for name, fn in (("fused", fused), ("peer", peer), ("fxpipe", ours)):
            t = fn()
            if it >= warmup:
                times[name].append(t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {
        "fused_ms": round(med["fused"], 4),
        "peer_ms": round(med["peer"], 4),
        "fxpipe_ms": round(med["fxpipe"], 4),
        "peer_over_fused": round(med["peer"] / med["fused"], 4),
        "fxpipe_over_fused": round(med["fxpipe"] / med["fused"], 4),
        "fxpipe_over_peer": round(med["fxpipe"] / med["peer"], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="*", default=["mlp-large", "gpt-medium"])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    for name in args.models:
        zoo = models.build(name, batch_size=args.batch_size)
        pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=args.stages)
        env = dict(zip(pipe.input_names, zoo.example_inputs))
        needs_grad: set[str] = set()
        for stage, graphs in zip(pipe.stage_list(), pipe.stage_graphs):  # type: ignore[arg-type]
            row = {"model": name, "stage": stage.index, "first_stage": stage.index == 0}
            row.update(bench_stage(stage, graphs, env, needs_grad, args.runs, args.warmup))
            rows.append(row)
            with torch.no_grad():
                env.update(zip(stage.outputs, stage.module(*_inputs(stage, env, set()))))
            needs_grad.update(stage.outputs[i] for i in graphs.grad_outputs)
    print(json.dumps({"threads": torch.get_num_threads(), "stages": args.stages, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
