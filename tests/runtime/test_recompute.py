"""Activation recomputation draws dropout's masks again and updates BatchNorm's statistics once.

The reference executor runs a small model with dropout in both stages and BatchNorm in the first,
with and without recomputation from the same weights and RNG state: the losses, every parameter's
gradient, the buffers and the RNG state after the run must be equal. (The distributed runtime's core,
losses, gradients and held bytes: tests/runtime/test_memory_tracking.py.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fxpipe
from fxpipe.errors import OptionError
from fxpipe.graphs.recompute import draws_random, recompute_graph
from fxpipe.runtime.reference import ReferenceExecutor
from fxpipe.schedules.auto import plan_schedule


class _Dropped(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
        self.bn = torch.nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.dropout(torch.relu(self.bn(self.a(x))), 0.5, training=True)
        return self.c(torch.nn.functional.dropout(torch.relu(self.b(h)), 0.3, training=True))


@pytest.fixture(scope="module")
def dropped() -> fxpipe.Pipeline:
    torch.manual_seed(0)
    return fxpipe.compile(_Dropped().double(), (torch.randn(4, 8, dtype=torch.float64),), stages=2)


def test_recompute_draws_the_same_dropout_and_updates_batchnorm_once(dropped: fxpipe.Pipeline) -> None:
    pipe = dropped
    graphs = pipe.stage_graphs
    assert all(draws_random(g.forward) for g in graphs)  # both stages draw a dropout mask in F
    assert any(n.target is torch.ops.aten.copy_.default for n in graphs[0].forward.graph.nodes)  # F updates bn
    assert not any(n.target is torch.ops.aten.copy_.default for n in recompute_graph(graphs[0]).graph.nodes)
    gen = torch.Generator().manual_seed(1)
    microbatches = [((torch.randn(4, 8, dtype=torch.float64, generator=gen),),
                     torch.randn(4, 4, dtype=torch.float64, generator=gen)) for _ in range(3)]
    state = {k: v.clone() for k, v in pipe.state_dict().items()}

    def run(recompute: tuple[int, ...], seed: int) -> tuple[list[torch.Tensor], dict[str, Any], dict[str, Any]]:
        pipe.load_state_dict(state)
        pipe.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        losses = ReferenceExecutor(pipe, torch.nn.functional.mse_loss, recompute=recompute).run(microbatches)
        after = torch.rand(1)  # the RNG goes on from where the last F left it, recomputing or not
        return [*losses, after], {n: p.grad.clone() for n, p in pipe.named_parameters()}, {
            k: v.clone() for k, v in pipe.state_dict().items()}

    losses, grads, buffers = run((), 7)
    losses_rc, grads_rc, buffers_rc = run((0, 1), 7)
    torch.testing.assert_close(losses_rc, losses, rtol=0, atol=0)
    torch.testing.assert_close(grads_rc, grads)
    torch.testing.assert_close(buffers_rc, buffers)  # running mean and variance: one update per F
    assert [int(v) for k, v in buffers_rc.items() if k.endswith("num_batches_tracked")] == [3]  # 3 microbatches
    _, grads_other, _ = run((0, 1), 8)  # the check can fail: another seed draws other masks, other gradients
    assert any(not torch.equal(grads_other[n], grads[n]) for n in grads)


def test_recompute_refuses_asynchronous_schedules_and_unknown_stages(dropped: fxpipe.Pipeline) -> None:
    pipe = dropped
    ex = ReferenceExecutor(pipe, torch.nn.functional.mse_loss, recompute=[0])
    batches = [((torch.randn(4, 8, dtype=torch.float64),), torch.randn(4, 4, dtype=torch.float64))] * 4
    with pytest.raises(OptionError, match="asynchronous schedules read weight versions"):
        ex.run_async(plan_schedule(pipe.plan, "async-1f1b", 4), batches, lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(OptionError, match="stage 2 cannot recompute: there are 2 stages"):
        ReferenceExecutor(pipe, torch.nn.functional.mse_loss, recompute=[2])
