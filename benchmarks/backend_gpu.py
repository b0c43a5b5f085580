"""torch.compile(model, backend="fxpipe") against eager and torch.compile(model): one training step on one GPU.

A step is forward, the loss, backward and an SGD step (lr 0.01, no momentum). Every method trains its own copy of
the same model on the same batch:

  eager      : the model as written
  compile    : torch.compile(model) (the default backend, Inductor, mode "default": no CUDA graphs)
  fxpipe     : torch.compile(model, backend="fxpipe") with no options (one GPU: Inductor per stage graph, one
               microbatch unless memory needs more, the step as CUDA graphs from its second call)
  fxpipe-2x4 : the same with options {"stages": 2, "microbatches": 4}
  fxpipe-nograph, fxpipe-noinductor : fxpipe with options cuda_graphs=False / inductor=False
  inductor-cg: torch.compile(model, mode="reduce-overhead") (Inductor with its own CUDA graphs)
  --methods picks some (default: eager compile fxpipe fxpipe-2x4).

Models: ``hf-gpt2`` (a Hugging Face GPT-2 configuration: 8 layers, d 768, 12 heads, vocab 8192, batch 8 x 256),
``hf-llama`` (a Hugging Face Llama configuration: 8 layers, d 1024, 16 query and 4 key/value heads, MLP 2816,
vocab 8192, batch 8 x 256), or a zoo name. --precisions fp32 bf16: in bf16, eager and compile run the forward
under torch.autocast and fxpipe takes options precision="bf16" (fp32 master weights in every method; the loss
outside autocast). After --warmup steps each (the first step of a compiled method is its compile time, reported
on its own), the methods run interleaved, one step each per iteration in a rotating order, for --iters
iterations, each step bracketed by a device synchronize. The table gives the median, the 10th/90th percentiles
and the ratio to compile's median. kernel_ms is the GPU time of one step's kernels (torch.profiler): where it is
far below the median, the step is bound by the host. TF32 off (torch's default).

    python benchmarks/backend_gpu.py [--models hf-gpt2 hf-llama] [--precisions fp32 bf16] [--iters 15]
    python benchmarks/backend_gpu.py --device cpu --smoke       # the same code at tiny sizes, on the CPU
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from typing import Any

import torch

METHODS = ("eager", "compile", "fxpipe", "fxpipe-2x4", "fxpipe-nograph", "fxpipe-noinductor", "inductor-cg")
# (layers, d_model, heads, kv heads, mlp, vocab, batch, tokens): the sizes, and tiny ones for --smoke
HF_SIZES = {"hf-gpt2": (8, 768, 12, 12, 3072, 8192, 8, 256), "hf-llama": (8, 1024, 16, 4, 2816, 8192, 8, 256)}
SMOKE_SIZES = {"hf-gpt2": (2, 32, 4, 4, 64, 128, 4, 16), "hf-llama": (2, 32, 4, 2, 64, 128, 4, 16)}


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


def hf_model(name: str, device: torch.device, smoke: bool) -> tuple[torch.nn.Module, tuple[Any, ...], Any, Any]:
    """A Hugging Face causal LM from a configuration (no download), seed 0, its batch, target and loss."""
    import transformers

    layers, d, heads, kv, mlp, vocab, batch, tokens = (SMOKE_SIZES if smoke else HF_SIZES)[name]
    torch.manual_seed(0)
    if name == "hf-gpt2":
        config: Any = transformers.GPT2Config(n_layer=layers, n_embd=d, n_head=heads, n_inner=mlp, vocab_size=vocab,
                                              n_positions=tokens, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                                              attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model: Any = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=d, num_attention_heads=heads,
                                          num_key_value_heads=kv, intermediate_size=mlp, vocab_size=vocab,
                                          max_position_embeddings=tokens, use_cache=False, bos_token_id=0,
                                          eos_token_id=0, pad_token_id=0)
        model = transformers.LlamaForCausalLM(config)
    model = model.to(device).train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, tokens + 1), generator=gen).to(device)

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        logits = out[0] if isinstance(out, tuple) else out.logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    return model, (ids[:, :-1].contiguous(),), ids[:, 1:].contiguous(), loss_fn


def _build(name: str, batch_size: int, device: torch.device, smoke: bool) -> tuple[Any, tuple[Any, ...], Any, Any]:
    if name in HF_SIZES:
        return hf_model(name, device, smoke)
    from fxpipe import models

    zoo = models.build(name, batch_size=batch_size or None, device=device)
    return zoo.model, zoo.example_inputs, zoo.example_target, zoo.loss_fn


def _compiled(method: str, model: torch.nn.Module, precision: str) -> Any:
    fx_opts: dict[str, Any] = {} if precision == "fp32" else {"precision": precision}
    if method == "fxpipe":
        return torch.compile(model, backend="fxpipe", options=fx_opts or None)
    if method == "fxpipe-2x4":
        return torch.compile(model, backend="fxpipe", options={"stages": 2, "microbatches": 4, **fx_opts})
    if method == "fxpipe-nograph":
        return torch.compile(model, backend="fxpipe", options={"cuda_graphs": False, **fx_opts})
    if method == "fxpipe-noinductor":
        return torch.compile(model, backend="fxpipe", options={"inductor": False, **fx_opts})
    if method == "compile":
        return torch.compile(model)
    if method == "inductor-cg":
        return torch.compile(model, mode="reduce-overhead")
    return model


def bench(name: str, batch_size: int, device: torch.device, methods: list[str], precision: str, warmup: int,
          iters: int, smoke: bool) -> list[dict[str, Any]]:
    torch._dynamo.reset()  # fxpipe binds one instance; a fresh Dynamo cache per configuration
    base, inputs, target, loss_fn = _build(name, batch_size, device, smoke)
    dtype = torch.bfloat16 if precision == "bf16" else None
    runs: dict[str, dict[str, Any]] = {}
    for method in methods:
        model = copy.deepcopy(base)
        fn = _compiled(method, model, precision)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        # eager and torch.compile autocast the forward; fxpipe's graphs were traced under it (options precision)
        autocast = dtype is not None and not method.startswith("fxpipe")

        def step(fn: Any = fn, opt: Any = opt, method: str = method, autocast: bool = autocast) -> torch.Tensor:
            if method == "inductor-cg":
                torch.compiler.cudagraph_mark_step_begin()  # its graphs' outputs are reused each step
            with torch.autocast(device.type, dtype=dtype) if autocast else contextlib.nullcontext():
                out = fn(*inputs)
            loss = loss_fn(out, target)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        _sync(device)
        t0 = time.perf_counter()
        try:
            first_loss = step()
        except Exception as exc:  # noqa: BLE001 - one method failing still leaves the others' numbers
            import traceback

            print(f"{name} {precision} {method}: {type(exc).__name__}: "
                  + "\n".join(traceback.format_exception(exc)[-12:])[-3000:], file=sys.stderr)
            continue
        runs[method] = {"step": step, "times": [], "model": model}
        _sync(device)
        runs[method]["first_step_s"] = time.perf_counter() - t0
        runs[method]["first_loss"] = float(first_loss)
        if method.startswith("fxpipe"):
            from fxpipe.backend import _LAST_RUNNER

            runs[method]["runner"] = _LAST_RUNNER[0]
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
    medians = {m: statistics.median(runs[m]["times"]) * 1e3 for m in methods}
    rows = []
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
        runner = r.get("runner")
        if runner is not None:  # after the timed steps: a failed capture leaves step_graphs None
            r["setup"] = (f"{len(runner.stages)}x{runner.m}" + (" inductor" if runner.inductor else "")
                          + (" graphs" if runner.step_graphs is not None else ""))
        times = sorted(r["times"])
        q = statistics.quantiles(times, n=10, method="inclusive") if len(times) >= 2 else [times[0]] * 9
        rows.append({
            "model": name, "precision": precision, "batch": "x".join(str(s) for s in inputs[0].shape),
            "method": method, "setup": r.get("setup", ""), "median_ms": round(medians[method], 3),
            "p10_ms": round(q[0] * 1e3, 3), "p90_ms": round(q[-1] * 1e3, 3),
            "vs_compile": round(medians[method] / medians["compile"], 3) if "compile" in medians else None,
            "vs_eager": round(medians[method] / medians["eager"], 3) if "eager" in medians else None,
            "kernel_ms": None if kernel_ms is None else round(kernel_ms, 3),
            "step_peak_mib": None if peak is None else round(peak / 2**20, 1),
            "first_step_s": round(r["first_step_s"], 2), "first_loss": round(r["first_loss"], 5),
        })
    return rows


COLUMNS = ["model", "precision", "batch", "method", "setup", "median_ms", "p10_ms", "p90_ms", "vs_compile", "vs_eager",
           "kernel_ms", "step_peak_mib", "first_step_s", "first_loss"]


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join("" if r[c] is None else str(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["hf-gpt2", "hf-llama"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[0], help="zoo models: 0 is the zoo's default")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 1 warm-up and 3 iterations: the code path")
    parser.add_argument("--methods", nargs="+", default=["eager", "compile", "fxpipe", "fxpipe-2x4"], choices=METHODS)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("error: CUDA is not available here; run on a GPU machine or pass --device cpu")
        device = torch.device("cuda", torch.cuda.current_device())
    if args.smoke:
        args.warmup, args.iters = min(args.warmup, 1), min(args.iters, 3)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; "
          f"warmup {args.warmup}, iters {args.iters}{' (smoke sizes)' if args.smoke else ''}", flush=True)
    rows = []
    for name in args.models:
        for batch in args.batch_sizes if name not in HF_SIZES else [0]:
            for precision in args.precisions:
                new = bench(name, batch, device, list(args.methods), precision, args.warmup, args.iters, args.smoke)
                for r in new:
                    print(json.dumps(r), flush=True)
                rows += new
    print("\n" + table(rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": str(device), "args": vars(args), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
