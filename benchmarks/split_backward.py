"""B+W time of fxpipe's compiled split against torch.distributed.pipelining's run-time split and a fused backward.

Per stage, in one process, interleaved A/B/C each iteration so machine drift cancels (the order rotates
from one iteration to the next, so none always follows the same one: a 51 MB gradient freed by one
method is memory the next one faults in again):

  fused : eager forward of the stage module, then one autograd backward to inputs and weights
  peer  : eager forward, then pipelining._backward.stage_backward_input + stage_backward_weight
  fxpipe: the F graph, then the B graph + the W graph (split at compile time by split_backward)

Only the backward part is timed (median over --runs after --warmup). One thread.

    python benchmarks/split_backward.py [--models mlp-large gpt-medium hf-gpt2] [--stages 2] [--runs 30] [--profile]

``hf-gpt2`` is Hugging Face transformers' GPT2LMHeadModel as issue 16 names it (4 layers, d = 256,
4 heads, sequence 128, batch 4; built from a config, no download). ``--profile`` also runs each
stage's fused backward and fxpipe's B+W under torch.profiler and prints, per aten op, the self CPU
time per backward of each and their difference: where the split's cost is.
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
from fxpipe._compat import boxed
from fxpipe.calibration.host_memory import keep_freed_memory


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

    # As the runtime calls them (fxpipe.runtime.core): B and W take one list of their inputs that they empty, so
    # each saved tensor is freed after its last use, as autograd frees a node's saved tensors once it ran.
    box_b, box_w = boxed(graphs.backward_input), boxed(graphs.backward_weight)

    def ours() -> float:
        args = _inputs(stage, env, set())
        with torch.no_grad():
            result = graphs.forward(*args)
            saved = list(result[graphs.num_outputs:])
            del result
            t0 = time.perf_counter()
            b_args = [saved[i] if k == "saved" else grads_out[i] for k, i in graphs.b_slots]
            w_args = [saved[i] if k == "saved" else grads_out[i] for k, i in graphs.w_slots]
            saved.clear()  # B and W hold the only references now
            b = box_b(b_args)
            w_args[:0] = b[len(graphs.grad_inputs):]
            del b
            box_w(w_args)
            return time.perf_counter() - t0

    times: dict[str, list[float]] = {"fused": [], "peer": [], "fxpipe": []}
    methods = (("fused", fused), ("peer", peer), ("fxpipe", ours))
    for it in range(warmup + runs):
        for name, fn in methods[it % 3:] + methods[:it % 3]:  # rotated: none always runs after the same one
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


def profile_stage(stage: Any, graphs: Any, env: dict[str, Any], needs_grad: set[str], runs: int) -> list[dict]:
    """Per aten op: self CPU ms per backward in the fused backward and in fxpipe's B+W (``runs`` of each)."""
    from torch.profiler import ProfilerActivity, profile

    params = [p for p in stage.module.parameters() if p.requires_grad]
    with torch.no_grad():
        outs0 = stage.module(*_inputs(stage, env, set()))
    grads_out = [torch.randn_like(outs0[i]) for i in graphs.grad_outputs]
    fused_inputs, ours_inputs = [], []
    for _ in range(runs):  # forwards outside the profiled region
        args = _inputs(stage, env, needs_grad)
        outs = stage.module(*args)
        fused_inputs.append(([outs[i] for i in graphs.grad_outputs],
                             [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad] + params))
        with torch.no_grad():
            result = graphs.forward(*_inputs(stage, env, set()))
        ours_inputs.append(list(result[graphs.num_outputs:]))

    def per_op(prof: Any) -> dict[str, float]:
        return {e.key: e.self_cpu_time_total / 1e3 / runs for e in prof.key_averages()}

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for diff, wrt in fused_inputs:
            torch.autograd.grad(diff, wrt, grad_outputs=grads_out, allow_unused=True)
    fused = per_op(prof)
    box_b, box_w = boxed(graphs.backward_input), boxed(graphs.backward_weight)
    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.no_grad():
        while ours_inputs:
            saved = ours_inputs.pop()
            b_args = [saved[i] if k == "saved" else grads_out[i] for k, i in graphs.b_slots]
            w_args = [saved[i] if k == "saved" else grads_out[i] for k, i in graphs.w_slots]
            del saved
            b = box_b(b_args)
            w_args[:0] = b[len(graphs.grad_inputs):]
            del b
            box_w(w_args)
    ours = per_op(prof)
    rows = [{"op": op, "fused_ms": round(fused.get(op, 0.0), 4), "fxpipe_ms": round(ours.get(op, 0.0), 4),
             "diff_ms": round(ours.get(op, 0.0) - fused.get(op, 0.0), 4)}
            for op in set(fused) | set(ours) if op.startswith("aten::")]
    return sorted(rows, key=lambda r: -abs(r["diff_ms"]))


def hf_gpt2(batch_size: int | None) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """Issue 16's Hugging Face GPT-2: 4 layers, d = 256, 4 heads, sequence 128, batch 4 (no dropout, no cache)."""
    import transformers

    config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=128, vocab_size=50257,
                                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).train()
    return model, (torch.randint(0, config.vocab_size, (batch_size or 4, 128)),)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="*", default=["mlp-large", "gpt-medium"])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--profile", action="store_true", help="per-op self CPU time, fused vs B+W, per stage")
    parser.add_argument("--keep-freed-memory", type=int, choices=(0, 1), default=1,
                        help="1: freed memory kept in this process, as fxpipe's ranks run (fxpipe.calibration.host_memory), for "
                             "all three methods alike; 0: glibc's defaults")
    args = parser.parse_args()
    kept = bool(args.keep_freed_memory) and keep_freed_memory()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    for name in args.models:
        if name == "hf-gpt2":
            model, example = hf_gpt2(args.batch_size)
        else:
            zoo = models.build(name, batch_size=args.batch_size)
            model, example = zoo.model, zoo.example_inputs
        pipe = fxpipe.compile(model, example, stages=args.stages)
        env = dict(zip(pipe.input_names, example))
        needs_grad: set[str] = set()
        for stage, graphs in zip(pipe.stage_list(), pipe.stage_graphs):  # type: ignore[arg-type]
            row = {"model": name, "stage": stage.index, "first_stage": stage.index == 0}
            row.update(bench_stage(stage, graphs, env, needs_grad, args.runs, args.warmup))
            if args.profile:
                row["ops"] = profile_stage(stage, graphs, env, needs_grad, args.runs)
            rows.append(row)
            with torch.no_grad():
                env.update(zip(stage.outputs, stage.module(*_inputs(stage, env, set()))))
            needs_grad.update(stage.outputs[i] for i in graphs.grad_outputs)
    print(json.dumps({"threads": torch.get_num_threads(), "stages": args.stages, "keep_freed_memory": kept,
                      "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
