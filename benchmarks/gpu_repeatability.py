"""Is backend='fxpipe' with CUDA graphs exact? Gradients against eager's, and eager's against eager's, on one GPU.

    python benchmarks/gpu_repeatability.py 10 > log      # trials; JSON to $OUT (or /tmp)/gpu_repeatability.json

resnet-tiny (conv + BatchNorm over 2-sample microbatches) trained 5 SGD-momentum steps side by side with an eager
copy, per trial (seed = trial) and per configuration: eager against eager (cuDNN's default, nondeterministic
algorithms, and deterministic ones), fxpipe op by op, fxpipe with CUDA graphs (float32, float32 with deterministic
cuDNN, float64). Each line: the largest gradient difference at each step, and the steps where
torch.testing.assert_close's float32/float64 tolerance fails. TF32 is off throughout.
"""
import copy, json, os, sys, time
import torch
from fxpipe import models

def run(cfg, seed, steps=5):
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic = cfg.get("det", False)
    torch._dynamo.reset()
    zoo = models.build(cfg.get("model", "resnet-tiny"), batch_size=4, device="cuda", seed=seed,
                       dtype=torch.float64 if cfg.get("fp64") else torch.float32)
    model = zoo.model
    ref = copy.deepcopy(model)
    if cfg["kind"] == "eager":
        other = lambda x: torch.cat([model(p) for p in x.tensor_split(2)])
    else:
        opts = {"stages": 2, "microbatches": 2, "cuda_graphs": cfg["kind"] == "graphs"}
        other = torch.compile(model, backend="fxpipe", fullgraph=True, options=opts)
    eager = lambda x: torch.cat([ref(p) for p in x.tensor_split(2)])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    x, y = zoo.example_inputs[0], zoo.example_target
    rows = []
    for step in range(steps):
        out, out_ref = other(x), eager(x)
        loss, loss_ref = zoo.loss_fn(out, y), zoo.loss_fn(out_ref, y)
        loss.backward(); loss_ref.backward()
        rp = dict(ref.named_parameters())
        worst, worst_name, fails = 0.0, None, []
        for n, p in model.named_parameters():
            d = (p.grad - rp[n].grad).abs().max().item()
            scale = rp[n].grad.abs().max().item()
            if d > worst:
                worst, worst_name = d, n
            try:
                torch.testing.assert_close(p.grad, rp[n].grad)
            except AssertionError:
                fails.append(n)
        rows.append({"step": step, "out": (out - out_ref).abs().max().item(), "loss": abs(loss.item() - loss_ref.item()),
                     "worst_grad": worst, "worst_param": worst_name, "fails": fails})
        opt.step(); opt_ref.step(); opt.zero_grad(); opt_ref.zero_grad()
    return rows

cfgs = {
    "eager_vs_eager_fp32": {"kind": "eager"},
    "nographs_fp32": {"kind": "nographs"},
    "graphs_fp32": {"kind": "graphs"},
    "graphs_fp32_det": {"kind": "graphs", "det": True},
    "eager_vs_eager_fp32_det": {"kind": "eager", "det": True},
    "graphs_fp64": {"kind": "graphs", "fp64": True},
}
trials = int(sys.argv[1]) if len(sys.argv) > 1 else 6
result = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name()}
t0 = time.time()
for trial in range(trials):
    for name, cfg in cfgs.items():
        try:
            rows = run(cfg, seed=trial)
        except Exception as exc:
            rows = [{"error": f"{type(exc).__name__}: {str(exc)[:300]}"}]
        result.setdefault(name, []).append(rows)
        bad = [r for r in rows if r.get("fails") or r.get("error")]
        print(f"{time.time()-t0:6.1f}s trial {trial} {name:26s} worst grad " +
              " ".join(f"{r.get('worst_grad', float('nan')):.1e}" for r in rows) +
              (f"  FAIL at steps {[r.get('step') for r in bad]} {bad[0].get('fails', bad[0].get('error'))[:3]}" if bad else ""),
              flush=True)
json.dump(result, open(os.path.join(os.environ.get("OUT", "/tmp"), "gpu_repeatability.json"), "w"), indent=1)
