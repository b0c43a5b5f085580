"""split_backward: F, B and W graphs per stage; run by the reference executor they give eager's gradients."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe import models
from fxpipe._compat import flop_counter_mode
from fxpipe.graphs.convention import StageGraphs
from fxpipe.graphs.split import split_stage
from fxpipe.models import GPT, GPTConfig
from fxpipe.passes.split_backward import _report
from fxpipe.runtime.reference import ReferenceExecutor
from tests._helpers import DataDependent, SkipTied, check_fbw_matches_eager, hf_gpt2, hf_loss, token_ce

ZOO = ["mlp-tiny", "gpt-tiny", "resnet-tiny", "vgg-tiny"]


def _microbatches(zoo: Any, count: int, seed: int = 7) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """``count`` microbatches shaped like the zoo's example batch, with different values."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        inputs = tuple(
            torch.randn(x.shape, generator=gen, dtype=x.dtype) if x.is_floating_point()
            else torch.randint(0, int(x.max()) + 1, x.shape, generator=gen) for x in zoo.example_inputs
        )
        t = zoo.example_target
        target = torch.randint(0, int(t.max()) + 1, t.shape, generator=gen)
        out.append((inputs, target))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("name", ZOO)
def test_zoo_fbw_gradients_equal_eager(name: str, stages: int, dtype: torch.dtype) -> None:
    zoo = models.build(name, dtype=dtype)
    check_fbw_matches_eager(zoo.model, zoo.example_inputs, zoo.loss_fn, _microbatches(zoo, 2), stages)


def test_dropout_uses_the_same_mask_in_f_b_and_w() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.2)).train()
    idx = torch.randint(0, 64, (2, 16))
    mbs = [(tuple([torch.randint(0, 64, (2, 16))]), torch.randint(0, 64, (2, 16))) for _ in range(2)]
    from fxpipe.models.gpt import loss_fn

    pipe = check_fbw_matches_eager(model, (idx,), loss_fn, mbs, 3, seed=123)
    assert any("dropout" in str(n.target) for g in pipe.stage_graphs for n in g.forward.graph.nodes)  # type: ignore[union-attr]


def test_tied_weights_and_a_skip_connection() -> None:
    torch.manual_seed(0)
    model = SkipTied()
    mbs = [((torch.randint(0, 32, (3, 5)),), torch.randint(0, 32, (3, 5))) for _ in range(3)]
    pipe = check_fbw_matches_eager(model, mbs[0][0], token_ce, mbs, 4, granularity="1")
    assert pipe.shared_params == {"head.weight": [0, 3]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("stages", [2, 4])
def test_transformers_gpt2_fbw(stages: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    mbs = [((torch.randint(0, 96, (2, 16)),), torch.randint(0, 96, (2, 16))) for _ in range(2)]
    check_fbw_matches_eager(hf_gpt2().to(dtype), mbs[0][0], hf_loss, mbs, stages)


@pytest.mark.parametrize("name", ZOO)
def test_no_recomputation_b_plus_w_equals_eager_backward_flops(name: str) -> None:
    zoo = models.build(name)
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=3)
    env = dict(zip(pipe.input_names, zoo.example_inputs))
    grads_needed: set[str] = set()
    for stage, g in zip(pipe.stage_list(), pipe.stage_graphs):  # type: ignore[arg-type]
        args = [env[n].detach().requires_grad_(n in grads_needed) if isinstance(env[n], torch.Tensor) else env[n]
                for n in stage.inputs]
        outs = stage.module(*args)
        diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        wrt += [p for p in stage.module.parameters() if p.requires_grad]
        with flop_counter_mode() as counter:
            torch.autograd.grad(diff, wrt, grad_outputs=[torch.ones_like(o) for o in diff], allow_unused=True)
        eager = counter.get_total_flops()
        split = g.flops_backward_input + g.flops_backward_weight
        assert split == g.flops_fused_backward
        assert abs(split - eager) <= 0.01 * max(eager, 1), f"stage {stage.index}: B+W {split} vs eager backward {eager}"
        env.update(zip(stage.outputs, (o.detach() for o in outs)))
        grads_needed.update(stage.outputs[i] for i in g.grad_outputs)


def test_first_stage_has_no_input_gradients_and_w_does_the_weight_work() -> None:
    zoo = models.build("mlp-tiny")
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2)
    first, last = pipe.stage_graphs  # type: ignore[misc]
    assert first.grad_inputs == () and first.flops_backward_input == 0 and first.flops_backward_weight > 0
    assert last.grad_inputs == (0,) and last.flops_backward_input > 0 and last.flops_backward_weight > 0
    stage = pipe.stages[1]
    assert stage.forward is first.forward or stage.forward is last.forward
    assert isinstance(stage.backward_input, torch.fx.GraphModule)
    assert isinstance(stage.backward_weight, torch.fx.GraphModule)
    table = next(r for r in pipe.report() if r.title.startswith("split-backward"))
    assert table.column("B FLOPs")[0] == 0 and table.column("W FLOPs")[0] == first.flops_backward_weight


def test_split_backward_can_be_turned_off() -> None:
    zoo = models.build("mlp-tiny")
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2, split_backward=False)
    assert pipe.stage_graphs is None
    assert pipe.stages[0].backward_input is None


def test_the_executor_runs_a_fused_stage_with_one_backward() -> None:
    zoo = models.build("gpt-tiny", dtype=torch.float64)
    ref = copy.deepcopy(zoo.model)
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=3)
    pipe.stages[1].graphs = StageGraphs(None, None, None, fused_reason="forced in this test")
    mbs = _microbatches(zoo, 2)
    ex = ReferenceExecutor(pipe, zoo.loss_fn)
    order = ex.default_order(2)
    assert (1, "BW", 0) in order and (1, "B", 0) not in order
    ex.run(mbs, order=order)
    (sum(zoo.loss_fn(ref(*x), t) for x, t in mbs) / 2).backward()
    ref_params = dict(ref.named_parameters())
    for name, p in zoo.model.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, msg=lambda m: f"{name}: {m}")


def test_the_report_says_why_a_stage_keeps_a_fused_backward() -> None:

    graphs = split_stage(DataDependent(), [torch.randn(2, 4, requires_grad=True)])
    table = _report([graphs])
    assert table.column("backward") == ["fused"]
    assert table.notes[0] == f"stage 0 keeps a fused backward: {graphs.fused_reason}"


@pytest.mark.parametrize("name", ["gpt-tiny", "resnet-tiny", "skip-tied"])
def test_flops_read_from_the_recorded_values_equal_flopcountermode_running_the_graph(name: str) -> None:
    """count_flops reads each operator's arguments from the split graphs' ``meta["val"]`` instead of running them;
    on every F, B and W of these stages (attention, convolutions and their masked halves, BatchNorm, embeddings,
    tied weights) that gives FlopCounterMode's own count."""
    from fxpipe.passes.split_backward import _recorded_flops, _run_flops
    from tests._helpers import zoo_pipe

    graphs = zoo_pipe(name, 2).stage_graphs
    assert graphs is not None
    counted = 0
    for g in graphs:
        for gm in (g.forward, g.backward_input, g.backward_weight):
            assert gm is not None
            recorded = _recorded_flops(gm)
            assert recorded is not None and recorded == _run_flops(gm)
            counted += recorded
    assert counted > 0
