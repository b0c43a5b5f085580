"""A plan on torch.distributed.pipelining's runtime: its stages as modules ``PipelineStage`` wraps, its schedule as
torch's CSV of actions, and the ``_PipelineScheduleRuntime`` that runs them.

Torch hands each stage only the previous stage's outputs (the first stage the model's inputs), so a stage here takes
what the stage before it gives and gives what every later stage (and the loss) reads, passing through the values it
does not compute itself::

    plan:   stage 0: idx -> h        stage 1: h -> y        stage 2: (y, idx) -> logits
    torch:  stage 0: idx -> (h, idx) stage 1: (h, idx) -> (y, idx)  stage 2: (y, idx) -> logits

Weights tied across ranks (``Pipeline.shared_params``) are summed over the ranks that hold them at the rank's last
REDUCE_GRAD action (torch's lowering places one after each stage's last backward and its sends), as one process
would.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from fxpipe._compat import pipelining_schedules, pytree
from fxpipe.errors import PlanError
from fxpipe.pipeline import Pipeline
from fxpipe.schedules.ir import Schedule
from fxpipe.schedules.torch_csv import check_with_torch, lowered_torch_csv, to_torch_csv, torchable

COMPUTE_CSV = "schedule.csv"  # _load_csv(path, format="compute_only")
COMMS_CSV = "schedule_comms.csv"  # _load_csv(path, format="compute_comms"): torch's own lowering of it
MANIFEST = "torch_export.json"
PLAN_SUBDIR = "plan"


class TorchStage(torch.nn.Module):
    """One plan stage as torch runs it: takes the previous stage's outputs, gives what later stages read; its
    parameters and buffers are the stage graph's own, under the model's names (``blocks.0.attn.c_attn.weight``)."""

    graph: torch.fx.GraphModule  # set past nn.Module's __setattr__: not a child module

    def __init__(self, index: int, graph: torch.fx.GraphModule, takes: Sequence[str], inputs: Sequence[str],
                 outputs: Sequence[str], gives: Sequence[str | None], *, last: bool = False,
                 constants: Sequence[Any] = (), out_spec: pytree.TreeSpec | None = None) -> None:
        super().__init__()
        for name, child in graph.named_children():
            self.add_module(name, child)
        for name, p in graph.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in graph.named_buffers(recurse=False):
            self.register_buffer(name, b)
        object.__setattr__(self, "graph", graph)  # not a child: its parameters would be listed twice
        self.index = index
        self.takes, self.inputs, self.outputs, self.gives = tuple(takes), tuple(inputs), tuple(outputs), tuple(gives)
        self.last, self.constants, self.out_spec = last, tuple(constants), out_spec

    def forward(self, *args: Any) -> Any:
        env = dict(zip(self.takes, args))
        env.update(zip(self.outputs, self.graph(*(env[n] for n in self.inputs))))
        made = set(self.outputs)
        # torch detaches a stage's outputs in place after its backward: a value passed through is given as a copy
        # (detaching it would cut the input's own graph) and so is a view (which cannot be detached in place)
        values = tuple(env[n].clone() if isinstance(env[n], torch.Tensor) and (n not in made or env[n]._is_view())
                       else env[n] for n in self.gives if n is not None)
        # torch sends tuples of tensors and hands the last stage's to the loss: one tensor goes alone
        return values[0] if self.last and len(values) == 1 else values

    def model_output(self, output: Any) -> Any:
        """The last stage's output as the model returns it (its constants and pytree put back): the loss's input."""
        leaves = iter((output,) if isinstance(output, torch.Tensor) else output)
        full = [next(leaves) if n is not None else c for n, c in zip(self.gives, self.constants)]
        return tuple(full) if self.out_spec is None else pytree.tree_unflatten(full, self.out_spec)


@dataclasses.dataclass
class TorchExport:
    """A plan for torch's runtime: one module per stage, the schedule, and its CSVs (compute only and lowered)."""

    modules: list[TorchStage]
    schedule: Schedule
    compute_csv: str
    comms_csv: str
    shared_params: dict[str, list[int]]
    pipeline: Pipeline | None = None  # what :meth:`save` writes as ``plan/`` when no plan directory is given

    @property
    def rank_of_stage(self) -> tuple[int, ...]:
        return self.schedule.rank_of_stage

    def manifest(self) -> dict[str, Any]:
        """What a reader needs besides the plan: per stage what it takes and gives and its parameter names."""
        return {"schema": "fxpipe.torch_export/v1", "schedule": self.schedule.name,
                "microbatches": self.schedule.num_microbatches, "stages": len(self.modules),
                "ranks": self.schedule.num_ranks, "rank_of_stage": list(self.rank_of_stage),
                "compute_csv": COMPUTE_CSV, "comms_csv": COMMS_CSV, "plan": PLAN_SUBDIR,
                "tied_across_ranks": {n: ks for n, ks in self.shared_params.items() if self._across(ks)},
                "per_stage": [{"stage": m.index, "rank": self.rank_of_stage[m.index], "takes": list(m.takes),
                               "gives": [n for n in m.gives if n is not None],
                               "parameters": [n for n, _ in m.named_parameters()]} for m in self.modules]}

    def _across(self, stages: Sequence[int]) -> bool:
        return len({self.rank_of_stage[k] for k in stages}) > 1

    def save(self, out: str | Path, plan_dir: str | Path | None = None) -> Path:
        """Write the CSVs and the manifest into ``out`` (and a copy of ``plan_dir`` as ``out/plan``, so that
        :func:`torch_schedule` runs ``out`` alone). Modules are not written: ranks rebuild them from the plan."""
        from fxpipe.files import write_file
        from fxpipe.plan_dir import load as load_plan, save_pipeline

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        ours = _own_export(out)  # a file of an earlier export into ``out`` is replaced; anything else is refused
        for name, text in ((COMPUTE_CSV, self.compute_csv), (COMMS_CSV, self.comms_csv),
                           (MANIFEST, json.dumps(self.manifest(), indent=2) + "\n")):
            write_file(out / name, text, what=f"the export's {name}", ours=lambda p: ours)
        pipeline = self.pipeline
        if plan_dir is not None and Path(plan_dir).resolve() != (out / PLAN_SUBDIR).resolve():
            pipeline = load_plan(plan_dir)
        if pipeline is not None:  # the plan directory's own writer: it replaces only the files it wrote
            save_pipeline(pipeline, out / PLAN_SUBDIR)
        return out


def _own_export(out: Path) -> bool:
    """Whether ``out`` holds an earlier export's manifest (a regular file of this format): its files are fxpipe's."""
    manifest = out / MANIFEST
    if manifest.is_symlink() or not manifest.is_file() or manifest.stat().st_size > 1 << 24:
        return False
    try:
        return json.loads(manifest.read_text()).get("schema") == "fxpipe.torch_export/v1"
    except (ValueError, UnicodeDecodeError, AttributeError):
        return False


def export_torch(plan: Pipeline | str | Path, *, out: str | Path | None = None) -> TorchExport:
    """``plan`` (a Pipeline, a plan directory, or a directory ``export_torch`` wrote) for torch's pipelining runtime.

    Raises PlanError, one line each, for what torch's runtime cannot run: an asynchronous schedule (weight stashing
    or prediction), a per-layer strategy, replicas (``--dp``; torch's data parallelism is FSDP/DDP around stages),
    or a model output no stage computes.
    """
    plan_dir = None
    if not isinstance(plan, Pipeline):
        plan_dir = resolve_plan_dir(plan)
        from fxpipe.plan_dir import load

        plan = load(plan_dir)
    pipe = plan
    p = pipe.plan
    if p.strategy is not None:
        raise PlanError(f"this plan runs a per-layer strategy ({p.strategy.name}: layers sharded over "
                        f"{p.strategy.ranks} "
                        "ranks), which torch's pipelining runtime does not express; "
                        "compile it again without --strategy")
    if p.mesh.dp > 1:
        raise PlanError(f"this plan replicates every stage on {p.mesh.dp} ranks (--dp); torch's runtime takes one rank "
                        "per stage position (wrap stages in FSDP/DDP yourself): compile it again without --dp")
    if p.schedule is not None and p.schedule.weights is not None:
        raise PlanError(f"schedule {p.schedule.name} trains with weight {p.schedule.weights} (asynchronous); torch's "
                        "runtime flushes every step: compile with --schedule 1f1b, zb-h1, zb-h2 or interleaved-1f1b")
    from fxpipe.schedules.auto import plan_schedule

    schedule = plan_schedule(p, None, None)
    torchable(schedule)
    check_with_torch(schedule)
    export = TorchExport(stage_modules(pipe), schedule, to_torch_csv(schedule), lowered_torch_csv(schedule),
                         dict(pipe.shared_params), pipe)
    if out is not None:
        export.save(out, plan_dir)
    return export


def stage_modules(pipe: Pipeline) -> list[TorchStage]:
    """Each stage as a :class:`TorchStage`: what it takes from the stage before and gives to the stages after."""
    stages = pipe.stage_list()
    made_by: dict[str, int] = {n: -1 for n in pipe.input_names}
    for s in stages:
        made_by.update({n: s.index for n in s.outputs})
    missing = [n for n in pipe.output_names if n is not None and n not in made_by]
    if missing:
        raise PlanError(f"the model's outputs {missing} come from no stage; re-run fxpipe compile")
    takes: list[str] = list(pipe.input_names)
    modules = []
    for k, s in enumerate(stages):
        last = k == len(stages) - 1
        if last:
            gives: list[str | None] = list(pipe.output_names)
        else:
            later = [n for t in stages[k + 1:] for n in t.inputs] + [n for n in pipe.output_names if n is not None]
            gives = list(dict.fromkeys(n for n in later if made_by[n] <= k))
        modules.append(TorchStage(k, s.module, takes, s.inputs, s.outputs, gives, last=last,
                                  constants=pipe.output_constants if last else (),
                                  out_spec=pipe.out_spec if last else None))
        takes = [n for n in gives if n is not None]
    return modules


def resolve_plan_dir(path: str | Path) -> Path:
    """A plan directory, or the plan inside a directory ``export_torch`` wrote."""
    path = Path(path)
    return path / PLAN_SUBDIR if (path / MANIFEST).is_file() and (path / PLAN_SUBDIR).is_dir() else path


def torch_schedule(plan_dir: str | Path, rank: int, world: int, loss_fn: Callable[..., torch.Tensor], *,
                   device: torch.device | str = "cpu", group: Any = None, scale_grads: bool = True
                   ) -> tuple[list[Any], Any]:
    """This rank's ``PipelineStage``s of a plan (or export) directory and a ``_PipelineScheduleRuntime`` loaded from
    the plan's schedule CSV, ready for ``schedule.step(*inputs, target=target, losses=losses)``.

    Call it on every rank of ``group`` (default: the world) at once: it makes one process group per weight tied
    across ranks. ``world``: the group's size, which must be the plan's rank count. Raises PlanError otherwise.
    """
    import tempfile

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    export = export_torch(plan_dir)
    sched = export.schedule
    if world != sched.num_ranks:
        raise PlanError(f"the plan's schedule {sched.name} runs on {sched.num_ranks} ranks, the world has {world}; "
                        f"launch {sched.num_ranks} ranks (torchrun --nproc-per-node {sched.num_ranks})")
    if not 0 <= rank < world:
        raise PlanError(f"rank {rank} is not in a world of {world}; pass the rank of this process")
    stages = [PipelineStage(m, m.index, len(export.modules), torch.device(device), group=group)
              for m in export.modules if export.rank_of_stage[m.index] == rank]
    runtime_cls = pipelining_schedules()._PipelineScheduleRuntime
    rebuild = export.modules[-1].model_output

    def model_loss(output: Any, target: Any) -> torch.Tensor:  # the loss sees what the model returns
        return loss_fn(rebuild(output), target)

    schedule = runtime_cls(stages, n_microbatches=sched.num_microbatches, loss_fn=model_loss, scale_grads=scale_grads)
    written = Path(plan_dir) / COMPUTE_CSV  # an export directory's CSV is what runs (edited or not)
    with tempfile.TemporaryDirectory() as tmp:
        path = written if (Path(plan_dir) / MANIFEST).is_file() and written.is_file() else Path(tmp) / COMPUTE_CSV
        if path != written:
            path.write_text(export.compute_csv)
        try:
            schedule._load_csv(str(path), format="compute_only")
        except (AssertionError, RuntimeError, ValueError, KeyError) as exc:
            raise PlanError(f"torch refuses {path.name} ({str(exc).splitlines()[0]}); export the plan again") from None
    placed = dict(schedule.stage_index_to_group_rank)
    if placed != dict(enumerate(export.rank_of_stage)):
        raise PlanError(f"{path} places stages on ranks {placed}, the plan on {dict(enumerate(export.rank_of_stage))}; "
                        "keep each stage's rank when editing the CSV, or export the plan again")
    tied = _tied_groups(export, group)
    if tied.get(rank):
        mine = {s.stage_index: s for s in stages}
        reduce_grad = pipelining_schedules().REDUCE_GRAD
        # Summed after this rank's last REDUCE_GRAD, when all its compute is done and all its sends are posted: a
        # collective any earlier (at a stage's own REDUCE_GRAD) would wait on a rank that still waits on this one
        # (interleaved stages). The sums go in one order on every rank: by name.
        last = sum(1 for a in schedule.pipeline_order_with_comms[rank] if a.computation_type == reduce_grad)
        sums = sorted((name, k, pg) for k, pairs in tied[rank].items() for name, pg in pairs)
        seen = [0]

        def reduce_and_sum_tied(action: Any, ctx: Any) -> None:
            mine[action.stage_index].perform_reduce_grad(sched.num_microbatches if scale_grads else 1)
            seen[0] += 1
            if seen[0] < last:
                return
            seen[0] = 0
            for name, k, pg in sums:
                p = mine[k].submod.get_parameter(name)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=pg)

        schedule.register_custom_function(reduce_grad, reduce_and_sum_tied)
    return stages, schedule


def _tied_groups(export: TorchExport, group: Any) -> dict[int, dict[int, list[tuple[str, Any]]]]:
    """rank -> stage -> (parameter name, process group of the ranks holding it), for weights tied across ranks.
    Every rank makes every group, in the same order (``new_group`` is collective)."""
    import torch.distributed as dist

    out: dict[int, dict[int, list[tuple[str, Any]]]] = {}
    for name, ks in sorted(export.shared_params.items()):
        ranks = sorted({export.rank_of_stage[k] for k in ks})
        if len(ranks) != len(ks):  # one Parameter in two PipelineStages of a rank: each stage scales its gradient
            raise PlanError(f"weight {name} is tied between stages {ks}, {len(ks) - len(ranks) + 1} of them on one "
                            "rank; torch's runtime scales its gradient once per stage: place the tied stages on "
                            "ranks of their own (one stage per rank)")
        if len(ranks) == 1:
            continue
        global_ranks = ranks if group is None else [dist.get_global_rank(group, r) for r in ranks]
        pg = dist.new_group(global_ranks)
        for k in ks:
            out.setdefault(export.rank_of_stage[k], {}).setdefault(k, []).append((name, pg))
    return out


def stage_modules_by_name(plan: Any) -> list[list[str]]:
    """Each stage's modules by their names in the model (the plan's layers), for torchtitan's
    ``module_fqns_per_model_part``. Raises PlanError, one line, naming the module a cut falls inside."""
    names = [layer.name for layer in plan.layers]
    if plan.options.granularity == "node":
        raise PlanError("this plan was cut between single fx nodes (--granularity node), not at modules; torchtitan "
                        "splits at modules: compile with --granularity auto (or a module depth)")
    bounds = plan.bounds
    for k, cut in enumerate(bounds[1:-1], start=1):
        before, after = names[cut - 1].split("#")[0], names[cut]
        base = after.split("#")[0]
        if "#" in after or base == before:
            raise PlanError(f"the cut before stage {k} falls inside module {base} (its calls run on both sides: layers "
                            f"{names[cut - 1]} | {after}); torchtitan splits at module boundaries: "
                            "compile with another --granularity, or run the plan with fxpipe export --to torch")
    return [[n.split("#")[0] for n in names[a:b]] for a, b in zip(bounds[:-1], bounds[1:])]


def torchtitan_toml(plan: Any, schedule_csv: str) -> str:
    """torchtitan's ``[parallelism]`` fragment for ``plan``: its stages by module, its schedule as the CSV
    ``schedule_csv`` (``fxpipe export --to torch`` writes it) and its microbatch size."""
    from fxpipe.schedules.auto import plan_schedule

    parts = stage_modules_by_name(plan)
    sched = plan_schedule(plan, None, None)
    torchable(sched)
    rows = plan.inputs[0].shape[0] if plan.inputs and plan.inputs[0].shape else 1

    def strings(xs: Sequence[str]) -> str:
        return "[" + ", ".join(json.dumps(x) for x in xs) + "]"

    return "\n".join([
        f"# fxpipe plan: {len(parts)} stages on {sched.num_ranks} ranks, schedule {sched.name}, "
        f"{sched.num_microbatches} microbatches of {rows} rows (training.local_batch_size = "
        f"{rows * sched.num_microbatches})",
        "[parallelism]",
        f"pipeline_parallel_degree = {sched.num_ranks}",
        f"module_fqns_per_model_part = [{', '.join(strings(p) for p in parts)}]",
        "# torchtitan before module_fqns_per_model_part: the module each stage after the first begins with",
        f"pipeline_parallel_split_points = {strings([p[0] for p in parts[1:]])}",
        'pipeline_parallel_schedule = "_PipelineScheduleRuntime"',
        f"pipeline_parallel_schedule_csv = {json.dumps(schedule_csv)}",
        f"pipeline_parallel_microbatch_size = {rows}",
    ]) + "\n"
