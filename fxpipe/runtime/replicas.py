"""Stages on rank groups: the pp x dp device mesh, and each stage's gradients averaged over its replicas.

The mesh is torch's ``DeviceMesh`` with dimensions ``("pp", "dp")``: the rank at pipeline position p
and replica d is ``mesh["pp", "dp"][p, d]`` (``p * dp + d`` for ``init_device_mesh``), so every replica
runs the same schedule among its own pipeline ranks, and each stage's replicas form the ``dp`` group
its gradients are summed over.

Why not DDP's reducer or FSDP2: both learn that a gradient is ready from autograd (DDP's hooks on
each parameter's ``AccumulateGrad``, FSDP2's module pre/post-backward hooks, which also swap
parameters for DTensors that fxpipe's functional F/B/W graphs do not take). fxpipe's W graphs run
outside autograd and write ``.grad`` themselves, so no hook ever fires. What DDP does is kept:
gradients live in flat buckets (each ``.grad`` is a view into one, so W_set and W_acc write
straight into the buffer that is all-reduced, with no copy), and a bucket's all-reduce starts,
asynchronously, as soon as the last W of the step that writes into it has run; the rank waits for
them only before its optimizer steps.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.errors import OptionError
from fxpipe.planning.cost import BUCKET_BYTES  # 25 MiB, DDP's cap; the simulator's buckets too
from fxpipe.schedules.ir import Action, Kind


@dataclass(frozen=True)
class Layout:
    """Where this rank sits on the mesh: its pipeline position and replica, and the ranks of its replica."""

    mesh: Any  # torch DeviceMesh, or None with one replica
    dp: int
    pp_rank: int
    dp_rank: int
    replica_ranks: tuple[int, ...]  # global rank of each pipeline position in this rank's replica

    def global_rank(self, pp_rank: int) -> int:
        return self.replica_ranks[pp_rank]


def layout(mesh: Any, pp: int, rank: int, world: int, device_type: str) -> Layout:
    """This rank's place on ``mesh`` (a DeviceMesh with ``pp`` and ``dp`` dimensions), or on the mesh of
    ``pp`` pipeline ranks x ``world // pp`` replicas that ``init_device_mesh`` lays out when none is given."""
    if mesh is None:
        if world % pp:
            raise OptionError(f"the schedule runs on {pp} ranks and the world has {world}: start a multiple of {pp} "
                              f"ranks (pipeline ranks x replicas), e.g. {pp * max(1, world // pp)}")
        dp = world // pp
        if dp == 1:
            return Layout(None, 1, rank, 0, tuple(range(pp)))
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (pp, dp), mesh_dim_names=("pp", "dp"))
    names = tuple(mesh.mesh_dim_names or ())
    if names != ("pp", "dp"):
        raise OptionError(f"the mesh's dimensions are {names or 'unnamed'}; pass a DeviceMesh with "
                          "mesh_dim_names=('pp', 'dp')")
    if mesh.size(0) != pp:
        raise OptionError(f"the mesh has {mesh.size(0)} pipeline positions and the schedule {pp} ranks; "
                          "make them agree")
    coord = mesh.get_coordinate()
    if coord is None:
        raise OptionError(f"rank {rank} is not on the mesh; every rank of the world runs a part of the pipeline")
    p, d = coord
    grid = mesh.mesh.tolist()
    return Layout(mesh, mesh.size(1), p, d, tuple(int(grid[q][d]) for q in range(pp)))


@dataclass
class Bucket:
    """Gradients of one dtype laid out in one flat buffer; ``stages``: this rank's stages whose W writes them."""

    flat: torch.Tensor
    params: list[torch.nn.Parameter]
    views: list[torch.Tensor]
    stages: frozenset[int]
    work: Any = None
    event: SyncEvent | None = None


@dataclass
class SyncEvent:
    """One bucket's all-reduce: when it was launched, and the wait for it at the step's end (seconds into the step)."""

    stages: tuple[int, ...]
    nbytes: int
    launched: float
    wait_start: float = 0.0
    wait_end: float = 0.0


class GradSync:
    """Sums this rank's gradients over its dp group, bucket by bucket, each as soon as its last W has run.

    ``stage_params[s]``: the parameters stage s's W writes (in W's order; a parameter may repeat or
    appear under several of this rank's stages). The loss is divided by the replica count, so the
    sum is the mean over the whole batch.
    """

    def __init__(self, group: Any, stage_params: dict[int, list[torch.nn.Parameter]], ws_per_step: dict[int, int],
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self.group = group
        self.ws_per_step = dict(ws_per_step)
        writers: dict[int, set[int]] = {}
        order: list[torch.nn.Parameter] = []
        for s, params in stage_params.items():
            for p in params:
                if id(p) not in writers:
                    writers[id(p)] = set()
                    order.append(p)
                writers[id(p)].add(s)
        self.buckets: list[Bucket] = []
        for chunk in _chunks(order, bucket_bytes):
            flat = torch.zeros(sum(p.numel() for p in chunk), dtype=chunk[0].dtype, device=chunk[0].device)
            views, at = [], 0
            for p in chunk:
                views.append(flat[at:at + p.numel()].view(p.shape))
                at += p.numel()
            self.buckets.append(Bucket(flat, chunk, views, frozenset(s for p in chunk for s in writers[id(p)])))
        self.events: list[SyncEvent] = []

    def begin(self, start: float) -> None:
        """A new step (``start``: its ``perf_counter``): every bucket waits for its stages' Ws again."""
        self.start = start
        self.left = dict(self.ws_per_step)
        self.events = []
        for b in self.buckets:
            b.work, b.event = None, None

    def after(self, action: Action) -> None:
        """After a compute action: launch every bucket whose last W of the step this was."""
        if action.kind not in (Kind.W, Kind.BW) or action.stage not in self.left:
            return
        self.left[action.stage] -= 1
        if self.left[action.stage] == 0:
            self.launch(b for b in self.buckets if b.work is None and all(self.left.get(s, 0) == 0 for s in b.stages))

    def launch(self, buckets: Iterable[Bucket]) -> None:
        for b in buckets:
            _into(b)
            b.event = SyncEvent(tuple(sorted(b.stages)), b.flat.numel() * b.flat.element_size(),
                                time.perf_counter() - self.start)
            b.work = dist.all_reduce(b.flat, group=self.group, async_op=True)
            self.events.append(b.event)

    def wait(self, wait: Callable[[Any], None]) -> None:
        """Launch what is left (a stage with no W this step) and wait for every bucket (``wait(work)``)."""
        self.launch(b for b in self.buckets if b.work is None)
        for b in sorted(self.buckets, key=lambda b: b.event.launched if b.event else 0.0):
            assert b.event is not None
            b.event.wait_start = time.perf_counter() - self.start
            wait(b.work)
            b.event.wait_end = time.perf_counter() - self.start
            b.work = None


def _into(bucket: Bucket) -> None:
    """Make every gradient of the bucket its view (a W that made a new tensor is copied in; no gradient: zeros)."""
    for p, view in zip(bucket.params, bucket.views):
        g = p.grad
        if g is None:
            view.zero_()
        elif g.data_ptr() != view.data_ptr() or g.stride() != view.stride():
            view.copy_(g)
        else:
            continue
        p.grad = view


def attach(sync: GradSync) -> None:
    """Before the first step: every gradient is already its bucket's view, so the first W writes into it."""
    for b in sync.buckets:
        _into(b)


def _chunks(params: Sequence[torch.nn.Parameter], cap: int) -> list[list[torch.nn.Parameter]]:
    """Parameters in order, cut into runs of one dtype and device of at most ``cap`` bytes (a bigger one alone)."""
    out: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not out or size + nbytes > cap or (p.dtype, p.device) != (out[-1][0].dtype, out[-1][0].device):
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return out


def average_buffers(modules: Sequence[torch.nn.Module], dp: int, all_reduce: Callable[[torch.Tensor], None]) -> None:
    """Every replica ends the step with the mean of the replicas' floating-point buffers (BatchNorm's running
    statistics: each replica's are of its own microbatches during the step). Integer buffers (the batch
    counters) are the same on every replica and stay."""
    bufs = [b for mod in modules for b in mod.buffers() if b.is_floating_point()]
    if not bufs:
        return
    flat = torch.cat([b.detach().reshape(-1) for b in bufs])
    all_reduce(flat)
    flat /= dp
    at = 0
    with torch.no_grad():
        for b in bufs:
            b.copy_(flat[at:at + b.numel()].view(b.shape))
            at += b.numel()


def on_ranks(program: Any, where: Layout) -> Any:
    """A program lowered for pipeline positions, its messages addressed to the global ranks of this replica."""
    if where.dp == 1 and where.replica_ranks == tuple(range(len(where.replica_ranks))):
        return program
    g = where.global_rank
    for op in program.ops:
        op.recvs = [dataclasses.replace(m, src=g(m.src), dst=g(m.dst)) for m in op.recvs]
        op.sends = [dataclasses.replace(m, src=g(m.src), dst=g(m.dst)) for m in op.sends]
    posts = [dataclasses.replace(m, src=g(m.src), dst=g(m.dst)) for m in program.posts]
    return dataclasses.replace(program, rank=g(program.rank), posts=posts)
