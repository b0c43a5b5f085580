"""``fxpipe run`` of a plan with a per-layer strategy (``fxpipe compile --stages P --dp D --strategy ...``).

Called by ``fxpipe.cli.rank`` on every rank. The plan records each fx node's configuration by name;
nothing from the plan directory is executed: the rank rebuilds the built-in model the plan was
compiled from (fxpipe's own code, as the pipeline path does), traces it again with
``strategy_graph`` (the same one-layer-per-fx-node graph the search saw), and gives each node its
recorded configuration. A node the trace has and the record lacks (or the other way round) is a
plan of another model or version: one ``PlanFileError``. It then trains ``StrategyRuntime`` (DTensor
on each stage's D ranks, P x D in all) on the global batch, the compiled example's rows, each layer
taking its share, under the plan's schedule or ``--schedule`` (any synchronous one) with the
record's microbatches or ``--microbatches``. Stages must cut the trace where one tensor crosses,
exactly at the recorded nodes (else ``PlanFileError``).
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import time
from pathlib import Path
from typing import Any


def run_strategy(args: argparse.Namespace, rank: int, world: int, pipe: Any, zoo: Any, loss_fn: Any,
                 progress: Path) -> tuple[dict[str, object], dict[str, Any] | None]:
    """Train the plan's strategy for ``args.steps`` steps, rank 0 appending each step's line to ``progress``; the
    rank's result (the keys ``fxpipe run`` reads). Every rank reads the whole global batch (each layer takes its
    share) through the pipelines' feed (``fxpipe.cli.feed``: ``--data``, ``--loss``) and keeps its state in their
    checkpoint format (``fxpipe.runtime.strategy.StrategyState``)."""
    from datetime import timedelta

    import torch

    from fxpipe.cli.feed import input_specs, rank_batches
    from fxpipe.cli.rank_common import check_finite_loss, check_finite_weights, resumes, synthetic_batch
    from fxpipe.data import DataContext, step_loader, step_seed
    from fxpipe.errors import CheckpointError, OptionError, PlanFileError
    from fxpipe.passes.strategy_graph import strategy_graph
    from fxpipe.planning.strategies import Degrees
    from fxpipe.runtime import checkpoint
    from fxpipe.runtime.optim import LRSchedule, OptimizerSpec, clip_coefficient, parse_betas
    from fxpipe.runtime.strategy import StrategyRuntime, StrategyState

    record = pipe.plan.strategy
    pp = max(1, len(record.stages))
    if world != record.world:
        raise OptionError(f"the plan's strategy runs on {record.world} ranks" + (
            f" ({pp} stages x {record.ranks})" if pp > 1 else "") + f", and this run has {world}; run it with "
            + (f"--dp {record.ranks}" if pp == 1 else f"no --dp or --nproc (it starts {record.world})"))
    sched = strategy_schedule(pipe.plan, args.schedule, args.microbatches)
    rows = int(pipe.plan.inputs[0].shape[0]) if pipe.plan.inputs and pipe.plan.inputs[0].shape else 1
    ctx = DataContext(rank, True, True, 0, 1, 1, rows, args.seed, 0, args.steps, input_specs(pipe.plan, 1))
    batch_of = rank_batches(args.data, pipe.plan, ctx, lambda n: synthetic_batch(zoo, n), args.synthetic,
                            timeout=args.timeout)
    inputs, target = batch_of(0)
    g = strategy_graph(zoo.model, tuple(inputs))
    configs = record.configs
    missing = [n for n in g.nodes if n not in configs]
    extra = [n for n in configs if n not in set(g.nodes)]
    if missing or extra:
        which = f"node {missing[0]!r} has no configuration" if missing else f"it names node {extra[0]!r}, not traced"
        raise PlanFileError(f"the plan's strategy does not fit this model's trace ({which}); compile the plan again "
                            "with this fxpipe")
    if pp > 1:
        _check_stages(record, g, int(inputs[0].shape[0]), sched.num_microbatches)
    rt = StrategyRuntime(g.module, g.nodes, g.specs, [Degrees.from_name(configs[n]) for n in g.nodes],
                         stages=record.cuts, schedule=sched, loss_fn=loss_fn,
                         timeout=timedelta(seconds=args.timeout), host=getattr(args, "host", None))
    # fxpipe run's optimizers (torch's default kernels: the parameters are DTensors, which the fused ones do not take)
    opt = OptimizerSpec(args.optimizer, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                        betas=parse_betas(args.betas))(list(rt.parameters()))
    lr_sched = LRSchedule(args.lr_schedule, args.warmup_steps, args.steps)(opt) \
        if args.lr_schedule != "constant" or args.warmup_steps else None
    state = StrategyState(rt, opt, lr_sched, stages=pp, schedule=f"strategy {record.name}")
    state.data_position = {"data_seed": float(args.seed)}  # type: ignore[attr-defined]  # saved with the checkpoint
    first = checkpoint.load(state, args.checkpoint_dir) if resumes(args, world) else 0
    saved_seed = getattr(state, "resumed_position", {}).get("data_seed")
    if first and saved_seed is not None and saved_seed != float(args.seed):
        raise CheckpointError(f"the checkpoint of step {first} was trained with --seed {int(saved_seed)}, and this "
                              f"run has --seed {args.seed}; pass --seed {int(saved_seed)}, or start a new run")
    norms: list[float | None] = []

    def clip() -> None:  # the whole model's gradient norm (every rank's), and the clip, before the step
        norm = rt.global_grad_norm(record.ranks)
        norms.append(norm)
        coefficient = clip_coefficient(norm, args.clip_grad_norm)
        if coefficient < 1.0:
            for p in rt.parameters():
                if p.grad is not None:
                    p.grad.mul_(coefficient)

    from fxpipe.cli.run_log import StepLog, token_ids

    samples = int(inputs[0].shape[0])
    log = StepLog(Path(args.log_dir) if getattr(args, "log_dir", None) else None, rank=rank, world=world,
                  device=torch.device("cpu"), samples=samples, tokens=samples * int(inputs[0].shape[1])
                  if pipe.plan.inputs and token_ids(pipe.plan.inputs[0]) else None, first=first)
    stream = step_loader(batch_of, first=first, steps=args.steps, workers=args.data_workers)
    losses, step_ms, lrs = [], [], []
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)  # faults fire in the first attempt only
    for step in range(first, args.steps):
        if rank == args.fail_rank and step == first + args.fault_step and attempt == 0:
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        inputs, target = next(stream)
        torch.manual_seed(step_seed(args.seed, step, rank))
        lrs.append(opt.param_groups[0]["lr"])
        t0 = time.perf_counter()
        losses.append(rt.train_step(inputs[0], target, opt,
                                    before_step=clip if args.clip_grad_norm is not None else None))
        check_finite_loss(losses[-1], norms[-1] if norms else None, step + 1)
        if lr_sched is not None:
            lr_sched.step()
        step_ms.append((time.perf_counter() - t0) * 1e3)
        if rank == 0:
            with open(progress, "a") as f:
                f.write(f"step {step + 1} loss {losses[-1]:.6f} ms {step_ms[-1]:.1f}\n")
        log.write(step + 1, losses[-1], lrs[-1], norms[-1] if norms else None, log.share(step_ms[-1]))
        if args.checkpoint_dir and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
            check_finite_weights([opt], step + 1, rank, world)
            checkpoint.save(state, args.checkpoint_dir, step + 1, keep=args.keep_checkpoints)
    log.close()
    params = None
    group_rank = rank % record.ranks  # ranks = pp x group, row-major: a stage's group is neighbouring ranks
    if args.data != "synthetic":  # the launcher scores the held-out data with the whole model
        whole = rt.full_parameters()  # a collective over the stage's group: every rank of it gathers
        if group_rank == 0:
            params = {n: p.detach().clone() for n, p in whole.items()}
    schedule = f"strategy {record.name} ({record.method})" + (f" in {pp} stages, {sched.name}" if pp > 1 else "")
    return {
        "rank": rank, "world": world, "schedule": schedule, "microbatches": rt.microbatches,
        "synchronous": True, "weights": args.weights, "dp": record.ranks, "pp": pp, "pp_rank": rt.pp_rank,
        "dp_rank": group_rank, "stages": [rt.pp_rank], "host": socket.gethostname(),
        "batch": int(inputs[0].shape[0]), "losses": losses, "step_ms": step_ms, "first_step": first,
        "restarts": attempt,
        "lrs": lrs, "grad_norms": norms if norms else [None] * len(losses),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "simulated_step_ms": record.cost * 1e3, "profiled": False, "profile_threads": None, "events": [],
    }, params


def strategy_schedule(plan: Any, schedule: str | None, microbatches: int | None) -> Any:
    """The schedule a strategy plan runs: ``schedule`` (default: the plan's recorded one, else GPipe) over
    ``microbatches`` (default: the strategy record's), one that a strategy can run (``check_schedule``)."""
    from fxpipe.runtime.strategy import check_schedule
    from fxpipe.schedules.auto import plan_schedule

    record = plan.strategy
    m = microbatches if microbatches is not None else record.microbatches
    name = schedule if schedule is not None or plan.schedule is not None else "gpipe"
    sched = plan_schedule(plan, name, m)
    check_schedule(sched, max(1, len(record.stages)))
    if len(record.stages) > 1 and plan.inputs and plan.inputs[0].shape:
        _check_split(record, int(plan.inputs[0].shape[0]), microbatches)
    return sched


def _check_stages(record: Any, g: Any, batch: int, microbatches: int | None = None) -> None:
    """A pipelined record against the trace ``g``: its stages are the trace's nodes cut where one tensor crosses,
    and ``microbatches`` (default: the record's) split the batch evenly over the ranks; else one error."""
    from fxpipe.errors import OptionError, PlanFileError
    from fxpipe.planning.strategies import stage_graph

    bounds = [0, *(g.nodes.index(c) + 1 for c in record.cuts), len(g.nodes)]
    try:
        for lo, hi in zip(bounds, bounds[1:]):
            stage_graph(g.specs, g.edges, lo, hi)
    except OptionError as exc:
        raise PlanFileError(f"the plan's strategy stages do not cut this model's trace where one tensor crosses "
                            f"({exc}); compile the plan again with this fxpipe") from None
    _check_split(record, batch, microbatches)


def _check_split(record: Any, batch: int, microbatches: int | None) -> None:
    """``microbatches`` (None: the record's) cut a ``batch``-row batch evenly over each stage's ranks (else each
    stage's messages would differ in shape between its ranks); else one error."""
    from fxpipe.errors import OptionError, PlanFileError

    if microbatches is not None and microbatches != record.microbatches:
        if batch % (microbatches * record.ranks):
            raise OptionError(f"--microbatches {microbatches} cuts the plan's {batch}-row batch over {record.ranks} "
                              f"ranks a stage unevenly; pass a count that divides {batch // record.ranks}")
    elif batch % (record.microbatches * record.ranks):
        raise PlanFileError(f"the plan's strategy cuts a {batch}-row batch into {record.microbatches} microbatches "
                            f"over {record.ranks} ranks, unevenly; compile the plan again")
