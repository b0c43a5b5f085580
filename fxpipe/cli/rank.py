"""One rank of ``fxpipe run``: load the plan, build its F/B/W graphs, train on its data, write results.

``--device cuda`` trains on cuda:(LOCAL_RANK mod the GPUs torch sees): over NCCL where each rank of the node has a
GPU of its own (``process_group_backend``), else over gloo, several ranks sharing a GPU (every message staged
through pinned host memory). The plan, loaded on the CPU, is moved there first (``Pipeline.to_device``:
parameters, constants and the graphs' device literals). ``--cuda-graphs auto|on|off`` is
``PipelineRuntime(cuda_graphs=None|True|False)`` (auto: on a CUDA rank running a synchronous schedule's eager graphs).

Run as ``python -m fxpipe.cli.rank RUN_JSON --out DIR`` under torchrun (``fxpipe.cli.ranks``; RUN_JSON is the run's
:class:`~fxpipe.cli.run_config.RunConfig`); reads RANK/WORLD_SIZE/MASTER_* from the environment. It lives in
``cli/``, not ``runtime/``, because it rebuilds the built-in model the plan was compiled from (its loss and data),
and the runtime does not import the zoo; ``--loss`` / ``--data FILE.py:FUNCTION`` replace them
(``fxpipe.cli.feed``: this rank reads only what its stages consume, its replica's rows).

Writes ``OUT/rank{R}.json`` (losses, step times, peak RSS, the last step's measured actions) or, on
failure, ``OUT/rank{R}.error`` with one line saying why, then exits non-zero; each node's first rank
(LOCAL_RANK 0) appends a line ``step K loss L ms T`` to ``OUT/progress`` after each step. ``OUT`` is
a directory of this node: rank 0 gathers every rank's result (and, for real data, every stage's final
weights) over the process group into its own ``OUT/results.json`` (and ``OUT/params.pt``), so the
node that holds rank 0 has the whole run.

With more ranks than the schedule's (``WORLD_SIZE`` = pipeline ranks x dp), the runtime runs dp
replicas of the pipeline; the global batch is dp x microbatches x one compiled microbatch's rows, and
replica d reads only its d-th slice (the inputs on the first stage's rank, the target on the last's).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import resource
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run", help="the run's configuration, written by fxpipe run (fxpipe.cli.config.write_json)")
    parser.add_argument("--out", required=True, help="the run's report directory")
    given = parser.parse_args(argv)
    args = rank_args(Path(given.run), given.out)
    rank = int(os.environ.get("RANK", "0"))
    out = Path(args.out)
    try:  # which process runs this rank, for fxpipe run (fxpipe.cli.ranks.rank_pids)
        (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    except OSError:
        pass
    watch_launcher()
    from fxpipe.cli.ranks import Heartbeat, record_warnings

    args.heartbeat = Heartbeat(out, rank)  # the launcher stops the run when no rank moves on for --timeout

    record_warnings(out, rank)
    import torch.distributed as dist

    try:
        from fxpipe.cli.ranks import keep_earlier_error

        keep_earlier_error(out, rank)  # a restarted attempt: the last one's report is not this one's
        args.host = args.config.host_tuning()
        # before the process group, so that gloo's threads start on this rank's CPUs too
        cpus = args.host.pin(int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        backend = process_group_backend(args.device, _gpus(args.device), local_world)
        if backend == "nccl":  # this rank's own GPU, before NCCL starts on it; CPU tensors (results, losses) take gloo
            import torch

            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        args.heartbeat.phase("joining the process group")
        try:
            dist.init_process_group("cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo",
                                    timeout=timedelta(seconds=args.timeout))
        except Exception as exc:  # across machines: a port the firewall blocks, or a host name that resolves locally
            from fxpipe.errors import RankFailedError

            raise RankFailedError(f"rank {rank} could not join the process group within {args.timeout:g} s "
                                  f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); every rank "
                                  "must reach MASTER_ADDR:MASTER_PORT and every other node's ranks (gloo connects "
                                  "each pair; GLOO_SOCKET_IFNAME picks the network interface)") from exc
        check_same_run(args, rank)
        result, params = _run(args, rank, dist.get_world_size())
        result["cpus"] = list(cpus)  # the CPUs this rank ran on (none: wherever the system put it)
        result["backend"] = backend  # what carried the pipeline's messages
        _gather(out, rank, dist.get_world_size(), result, params, args.timeout)
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()  # every rank is done talking before any tears its connections down
        return 0
    except BaseException as exc:  # every failure becomes one line the launcher can report
        (out / f"rank{rank}.error").write_text(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        traceback.print_exc()
        return 1
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001  (the results are written; a peer closing first must not fail this rank)
                traceback.print_exc()


def rank_args(run_file: Path, out: str) -> argparse.Namespace:
    """This rank's view of the run: every option of the launcher's :class:`~fxpipe.cli.run_config.RunConfig` (read
    back and checked again) by name, what the launcher resolved in their place (the trusted libraries as a list, a
    user model's synthetic batch) and the report directory; ``config`` is the config itself."""
    from fxpipe.cli.config import read_json
    from fxpipe.cli.run_config import RunConfig

    config, extra = read_json(RunConfig, run_file)
    return argparse.Namespace(**{**config.flat(), **extra}, config=config, out=out, plan=str(config.plan_dir))


def watch_launcher(every: float = 0.5) -> None:
    """Leave (SIGKILL, at once) when ``fxpipe run`` or torchrun is gone: killed outright, neither can stop this
    rank, which would otherwise train on alone. A daemon thread compares the parent pid and the launcher's start
    time (``FXPIPE_LAUNCHER_PID``, set by ``fxpipe.cli.ranks``) every ``every`` seconds."""
    import signal
    import threading

    from fxpipe.cli.ranks import LAUNCHER_PID

    parent = os.getppid()
    launcher = int(os.environ.get(LAUNCHER_PID, "0") or 0)
    started = _start_time(launcher) if launcher else None

    def watch() -> None:
        while True:
            time.sleep(every)
            if os.getppid() != parent or (launcher and _start_time(launcher) != started):
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="fxpipe-watch-launcher", daemon=True).start()


def _start_time(pid: int) -> str | None:
    """A process's start time from ``/proc`` (a pid can be reused), or None when it is gone or unreadable."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else fields[19]


# What every rank must run alike beside the plan: the options that shape its program (steps, schedule, microbatches,
# where it resumes) or its arithmetic. A node's paths (--out, --data, --checkpoint-dir, --log-dir), CPUs and timeout
# may differ.
SHARED_OPTIONS = ("steps", "schedule", "microbatches", "resume", "checkpoint_every", "seed", "lr", "momentum",
                  "optimizer", "weight_decay", "betas", "lr_schedule", "warmup_steps", "clip_grad_norm", "precision",
                  "weights", "codegen", "recompute", "w_lane")


def run_identity(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(what, value) pairs every rank must share: the plan's manifest (``plan.json`` names every file's sha256, so its
    bytes stand for the whole plan) and :data:`SHARED_OPTIONS`."""
    manifest = Path(args.plan) / "plan.json"
    plan = hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else "(no plan.json)"
    return [("plan", plan)] + [(f"--{name.replace('_', '-')}", repr(getattr(args, name))) for name in SHARED_OPTIONS]


def check_same_run(args: argparse.Namespace, rank: int) -> None:
    """Refuse, on every rank, a run whose ranks loaded different plans or were started with different options (nodes
    started apart, one with a stale plan or another --microbatches): they would post different messages and wait
    on each other until the timeout, or train apart. Collective: one all-gather of a digest per entry."""
    from fxpipe.errors import OptionError, PlanFileError
    from fxpipe.runtime.same import differing_rank

    found = differing_rank(run_identity(args))
    if found is None:
        return
    q, what, value = found
    if what == "plan":
        raise PlanFileError(f"rank {q} loaded another plan than rank {rank} (whose {Path(args.plan) / 'plan.json'} "
                            f"has sha256 {value[:16]}...); every rank must load the same plan: copy the directory "
                            "fxpipe compile wrote to every node")
    raise OptionError(f"rank {q} was started with another {what} than rank {rank} ({value}); start fxpipe run on "
                      "every node with the same options")


def out_progress(args: argparse.Namespace) -> Path:
    return Path(args.out) / "progress"


def _gather(out: Path, rank: int, world: int, result: dict[str, object], params: dict[str, Any] | None,
            timeout: float) -> None:
    """Every rank's result (and final weights, when it holds replica 0 of its stages) to rank 0, which writes
    them on its node: ``results.json`` in rank order, and ``params.pt`` (one tensor per name)."""
    import torch
    import torch.distributed as dist

    from fxpipe.cli.ranks import PARAMS, RESULTS
    from fxpipe.errors import RankFailedError

    gathered: list[Any] | None = [None] * world if rank == 0 else None
    try:
        dist.gather_object((result, params), gathered, dst=0)
    except Exception as exc:
        why = str(exc).splitlines()[0] if str(exc) else exc
        raise RankFailedError(f"a rank stopped responding while rank {rank} waited for the results to be gathered on "
                              f"rank 0 (timeout {timeout:g} s): {why}") from exc
    if gathered is None:
        return
    merged: dict[str, Any] = {}
    for _, part in gathered:
        merged.update(part or {})
    if merged:
        torch.save(merged, out / PARAMS)
    (out / RESULTS).write_text(json.dumps([r for r, _ in gathered]))


def stream_step_ms(events: Sequence[tuple[Any, float, float]], offset: float, elapsed: float, steps: int,
                   m: int) -> list[float]:
    """Per step of an asynchronous chunk on this rank, ms: from the end of the previous step's last action here (the
    chunk's start for the first step, which so carries the lowering and the first touches of every buffer) to the
    end of its own; the last step runs to the chunk's end (the drain's last messages, the losses' gather).
    ``events``: the stream's (action, start, end), seconds from ``offset`` after the chunk's start; microbatch
    ``mb`` belongs to step ``mb // m``.

    >>> from types import SimpleNamespace as A
    >>> [round(ms, 6) for ms in stream_step_ms([(A(mb=0), 0.0, 0.1), (A(mb=1), 0.1, 0.2), (A(mb=2), 0.2, 0.25),
    ...                                          (A(mb=3), 0.25, 0.3)], 0.5, 0.9, 2, 2)]
    [700.0, 200.0]
    """
    ends = [0.0] * steps
    for action, _, end in events:
        k = action.mb // m
        if k < steps:
            ends[k] = max(ends[k], offset + end)
    marks, last = [], 0.0
    for end in ends[:-1]:
        last = max(last, end)
        marks.append(last)
    marks.append(max(elapsed, last))
    return [(b - a) * 1e3 for a, b in zip([0.0, *marks[:-1]], marks)]


def _die_after_first_compute(graphs: list[Any]) -> None:
    """``--kill-rank``: this process SIGKILLs itself right after its next F, B or W graph call: mid-step,
    with the value it just made not yet sent, leaving no error file and no traceback."""
    import os
    import signal

    def die(*_: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    for g in graphs:
        for gm in (g.forward, g.backward_input, g.backward_weight):
            if gm is not None:
                gm.register_forward_hook(die)


def _run(args: argparse.Namespace, rank: int, world: int) -> tuple[dict[str, object], dict[str, Any] | None]:
    import torch

    import fxpipe
    from fxpipe.cli.feed import loss_of, trusted_ops
    from fxpipe.errors import PlanFileError
    from fxpipe.runtime.executor import PipelineRuntime

    device = rank_device(args.device)
    # --loss's file imported first (once): a model library it imports (transformers) types the plan's outputs
    args.heartbeat.phase("importing --loss's file")
    user_loss = loss_of(None, args.loss) if args.loss is not None else None
    args.heartbeat.phase("loading the plan")
    pipe = fxpipe.load(args.plan, trust_ops=trusted_ops(args.trust_ops))  # on the CPU; moved to its device below
    zoo = zoo_of(pipe.plan)  # built as fxpipe compile built it (dtype, batch, seed); None: the user's own model
    if zoo is None and pipe.plan.strategy is not None:  # fxpipe run refuses it before starting the ranks
        raise PlanFileError(f"a per-layer strategy plan trains a built-in model (this plan is of "
                            f"{pipe.plan.provenance.model!r}); compile it without --strategy")
    loss_fn = user_loss if user_loss is not None else loss_of(zoo, None)  # fxpipe run checked that there is one
    if pipe.plan.strategy is not None:  # a per-layer strategy: DTensor on the plan's ranks, not a pipeline
        from fxpipe.cli.rank_strategy import run_strategy
        from fxpipe.errors import OptionError

        if device.type != "cpu":  # fxpipe run refuses it before starting the ranks
            raise OptionError(f"--device {args.device} runs pipeline plans; a per-layer strategy trains on the CPU: "
                              "use --device cpu")
        return run_strategy(args, rank, world, pipe, zoo, loss_fn, out_progress(args))
    pipe.to_device(device)  # parameters, constants and the graphs' device=cpu literals, before F/B/W are built
    args.heartbeat.phase("building the stages' forward and backward graphs")
    rt = PipelineRuntime(pipe, args.schedule, loss_fn, options=args.config.runtime_options(),
                         example_inputs=None if zoo is None else tuple(x.to(device) if isinstance(x, torch.Tensor)
                                                                       else x for x in zoo.example_inputs),
                         device=device, host=args.host)
    # The bytes each stage keeps between actions, counted in the first step (left out of the median step
    # time: counting costs a few percent of a small stage's step); every step holds the same.
    rt.track_memory = True
    trained = _train(args, rt, pipe, zoo, rank, world)
    return _measure(args, rt, pipe, trained, rank, world)


@dataclasses.dataclass
class _Trained:
    """What the training loop leaves for the report: per step its loss, time, learning rate and gradient norm."""

    costs: Any
    overheads: Any
    first: int
    losses: list[float]
    step_ms: list[float]
    lrs: list[float | None]
    grad_norms: list[float | None]
    timed_steps: list[tuple[Any, Any]]
    eval_losses: list[tuple[int, float]]
    attempt: int


def _resume(args: argparse.Namespace, rt: Any, world: int) -> int:
    """The step this run starts from: the newest checkpoint's under --resume (its data seed must be this run's),
    else 0."""
    from fxpipe.cli.rank_common import resumes
    from fxpipe.errors import CheckpointError
    from fxpipe.runtime import checkpoint

    rt.data_position = {"data_seed": float(args.seed)}  # batch k and its random ops are functions of (seed, k)
    # the launcher has said which newer steps are passed over (fxpipe.cli.run_cmd): no warning here again
    args.heartbeat.phase("loading the checkpoint")
    first = checkpoint.load(rt, args.checkpoint_dir) if resumes(args, world) else 0
    saved_seed = rt.resumed_position.get("data_seed")
    if first and saved_seed is not None and saved_seed != float(args.seed):
        raise CheckpointError(f"the checkpoint of step {first} was trained with --seed {int(saved_seed)}, and this "
                              f"run has --seed {args.seed}: its batches from step {first + 1} on would not be the "
                              f"ones that run goes on with; pass --seed {int(saved_seed)}, or start a new run")
    if first >= args.steps:  # fxpipe run says so before starting the ranks; a checkpoint written since is caught here
        raise CheckpointError(f"the checkpoint in {args.checkpoint_dir} is of step {first}, and --steps {args.steps} "
                              f"asks for no more; pass --steps {first + 1} or more to train further")
    return first


def _train(args: argparse.Namespace, rt: Any, pipe: Any, zoo: Any, rank: int, world: int) -> _Trained:
    """Resume (--resume), then train from the first step to --steps: each step's batch, its loss reported as it
    arrives, a checkpoint every --checkpoint-every steps."""
    import torch

    from fxpipe.calibration.compute import plan_overheads
    from fxpipe.cli.feed import eval_batches, input_specs, rank_batches
    from fxpipe.cli.rank_common import check_finite_loss, check_finite_weights, synthetic_batch
    from fxpipe.schedules.simulate import Costs

    device = rt.device
    sched, m = rt.schedule, rt.schedule.num_microbatches
    overheads = plan_overheads(pipe.plan)
    costs = Costs.from_plan(pipe.plan)
    if rt.recompute:  # B runs F first, and F keeps only the stage's inputs (before the loss's time joins the last F)
        costs = dataclasses.replace(costs, held_in=costs.held_in or rt.held_in).recomputing(rt.recompute)
    costs = dataclasses.replace(costs.with_runtime(overheads), dp=rt.dp, w_lane=rt.w_lane is not None)
    reports = int(os.environ.get("LOCAL_RANK", rank)) == 0  # each node's first rank feeds its progress bar
    first = _resume(args, rt, world)
    from fxpipe.cli.run_log import StepLog, token_ids

    spec = pipe.plan.inputs[0] if pipe.plan.inputs else None
    samples = (int(spec.shape[0]) if spec is not None and spec.shape else 0) * m * rt.dp
    log = StepLog(Path(args.log_dir) if args.log_dir else None, rank=rank, world=world, device=device, samples=samples,
                  tokens=samples * int(spec.shape[1]) if spec is not None and token_ids(spec) else None, first=first)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)  # faults fire in the first attempt only
    fault_at = first + args.fault_step if sched.synchronous else first
    losses, step_ms = [], []
    lrs: list[float | None] = []  # per step: the learning rate it used, and the global gradient norm (clipping, fp16)
    grad_norms: list[float | None] = []
    timed_steps: list[tuple[Any, Any]] = []  # (events, optimizer steps) of each step after the first
    in_flight: list[tuple[int, Any, float, tuple[Any, ...]]] = []  # synchronous steps whose loss is still in flight
    # Synchronous schedules run one step at a time. An asynchronous one streams a chunk of steps through
    # one schedule (all of them, or --checkpoint-every with --checkpoint-dir): its pipeline drains only at
    # a chunk's end, where it checkpoints, and a resumed run restarts the pipeline at the same place. Both
    # checkpoint every --checkpoint-every steps and after the last.
    every = 1 if sched.synchronous else (args.checkpoint_every if args.checkpoint_dir else args.steps - first)
    # This replica's rows of each step's batch, and of them only what this rank's stages consume (fxpipe.cli.feed).
    rows = int(pipe.plan.inputs[0].shape[0]) if pipe.plan.inputs and pipe.plan.inputs[0].shape else 1
    from fxpipe.data import DataContext, step_loader, step_seed

    args.heartbeat.phase("opening the data")
    ctx = DataContext(rank, rt.needs_inputs, rt.needs_targets, rt.dp_rank, rt.dp, m, rows, args.seed, first,
                      args.steps, input_specs(pipe.plan, m))
    batch_of = rank_batches(args.data, pipe.plan, ctx, None if zoo is None else lambda n: synthetic_batch(zoo, n),
                            args.synthetic, timeout=args.timeout)
    stream = step_loader(batch_of, first=first, steps=args.steps, workers=args.data_workers,
                         pin_memory=device.type == "cuda")
    at = [first]

    def next_batch(k: int) -> tuple[Any, Any]:  # the loader's next item, which is step k's
        assert k == at[0], (k, at[0])  # the loop below asks for steps in order
        at[0] += 1
        return next(stream)

    held_out = eval_batches(args.eval_data or args.data, pipe.plan, ctx, args.eval_batches) if args.eval_every else None
    eval_losses: list[tuple[int, float]] = []
    args.heartbeat.watch(lambda: (id(rt.events), len(rt.events)))  # each finished action moves it on
    for start in range(first, args.steps, every):
        chunk = range(start, min(start + every, args.steps))
        args.heartbeat.phase(f"step {start + 1}" if len(chunk) == 1 else f"steps {start + 1} to {chunk[-1] + 1}")
        if rank == args.fail_rank and start == fault_at and attempt == 0:
            raise RuntimeError(f"injected failure on rank {rank} at step {start}")
        if rank == args.kill_rank and start == fault_at and attempt == 0:
            _die_after_first_compute(rt.graphs)
        torch.manual_seed(step_seed(args.seed, start, rank))  # the step's random ops (dropout): --seed's, resumable
        t0 = time.perf_counter()
        if sched.synchronous:  # no barrier at the step's end: the loss's all-reduce is read when it has arrived
            inputs, target = next_batch(start)
            pending = rt.step_async(inputs, target, shard=True)
            lrs.append(rt.lr)
            grad_norms.append(rt.last_grad_norm)
            rt.track_memory = False
            step_ms.append((time.perf_counter() - t0) * 1e3)
            if start > first:  # its actions' times (summed after the run), every step after the first (which faults
                timed_steps.append((rt.events, rt.optimizer_steps))  # its buffers in); each step makes new lists
            evaluated = None
            if held_out is not None and (start + 1) % args.eval_every == 0:  # after the step, with its weights
                evaluated = rt.evaluate(held_out, shard=True)
                eval_losses.append((start + 1, evaluated))
            in_flight.append((start, pending, step_ms[-1], (rt.lr, rt.last_grad_norm, log.share(step_ms[-1]),
                                                            evaluated, rt.last_step_skipped)))
            losses += _arrived(in_flight, args, reports, last=False, log=log)
        else:
            done = [float(x) for x in rt.train([next_batch(k) for k in chunk])]
            for k, loss in zip(chunk, done):
                check_finite_loss(loss, None, k + 1)
            times = stream_step_ms(rt.events, rt.started - t0, time.perf_counter() - t0, len(done), m)
            losses += done
            step_ms += times
            if reports:  # the CLI's progress bar follows this file (the loss is the same on every rank)
                with open(out_progress(args), "a") as f:
                    f.write(f"step {chunk[-1] + 1} loss {losses[-1]:.6f} ms {sum(times) / len(times):.1f}\n")
            for k, loss, ms in zip(chunk, done, times):
                log.write(k + 1, loss, rt.lr, rt.last_grad_norm, log.share(ms))
        if args.checkpoint_dir and (not sched.synchronous or (chunk[-1] + 1) % args.checkpoint_every == 0
                                    or chunk[-1] + 1 == args.steps):
            # Only finite training is saved: every step's loss so far has arrived and is finite, and so is every
            # weight (an update can overflow with a finite loss); else the run stops here, before the save.
            losses += _arrived(in_flight, args, reports, last=True, log=log)
            check_finite_weights(rt.optimizers.values(), chunk[-1] + 1, rank, world)
            rt.save_checkpoint(args.checkpoint_dir, chunk[-1] + 1, keep=args.keep_checkpoints)
    losses += _arrived(in_flight, args, reports, last=True, log=log)
    if args.checkpoint_dir:  # --async-checkpoint: the last save completes before the run ends
        args.heartbeat.phase("completing the last checkpoint")
        rt.wait_checkpoint()
    args.heartbeat.phase("measuring the run for its report")
    log.close()
    return _Trained(costs, overheads, first, losses, step_ms, lrs, grad_norms, timed_steps, eval_losses, attempt)


def _measure(args: argparse.Namespace, rt: Any, pipe: Any, trained: _Trained, rank: int,
             world: int) -> tuple[dict[str, object], dict[str, Any] | None]:
    """This rank's result: the steps' measurements, and the schedule simulated on this machine's calibration
    (collectives: every rank calls it)."""
    from fxpipe.cli.feed import scored

    sched, m = rt.schedule, rt.schedule.num_microbatches
    costs, overheads, first, losses, step_ms = (trained.costs, trained.overheads, trained.first, trained.losses,
                                                trained.step_ms)
    lrs, grad_norms, timed_steps, eval_losses, attempt = (trained.lrs, trained.grad_norms, trained.timed_steps,
                                                          trained.eval_losses, trained.attempt)
    from fxpipe.calibration.compute import calibration_enabled
    from fxpipe.calibration.runtime_costs import calibrate, calibrate_allreduce
    from fxpipe.planning.cost import held_peaks
    from fxpipe.schedules.simulate import simulate
    from fxpipe.schedules.versions import held_peaks_with_versions

    # Collectives: this machine's link and compute contention, measured now (< 2 s; one rank has no link to
    # measure), and the all-reduces below. FXPIPE_CALIBRATION=off (every rank reads the same environment) keeps the
    # plan's fixed model, as fxpipe compile does, and measures nothing.
    measure = calibration_enabled()
    cal = calibrate() if world > 1 and measure else None
    simulated = cal.apply(costs) if cal is not None else costs
    cores = os.cpu_count() or 1
    if world > cores:  # time-sharing: ranks / cores slower (the contention loop keeps rounds that ran unshared)
        simulated = dataclasses.replace(calibrate_contention_free(costs, simulated), cores=cores)
    mem_bw = memory_bandwidth(pipe.plan) if measure else None
    if mem_bw is not None:  # this machine's memory bandwidth: each stage's optimizer step, and an asynchronous
        # schedule's copies of the weights (its stash snapshots or predictions)
        optimizer = args.optimizer if args.optimizer != "sgd" else "momentum" if args.momentum else "sgd"
        simulated = simulated.with_optimizer(optimizer, mem_bw, overheads)
        if not sched.synchronous:
            simulated = simulated.with_weights(args.weights, optimizer, mem_bw)
    if sched.synchronous and sched.batch_w:  # collective: every stage's measured batched-W fraction
        simulated = dataclasses.replace(simulated, w_batched=rt.batched_w_fractions())
    if rt.dp > 1 and measure:  # collective: the replicas' all-reduce over each dp group, measured now (< 1 s)
        simulated = calibrate_allreduce(group=rt.mesh.get_group("dp")).apply(simulated)
    tied = tied_costs(pipe, rt.where)
    if tied:  # each weight tied across ranks is summed at the step's end (GPT's wte and lm_head)
        if rt.dp == 1 and measure:  # collective: the all-reduce's link, over every rank, measured now (< 1 s)
            simulated = calibrate_allreduce().apply(simulated)
        simulated = dataclasses.replace(simulated, tied=tied)
    ran = sched if sched.synchronous else rt.stream  # what the counted step (stream) ran
    if not sched.synchronous:  # plus the copies of the weights the policy keeps for microbatches in flight
        held = held_peaks_with_versions(ran, args.weights, simulated.held_fb, simulated.held_bw, simulated.grad_bytes)
    else:
        held = held_peaks(((a.stage, a.kind.value) for acts in ran.ranks for a in acts), simulated.held_fb,
                          simulated.held_bw)
    actions = (_action_table([action_seconds(*t) for t in timed_steps], sched, simulated) if sched.synchronous
               else _action_table(stream_action_seconds(rt.events, m), ran, simulated))
    params = None
    if scored(args.data) and rt.dp_rank == 0:  # the launcher scores the held-out data with every stage's weights
        params = {n: p.detach().to("cpu", copy=True)  # gathered as objects and saved: CPU tensors
                  for s in rt.mine for n, p in rt.stages[s].module.named_parameters()}
    return {
        "rank": rank, "world": world, "schedule": sched.name, "microbatches": m, "synchronous": sched.synchronous,
        "weights": args.weights, "dp": rt.dp, "pp": sched.num_ranks, "pp_rank": rt.pp_rank, "dp_rank": rt.dp_rank,
        "stages": sorted(rt.mine), "host": socket.gethostname(), "device": str(rt.device),
        "batched_w": {str(s): how for s, how in sorted(rt.batched_w.items())},  # batched-w: how each stage's W ran
        # CUDA graphs: the call slots captured, and the calls that ran eagerly after all (fxpipe.runtime.cuda_graphs)
        "graph_calls": None if rt.graph_set is None else {"captured": rt.graph_set.captured,
                                                          "fallbacks": rt.graph_set.fallbacks},
        "batch": (int(pipe.plan.inputs[0].shape[0]) if pipe.plan.inputs and pipe.plan.inputs[0].shape else 1)
        * m * rt.dp,  # the global batch's rows
        "losses": losses, "step_ms": step_ms, "first_step": first, "restarts": attempt, "lrs": lrs,
        "grad_norms": grad_norms, "eval_losses": eval_losses,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        # an asynchronous run's step: its stream's (one fill and drain for every step of it), per step
        "simulated_step_ms": simulate(ran, simulated).makespan * 1e3 * m / ran.num_microbatches,
        "runtime_costs_missing": runtime_costs_missing(pipe.plan, overheads),
        # the link and contention measured on the ranks after the steps, which the simulation above charged
        "calibration": None if cal is None else {**cal.to_json(), "summary": cal.summary()},
        "profiled": pipe.plan.provenance.profiled,
        "profile_threads": pipe.plan.provenance.profile_threads,
        "events": [[str(a), t0, t1] for a, t0, t1 in rt.events],
        "step_started": rt.started,  # the last step's start on this machine's monotonic clock (perf_counter)
        # Per stage and kind of action of this rank: seconds per microbatch, measured (the median over the steps
        # after the first) and as the run's simulation charges it
        # (an asynchronous run: its last chunk's steps after the first, each W with the update it makes, as simulated)
        "action_ms": actions,
        # the step simulated on every rank's measured action times instead of the plan's (collective): where it is
        # near the measured step and the simulation is not, the gap is the per-action costs', not the schedule's.
        # None with --w-lane (every rank alike): the times measured there already hold the lanes' sharing
        "replayed_step_ms": replayed_step_ms(ran, simulated, actions, world) * m / ran.num_microbatches
        if rt.w_lane is None else None,
        # Per stage of this rank (as "stages"): bytes kept between actions for later ones of the same
        # microbatch, at their peak in the first step (an asynchronous run: the whole stream), measured and as
        # the schedule's simulation holds them.
        "recompute": list(rt.recompute), "recompute_note": rt.recompute_note,
        "peak_held_bytes_per_stage": [rt.peak_held_bytes[s] for s in sorted(rt.mine)],
        "simulated_held_bytes_per_stage": [held[s] for s in sorted(rt.mine)],
    }, params


def tied_costs(pipe: Any, where: Sequence[int]) -> tuple[tuple[tuple[int, ...], float], ...]:
    """``Costs.tied`` for ``pipe``: each parameter its stages share (``Pipeline.shared_params``) that sits on two or
    more pipeline positions (``where``: stage -> position), with its bytes, in the order the runtime sums them."""
    out = []
    for name, holders in sorted(pipe.shared_params.items()):
        if len({where[k] for k in holders}) < 2:
            continue
        p = pipe.stage_list()[holders[0]].module.get_parameter(name)
        out.append((tuple(holders), float(p.numel() * p.element_size())))
    return tuple(out)


def action_seconds(events: Sequence[tuple[Any, float, float]],
                   optimizer_steps: Sequence[tuple[float, float]]) -> dict[tuple[int, str], float]:
    """One step's seconds per microbatch of each (stage, kind) of action: the actions' time (less any optimizer
    step run inside one: a stage steps right after its last W) over how many there were. A batched run of Ws is
    timed on its first W (the rest take none), so a W's share is the batch's time over its microbatches."""
    total: dict[tuple[int, str], float] = {}
    count: dict[tuple[int, str], int] = {}
    for action, t0, t1 in events:
        inside = sum(max(0.0, min(t1, b) - max(t0, a)) for a, b in optimizer_steps)
        key = (action.stage, action.kind.value)
        total[key] = total.get(key, 0.0) + (t1 - t0 - inside)
        count[key] = count.get(key, 0) + 1
    return {key: total[key] / count[key] for key in total}


def stream_action_seconds(events: Sequence[tuple[Any, float, float]], m: int) -> list[dict[tuple[int, str], float]]:
    """An asynchronous chunk's :func:`action_seconds` per step after its first (microbatch ``mb`` is step
    ``mb // m``'s); its W and BW actions include the update each makes, as the simulation charges them."""
    steps: dict[int, list[tuple[Any, float, float]]] = {}
    for event in events:
        steps.setdefault(event[0].mb // m, []).append(event)
    return [action_seconds(steps[k], ()) for k in sorted(steps) if k > 0]


def replayed_step_ms(schedule: Any, costs: Any, actions: list[list[Any]], world: int) -> float:
    """Milliseconds of ``schedule`` simulated on the measured action times of every rank (``_action_table`` rows,
    gathered: a collective when ``world`` > 1; a stage's replicas: the slowest one's, as the run's table shows them)
    in place of ``costs``' (``schedules.simulate.replayed``)."""
    from fxpipe.schedules.simulate import replayed, simulate

    every = [actions]
    if world > 1:
        import torch.distributed as dist

        every = [[] for _ in range(world)]
        dist.all_gather_object(every, actions)
    measured = {key: ms / 1e3 for key, (ms, _) in slowest_actions(every).items()}
    return simulate(schedule, replayed(schedule, costs, measured)).makespan * 1e3


def slowest_actions(tables: Any) -> dict[tuple[int, str], tuple[float, float]]:
    """Per (stage, kind), the (measured, simulated) ms of the slowest measured row over ``tables`` (ranks'
    ``_action_table`` rows): a stage's replicas reported as their slowest, in the run's table and its replay."""
    slowest: dict[tuple[int, str], tuple[float, float]] = {}
    for table in tables:
        for stage, kind, measured, simulated in table:
            key = (int(stage), str(kind))
            if key not in slowest or measured > slowest[key][0]:
                slowest[key] = (float(measured), float(simulated))
    return slowest


def _action_table(steps: list[dict[tuple[int, str], float]], sched: Any, costs: Any) -> list[list[Any]]:
    """[stage, kind, measured ms, simulated ms] per (stage, kind) this rank ran: the median over ``steps``, and
    what simulating ``sched`` on ``costs`` charges one such action (``schedules.simulate.charged``)."""
    from fxpipe.schedules.ir import Action, Kind
    from fxpipe.schedules.simulate import charged

    timed = charged(sched, costs)
    return [[stage, kind, statistics.median(step[(stage, kind)] for step in steps if (stage, kind) in step) * 1e3,
             timed.time(Action(stage, Kind(kind), 0)) * 1e3]
            for stage, kind in sorted({k for step in steps for k in step})]


def process_group_backend(device: str, gpus: int, local_world: int) -> str:
    """``nccl`` where every rank of this node has a GPU of its own (``--device cuda``, ``gpus`` >= the node's ranks):
    messages go GPU to GPU, one tag per pair (the runtime's tag-blind order). Else ``gloo``: on the CPU, or ranks
    sharing a GPU (NCCL refuses two ranks on one device), each message staged through pinned host memory."""
    return "nccl" if device == "cuda" and local_world >= 1 and gpus >= local_world else "gloo"


def _gpus(device: str) -> int:
    """The GPUs torch sees here (0 without ``--device cuda``: torch.cuda is not touched)."""
    if device != "cuda":
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_device(name: str) -> Any:
    """``--device``: the CPU, or this rank's GPU, cuda:(LOCAL_RANK mod the GPUs torch sees), made the current one.
    Several ranks may share a GPU: gloo stages every message through host memory."""
    import torch

    from fxpipe.errors import OptionError

    if name == "cpu":
        return torch.device("cpu")
    if name != "cuda":
        raise OptionError(f"--device {name!r} is not a device fxpipe run trains on; use cpu or cuda")
    if not torch.cuda.is_available():  # fxpipe run checks it on its own machine; a rank may be on another node
        raise OptionError(f"this machine ({socket.gethostname()}) has no CUDA device torch can use (torch "
                          f"{torch.__version__}); use --device cpu")
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def memory_bandwidth(plan: Any) -> float | None:
    """Bytes/s the run charges its optimizer steps and weight copies at: an estimated plan's calibrated rates, a
    profiled plan's own reading (taken beside its layer times), else this machine's cached calibration at the ranks'
    threads; None when none of them is there (the simulation then leaves them out)."""
    import torch

    from fxpipe.calibration.compute import cached_rates

    if plan.options.compute is not None:
        return plan.options.compute.mem_bw
    if plan.provenance.profile_mem_bw is not None:
        return plan.provenance.profile_mem_bw
    cached = cached_rates(torch.get_num_threads())
    return None if cached is None else cached.mem_bw


def calibrate_contention_free(costs: Any, calibrated: Any) -> Any:
    """``calibrated`` (``Calibration.apply``'d) with the plan's own F, B and W times back: ``Costs.cores`` scales
    them instead of the contention factor."""
    return dataclasses.replace(calibrated, f=costs.f, b=costs.b, w=costs.w)


def _arrived(in_flight: list[tuple[int, Any, float, tuple[Any, ...]]], args: argparse.Namespace, reports: bool, *,
             last: bool, log: Any = None) -> list[float]:
    """The losses of the oldest steps whose all-reduce has arrived (all of them with ``last``), in order, each
    written to the progress file and ``log`` (``run_log.StepLog``); they leave ``in_flight`` (entries: step,
    pending loss, step ms, and the step's learning rate, gradient norm and shared numbers for the log)."""
    from fxpipe.cli.rank_common import check_finite_loss

    out = []
    while in_flight and (last or in_flight[0][1].done()):
        step, pending, ms, extra = in_flight.pop(0)
        out.append(float(pending.wait()))
        if not extra[-1]:  # --skip-nonfinite skipped this step's update: it goes on, said in metrics.jsonl
            check_finite_loss(out[-1], extra[1], step + 1)
        if log is not None:
            log.write(step + 1, out[-1], *extra)
        if reports:  # the CLI's progress bar follows this file (the loss is the same on every rank)
            with open(out_progress(args), "a") as f:
                f.write(f"step {step + 1} loss {out[-1]:.6f} ms {ms:.1f}\n")
    return out



def runtime_costs_missing(plan: Any, overheads: Any) -> bool:
    """Whether the simulation of ``plan`` left out the runtime's fixed costs although it should hold them: the plan
    was estimated with calibrated rates and calibration is on, but this machine's cache has no runtime costs for
    that calibration (``plan_overheads`` gave None: another machine, thread count or calibration version).
    ``fxpipe run`` says so, rather than report a step simulated without them as if it were whole."""
    from fxpipe.calibration.compute import calibration_enabled

    return overheads is None and getattr(plan.options, "compute", None) is not None and calibration_enabled()


def zoo_of(plan: Any, device: str = "cpu") -> Any:
    """The built-in model a plan (``fxpipe.plan.Plan``) was compiled from (built as ``fxpipe compile`` built it,
    on ``device``), or None."""
    import torch

    from fxpipe import models
    from fxpipe.errors import FxpipeError

    name, build = plan.provenance.model, plan.provenance.build
    if name is None or build is None:
        return None
    try:
        return models.build(name, dtype=getattr(torch, build.dtype), batch_size=build.batch_size, seed=build.seed,
                            device=device)
    except FxpipeError:  # not a zoo name: the user's own model
        return None


if __name__ == "__main__":
    code = main()
    # Every result is written and every file closed: leave without the interpreter's teardown of torch and Dynamo
    # (about 1 s per rank here, which torchrun and fxpipe run would wait for).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
