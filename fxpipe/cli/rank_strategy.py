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
import resource
import socket
import time
from pathlib import Path
from typing import Any


def run_strategy(args: argparse.Namespace, rank: int, world: int, pipe: Any, zoo: Any, batches: Any,
                 progress: Path) -> tuple[dict[str, object], dict[str, Any] | None]:
    """Train the plan's strategy for ``args.steps`` steps, rank 0 appending each step's line to ``progress``; the
    rank's result (the keys ``fxpipe run`` reads)."""
    from datetime import timedelta

    import torch

    from fxpipe.errors import OptionError, PlanFileError
    from fxpipe.passes.strategy_graph import strategy_graph
    from fxpipe.planning.strategies import Degrees
    from fxpipe.runtime.strategy import StrategyRuntime
    from fxpipe.runtime.optim import OptimizerSpec, parse_betas

    record = pipe.plan.strategy
    pp = max(1, len(record.stages))
    if world != record.world:
        raise OptionError(f"the plan's strategy runs on {record.world} ranks" + (
            f" ({pp} stages x {record.ranks})" if pp > 1 else "") + f", and this run has {world}; run it with "
            + (f"--dp {record.ranks}" if pp == 1 else f"no --dp or --nproc (it starts {record.world})"))
    if args.checkpoint_dir is not None:
        raise OptionError("--checkpoint-dir saves pipeline plans' stages; a per-layer strategy's DTensor parameters "
                          "are not checkpointed: run it without --checkpoint-dir")
    sched = strategy_schedule(pipe.plan, args.schedule, args.microbatches)
    inputs, target = batches(0)
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
                         stages=record.cuts, schedule=sched, loss_fn=zoo.loss_fn,
                         timeout=timedelta(seconds=args.timeout), host=getattr(args, "host", None))
    # fxpipe run's optimizers (torch's default kernels: the parameters are DTensors, which the fused ones do not take)
    opt = OptimizerSpec(args.optimizer, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                        betas=parse_betas(args.betas))(list(rt.parameters()))
    from fxpipe.cli.run_log import StepLog, token_ids

    samples = int(inputs[0].shape[0])
    log = StepLog(Path(args.log_dir) if getattr(args, "log_dir", None) else None, rank=rank, world=world,
                  device=torch.device("cpu"), samples=samples, tokens=samples * int(inputs[0].shape[1])
                  if pipe.plan.inputs and token_ids(pipe.plan.inputs[0]) else None, first=0)
    losses, step_ms = [], []
    for step in range(args.steps):
        if rank == args.fail_rank and step == 1:
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        inputs, target = batches(step)
        t0 = time.perf_counter()
        losses.append(rt.train_step(inputs[0], target, opt))
        step_ms.append((time.perf_counter() - t0) * 1e3)
        if rank == 0:
            with open(progress, "a") as f:
                f.write(f"step {step + 1} loss {losses[-1]:.6f} ms {step_ms[-1]:.1f}\n")
        log.write(step + 1, losses[-1], args.lr, None, log.share(step_ms[-1]))
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
        "batch": int(inputs[0].shape[0]), "losses": losses, "step_ms": step_ms, "first_step": 0,
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
