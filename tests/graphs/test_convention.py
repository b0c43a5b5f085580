"""graphs.convention: a pipeline's inputs flattened and cut into microbatches, and the loss on its outputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fxpipe._compat import pytree
from fxpipe.errors import OptionError
from fxpipe.graphs.convention import flatten_inputs, loss_and_output_grads, split_batch


def test_flatten_inputs_follows_the_compiled_structure() -> None:
    x, y = torch.ones(2), torch.zeros(2)
    _, spec = pytree.tree_flatten(((x,), {"mask": y}))
    assert flatten_inputs(spec, (x,), {"mask": y}) == [x, y]
    assert flatten_inputs(None, (x, y), {}) == [x, y]
    with pytest.raises(OptionError, match=r"keyword inputs differ from compile time \(missing: \['mask'\], unexpected: "
                                          r"\[\]\)"):
        flatten_inputs(spec, (x,), {})
    with pytest.raises(OptionError, match="positional inputs only"):
        flatten_inputs(None, (x,), {"mask": y})


def test_split_batch_cuts_dim_0_and_repeats_the_rest() -> None:
    parts = split_batch(torch.arange(6), 3, fix="-")
    assert [p.tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert split_batch(1.5, 2, fix="-") == [1.5, 1.5]
    with pytest.raises(OptionError, match="the batch of 5 does not split into 2 microbatches; use 5"):
        split_batch(torch.zeros(5, 3), 2, fix="use 5")


def test_loss_and_output_grads_scale_and_divide_the_gradient_only() -> None:
    pipe = SimpleNamespace(output_names=("y", None, "y"), output_constants=(None, 3, None), out_spec=None)
    y = torch.tensor([1.0, 2.0])
    seen = []

    def loss_fn(out: tuple, target: torch.Tensor) -> torch.Tensor:
        seen.append(out[1])
        return (out[0] * target).sum() + out[2].sum()

    loss, grads = loss_and_output_grads(pipe, loss_fn, {"y": y}, torch.tensor([3.0, 4.0]), scale=2.0, divisor=4)
    assert seen == [3] and loss.item() == 14.0 and not loss.requires_grad
    assert [n for n, _ in grads] == ["y", "y"]  # a value returned twice has one gradient per place
    torch.testing.assert_close(grads[0][1], torch.tensor([1.5, 2.0]))
    torch.testing.assert_close(grads[1][1], torch.tensor([0.5, 0.5]))
