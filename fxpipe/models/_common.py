"""Pieces the image classifiers of the zoo share: an example batch of images and the classification loss."""

from __future__ import annotations

import torch
from torch import nn


def image_batch(batch_size: int, image_size: int, num_classes: int,
                generator: torch.Generator) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Standard-normal RGB images ``(B, 3, H, W)`` and integer class targets, on CPU in float32."""
    images = torch.randn(batch_size, 3, image_size, image_size, generator=generator)
    target = torch.randint(0, num_classes, (batch_size,), generator=generator)
    return (images,), target


def classification_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of class logits ``(B, classes)`` against integer targets ``(B,)``."""
    return nn.functional.cross_entropy(output, target)
