"""vgg: 3x3 conv features and a large fully connected classifier holding most parameters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fxpipe.models._common import classification_loss, image_batch

DESCRIPTION = "conv features + large FC classifier holding most parameters (the SplitBrain target)"
DEFAULT_SIZE = "small"

#: A features layout: an int is a 3x3 conv (+ReLU) to that many channels, "M" a 2x2 max pool.
Layout = Sequence[int | str]


@dataclass(frozen=True)
class VGGSize:
    """One zoo size: features layout, input side, classifier width, classes, dropout and batch."""

    layout: tuple[int | str, ...]
    image_size: int
    fc_width: int
    num_classes: int
    dropout: float
    batch_size: int


_VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")

SIZES: dict[str, VGGSize] = {
    "tiny": VGGSize((8, "M", 16, "M", 32, "M"), 32, 256, 10, 0.0, 2),
    # VGG-11's eight convs at a quarter of the channels; the last two pools are dropped because
    # a 32x32 input would shrink to 1x1 and leave the classifier small.
    "small": VGGSize((16, "M", 32, "M", 64, 64, "M", 128, 128, 128, 128), 32, 512, 10, 0.0, 4),
    "16": VGGSize(_VGG16, 224, 4096, 1000, 0.5, 2),
}


class VGG(nn.Module):
    """``features`` (conv3x3+ReLU, max pools), flatten, ``classifier`` (3 Linear, ReLU, Dropout).

    ``image_size`` fixes the classifier's input width: ``channels * (image_size // 2**pools)**2``.
    ``VGG(_VGG16, image_size=224)`` is VGG-16 (138M parameters, 124M of them in the classifier).
    """

    def __init__(
        self,
        layout: Layout,
        *,
        image_size: int = 224,
        fc_width: int = 4096,
        num_classes: int = 1000,
        in_channels: int = 3,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        side = image_size
        for item in layout:
            if item == "M":
                if side % 2 != 0:
                    raise ValueError(
                        f"each max pool halves the side, which must stay even (image_size: "
                        f"{image_size}, side before this pool: {side}); "
                        "use a power-of-two image_size"
                    )
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
                side //= 2
            elif isinstance(item, int):
                layers.append(nn.Conv2d(channels, item, kernel_size=3, padding=1))
                layers.append(nn.ReLU())
                channels = item
            else:
                raise ValueError(
                    f"a VGG layout holds channel counts and 'M' (got: {item!r}); fix the layout"
                )
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(channels * side * side, fc_width),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(fc_width, fc_width),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(fc_width, num_classes),
        )
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.01)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def make_model(size: str) -> VGG:
    """The VGG of zoo size ``size`` (a key of ``SIZES``)."""
    spec = SIZES[size]
    return VGG(
        spec.layout,
        image_size=spec.image_size,
        fc_width=spec.fc_width,
        num_classes=spec.num_classes,
        dropout=spec.dropout,
    )


def make_example(
    size: str, batch_size: int, generator: torch.Generator
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Standard-normal RGB images ``(B, 3, H, W)`` and integer class targets, on CPU in float32."""
    spec = SIZES[size]
    return image_batch(batch_size, spec.image_size, spec.num_classes, generator)


loss_fn = classification_loss
