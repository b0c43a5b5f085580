"""fxpipe's runtime against torch.distributed.pipelining, side by side in one run (2 ranks, gloo, 1 thread each).

The peer runs split at fxpipe's cut and, as its users split by hand, at half the layers; all
train the same batch in the same microbatches (mlp-deep: the issue's 16-layer 1024-wide MLP,
batch 64; gpt-base: 8 blocks, d=256, seq 128, batch 16; 8 microbatches by default). Every
iteration runs each (system, schedule) once in turn (A B A B ...) so machine drift cancels. Also measured, in the same run: the machine's bound, every rank running its own
stage's F, B and W for all microbatches at the same time with no communication and no waiting
(and, to check the calibration's contention factor, the same work one rank at a time); and that bound with each
rank's W run once over all microbatches ("bound, batched W", where the stage batches: fxpipe.runtime.batched_w), the
work fxpipe's batched-w schedule does. ``fxpipe_over_best_bound`` compares with the smaller of the two. And that
batched bound with what every schedule also does ("bound, batched W, fill and optimizer"): each rank's optimizer step
(SGD, on a copy of its stage's parameters) and the pipeline's fill (a rank starts no earlier than the stages before
it ran one microbatch's F), the max over ranks; ``fxpipe_over_bound_with_fill`` compares with it. It is still a
lower bound: no drain (stage 0's last W after the last gradient), no message.

The "simulated" step time is the event simulator's, with rank 0's profiled costs calibrated to
this machine in the same run (``fxpipe.calibration.runtime_costs``: measured link latency and bandwidth,
compute slowed by the measured contention factor); "simulated_uncalibrated" uses the plan's
defaults (1.5 GB/s, 0.1 ms, single-process compute times).

    python benchmarks/runtime_vs_peer.py [--models mlp-deep gpt-base mlp-large gpt-medium] [--microbatches 8] [--iters 12]
"""

from __future__ import annotations

from fxpipe.schedules.simulate import Costs

import argparse
import dataclasses
import itertools
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _timed(fn: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed) * 1e3


def _own(fn: Any) -> float:
    """Seconds of ``fn`` on this rank alone (no barrier)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def worker(rank: int, init: str, name: str, m: int, iters: int, warmup: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=120))
    import fxpipe
    from fxpipe import models
    from fxpipe.calibration.runtime_costs import calibrate
    from fxpipe.runtime.executor import PipelineRuntime
    from fxpipe.cli.rank import synthetic_batch
    from fxpipe.schedules.generators import generate
    from fxpipe.schedules.simulate import simulate
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

    # This machine's link and compute contention, measured while nothing else runs.
    cal = calibrate()
    zoo = models.build(name)
    inputs, target = synthetic_batch(zoo, m)
    mb = tuple(x.tensor_split(m)[0] for x in inputs)
    # Rank 0 compiles and profiles alone (rank 1 waits), so the profile is one process's, which is
    # what the calibration's contention factor scales from; every rank then loads that one plan,
    # so all ranks hold the same stages and the same costs (and so build the same schedules).
    plan_dir = os.path.join(os.path.dirname(out), "plan")
    if rank == 0:
        fxpipe.save(fxpipe.compile(__import__("copy").deepcopy(zoo.model), mb, stages=2, profile=True,
                                   profile_runs=3), plan_dir)
    dist.barrier()
    runners: dict[str, Any] = {}
    runtimes: dict[str, Any] = {}
    simulated: dict[str, float] = {}
    simulated_default: dict[str, float] = {}
    for sched_name in ("1f1b", "zb-h1", "zb-h2", "batched-w", "auto"):
        pipe = fxpipe.load(plan_dir)
        pipe.build_backward(mb)
        costs = Costs.from_plan(pipe.plan)
        if sched_name == "auto":  # fxpipe's own pick for these costs, among every schedule it generates
            from fxpipe.schedules.auto import auto

            sched = auto(2, costs, microbatches=[m]).schedule
            key = f"fxpipe auto ({sched.name})"
        else:
            sched = generate(sched_name, 2, m, costs)
            key = f"fxpipe {sched_name}"
        rt = PipelineRuntime(pipe, sched, zoo.loss_fn, optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-4))
        runners[key] = lambda rt=rt: rt.step(inputs, target)
        runtimes[key] = rt
        simulated[key] = simulate(sched, cal.apply(costs)).makespan * 1e3
        simulated_default[key] = simulate(sched, costs).makespan * 1e3
    # The peer, split where fxpipe's plan cuts (before the first layer of stage 1), and where its
    # users split by hand: half the layers on each rank.
    layers = next(r for r in pipe.report() if r.title.startswith("group-layers")).column("name")
    cut = layers[list(pipe.plan.bounds)[1]].split("#")[0]
    half = layers[len(layers) // 2].split("#")[0]
    splits = [("", cut)] + ([(" (half the layers)", half)] if half != cut else [])
    for (suffix, at), (peer_name, cls) in itertools.product(splits, (("peer GPipe", ScheduleGPipe),
                                                                     ("peer 1F1B", Schedule1F1B))):
        peer_name += suffix
        model = __import__("copy").deepcopy(zoo.model)
        ppipe = pipeline(model, mb_args=mb, split_spec={at: SplitPoint.BEGINNING})
        stage = ppipe.build_stage(rank, torch.device("cpu"))
        schedule = cls(stage, n_microbatches=m, loss_fn=zoo.loss_fn)
        opt = torch.optim.SGD(stage.submod.parameters(), lr=1e-4)

        def peer_step(schedule: Any = schedule, opt: Any = opt) -> None:
            if rank == 0:
                schedule.step(*inputs)
            else:
                schedule.step(target=target)
            opt.step()
            opt.zero_grad()

        runners[peer_name] = peer_step
    # The bound: this rank's F, B, W for all microbatches, no communication, both ranks at once; W as the
    # runtime runs it, W_acc adding into gradient buffers kept across calls (plain W made fresh gradient buffers
    # every microbatch, which the allocator may hand back to the kernel and fault in again: a bound that moved
    # with the allocator's state, 83 ms on one run, 133 ms on another, for mlp-deep's same rank).
    from fxpipe.graphs.accumulate import accumulating_weight_graph

    g = pipe.stage_graphs[rank]  # the same graphs the runtime runs
    stage_mod = pipe.stage_list()[rank].module
    w_acc = accumulating_weight_graph(g.backward_weight, len(g.param_names))[0]
    accs = [torch.zeros_like(stage_mod.get_parameter(n)) for n in g.param_names]

    args = [torch.randn(v.shape, dtype=v.dtype) if v.is_floating_point() else torch.zeros(v.shape, dtype=v.dtype)
            for v in (n.meta["val"] for n in g.forward.graph.nodes if n.op == "placeholder")]

    def forward_backward() -> list[Any]:
        """One microbatch's F and B on this rank's stage: W's arguments."""
        res = g.forward(*args)
        saved = list(res[g.num_outputs:])
        grads = [torch.ones_like(res[j]) for j in g.grad_outputs]
        b = g.backward_input(*(saved[k] if kind == "saved" else grads[k] for kind, k in g.b_slots))
        return [*b[len(g.grad_inputs):], *(saved[k] if kind == "saved" else grads[k] for kind, k in g.w_slots)]

    def bound() -> None:
        with torch.no_grad():
            for _ in range(m):
                w_acc(*forward_backward(), *accs)

    # batched-w simulated as fxpipe run does: each batched W at the fraction its rank measured (Costs.w_batched)
    fractions = runtimes["fxpipe batched-w"].batched_w_fractions()
    if any(f != 1.0 for f in fractions):
        bw = runtimes["fxpipe batched-w"].schedule
        with_ratio = dataclasses.replace(Costs.from_plan(pipe.plan), w_batched=fractions)
        simulated["fxpipe batched-w"] = simulate(bw, cal.apply(with_ratio)).makespan * 1e3
        simulated_default["fxpipe batched-w"] = simulate(bw, with_ratio).makespan * 1e3
    # The bound with batched W: F and B per microbatch, then one W over all m (where this rank's stage batches:
    # fxpipe.runtime.batched_w; batched-w itself runs two batches of m/2), else the bound above.
    from fxpipe.runtime.batched_w import batched_weight_graphs

    batch = batched_weight_graphs(pipe, rank, g, m, mb) if rank in runtimes["fxpipe batched-w"].batched_w_ratio else None
    batch = None if isinstance(batch, str) else batch

    def bound_batched_w() -> None:
        if batch is None:
            return bound()
        with torch.no_grad():
            batch.w_acc(*batch.combine([forward_backward() for _ in range(m)]), *accs)

    def bound_alone() -> float:
        """The bound's work with the other rank waiting: this rank's own time, no contention."""
        own = 0.0
        for r in range(2):
            dist.barrier()
            if r == rank:
                t0 = time.perf_counter()
                bound()
                own = time.perf_counter() - t0
        elapsed = torch.tensor([own])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed) * 1e3

    # The batched bound with two things every schedule also does: the optimizer step (SGD, as the runtimes; on a
    # copy of this stage's parameters, so the runtimes' weights stay theirs) and the pipeline's fill (a rank
    # cannot start before the stages before it ran one microbatch's F: their F times, from each rank's own).
    shadow = [p.detach().clone().requires_grad_() for p in stage_mod.parameters()]
    for p in shadow:
        p.grad = torch.zeros_like(p)
    shadow_opt = torch.optim.SGD(shadow, lr=1e-4)

    def bound_batched_w_and_optimizer() -> None:
        bound_batched_w()
        shadow_opt.step()

    with torch.no_grad():
        one_f = statistics.median(_own(lambda: g.forward(*args)) for _ in range(5))
    firsts = [0.0, 0.0]
    dist.all_gather_object(firsts, one_f)
    fill = sum(firsts[:rank]) * 1e3  # ms before this rank's first action can start

    def bound_with_fill() -> float:
        """max over ranks of (the fill before it + its batched-bound work and optimizer step, both ranks at once)."""
        dist.barrier()
        t0 = time.perf_counter()
        bound_batched_w_and_optimizer()
        elapsed = torch.tensor([fill + (time.perf_counter() - t0) * 1e3])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    runners["bound"] = bound
    runners["bound, batched W"] = bound_batched_w
    times: dict[str, list[float]] = {k: [] for k in [*runners, "bound alone", "bound, batched W, fill and optimizer"]}
    faults: dict[str, list[int]] = {k: [] for k in runners}  # this rank's minor page faults per call
    for it in range(warmup + iters):
        for key, fn in runners.items():
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = _timed(fn)
            if it >= warmup:
                times[key].append(t)
                faults[key].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        t = bound_alone()
        if it >= warmup:
            times["bound alone"].append(t)
        t = bound_with_fill()
        if it >= warmup:
            times["bound, batched W, fill and optimizer"].append(t)
    # Where each fxpipe step went, per rank, from the runtime's own events of one more step:
    # compute (its actions), waiting for messages, and after the last action (optimizer, loss sum).
    breakdown: dict[str, dict[str, float]] = {}
    for key, rt in runtimes.items():
        t = _timed(runners[key])
        compute = sum(t1 - t0 for _, t0, t1 in rt.events) * 1e3
        waits = sum(t1 - t0 for _, t0, t1 in rt.waits) * 1e3
        span = rt.events[-1][2] * 1e3
        # The optimizer steps: inside the last W's event where a stage steps as soon as its last W ran, else after
        # the last action (tied weights across ranks: after their gradients are summed).
        inside = sum(t1 - t0 for t0, t1 in rt.optimizer_steps if t1 <= rt.events[-1][2]) * 1e3
        optimizer = sum(t1 - t0 for t0, t1 in rt.optimizer_steps) * 1e3
        by_kind: dict[str, float] = {}
        for action, t0, t1 in rt.events:
            by_kind[action.kind.value] = by_kind.get(action.kind.value, 0.0) + (t1 - t0) * 1e3
        breakdown[key] = {"step": t, "compute": compute - inside, "optimizer": optimizer, "by_kind": by_kind,
                          "waiting": waits, "between_actions": span - compute - waits,
                          "after_last_action": t - span - (optimizer - inside)}
    every = [None, None]
    dist.all_gather_object(every, breakdown)
    every_batched = [None, None]
    dist.all_gather_object(every_batched, runtimes["fxpipe batched-w"].batched_w)
    every_faults = [None, None]
    dist.all_gather_object(every_faults, {k: statistics.median(v) for k, v in faults.items()})
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"model": name, "microbatches": m, "batch": int(inputs[0].shape[0]), "cut_before": cut,
                       "half_the_layers_before": half,
                       "median_ms": {k: statistics.median(v) for k, v in times.items()}, "simulated_ms": simulated,
                       "simulated_uncalibrated_ms": simulated_default, "calibration": cal.to_json(),
                       "batched_w": every_batched,
                       "breakdown_ms_per_rank": every, "minor_faults_per_call_per_rank": every_faults,
                       "peak_rss_mib_rank0": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="*", default=["mlp-deep", "gpt-base"])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None, help="where the results go as JSON (default: benchmarks/results/"
                        "runtime_vs_peer/<date-time>-<models>.json); they are printed too")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    rows = []
    for name in args.models:
        tmp = tempfile.mkdtemp()
        out = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(f"file://{tmp}/pg", name, args.microbatches, args.iters, args.warmup, out), nprocs=2)
        with open(out) as f:
            res = json.load(f)
        med = res["median_ms"]
        best_peer = min(v for k, v in med.items() if k.startswith("peer"))
        best_ours_key = min((k for k in med if k.startswith("fxpipe")), key=med.__getitem__)
        res["best_fxpipe"] = best_ours_key
        res["fxpipe_over_best_peer"] = med[best_ours_key] / best_peer
        res["fxpipe_over_bound"] = med[best_ours_key] / med["bound"]
        # against the better of the two bounds: per-microbatch W's, or one batched W per stage where it batches
        res["fxpipe_over_best_bound"] = med[best_ours_key] / min(med["bound"], med["bound, batched W"])
        res["simulated_over_measured"] = res["simulated_ms"][best_ours_key] / med[best_ours_key]
        res["simulated_over_measured_per_schedule"] = {k: res["simulated_ms"][k] / med[k] for k in res["simulated_ms"]}
        res["uncalibrated_over_measured_per_schedule"] = {k: res["simulated_uncalibrated_ms"][k] / med[k]
                                                          for k in res["simulated_uncalibrated_ms"]}
        # against the batched bound plus the fill and the optimizer step, which every schedule also runs
        res["fxpipe_over_bound_with_fill"] = med[best_ours_key] / med["bound, batched W, fill and optimizer"]
        res["bound_contention"] = med["bound"] / med["bound alone"]  # measured slowdown of the real stage work
        res["samples_per_s"] = {k: res["batch"] / (v / 1e3) for k, v in med.items() if not k.startswith("bound")}
        rows.append(res)
    text = json.dumps(rows, indent=2)
    out_path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "runtime_vs_peer",
                                        time.strftime("%Y-%m-%d-%H%M-") + "-".join(args.models) + ".json")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        f.write(text + "\n")
    print(text)
    print(f"wrote {out_path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
