"""Tests for the model zoo: building, seeding, dtypes, the meta device, export and name errors."""

from __future__ import annotations

import resource

import pytest
import torch

from fxpipe.errors import OptionError, TargetError
from fxpipe.models import (
    GPT,
    GPTConfig,
    ZooEntry,
    ZooModel,
    build,
    canonical_name,
    entries,
    parameter_count,
)

FAMILIES = ("mlp", "gpt", "resnet", "vgg")
TINY = tuple(f"{family}-tiny" for family in FAMILIES)
ALL_NAMES = tuple(f"{entry.family}-{size}" for entry in entries() for size in entry.sizes)


def _loss(zoo: ZooModel) -> torch.Tensor:
    return zoo.loss_fn(zoo.model(*zoo.example_inputs), zoo.example_target)


def _tensors(zoo: ZooModel) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and example tensor of a build, by name."""
    tensors = dict(zoo.model.state_dict())
    tensors.update({f"input{idx}": x for idx, x in enumerate(zoo.example_inputs)})
    tensors["target"] = zoo.example_target
    return tensors


def test_entries_list_the_four_families() -> None:
    listed = entries()
    assert tuple(entry.family for entry in listed) == FAMILIES
    for entry in listed:
        assert isinstance(entry, ZooEntry)
        assert entry.default_size in entry.sizes
        assert entry.sizes[0] == "tiny"
        assert entry.description and "\n" not in entry.description
    assert next(e for e in listed if e.family == "gpt").sizes == ("tiny", "small", "medium", "base", "1.5b")


def test_canonical_name() -> None:
    assert canonical_name("gpt") == "gpt-small"
    assert canonical_name("gpt-1.5b") == "gpt-1.5b"
    assert canonical_name("resnet-50") == "resnet-50"
    for entry in entries():
        assert canonical_name(entry.family) == f"{entry.family}-{entry.default_size}"
    assert build("mlp").name == "mlp-small"


@pytest.mark.parametrize("name", TINY)
def test_tiny_builds_and_every_parameter_gets_a_gradient(name: str) -> None:
    zoo = build(name)
    assert zoo.name == name
    assert zoo.model.training and all(m.training for m in zoo.model.modules())
    loss = _loss(zoo)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    params = dict(zoo.model.named_parameters())
    missing = [n for n, p in params.items() if p.grad is None]
    assert not missing, f"no gradient for {missing}"
    assert all(torch.isfinite(p.grad).all() for p in params.values() if p.grad is not None)
    assert sum(int(p.grad.count_nonzero()) for p in params.values() if p.grad is not None) > 0


@pytest.mark.parametrize("name", TINY)
def test_same_seed_same_build_other_seed_other_build(name: str) -> None:
    first, again, other = (build(name, seed=seed) for seed in (3, 3, 4))
    first_tensors, again_tensors = _tensors(first), _tensors(again)
    assert first_tensors.keys() == again_tensors.keys()
    for key, value in first_tensors.items():
        assert torch.equal(value, again_tensors[key]), key
    # Norm weights start at one and biases at zero whatever the seed; random weights must differ.
    random_layers = (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Embedding)
    weights = {n: m.weight for n, m in first.model.named_modules() if isinstance(m, random_layers)}
    other_modules = dict(other.model.named_modules())
    assert weights
    for layer_name, weight in weights.items():
        assert not torch.equal(weight, other_modules[layer_name].weight), layer_name
    assert not torch.equal(first.example_inputs[0], other.example_inputs[0])
    assert not torch.equal(first.example_target, other.example_target)


def test_build_leaves_the_callers_rng_untouched() -> None:
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    build("gpt-tiny", seed=7)
    assert torch.equal(torch.get_rng_state(), state)


def test_batch_size_changes_only_the_batch() -> None:
    default, bigger = build("resnet-tiny"), build("resnet-tiny", batch_size=5)
    assert default.example_inputs[0].shape[0] == 2
    assert bigger.example_inputs[0].shape[0] == 5 and bigger.example_target.shape == (5,)
    for key, value in default.model.state_dict().items():
        assert torch.equal(value, bigger.model.state_dict()[key]), key
    gpt = build("gpt-tiny", batch_size=3)
    assert gpt.example_inputs[0].shape == (3, 16) and gpt.example_target.shape == (3, 16)
    assert _loss(gpt).dim() == 0


@pytest.mark.parametrize("name", TINY)
def test_float64(name: str) -> None:
    zoo = build(name, dtype=torch.float64)
    floats = [t for t in _tensors(zoo).values() if t.is_floating_point()]
    assert floats and all(t.dtype == torch.float64 for t in floats)
    assert zoo.example_target.dtype == torch.int64
    # The same seed gives the same weights, only wider (compared before a forward moves BN stats).
    narrow = build(name).model.state_dict()
    for key, value in zoo.model.state_dict().items():
        if value.is_floating_point():
            torch.testing.assert_close(value, narrow[key].double(), rtol=0, atol=0)
    loss = _loss(zoo)
    assert loss.dtype == torch.float64 and torch.isfinite(loss)


def test_gpt_head_is_tied_to_the_token_embedding() -> None:
    for dtype in (torch.float32, torch.float64):
        model = build("gpt-tiny", dtype=dtype).model
        assert isinstance(model, GPT)
        assert model.lm_head.weight is model.wte.weight
    tied = sum(p.numel() for p in model.parameters())
    untied = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert parameter_count("gpt-tiny") == tied == untied - model.wte.weight.numel()


def test_gpt_1_5b_on_meta_allocates_nothing() -> None:
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    zoo = build("gpt-1.5b", device="meta")
    # Real float32 weights would be 6 GiB; the peak resident size must not move by even 256 MiB.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_kib < 256 * 1024
    tensors = [*zoo.model.parameters(), *zoo.model.buffers(), *zoo.example_inputs]
    assert all(t.is_meta for t in tensors) and zoo.example_target.is_meta
    assert zoo.example_inputs[0].shape == (1, 1024)
    count = parameter_count("gpt-1.5b")
    assert count >= 1.4e9 and count <= 1.7e9
    assert count == sum(p.numel() for p in zoo.model.parameters())


def test_known_large_parameter_counts() -> None:
    # torchvision's resnet50() and vgg16() have exactly these many parameters.
    assert parameter_count("resnet-50") == 25_557_032
    assert parameter_count("vgg-16") == 138_357_544
    assert parameter_count("resnet") == parameter_count("resnet-small")


@pytest.mark.parametrize("name", ALL_NAMES)
def test_every_size_runs_on_meta(name: str) -> None:
    zoo = build(name, device="meta")
    assert all(p.is_meta for p in zoo.model.parameters())
    loss = _loss(zoo)
    assert loss.is_meta and loss.dim() == 0
    assert parameter_count(name) == sum(p.numel() for p in zoo.model.parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_default_size_parameter_count_matches_a_real_build(family: str) -> None:
    zoo = build(family)
    assert parameter_count(family) == sum(p.numel() for p in zoo.model.parameters())


def test_vgg_classifier_holds_most_parameters() -> None:
    for size in ("tiny", "small", "16"):
        model = build(f"vgg-{size}", device="meta").model
        classifier = sum(p.numel() for p in model.get_submodule("classifier").parameters())
        assert classifier > 0.5 * parameter_count(f"vgg-{size}"), size


def test_mlp_layers_are_unbalanced() -> None:
    model = build("mlp").model
    sizes = [m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(sizes) >= 4 and max(sizes) >= 4 * min(sizes)


@pytest.mark.parametrize("name", TINY)
def test_export_matches_eager(name: str) -> None:
    zoo = build(name)
    exported = torch.export.export(zoo.model, zoo.example_inputs)
    expected = zoo.model(*zoo.example_inputs)
    torch.testing.assert_close(exported.module()(*zoo.example_inputs), expected)


def test_gpt_is_usable_directly() -> None:
    config = GPTConfig(vocab_size=17, block_size=8, n_layer=1, n_head=2, n_embd=8)
    model = GPT(config)
    idx = torch.randint(0, 17, (2, 8))
    assert model(idx).shape == (2, 8, 17)
    # Causal: changing the last token leaves the earlier positions' logits alone.
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 17
    torch.testing.assert_close(model(changed)[:, :-1], model(idx)[:, :-1])
    with pytest.raises(OptionError, match="seq_len: 9, block_size: 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize(
    ("name", "pattern"),
    [
        ("gtp", r"unknown model 'gtp' \(known: mlp, gpt, resnet, vgg\).*did you mean 'gpt'"),
        ("resnet50", r"unknown model 'resnet50'.*did you mean 'resnet-50'"),
        ("gpt-huge", r"unknown size 'huge' for model 'gpt-huge' \(sizes of gpt: tiny, small"),
        ("vgg-19", r"unknown size '19'.*'vgg-small'"),
    ],
)
def test_unknown_names_raise_target_error(name: str, pattern: str) -> None:
    for call in (build, canonical_name, parameter_count):
        with pytest.raises(TargetError, match=pattern):
            call(name)


def test_bad_options_raise_option_error() -> None:
    with pytest.raises(OptionError, match="batch_size: 0"):
        build("mlp-tiny", batch_size=0)
    with pytest.raises(OptionError, match="torch.int64"):
        build("mlp-tiny", dtype=torch.int64)
    with pytest.raises(OptionError, match="'gpu'"):
        build("mlp-tiny", device="gpu")
