"""How a stage's F, B and W graphs are called, and how a pipeline's inputs and loss meet them.

Every executor (the reference executor, the distributed runtime, ``backend="fxpipe"``, and the
stage timing of ``split-backward --profile``) calls the graphs through these methods and
functions only; where values live and when they are dropped stays each executor's policy.

    F  (*inputs)                       -> (*outputs, *saved)
    B  (*b_slots)                      -> (*input_grads, *handover)
    W  (*handover, *w_slots)           -> (*param_grads)           # in StageGraphs.param_names order

A slot is ``("saved", i)`` (F's i-th saved tensor) or ``("grad", j)`` (the gradient of the
stage's j-th differentiable output, stage output ``grad_outputs[j]``). B is every backward node
on a path to an input gradient; W is the rest of what the parameter gradients need, and
``handover`` is what W reads from B.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.func
import torch.fx

from fxpipe._compat import pytree
from fxpipe.errors import OptionError

Slot = tuple[str, int]  # ("saved", i) or ("grad", j)


@dataclass(frozen=True, eq=False)
class StageGraphs:
    """The F, B and W graphs of one stage and their calling convention (see the module docstring).

    When ``fused_reason`` is set the stage could not be split: the three graphs are None and
    executors run the stage's module under autograd with one fused backward (BW). The FLOP
    counts are 0 unless the builder was given a counter (the passes give annotate-costs' one).
    """

    forward: torch.fx.GraphModule | None
    backward_input: torch.fx.GraphModule | None
    backward_weight: torch.fx.GraphModule | None
    num_outputs: int = 0
    num_saved: int = 0
    grad_inputs: tuple[int, ...] = ()  # stage input positions whose gradient B returns, in order
    grad_outputs: tuple[int, ...] = ()  # stage output positions that take a gradient; ("grad", j) is the j-th
    b_slots: tuple[Slot, ...] = ()
    w_slots: tuple[Slot, ...] = ()
    num_handover: int = 0
    param_names: tuple[str, ...] = ()
    flops_forward: int = 0
    flops_backward_input: int = 0
    flops_backward_weight: int = 0
    flops_fused_backward: int = 0  # the backward graph before the split
    bytes_f_to_b: int = 0  # what F keeps for B and W
    bytes_b_to_w: int = 0  # what is still held once B ran, until W runs
    split_ops: tuple[str, ...] = ()  # multi-output backward ops split in two by output_mask
    fused_reason: str | None = None
    # A stage another rank runs (``build_stage_graphs(only=...)``): F, B and W are not built; this holds
    # its (inputs, outputs) as meta tensors (shape, dtype, strides), with grad_inputs and grad_outputs,
    # what a rank needs to talk to it.
    interface: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None

    @property
    def fused(self) -> bool:
        return self.fused_reason is not None

    @property
    def remote(self) -> bool:
        """Only the stage's interface was built (another rank runs it)."""
        return self.interface is not None

    def split_graphs(self) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, torch.fx.GraphModule]:
        """F, B and W, for a caller that runs them: a fused stage has none, nor does another rank's."""
        if self.forward is None or self.backward_input is None or self.backward_weight is None:
            why = self.fused_reason if self.fused else "another rank runs it"
            raise ValueError(f"the stage has no F, B and W graphs ({why}); check .fused and .remote before running "
                             "them")
        return self.forward, self.backward_input, self.backward_weight

    # Plain calls: no autograd mode is set here (executors run them under ``torch.no_grad()``),
    # and nothing is kept. The loss on the pipeline's outputs is ``loss_and_output_grads``.

    def run_forward(self, args: Sequence[Any], weights: Mapping[str, torch.Tensor] | None = None,
                    ) -> tuple[Sequence[Any], list[Any]]:
        """F on the stage's inputs: ``(outputs, saved)``, saved being what B and W read as ``("saved", i)``.

        ``weights``: tensors to read in place of the stage's parameters, by name (asynchronous
        training's weight versions); None reads the parameters themselves. So for B and W.
        """
        result = call_with(self.forward, weights, args)
        return result[: self.num_outputs], list(result[self.num_outputs:])

    def run_backward_input(self, saved: Sequence[Any], grad_outs: Sequence[Any],
                           weights: Mapping[str, torch.Tensor] | None = None) -> tuple[Sequence[Any], tuple[Any, ...]]:
        """B: ``(input_grads, handover)``; ``input_grads[k]`` is the gradient of stage input ``grad_inputs[k]``.

        ``grad_outs[j]`` is the gradient of stage output ``grad_outputs[j]`` (a ``("grad", j)`` slot).
        """
        result = call_with(self.backward_input, weights, self.input_args(saved, grad_outs))
        n = len(self.grad_inputs)
        return result[:n], tuple(result[n:])

    def input_args(self, saved: Sequence[Any], grad_outs: Sequence[Any]) -> list[Any]:
        """B's arguments, its slots' values: for ``backward_input``."""
        return _slot_args(self.b_slots, saved, grad_outs)

    def weight_args(self, handover: Sequence[Any], saved: Sequence[Any], grad_outs: Sequence[Any]) -> list[Any]:
        """W's arguments, ``[*handover, *w_slots]``: for ``backward_weight`` or its accumulating variants."""
        return [*handover, *_slot_args(self.w_slots, saved, grad_outs)]

    def run_backward_weight(self, handover: Sequence[Any], saved: Sequence[Any], grad_outs: Sequence[Any],
                            weights: Mapping[str, torch.Tensor] | None = None) -> Sequence[Any]:
        """W: the parameter gradients, in ``param_names`` order (a tied parameter may come twice)."""
        return call_with(self.backward_weight, weights, self.weight_args(handover, saved, grad_outs))


@dataclass(frozen=True)
class StageInterface:
    """What the other ranks need to know of a stage besides its values' shapes: which of its inputs B
    gives a gradient for, which outputs take one, and whether it could be split at all. A plan directory
    records it per stage, so a rank builds the F, B and W of its own stages only."""

    grad_inputs: tuple[int, ...]
    grad_outputs: tuple[int, ...]
    fused_reason: str | None = None

    @classmethod
    def of(cls, graphs: StageGraphs) -> StageInterface:
        return cls(tuple(graphs.grad_inputs), tuple(graphs.grad_outputs), graphs.fused_reason)

    def to_json(self) -> dict[str, Any]:
        return {"grad_inputs": list(self.grad_inputs), "grad_outputs": list(self.grad_outputs),
                "fused_reason": self.fused_reason}

    @classmethod
    def from_json(cls, doc: Any) -> StageInterface:
        """The record ``to_json`` wrote; ValueError for anything else."""
        def positions(v: Any) -> tuple[int, ...]:
            if not (isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v)):
                raise ValueError(f"positions must be a list of non-negative integers, not {v!r:.60}")
            return tuple(v)

        if not isinstance(doc, dict) or set(doc) != {"grad_inputs", "grad_outputs", "fused_reason"}:
            raise ValueError("an interface has exactly grad_inputs, grad_outputs and fused_reason")
        if doc["fused_reason"] is not None and not isinstance(doc["fused_reason"], str):
            raise ValueError("fused_reason must be a string or null")
        return cls(positions(doc["grad_inputs"]), positions(doc["grad_outputs"]), doc["fused_reason"])


def call_with(gm: Any, weights: Mapping[str, torch.Tensor] | None, args: Sequence[Any]) -> Any:
    """``gm(*args)``, reading ``weights`` (by parameter name) in place of its parameters when given."""
    if weights is None:
        return gm(*args)
    names = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    return torch.func.functional_call(gm, {n: t for n, t in weights.items() if n in names}, tuple(args),
                                      tie_weights=False)


def _slot_args(slots: Sequence[Slot], saved: Sequence[Any], grad_outs: Sequence[Any]) -> list[Any]:
    """The values of B's or W's slots: F's saved tensors and the stage outputs' gradients."""
    return [saved[i] if kind == "saved" else grad_outs[i] for kind, i in slots]


def flatten_inputs(in_spec: pytree.TreeSpec | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The call's inputs in the order of the graph's placeholders."""
    if in_spec is None:
        if kwargs:
            raise OptionError(f"this pipeline takes positional inputs only (got keywords: {', '.join(kwargs)})")
        return list(args)
    if in_spec.num_children == 2 and in_spec.child(1).type is dict:
        keys = list(in_spec.child(1).context)
        missing = [k for k in keys if k not in kwargs]
        extra = [k for k in kwargs if k not in keys]
        if missing or extra:
            raise OptionError(
                f"keyword inputs differ from compile time (missing: {missing}, unexpected: {extra}); "
                "pass the same keywords you compiled with"
            )
        kwargs = {k: kwargs[k] for k in keys}
    flat, spec = pytree.tree_flatten((tuple(args), kwargs))
    if spec != in_spec:
        raise OptionError(f"inputs are structured differently from compile time (expected {in_spec}, got {spec}); "
                          "pass the same structure you compiled with")
    return flat


def split_batch(x: Any, m: int, *, fix: str) -> list[Any]:
    """``x`` cut into m microbatches along dim 0 (views); anything without a batch dim is repeated."""
    if isinstance(x, torch.Tensor) and x.dim() > 0:
        if x.shape[0] % m:
            raise OptionError(f"the batch of {x.shape[0]} does not split into {m} microbatches; {fix}")
        return list(x.tensor_split(m))
    return [x] * m


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


class Record(dict):
    """A saved plan's keyed output whose class no imported library provides (e.g. a Hugging Face
    ``ModelOutput`` loaded without transformers): a dict whose keys are also attributes, and whose values a
    position reads as a ``ModelOutput``'s do (``out[0]``, ``out.to_tuple()``).

        >>> out = Record(logits=1, past_key_values=2)
        >>> out.logits, out["logits"], out[0], out[1:]
        (1, 1, 1, (2,))
    """

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, slice)):  # the keys are strings: a position, as ModelOutput reads one
            return self.to_tuple()[key]
        return super().__getitem__(key)

    def to_tuple(self) -> tuple[Any, ...]:
        """The values in key order, as ``ModelOutput.to_tuple``."""
        return tuple(self.values())

    def __getattr__(self, name: str) -> Any:
        try:
            return dict.__getitem__(self, name)
        except KeyError:
            raise AttributeError(f"this output has no {name!r}; it has {', '.join(self)}. It is an fxpipe.Record: the "
                                 "plan's output class was not imported when the plan was loaded; import its library "
                                 "(e.g. transformers) before fxpipe.load to get the class back") from None


RECORD_TYPE = "fxpipe.Record"
pytree.register_pytree_node(
    Record,
    lambda r: (list(r.values()), list(r.keys())),
    lambda values, keys: Record(zip(keys, values)),
    serialized_type_name=RECORD_TYPE,
    flatten_with_keys_fn=lambda r: ([(pytree.MappingKey(k), v) for k, v in r.items()], list(r.keys())),
)
