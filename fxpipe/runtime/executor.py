"""PipelineRuntime: one rank's program of a schedule, run over torch.distributed with asynchronous send/recv.

Every rank builds the same plan and schedule, lowers them to its own program
(:func:`fxpipe.runtime.lower.lower`: its compute actions, each with the messages it waits for and
the messages it sends), and runs only that. Receives are posted at the start of the step, in the
lowering's posting order (each sender's order, as NCCL needs), into buffers shaped from the stage
graphs, and waited for right before the compute that reads them;
sends go out right after the compute that makes them and are completed at the end of the step
(:class:`fxpipe.runtime.channel.Channel`, which also owns the CUDA streams). A microbatch's values
are dropped once no stage of the rank reads them again, its saved tensors once W ran. Gradients
accumulate over microbatches; gradients of parameters held by several ranks (tied weights) are
summed across those ranks; then each stage's optimizer steps. A peer that fails or dies makes the
others stop at the timeout with an error naming the peer and the message they waited for.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import math
import os
import sys
import time
import warnings
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fxpipe._compat import autocast_forward, pytree
from fxpipe._overrides import with_overrides
from fxpipe.errors import CheckpointError, OptionError, RankFailedError
from fxpipe.graphs.accumulate import accumulating_weight_graph
from fxpipe.graphs.convention import StageGraphs, flatten_inputs, split_batch
from fxpipe.pipeline import Pipeline
from fxpipe.plan import LIMITS
from fxpipe.plan_dir import load, stored_stage_graphs
from fxpipe.runtime import checkpoint, replicas
from fxpipe.runtime.batched_w import BatchedW, agree, batched_weight_graphs, measure_ratio
from fxpipe.runtime.channel import Channel
from fxpipe.runtime.core import ActionRunner, HeldBytes, grad_like
from fxpipe.runtime.faults import peer_down
from fxpipe.runtime.lane import WLane, refusal as lane_refusal
from fxpipe.runtime.lower import FORWARD, Message, lower
from fxpipe.runtime.optim import (
    LossScaler,
    LRSchedule,
    OptimizerSpec,
    autocast_loss,
    autocast_of,
    clip_grads,
    optimizer_factory,
    scheduler_factory,
    squared_norm,
)
from fxpipe.runtime.options import RuntimeOptions
from fxpipe.runtime.reference import check_async
from fxpipe.runtime.same import differing_rank, hash64
from fxpipe.schedules.auto import plan_schedule
from fxpipe.schedules.ir import Action, Kind, Schedule
from fxpipe.schedules.versions import POLICIES

logger = logging.getLogger(__name__)

if TYPE_CHECKING:  # the caller's value; the runtime calls its methods and imports nothing of the calibration
    from fxpipe.calibration.host import HostTuning


class PipelineRuntime:
    """Trains one mini-batch per :meth:`step` on this rank's stages of a plan under a schedule.

    Every rank builds the same plan and schedule and runs only its own part. After each step, :attr:`lr` is the
    learning rate it used and :attr:`last_grad_norm` the global gradient norm before clipping (None unless clipping
    or fp16 needs it); :attr:`recompute` holds the stages that recompute their forward and :attr:`recompute_note`
    why; :attr:`peak_held_bytes` the bytes kept between actions when ``track_memory`` (settable between steps).

    Args:
        plan: A compiled :class:`fxpipe.Pipeline`, or a plan directory (``fxpipe compile --out``).
        schedule: A :class:`Schedule`, a schedule name (``fxpipe simulate``'s, ``auto`` included), or None: the
            schedule recorded in the plan, else ``DEFAULTS.schedule``.
        loss_fn: ``loss_fn(outputs, target) -> loss`` on the last stage's rank. Required: the runtime imports no
            model, so it has no loss of its own.
        options: How it trains (:class:`RuntimeOptions`); None: ``RuntimeOptions()``.
        example_inputs: One microbatch's inputs, to shape the stage graphs; None: built from the plan's specs.
        device: This rank's device; None: where the plan's parameters are.
        mesh: A ``DeviceMesh`` with dimensions ``("pp", "dp")`` (pipeline positions x replicas of every stage);
            None lays out ``world // schedule ranks`` replicas itself (with replicas, :meth:`step` takes the whole
            batch).
        host: The process-wide settings this rank asks for (:class:`fxpipe.calibration.host.HostTuning`: CPU
            pinning, gloo's socket threads' priority, a yield after each send); None changes none.
        **overrides: Fields of ``options`` by name, replacing its values (the keyword arguments of before
            :class:`RuntimeOptions`).

    Raises:
        TypeError: An override that is no field of :class:`RuntimeOptions`.
        OptionError: No ``loss_fn``, an option the schedule cannot run (clipping, fp16, an lr schedule, recompute or
            compiled stages under an asynchronous schedule), or options that differ between ranks.
        RankFailedError: A peer that fails or stops answering within ``options.timeout``.
    """

    def __init__(self, plan: Any, schedule: Schedule | str | None = None,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, *,
                 options: RuntimeOptions | None = None, example_inputs: Sequence[Any] | None = None,
                 device: torch.device | str | None = None, mesh: Any = None, host: HostTuning | None = None,
                 **overrides: Any) -> None:
        o = self.options = with_overrides(RuntimeOptions() if options is None else options, overrides,
                                          "PipelineRuntime")
        microbatches, optimizer, lr_schedule, precision = o.microbatches, o.optimizer, o.lr_schedule, o.precision
        clip_grad_norm, weights, codegen, recompute, tag_blind = (o.clip_grad_norm, o.weights, o.codegen,
                                                                  o.recompute, o.tag_blind)
        if microbatches is not None:  # before the process group: a wrong count is one line, not a hang
            LIMITS.whole("microbatches", microbatches, LIMITS.microbatches, "a schedule lists every microbatch's "
                         "actions")
        _init_process_group(o.timeout)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        pipe = _resolve_plan(plan)
        schedule = _resolve_schedule(pipe, schedule, microbatches)
        if loss_fn is None:
            raise OptionError("no loss function: pass loss_fn=(outputs, target) -> loss")
        if weights not in POLICIES:
            raise OptionError(f"unknown weight policy {weights!r}; use one of {', '.join(POLICIES)}")
        self.weights = weights  # asynchronous schedules only: what each phase reads (fxpipe.runtime.weights)
        if schedule.num_stages != pipe.num_stages:
            raise OptionError(f"the schedule has {schedule.num_stages} stages and the plan {pipe.num_stages}; "
                              "make them agree")
        _check_same_program(pipe, schedule, self.rank, (
            ("weights", weights), ("precision", precision), ("codegen", codegen), ("tag_blind", repr(tag_blind)),
            ("recompute", repr(recompute if isinstance(recompute, str) else sorted(recompute))),
            ("clip_grad_norm", repr(clip_grad_norm)), ("lr", repr(o.lr)),
            ("optimizer", optimizer if isinstance(optimizer, str) or optimizer is None else "(a callable)"),
            ("lr_schedule", lr_schedule if isinstance(lr_schedule, str) or lr_schedule is None else "(an object)")))
        # Stages on rank groups: this rank's pipeline position and replica on the pp x dp mesh.
        kind = torch.device(device).type if device is not None else \
            next((p.device.type for p in pipe.parameters()), "cpu")
        self.layout = replicas.layout(mesh, schedule.num_ranks, self.rank, self.world, kind)
        self.mesh, self.dp = self.layout.mesh, self.layout.dp
        self.pp_rank, self.dp_rank = self.layout.pp_rank, self.layout.dp_rank
        if self.dp > 1 and not schedule.synchronous:
            needed = f"{schedule.num_ranks} rank{'s' if schedule.num_ranks > 1 else ''}"
            raise OptionError(f"{schedule.name} is asynchronous, and asynchronous training runs one replica per "
                              f"stage (here {self.dp}); start {needed}, or pick a synchronous schedule")
        # Mixed precision: the stage graphs traced under autocast, the loss computed under it (fxpipe.runtime.optim).
        self.precision, self.autocast = precision, autocast_of(precision, kind)
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise OptionError("clip_grad_norm is the largest global gradient norm, > 0 (clip_grad_norm: "
                              f"{clip_grad_norm})")
        if not schedule.synchronous and (clip_grad_norm is not None or precision == "fp16"
                                         or lr_schedule not in (None, "constant", LRSchedule())):
            raise OptionError(f"{schedule.name} steps each stage after every microbatch, with no step of the whole "
                              "model to clip, unscale or schedule at: use a synchronous schedule for clip_grad_norm, "
                              "fp16 or an lr schedule")
        loss_fn = autocast_loss(loss_fn, self.autocast)
        # The plan's own F/B/W where this run needs exactly them (fp32, no recompute, eager graphs, no batched W);
        # any other run traces them.
        as_compiled = (recompute == "none" or not recompute) and codegen == "eager" and not schedule.batch_w
        graphs = _stage_graphs(pipe, example_inputs, schedule.rank_of_stage, self.pp_rank, self.autocast,
                               kind=kind, from_plan=as_compiled)
        if any(g.fused for g in graphs):
            raise OptionError("every stage needs its F, B and W graphs; compile with split_backward (the default)")
        if not schedule.synchronous:
            check_async(pipe, graphs)
        self.pipe, self.schedule, self.loss_fn, self.graphs = pipe, schedule, loss_fn, list(graphs)
        self.timeout = o.timeout
        # The last collectives this runtime waited for (``_keep``).
        self.settled: deque[Any] = deque(maxlen=64)
        self.stages = pipe.stage_list()
        self.where = schedule.rank_of_stage
        self.program = replicas.on_ranks(lower(pipe, schedule, self.pp_rank, graphs), self.layout)
        self.mine = self.program.stages
        last_rank = self.where[-1]
        producer = {n: s for s, st in enumerate(self.stages) for n in st.outputs}
        for n in pipe.output_names:
            if n is not None and n in producer and self.where[producer[n]] != last_rank:
                raise OptionError(f"model output {n} is made on rank {self.where[producer[n]]}, not on the last "
                                  "stage's rank; the runtime computes the loss on the last stage")
        # What this rank's batches must hold: the model's inputs where a stage of its reads one (the first stage),
        # the targets where the loss is computed (the last stage's rank); a rank that needs neither gets None.
        self.needs_inputs = any(n in pipe.input_names for s in self.mine for n in self.stages[s].inputs)
        self.needs_targets = self.pp_rank == last_rank
        # How many of this rank's stages read each value: a microbatch's value is dropped once the last has.
        self.readers: dict[str, int] = defaultdict(int)
        for s in self.mine:
            for n in self.stages[s].inputs:
                self.readers[n] += 1
        # One optimizer per stage, over the parameters that stage is first on this rank to hold (a
        # parameter two of this rank's stages share is stepped once).
        make = _optimizer(o)
        owned: set[int] = set()
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        for s in self.mine:
            ps = [p for p in self.stages[s].module.parameters() if id(p) not in owned]
            owned.update(id(p) for p in ps)
            if ps:  # a stage with no parameters (an activation alone) has nothing to step
                self.optimizers[s] = make(ps)
        schedule_of = scheduler_factory(lr_schedule)
        self.schedulers = {s: schedule_of(opt) for s, opt in self.optimizers.items()} if schedule_of else {}
        self.clip_grad_norm = clip_grad_norm
        self.scaler = LossScaler() if precision == "fp16" else None
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False  # skip_nonfinite: the last step's update was skipped (a non-finite norm)
        self._counted: set[int] | None = None  # the parameters whose gradients this rank adds to the global norm
        self.lr: float | None = self._current_lr()
        # W's gradients in its order (a parameter may come twice), and W_acc, which adds them in place; W_acc and W_set
        # are fx graphs, or what runs them once compiled (Inductor) or captured (CUDA graphs).
        self.stage_params = {s: [self.stages[s].module.get_parameter(n) for n in graphs[s].param_names]
                             for s in self.mine}
        self.w_acc: dict[int, Callable[..., Any]] = {
            s: accumulating_weight_graph(graphs[s].backward_weight, len(graphs[s].param_names))[0] for s in self.mine}
        self.w_set: dict[int, Callable[..., Any]] = {
            s: accumulating_weight_graph(graphs[s].backward_weight, len(graphs[s].param_names), overwrite=True)[0]
            for s in self.mine}
        self._written: set[int] = set()  # parameters whose .grad this step has written
        self._buffers: dict[int, torch.Tensor] = {}  # receive buffers by tag, reused every step
        self.core = _RankRunner(self, loss_fn)
        self.recompute, self.recompute_note = self._recompute_stages(recompute)
        self.core.recomputing(s for s in self.recompute if s in self.mine)  # before the graphs are compiled
        self.held = HeldBytes([st.module for st in self.stages])
        self.track_memory = o.track_memory
        # Tied parameters held on several ranks: one group each (created by every rank, in one order).
        self.shared: list[tuple[torch.nn.Parameter, Any, list[int]]] = []
        # With replicas, one group per replica: the tied weight's holders among that replica's ranks.
        grid = self.mesh.mesh.tolist() if self.mesh is not None else [[r] for r in range(schedule.num_ranks)]
        for name, holders in sorted(pipe.shared_params.items()):
            positions = sorted({self.where[k] for k in holders})
            if len(positions) < 2:
                continue
            for d in range(self.dp):
                ranks = [int(grid[p][d]) for p in positions]
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    k = next(k for k in holders if self.where[k] == self.pp_rank)
                    self.shared.append((self.stages[k].module.get_parameter(name), group, ranks))
        if device is None:
            first = next((p for s in self.mine for p in self.stages[s].module.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.sync: replicas.GradSync | None = None
        if self.dp > 1:
            ws: defaultdict[int, int] = defaultdict(int)
            for op in self.program.ops:
                if op.action.kind in (Kind.W, Kind.BW):
                    ws[op.action.stage] += 1
            self.sync = replicas.GradSync(self.mesh.get_group("dp"), self.stage_params, ws)
            replicas.attach(self.sync)
        self.codegen = self._compile_stages(codegen)
        cuda_graphs = o.cuda_graphs
        # The default: on where it can be, a CUDA rank running a synchronous schedule's eager graphs.
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and schedule.synchronous and self.codegen == "eager"
        self.graph_set = self._graph_stages() if cuda_graphs else None
        self._early = self._early_steps()
        # Batched W (Schedule.batch_w): program index -> end of the run of one stage's adjacent W ops starting there
        self._w_runs = _w_runs(self.program.ops) if schedule.batch_w else {}
        self.batched_w: dict[int, str] = {}  # per stage of this rank: how its W runs (batched, or why not)
        self._batches: dict[tuple[int, int], BatchedW] = {}
        if self._w_runs:
            self._build_batches(example_inputs)
        self._stepped: set[int] = set()  # stages whose optimizer this step has already stepped
        self.w_lane = self._lane(o.w_lane, schedule)
        self.channel = Channel(self.device, o.timeout, yield_after_send=host is not None and host.yields_after_send(
            _mean_action(pipe.plan.stages, self.mine)), tag_blind=tag_blind)
        self.tag_blind = self.channel.tag_blind
        prefetch = o.prefetch
        if prefetch is None and self.tag_blind:
            prefetch = 0  # NCCL runs a pair's messages on one stream: a step's receives all first would block its sends
        if prefetch is not None and prefetch < 0:
            raise RankFailedError(f"prefetch is how many actions ahead receives are posted (prefetch: {prefetch}); "
                                "pass 0 or more, or None for all of a step's at its start")
        # None: every receive posted at the step's start into buffers kept across steps (fastest);
        # K: receives posted K actions ahead into new buffers (memory bounded by the window).
        self.prefetch = prefetch
        self._forward_program: Any = None  # evaluate's forward-only program, lowered on first use
        # Where the data stands, as numbers the checkpoint keeps (fxpipe run: data_seed; batch k is a function of
        # the seed and k), and what a loaded checkpoint had.
        self.data_position: dict[str, float] = {}
        self.resumed_position: dict[str, float] = {}
        # The process-wide settings the caller asked for (none by default): after every group above is made, so that
        # each group's gloo socket thread is reniced (fxpipe.calibration.host)
        self.host = host
        self.gloo_loops, self.keeps_freed_memory = host.apply(self.rank, self.world) if host is not None else (0, False)
        self.events: list[tuple[Action, float, float]] = []
        self.optimizer_steps: list[tuple[float, float]] = []
        self.started = 0.0

    def _recompute_stages(self, recompute: str | Iterable[int]) -> tuple[tuple[int, ...], str]:
        """The stages that recompute their forward (``recompute=``), and one line saying why."""
        from fxpipe.graphs.recompute import input_bytes
        from fxpipe.schedules.auto import plan_recompute

        self.held_in = tuple(float(input_bytes(g)) for g in self.graphs)  # each stage's inputs: F to B, recomputing
        if isinstance(recompute, str):
            stages, note = plan_recompute(self.pipe.plan, self.schedule, recompute, held_in=self.held_in)
        else:
            stages = tuple(sorted({int(s) for s in recompute}))
            bad = [s for s in stages if not 0 <= s < self.pipe.num_stages]
            if bad:
                raise OptionError(f"recompute names stage {bad[0]}, and the plan has {self.pipe.num_stages} stages; "
                                  f"name stages 0 .. {self.pipe.num_stages - 1}")
            note = f"recompute: stages {', '.join(map(str, stages))}" if stages else "recompute: none"
        if stages and not self.schedule.synchronous:
            raise OptionError(f"{self.schedule.name} is asynchronous: its phases read weight versions a recomputed "
                              "forward would not see; use recompute none, or a synchronous schedule")
        return stages, note

    def _compile_stages(self, codegen: str) -> str:
        """``codegen="inductor"``: this rank's F, B, W, W_acc and W_set graphs compiled (``runtime.codegen``); the
        codegen that runs (eager, with one warning, where no C++ compiler is found)."""
        from fxpipe.runtime.codegen import check_codegen, compile_stage, compiled

        fallback = check_codegen(codegen)
        if codegen == "eager":
            return codegen
        if not self.schedule.synchronous:
            raise OptionError(f"--codegen {codegen} compiles synchronous schedules' stages; {self.schedule.name} reads "
                              "weight versions through functional_call: use --codegen eager")
        if fallback is not None:  # the machine's, not the caller's doing: a note on the logger, not a warning
            logger.warning(fallback)
            return "eager"
        for s in self.mine:
            self.graphs[s] = self.core.graphs[s] = compile_stage(self.graphs[s])
            self.w_acc[s], self.w_set[s] = compiled(self.w_acc[s]), compiled(self.w_set[s])
        return codegen

    def _graph_stages(self) -> Any:
        """``cuda_graphs`` (the default on a CUDA rank): this rank's F, B, W, W_acc and W_set as CUDA graphs per
        call slot (:mod:`fxpipe.runtime.cuda_graphs`), captured in the second step and replayed after it."""
        from fxpipe.runtime.cuda_graphs import GraphSet

        if self.codegen != "eager":
            # Measured on an H100: Inductor's compiled B recompiled inside the capture (its guards saw the slot's
            # static copies) and the capture failed.
            raise OptionError(f"cuda_graphs=True replays the eager stage graphs; with codegen={self.codegen!r} "
                              "Inductor recompiles inside the capture and it fails: use one of the two")
        if self.device.type != "cuda":
            raise OptionError(f"cuda_graphs=True needs the rank on a CUDA device (device: {self.device}); "
                              "leave cuda_graphs off on the CPU")
        if not self.schedule.synchronous:
            raise OptionError(f"cuda_graphs=True replays synchronous schedules' stages; {self.schedule.name} reads "
                              "weight versions that change between calls: leave cuda_graphs off")

        def persistent() -> list[Any]:
            out: list[Any] = []
            for s in self.mine:
                module = self.stages[s].module
                out += [t for p in module.parameters() for t in (p, p.grad)]
                out += list(module.buffers())
            return out

        graphs = GraphSet(persistent)
        for s in self.mine:
            g = self.graphs[s]
            if g.fused:
                continue
            self.graphs[s] = self.core.graphs[s] = dataclasses.replace(
                g, forward=graphs.wrap(g.forward), backward_input=graphs.wrap(g.backward_input),
                backward_weight=graphs.wrap(g.backward_weight))
            self.w_acc[s], self.w_set[s] = graphs.wrap(self.w_acc[s]), graphs.wrap(self.w_set[s])
        return graphs

    @property
    def _global_norm(self) -> bool:
        """Whether each step's update waits for the global gradient norm (clipping, fp16, skip_nonfinite)."""
        return self.clip_grad_norm is not None or self.scaler is not None or self.options.skip_nonfinite

    def _early_steps(self) -> dict[int, list[int]]:
        """Program index -> the stages whose optimizer steps right after it: after the last W (or BW) of every
        stage whose W writes that optimizer's parameters. None without replicas or tied weights across
        ranks: their gradients are summed after the last W (``step`` steps those optimizers then). None either
        with clipping, fp16 or skip_nonfinite: every optimizer waits for the global gradient norm
        (``_global_update``)."""
        if self.dp > 1 or self.shared or self._global_norm:
            return {}
        ids = {s: {id(p) for p in self.stage_params[s]} for s in self.mine}
        last: dict[int, int] = {}
        for j, op in enumerate(self.program.ops):
            if op.action.kind in (Kind.W, Kind.BW):
                last[op.action.stage] = j
        out: dict[int, list[int]] = defaultdict(list)
        for s, opt in self.optimizers.items():
            mine = {id(p) for g in opt.param_groups for p in g["params"]}
            writers = [t for t in self.mine if ids[t] & mine]
            if writers and all(t in last for t in writers):
                out[max(last[t] for t in writers)].append(s)
        return dict(out)

    @property
    def track_memory(self) -> bool:
        return self.core.held is not None

    @track_memory.setter
    def track_memory(self, on: bool) -> None:
        self.core.held = self.held if on else None

    @property
    def peak_held_bytes(self) -> dict[int, int]:
        """Per stage of this rank, the peak bytes kept between actions in the last step counted (all 0 if none was)."""
        return {s: self.held.peak[s] for s in self.mine}

    # -- one step -------------------------------------------------------------------------

    def step(self, inputs: Sequence[Any] | None, target: Any, *, shard: bool = False) -> torch.Tensor:
        """One mini-batch: every microbatch's F, B and W on this rank's stages, then the optimizer step.

        With replicas (dp > 1), ``inputs`` and ``target`` are the whole batch on every rank (dp x the
        microbatch count x one compiled microbatch's rows): replica d takes the d-th of dp equal
        slices, and each stage's gradients are averaged over its replicas (summed over its dp group,
        each bucket as soon as its last W has run) before the optimizer steps. ``shard=True``: they are
        this replica's own rows only (the microbatch count x one microbatch's rows). A rank whose stages
        read no model input (``needs_inputs`` False) may pass None inputs, and one that computes no loss
        (``needs_targets`` False) a None target. Returns the mean loss over the whole batch (the same
        value on every rank). Asynchronous schedules have no step: use :meth:`train`.
        """
        return self.step_async(inputs, target, shard=shard).wait()

    def step_async(self, inputs: Sequence[Any] | None, target: Any, *, shard: bool = False) -> PendingLoss:
        """:meth:`step` without the step's barrier: each stage's optimizer steps as soon as its last W has run
        (with replicas or tied weights across ranks, once their gradients are summed), and the loss's
        all-reduce over every rank is left in flight: ``.wait()`` on the result gives the mean loss. The
        next ``step_async`` may start at once: a stage runs the next step's F only after its own update
        (its actions are in order on its rank), so the semantics stay synchronous."""
        if not self.schedule.synchronous:
            raise OptionError(f"{self.schedule.name} is asynchronous: there is no step boundary to stop at; "
                              "pass the batches to rt.train(batches), which streams them without a flush")
        m = self.schedule.num_microbatches
        micro, targets = self._microbatches(inputs, target, m, shard=shard)
        self.core.loss_divisor = m * self.dp  # the replicas' gradients are summed: each is 1/dp of the mean
        self.core.loss_scale = self.scaler.scale if self.scaler is not None else 1.0
        self._stepped = set()
        losses = self._execute(self.program, micro, targets, ahead=self.prefetch)
        sync = self.sync
        if sync is not None:
            sync.wait(lambda work: self._wait(work, sync.group, "the replicas' gradients (dp group)"))
        for p, group, ranks in self.shared:
            if p.grad is not None:
                self._collective(partial(dist.all_reduce, p.grad, group=group),
                                 f"the tied weight's gradient (ranks {ranks})")
        t0 = time.perf_counter() - self.started
        self.lr = self._current_lr()
        self.last_step_skipped = False
        if not self._global_norm:
            for s, opt in self.optimizers.items():
                if s not in self._stepped:
                    opt.step()  # no zero_grad: the next step's first W writes over the gradients (W_set)
        else:
            self._global_update()
        for scheduler in self.schedulers.values():
            scheduler.step()
        self.optimizer_steps.append((t0, time.perf_counter() - self.started))
        if self.sync is not None:
            group = self.sync.group
            replicas.average_buffers([self.stages[s].module for s in self.mine], self.dp, lambda t: self._collective(
                partial(dist.all_reduce, t, group=group), "the replicas' buffers (dp group)"))
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for loss in losses:
            if loss is not None:
                total += loss.double()
        total = total.cpu()
        return PendingLoss(self, dist.all_reduce(total, async_op=True), total, m * self.dp)

    def evaluate(self, batches: Iterable[tuple[Sequence[Any] | None, Any]], *, shard: bool = False) -> float:
        """The mean loss over ``batches`` (each a batch as :meth:`step` takes it), forward only: every microbatch's
        F in order on each rank, no gradient reaches a parameter and no optimizer steps. Every rank calls it with
        the same number of batches; replicas score their own rows and one all-reduce of the sum gives every rank
        the same value. Synchronous schedules; the graphs run as traced (a model traced in training mode keeps
        its dropout).

        Raises: OptionError for an asynchronous schedule.
        """
        if not self.schedule.synchronous:
            raise OptionError(f"{self.schedule.name} is asynchronous; evaluate with a synchronous schedule's runtime")
        m = self.schedule.num_microbatches
        if self._forward_program is None:
            order = self.schedule.rank_of_stage
            # (microbatch, stage) order: no rank waits in a cycle
            ranks = tuple(tuple(Action(s, Kind.F, i) for i in range(m) for s in range(len(order)) if order[s] == r)
                          for r in range(self.schedule.num_ranks))
            forward = Schedule("forward", self.schedule.num_stages, m, order, ranks)
            self._forward_program = replicas.on_ranks(lower(self.pipe, forward, self.pp_rank, self.graphs), self.layout)
        total = torch.zeros((), dtype=torch.float64)
        count = 0
        sync, self.sync = self.sync, None  # no gradient to average over the replicas
        try:
            for inputs, target in batches:
                micro, targets = self._microbatches(inputs, target, m, shard=shard)
                for loss in self._execute(self._forward_program, micro, targets, ahead=self.prefetch):
                    if loss is not None:
                        total += loss.detach().double().cpu()
                count += m * self.dp
        finally:
            self.sync = sync
        self._collective(partial(dist.all_reduce, total), "the evaluation loss (every rank)")
        return float(total) / max(count, 1)

    def _global_update(self) -> None:
        """The optimizer steps of a step that needs the global gradient norm (clipping, fp16, skip_nonfinite):
        unscale, one all-reduce of the squared norm over every rank, then clip and step, or (fp16 or skip_nonfinite,
        not finite) skip the step.

        Each parameter counts once: on this rank once however many of its stages hold it (its optimizers own
        each once), on the first of the pipeline ranks a tied weight is on, and on replica 0 only (after the dp
        all-reduce every replica holds the same gradients). The other ranks add 0, so the sum is the one
        process's sum of squares on every rank, and every rank decides alike."""
        params = [p for opt in self.optimizers.values() for g in opt.param_groups for p in g["params"]
                  if p.grad is not None]
        if self.scaler is not None:
            inverse = 1.0 / self.scaler.scale  # a power of two: exact
            for p in params:
                p.grad.mul_(inverse)
        if self._counted is None:
            elsewhere = {id(p) for p, _, ranks in self.shared if self.rank != min(ranks)}
            self._counted = {id(p) for opt in self.optimizers.values() for g in opt.param_groups
                             for p in g["params"] if id(p) not in elsewhere} if self.dp_rank == 0 else set()
        total = squared_norm(p.grad for p in params if id(p) in self._counted)
        self._collective(partial(dist.all_reduce, total), "the gradient norm (every rank)")
        norm = math.sqrt(float(total))
        self.last_grad_norm = norm
        finite = math.isfinite(norm)
        if self.scaler is not None:
            self.scaler.update(found_inf=not finite)
            if not finite:
                return  # fp16 overflowed somewhere: no rank steps, and the scale is halved
        if not finite and self.options.skip_nonfinite:
            self.last_step_skipped = True  # every rank read the same norm: none steps
            return
        if self.clip_grad_norm is not None and finite:
            clip_grads(params, self.clip_grad_norm, norm)
        for opt in self.optimizers.values():
            opt.step()

    def _current_lr(self) -> float | None:
        """The learning rate this rank's optimizers use now (the first group's; one schedule steps them all)."""
        opt = next(iter(self.optimizers.values()), None)
        return float(opt.param_groups[0]["lr"]) if opt is not None else None

    def train(self, batches: Sequence[tuple[Sequence[Any], Any]]) -> list[torch.Tensor]:
        """Asynchronous training over ``batches`` (each split into the schedule's microbatch count): one schedule
        for the whole stream, each stage stepping its optimizer after every microbatch's W, no flush between
        batches; each phase reads the weights of the ``weights`` policy. Returns each batch's mean loss (the same
        on every rank). A synchronous schedule trains batch by batch (:meth:`step`)."""
        from fxpipe.runtime.weights import WeightVersions

        if self.schedule.synchronous:
            return [self.step(inputs, target) for inputs, target in batches]
        m = self.schedule.num_microbatches
        micro: list[dict[str, Any]] = []
        targets: list[Any] = []
        for inputs, target in batches:
            more, more_targets = self._microbatches(inputs, target, m)
            micro += more
            targets += more_targets
        stream = _resolve_schedule(self.pipe, self.schedule.name, len(micro))
        program = replicas.on_ranks(lower(self.pipe, stream, self.pp_rank, self.graphs), self.layout)
        self.stream = stream
        core = self.core
        core.loss_divisor = 1  # each microbatch's gradient is an update of its own
        core.optimizers = self.optimizers
        core.versions = WeightVersions(stream, self.weights, {s: self.stages[s].module for s in self.mine},
                                       self.optimizers)
        try:
            losses = self._execute(program, micro, targets, ahead=self.prefetch if self.prefetch is not None else 8)
        finally:
            self.versions, core.versions = core.versions, None
        mine = torch.tensor([float(x) if x is not None else 0.0 for x in losses], dtype=torch.float64)
        self._collective(partial(dist.all_reduce, mine), "the losses (every rank)")
        return list(mine.view(len(batches), m).mean(dim=1))

    def _microbatches(self, inputs: Sequence[Any] | None, target: Any, m: int,
                      shard: bool = False) -> tuple[list[dict[str, Any]], list[Any]]:
        """One batch (``shard``: this replica's) cut into m microbatches: each one's model inputs by name, and its
        target; empty and None where the batch holds none (a rank that needs none)."""
        for given, needed, what in ((inputs, self.needs_inputs, "the model's inputs"),
                                    (target, self.needs_targets, "the target")):
            if given is None and needed:
                raise OptionError(f"rank {self.rank} runs stages {sorted(self.mine)}, which need {what}, and got "
                                  "None; pass them on the ranks where rt.needs_inputs / rt.needs_targets says so")
        n, d = (m, 0) if shard else (m * self.dp, self.dp_rank)  # replicas: this one's m of dp x m microbatches
        fix = f"pick a batch that is a multiple of {n}"
        if n != m:
            fix += f" ({self.dp} replicas x {m} microbatches)"
        targets = [None] * m if target is None else split_batch(self._here(target), n, fix=fix)[d * m:(d + 1) * m]
        if inputs is None:
            return [{} for _ in range(m)], list(targets)
        if not isinstance(inputs, (tuple, list)):
            inputs = (inputs,)
        # The batch's structure is checked once, on the whole batch: its leaves in the graph's placeholder order are
        # each cut along dim 0, so microbatch i's inputs are the i-th piece of each (splitting is leafwise). A plan
        # with no recorded structure takes its inputs as given.
        spec = None
        if self.pipe.in_spec is None:
            flat, spec = pytree.tree_flatten(tuple(inputs))
        else:
            flat = flatten_inputs(self.pipe.in_spec, tuple(inputs), {})
        parts = [split_batch(self._here(x), n, fix=fix)[d * m:(d + 1) * m] for x in flat]
        pieces = [[p[i] for p in parts] for i in range(m)]
        micro = [dict(zip(self.pipe.input_names, pytree.tree_unflatten(piece, spec) if spec is not None else piece))
                 for piece in pieces]
        self._check_shapes(micro[0], n)
        return micro, list(targets)

    def _execute(self, program: Any, micro: list[dict[str, Any]], targets: list[Any],
                 ahead: int | None) -> list[torch.Tensor | None]:
        """Run this rank's part of ``program`` over the microbatches; returns the losses this rank computed.

        Receives are posted ahead into buffers shaped from the graphs (``ahead`` None: all at once,
        into the previous step's buffers; else the next ``ahead`` actions' into new ones); each is
        waited for right before the compute that reads it, and each send goes out right after the
        compute that makes it.
        """
        core = self.core
        core.begin(micro, targets)
        if self.graph_set is not None:
            self.graph_set.new_step()
        self._left = [dict(self.readers) for _ in range(len(micro))]  # local reads still to come, per microbatch
        ops = program.ops
        reuse = ahead is None
        window = len(ops) if ahead is None else ahead + 1
        # Receives are posted in the program's posting order (each source's messages in the order it sends them,
        # which a backend without tags needs: fxpipe.runtime.lower); upto[k]: how many cover ops 0..k.
        posts, upto, read_by = program.posts, program.posted_by, program.reader
        posted: dict[int, Any] = {}  # tag -> its posted receive, until waited for
        done = 0  # posts[:done] are posted

        def post_until(j: int) -> None:
            nonlocal done
            for msg in posts[done:upto[min(j + window, len(ops)) - 1]]:
                item = self.channel.recv(msg.shape, msg.dtype, msg.src, msg.tag,
                                         self._buffers.get(msg.tag) if reuse else None,
                                         on_error=self._failed_recv(msg, read_by[msg.tag]))
                if reuse:
                    self._buffers[msg.tag] = item.buf
                posted[msg.tag] = item
                done += 1

        self._written = set()
        self.events = []  # this step's compute actions (start, end), seconds from its start
        self.optimizer_steps = []  # its optimizer steps (start, end), seconds from its start
        runs = self._w_runs if program is self.program else {}
        lane = self.w_lane
        ran_until = 0  # ops before this index already ran (the rest of a batched run of W's)
        self.started = start = time.perf_counter()
        self.waits: list[tuple[Action, float, float]] = []  # the waits for their messages before them
        if self.sync is not None:
            self.sync.begin(start)
        with torch.no_grad():  # the graphs are the backward: autograd would only record and slow them
            for j, op in enumerate(ops):
                post_until(j)
                items = [posted.pop(msg.tag) for msg in op.recvs]  # let the buffers go with their values
                waited = time.perf_counter() - start
                received = [(msg, self.channel.wait(item, self._failed_recv(msg, op.action)))
                            for msg, item in zip(op.recvs, items)]
                t0 = time.perf_counter() - start
                if op.recvs:
                    self.waits.append((op.action, waited, t0))
                self._receive(op.action, received)
                core.shares = {}
                end = runs.get(j)
                if end is not None:  # a batched run of W's: all of them now
                    core.run_weights(op.action.stage, [ops[i].action.mb for i in range(j, end)])
                    ran_until = end
                elif lane is not None and op.action.kind is Kind.W:  # on the second lane; its event when joined
                    s, mb = op.action.stage, op.action.mb
                    lane.submit(partial(self._lane_weight, s, mb, core.weight_args(s, mb), start))
                elif j >= ran_until:
                    core.run(op.action)
                for msg in op.sends:
                    value = core.values[msg.mb][msg.name] if msg.direction == FORWARD else core.shares[msg.name]
                    self.channel.send(value, msg.dst, msg.tag, on_error=self._failed_send)
                if self.sync is not None:
                    self.sync.after(op.action)
                for s in self._early.get(j, ()) if program is self.program else ():
                    if lane is not None:
                        self.events.extend(lane.join())  # its gradients, every W of them, written
                    t1 = time.perf_counter() - start
                    self.optimizers[s].step()  # its last W has run: nothing else writes these gradients
                    self.optimizer_steps.append((t1, time.perf_counter() - start))
                    self._stepped.add(s)
                self._drop_dead(op.action)
                self.channel.poll()
                if lane is None or op.action.kind is not Kind.W:
                    self.events.append((op.action, t0, time.perf_counter() - start))
            if lane is not None:
                self.events.extend(lane.join())
                self.events.sort(key=lambda e: e[1])
        self.channel.flush(self._failed_send)
        return list(core.losses)

    def _lane(self, on: bool, schedule: Schedule) -> WLane | None:
        """``w_lane``: each W on a thread of its own (:mod:`fxpipe.runtime.lane`), where its gradients are read only
        after the step's compute, by this rank alone."""
        if not on:
            return None
        why = lane_refusal(synchronous=schedule.synchronous, dp=self.dp, tied=bool(self.shared),
                           global_norm=self._global_norm,
                           device=self.device.type, batched=bool(self._w_runs))
        if why is not None:
            raise OptionError(why)
        return WLane()

    def _lane_weight(self, s: int, m: int, args: list[Any], start: float) -> tuple[Action, float, float]:
        """W of (s, m) on the second lane: grad mode is the thread's own, so off here as on the main thread."""
        t0 = time.perf_counter() - start
        with torch.no_grad():
            self.core.weight(s, m, args)
        return Action(s, Kind.W, m), t0, time.perf_counter() - start

    def _check_shapes(self, values: dict[str, Any], m: int) -> None:
        """A microbatch's inputs must have the shapes the plan's graphs were compiled for."""
        for spec in self.pipe.plan.inputs:
            got = values.get(spec.name)
            if isinstance(got, torch.Tensor) and tuple(got.shape) != tuple(spec.shape):
                rows = f"{spec.shape[0] * m} rows, " if spec.shape else ""
                raise OptionError(f"a microbatch's input {spec.name} has shape {list(got.shape)}, but the plan was "
                                  f"compiled for {list(spec.shape)}: pass {m} microbatches' worth ({rows}the compiled "
                                  "inputs stacked), or compile the plan with one microbatch's inputs")

    def _here(self, value: Any) -> Any:
        """A batch tensor on this rank's device (the stages compute where their parameters are)."""
        return value.to(self.device, non_blocking=True) if isinstance(value, torch.Tensor) else value

    def _receive(self, action: Action, received: list[tuple[Message, torch.Tensor]]) -> None:
        """Put an action's received values (F) or gradient shares (B, BW) where the core reads them."""
        values, grads = self.core.values[action.mb], self.core.grads[action.mb]
        for msg, buf in received:
            if action.kind is Kind.F:
                values[msg.name] = buf if msg.stride is None else \
                    torch.empty_strided(msg.shape, msg.stride, dtype=buf.dtype, device=buf.device).copy_(buf)
            else:
                grads[msg.name] = buf if msg.name not in grads else grads[msg.name] + buf

    def _drop_dead(self, action: Action) -> None:
        """After a forward, drop the microbatch's values no stage of this rank will read again."""
        if action.kind is not Kind.F:
            return
        st, left, values = self.stages[action.stage], self._left[action.mb], self.core.values[action.mb]
        keep = set(self.core.outputs) if self.core.losses[action.mb] is None else set()  # the loss reads them
        for name in st.inputs:
            left[name] -= 1
            if left[name] == 0 and name not in keep:
                values.pop(name, None)
        for name in st.outputs:
            if left.get(name, 0) == 0 and name not in keep:  # read only on other ranks (sent already)
                values.pop(name, None)

    def save_checkpoint(self, directory: str | os.PathLike[str], step: int, *, keep: int | None = None,
                        asynchronous: bool | None = None) -> Path:
        """Every rank: save the state after ``step`` as ``directory/step_NNNNNN`` (a DCP checkpoint, complete
        once every rank's part is in) and keep the newest ``keep`` steps (None: ``options.keep_checkpoints``, else
        ``checkpoint.DEFAULT_KEEP``); see :mod:`fxpipe.runtime.checkpoint`. ``asynchronous`` (None:
        ``options.async_checkpoint``): written by ``dcp.async_save`` while training goes on, completed by the next
        save or :meth:`wait_checkpoint`, which the caller runs before the run ends."""
        if keep is None:
            keep = self.options.keep_checkpoints if self.options.keep_checkpoints is not None else \
                checkpoint.DEFAULT_KEEP
        if asynchronous is None:
            asynchronous = self.options.async_checkpoint
        return checkpoint.save(self, directory, step, keep=keep, asynchronous=asynchronous)

    def wait_checkpoint(self) -> Path | None:
        """Every rank: complete the asynchronous save under way, if any (its path; None if none); raises the
        CheckpointError a synchronous save would have."""
        return checkpoint.wait(self)

    def stage_parts(self) -> list[tuple[torch.nn.Module, torch.optim.Optimizer | None]]:
        """This rank's stages as checkpoints read and write them: each stage's module and the optimizer of the
        parameters it is the first of this rank's stages to hold (None where it holds none of its own)."""
        return [(self.stages[s].module, self.optimizers.get(s)) for s in self.mine]

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> int:
        """Every rank: load the newest complete step of ``directory`` (saved with this plan or another plan of
        the same model) and return it. A newer step that is incomplete or corrupt is passed over with a
        warning on rank 0."""
        return checkpoint.load(self, directory, warn=lambda line: warnings.warn(line, RuntimeWarning, stacklevel=3))

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, keyed by the model's parameter names (the same under any plan of the model).

        ``params`` and ``buffers``: name -> tensor (copies); ``optim``: parameter name -> its optimizer
        state (e.g. ``{"momentum_buffer": tensor}``); ``param_groups``: each optimizer group's
        hyperparameters (plain values) with the names of its parameters; ``runtime``: the steps the lr schedule
        has taken (``lr_step``) and fp16's loss scale (numbers, the same on every rank).
        """
        names = {id(p): n for n, p in self._named(lambda mod: mod.named_parameters())}
        optim: dict[str, dict[str, Any]] = {}
        groups: list[dict[str, Any]] = []
        for opt in self.optimizers.values():
            for group in opt.param_groups:
                groups.append({"params": [names[id(p)] for p in group["params"]],
                               **{k: list(v) if isinstance(v, tuple) else v for k, v in group.items()
                                  if k != "params" and _plain(v)}})
                for p in group["params"]:
                    if opt.state.get(p):
                        optim[names[id(p)]] = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                                               for k, v in opt.state[p].items()}
        return {"rank": self.rank,
                "params": {n: p.detach().clone() for n, p in self._named(lambda mod: mod.named_parameters())},
                "buffers": {n: b.detach().clone() for n, b in self._named(lambda mod: mod.named_buffers())},
                "optim": optim, "param_groups": groups, "runtime": self.runtime_state()}

    def runtime_state(self) -> dict[str, float]:
        """The numbers a checkpoint keeps besides tensors: the steps the lr schedule has taken (``lr_step``),
        fp16's loss scale, where the data stands (the same on every rank)."""
        state: dict[str, float] = {}
        first = next(iter(self.schedulers.values()), None)
        if first is not None:
            state["lr_step"] = float(first.last_epoch)
        if self.scaler is not None:
            state.update(self.scaler.state_dict())
        state.update(self.data_position)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` of any plan of the same model: this rank takes the entries of its own
        stages (``state`` may hold more, e.g. every rank's merged)."""
        params = dict(self._named(lambda mod: mod.named_parameters()))
        buffers = dict(self._named(lambda mod: mod.named_buffers()))
        missing = sorted((set(params) - set(state["params"])) | (set(buffers) - set(state.get("buffers", {}))))
        if missing:
            raise CheckpointError(f"this state lacks {len(missing)} of rank {self.rank}'s tensors "
                                  f"({', '.join(missing[:3])}"
                                  f"{', ...' if len(missing) > 3 else ''}); load a state of the same model")
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(state["params"][n])
            for n, b in buffers.items():
                b.copy_(state["buffers"][n])
        saved_groups = {fqn: g for g in state.get("param_groups", ()) for fqn in g["params"]}
        names = {id(p): n for n, p in params.items()}
        for opt in self.optimizers.values():
            sd = opt.state_dict()
            index = 0
            for group, packed in zip(opt.param_groups, sd["param_groups"]):
                fqns = [names[id(p)] for p in group["params"]]
                for fqn in fqns:
                    if fqn in state.get("optim", {}):
                        sd["state"][index] = dict(state["optim"][fqn])
                    index += 1
                packed.update(checkpoint.saved_hyperparameters(fqns, saved_groups, packed))
            opt.load_state_dict(sd)
        self.load_runtime_state(state.get("runtime", {}))

    def load_runtime_state(self, run: dict[str, float]) -> None:
        """Load :meth:`runtime_state`'s numbers (after the optimizers' state and hyperparameters)."""
        self.resumed_position = {k: v for k, v in run.items() if k.startswith("data_")}
        if "lr_step" in run:  # the schedule goes on from the saved step (the groups' lr were loaded just above)
            for scheduler in self.schedulers.values():
                sd = scheduler.state_dict()
                groups = scheduler.optimizer.param_groups
                sd.update(last_epoch=int(run["lr_step"]), _last_lr=[g["lr"] for g in groups],
                          base_lrs=[g.get("initial_lr", g["lr"]) for g in groups])
                scheduler.load_state_dict(sd)
                if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
                    # The saved lr is the saved schedule's; this run's may be longer (a larger --steps, the way to
                    # train on): its own curve at the saved step, as an unbroken run of this length has there.
                    lrs = [base * fn(scheduler.last_epoch)
                           for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
                    for group, lr in zip(groups, lrs):
                        group["lr"] = lr
                    scheduler._last_lr = lrs  # what get_last_lr() reports
        if self.scaler is not None and "loss_scale" in run:
            self.scaler.load_state_dict(run)

    def _named(self, items: Callable[[torch.nn.Module], Any]) -> list[tuple[str, torch.Tensor]]:
        return [(n, t) for s in self.mine for n, t in items(self.stages[s].module)]

    # -- W into .grad ---------------------------------------------------------------------

    def backward_weight(self, s: int, args: list[Any], batch: BatchedW | None = None) -> None:
        """Run W on ``args`` (a list W owns: each is freed after its last use); the first microbatch's gradients
        become ``.grad``, later ones are added in place (inside the weight-gradient GEMMs, with W_acc: see
        ``fxpipe.graphs.accumulate``). ``batch``: the stage's W over several microbatches, on their combined
        arguments (``BatchedW.combine``)."""
        plain, w_acc, w_set, fresh_grads = (self.graphs[s].backward_weight, self.w_acc[s], self.w_set[s],
                                            self.core.fresh_grads(s)) if batch is None else \
            (batch.plain, batch.w_acc, batch.w_set, batch.fresh)
        tag = "" if batch is None else f"@{batch.k}"
        params = self.stage_params[s]
        ids = [id(p) for p in params]
        if params and all(p.grad is not None for p in params):
            if all(k in self._written for k in ids):  # later microbatches: add inside the GEMMs
                args.extend(p.grad for p in params)  # in place: the callers' list is the one W empties
                self._run_boxed(s, "w_acc" + tag, w_acc, args)
                return
            if not any(k in self._written for k in ids) and len(set(ids)) == len(ids):
                # a step's first: over last step's buffers
                args.extend(p.grad for p in params)
                self._run_boxed(s, "w_set" + tag, w_set, args)
                self._written.update(ids)
                return
        self._add_grads(s, self._run_boxed(s, "backward_weight" + tag, plain, args), fresh_grads)

    def _add_grads(self, s: int, result: Sequence[Any], fresh_grads: Sequence[bool]) -> None:
        """W's gradients (in ``param_names`` order) into ``.grad``: the step's first become it, later ones are added."""
        params = self.stage_params[s]
        for p, grad, fresh in zip(params, result, fresh_grads):
            if id(p) not in self._written:
                # In the parameter's layout (row-major for the zoo's): W_set and W_acc then write plain buffers (a
                # transposed view would make every GEMM into it strided), and the fused optimizer reads them right.
                p.grad = grad_like(p, grad, fresh=fresh)
                self._written.add(id(p))
            else:
                p.grad.add_(grad)

    def backward_weights(self, s: int, args: list[list[Any]]) -> None:
        """W of stage s for a batched run of microbatches (their argument lists, in order): one call over all of
        them where the stage's W batches (:mod:`fxpipe.runtime.batched_w`), else one per microbatch."""
        batch = self._batches.get((s, len(args)))
        combined = batch.combine(args) if batch is not None else None
        if batch is not None and combined is None:
            self._refuse(s, "an input its W keeps the shape of differs between microbatches (as a per-microbatch "
                            "statistic does)")
        if combined is None or batch is None:
            for a in args:
                self.backward_weight(s, a)
            return
        if not batch.checked:  # the first call: the per-microbatch W's too, and the sums compared
            batch.checked = True
            plain = self.graphs[s].split_graphs()[2]
            each = [plain(*a) for a in args]
            summed = [None if g[0] is None else sum(g[1:], g[0].clone()) for g in zip(*each)]
            if not agree(batch.plain(*combined), summed):
                self._refuse(s, f"its W over {batch.k} microbatches is not the sum of the per-microbatch W's (an op "
                                "mixes the batch's samples)")
            self._add_grads(s, summed, [True] * len(summed))
            return
        self.backward_weight(s, combined, batch)

    def _build_batches(self, example_inputs: Sequence[Any] | None) -> None:
        """This rank's stages' W over each run length the schedule batches (``_w_runs``), traced now."""
        wanted = sorted({(self.program.ops[j].action.stage, end - j) for j, end in self._w_runs.items()})
        if self.codegen != "eager" or self.graph_set is not None:
            for s in sorted({s for s, _ in wanted}):
                self._refuse(s, "batched W runs the eager graphs (not --codegen inductor or CUDA graphs)")
            self._w_runs = {}
            return
        example = [x.to(self.device) if isinstance(x, torch.Tensor) else x
                   for x in (example_inputs if example_inputs is not None else _example_inputs(self.pipe))]
        for s, k in wanted:
            if s in self.batched_w:  # refused already
                continue
            with autocast_forward(*self.autocast) if self.autocast is not None else contextlib.nullcontext():
                built = batched_weight_graphs(self.pipe, s, self.graphs[s], k, example)  # as the stages were traced
            if isinstance(built, str):
                self._refuse(s, built)
            else:
                built.ratio = measure_ratio(self.graphs[s].backward_weight, self.w_acc[s], built, device=self.device)
                self._batches[(s, k)] = built
                self.batched_w.setdefault(s, f"batched over {k} microbatches ({built.ratio:.2f}x their time one by "
                                             "one)")

    @property
    def batched_w_ratio(self) -> dict[int, float]:
        """Per stage of this rank whose W runs batched: the batched W's time over its microbatches' W's one by one
        (measured when it was built); what the simulator charges each W of a batched run (``Costs.w_batched``)."""
        return {s: b.ratio for (s, _), b in sorted(self._batches.items())}

    def batched_w_fractions(self) -> tuple[float, ...]:
        """Every stage's :attr:`batched_w_ratio` (1.0 where its Ws run one by one), gathered from every rank, for
        ``Costs.w_batched``. Collective: every rank calls it."""
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, self.batched_w_ratio)
        merged = {s: r for d in every for s, r in d.items()}
        return tuple(merged.get(s, 1.0) for s in range(self.schedule.num_stages))

    def _refuse(self, s: int, why: str) -> None:
        """Stage s runs its W per microbatch from now on, and says why (once)."""
        for key in [key for key in self._batches if key[0] == s]:
            del self._batches[key]
        if not self.batched_w.get(s, "").startswith("per microbatch"):
            self.batched_w[s] = f"per microbatch: {why}"
            logger.warning("%s: stage %d runs its W per microbatch: %s", self.schedule.name, s, why)

    def _run_boxed(self, s: int, which: str, graph: Any, args: list[Any]) -> Any:
        box = self.core.boxed(s, which, graph)
        if box is None:
            return graph(*args)
        return box(args)

    # -- failures -------------------------------------------------------------------------

    def _failed_recv(self, msg: Message, action: Action) -> Callable[[Exception], BaseException]:
        """What a failed receive of ``msg`` raises (made once per message posted and waited for: the words only when
        it fails)."""
        def failed(exc: Exception) -> BaseException:
            what = msg.name if msg.direction == FORWARD else f"grad of {msg.name}"
            return self._peer_down(exc, [msg.src], f"{what} of microbatch {msg.mb} (stage {msg.stage}) "
                                                   f"from rank {msg.src} at {action}")

        return failed

    def _failed_send(self, exc: Exception, dst: int) -> BaseException:
        return self._peer_down(exc, [dst], f"its sends to rank {dst} to complete")

    def _collective(self, fn: Callable[..., Any], what: str) -> None:
        """Run a collective (``fn``, a ``partial`` of one) and wait for it, bounded by the runtime's timeout."""
        group = fn.keywords.get("group") if isinstance(fn, partial) else None
        try:
            work = fn(async_op=True)
        except Exception as exc:
            ranks = dist.get_process_group_ranks(group) if group is not None else range(self.world)
            raise self._peer_down(exc, [r for r in ranks if r != self.rank], f"the sum of {what}") from exc
        self._wait(work, group if group is not None else dist.group.WORLD, what)

    def _wait(self, work: Any, group: Any, what: str) -> None:
        """Wait for an asynchronous collective on ``group``, bounded by the runtime's timeout, and keep its work."""
        try:
            if self.timeout is None:
                work.wait()
            else:
                work.wait(self.timeout)
        except Exception as exc:
            peers = [r for r in dist.get_process_group_ranks(group) if r != self.rank]
            raise self._peer_down(exc, peers, f"the sum of {what}") from exc
        self._keep(work)

    def _keep(self, work: Any) -> None:
        """Hold a finished collective's work (and so its tensors) while 63 more finish. Gloo's worker thread lets go
        of a work just after ``wait`` returns; were that the last reference, the thread would free the tensors and
        take the GIL to do it, and at the end of a script it can find the interpreter finalizing: the process
        aborts ("terminate called without an active exception"). Held here, they are freed by this thread, with
        the runtime."""
        self.settled.append(work)

    def _peer_down(self, exc: Exception, peers: Sequence[int], waited: str) -> RankFailedError:
        return peer_down(exc, peers, waited, rank=self.rank, timeout=self.timeout)


class PendingLoss:
    """A step's mean loss whose all-reduce over every rank may still be in flight (``step_async``)."""

    def __init__(self, rt: PipelineRuntime, work: Any, total: torch.Tensor, divisor: int) -> None:
        self._rt, self._work, self._total, self._divisor = rt, work, total, divisor
        self._value: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        """The mean loss over the whole batch (float64, the same on every rank), once every rank's share is in."""
        if self._value is None:
            self._rt._wait(self._work, dist.group.WORLD, "the loss (every rank)")
            self._value = self._total / self._divisor  # float64: summed over the batch's microbatches in double
        return self._value

    def done(self) -> bool:
        return self._value is not None or bool(self._work.is_completed())


class _RankRunner(ActionRunner):
    """The core with this rank's policies: gradient shares for remote producers leave as messages,
    W accumulates in place, and the loss is divided by the microbatch count."""

    def __init__(self, rt: PipelineRuntime, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__(rt.pipe, rt.graphs, loss_fn, loss_divisor=rt.schedule.num_microbatches)
        self.rt = rt
        self.shares: dict[str, torch.Tensor] = {}

    def deliver(self, s: int, m: int, name: str, grad: torch.Tensor) -> None:
        src = self.rt.program.producer.get(name, -1)
        if src >= 0 and self.rt.where[src] != self.rt.pp_rank:
            # This stage's own share, sent on its own: another stage of this rank that reads the
            # same value sends its share separately, and the producer sums them.
            self.shares[name] = grad
        else:
            self.add_grad(m, name, grad)

    def stage_device(self, s: int) -> torch.device:
        return self.rt.device

    def weight(self, s: int, m: int, args: list[Any]) -> None:
        self.rt.backward_weight(s, args)

    def weights(self, s: int, mbs: Sequence[int], args: list[list[Any]]) -> None:
        self.rt.backward_weights(s, args)


def _w_runs(ops: Sequence[Any]) -> dict[int, int]:
    """Each run of two or more adjacent W ops of one stage with no messages: its first index -> the index after it."""
    out: dict[int, int] = {}
    j = 0
    while j < len(ops):
        end = j
        a = ops[j].action
        while (end < len(ops) and ops[end].action.kind is Kind.W and ops[end].action.stage == a.stage
               and not ops[end].recvs and not ops[end].sends):
            end += 1
        if end - j >= 2:
            out[j] = end
        j = max(end, j + 1)
    return out


def _optimizer(o: RuntimeOptions) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    """The factory of a stage's optimizer: a named optimizer (None: ``OptimizerSpec``'s) at ``o.lr``; a spec or any
    other factory as given, with its own learning rate."""
    if o.optimizer is None or isinstance(o.optimizer, str):
        return OptimizerSpec(lr=o.lr) if o.optimizer is None else OptimizerSpec(o.optimizer, lr=o.lr)
    return optimizer_factory(o.optimizer)


def _init_process_group(timeout: timedelta | None) -> None:
    """Under torchrun (its RANK, WORLD_SIZE and MASTER_ADDR set), start the default process group if the
    script has not: gloo for CPU tensors, NCCL for CUDA ones where torch has it."""
    if dist.is_initialized():
        return
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        raise RankFailedError("PipelineRuntime needs torch.distributed: launch the script with torchrun (the runtime "
                              "then starts the process group), or call dist.init_process_group first")
    dist.init_process_group(timeout=timeout)  # None: the backend's default
    atexit.register(_destroy_at_exit)


def _destroy_at_exit() -> None:
    """At the exit of a script whose process group the runtime started (the README's recipe calls no
    ``destroy_process_group``): destroy it while the interpreter is still whole. Left to the interpreter's
    finalization, gloo's threads free work objects that hold tensors after Python is gone, and the process
    can abort ("terminate called without an active exception", SIGABRT: pytorch/pytorch#179291; seen here
    at the end of a 2-rank run of the recipe). Not after an unhandled exception: a collective a dead peer
    never answers would make the exit wait for its timeout, where ending now lets torchrun stop the others."""
    if dist.is_initialized() and getattr(sys, "last_value", None) is None:
        dist.destroy_process_group()


def _check_same_program(pipe: Pipeline, schedule: Schedule, rank: int,
                        options: Sequence[tuple[str, Any]]) -> None:
    """Refuse, on every rank and before any group is made, ranks that built their runtime from different plans,
    schedules or options (one all-gather of digests, ``runtime.same``): they would post different messages and
    wait on each other until the timeout, or train apart. The plan is its stages' graphs and parameter shapes (not
    their values: replicas start from their own copy)."""
    stages = "\n".join(f"{s.inputs} -> {s.outputs}\n{getattr(s.module, 'code', '')}\n"
                       + ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in s.module.named_parameters())
                       for s in pipe.stage_list())
    def digest(text: str) -> str:
        return f"digest {hash64(text) & (2**64 - 1):016x}"

    items = [("plan (its stages' graphs and parameter shapes)", f"{pipe.num_stages} stages, {digest(stages)}"),
             ("schedule", f"{schedule.name}: {schedule.num_stages} stages, {schedule.num_microbatches} microbatches "
              f"on {schedule.num_ranks} ranks"),
             ("schedule's actions", digest(repr(schedule.ranks))),
             *((what, str(value)) for what, value in options)]
    found = differing_rank(items)
    if found is not None:
        q, what, value = found
        raise OptionError(f"rank {q} built its PipelineRuntime with another {what} than rank {rank} ({value}); every "
                          "rank must pass the same plan, schedule and options")


def _resolve_plan(plan: Any) -> Pipeline:
    """The Pipeline of a Pipeline or a plan directory."""
    if isinstance(plan, (str, os.PathLike)):
        plan = load(os.fspath(plan))
    if not isinstance(plan, Pipeline):
        raise OptionError(f"plan is a {type(plan).__name__}; pass a Pipeline (fxpipe.compile) or a plan directory")
    return plan


def _stage_graphs(pipe: Pipeline, example_inputs: Sequence[Any] | None, rank_of_stage: Sequence[int],
                  rank: int, autocast: tuple[str, torch.dtype] | None = None, *, kind: str = "cpu",
                  from_plan: bool = True) -> list[StageGraphs]:
    """Every stage's F/B/W graphs as this rank needs them: the pipeline's own, the plan's, or built now.

    A plan directory compiled with them carries each stage's F/B/W (``stage_K.fbw.json``): a rank running it
    as compiled (``from_plan``: a run that needs no other graphs; on ``kind``, the device type they were traced
    for; at the plan's shapes; fp32) reads its own stages' and imports no AOTAutograd
    (``plan_dir.stored_stage_graphs``).
    Otherwise they are rebuilt from ``example_inputs``, or from zeros shaped like the inputs the plan was
    compiled with (``Plan.inputs``: the graphs depend on shapes and dtypes only). Where plan.json records
    each stage's interface, this rank splits only the stages it runs; of the others it builds the interface
    (``StageGraphs.remote``). ``autocast``: graphs traced afresh under it (``Pipeline.build_backward``),
    whatever the pipeline holds.
    """
    graphs = pipe.stage_graphs
    if graphs is not None and autocast is None:
        return list(graphs)
    mine = {s for s, r in enumerate(rank_of_stage) if r == rank}
    if autocast is None and from_plan:
        loaded = stored_stage_graphs(pipe, mine, kind, example_inputs)
        if loaded is not None:
            return loaded
    return pipe.build_backward(example_inputs if example_inputs is not None else _example_inputs(pipe), only=mine,
                               autocast=autocast)


def _example_inputs(pipe: Pipeline) -> tuple[Any, ...]:
    """Zeros shaped like the plan's compiled inputs (one microbatch), as the call's positional arguments."""
    flat = []
    for spec in pipe.plan.inputs:
        dtype = getattr(torch, spec.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise OptionError(f"the plan's input {spec.name} is a {spec.dtype}, not a tensor; pass example_inputs=")
        flat.append(torch.zeros(spec.shape, dtype=dtype))
    if pipe.in_spec is None:
        return tuple(flat)
    args, kwargs = pytree.tree_unflatten(flat, pipe.in_spec)
    if kwargs:
        raise OptionError(f"the plan was compiled with keyword inputs ({', '.join(kwargs)}); pass example_inputs=")
    return tuple(args)


def _resolve_schedule(pipe: Pipeline, schedule: Schedule | str | None, microbatches: int | None) -> Schedule:
    """A Schedule as given; else ``fxpipe.schedules.auto.plan_schedule`` (the plan's recorded one, or a named one)."""
    if isinstance(schedule, Schedule):
        return schedule
    return plan_schedule(pipe.plan, schedule, microbatches)


def _plain(value: Any) -> bool:
    """A hyperparameter that is a plain value (kept in a checkpoint's JSON)."""
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, (bool, int, float)) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _mean_action(costs: Sequence[Any], stages: Iterable[int]) -> float | None:
    """Seconds per action of ``stages`` in the plan's estimate: the mean of their F, B and W that do anything (a
    first stage's B is empty); None where the plan has no costs for them."""
    times = [t for s in stages if s < len(costs) for t in (costs[s].f, costs[s].b, costs[s].w) if t > 0]
    return sum(times) / len(times) if times else None
