"""From a compiled plan to the per-layer strategy search's ``LayerSpec`` chain (planning/strategies.py).

One spec per plan layer (compile with a ``granularity`` whose layers are modules, e.g. ``"2"`` on
the zoo's VGG: ``features.0``, ``classifier.0``): a layer whose parameters belong to an
``nn.Linear`` is a ``matmul``, one whose parameters belong to a convolution a ``matmul`` with
``spatial=True``, a parameter-free layer ``elementwise`` (``spatial`` when its output has a
height). The chain starts with the model's input (kind ``input``); every layer reads the one
before it. Output bytes come from one forward run with hooks on the layers' modules (on ``meta``
it allocates nothing), scaled to the plan's microbatch; F + B + W seconds, saved and parameter
bytes come from the plan (one microbatch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fxpipe.errors import OptionError
from fxpipe.plan import Plan
from fxpipe.planning.strategies import LayerSpec

__all__ = ["strategy_specs"]

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _owner(model: nn.Module, param: str) -> nn.Module:
    return model.get_submodule(param.rsplit(".", 1)[0]) if "." in param else model


def strategy_specs(plan: Plan, model: nn.Module, example_inputs: Sequence[Any]) -> tuple[
        tuple[LayerSpec, ...], tuple[tuple[int, int], ...]]:
    """``(specs, edges)``: the input then one ``LayerSpec`` per plan layer, and the chain ``(i, i + 1)``.

    Raises ``OptionError`` when a layer's name is not a module of ``model`` (compile with a module
    granularity) or its parameters belong to neither a Linear nor a convolution.
    """
    if not example_inputs or not isinstance(example_inputs[0], torch.Tensor):
        raise OptionError("strategy_specs needs the example inputs the plan was compiled from (a tensor first)")
    x = example_inputs[0]
    scale = (plan.inputs[0].shape[0] / x.shape[0]) if plan.inputs and plan.inputs[0].shape and x.dim() else 1.0
    modules = {}
    for layer in plan.layers:
        try:
            modules[layer.name] = model.get_submodule(layer.name)
        except AttributeError as err:
            raise OptionError(f"layer {layer.name!r} is not a module of the model; compile with a module "
                              "granularity (e.g. granularity='2') for strategy_specs") from err
    out: dict[str, tuple[int, int]] = {}  # name -> (bytes, dims)

    def hook(name: str):
        def record(_module: nn.Module, _args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor):
                out[name] = (output.numel() * output.element_size(), output.dim())
        return record

    handles = [m.register_forward_hook(hook(name)) for name, m in modules.items()]
    try:
        with torch.no_grad():
            model(*example_inputs)
    finally:
        for h in handles:
            h.remove()

    specs = [LayerSpec("input", out_bytes=x.numel() * x.element_size() * scale, kind="input")]
    for layer in plan.layers:
        nbytes, dims = out.get(layer.name, (0, 0))
        owners = {type(_owner(model, p)) for p in layer.params}
        if not layer.params:
            kind, spatial = "elementwise", dims >= 3
        elif owners and all(issubclass(t, nn.Linear) for t in owners):
            kind, spatial = "matmul", False
        elif owners and all(issubclass(t, _CONV) for t in owners):
            kind, spatial = "matmul", True
        else:
            names = ", ".join(sorted(t.__name__ for t in owners))
            raise OptionError(f"layer {layer.name!r} holds parameters of {names}; strategy_specs knows Linear and "
                              "convolution layers (compile with a finer granularity to separate them)")
        specs.append(LayerSpec(layer.name, layer.f + layer.b + layer.w, float(layer.param_bytes), nbytes * scale,
                               float(layer.saved_bytes), kind, spatial))
    return tuple(specs), tuple((i, i + 1) for i in range(len(specs) - 1))
