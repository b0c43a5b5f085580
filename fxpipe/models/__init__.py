"""models: the built-in zoo (mlp, gpt, resnet, vgg), built by name, seeded, on any device."""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fxpipe.errors import OptionError, TargetError
from fxpipe.models import gpt, mlp, resnet, vgg
from fxpipe.models.gpt import GPT, GPTConfig

__all__ = [
    "GPT",
    "GPTConfig",
    "ZooEntry",
    "ZooModel",
    "build",
    "canonical_name",
    "entries",
    "parameter_count",
]


@dataclass(frozen=True, eq=False)
class ZooModel:
    """A built zoo model with one example batch; ``loss_fn(model(*example_inputs), example_target)``.

    Compared by identity: its fields are tensors and modules, which have no useful ``==``.
    """

    name: str
    model: torch.nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    example_target: torch.Tensor
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ZooEntry:
    """One model family as ``fxpipe models`` lists it."""

    family: str
    sizes: tuple[str, ...]
    default_size: str
    description: str


@dataclass(frozen=True)
class _Family:
    """How to build one family: its listing, its model, its example batch and its loss."""

    entry: ZooEntry
    make_model: Callable[[str], torch.nn.Module]
    make_example: Callable[
        [str, int, torch.Generator], tuple[tuple[torch.Tensor, ...], torch.Tensor]
    ]
    default_batch_size: Callable[[str], int]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]


_FAMILIES: dict[str, _Family] = {
    "mlp": _Family(
        ZooEntry("mlp", tuple(mlp.SIZES), mlp.DEFAULT_SIZE, mlp.DESCRIPTION),
        mlp.make_model,
        mlp.make_example,
        lambda size: mlp.SIZES[size].batch_size,
        mlp.loss_fn,
    ),
    "gpt": _Family(
        ZooEntry("gpt", tuple(gpt.SIZES), gpt.DEFAULT_SIZE, gpt.DESCRIPTION),
        gpt.make_model,
        gpt.make_example,
        lambda size: gpt.SIZES[size].batch_size,
        gpt.loss_fn,
    ),
    "resnet": _Family(
        ZooEntry("resnet", tuple(resnet.SIZES), resnet.DEFAULT_SIZE, resnet.DESCRIPTION),
        resnet.make_model,
        resnet.make_example,
        lambda size: resnet.SIZES[size].batch_size,
        resnet.loss_fn,
    ),
    "vgg": _Family(
        ZooEntry("vgg", tuple(vgg.SIZES), vgg.DEFAULT_SIZE, vgg.DESCRIPTION),
        vgg.make_model,
        vgg.make_example,
        lambda size: vgg.SIZES[size].batch_size,
        vgg.loss_fn,
    ),
}


def entries() -> tuple[ZooEntry, ...]:
    """Every family in the zoo, in listing order."""
    return tuple(family.entry for family in _FAMILIES.values())


def _all_names() -> list[str]:
    names = list(_FAMILIES)
    for family in _FAMILIES.values():
        names += [f"{family.entry.family}-{size}" for size in family.entry.sizes]
    return names


def _did_you_mean(name: str) -> str:
    close = difflib.get_close_matches(name, _all_names(), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def _split_name(name: str) -> tuple[_Family, str]:
    family_name, dash, size = name.strip().lower().partition("-")
    family = _FAMILIES.get(family_name)
    if family is None:
        raise TargetError(
            f"unknown model {name!r} (known: {', '.join(_FAMILIES)}); "
            f"run `fxpipe models` to list them{_did_you_mean(name.strip().lower())}"
        )
    if not dash:
        return family, family.entry.default_size
    if size not in family.entry.sizes:
        raise TargetError(
            f"unknown size {size!r} for model {name!r} (sizes of {family_name}: "
            f"{', '.join(family.entry.sizes)}); use one of them, e.g. "
            f"'{family_name}-{family.entry.default_size}'"
        )
    return family, size


def canonical_name(name: str) -> str:
    """``FAMILY-SIZE`` for a zoo name; a bare ``FAMILY`` gets its default size.

        >>> canonical_name("gpt")
        'gpt-small'

    Raises: TargetError for an unknown family or size.
    """
    family, size = _split_name(name)
    return f"{family.entry.family}-{size}"


def build(
    name: str,
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
    batch_size: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> ZooModel:
    """Build zoo model ``name`` in train mode with one example batch, on ``device`` in ``dtype``.

    Weights come from ``seed`` through the CPU generator (forked, so the caller's RNG state is
    untouched) and are then moved, so a seed gives the same weights on every device; the batch
    comes from its own generator seeded with ``seed``, independent of the model. On ``meta`` the
    model is constructed there directly and allocates no weight memory (gpt-1.5b included).

    Raises: TargetError for an unknown name; OptionError for a bad device, dtype or batch size.
    """
    family, size = _split_name(name)
    target_device = _parse_device(device)
    if not dtype.is_floating_point:
        raise OptionError(
            f"the zoo builds floating-point models (dtype: {dtype}); "
            "pass torch.float32, torch.float64, torch.bfloat16 or torch.float16"
        )
    if batch_size is None:
        batch_size = family.default_batch_size(size)
    if batch_size < 1:
        raise OptionError(f"batch size must be at least 1 (batch_size: {batch_size}); raise it")

    model = _make_model(family, size, target_device, seed).to(device=target_device, dtype=dtype)
    model.train()

    generator = torch.Generator().manual_seed(seed)
    inputs, target = family.make_example(size, batch_size, generator)
    inputs = tuple(_to(tensor, target_device, dtype) for tensor in inputs)
    return ZooModel(
        name=f"{family.entry.family}-{size}",
        model=model,
        example_inputs=inputs,
        example_target=_to(target, target_device, dtype),
        loss_fn=family.loss_fn,
    )


def parameter_count(name: str) -> int:
    """Number of distinct parameter elements of zoo model ``name`` (tied weights counted once).

    Built on the meta device, so it is instant even for gpt-1.5b.
    """
    return _meta_parameter_count(canonical_name(name))


@functools.cache
def _meta_parameter_count(canonical: str) -> int:
    family, size = _split_name(canonical)
    model = _make_model(family, size, torch.device("meta"), seed=0)
    return sum(param.numel() for param in model.parameters())


def _make_model(family: _Family, size: str, device: torch.device, seed: int) -> torch.nn.Module:
    if device.type == "meta":
        with torch.device("meta"), _SkipInit():
            return family.make_model(size)
    # Built on the CPU whatever the target device, so a seed means the same weights everywhere.
    # Only the CPU generator is seeded: torch.manual_seed would also reseed every CUDA device,
    # which fork_rng(devices=[]) would not restore.
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        return family.make_model(size)


class _SkipInit(torch.overrides.TorchFunctionMode):
    """Parameter initialisers (``torch.nn.init``'s, a tensor's ``normal_`` and ``uniform_``) return their tensor
    untouched: on meta there are no values to draw, and meta's random fills run through ``torch._refs``, whose first
    call imports Dynamo (seconds of fxpipe run's start-up, before any rank starts)."""

    SKIPPED = frozenset({*(getattr(torch.nn.init, name) for name in dir(torch.nn.init)
                           if name.endswith("_") and not name.startswith("_")),
                         torch.Tensor.normal_, torch.Tensor.uniform_})

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in self.SKIPPED:
            return args[0] if args else kwargs.get("tensor", kwargs.get("self"))
        return func(*args, **kwargs)


def _to(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if tensor.is_floating_point():
        return tensor.to(device=device, dtype=dtype)
    return tensor.to(device=device)


def _parse_device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except RuntimeError as error:
        raise OptionError(
            f"unknown device {device!r} ({error}); use cpu, cuda, cuda:N or meta"
        ) from None
