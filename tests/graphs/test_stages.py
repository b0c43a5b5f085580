"""graphs.stages: every stage's graphs at once; identical stages share one split, and a pipeline without graphs gets the
pass's."""

from __future__ import annotations

import torch

import fxpipe
from fxpipe import models
from fxpipe.graphs.convention import StageGraphs
from fxpipe.models import GPT, GPTConfig
from tests._helpers import check_fbw_matches_eager


def test_identical_stages_reuse_one_split_and_still_train_their_own_parameters() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=6, n_head=2, n_embd=32)).train()
    from fxpipe.models.gpt import loss_fn

    mbs = [((torch.randint(0, 64, (2, 16)),), torch.randint(0, 64, (2, 16))) for _ in range(2)]
    pipe = check_fbw_matches_eager(model, mbs[0][0], loss_fn, mbs, 6)
    graphs = pipe.stage_graphs
    assert graphs is not None
    names = [[n for n, _ in s.module.named_parameters()] for s in pipe.stage_list()]
    singles = [k for k, ns in enumerate(names)
               if all(n.startswith("blocks.") for n in ns) and len({n.split(".")[1] for n in ns}) == 1]
    assert len(singles) >= 2, "expected several one-block stages"
    for k in singles:
        owned = {n for n, _ in pipe.stages[k].module.named_parameters()}
        attrs = {str(n.target) for n in graphs[k].backward_weight.graph.nodes if n.op == "get_attr"}  # type: ignore[union-attr]
        assert set(graphs[k].param_names) == owned and attrs <= owned
    for g in graphs:  # each tensor read under the name fx gives its target, as a split of that stage names it
        for gm in (g.forward, g.backward_input, g.backward_weight):
            assert all(n.name == str(n.target).replace(".", "_") for n in gm.graph.nodes if n.op == "get_attr")  # type: ignore[union-attr]


def _convention(g: StageGraphs) -> tuple[object, ...]:
    return (g.num_outputs, g.num_saved, g.grad_inputs, g.grad_outputs, g.b_slots, g.w_slots, g.num_handover,
            g.param_names, g.bytes_f_to_b, g.bytes_b_to_w, g.split_ops, g.fused_reason)


def test_build_backward_gives_a_pipeline_without_graphs_the_passes_graphs() -> None:
    """Pipeline.build_backward (plans loaded from disk, the runtime) and the split-backward pass build the same F, B and
    W."""
    zoo = models.build("gpt-tiny")
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=3)
    compiled = pipe.stage_graphs
    assert compiled is not None
    for stage in pipe.stage_list():
        stage.graphs = None
    assert pipe.stage_graphs is None
    pipe.build_backward(zoo.example_inputs)
    rebuilt = pipe.stage_graphs
    assert rebuilt is not None
    for stage, old, new in zip(pipe.stage_list(), compiled, rebuilt, strict=True):
        assert _convention(new) == _convention(old)
        for a, b in ((old.forward, new.forward), (old.backward_input, new.backward_input),
                     (old.backward_weight, new.backward_weight)):
            assert a is not b and a.code == b.code  # type: ignore[union-attr]
        assert stage.forward is new.forward
    flops = [(g.flops_forward, g.flops_backward_input, g.flops_backward_weight) for g in rebuilt]
    assert set(flops) == {(0, 0, 0)} and sum(g.flops_forward for g in compiled) > 0  # only the passes count FLOPs


def test_a_model_compiled_again_is_split_from_the_process_cache_onto_its_own_parameters(monkeypatch) -> None:
    """The second compile of the same model (a fresh copy: other parameters) traces no stage through AOTAutograd:
    its graphs are the first compile's, read its own parameters, and train to eager's gradients. The same stage traced
    under autocast, or on inputs of other shapes, is not a hit."""
    from fxpipe._compat import autocast_forward
    from fxpipe.graphs import stages as st
    from fxpipe.graphs.fx import get_path
    from tests._helpers import assert_composes, skip_tied, token_ce

    model, inputs, target = skip_tied()
    first = assert_composes(model, inputs, token_ce, target, stages=2, granularity="1")
    calls: list[int] = []
    real = st.split_stage
    monkeypatch.setattr(st, "split_stage", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = assert_composes(model, inputs, token_ce, target, stages=2, granularity="1")
    assert calls == []
    for a, b in zip(first.stage_list(), again.stage_list(), strict=True):
        assert a.graphs is not None and b.graphs is not None
        for ga, gb in zip((a.graphs.forward, a.graphs.backward_input, a.graphs.backward_weight),
                          (b.graphs.forward, b.graphs.backward_input, b.graphs.backward_weight)):
            assert ga is not None and gb is not None and ga is not gb and ga.code == gb.code
            for node in gb.graph.nodes:
                if node.op == "get_attr":  # the graph's tensor is the second model's, not the first's
                    assert get_path(gb, node.target) is get_path(b.module, node.target), node.target
        attrs = [n for g in (b.graphs.forward, b.graphs.backward_weight) for n in g.graph.nodes if n.op == "get_attr"]
        assert attrs, "no graph of the stage reads a parameter"
    with autocast_forward("cpu", torch.bfloat16):
        fxpipe.compile(*skip_tied()[:2], stages=2, granularity="1")
    assert calls, "a stage traced under autocast was served fp32 graphs"
    calls.clear()
    fxpipe.compile(skip_tied()[0], (torch.randint(0, 32, (4, 5)),), stages=2, granularity="1")
    assert calls, "a stage on inputs of other shapes was served another shape's graphs"


def test_stages_of_called_leaf_modules_with_one_signature_each_train_their_own_parameters() -> None:
    """``--tracer fx`` keeps ``nn.Linear`` as a call: the graphs of one stage (or counted layer) rebound onto another of
    the same signature read the other's weights, which no get_attr names."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(m for _ in range(3) for m in (torch.nn.Linear(8, 8), torch.nn.Tanh())))
    mbs = [((torch.randn(4, 8),), torch.randn(4, 8)) for _ in range(2)]
    check_fbw_matches_eager(model, mbs[0][0], torch.nn.functional.mse_loss, mbs, 3, tracer="fx", granularity="1")
