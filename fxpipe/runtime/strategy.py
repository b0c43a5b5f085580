"""Per-layer strategies on DTensor: every node of a traced model runs in its own configuration on one rank group.

``planning.strategies`` picks, per layer (fx node), degrees ``(s, c, r)`` over the batch, the output
channels and the input channels; this module runs them. A group of ``d = 2**k`` ranks is a
``(2, ..., 2)`` ``DeviceMesh`` and each configuration is a placement on it, so moving a tensor between
two layers' configurations is one ``DTensor.redistribute``, which moves what
``planning.strategies.transfer`` counts. Each node computes on local shards; after backward, each
layer's parameter gradients are all-reduced over the ranks holding the same shard (``sync``).
BatchNorm with a split batch computes the whole batch's statistics; height splits stay in the cost
model (DTensor's convolution on a split height is wrong on this torch).

Pipelined strategies (several stages, each on its own group) run their schedule through the
executor core (``runtime.core``): the ranks at one place of every group form one lane.
``CollectiveCounter`` records each collective with its layer and bytes, to check the cost model.
docs/internals/strategy-runtime.md gives the placements table and the nesting orders.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from fxpipe._compat import TorchDispatchMode, flatten_mesh, gloo_options, process_group_size
from fxpipe._overrides import with_overrides
from fxpipe.errors import OptionError
from fxpipe.graphs.convention import StageGraphs
from fxpipe.planning.cost import BUCKET_BYTES
from fxpipe.planning.strategies import Degrees, LayerSpec
from fxpipe.runtime import replicas
from fxpipe.runtime.channel import Channel
from fxpipe.runtime.core import ActionRunner
from fxpipe.runtime.faults import peer_down
from fxpipe.runtime.lower import FORWARD, Message, lower
from fxpipe.runtime.same import gathered, hash64
from fxpipe.schedules.generators import generate
from fxpipe.schedules.ir import Action, Kind, Schedule

if TYPE_CHECKING:  # the caller's value; the runtime calls its methods and imports nothing of the calibration
    from fxpipe.calibration.host import HostTuning

__all__ = ["CollectiveCounter", "Record", "StrategyOptions", "StrategyRuntime", "check_same_strategy", "check_schedule",
           "fused_backward", "mesh_roles", "strategy_mesh"]

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


_MESHES: dict[tuple[Any, ...], tuple[Any, DeviceMesh]] = {}


def _shared_mesh(device_type: str, layout: torch.Tensor, names: tuple[str, ...],
                 timeout: timedelta | None = None) -> DeviceMesh:
    """The one DeviceMesh of this process's world over ``layout`` (ranks) with dims ``names`` whose groups wait
    ``timeout`` for a collective (None: torch's default). Two meshes alike compare and hash equal but own different
    process groups, and DTensor's sharding cache can hand a tensor of one the other (the first it saw), so one
    runtime's collectives could run on another's groups. Made once, every runtime's mesh alike is the same object,
    and the groups (each with its threads and sockets) do not grow with the runtimes a process makes; entries of an
    earlier world are dropped."""
    world = dist.group.WORLD
    for key in [k for k, (w, _) in _MESHES.items() if w is not world]:
        del _MESHES[key]
    key = (device_type, tuple(layout.shape), tuple(layout.flatten().tolist()), names, timeout)
    if key not in _MESHES:
        override = tuple((None, gloo_options(timeout)) for _ in names)  # (None, None): torch's default
        _MESHES[key] = (world, DeviceMesh(device_type, layout, mesh_dim_names=names, backend_override=override))
    return _MESHES[key][1]


def strategy_mesh(ranks: int, device_type: str = "cpu", timeout: timedelta | None = None) -> DeviceMesh:
    """The ``(2, ..., 2)`` mesh of ``ranks`` (a power of two, at least 2) a strategy runs on; its groups wait
    ``timeout`` for a collective (None: torch's default, 30 minutes on gloo)."""
    k = ranks.bit_length() - 1
    if ranks < 2 or 1 << k != ranks:
        raise OptionError(f"per-layer strategies run on a power-of-two rank group of at least 2 (ranks: {ranks}); "
                          "start 2, 4, 8, ... ranks")
    return _shared_mesh(device_type, torch.arange(ranks).view((2,) * k), tuple(f"m{i}" for i in range(k)), timeout)


def mesh_roles(degrees: Degrees, ndim: int) -> tuple[str, ...]:
    """Each mesh dimension's role under ``degrees``: ``"s"`` (sample), ``"c"`` (column), ``"r"`` (row), in that order
    (``StrategyRuntime`` may permute them to line up with a layer's producers).

    >>> mesh_roles(Degrees(sample=2, column=2), 2), mesh_roles(Degrees(row=4), 2)
    (('s', 'c'), ('r', 'r'))
    """
    if degrees.spatial > 1:
        raise OptionError(f"configuration {degrees.name} splits the height, which DTensor computes wrongly on this "
                          "torch (convolutions on a split height); it stays in the cost model: search without "
                          "spatial degrees to run the strategy")
    roles: list[str] = []
    for letter, n in (("s", degrees.sample), ("c", degrees.column), ("r", degrees.row)):
        k = n.bit_length() - 1
        if 1 << k != n:
            raise OptionError(f"configuration {degrees.name}: every degree must be a power of two "
                              "on a (2, ..., 2) mesh")
        roles += [letter] * k
    if len(roles) != ndim:
        raise OptionError(f"configuration {degrees.name} uses {2 ** len(roles)} ranks; the mesh has {2 ** ndim}")
    return tuple(roles)


_S0, _S1, _R, _P = Shard(0), Shard(1), Replicate(), Partial()
_TABLE: dict[str, dict[str, Any]] = {
    # what: role -> placement (module docstring)
    "in": {"s": _S0, "c": _R, "r": _S1},
    "in_grad": {"s": _S0, "c": _P, "r": _S1},
    "out": {"s": _S0, "c": _S1, "r": _P},
    "weight": {"s": _R, "c": _S0, "r": _S1},
    "weight_grad": {"s": _P, "c": _S0, "r": _S1},
    "bias": {"s": _R, "c": _S0, "r": _R},
    "bias_grad": {"s": _P, "c": _S0, "r": _R},
    "act": {"s": _S0, "c": _S1},
    "norm": {"s": _R, "c": _S0},
    "norm_grad": {"s": _P, "c": _S0},
}


def check_schedule(schedule: Schedule, stages: int) -> None:
    """A schedule a per-layer strategy of ``stages`` stages can run: synchronous, with one stage per rank group;
    else one ``OptionError``."""
    if not schedule.synchronous:
        raise OptionError(f"{schedule.name} is asynchronous, and a per-layer strategy trains synchronously (a stage's "
                          "DTensor parameters have one version, stepped once per step): use a synchronous schedule "
                          "(gpipe, 1f1b, zb-h1, ...)")
    if schedule.num_stages != stages or tuple(schedule.rank_of_stage) != tuple(range(stages)):
        raise OptionError(f"{schedule.name} places {schedule.num_stages} stages on {schedule.num_ranks} ranks, and the "
                          f"strategy runs {stages} stages, each on its own rank group: use a schedule with one stage "
                          "per rank (gpipe, 1f1b, zb-h1, ...)")


def _placements(what: str, roles: Sequence[str]) -> tuple[Any, ...]:
    return tuple(_TABLE[what][r] for r in roles)


def _lined_up(held: Sequence[Any], needed: Sequence[Any]) -> tuple[int, int]:
    """How well two placements on one mesh line up: the tensor dims whose splits nest (one's mesh dims, in
    order, a prefix of the other's: DTensor splits a dim over its mesh dims outermost first), then the
    mesh dims with equal placements."""
    def shards(placements: Sequence[Any]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for i, p in enumerate(placements):
            if p.is_shard():
                out.setdefault(p.dim, []).append(i)
        return out

    a, b = shards(held), shards(needed)
    nested = sum(1 for x in set(a) | set(b)
                 if (lambda u, v: u[:len(v)] == v or v[:len(u)] == u)(a.get(x, []), b.get(x, [])))
    return nested, sum(h == w for h, w in zip(held, needed))


@dataclass(frozen=True)
class Record:
    """One collective: the layer it belongs to, its op, its group size and the bytes one rank receives."""

    layer: str
    op: str
    ranks: int
    nbytes: float


def _received(op: str, nbytes: float, g: int) -> float:
    if op.startswith("all_gather"):
        return (g - 1) * nbytes
    if op.startswith("reduce_scatter") or op.startswith("all_to_all"):
        return (g - 1) / g * nbytes
    return 2 * (g - 1) / g * nbytes  # all-reduce


def _nbytes(x: Any) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


class CollectiveCounter(TorchDispatchMode):
    """Records every collective issued under it (as ``CommDebugMode`` sees them: after DTensor has desugared
    into functional collectives, and the runtime's own c10d all-reduces) with the layer the runtime was
    at and the bytes one rank receives. (``CommDebugMode`` itself attributes by module calls, which the
    runtime's node-by-node execution does not make.)"""

    _FUNCOL = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single")

    def __init__(self) -> None:
        super().__init__()
        self.layer = ""
        self.records: list[Record] = []

    @contextlib.contextmanager
    def at(self, layer: str) -> Iterator[None]:
        previous, self.layer = self.layer, layer
        try:
            yield
        finally:
            self.layer = previous

    def counts(self) -> dict[str, int]:
        """Collectives by op, like ``CommDebugMode.get_comm_counts``."""
        out: dict[str, int] = {}
        for r in self.records:
            out[r.op] = out.get(r.op, 0) + 1
        return out

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into plain collectives first, as CommDebugMode does
        out = func(*args, **(kwargs or {}))
        packet = func._overloadpacket
        name, ns = packet.__name__, str(packet).split(".")[0]
        if "c10d_functional" in ns and name in self._FUNCOL:
            g = process_group_size(args[-1])  # the group's name is the last argument of each
            self.records.append(Record(self.layer, name, g, _received(name, _nbytes(args[0]), g)))
        elif ns.endswith("c10d") and name == "allreduce_":  # the runtime's own all-reduces (gradients, statistics)
            g = process_group_size(args[1])
            self.records.append(Record(self.layer, "all_reduce", g, _received("all_reduce", _nbytes(args[0]), g)))
        elif ns.endswith("c10d") and name in ("allgather_", "_allgather_base_", "reduce_scatter_",
                                              "_reduce_scatter_base_", "alltoall_base_", "broadcast_"):
            raise OptionError(f"the collective counter saw c10d.{name}, which it does not size; count inside the "
                              "strategy runtime only")
        return out


def _at(counter: CollectiveCounter | None, layer: str) -> Any:
    return counter.at(layer) if counter is not None else contextlib.nullcontext()


class _Move(torch.autograd.Function):
    """``redistribute`` forward, and its gradient back to the held placements backward (DTensor's rule: a
    gradient for a ``Partial`` placement stays whole), both under the layer's label for the counter."""

    @staticmethod
    def forward(ctx: Any, x: DTensor, needed: tuple[Any, ...], label: str, rt: StrategyRuntime) -> DTensor:
        ctx.held, ctx.label, ctx.rt = x.placements, label, rt
        with _at(rt.counter, label):
            return x.redistribute(x.device_mesh, needed)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> Any:
        back = tuple(_R if h.is_partial() else h for h in ctx.held)
        with _at(ctx.rt.counter, ctx.label):
            moved = grad.redistribute(grad.device_mesh, back) if grad.placements != back else grad
        return moved, None, None, None


def _route(held: Sequence[Any], src: tuple[int, ...], dst: tuple[int, ...], needed: Sequence[Any],
           views: Sequence[tuple[int, ...]], reorder: bool) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None,
                                                                     tuple[int, int]]:
    """Where to move a value held on view ``src`` to what a layer on view ``dst`` needs: the view it is moved on
    (seen there as it is, moved, then seen on ``dst``; None when no view keeps its blocks nesting), the block
    order of its dim 1 seen there (``_block_order``; None unless ``reorder``, the layer reads its input's channels
    in any order, and a view other than ``src`` lines up better that way), and how well it then lines up
    (``_lined_up``). Candidates: ``dst``, ``src``, then the other views; the first best wins."""
    best: tuple[tuple[int, ...] | None, tuple[int, ...] | None, tuple[int, int]] = (None, None, (-1, -1))
    for via in dict.fromkeys((dst, src, *views)):
        there, ok = _reinterpret(needed, dst, via)
        if not ok:
            continue
        for permuted in (False, True) if reorder and via != src else (False,):
            seen, ok = _reinterpret(held, src, via, reorder=permuted)
            order = _block_order(held, src, via) if permuted else None
            if not ok or (permuted and order == tuple(range(len(order or ())))):
                continue  # not faithful, or the same order: the unpermuted candidate
            score = _lined_up(seen, there)
            if score > best[2]:
                best = (via, order, score)
    return best if best[0] is not None else (None, None, (0, 0))


class _View(torch.autograd.Function):
    """The same local blocks as a DTensor on another view of the mesh (no data moves), and back for the gradient
    (pending sums included; a gradient whose blocks would not nest on the way back is first brought to the
    placements the forward produced, Partial made whole, under the layer's label). ``reorder``: dim 1's blocks
    may nest in another order on the new view (the DTensor there is the tensor with its dim-1 blocks in
    ``_block_order``; only a layer that reads its input's channels in that order takes it)."""

    @staticmethod
    def forward(ctx: Any, x: DTensor, src: tuple[int, ...], dst: tuple[int, ...], label: str,
                rt: StrategyRuntime, reorder: bool = False) -> DTensor:
        placements, ok = _reinterpret(x.placements, src, dst, reorder=reorder)
        assert ok, (x.placements, src, dst)
        ctx.src, ctx.dst, ctx.label, ctx.rt, ctx.reorder = src, dst, label, rt, reorder
        ctx.want = tuple(_R if p.is_partial() else p for p in placements)
        return DTensor.from_local(x.to_local(), rt.view(dst), placements, run_check=False)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> Any:
        if ctx.reorder:  # reordered blocks go back only as the forward split them
            ok = grad.placements == ctx.want
        else:
            _, ok = _reinterpret(grad.placements, ctx.dst, ctx.src)  # a pending sum is seen as it is
        if not ok:
            with _at(ctx.rt.counter, ctx.label):
                grad = grad.redistribute(grad.device_mesh, ctx.want)
        placements, _ = _reinterpret(grad.placements, ctx.dst, ctx.src, reorder=ctx.reorder)
        return (DTensor.from_local(grad.to_local(), ctx.rt.view(ctx.src), placements, run_check=False),
                None, None, None, None, None)


class _BatchNormSync(torch.autograd.Function):
    """BatchNorm over a batch split on ``group``: the whole batch's statistics, one all-reduce each way.

    The passes over the activation are torch's BatchNorm kernels (normalize as eval mode does, with the whole
    batch's statistics; the backward's channel sums) and two per-channel multiply-adds for dx, so a rank computes
    about what eager BatchNorm does beside the two all-reduces (tensor expressions took several times that)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, running: Any,
                group: Any, label: str, rt: StrategyRuntime) -> torch.Tensor:
        module, mean_buf, var_buf = running
        dims = [0, *range(2, x.dim())]
        g = process_group_size(group)
        n = x.numel() // x.shape[1] * g
        sums = torch.cat([x.sum(dims), (x * x).sum(dims)])
        with _at(rt.counter, label):
            dist.all_reduce(sums, group=group)
        mean, sq = sums.chunk(2)
        mean = mean / n
        var = sq / n - mean * mean
        invstd = torch.rsqrt(var + module.eps)
        with torch.no_grad():
            m = module.momentum
            mean_buf.mul_(1 - m).add_(mean, alpha=m)
            var_buf.mul_(1 - m).add_(var * n / max(n - 1, 1), alpha=m)
        ctx.save_for_backward(x, mean, invstd, weight)
        ctx.group, ctx.label, ctx.rt, ctx.n, ctx.eps = group, label, rt, n, module.eps
        return torch.native_batch_norm(x, weight, bias, mean, var, False, 0.0, module.eps)[0]

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        x, mean, invstd, weight = ctx.saved_tensors
        dy = dy.contiguous()
        _, grad_weight, grad_bias = torch.ops.aten.native_batch_norm_backward(
            dy, x, weight, None, None, mean, invstd, True, ctx.eps, [False, True, True])
        # this rank's shares (sum dy * xhat, sum dy), summed with the layer's gradients; the whole batch's for dx
        local = torch.cat([grad_bias, grad_weight])
        with _at(ctx.rt.counter, ctx.label):
            dist.all_reduce(local, group=ctx.group)
        sum_dy, sum_dy_xhat = local.chunk(2)
        # dx = w * invstd * (dy - sum_dy / n - xhat * sum_dy_xhat / n), per channel a * dy + b * x + c
        shape = [1, -1] + [1] * (x.dim() - 2)
        a = weight * invstd
        b = -a * invstd * sum_dy_xhat / ctx.n
        c = -a * sum_dy / ctx.n - b * mean
        dx = torch.addcmul(c.view(shape), x, b.view(shape)).addcmul_(dy, a.view(shape))
        return dx, grad_weight, grad_bias, None, None, None, None


@dataclass
class _Layer:
    """A node's configuration as the runtime runs it: ``roles[j]`` is the role of dim j of the layer's mesh view,
    and ``perm[j]`` the base mesh dim that view dim is (DTensor splits a tensor dim over its mesh dims
    outermost first, so the view's order is the order in which the layer's split blocks nest)."""

    spec: LayerSpec
    degrees: Degrees
    roles: tuple[str, ...]
    perm: tuple[int, ...]
    order: tuple[int, ...] | None = None  # a matmul reading its input's dim-1 blocks in this order (_block_order)

    @property
    def sample_dims(self) -> tuple[int, ...]:
        """The base mesh dims that split the batch: the ranks that hold the same shard of the parameters."""
        return tuple(sorted(self.perm[i] for i, r in enumerate(self.roles) if r == "s"))


def _reinterpret(placements: Sequence[Any], src: tuple[int, ...], dst: tuple[int, ...],
                 reorder: bool = False) -> tuple[tuple[Any, ...], bool]:
    """The same local blocks seen on the view ``dst`` instead of ``src`` (both: view dim -> base dim), and whether
    that is faithful: every tensor dim split over several mesh dims keeps the order they nest in (dim 1 may
    change its order under ``reorder``: ``_block_order`` says how).

    >>> _reinterpret((Shard(1), Partial()), (0, 1), (1, 0))
    ((Partial(sum), Shard(dim=1)), True)
    >>> _reinterpret((Shard(1), Shard(1)), (0, 1), (1, 0))[1]
    False
    >>> _reinterpret((Shard(1), Shard(1)), (0, 1), (1, 0), True)[1]
    True
    """
    base: list[Any] = [None] * len(src)
    for j, p in enumerate(placements):
        base[src[j]] = p
    out = tuple(base[dst[j]] for j in range(len(dst)))
    a, b = _nesting(placements, src), _nesting(out, dst)
    if reorder:
        a.pop(1, None)
        b.pop(1, None)
    return out, a == b


def _nesting(placements: Sequence[Any], view: tuple[int, ...]) -> dict[int, list[int]]:
    """Each split tensor dim's base mesh dims, outermost first (DTensor splits over a view's dims in its order)."""
    found: dict[int, list[int]] = {}
    for j, p in enumerate(placements):
        if p.is_shard():
            found.setdefault(p.dim, []).append(view[j])
    return found


def _block_order(placements: Sequence[Any], src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[int, ...]:
    """Dim 1 of a tensor ``x`` split over m mesh dims has 2^m blocks; seen on ``dst`` instead of ``src`` (the same
    local blocks, ``_reinterpret(..., reorder=True)``) it is ``x'`` with ``x'``'s block i = ``x``'s block
    ``order[i]``: a rank's block index is its coordinates over those mesh dims read outermost first, and the
    two views read them in different orders. A matmul that reads ``x'`` holds its weight's dim 1 in the same
    order, so ``W' x' = W x``.

    >>> _block_order((Shard(1), Shard(1)), (0, 1), (1, 0))  # a 2x2 mesh: the middle blocks swap
    (0, 2, 1, 3)
    """
    seen, _ = _reinterpret(placements, src, dst, reorder=True)
    before, after = _nesting(placements, src).get(1, []), _nesting(seen, dst).get(1, [])
    m = len(before)
    order = [0] * (1 << m)
    for coords in itertools.product((0, 1), repeat=m):  # coords[t]: the rank's coordinate on mesh dim before[t]
        at = dict(zip(before, coords))
        i_src = sum(at[d] << (m - 1 - t) for t, d in enumerate(before))
        i_dst = sum(at[d] << (m - 1 - t) for t, d in enumerate(after))
        order[i_dst] = i_src
    return tuple(order)


def _grad(p: DTensor) -> DTensor | None:
    """A DTensor parameter's gradient, a DTensor too (torch types ``.grad`` as a plain tensor)."""
    return cast("DTensor | None", p.grad)


def _reordered(t: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """``t`` with its dim-1 blocks in ``order`` (block i of the result is block ``order[i]`` of ``t``)."""
    if order is None:
        return t
    return t.unflatten(1, (len(order), -1))[:, list(order)].flatten(1, 2)


def _inverse(order: tuple[int, ...] | None) -> tuple[int, ...] | None:
    if order is None:
        return None
    out = [0] * len(order)
    for i, o in enumerate(order):
        out[o] = i
    return tuple(out)


def check_same_strategy(nodes: Sequence[str], degrees: Sequence[Degrees], rest: Any = ()) -> None:
    """Raise ``OptionError`` unless every rank of the world passes the same ``nodes``, ``degrees`` and ``rest``
    (collective: one all-gather of a digest, a second naming the first node that differs). Ranks that run
    different strategies post different collectives and wait on each other until the timeout: a strategy searched
    on each rank from its own timings can differ by rank on a near tie."""
    rows = torch.tensor([[hash64(n), d.sample, d.column, d.row, d.spatial] for n, d in zip(nodes, degrees)],
                        dtype=torch.int64).reshape(-1, 5)
    head = torch.tensor([len(rows), hash64(repr(rows.tolist())), hash64(repr(rest))], dtype=torch.int64)
    heads = gathered(head)
    rank = dist.get_rank()
    other = next((q for q, h in enumerate(heads) if not torch.equal(h, head)), None)
    if other is None:
        return
    fix = ("every rank must pass the same strategy: search it once (on rank 0) and broadcast it, or load it from "
           "one plan")
    if any(int(h[0]) != len(rows) for h in heads):
        raise OptionError(f"the ranks' strategies differ: rank {rank} has {len(rows)} nodes, rank {other} "
                          f"{int(heads[other][0])}; {fix}")
    theirs = gathered(rows)[other]
    where = next((i for i in range(len(rows)) if not torch.equal(rows[i], theirs[i])), None)
    if where is None:
        raise OptionError(f"the ranks' strategies differ: rank {rank} and rank {other} pass other stages, "
                          f"microbatches, schedule or bucketing; {fix}")
    d = Degrees(*(int(v) for v in theirs[where][1:]))
    same = int(theirs[where][0]) == int(rows[where][0])
    name = repr(nodes[where]) if same else f"{nodes[where]!r} (rank {other}: another node)"
    raise OptionError(f"the ranks' strategies differ: rank {rank} runs node {name} as {degrees[where].name}, "
                      f"rank {other} as {d.name}; {fix}")


@dataclass(frozen=True)
class StrategyOptions:
    """How a :class:`StrategyRuntime` pipelines and syncs; the same on every rank (the ranks check that they agree).

    Attributes:
        stages: The node each pipeline stage but the last ends with; (): one stage.
        microbatches: Microbatches per step when ``schedule`` is a name.
        schedule: A synchronous :class:`Schedule`, or a name generated for the stages and ``microbatches``.
        bucket_layers: Sync every layer of a group in one flat buffer cut into ``BUCKET_BYTES`` buckets (DDP's),
            not one buffer per layer.
        timeout: How long every collective waits; None: torch's default.
    """

    stages: Sequence[str] = ()
    microbatches: int = 1
    schedule: Schedule | str = "gpipe"
    bucket_layers: bool = False
    timeout: timedelta | None = None


class StrategyRuntime:
    """Train ``module`` (an fx GraphModule) with one configuration per node on a (2, ..., 2) mesh, or on a
    pipeline of such groups.

    ``nodes[i]`` (a node name of ``module``'s graph) runs ``degrees[i]``; ``specs[i]`` says its kind
    (``fxpipe.passes.strategy_graph`` makes all three). ``train_step(x, target, optimizer)`` takes the
    whole batch on every rank, like one process: the loss is ``loss_fn``'s mean over it.
    ``parameters()`` are DTensors, for any torch optimizer; ``full_parameters()`` and
    ``full_grads()`` gather them whole (collectives: every rank of the group calls them).

    **Pipelined** (``stages``: the node each stage but the last ends with): the world is ``pp x g``
    ranks, a mesh ``("pp", "m0", ...)``; the ranks at pipeline position p run that stage's nodes in
    their configurations on their group of g. A stage sends its last node's output split over the
    batch on every rank of its group (each rank its slice, to the rank at the same place in the next
    group), the next stage starts from it (``planning.strategies.stage_graph`` costs a stage this
    way). So the g ranks of a group are g lanes, and the rank at place c of every group is one
    pipeline, as replica c of a ``("pp", "dp")`` mesh with dp = g (without replicas' gradient
    averaging: ``sync`` sums each layer's gradients inside its group).

    **Steps** run on the executor core, one or many stages alike: ``schedule`` (a synchronous
    :class:`Schedule` or a name, generated for ``pp`` stages and ``microbatches``) is lowered
    (``runtime.lower``) for this rank's pipeline position, its messages go through the ``Channel``, and
    ``ActionRunner`` runs each F and backward. A stage's backward is one autograd call (BW): a B of the
    schedule is the whole backward and its W nothing (``fused_backward``). Each group syncs its
    gradients once per step.

    ``bucket_layers``: the gradient sync all-reduces every layer of a sync group in one flat buffer cut into
    ``BUCKET_BYTES`` buckets (DDP's), not one buffer per layer (``build_graph(bucket_layers=True)`` costs it).

    Args:
        module: The model as one fx GraphModule (``strategy_graph``'s); copied, not changed.
        nodes: The node names of ``module``'s graph, one per layer.
        specs: Each node's kind (:class:`LayerSpec`).
        degrees: Each node's configuration.
        options: Stages, schedule, bucketing and timeout (:class:`StrategyOptions`).
        mesh: The (2, ..., 2) mesh, or ``("pp", ...)`` when pipelined; None: made over the world.
        loss_fn: ``loss_fn(outputs, target)``, a mean over the batch.
        host: The process-wide settings this rank asks for (``HostTuning``); None changes none.
        **overrides: Fields of ``options`` by name, replacing its values (the keyword arguments of before
            :class:`StrategyOptions`).

    Raises:
        TypeError: An override that is no field of :class:`StrategyOptions`.
        OptionError: Nodes, specs and configurations that do not match, or the ranks' strategies or options differ.
    """

    def __init__(self, module: fx.GraphModule, nodes: Sequence[str], specs: Sequence[LayerSpec],
                 degrees: Sequence[Degrees], *, options: StrategyOptions = StrategyOptions(),
                 mesh: DeviceMesh | None = None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
                 host: HostTuning | None = None, **overrides: Any) -> None:
        o = self.options = with_overrides(options, overrides, "StrategyRuntime")
        stages, microbatches, schedule, timeout = o.stages, o.microbatches, o.schedule, o.timeout
        bucket_layers = o.bucket_layers
        if not (len(nodes) == len(specs) == len(degrees)):
            raise OptionError(f"one spec and one configuration per node (nodes: {len(nodes)}, specs: {len(specs)}, "
                              f"configurations: {len(degrees)})")
        if microbatches < 1:
            raise OptionError(f"at least 1 microbatch (microbatches: {microbatches})")
        if mesh is None or mesh.size() == dist.get_world_size():  # a mesh over part of the world: its ranks alone
            check_same_strategy(nodes, degrees, (tuple(stages), microbatches, schedule if isinstance(schedule, str) else
                                   repr(schedule), bucket_layers))
        self.module = copy.deepcopy(module)
        self.dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.get_default_dtype())
        self.loss_fn = loss_fn
        self.timeout = timeout
        self.bucket_layers = bucket_layers  # sync: one gradient buffer per group over all layers (DDP's buckets)
        self.counter: CollectiveCounter | None = None
        # The last collectives waited for: gloo's worker thread must never free their tensors (PipelineRuntime._keep).
        self.settled: deque[Any] = deque(maxlen=64)
        self.pp = len(stages) + 1
        self.pipeline = self._pipeline_mesh(mesh)
        if self.pipeline is None:
            self.mesh = mesh if mesh is not None else strategy_mesh(dist.get_world_size(), timeout=timeout)
            self.pp_rank = 0
        else:
            names = self.pipeline.mesh_dim_names or ()  # named: _pipeline_mesh checked or made them
            self.mesh = self.pipeline[tuple(n for n in names if n != "pp")]
            self.pp_rank = self.pipeline.get_local_rank("pp")
        ndim = self.mesh.ndim
        self._identity = tuple(range(ndim))
        self._views = self._make_views()
        self.cuts = tuple(stages)
        self._cuts = set(stages)
        self.layers = {n: _Layer(s, d, mesh_roles(d, ndim), self._identity) for n, s, d in zip(nodes, specs, degrees)}
        graph_nodes = {n.name: n for n in self.module.graph.nodes}
        missing = [n for n in graph_nodes if n not in self.layers]
        if missing:
            raise OptionError(f"node {missing[0]!r} of the model has no configuration; build the strategy from "
                              "strategy_graph of this model")
        self.stage_of = self._stages(list(stages))
        self._mine = [n for n in self.module.graph.nodes if self.stage_of[n.name] == self.pp_rank]
        for node in self._mine:
            self._line_up(node)
        self._groups: dict[tuple[int, ...], Any] = {}
        for layer in self.layers.values():  # every rank, every stage, the same order: groups are made collectively
            self._group(layer.sample_dims)
        # layer -> (name, parameter, its role): each parameter a DTensor (an nn.Parameter made of one)
        self._params: dict[str, list[tuple[str, DTensor, str]]] = {}
        for node in self._mine:
            if node.op == "call_module":
                self._distribute(node, self.module.get_submodule(str(node.target)))
        self.schedule = fused_backward(self._schedule(schedule, microbatches))
        self.microbatches = self.schedule.num_microbatches
        self._layout = self._lane_layout()
        # the process-wide settings the caller asked for (fxpipe.calibration.host.HostTuning; None: none)
        self.channel = Channel(torch.device("cpu"), timeout,
                               yield_after_send=host is not None and host.yields_after_send(None))
        if host is not None:
            host.apply(dist.get_rank(), dist.get_world_size())
        self._programs: dict[int, tuple[Any, _LaneRunner]] = {}
        self._batch = 0
        self._out_mesh = self.mesh

    def _schedule(self, schedule: Schedule | str, microbatches: int) -> Schedule:
        """The schedule the stages run: as given, or generated by name for ``pp`` stages and ``microbatches``."""
        if not isinstance(schedule, Schedule):
            schedule = generate(schedule, self.pp, microbatches)
        check_schedule(schedule, self.pp)
        return schedule

    def _lane_layout(self) -> replicas.Layout:
        """This rank as the runtime's layout sees it: pipeline position ``pp_rank`` of the lane at its place c in
        its group, whose ranks are the ranks at place c of every group."""
        rank = dist.get_rank()
        group = [int(r) for r in self.mesh.mesh.flatten().tolist()]
        c = group.index(rank)
        grid = self.pipeline.mesh.reshape(self.pp, -1).tolist() if self.pipeline is not None else [group]
        return replicas.Layout(self.pipeline if self.pipeline is not None else self.mesh, len(group), self.pp_rank,
                               c, tuple(int(grid[q][c]) for q in range(self.pp)))

    def _pipeline_mesh(self, mesh: DeviceMesh | None) -> DeviceMesh | None:
        if self.pp == 1:
            return None
        if mesh is not None:
            if mesh.mesh_dim_names is None or mesh.mesh_dim_names[0] != "pp" or mesh.size(0) != self.pp:
                raise OptionError("a pipelined strategy runs on a mesh whose first dimension is 'pp' of size "
                                  f"{self.pp}")
            return mesh
        world = dist.get_world_size()
        group = world // self.pp
        k = group.bit_length() - 1
        if world % self.pp or group < 2 or 1 << k != group:
            raise OptionError(f"{self.pp} stages on {world} ranks: start {self.pp} x a power of two (at least 2) ranks")
        return _shared_mesh("cpu", torch.arange(world).view((self.pp,) + (2,) * k),
                            ("pp",) + tuple(f"m{i}" for i in range(k)), self.timeout)

    def _stages(self, cuts: list[str]) -> dict[str, int]:
        order = list(self.module.graph.nodes)
        names = [n.name for n in order]
        unknown = [c for c in cuts if c not in names]
        if unknown:
            raise OptionError(f"stage cut {unknown[0]!r} is not a node of the model")
        positions = [names.index(c) for c in cuts]
        if positions != sorted(set(positions)) or (positions and positions[-1] >= len(order) - 2):
            raise OptionError("stage cuts must be distinct nodes in the model's order, each leaving a stage after it")
        stage_of, stage = {}, 0
        for i, node in enumerate(order):
            stage_of[node.name] = stage
            if stage < len(positions) and i == positions[stage]:
                stage += 1
        for node in order:
            for a in node.all_input_nodes:
                s_a, s_n = stage_of[a.name], stage_of[node.name]
                if s_a != s_n and not (s_n == s_a + 1 and a.name == cuts[s_a]):
                    raise OptionError(f"{a.name!r} -> {node.name!r} crosses a stage cut that does not end with it; "
                                      "cut where one tensor crosses (between blocks)")
        return stage_of

    # --- set-up -------------------------------------------------------------------------------

    def _make_views(self) -> dict[tuple[int, ...], DeviceMesh]:
        """One DeviceMesh per order of the group's mesh dims (k! of them for 2^k ranks), made collectively by every
        rank in the same order: a layer's view decides the order its split blocks nest in."""
        views = {self._identity: self.mesh}
        base = self.pipeline if self.pipeline is not None else self.mesh
        lead = 1 if self.pipeline is not None else 0
        for perm in sorted(itertools.permutations(self._identity)):
            if perm == self._identity:
                continue
            tag = "".join(map(str, perm))
            names = tuple(f"v{tag}_{j}" for j in range(len(perm)))
            order = tuple(range(lead)) + tuple(lead + p for p in perm)
            whole = _shared_mesh(base.device_type, base.mesh.permute(order), (("pp",) if lead else ()) + names,
                                 self.timeout)
            views[perm] = whole[names] if lead else whole
        self._perm_of = {id(m): p for p, m in views.items()}
        return views

    def view(self, perm: tuple[int, ...]) -> DeviceMesh:
        """The group's mesh with its dims in the order ``perm`` (view dim j is base dim ``perm[j]``)."""
        return self._views[perm]

    def _line_up(self, node: fx.Node) -> None:
        """Give ``node`` the view of the mesh (an order of its dims, roles in the order s, c, r over it) whose
        placements its producers' outputs fit best: moved on a view where their blocks keep nesting (the cost
        model assumes split blocks line up: a split kept on the same ranks moves nothing), then nested with
        what the node reads, then equal to it; the base view on a tie. A matmul reads its input's channels
        in any order (``_reads_any_order``), so it can take the base view where its input nests the other way:
        its output then nests in the base order too, and a residual add's two inputs agree. A stage's last
        node keeps the base view: the next stage reads its slices in the base order."""
        layer = self.layers[node.name]
        producers = [(self._held_by(a, node), self.layers[a.name].perm if self._same_stage(a, node) else
                      self._identity) for a in node.all_input_nodes]
        if not producers or self.mesh.ndim < 2:
            return
        reorder = self._reads_any_order(node)
        perms = [self._identity] if node.name in self._cuts else sorted(itertools.permutations(self._identity))
        best = layer.perm
        best_score: tuple[int, ...] = (-1, -1, -1)
        order: tuple[int, ...] | None = None  # a producer's block order (only a one-input matmul reorders)
        best_order = order
        for perm in perms:
            trial = _Layer(layer.spec, layer.degrees, layer.roles, perm)
            needed = self._needed(trial)[0]
            score = [0, 0, 0]
            for held, src in producers:
                via, order, (nested, equal) = _route(held, src, perm, needed, list(self._views), reorder)
                score = [score[0] + (via is not None), score[1] + nested, score[2] + equal]
            if tuple(score) > best_score:
                best, best_score, best_order = perm, tuple(score), order
        layer.perm, layer.order = best, best_order

    def _same_stage(self, a: fx.Node, node: fx.Node) -> bool:
        return self.stage_of[a.name] == self.stage_of[node.name]

    def _held_by(self, a: fx.Node, node: fx.Node) -> tuple[Any, ...]:
        """The placements ``node`` finds its input ``a`` in: ``a``'s own, or, from the previous stage, its slices."""
        return self._held(self.layers[a.name]) if self._same_stage(a, node) else self._sliced()

    def _reads_any_order(self, node: fx.Node) -> bool:
        """A Linear or convolution whose one input's dim 1 is its weight's input dim: it can hold its weight's dim 1
        in the order its input's blocks arrive in (``_block_order``), so no block needs to move for the order."""
        layer = self.layers[node.name]
        inputs = node.all_input_nodes
        if layer.spec.kind != "matmul" or node.op != "call_module" or len(inputs) != 1:
            return False
        shape, module = self.layers[inputs[0].name].spec.shape, self.module.get_submodule(str(node.target))
        rank = 2 if isinstance(module, nn.Linear) else module.weight.dim() if isinstance(module, _CONV) else 0
        return len(shape) == rank > 0 and shape[1] == layer.spec.in_features > 0

    def _to(self, value: DTensor, layer: _Layer, needed: tuple[Any, ...], label: str) -> DTensor:
        """``value`` (a producer's output, on its view) as ``layer`` reads it: on the layer's view, in ``needed``
        (moved on the view ``_route`` picks: the one ``_line_up`` planned, weight order included)."""
        src, dst = self._perm_of[id(value.device_mesh)], layer.perm
        via, order, _ = _route(value.placements, src, dst, needed, list(self._views), layer.order is not None)
        if order != layer.order:
            raise RuntimeError(f"node {label!r}: its input arrives in block order {order}, its weight is held in "
                               f"{layer.order} (the strategy runtime planned it from other placements)")
        if via is None:  # blocks that nest on no view: the split dims gathered on the producer's first
            value = _Move.apply(value, tuple(_R if p.is_shard() else p for p in value.placements), label, self)
            value = _View.apply(value, src, dst, label, self) if src != dst else value
            src = via = dst
        if via != src:
            value = _View.apply(value, src, via, label, self, order is not None)
        there, _ = _reinterpret(needed, dst, via)
        if value.placements != there:
            value = _Move.apply(value, there, label, self)
        return _View.apply(value, via, dst, label, self) if via != dst else value

    def _group(self, dims: tuple[int, ...]) -> Any:
        if len(dims) == 0:
            return None
        if dims not in self._groups:
            names = tuple(self.mesh.mesh_dim_names[i] for i in dims)  # type: ignore[index]
            sub = (self.mesh[names[0]] if len(names) == 1
                   else flatten_mesh(self.mesh[names], "_".join(names), gloo_options(self.timeout)))
            self._groups[dims] = sub.get_group()
        return self._groups[dims]

    def _distribute(self, node: fx.Node, module: nn.Module) -> None:
        layer = self.layers[node.name]
        roles = layer.roles
        params = dict(module.named_parameters(recurse=False))
        if not params:
            return
        if isinstance(module, (nn.Linear, *_CONV)):
            if isinstance(module, _CONV) and (module.groups != 1 or module.padding_mode != "zeros"):
                raise OptionError(f"node {node.name!r}: the strategy runtime runs convolutions with groups=1 and "
                                  "zero padding")
            what = {"weight": "weight", "bias": "bias"}
        elif isinstance(module, _NORM):
            if module.momentum is None or not module.affine:
                raise OptionError(f"node {node.name!r}: the strategy runtime runs affine BatchNorm with a momentum")
            what = {"weight": "norm", "bias": "norm"}
            for name in ("running_mean", "running_var"):
                buf = getattr(module, name)
                if buf is not None:
                    setattr(module, name, distribute_tensor(buf, self.view(layer.perm), _placements("norm", roles)))
        else:
            raise OptionError(f"node {node.name!r} is a {type(module).__name__} with parameters; the strategy "
                              "runtime runs Linear, convolutions and BatchNorm")
        self._params[node.name] = []
        for name, p in params.items():
            whole = _reordered(p.detach(), layer.order) if name == "weight" else p.detach()
            dt = distribute_tensor(whole, self.view(layer.perm), _placements(what[name], roles))
            setattr(module, name, nn.Parameter(dt, requires_grad=p.requires_grad))
            self._params[node.name].append((name, getattr(module, name), what[name]))

    # --- parameters ---------------------------------------------------------------------------

    def parameters(self) -> Iterator[DTensor]:
        for entries in self._params.values():
            for _, p, _ in entries:
                yield p

    def named_parameters(self) -> Iterator[tuple[str, DTensor]]:
        """This stage's parameters by the model's qualified names (``features.0.weight``)."""
        for node in self._mine:
            for name, p, _ in self._params.get(node.name, ()):
                yield f"{node.target}.{name}", p

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """This stage's parameters, whole, as the model holds them (``named_parameters`` holds the weight of a layer
        that reads its input's blocks reordered with its dim 1 in that order: ``_block_order``)."""
        return {n: self._unordered(n, p.full_tensor()) for n, p in self.named_parameters()}

    def full_grads(self) -> dict[str, torch.Tensor]:
        grads = ((n, _grad(p)) for n, p in self.named_parameters())
        return {n: self._unordered(n, g.full_tensor()) for n, g in grads if g is not None}

    def _unordered(self, qualified: str, t: torch.Tensor) -> torch.Tensor:
        """A whole parameter (or its gradient) named ``qualified`` in the model's order."""
        target, name = qualified.rsplit(".", 1)
        node = next(n for n in self._mine if n.op == "call_module" and n.target == target)
        return _reordered(t, _inverse(self.layers[node.name].order)) if name == "weight" else t

    def full_buffers(self) -> dict[str, torch.Tensor]:
        """This stage's buffers (BatchNorm's running statistics), whole."""
        out = {}
        for node in self._mine:
            if node.op == "call_module":
                for name, b in self.module.get_submodule(str(node.target)).named_buffers(recurse=False):
                    out[f"{node.target}.{name}"] = b.full_tensor() if isinstance(b, DTensor) else b
        return out

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
        """``optimizer``'s state of this stage's parameters, whole and in the model's order, by parameter name (a
        collective over the stage's group, as :meth:`full_parameters`)."""
        out: dict[str, dict[str, Any]] = {}
        for n, p in self.named_parameters():
            state = optimizer.state.get(p)
            if not state:
                continue
            out[n] = {}
            for key, value in state.items():
                if isinstance(value, DTensor):
                    whole = value.full_tensor()
                    value = self._unordered(n, whole) if whole.shape == p.shape else whole
                elif isinstance(value, torch.Tensor):
                    value = value.detach().clone()
                out[n][key] = value
        return out

    def load_full(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                  optimizer: torch.optim.Optimizer | None = None, optim: dict[str, dict[str, Any]] | None = None
                  ) -> None:
        """Load whole tensors (as :meth:`full_parameters`, :meth:`full_buffers` and :meth:`full_optimizer_state`
        give them) into this rank's shards; no communication (every rank has the whole tensors)."""
        with torch.no_grad():
            for n, p in self.named_parameters():
                p.to_local().copy_(self._like(n, p, params[n]).to_local())
                if optimizer is not None and optim is not None and n in optim:
                    optimizer.state[p] = {
                        k: self._like(n, p, v) if isinstance(v, torch.Tensor) and v.shape == p.shape else v
                        for k, v in optim[n].items()}
            for node in self._mine:
                if node.op != "call_module":
                    continue
                for name, b in self.module.get_submodule(str(node.target)).named_buffers(recurse=False):
                    whole = buffers[f"{node.target}.{name}"]
                    if isinstance(b, DTensor):
                        b.to_local().copy_(distribute_tensor(whole.to(b.dtype), b.device_mesh, b.placements,
                                                             src_data_rank=None).to_local())
                    else:
                        b.copy_(whole)

    def _like(self, qualified: str, p: DTensor, whole: torch.Tensor) -> DTensor:
        """A whole tensor in the model's order laid out as parameter ``qualified`` is (its blocks, its shards)."""
        target, name = qualified.rsplit(".", 1)
        node = next(n for n in self._mine if n.op == "call_module" and n.target == target)
        if name == "weight":
            whole = _reordered(whole, self.layers[node.name].order)
        return distribute_tensor(whole.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)

    def global_grad_norm(self, group_size: int) -> float:
        """The whole model's gradient norm (every stage's parameters, counted once) on every rank: each stage's
        norm over its group, then one all-reduce over the world (each of a stage's ``group_size`` ranks adds its
        share)."""
        square = torch.zeros((), dtype=torch.float64)
        for p in self.parameters():
            if p.grad is not None:
                square += float(torch.linalg.vector_norm(p.grad).full_tensor()) ** 2
        self._all_reduce(square)
        return math.sqrt(float(square) / group_size)

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the world and keep the work (:attr:`settled`)."""
        work = dist.all_reduce(tensor, async_op=True)
        work.wait()
        self.settled.append(work)

    @contextlib.contextmanager
    def count(self) -> Iterator[CollectiveCounter]:
        """Record every collective of the steps run inside (``CollectiveCounter``)."""
        counter = CollectiveCounter()
        self.counter = counter
        try:
            with counter:
                yield counter
        finally:
            self.counter = None

    # --- one step -----------------------------------------------------------------------------

    def _module(self, node: fx.Node, module: nn.Module, args: list[Any], kwargs: dict[str, Any]) -> torch.Tensor:
        layer = self.layers[node.name]
        entries = self._params.get(node.name)
        if not entries:
            return module(*args, **kwargs)
        roles = layer.roles
        local = {name: p.to_local(grad_placements=_placements(what + "_grad", roles)) for name, p, what in entries}
        x = args[0]
        if isinstance(module, _NORM):
            return self._norm(node.name, module, layer, x, local)
        weight, bias = local["weight"], local.get("bias")
        if bias is not None and "r" in roles:
            coords: Sequence[int] = self.view(layer.perm).get_coordinate() or ()
            first = all(coords[i] == 0 for i, r in enumerate(roles) if r == "r")
            # the sum over row ranks adds it once; every rank's grad is whole
            bias = bias if first else bias - bias.detach()
        if isinstance(module, nn.Linear):
            return F.linear(x, weight, bias)
        assert isinstance(module, _CONV)  # the layers with parameters set up (_distribute refused others)
        conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[weight.dim() - 2]
        return conv(x, weight, bias, module.stride, module.padding, module.dilation, 1)

    def _norm(self, name: str, module: nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d, layer: _Layer,
              x: torch.Tensor, local: dict[str, torch.Tensor]) -> Any:
        # The running statistics are DTensors since _distribute, which refused a BatchNorm without a momentum.
        mean, var = cast(DTensor, module.running_mean), cast(DTensor, module.running_var)
        momentum = cast(float, module.momentum)
        mean_l, var_l = mean.to_local(), var.to_local()
        group = self._group(layer.sample_dims)
        if module.training:
            cast(torch.Tensor, module.num_batches_tracked).add_(1)
            if group is not None:
                return _BatchNormSync.apply(x, local["weight"], local["bias"], (module, mean_l, var_l), group, name,
                                            self)
        return F.batch_norm(x, mean_l, var_l, local["weight"], local["bias"], module.training, momentum, module.eps)

    def _held(self, layer: _Layer) -> tuple[Any, ...]:
        if layer.spec.kind == "matmul":
            return _placements("out", layer.roles)
        return _placements("act", layer.roles)

    def _needed(self, layer: _Layer) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        if layer.spec.kind == "matmul":
            return _placements("in", layer.roles), _placements("in_grad", layer.roles)
        act = _placements("act", layer.roles)
        return act, act

    def _sliced(self) -> tuple[Any, ...]:
        return (_S0,) * self.mesh.ndim  # the input, the loss, and what a stage sends: the batch split on every rank

    def forward(self, x: torch.Tensor | DTensor) -> DTensor:
        """This stage's output: on ``x`` (the whole batch, first stage) or the previous stage's output (a DTensor)."""
        env: dict[fx.Node, Any] = {}
        if isinstance(x, DTensor):
            cut = next(a for n in self._mine for a in n.all_input_nodes if self.stage_of[a.name] != self.pp_rank)
            env[cut] = x
        for node in self._mine:
            layer = self.layers[node.name]
            if node.op == "placeholder":
                view = self.view(layer.perm)
                whole = DTensor.from_local(x, view, (_R,) * view.ndim, run_check=False)
                env[node] = whole.redistribute(view, self._held(layer))  # a local slice: no collective
                continue
            if node.op == "output":
                return env[node.args[0]]
            needed, grads = self._needed(layer)
            moved: dict[fx.Node, Any] = {}

            def local(a: fx.Node) -> Any:
                value = env[a]
                if not isinstance(value, DTensor):
                    return value
                if a not in moved:
                    moved[a] = self._to(value, layer, needed, node.name).to_local(grad_placements=grads)
                return moved[a]

            args = fx.node.map_arg(node.args, local)
            kwargs = fx.node.map_arg(node.kwargs, local)
            if node.op == "call_module":
                out = self._module(node, self.module.get_submodule(str(node.target)), list(args), dict(kwargs))
            elif node.op == "call_function":
                out = node.target(*args, **kwargs)
            elif node.op == "call_method":
                out = getattr(args[0], str(node.target))(*args[1:], **kwargs)
            else:
                raise OptionError(f"node {node.name!r} ({node.op}) cannot run on the strategy runtime")
            if not isinstance(out, torch.Tensor):
                raise OptionError(f"node {node.name!r} returns {type(out).__name__}, not a tensor; the strategy "
                                  "runtime runs tensor-to-tensor models")
            env[node] = DTensor.from_local(out, self.view(layer.perm), self._held(layer), run_check=False)
        return env[self._mine[-1]]

    def _lane_forward(self, value: torch.Tensor) -> torch.Tensor:
        """This stage's forward on one lane: from the whole microbatch (the first stage) or this rank's slice of
        the previous stage's output, to this rank's slice of the stage's output (split over the batch on every
        mesh dim). A middle stage's slice is on the group's base view, as the next stage reads it; the last
        stage's is on its output's own view, and ``_lane_loss`` slices the target the same way."""
        held = self._sliced()
        if self.pp_rank > 0:
            value = DTensor.from_local(value, self.mesh, held, run_check=False)
        out = self.forward(value)
        last = self.pp_rank == self.pp - 1
        label = next(n for n in self.module.graph.nodes if n.op == "output").name if last else "(send)"
        if out.placements != held:
            out = _Move.apply(out, held, label, self)
        self._out_mesh = out.device_mesh
        return out.to_local(grad_placements=held)

    def _lane_loss(self, outputs: Sequence[torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        """This rank's share of the loss: ``loss_fn`` on its slice of a microbatch's output and target, scaled so
        the shares of every rank and microbatch sum to ``loss_fn`` on the whole batch (a mean)."""
        (out,) = outputs
        mesh = self._out_mesh
        whole = DTensor.from_local(target, mesh, (_R,) * mesh.ndim, run_check=False)
        mine = whole.redistribute(mesh, self._sliced()).to_local()  # a local slice: no collective
        return self.loss_fn(out, mine) * (out.shape[0] / self._batch)

    # --- one step on the executor core --------------------------------------------------------------

    def _program(self, rows: int) -> tuple[Any, _LaneRunner]:
        """This rank's lowered program and core for microbatches of ``rows`` rows per lane (made once per size)."""
        if rows not in self._programs:
            lanes = _Lanes.of(self, rows)
            program = replicas.on_ranks(lower(lanes, self.schedule, self.pp_rank, lanes.graphs), self._layout)
            self._programs[rows] = (program, _LaneRunner(lanes, self._lane_loss))
        return self._programs[rows]

    def _step(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Every microbatch's F and backward of this rank's stage in the schedule's order, through the executor
        core; messages from ``lower`` (shapes from the traced graph), sent and received by the ``Channel``. This
        rank's summed loss shares."""
        m, lanes = self.schedule.num_microbatches, self.mesh.size()
        rows = x.shape[0]
        if self.pp > 1 and rows % (m * lanes):
            raise OptionError(f"a {rows}-row batch does not split evenly into {m} microbatches over the {lanes} ranks "
                              f"of a stage; pass a batch that is a multiple of {m * lanes}, or other microbatches")
        program, core = self._program(rows // (m * lanes))
        self._batch = rows
        name = core.pipe.input_names[0]
        core.begin([{name: xi} if self.pp_rank == 0 else {} for xi in x.tensor_split(m)], list(target.tensor_split(m)))
        posted = [[self.channel.recv(msg.shape, msg.dtype, msg.src, msg.tag, on_error=self._failed_recv(msg, op.action))
                   for msg in op.recvs] for op in program.ops]
        for op, items in zip(program.ops, posted):
            for msg, item in zip(op.recvs, items):
                buf = self.channel.wait(item, self._failed_recv(msg, op.action))
                (core.values if msg.direction == FORWARD else core.grads)[msg.mb][msg.name] = buf
            core.shares = {}
            core.run(op.action)
            for msg in op.sends:
                value = core.values[msg.mb][msg.name] if msg.direction == FORWARD else core.shares[msg.name]
                self.channel.send(value, msg.dst, msg.tag, on_error=self._failed_send)
            self.channel.poll()
        self.channel.flush(self._failed_send)
        total = torch.zeros((), dtype=x.dtype if x.is_floating_point() else torch.float64)
        for loss in core.losses:
            if loss is not None:
                total = total + loss
        return total

    def _failed_recv(self, msg: Message, action: Action) -> Callable[[Exception], BaseException]:
        what = msg.name if msg.direction == FORWARD else f"grad of {msg.name}"
        return lambda exc: peer_down(exc, [msg.src], f"{what} of microbatch {msg.mb} (stage {msg.stage}) from rank "
                                     f"{msg.src} at {action}", rank=dist.get_rank(), timeout=self.timeout)

    def _failed_send(self, exc: Exception, dst: int) -> BaseException:
        return peer_down(exc, [dst], f"its sends to rank {dst} to complete", rank=dist.get_rank(), timeout=self.timeout)

    def train_step(self, x: torch.Tensor, target: torch.Tensor, optimizer: torch.optim.Optimizer, *,
                   before_step: Callable[[], None] | None = None) -> float:
        """Forward, backward, gradient sync and ``optimizer.step()`` on the whole batch; the mean loss.
        ``before_step``: called after the sync and before the step (the global gradient norm and clipping)."""
        optimizer.zero_grad(set_to_none=True)
        total = self._step(x, target)
        self.sync()
        if before_step is not None:
            before_step()
        optimizer.step()
        with _at(self.counter, "(loss value)"):
            self._all_reduce(total)  # every rank of the last stage holds its own slice: the shares sum to the mean
        return float(total)

    def sync(self) -> None:
        """All-reduce each layer's parameter gradients over the ranks holding the same shard (one flat buffer
        per layer, ``BUCKET_BYTES`` buckets; with ``bucket_layers``, one flat buffer per sync group and dtype
        over all its layers, cut into ``BUCKET_BYTES`` buckets as DDP does), leaving every gradient in its
        parameter's placements."""
        units: dict[Any, tuple[str, Any, list[tuple[Any, Any]]]] = {}  # key -> (counter label, group, grads)
        for name, entries in self._params.items():
            layer = self.layers[name]
            group = self._group(layer.sample_dims)
            grads = [(p, g) for _, p, _ in entries if (g := _grad(p)) is not None]
            if not grads:
                continue
            if group is None:
                for p, g in grads:
                    p.grad = DTensor.from_local(g.to_local(), p.device_mesh, p.placements, run_check=False)
                continue
            key = (layer.sample_dims, grads[0][1].dtype) if self.bucket_layers else name
            label = f"(gradients over mesh dims {layer.sample_dims})" if self.bucket_layers else name
            units.setdefault(key, (label, group, []))[2].extend(grads)
        pending = []
        for label, group, grads in units.values():  # the same order on every rank: the layers'
            locals_ = [g.to_local() for _, g in grads]
            flat = torch.cat([t.reshape(-1) for t in locals_])
            per = max(1, int(BUCKET_BYTES // flat.element_size()))
            with _at(self.counter, label):
                works = [dist.all_reduce(chunk, group=group, async_op=True) for chunk in flat.split(per)]
            pending.append((grads, locals_, flat, works))
        for grads, locals_, flat, works in pending:
            for w in works:
                w.wait()
            self.settled.extend(works)
            offset = 0
            for (p, _), t in zip(grads, locals_):
                piece = flat[offset:offset + t.numel()].view_as(t)
                offset += t.numel()
                p.grad = DTensor.from_local(piece, p.device_mesh, p.placements, run_check=False)


# --- the strategy's stages as the executor core sees them ---------------------------------------------


class _LaneStage:
    """Stage ``p`` for the executor core (``runtime.core``): a stage without split graphs, run under autograd (its
    forward computes on DTensors; its backward is one autograd call, BW), taking and giving this rank's lane."""

    def __init__(self, rt: StrategyRuntime, p: int, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> None:
        self.rt, self.p, self.inputs, self.outputs = rt, p, inputs, outputs
        self.module = self

    def __call__(self, value: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.rt._lane_forward(value),)

    def parameters(self) -> Iterator[DTensor]:
        return self.rt.parameters() if self.p == self.rt.pp_rank else iter(())


@dataclass
class _Lanes:
    """The strategy's stages as a pipeline of one lane: what ``lower`` and ``ActionRunner`` read of a ``Pipeline``.
    A value crossing stages is one rank's slice of the cut node's output, ``rows`` rows of the batch."""

    stages: list[_LaneStage]
    graphs: list[StageGraphs]
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    output_constants: tuple[Any, ...] = (None,)
    out_spec: Any = None

    def stage_list(self) -> list[_LaneStage]:
        return self.stages

    @classmethod
    def of(cls, rt: StrategyRuntime, rows: int) -> _Lanes:
        nodes = list(rt.module.graph.nodes)
        placeholder = next(n for n in nodes if n.op == "placeholder")
        output = next(n for n in nodes if n.op == "output")
        ends = [*rt.cuts, output.args[0].name]
        values = [placeholder.name, *rt.cuts, output.name]

        def meta(node: str) -> torch.Tensor:
            shape = rt.layers[node].spec.shape
            if not shape:
                raise OptionError(f"node {node!r} ends a stage and its output's shape is unknown; trace the model "
                                  "with strategy_graph")
            return torch.empty((rows, *shape[1:]), dtype=rt.dtype, device="meta")

        stages, graphs = [], []
        for p in range(rt.pp):
            stages.append(_LaneStage(rt, p, (values[p],), (values[p + 1],)))
            graphs.append(StageGraphs(None, None, None, num_outputs=1, grad_inputs=(0,) if p else (),
                                      grad_outputs=(0,), fused_reason="a per-layer strategy stage runs under autograd",
                                      interface=((meta(values[p]) if p else None,), (meta(ends[p]),))))
        return cls(stages, graphs, (placeholder.name,), (output.name,))


class _LaneRunner(ActionRunner):
    """The core with a strategy stage's policies: an input gradient goes back as a message (the producer is the
    previous stage, on another rank), and the loss is each rank's share (``StrategyRuntime._lane_loss``)."""

    def __init__(self, lanes: _Lanes, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__(lanes, lanes.graphs, loss_fn)
        self.shares: dict[str, torch.Tensor] = {}

    def deliver(self, s: int, m: int, name: str, grad: torch.Tensor) -> None:
        self.shares[name] = grad


def fused_backward(schedule: Schedule) -> Schedule:
    """``schedule`` with each B the whole backward (BW) and each W dropped: a strategy stage's backward is one
    autograd call that also makes its parameters' gradients. A synchronous step updates only at its end, so
    where a W ran changes nothing, and B's messages (the input gradient out, the output gradient in) are BW's."""
    ranks = tuple(tuple(dataclasses.replace(a, kind=Kind.BW) if a.kind is Kind.B else a for a in actions
                        if a.kind is not Kind.W) for actions in schedule.ranks)
    return dataclasses.replace(schedule, ranks=ranks, batch_w=False)


class StrategyState:
    """A strategy runtime, its optimizer and learning-rate scheduler as ``fxpipe.runtime.checkpoint`` saves and
    loads a runtime: every tensor whole and in the model's order (gathered over the stage's ranks, which save it
    alike; DCP keeps one copy), by the model's parameter names, so the checkpoint format is the pipelines'."""

    def __init__(self, rt: StrategyRuntime, optimizer: torch.optim.Optimizer, scheduler: Any, *, stages: int,
                 schedule: str) -> None:
        from types import SimpleNamespace

        self.rt, self.optimizer, self.scheduler = rt, optimizer, scheduler
        self.rank, self.dp_rank, self.pp_rank = dist.get_rank(), 0, rt.pp_rank
        self.pipe = SimpleNamespace(num_stages=stages, shared_params={})
        self.schedule = SimpleNamespace(name=schedule)
        self.where: dict[int, int] = {}

    def state_dict(self) -> dict[str, Any]:
        """Collective over every rank (each gathers its stage's tensors)."""
        names = {id(p): n for n, p in self.rt.named_parameters()}
        groups = [{"params": [names[id(p)] for p in g["params"] if id(p) in names],
                   **{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()
                      if k != "params" and (v is None or isinstance(v, (bool, int, float, str, tuple)))}}
                  for g in self.optimizer.param_groups]
        runtime = {"lr_step": float(self.scheduler.last_epoch)} if self.scheduler is not None else {}
        return {"rank": self.rank, "params": self.rt.full_parameters(), "buffers": self.rt.full_buffers(),
                "optim": self.rt.full_optimizer_state(self.optimizer), "param_groups": groups,
                "runtime": {**runtime, **getattr(self, "data_position", {})}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rt.load_full(state["params"], state["buffers"], self.optimizer, state.get("optim", {}))
        run = state.get("runtime", {})
        self.resumed_position = {k: v for k, v in run.items() if k.startswith("data_")}
        if self.scheduler is not None and "lr_step" in run:
            self.scheduler.last_epoch = int(run["lr_step"])
            lrs = [base * fn(self.scheduler.last_epoch) for base, fn in zip(self.scheduler.base_lrs,
                                                                            self.scheduler.lr_lambdas)]
            for group, lr in zip(self.optimizer.param_groups, lrs):
                group["lr"] = lr
            self.scheduler._last_lr = lrs
