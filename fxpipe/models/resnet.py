"""resnet: a bottleneck ResNet written from scratch (no torchvision), from toy size to ResNet-50."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fxpipe.models._common import classification_loss, image_batch

DESCRIPTION = "bottleneck ResNet with BatchNorm and residual adds, from CIFAR-size to ResNet-50"
DEFAULT_SIZE = "small"


@dataclass(frozen=True)
class ResNetSize:
    """One zoo size: blocks per stage, base width, input side, classes and example batch."""

    layers: tuple[int, int, int, int]
    width: int
    image_size: int
    num_classes: int
    batch_size: int
    imagenet_stem: bool


SIZES: dict[str, ResNetSize] = {
    "tiny": ResNetSize((1, 1, 1, 1), 8, 32, 10, 2, imagenet_stem=False),
    "small": ResNetSize((2, 2, 2, 2), 16, 32, 10, 4, imagenet_stem=False),
    "50": ResNetSize((3, 4, 6, 3), 64, 224, 1000, 2, imagenet_stem=True),
}


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4, each with BN; then add and ReLU.

    The shortcut is ``downsample`` (1x1 conv + BN) when the stride or channel count changes,
    else the identity.
    """

    expansion = 4

    def __init__(self, in_channels: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = planes * self.expansion
        self.conv1 = nn.Conv2d(in_channels, planes, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_channels, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.downsample: nn.Sequential | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """Stem, ``layer1..layer4`` of Bottleneck blocks, global average pool, flatten, ``fc``.

    ``imagenet_stem`` picks the 7x7/2 conv + 3x3/2 max pool stem of ImageNet models; without it
    the stem is one 3x3/1 conv, as for 32x32 inputs. ``ResNet((3, 4, 6, 3))`` is ResNet-50.
    """

    def __init__(
        self,
        layers: Sequence[int],
        *,
        width: int = 64,
        num_classes: int = 1000,
        in_channels: int = 3,
        imagenet_stem: bool = True,
    ) -> None:
        super().__init__()
        if len(layers) != 4:
            raise ValueError(
                f"a ResNet has 4 stages (layers: {list(layers)}); pass 4 block counts"
            )
        kernel, stride, padding = (7, 2, 3) if imagenet_stem else (3, 1, 1)
        self.conv1 = nn.Conv2d(
            in_channels, width, kernel_size=kernel, stride=stride, padding=padding, bias=False
        )
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.maxpool: nn.MaxPool2d | None = (
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1) if imagenet_stem else None
        )
        channels = width
        stages: list[nn.Sequential] = []
        for stage_idx, num_blocks in enumerate(layers):
            planes = width * 2**stage_idx
            first_stride = 1 if stage_idx == 0 else 2
            blocks: list[nn.Module] = []
            for block_idx in range(num_blocks):
                blocks.append(Bottleneck(channels, planes, first_stride if block_idx == 0 else 1))
                channels = planes * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        if self.maxpool is not None:
            x = self.maxpool(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def make_model(size: str) -> ResNet:
    """The ResNet of zoo size ``size`` (a key of ``SIZES``)."""
    spec = SIZES[size]
    return ResNet(
        spec.layers,
        width=spec.width,
        num_classes=spec.num_classes,
        imagenet_stem=spec.imagenet_stem,
    )


def make_example(
    size: str, batch_size: int, generator: torch.Generator
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Standard-normal RGB images ``(B, 3, H, W)`` and integer class targets, on CPU in float32."""
    spec = SIZES[size]
    return image_batch(batch_size, spec.image_size, spec.num_classes, generator)


loss_fn = classification_loss
