"""Gradient sync in buckets over layers (``StrategyOptions(bucket_layers=True)``), 4 gloo processes: VGG (tiny,
float64) under data parallelism and the SplitBrain preset (two sync groups) trains like one process, and the
sync issues one all-reduce per group carrying the bytes the cost model counts."""

from __future__ import annotations

import copy
import os
import subprocess
import tempfile
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fxpipe.models import vgg
from fxpipe.passes.strategy_graph import strategy_graph
from fxpipe.planning.strategies import build_graph, data_parallel, splitbrain, sync_collectives
from tests._helpers import HANG_S, Forked, assert_ranks_ok

WORLD, STEPS, LR = 4, 2, 0.05


def example() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return vgg.make_model("tiny").double(), torch.randn(8, 3, 32, 32, dtype=torch.float64), torch.randint(0, 10, (8,))


def worker(rank: int, init: str, out: str) -> None:
    from fxpipe.runtime.strategy import StrategyOptions, StrategyRuntime

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    net, x, t = example()
    g = strategy_graph(net, (x,))
    graph = build_graph(g.specs, g.edges, WORLD, bandwidth=1e9, latency=1e-4, alltoall=False, bucket_layers=True)
    results = {}
    for name, strategy in (("dp", data_parallel(graph)), ("splitbrain", splitbrain(graph, g.specs, 2))):
        degrees = [graph.layers[v].configs[c].degrees for v, c in enumerate(strategy.choice)]
        rt = StrategyRuntime(g.module, g.nodes, g.specs, degrees, options=StrategyOptions(bucket_layers=True))
        opt = torch.optim.SGD(rt.parameters(), lr=LR)
        steps = []
        for _ in range(STEPS):
            with rt.count() as counter:
                loss = rt.train_step(x, t, opt)
            sync = [r for r in counter.records if r.layer.startswith("(gradients")]
            steps.append({"loss": loss, "grads": rt.full_grads(), "sync": [(r.ranks, r.nbytes) for r in sync]})
        groups = {(d.sample, d.spatial) for s, d in zip(g.specs, degrees) if s.param_bytes and d.sample * d.spatial > 1}
        model_bytes = sum(2 * (n - 1) / n * b for s, d in zip(g.specs, degrees) if s.param_bytes
                          for b, n in sync_collectives(s, d))
        results[name] = {"steps": steps, "groups": len(groups), "model_bytes": model_bytes}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def reference() -> list[tuple[float, dict[str, torch.Tensor]]]:
    net, x, t = example()
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(ref(x), t)
        loss.backward()
        out.append((float(loss.detach()), {n: p.grad.clone() for n, p in ref.named_parameters()}))
        opt.step()
    return out


def test_bucketed_sync_trains_like_one_process_in_one_all_reduce_per_group() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pt")
        ranks = [Forked(["-c", f"from tests.runtime.test_strategy_bucketed import worker; "
                               f"worker({rank}, {f'file://{tmp}/pg'!r}, {out!r})"]) for rank in range(WORLD)]
        assert_ranks_ok([subprocess.CompletedProcess(r.args, r.wait(HANG_S), "", r.communicate()[1]) for r in ranks])
        results: dict[str, Any] = torch.load(out)
    expected = reference()
    for name, got in results.items():
        assert got["groups"] == (1 if name == "dp" else 2), name  # SplitBrain: s4 convolutions, s2c2 / s2r2 classifier
        for step, (loss, grads) in zip(got["steps"], expected):
            assert abs(step["loss"] - loss) < 1e-9, name
            torch.testing.assert_close(step["grads"], grads)
            assert len(step["sync"]) == got["groups"], (name, step["sync"])  # every layer of a group in one bucket
            assert abs(sum(b for _, b in step["sync"]) - got["model_bytes"]) < 1e-6, name
