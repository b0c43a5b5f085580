"""inception: a small Inception-style network (GoogLeNet's four-branch block), for OptCNN's branching graphs.

Each block runs four branches on one input and concatenates them on channels: a 1x1 convolution, 1x1 then
3x3, 1x1 then two 3x3 (Inception-v3's factorised 5x5), and a 3x3 max pool then 1x1. Its layer graph is
series-parallel, so node and edge elimination reduce it exactly. Not registered as a zoo family (``fxpipe
models``); build it with ``make_model(size)`` / ``make_example``, or ``fxpipe compile
fxpipe/models/inception.py:build``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fxpipe.models._common import classification_loss, image_batch

DESCRIPTION = "Inception-style blocks (four branches concatenated), CIFAR-size"
DEFAULT_SIZE = "small"


@dataclass(frozen=True)
class InceptionSize:
    """One size: stem width, blocks' branch width, blocks, input side, classes and example batch."""

    stem: int
    branch: int
    blocks: int
    image_size: int
    num_classes: int
    batch_size: int


SIZES: dict[str, InceptionSize] = {
    "tiny": InceptionSize(8, 4, 1, 16, 10, 2),
    "small": InceptionSize(32, 16, 2, 32, 10, 8),
}


def _conv(cin: int, cout: int, k: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class InceptionBlock(nn.Module):
    """Four branches on ``x``, concatenated: 1x1 | 1x1, 3x3 | 1x1, 3x3, 3x3 | pool, 1x1; ``4 * width`` channels."""

    def __init__(self, cin: int, width: int) -> None:
        super().__init__()
        self.b1 = _conv(cin, width, 1)
        self.b3 = nn.Sequential(_conv(cin, width, 1), _conv(width, width, 3))
        self.b5 = nn.Sequential(_conv(cin, width, 1), _conv(width, width, 3), _conv(width, width, 3))
        self.pool = nn.MaxPool2d(3, stride=1, padding=1)
        self.bp = _conv(cin, width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b3(x), self.b5(x), self.bp(self.pool(x))], dim=1)


class Inception(nn.Module):
    """Stem convolution, ``blocks`` Inception blocks (a max pool between them), global average pool, ``fc``."""

    def __init__(self, spec: InceptionSize) -> None:
        super().__init__()
        self.stem = _conv(3, spec.stem, 3)
        blocks: list[nn.Module] = []
        channels = spec.stem
        for i in range(spec.blocks):
            if i:
                blocks.append(nn.MaxPool2d(2))
            blocks.append(InceptionBlock(channels, spec.branch))
            channels = 4 * spec.branch
        self.blocks = nn.Sequential(*blocks)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(channels, spec.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.avgpool(self.blocks(self.stem(x))), 1))


def make_model(size: str) -> Inception:
    """The network of size ``size`` (a key of ``SIZES``)."""
    return Inception(SIZES[size])


def make_example(size: str, batch_size: int,
                 generator: torch.Generator) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Standard-normal RGB images ``(B, 3, H, W)`` and integer class targets, on CPU in float32."""
    spec = SIZES[size]
    return image_batch(batch_size, spec.image_size, spec.num_classes, generator)


def build(size: str = DEFAULT_SIZE, batch_size: int | None = None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``(model, example_inputs)`` seeded at 0: what ``fxpipe compile fxpipe/models/inception.py:build`` takes."""
    with torch.random.fork_rng(devices=[]):  # the caller's RNG state is untouched
        torch.manual_seed(0)
        model = make_model(size)
    inputs, _ = make_example(size, batch_size or SIZES[size].batch_size, torch.Generator().manual_seed(0))
    return model, inputs


loss_fn = classification_loss
