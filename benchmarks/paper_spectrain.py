"""SpecTrain (Chen, Yang, Cheng, 2018) against data parallelism, in the paper's own comparison.

Throughput (simulated, 4 GPUs' worth): data parallelism, 4 replicas of the whole model, each running
4 microbatches a step, then all-reducing its gradients (a ring over the link, in buckets), against
SpecTrain: the model in 4 stages (the partitioner DP's best for the link), ``async-1f1b`` streaming
64 microbatches with no flush and no all-reduce. Per-layer costs and links: paper_layerpipe's (the
committed profiles, and the GPU-class roofline for full-size models, modelled).

Accuracy at equal samples (measured here, CPU, one process: the reference executor, which the
distributed runtime equals exactly, tests/runtime/test_async_runtime.py), 4 stages, SGD momentum 0.9, on
digits (mlp-small, held-out accuracy) at ``ACCURACY_LR`` (above the tuned 0.05, where plain staleness
visibly hurts) for ``STEPS`` batches of 4 microbatches, over ``SEEDS``: sync (one step per batch,
eager), and asynchronous 1F1B with stale, stash (PipeDream), predict (SpecTrain's paper version: F and B
predict floor(k/2) + N-k-1 and floor(k/2) versions ahead) and predict-consistent (N-k-1 in F, B the live
weights), at lr / 4 a microbatch as benchmarks/async_convergence.py does. Memory per stage against
PipeDream's stash (measured, the runtime's tracked bytes, against the simulation's
``held_peaks_with_versions``): mlp-deep in 4 stages, async-1f1b, 8 microbatches. Both measurements run
only with ``--measure`` (minutes), which writes ``results/paper_spectrain/{accuracy,memory}.json``;
otherwise the committed JSON is read and nothing is written.

    python benchmarks/paper_spectrain.py [--quick] [--measure]
    python benchmarks/paper_spectrain.py --lr-sweep   # how ACCURACY_LR was chosen: 2 seeds, 300 batches, 5 rates
    python benchmarks/paper_spectrain.py --sync-curve # how STEPS was chosen: sync alone at ACCURACY_LR, 5 seeds
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
MODES = ("sync", "stale", "stash", "predict", "predict-consistent")
SEEDS = tuple(range(10))
QUICK_SEEDS = (0, 1)
STAGES = 4
M = 4  # microbatches per batch
# batches per dataset, full and quick; async_convergence.DATASETS says the model and microbatch rows
STEPS = {"digits": 800}
QUICK_STEPS = {"digits": 10}
ACCURACY_LR = 0.12
"""Digits' learning rate here: 2.4x the tuned 0.05 (async_convergence.DATASETS), where plain staleness diverged on
some seeds and sync still converged (a sweep of 0.05-0.15 on 2 seeds, 300 batches: RESULTS.md, 'SpecTrain's
accuracy')."""
EVAL_BATCHES = 4
RESULTS = HERE / "results" / "paper_spectrain"
# the throughput table's models: the committed profiles (VGG-16 on CIFAR-sized input is the paper's), and
# (zoo model, microbatch rows) at full size on paper_layerpipe's GPU-class roofline
PROFILED = ("vgg-16-4096", "vgg-16-512", "gpt-small")
QUICK_PROFILED = ("vgg-16-4096",)
THROUGHPUT = (("vgg-16", 32), ("resnet-50", 32), ("gpt-base", 8))
QUICK_THROUGHPUT = (("vgg-16", 32),)


MEMORY_MODEL, MEMORY_MICROBATCHES = "mlp-deep", 8
MEMORY_POLICIES = ("stale", "stash", "predict", "predict-consistent")
MIB = 2.0**20


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- throughput ---------------------------------------------------------------------------------


def throughput(quick: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """Per model and link, DP's and SpecTrain's samples/s; and where each model's costs came from."""
    from fxpipe.schedules.generators import generate
    from fxpipe.schedules.simulate import simulate

    lp = _load("paper_layerpipe")
    models = [(m, *lp.profile_table(m), lp.paper_profiles.load(m).doc["microbatch"])
              for m in (QUICK_PROFILED if quick else PROFILED)]
    models += [(m, lp.layer_table(m, r), f"roofline at {lp.GPU_FLOPS / 1e12:.0f} TFLOP/s, microbatch {r} (modelled)", r)
               for m, r in (QUICK_THROUGHPUT if quick else THROUGHPUT)]
    out = []
    for model, layers, _, rows in models:
        param_bytes = sum(x["param_bytes"] for x in layers)
        n = 16 * STAGES
        for link, (bandwidth, latency) in lp.LINKS.items():
            one = dataclasses.replace(lp.stage_costs(layers, 1, bandwidth, latency, M), dp=STAGES)
            dp = simulate(generate("1f1b", 1, M), one)
            st = simulate(generate("async-1f1b", STAGES, n), lp.stage_costs(layers, STAGES, bandwidth, latency, n))
            out.append({"model": model, "link": link, "dp": STAGES * M * rows / dp.makespan,
                        "spectrain": n * rows / st.makespan, "allreduce_s": dp.allreduce_s, "step_s": dp.makespan,
                        "param_mb": param_bytes / 1e6})
    return out, [f"- {m}: {src}" for m, _, src, _ in models]


def throughput_table(data: list[dict[str, Any]]) -> str:
    lines = [f"| model | params (MB) | link | DP x{STAGES} samples/s | SpecTrain {STAGES} stages samples/s | "
             "SpecTrain / DP | DP all-reduce share of its step |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in data:
        lines.append(f"| {r['model']} | {r['param_mb']:.0f} | {r['link']} | {r['dp']:.0f} | {r['spectrain']:.0f} | "
                     f"{r['spectrain'] / r['dp']:.2f}x | {min(1.0, r['allreduce_s'] / max(r['step_s'], 1e-12)):.0%} |")
    return "\n".join(lines)


# -- memory per stage against PipeDream's stash ----------------------------------------------------------


def measure_memory() -> dict[str, Any]:
    """Per weight policy, the peak bytes per stage the runtime tracked (reference executor, ``HeldBytes``) and the
    simulation's count for the same schedule (benchmarks/memory_per_schedule.py's ``run_one``)."""
    import fxpipe
    from fxpipe import models
    from fxpipe.schedules.simulate import Costs

    mps = _load("memory_per_schedule")
    torch.manual_seed(0)
    zoo = models.build(MEMORY_MODEL)
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=STAGES)
    policies = {w: {k: mps.run_one(pipe, zoo, "async-1f1b", MEMORY_MICROBATCHES, w)[k]
                    for k in ("measured", "simulated")} for w in MEMORY_POLICIES}
    return {"model": MEMORY_MODEL, "stages": STAGES, "microbatches": MEMORY_MICROBATCHES,
            "weight_bytes": list(Costs.from_plan(pipe.plan).grad_bytes), "policies": policies}


def memory_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per policy: measured and simulated MiB per stage, simulated / measured (worst stage), within 20% or not, and
    the weight copies kept beyond the live ones per stage (measured, over stale's activations, in stage weights)."""
    import paper_profiles

    stale = doc["policies"]["stale"]["measured"]
    out = []
    for policy, got in doc["policies"].items():
        ratios = [paper_profiles.model_over_measured(s, m) for s, m in zip(got["simulated"], got["measured"])]
        worst = max(ratios, key=lambda r: abs(r - 1.0))
        copies = [round((m - a) / w) if w else 0 for m, a, w in zip(got["measured"], stale, doc["weight_bytes"])]
        out.append({"policy": policy, "measured": got["measured"], "simulated": got["simulated"], "worst": worst,
                    "within": all(paper_profiles.within(s, m) for s, m in zip(got["simulated"], got["measured"])),
                    "copies": copies})
    return out


def memory_table(rows: list[dict[str, Any]]) -> str:
    names = {"stash": "stash (PipeDream)", "predict": "predict (SpecTrain, paper)"}
    stages = len(rows[0]["measured"])
    lines = ["| policy | " + " | ".join(f"stage {s} measured / simulated MiB" for s in range(stages)) +
             " | simulated / measured (worst stage) | within 20% | weight copies beyond the live ones |",
             "| --- |" + " --- |" * (stages + 3)]
    for r in rows:
        cells = " | ".join(f"{m / MIB:.3f} / {s / MIB:.3f}" for m, s in zip(r["measured"], r["simulated"]))
        lines.append(f"| {names.get(r['policy'], r['policy'])} | {cells} | {r['worst']:.3f} | "
                     f"{'yes' if r['within'] else 'no'} | {', '.join(map(str, r['copies']))} |")
    return "\n".join(lines)


# -- accuracy at equal samples --------------------------------------------------------------------


def _run_seed(ac: Any, dataset: str, cfg: dict[str, Any], data: Any, steps: int, seed: int,
              pipes: dict[str, Any]) -> dict[str, float]:
    """Every mode's held-out metric after ``steps`` batches of seed ``seed`` (the same batches, the same start)."""
    from fxpipe.runtime.reference import ReferenceExecutor
    from fxpipe.schedules.generators import generate

    zoo = ac._build(cfg, seed)
    size = cfg["mb_size"] * M
    batches = [ac._batch(data, cfg, k, size, seed) for k in range(steps)]
    start = {n: p.detach().clone() for n, p in zoo.model.named_parameters()}
    out = {}
    for mode in MODES:
        model = copy.deepcopy(zoo.model)
        if mode == "sync":
            opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
            for x, y in batches:
                loss = sum(zoo.loss_fn(model(xm), ym) for xm, ym in zip(x.tensor_split(M), y.tensor_split(M))) / M
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        else:
            pipe = pipes[dataset]
            for st in pipe.stages:  # this seed's starting weights into the shared stage modules
                for n, p in st.module.named_parameters():
                    with torch.no_grad():
                        p.copy_(start[n])
            micro = [((xm,), ym) for x, y in batches for xm, ym in zip(x.tensor_split(M), y.tensor_split(M))]
            ex = ReferenceExecutor(pipe, zoo.loss_fn)
            lr = cfg["lr"] / M
            ex.run_async(generate("async-1f1b", STAGES, len(micro)), micro,
                         lambda ps, lr=lr: torch.optim.SGD(ps, lr=lr, momentum=0.9), weights=mode)
            got = {n: p.detach() for st in pipe.stages for n, p in st.module.named_parameters()}
            model.load_state_dict(got, strict=False)
        out[mode] = ac._evaluate(data, cfg, model)
    return out


LR_SWEEP = (0.05, 0.08, 0.1, 0.12, 0.15)


def lr_sweep(rates: tuple[float, ...] = LR_SWEEP, seeds: tuple[int, ...] = (0, 1), steps: int = 300) -> dict[str, Any]:
    """Every mode's digits accuracy per learning rate and seed (how ``ACCURACY_LR`` was chosen); writes
    ``results/paper_spectrain/lr_sweep.json``."""
    global ACCURACY_LR
    old, out = ACCURACY_LR, {}
    try:
        for lr in rates:
            ACCURACY_LR = lr
            out[str(lr)] = accuracy({"digits": steps}, seeds)["digits"]
    finally:
        ACCURACY_LR = old
    doc = {"steps": steps, "seeds": list(seeds), "command": "python benchmarks/paper_spectrain.py --lr-sweep",
           "results": out}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "lr_sweep.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


CURVE_AT = (200, 400, 800, 1600)


def sync_curve(seeds: tuple[int, ...] = (0, 1, 2, 3, 4)) -> dict[str, Any]:
    """Sync's held-out digits accuracy at ``ACCURACY_LR`` after each of ``CURVE_AT`` batches, per seed (how long the
    accuracy table trains); writes ``results/paper_spectrain/sync_curve.json``."""
    ac = _load("async_convergence")
    torch.set_num_threads(1)
    data = ac._source("digits")
    cfg = dict(ac.DATASETS["digits"], eval_batches=EVAL_BATCHES, lr=ACCURACY_LR)
    out = {}
    for seed in seeds:
        zoo = ac._build(cfg, seed)
        opt = torch.optim.SGD(zoo.model.parameters(), lr=cfg["lr"], momentum=0.9)
        got = []
        for k in range(max(CURVE_AT)):
            x, y = ac._batch(data, cfg, k, cfg["mb_size"] * M, seed)
            loss = sum(zoo.loss_fn(zoo.model(xm), ym) for xm, ym in zip(x.tensor_split(M), y.tensor_split(M))) / M
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if k + 1 in CURVE_AT:
                got.append(ac._evaluate(data, cfg, zoo.model))
                zoo.model.train()
        out[str(seed)] = got
    doc = {"lr": ACCURACY_LR, "batches": list(CURVE_AT), "command": "python benchmarks/paper_spectrain.py --sync-curve",
           "accuracy": out}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sync_curve.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def accuracy(steps: dict[str, int], seeds: tuple[int, ...]) -> dict[str, dict[str, list[float]]]:
    import fxpipe

    ac = _load("async_convergence")
    torch.set_num_threads(1)
    results: dict[str, dict[str, list[float]]] = {}
    for dataset, n in steps.items():
        cfg = dict(ac.DATASETS[dataset], eval_batches=EVAL_BATCHES, lr=ACCURACY_LR)
        data = ac._source(dataset)
        zoo = ac._build(cfg, 0)
        mb = (ac._batch(data, cfg, 0, cfg["mb_size"], 0)[0],)
        pipe = fxpipe.compile(zoo.model, mb, stages=STAGES, verify_each=False)
        pipe.build_backward(mb)
        results[dataset] = {mode: [] for mode in MODES}
        for seed in seeds:
            for mode, value in _run_seed(ac, dataset, cfg, data, n, seed, {dataset: pipe}).items():
                results[dataset][mode].append(value)
    return results


def accuracy_table(results: dict[str, dict[str, list[float]]], steps: dict[str, int]) -> str:
    lines = ["| dataset | batches (x 4 microbatches) | mode | held-out accuracy, mean | std | median | spread (min - max) "
             "| per seed |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for dataset, modes in results.items():
        for mode, values in modes.items():
            lines.append(f"| {dataset} | {steps[dataset]} | {mode} | {100 * statistics.mean(values):.1f}% | "
                         f"{100 * statistics.pstdev(values):.1f} | {100 * statistics.median(values):.1f}% | "
                         f"{100 * min(values):.1f}% - {100 * max(values):.1f}% | "
                         f"{', '.join(f'{100 * v:.1f}' for v in values)} |")
    return "\n".join(lines)


def verdict(tput: list[dict[str, Any]], results: dict[str, dict[str, list[float]]] | None,
            memory: list[dict[str, Any]] | None) -> str:
    import paper_verdicts

    best = max(tput, key=lambda r: r["spectrain"] / r["dp"])
    parts = paper_verdicts.spectrain([r["spectrain"] / r["dp"] for r in tput])
    word = paper_verdicts.grade(parts)
    if results and "digits" in results:
        d = results["digits"]
        acc_word, acc = paper_verdicts.spectrain_accuracy(d["predict"], d["stale"], d["sync"])
        word = paper_verdicts.WORDS[max(paper_verdicts.WORDS.index(word), paper_verdicts.WORDS.index(acc_word))]
        acc = f"accuracy ({acc_word}): {acc}"
    else:
        acc = "accuracy: not committed (run --measure)"
    slower = [f"{r['model']} on {r['link']}" for r in tput if r["spectrain"] < r["dp"]]
    faster = [f"{r['model']} on {r['link']} {r['spectrain'] / r['dp']:.2f}x" for r in tput if r["spectrain"] >= r["dp"]]
    if memory:
        held = {r["policy"]: r for r in memory}
        ratios = ", ".join(f"{policy} {r['worst']:.3f}" for policy, r in held.items())
        mem = (f" Memory simulated / measured (worst stage): {ratios}, "
               f"{'all' if all(r['within'] for r in memory) else 'not all'} within 20%; predict keeps "
               f"at most {max(held['predict']['copies'])} weight copy per stage beyond the live one, stash "
               f"{', '.join(map(str, held['stash']['copies']))}.")
    else:
        mem = " Memory not committed (run --measure)."
    return (f"**Verdict: {word}** (throughput simulated, accuracy measured on digits). Headline: "
            f"{paper_verdicts.SPECTRAIN}. Here: {parts[0].text('.2f')} ({best['model']}, {best['link']}, where "
            f"DP's all-reduce of {best['param_mb']:.0f} MB is {min(1.0, best['allreduce_s'] / best['step_s']):.0%} of "
            f"its step); SpecTrain at least as fast as DP in {len(faster)} of {len(tput)} rows "
            f"({', '.join(faster) or 'none'}); {acc}.{mem}")


def main(quick: bool = False, measure: bool = False) -> str:
    """The tables as markdown; ``measure`` trains and measures memory now (the full run writes the JSON the default
    run reads), ``quick`` shrinks the throughput table and a measurement to a smoke test (nothing written)."""
    tput, sources = throughput(quick)
    parts = [f"## SpecTrain against data parallelism ({STAGES} GPUs' worth)", "",
             "Throughput (simulated), costs per layer:", "", *sources, "", throughput_table(tput), ""]
    full, mem_path = RESULTS / "accuracy.json", RESULTS / "memory.json"
    memory = None
    if measure:
        steps, seeds = (QUICK_STEPS, QUICK_SEEDS) if quick else (STEPS, SEEDS)
        live = accuracy(steps, seeds)
        memory = measure_memory()
        if quick:
            parts += [f"Accuracy at equal samples, measured now ({len(seeds)} seeds, {STAGES} stages; quick: a few "
                      "batches, not a result):", "", accuracy_table(live, steps), ""]
        else:
            RESULTS.mkdir(parents=True, exist_ok=True)
            full.write_text(json.dumps({"steps": steps, "seeds": list(seeds), "lr": ACCURACY_LR,
                                        "command": "python benchmarks/paper_spectrain.py --measure",
                                        "results": live}, indent=1) + "\n")
            mem_path.write_text(json.dumps(memory, indent=1) + "\n")
    if memory is None and mem_path.exists():
        memory = json.loads(mem_path.read_text())
    saved = json.loads(full.read_text()) if full.exists() else None
    where = "measured now" if measure and not quick else \
        f"committed, {full.relative_to(HERE.parent)}; --measure retrains"
    if saved:
        parts += [f"Accuracy at equal samples ({len(saved['seeds'])} seeds, {STAGES} stages, lr {saved.get('lr', '-')} "
                  f"a batch, measured on CPU in one process; {where}; `{saved.get('command', '-')}`):", "",
                  accuracy_table(saved["results"], saved["steps"]), ""]
    else:
        parts += ["Accuracy at equal samples: not committed (--measure trains and writes it).", ""]
    rows = memory_rows(memory) if memory else None
    mem_where = "measured now" if measure else \
        f"committed, {mem_path.relative_to(HERE.parent)}; --measure measures again"
    if rows:
        parts += [f"Memory per stage, measured (the runtime's tracked bytes, reference executor) against simulated "
                  f"(held_peaks_with_versions): {memory['model']} in {memory['stages']} stages, async-1f1b, "
                  f"{memory['microbatches']} microbatches ({mem_where}):", "",
                  memory_table(rows), ""]
    parts += ["Measured here against a model: the memory only (its simulated / measured column). The accuracy has no "
              "simulated counterpart, and the throughput is simulated only (no multi-GPU machine here).", "",
              verdict(tput, saved["results"] if saved else None, rows), ""]
    return "\n".join(parts)


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--sync-curve" in args:
        for seed, got in sync_curve()["accuracy"].items():
            print(f"seed {seed}: " + ", ".join(f"{b} batches {100 * v:.1f}" for b, v in zip(CURVE_AT, got)))
    elif "--lr-sweep" in args:
        for lr, modes in lr_sweep()["results"].items():
            print(f"lr {lr}: " + "; ".join(f"{m} {', '.join(f'{100 * v:.1f}' for v in vals)}" for m, vals in modes.items()))
    else:
        print(main(quick="--quick" in args, measure="--measure" in args))
