"""Asynchronous pipeline training against synchronous 1F1B on real data: sync vs stale vs stash vs predict (issue 12).

Each (dataset, ranks) pair is one launch of gloo ranks (1 thread each) that loops over seeds and
modes, so every rank builds its stage graphs once:

    digits  mlp-small, batches of 32 = 4 microbatches of 8, scikit-learn's digits (1 in 5 held out)
    text    gpt-small (T = 32, bytes), batches of 32 = 4 microbatches of 8, Python's stdlib sources

    sync     schedule 1f1b:       one optimizer step per batch, the gradient averaged over its 4 microbatches
    stale    schedule async-1f1b: one step per microbatch, no flush, each phase reads the live weights
    stash    async-1f1b, PipeDream: B and W read the version F read
    predict  async-1f1b, SpecTrain: F and B read W - s * lr * v (v the momentum buffer)

Every mode sees the same batches in the same order for a seed (the seed also picks the initial
weights), so curves are compared at equal samples. All modes use SGD with momentum 0.9; the async
modes take lr / m (m = 4 microbatches), so that m async steps of a microbatch gradient move the
weights as far as one sync step of the batch gradient. ``sgd-mb`` is the same per-microbatch SGD
(lr / m, momentum 0.9) in one process with no pipeline and so no staleness: it separates what
update granularity alone changes from what staleness changes.

Each mode trains in ``--chunks`` calls of ``rt.train`` (async: one schedule per call, drained at its
end, so 3 drains in a run of 4 chunks); after each, rank 0 gathers every rank's stage weights and
scores the eager model on the held-out set. Samples/s is the training wall time only (the max
over ranks of the ``rt.train`` calls), evaluation excluded.

    python benchmarks/async_convergence.py [--datasets digits text] [--ranks 2 4] [--seeds 3] [--steps N] [--out DIR]

Writes to ``--out``: curves.csv (per batch training loss), heldout.csv (held-out accuracy or loss at
each checkpoint), throughput.csv, simulated.csv, summary.md (the tables), summary.json and curves.png; ``--from-csv``
redoes the tables and the plot from the CSVs already there.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("sync", "stale", "stash", "predict")
REFERENCE = "sgd-mb"  # one process, per-microbatch SGD: async's update granularity without staleness
SMOOTH = 10  # batches in the moving average before curves are compared or drawn


DATASETS: dict[str, dict[str, Any]] = {
    # lr: synchronous SGD's, tuned on one seed in eager (digits 0.03 / 0.05 / 0.08 -> 0.05; text 0.05 / 0.1 / 0.2 -> 0.1)
    "digits": {"model": "mlp-small", "mb_size": 8, "lr": 0.05, "steps": 300, "metric": "accuracy"},
    "text": {"model": "gpt-small", "mb_size": 8, "lr": 0.1, "steps": 160, "metric": "heldout_loss", "seq_len": 32,
             "eval_batches": 16, "untie": True},
}


def _build(cfg: dict[str, Any], seed: int) -> Any:
    """The zoo model of ``cfg`` with weights from ``seed``; gpt's tied lm_head becomes its own copy of wte.

    Asynchronous training refuses a weight two stages share (``check_async``: each stage steps on its
    own), and every gpt of the zoo ties lm_head to wte; so every mode, sync included, trains the untied
    model (the same values at the start).
    """
    from fxpipe import models

    zoo = models.build(cfg["model"], seed=seed)
    if cfg.get("untie"):
        zoo.model.lm_head.weight = torch.nn.Parameter(zoo.model.wte.weight.detach().clone())
    return zoo


def _source(dataset: str) -> Any:
    from fxpipe.data import load_digits, load_stdlib_text

    return load_digits() if dataset == "digits" else load_stdlib_text()


def _batch(data: Any, cfg: dict[str, Any], k: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    if "seq_len" in cfg:
        return data.batch(k, size, cfg["seq_len"], seed=seed)
    return data.batch(k, size, seed=seed)


def _evaluate(data: Any, cfg: dict[str, Any], model: torch.nn.Module) -> float:
    model.eval()
    if "seq_len" in cfg:
        return data.evaluate(model, 64, cfg["seq_len"], max_batches=cfg["eval_batches"]).loss
    return data.evaluate(model, 64).accuracy


def _chunks(steps: int, chunks: int) -> list[range]:
    """``steps`` batches cut into ``chunks`` consecutive ranges of nearly equal length."""
    cuts = [round(i * steps / chunks) for i in range(chunks + 1)]
    return [range(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def worker(rank: int, world: int, init: str, dataset: str, cfg: dict[str, Any], seeds: list[int], m: int,
           chunks: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    import fxpipe
    from fxpipe.runtime import PipelineRuntime

    data = _source(dataset)
    size = cfg["mb_size"] * m
    zoo = _build(cfg, 0)
    mb = (_batch(data, cfg, 0, cfg["mb_size"], 0)[0],)  # the plan is compiled for one microbatch
    plan_dir = os.path.join(tmp, "plan")
    if rank == 0:
        fxpipe.save(fxpipe.compile(zoo.model, mb, stages=world), plan_dir)
    dist.barrier()
    t0 = time.perf_counter()
    pipe = fxpipe.load(plan_dir)
    pipe.build_backward(mb)  # once per rank: every runtime below shares these graphs (and the stage modules)
    build_s = time.perf_counter() - t0
    rows: dict[str, Any] = {"curves": [], "heldout": [], "throughput": [], "build_s": build_s}
    for seed in seeds:
        init_model = _build(cfg, seed).model
        init_state = {"params": dict(init_model.named_parameters(remove_duplicate=False)),
                      "buffers": dict(init_model.named_buffers(remove_duplicate=False))}
        batches = [((b[0],), b[1]) for b in (_batch(data, cfg, k, size, seed) for k in range(cfg["steps"]))]
        for mode in MODES:
            lr = cfg["lr"] if mode == "sync" else cfg["lr"] / m
            rt = PipelineRuntime(pipe, "1f1b" if mode == "sync" else "async-1f1b", zoo.loss_fn, microbatches=m,
                                 optimizer=lambda ps, lr=lr: torch.optim.SGD(ps, lr=lr, momentum=0.9),
                                 weights="stash" if mode == "sync" else mode, timeout=timedelta(seconds=600))
            rt.load_state_dict(init_state)
            _score(rt, data, cfg, rows, mode, seed, samples=0)
            for part in _chunks(cfg["steps"], chunks):
                dist.barrier()
                t0 = time.perf_counter()
                losses = rt.train(batches[part.start:part.stop])
                elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                rows["curves"] += [(mode, seed, k, (k + 1) * size, float(x)) for k, x in zip(part, losses)]
                rows["throughput"].append((mode, seed, len(part) * size, float(elapsed)))
                _score(rt, data, cfg, rows, mode, seed, samples=part.stop * size)
            if rank == 0:
                print(f"  {dataset} ranks {world} seed {seed} {mode}: last loss {rows['curves'][-1][-1]:.4f}, "
                      f"held out {rows['heldout'][-1][-1]:.4f}", flush=True)
            del rt
    if rank == 0:
        with open(os.path.join(tmp, "result.json"), "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def _score(rt: Any, data: Any, cfg: dict[str, Any], rows: dict[str, Any], mode: str, seed: int, samples: int) -> None:
    """Gather every rank's stage weights on rank 0 and score the eager model on the held-out set there."""
    mine = {n: p.detach().clone() for n, p in rt.state_dict()["params"].items()}
    every: list[Any] = [None] * rt.world
    dist.all_gather_object(every, mine)
    if rt.rank != 0:
        return
    model = _build(cfg, 0).model
    merged = {n: p for part in every for n, p in part.items()}
    # A tied weight may come under either of its names (gpt's plan calls wte.weight lm_head.weight): every
    # distinct parameter must be covered by one of them.
    names: dict[int, set[str]] = defaultdict(set)
    for n, p in model.named_parameters(remove_duplicate=False):
        names[id(p)].add(n)
    missing = [sorted(ns) for ns in names.values() if not ns & set(merged)]
    if missing:
        raise RuntimeError(f"the ranks' stages hold no value for {sorted(missing)}")
    model.load_state_dict(merged, strict=False)
    rows["heldout"].append((mode, seed, samples, _evaluate(data, cfg, model)))


def reference(dataset: str, cfg: dict[str, Any], seeds: list[int], m: int, chunks: int) -> dict[str, Any]:
    """``sgd-mb``: the async modes' per-microbatch SGD (lr / m) in one process, eager, with no staleness."""
    torch.set_num_threads(1)
    data = _source(dataset)
    size = cfg["mb_size"] * m
    rows: dict[str, Any] = {"curves": [], "heldout": [], "throughput": []}
    for seed in seeds:
        zoo = _build(cfg, seed)
        model = zoo.model
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"] / m, momentum=0.9)
        rows["heldout"].append((REFERENCE, seed, 0, _evaluate(data, cfg, model)))
        for part in _chunks(cfg["steps"], chunks):
            model.train()
            t0 = time.perf_counter()
            for k in part:
                x, y = _batch(data, cfg, k, size, seed)
                losses = []
                for xm, ym in zip(x.tensor_split(m), y.tensor_split(m)):
                    loss = zoo.loss_fn(model(xm), ym)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    losses.append(loss.item())
                rows["curves"].append((REFERENCE, seed, k, (k + 1) * size, sum(losses) / m))
            rows["throughput"].append((REFERENCE, seed, len(part) * size, time.perf_counter() - t0))
            rows["heldout"].append((REFERENCE, seed, part.stop * size, _evaluate(data, cfg, model)))
    return rows


def simulated(stages: tuple[int, ...], m: int, updates: int) -> list[tuple[int, int, str, float, float]]:
    """Microbatches per unit time over ``updates * m`` microbatches, F = 1, B = 1, W = 1 (free transfers):
    sync 1F1B drains every m microbatches (``updates`` schedules of m); async-1f1b streams them all at once."""
    from fxpipe.schedules.generators import GENERATORS
    from fxpipe.schedules.simulate import Costs, simulate

    rows = []
    for p in stages:
        costs = Costs.uniform(p, 1.0, 1.0, 1.0)
        n = updates * m
        sync = updates * simulate(GENERATORS["1f1b"](p, m), costs).makespan
        stream = simulate(GENERATORS["async-1f1b"](p, n), costs).makespan
        ideal = n * 3.0  # one rank's work alone: no bubble
        rows.append((p, m, "sync 1f1b", n / sync, ideal / sync))
        rows.append((p, m, "async-1f1b", n / stream, ideal / stream))
    return rows


def _smooth(xs: list[float]) -> list[float]:
    """Trailing moving average over ``SMOOTH`` batches (shorter at the start)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= SMOOTH:
            acc -= xs[i - SMOOTH]
        out.append(acc / min(i + 1, SMOOTH))
    return out


def summarize(results: dict[tuple[str, int], dict[str, Any]], cfgs: dict[str, dict[str, Any]],
              sim: list[tuple[int, int, str, float, float]]) -> tuple[str, dict[str, Any]]:
    """The markdown tables: per dataset x ranks, each mode's held-out metric, distance from sync, samples/s."""
    lines = ["| dataset | ranks | mode | held-out (median of seeds) | per seed | distance from sync "
             "(median, per seed) | distance from sgd-mb | samples/s (median) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    summary: dict[str, Any] = {}
    for (dataset, world), res in results.items():
        metric = cfgs[dataset]["metric"]
        curves: dict[tuple[str, int], list[float]] = defaultdict(list)
        for mode, seed, k, samples, loss in sorted(res["curves"], key=lambda r: (r[0], r[1], r[2])):
            curves[(mode, seed)].append(loss)
        final: dict[tuple[str, int], tuple[int, float]] = {}
        for mode, seed, samples, value in res["heldout"]:
            if (mode, seed) not in final or samples > final[(mode, seed)][0]:
                final[(mode, seed)] = (samples, value)
        speed: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
        for mode, seed, samples, seconds in res["throughput"]:
            speed[(mode, seed)][0] += samples
            speed[(mode, seed)][1] += seconds
        seeds = sorted({seed for _, seed in curves})
        for mode in (*MODES, REFERENCE):
            if (mode, seeds[0]) not in curves:
                continue
            vals = [final[(mode, s)][1] for s in seeds]
            dists, free = [], []
            for s in seeds:
                a, b = _smooth(curves[(mode, s)]), _smooth(curves[("sync", s)])
                dists.append(sum(abs(x - y) for x, y in zip(a, b)) / len(a))
                if (REFERENCE, s) in curves:  # the same updates without staleness: what staleness alone moves
                    c = _smooth(curves[(REFERENCE, s)])
                    free.append(sum(abs(x - y) for x, y in zip(a, c)) / len(a))
            rates = [speed[(mode, s)][0] / speed[(mode, s)][1] for s in seeds]
            scale, fmt = (100.0, "{:.1f}") if metric == "accuracy" else (1.0, "{:.3f}")
            label = f"{metric} %" if metric == "accuracy" else "held-out loss (nats/byte)"
            summary[f"{dataset}/{world}/{mode}"] = {"heldout": statistics.median(vals), "distance":
                                                   statistics.median(dists), "distance_from_reference":
                                                   statistics.median(free) if free else None, "samples_per_s": statistics.median(rates)}
            lines.append(f"| {dataset} | {world} | {mode} | {fmt.format(statistics.median(vals) * scale)} {label} | "
                         f"{', '.join(fmt.format(v * scale) for v in vals)} | "
                         f"{'-' if mode == 'sync' else f'{statistics.median(dists):.4f}'}"
                         f"{'' if mode == 'sync' else ' (' + ', '.join(f'{d:.4f}' for d in dists) + ')'} | "
                         f"{f'{statistics.median(free):.4f}' if free and mode != REFERENCE else '-'} | "
                         f"{statistics.median(rates):.0f} |")
    lines += ["", "Ranking by distance from sync (median over seeds, smallest first):", ""]
    for dataset, world in results:
        keys = [m for m in MODES[1:] if f"{dataset}/{world}/{m}" in summary]
        ranked = sorted(keys, key=lambda m: summary[f"{dataset}/{world}/{m}"]["distance"])
        lines.append(f"- {dataset}, {world} ranks: " + " < ".join(
            f"{m} ({summary[f'{dataset}/{world}/{m}']['distance']:.4f})" for m in ranked))
    lines += ["", f"Ranking by distance from {REFERENCE} (the same per-microbatch updates without staleness):", ""]
    for dataset, world in results:
        keys = [m for m in MODES[1:] if (summary.get(f"{dataset}/{world}/{m}") or {}).get("distance_from_reference")
                is not None]
        ranked = sorted(keys, key=lambda m: summary[f"{dataset}/{world}/{m}"]["distance_from_reference"])
        lines.append(f"- {dataset}, {world} ranks: " + " < ".join(
            f"{m} ({summary[f'{dataset}/{world}/{m}']['distance_from_reference']:.4f})" for m in ranked))
    lines += ["", "Simulated throughput (microbatches per unit time, F = B = W = 1; fraction of the bubble-free rate):",
              "", "| stages | microbatches per update | sync 1f1b | async-1f1b | async / sync |",
              "| --- | --- | --- | --- | --- |"]
    by = {(p, name): (rate, eff) for p, m, name, rate, eff in sim}
    for p in sorted({p for p, *_ in sim}):
        m = next(mm for pp, mm, *_ in sim if pp == p)
        s, a = by[(p, "sync 1f1b")], by[(p, "async-1f1b")]
        lines.append(f"| {p} | {m} | {s[0]:.4f} ({s[1]:.1%}) | {a[0]:.4f} ({a[1]:.1%}) | {a[0] / s[0]:.2f}x |")
    return "\n".join(lines) + "\n", summary


def plot(results: dict[tuple[str, int], dict[str, Any]], cfgs: dict[str, dict[str, Any]], path: Path) -> None:
    """Training loss (smoothed, median over seeds) and the held-out metric per mode, one column per (dataset, ranks)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results)
    fig, axes = plt.subplots(2, len(keys), figsize=(3.6 * len(keys), 5.6), squeeze=False)
    colors = {"sync": "black", "stale": "tab:red", "stash": "tab:blue", "predict": "tab:green", REFERENCE: "tab:gray"}
    for col, (dataset, world) in enumerate(keys):
        res = results[(dataset, world)]
        curves: dict[tuple[str, int], list[tuple[int, float]]] = defaultdict(list)
        for mode, seed, k, samples, loss in res["curves"]:
            curves[(mode, seed)].append((samples, loss))
        held: dict[tuple[str, int], list[tuple[int, float]]] = defaultdict(list)
        for mode, seed, samples, value in res["heldout"]:
            held[(mode, seed)].append((samples, value))
        for mode in (*MODES, REFERENCE):
            seeds = sorted(s for mm, s in curves if mm == mode)
            if not seeds:
                continue
            style = {"color": colors[mode], "lw": 1.2, "ls": ":" if mode == REFERENCE else "-", "label": mode}
            series = [sorted(curves[(mode, s)]) for s in seeds]
            xs = [x for x, _ in series[0]]
            smooth = [_smooth([y for _, y in s]) for s in series]
            axes[0][col].plot(xs, [statistics.median(v) for v in zip(*smooth)], **style)
            hs = [sorted(held[(mode, s)]) for s in seeds]
            axes[1][col].plot([x for x, _ in hs[0]], [statistics.median(v[1] for v in vs) for vs in zip(*hs)],
                              marker="o", ms=3, **style)
        axes[0][col].set_title(f"{dataset} ({cfgs[dataset]['model']}), {world} ranks", fontsize=9)
        if cfgs[dataset]["metric"] == "accuracy":  # from 2.3 down to a few hundredths
            axes[0][col].set_yscale("log")
        axes[0][col].set_ylabel("train loss (10-batch mean)", fontsize=8)
        axes[1][col].set_ylabel("held-out accuracy" if cfgs[dataset]["metric"] == "accuracy" else
                                "held-out loss (nats/byte)", fontsize=8)
        if cfgs[dataset]["metric"] == "accuracy":
            axes[1][col].set_ylim(0.5, 1.0)
        for row in (0, 1):
            axes[row][col].set_xlabel("samples", fontsize=8)
            axes[row][col].tick_params(labelsize=7)
            axes[row][col].grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("median over seeds; momentum 0.9, async at lr / m", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=72)


def _read_csv(out: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """The rows a run wrote to curves.csv, heldout.csv and throughput.csv, keyed as the run keeps them."""
    results: dict[tuple[str, int], dict[str, Any]] = defaultdict(lambda: {"curves": [], "heldout": [], "throughput": []})
    with open(out / "curves.csv") as f:
        for r in csv.DictReader(f):
            results[(r["dataset"], int(r["ranks"]))]["curves"].append(
                (r["mode"], int(r["seed"]), int(r["step"]), int(r["samples"]), float(r["train_loss"])))
    with open(out / "heldout.csv") as f:
        for r in csv.DictReader(f):
            results[(r["dataset"], int(r["ranks"]))]["heldout"].append(
                (r["mode"], int(r["seed"]), int(r["samples"]), float(r["value"])))
    with open(out / "throughput.csv") as f:
        for r in csv.DictReader(f):
            results[(r["dataset"], int(r["ranks"]))]["throughput"].append(
                (r["mode"], int(r["seed"]), int(r["samples"]), float(r["seconds"])))
    return dict(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="*", default=["digits", "text"], choices=list(DATASETS))
    parser.add_argument("--ranks", nargs="*", type=int, default=[2, 4])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None,
                        help="batches per run, every dataset (default: digits 300, text 160)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=4, help="rt.train calls per run, each followed by a held-out score")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/async_convergence"))
    parser.add_argument("--from-csv", action="store_true",
                        help="train nothing: redo summary.md and curves.png from the CSVs already in --out")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    args.out.mkdir(parents=True, exist_ok=True)
    cfgs = {d: {**DATASETS[d], **({"steps": args.steps} if args.steps else {})} for d in args.datasets}
    seeds = list(range(args.seeds))
    results: dict[tuple[str, int], dict[str, Any]] = {}
    refs: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    if args.from_csv:
        results = _read_csv(args.out)
        cfgs = {d: DATASETS[d] for d, _ in results}
        sim = simulated((4, 8, 16), args.microbatches, updates=64)
        table, summary = summarize(results, cfgs, sim)
        (args.out / "summary.md").write_text(table)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        plot(results, cfgs, args.out / "curves.png")
        print(table)
        return
    for dataset in args.datasets:
        t0 = time.perf_counter()
        refs[dataset] = reference(dataset, cfgs[dataset], seeds, args.microbatches, args.chunks)
        print(f"{dataset} {REFERENCE}: {time.perf_counter() - t0:.0f} s", flush=True)
        for world in args.ranks:
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                mp.spawn(worker, args=(world, f"file://{tmp}/pg", dataset, cfgs[dataset], seeds, args.microbatches,
                                       args.chunks, tmp), nprocs=world)
                with open(os.path.join(tmp, "result.json")) as f:
                    res = json.load(f)
            for key in ("curves", "heldout", "throughput"):
                res[key] += refs[dataset][key]
            results[(dataset, world)] = res
            print(f"{dataset} ranks {world}: {time.perf_counter() - t0:.0f} s (graphs built in {res['build_s']:.0f} s "
                  "on rank 0)", flush=True)
    sim = simulated((4, 8, 16), args.microbatches, updates=64)
    with open(args.out / "curves.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["dataset", "ranks", "mode", "seed", "step", "samples", "train_loss"])
        for (dataset, world), res in results.items():
            w.writerows((dataset, world, *r[:4], f"{r[4]:.4f}") for r in res["curves"])
    with open(args.out / "heldout.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["dataset", "ranks", "mode", "seed", "samples", "metric", "value"])
        for (dataset, world), res in results.items():
            w.writerows((dataset, world, *r[:3], cfgs[dataset]["metric"], f"{r[3]:.4f}") for r in res["heldout"])
    with open(args.out / "throughput.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["dataset", "ranks", "mode", "seed", "samples", "seconds", "samples_per_s"])
        for (dataset, world), res in results.items():
            w.writerows((dataset, world, *r[:3], f"{r[3]:.3f}", f"{r[2] / r[3]:.1f}") for r in res["throughput"])
    with open(args.out / "simulated.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["stages", "microbatches_per_update", "schedule", "microbatches_per_unit_time", "efficiency"])
        w.writerows((p, m, name, f"{rate:.4f}", f"{eff:.4f}") for p, m, name, rate, eff in sim)
    table, summary = summarize(results, cfgs, sim)
    (args.out / "summary.md").write_text(table)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    try:
        plot(results, cfgs, args.out / "curves.png")
    except ImportError:
        print("matplotlib is not installed (pip install 'fxpipe[plot]'): no curves.png", file=sys.stderr)
    print(table)
    print(f"total {time.perf_counter() - started:.0f} s; written to {args.out}")


if __name__ == "__main__":
    main()
