"""The reference executor runs any valid order and refuses invalid ones with a clear error."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import fxpipe
from fxpipe import models
from fxpipe.errors import ScheduleOrderError
from fxpipe.runtime.reference import ReferenceExecutor
from tests._helpers import count_boxing


def _setup(stages: int = 3) -> tuple[fxpipe.Pipeline, ReferenceExecutor, list, torch.nn.Module]:
    zoo = models.build("gpt-tiny", dtype=torch.float64)
    ref = copy.deepcopy(zoo.model)
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=stages)
    mbs = [((torch.randint(0, 128, (2, 16)),), torch.randint(0, 128, (2, 16))) for _ in range(3)]
    return pipe, ReferenceExecutor(pipe, zoo.loss_fn), mbs, ref


def _eager_grads(ref: torch.nn.Module, mbs: list) -> dict[str, torch.Tensor]:
    from fxpipe.models.gpt import loss_fn

    loss = sum(loss_fn(ref(*x), t) for x, t in mbs) / len(mbs)
    loss.backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def _one_f_one_b_deferred_w(stages: int, mbs: int) -> list[tuple[int, str, int]]:
    """A 1F1B-like order run serially, with every W deferred to the very end (the most W memory)."""
    order = []
    for m in range(mbs):
        order += [(s, "F", m) for s in range(stages)]
        order += [(s, "B", m) for s in reversed(range(stages))]
    order += [(s, "W", m) for m in range(mbs) for s in range(stages)]
    return order


def test_any_valid_order_gives_the_same_gradients() -> None:
    torch.manual_seed(0)
    pipe, ex, mbs, ref = _setup()
    expected = _eager_grads(ref, mbs)
    ex.run(mbs, order=_one_f_one_b_deferred_w(3, 3))
    model_params = {n: p for s in pipe.stage_list() for n, p in s.module.named_parameters(remove_duplicate=False)}
    for name, grad in expected.items():
        key = "lm_head.weight" if name == "wte.weight" else name
        torch.testing.assert_close(model_params[key].grad, grad, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("order, match", [
    ([(1, "F", 0), (0, "F", 0)], r"1F0 needs .* made by an earlier stage's F"),
    ([(0, "F", 0), (1, "F", 0), (2, "F", 0), (1, "B", 0)], r"1B0 needs the gradient of .* from stage 2's backward"),
    ([(0, "F", 0), (1, "F", 0), (2, "F", 0), (2, "W", 0)], r"2W0 runs before 2B0"),
    ([(0, "F", 0), (0, "F", 0)], r"0F0 runs twice"),
    ([(0, "F", 0), (1, "F", 0), (2, "F", 0), (2, "B", 0), (2, "BW", 0)], r"2BW0 repeats 2B0, which already ran"),
    ([(0, "F", 0)], r"the order never runs 0B0 \(and 7 more\)"),
    ([(5, "F", 0)], r"5F0 names a stage or microbatch that does not exist"),
])
def test_invalid_orders_are_refused(order: list, match: str) -> None:
    _, ex, mbs, _ = _setup()
    with pytest.raises(ScheduleOrderError, match=match):
        ex.run(mbs[:1], order=order)


def test_default_order_runs_every_action_once() -> None:
    _, ex, mbs, _ = _setup(2)
    order = ex.default_order(3)
    assert len(order) == len(set(order)) == 2 * 3 * 3
    assert order[0] == (0, "F", 0) and order[-1] == (0, "W", 2)


def test_runs_box_each_graph_once_and_new_graphs_are_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # Boxing copies and recompiles a graph: the runs of one executor share it (GraphFacts); graphs swapped in after
    # are boxed, and their W read, again rather than served from the old ones.
    made = count_boxing(monkeypatch)
    torch.manual_seed(0)
    pipe, ex, mbs, ref = _setup(stages=2)
    expected = _eager_grads(ref, mbs)
    for _ in range(3):
        for p in pipe.parameters():
            p.grad = None
        ex.run(mbs)
    assert len(made) == len(set(made)) == 4, made  # each stage's B and W, once over the 3 runs
    model_params = {n: p for s in pipe.stage_list() for n, p in s.module.named_parameters(remove_duplicate=False)}
    for name, grad in expected.items():
        torch.testing.assert_close(model_params["lm_head.weight" if name == "wte.weight" else name].grad, grad)

    first = ex._facts
    # other StageGraphs objects: the same fx graphs, but stage 1's B a copy
    ex.graphs = [ex.graphs[0],
                 dataclasses.replace(ex.graphs[1], backward_input=copy.deepcopy(ex.graphs[1].backward_input))]
    ex.run(mbs)
    assert ex._facts is not first and len(made) == 8  # read again, and every graph boxed again
