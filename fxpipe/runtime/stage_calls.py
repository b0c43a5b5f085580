"""The mechanics every executor shares: how a stage's graphs are called, and the loss on the pipeline's outputs.

The stage calls are methods of :class:`fxpipe.passes.split_backward.StageGraphs`
(``run_forward``, ``run_backward_input``, ``weight_args``, ``run_backward_weight``); this module
adds the loss. The reference executor, the distributed runtime and ``backend="fxpipe"`` keep
their own policies (validation, where values live and when they are dropped, how parameter
gradients accumulate); only these calls are common.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree


def loss_and_output_grads(pipe: Any, loss_fn: Callable[[Any, Any], torch.Tensor], values: Mapping[str, Any],
                          target: Any, *, scale: float = 1.0,
                          divisor: int = 1) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """``loss_fn`` on one microbatch's pipeline outputs: ``(loss, [(output name, gradient), ...])``.

    ``values`` holds the microbatch's values by name; the outputs are rebuilt in the model's
    output structure (``pipe.out_spec``, constants from ``pipe.output_constants``). Gradients are
    those of ``loss * scale / divisor`` with respect to each floating-point output tensor, in
    ``pipe.output_names`` order; an output the loss does not read has none, and a value returned
    twice has one entry per place. ``loss`` is returned unscaled and detached. (The reference
    executor multiplies by its ``loss_scale``, the runtime divides by the microbatch count: two
    parameters keep both bit-identical to what they computed on their own.)
    """
    leaves = [values[n].detach().requires_grad_(values[n].is_floating_point())
              if n is not None and isinstance(values[n], torch.Tensor) else (values[n] if n is not None else c)
              for n, c in zip(pipe.output_names, pipe.output_constants)]
    out = pytree.tree_unflatten(leaves, pipe.out_spec) if pipe.out_spec is not None else tuple(leaves)
    with torch.enable_grad():
        loss = loss_fn(out, target)
        weighted = loss * scale if scale != 1.0 else loss
        weighted = weighted / divisor if divisor != 1 else weighted
        diff = [(n, t) for n, t in zip(pipe.output_names, leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        grads = torch.autograd.grad(weighted, [t for _, t in diff], allow_unused=True)
    return loss.detach(), [(name, g) for (name, _), g in zip(diff, grads) if g is not None]
