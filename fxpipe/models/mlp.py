"""mlp: Linear+ReLU layers of unequal widths, so a split by layer count is unbalanced."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fxpipe.models._common import classification_loss

DESCRIPTION = "stack of Linear+ReLU layers of unequal widths; a split by layer count is unbalanced"
DEFAULT_SIZE = "small"


@dataclass(frozen=True)
class MLPSize:
    """One zoo size: the width of every activation, input first, class count last."""

    widths: tuple[int, ...]
    batch_size: int


SIZES: dict[str, MLPSize] = {
    "tiny": MLPSize(widths=(32, 256, 64, 512, 32, 10), batch_size=4),
    "small": MLPSize(widths=(64, 512, 128, 1024, 64, 10), batch_size=8),
    "large": MLPSize(widths=(256, 4096, 512, 8192, 256, 10), batch_size=32),
    # The runtime benchmark's MLP: 16 layers 1024 wide; batch 64 = 8 microbatches of 8.
    "deep": MLPSize(widths=(1024,) * 17, batch_size=8),
}


class MLP(nn.Sequential):
    """Linear layers ``fc0, fc1, ...`` joined by ReLUs ``act0, act1, ...``; none after the last.

        MLP([64, 512, 10])  ==  Sequential(fc0=Linear(64, 512), act0=ReLU(), fc1=Linear(512, 10))
    """

    def __init__(self, widths: Sequence[int]) -> None:
        if len(widths) < 2:
            raise ValueError(
                f"an MLP needs an input and an output width (widths: {list(widths)}); "
                "pass at least two widths"
            )
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        last = len(widths) - 2
        for idx, (width_in, width_out) in enumerate(zip(widths[:-1], widths[1:])):
            layers[f"fc{idx}"] = nn.Linear(width_in, width_out)
            if idx < last:
                layers[f"act{idx}"] = nn.ReLU()
        super().__init__(layers)
        self.widths = tuple(widths)


def make_model(size: str) -> MLP:
    """The MLP of zoo size ``size`` (a key of ``SIZES``)."""
    return MLP(SIZES[size].widths)


def make_example(
    size: str, batch_size: int, generator: torch.Generator
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """A batch of standard-normal features and integer class targets, on CPU in float32."""
    widths = SIZES[size].widths
    x = torch.randn(batch_size, widths[0], generator=generator)
    target = torch.randint(0, widths[-1], (batch_size,), generator=generator)
    return (x,), target


loss_fn = classification_loss
