"""What ``fxpipe run`` trains a plan on besides its stages: the loss (``--loss``) and each rank's batches (``--data``).

``check_feed`` runs in the launcher before any rank starts: it resolves both specs (``fxpipe.targets``), runs the
model's output on the meta device (a plan of a built-in model: the zoo's; else the plan's own stages), calls a
data function once for replica 0's first batch and checks its shapes against the plan's inputs, and calls the loss
on an output of the plan's shape and that batch's first target, which must give a scalar. ``rank_batches`` gives
a rank ``batch(step)``: that replica's rows only, the inputs only where the rank runs a stage that reads them,
the target only where it computes the loss, and nothing (no data read, no function called) elsewhere.

A plan of a built-in model keeps its zoo loss and data; a plan of the user's own model needs ``--loss`` and
trains on ``synthetic`` data shaped from the plan's inputs (integer inputs below the embedding they index, the
first random target its loss takes), ``text:``, ``jsonl:`` (a language model) or a data function.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

SYNTHETIC_SEED = 1234  # the seed of fxpipe.cli.rank_common.synthetic_batch


@dataclass(frozen=True)
class Feed:
    """The launcher's findings: the data source, its fit (built-in real data: the held-out score), and the user
    model's synthetic batch the ranks make."""

    source: Any
    fit: Any
    synthetic: str | None  # a user model's synthetic batch (JSON), for the ranks; None: theirs to make


@dataclass(frozen=True)
class RunShape:
    """What a data function is called for: microbatches per step, replicas, the data's seed and the steps."""

    microbatches: int
    dp: int
    seed: int
    steps: int


def check_feed(plan_dir: Path, plan: Any, zoo: Any, data_spec: Any, loss_spec: str | None, shape: RunShape, *,
               trust_ops: tuple[str, ...] = (), timeout: float | None = None) -> Feed:
    """``--data`` and ``--loss`` against the plan, before any rank starts (see the module's docstring); one line
    (an FxpipeError) for the first thing wrong. ``zoo``: the plan's built-in model built on the meta device
    (``fxpipe.cli.rank.zoo_of``), or None for the user's own."""
    microbatches, dp, seed, steps = shape.microbatches, shape.dp, shape.seed, shape.steps
    import torch

    from fxpipe import data
    from fxpipe.errors import OptionError
    from fxpipe.targets import resolve_function

    source: Any = data.parse_data(data_spec) if isinstance(data_spec, str) else data_spec  # hf: the launcher's
    name = plan.provenance.model or "a model compiled through the Python API"
    if plan.strategy is not None and zoo is None:
        raise OptionError(f"a per-layer strategy plan trains a built-in model, which its ranks trace again (this plan "
                          f"is of {name}); compile {name} without --strategy")
    if loss_spec is None and zoo is None:
        raise OptionError(f"this plan is of {name}, not a built-in model, so fxpipe run has no loss for it; pass "
                          "--loss FILE.py:FUNCTION, a function (outputs, target) -> scalar tensor")
    loss_fn = resolve_function(loss_spec, "--loss", "my_model.py:loss") if loss_spec is not None else None
    fn = resolve_function(source.spec, "--data", "my_data.py:batches") if isinstance(source, data.UserData) else None
    if zoo is not None and loss_fn is None and fn is None and isinstance(source, data.Synthetic):
        return Feed(source, None, None)  # the built-in model's own batch and loss
    example, output, bounds = _meta_output(plan_dir, plan, zoo, trusted_ops(trust_ops))
    rows = int(plan.inputs[0].shape[0]) if plan.inputs and plan.inputs[0].shape else 1
    fit = None
    target: Any = None
    if fn is not None:
        ctx = data.DataContext(-1, True, True, 0, dp, microbatches, rows, seed, 0, steps,
                               input_specs(plan, microbatches))
        first = data.user_batches(_call_data(fn, ctx, source.spec, timeout), ctx, source.spec)(0)
        _check_batch(first, plan, ctx, source.spec)
        target = first[1]
    elif isinstance(source, data.Synthetic):
        if zoo is not None:
            target = torch.zeros(zoo.example_target.shape, dtype=zoo.example_target.dtype)
        else:  # the user's model: the first synthetic target its loss takes
            assert loss_fn is not None
            found = _synthetic_target(loss_fn, f"--loss {loss_spec}", output, rows)
            spec = {"bounds": {str(i): n for i, n in bounds.items()}, "target": found}
            return Feed(source, None, json.dumps(spec))
    else:
        fit = data.check_fit(source, example, tuple(_logits(output).shape))
        if loss_fn is not None and isinstance(source, data.Digits):
            target = source.batch(0, rows, seed=seed, layout=cast(Any, fit.layout), dtype=fit.dtype)[1]
        elif loss_fn is not None:
            target = source.batch(0, rows, fit.seq_len, seed=seed)[1]
    if loss_fn is not None:
        _check_loss(loss_fn, f"--loss {loss_spec}", output, target, rows, timeout=timeout)
    elif fn is not None:  # the built-in model's own loss, on the data function's target
        _check_loss(zoo.loss_fn, f"{name}'s own loss (no --loss)", output, target, rows, timeout=timeout,
                    fix=f"give the targets {name}'s loss takes (fxpipe inspect PLAN shows them), or pass --loss")
    return Feed(source, fit, None)


def loss_of(zoo: Any, spec: str | None) -> Callable[[Any, Any], Any]:
    """A rank's loss: ``--loss``'s function, else the built-in model's."""
    if spec is None:
        return zoo.loss_fn
    from fxpipe.targets import resolve_function

    return resolve_function(spec, "--loss", "my_model.py:loss")


def rank_batches(spec: str, plan: Any, ctx: Any, zoo_batch: Callable[[int], tuple[Any, Any]] | None,
                 synthetic: str | None = None, timeout: float | None = None) -> Callable[[int], tuple[Any, Any]]:
    """``batch(step)`` for the rank ``ctx`` (a ``fxpipe.data.DataContext``) describes: its replica's rows, the
    inputs only with ``ctx.needs_inputs``, the target only with ``ctx.needs_targets``; a rank that needs
    neither reads nothing (and calls no data function). ``zoo_batch(m)``: a built-in model's synthetic batch of
    m microbatches (None: the user's own model, whose batch ``synthetic`` describes)."""
    from fxpipe import data
    from fxpipe.targets import resolve_function

    if not ctx.needs_inputs and not ctx.needs_targets:
        return lambda k: (None, None)
    source = data.parse_data(spec)

    def mine(batch: tuple[Any, Any]) -> tuple[Any, Any]:
        inputs, target = batch
        return (tuple(inputs) if ctx.needs_inputs else None), (target if ctx.needs_targets else None)

    if isinstance(source, data.UserData):
        fn = resolve_function(source.spec, "--data", "my_data.py:batches")
        return data.user_batches(_call_data(fn, ctx, source.spec, timeout), ctx, source.spec)
    if isinstance(source, data.Synthetic):
        m = ctx.microbatches * ctx.replicas
        fixed = zoo_batch(m) if zoo_batch is not None else synthetic_batches(plan, m, synthetic)
        shard = mine((tuple(_replica(x, ctx) for x in fixed[0]), _replica(fixed[1], ctx)))
        return lambda k: shard
    fit = data.check_fit(source, _example_zeros(plan), None)
    size, shard = ctx.batch_size * ctx.replicas, (ctx.replica, ctx.replicas)
    if isinstance(source, data.Digits):
        def digits(k: int) -> tuple[Any, Any]:
            x, y = source.batch(k, size, seed=ctx.seed, layout=cast(Any, fit.layout), dtype=fit.dtype, shard=shard)
            return mine(((x,), y))
        return digits

    def tokens(k: int) -> tuple[Any, Any]:
        assert fit.seq_len is not None  # a token source's fit has its sequence length
        idx, target = source.batch(k, size, fit.seq_len, seed=ctx.seed, shard=shard)
        return mine(((idx,), target))
    return tokens


def eval_batches(spec: str, plan: Any, ctx: Any, max_batches: int) -> list[tuple[Any, Any]]:
    """The held-out batches of ``--eval-data`` (or ``--data``) for the rank ``ctx`` describes: its replica's rows
    of each global batch (``fxpipe.data.held_out_batches``), what its stages consume."""
    from fxpipe import data

    source = data.parse_data(spec)
    if isinstance(source, (data.UserData, data.Synthetic)):
        from fxpipe.errors import OptionError

        raise OptionError(f"--eval-data {spec} has no held-out split; use digits, text:, jsonl: or hf: data")
    fit = data.check_fit(source, _example_zeros(plan), None)
    batches = data.held_out_batches(source, ctx.batch_size * ctx.replicas, seq_len=fit.seq_len,
                                    max_batches=max_batches, layout=cast(Any, fit.layout), dtype=fit.dtype,
                                    shard=(ctx.replica, ctx.replicas))
    return [((x,) if ctx.needs_inputs else None, y if ctx.needs_targets else None) for x, y in batches]


def synthetic_batches(plan: Any, m: int, synthetic: str | None) -> tuple[tuple[Any, ...], Any]:
    """``--data synthetic``'s one batch of m microbatches for the user's own model: random inputs shaped like the
    plan's (an integer input below the embedding rows it indexes, else 0) and a random target its loss takes, as
    the launcher found them (``synthetic``: JSON)."""
    import torch

    found = json.loads(synthetic or "{}")
    gen = torch.Generator().manual_seed(SYNTHETIC_SEED)
    inputs = []
    for i, x in enumerate(_example_zeros(plan)):
        shape = (x.shape[0] * m, *x.shape[1:])
        if x.is_floating_point():
            inputs.append(torch.randn(shape, generator=gen, dtype=x.dtype))
        else:
            inputs.append(torch.randint(0, int(found.get("bounds", {}).get(str(i), 1)), shape, generator=gen,
                                        dtype=x.dtype))
    return tuple(inputs), _draw_target(found.get("target", [[1], "float32", None]), m, gen)


def scored(spec: str) -> bool:
    """Whether ``--data spec`` is built-in real data, which the launcher scores on its held-out split."""
    kind = spec.strip().partition(":")[0].lower()
    return kind in ("digits", "text", "jsonl")


# --------------------------------------------------------------------------------------------- helpers


def _call_data(fn: Callable[..., Any], ctx: Any, spec: str, timeout: float | None = None) -> Any:
    """``fn(ctx)``, the user's data function: an exception is one line, and with ``timeout`` a call that has not
    returned after that many seconds is one line too (see :func:`_within`)."""
    from fxpipe.targets import call_user

    return _within(lambda: call_user(lambda: fn(ctx), f"--data {spec}", "fix the data function (it is called with a "
                                     "fxpipe.data.DataContext)"), timeout,
                   f"--data {spec} did not return within --timeout {timeout or 0:g} s (on rank {ctx.rank}; -1: the "
                   "launcher's check); make the function return its batches, or raise --timeout")


def _within(call: Callable[[], Any], timeout: float | None, late: str) -> Any:
    """``call()``, a user's function; with ``timeout``, one that has not returned after that many seconds raises
    OptionError(``late``) instead. It runs in a thread of its own, left behind: a blocked read of a FIFO, a lock or a
    loop that never ends would otherwise hang the launcher, or every rank at once, where no collective times out."""
    import os
    import threading

    from fxpipe.errors import OptionError

    if timeout is None:
        return call()
    result: list[Any] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:  # noqa: BLE001  (handed to the caller's thread)
            failed.append(exc)

    real_exit = os._exit  # call_user guards it while the function runs; a call left behind must not keep it
    worker = threading.Thread(target=run, name="fxpipe-user-function", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        os._exit = real_exit  # the process goes on (or exits) without the guard of a call that never returned
        raise OptionError(late)
    if failed:
        raise failed[0]
    return result[0]


def _replica(x: Any, ctx: Any) -> Any:
    """Replica ``ctx.replica``'s rows of a global batch's tensor."""
    import torch

    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return x
    return x.tensor_split(ctx.replicas)[ctx.replica]


def _example_zeros(plan: Any) -> tuple[Any, ...]:
    """Zeros shaped like the plan's flat inputs (one microbatch)."""
    import torch

    return tuple(torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in plan.inputs)


def input_specs(plan: Any, m: int) -> tuple[tuple[str, tuple[int, ...], Any], ...]:
    """``DataContext.inputs``: each of the plan's inputs as one replica's batch of m microbatches holds it."""
    import torch

    return tuple((s.name, (s.shape[0] * m, *s.shape[1:]) if s.shape else (), getattr(torch, s.dtype))
                 for s in plan.inputs)


def trusted_ops(extra: str | Sequence[str] | None) -> tuple[str, ...]:
    """The libraries whose operators a plan may call: transformers (``serialize.TRUSTED_LIBRARIES``) and --trust-ops
    (comma-separated names)."""
    from fxpipe.graphs.serialize import TRUSTED_LIBRARIES

    names = extra.split(",") if isinstance(extra, str) else list(extra or ())
    return tuple(dict.fromkeys((*TRUSTED_LIBRARIES, *(n.strip() for n in names if n.strip()))))


def _meta_output(plan_dir: Path, plan: Any, zoo: Any,
                 trust_ops: tuple[str, ...]) -> tuple[tuple[Any, ...], Any, dict[int, int]]:
    """The example inputs (one microbatch, on meta), the model's output on them computed on the meta device (the
    built-in model's, else the plan's stages moved there), and for each integer input an embedding indexes, its
    rows (``fxpipe.data.index_bounds``)."""
    import fxpipe
    from fxpipe.data import index_bounds
    from fxpipe.errors import OptionError, PlanFileError, first_line

    if zoo is not None:
        return tuple(zoo.example_inputs), zoo.model(*zoo.example_inputs), {}
    pipe = fxpipe.load(plan_dir, trust_ops=trust_ops).to_device("meta")
    example = tuple(x.to("meta") for x in _example_zeros(plan))

    from fxpipe.plan_dir import run_on_meta

    try:
        output, bounds = index_bounds(lambda *flat: run_on_meta(pipe, list(flat), plan_dir), example)
    except PlanFileError:
        raise
    except Exception as exc:  # noqa: BLE001  (a graph that cannot run on meta: say so, in one line)
        raise OptionError(f"the plan's stages could not be run on the meta device to find its output's shape "
                          f"({first_line(exc)}); re-run fxpipe compile") from exc
    return example, output, bounds


def _logits(output: Any) -> Any:
    """The tensor a data source feeds: the output itself, a Hugging Face output's ``.logits``, or the first of
    a tuple."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    from fxpipe.errors import OptionError

    raise OptionError(f"the model returns a {type(output).__name__}, and fxpipe run's built-in data feeds a model "
                      "that returns a tensor (or .logits); pass --data FILE.py:FUNCTION")


def _draw_target(found: list[Any], m: int, gen: Any) -> Any:
    """A random target of m microbatches: ``[shape of one, dtype, high]``, class ids below ``high`` (int64) or
    normal floats (high None)."""
    import torch

    shape, dtype, high = found
    shape = (shape[0] * m, *shape[1:]) if shape else ()
    if high is not None:
        return torch.randint(0, int(high), shape, generator=gen, dtype=getattr(torch, dtype))
    return torch.randn(shape, generator=gen, dtype=getattr(torch, dtype))


def _synthetic_target(fn: Callable[..., Any], what: str, output: Any, rows: int) -> list[Any]:
    """The synthetic target a user model's loss takes, tried in turn on one microbatch: class ids below the
    output's last dimension, shaped like the output without it (a classifier, a language model), then floats
    shaped like the output (a regression)."""
    import torch

    from fxpipe.errors import TargetError, first_line

    leaf = _logits(output)
    tries = [[list(leaf.shape[:-1]), "int64", int(leaf.shape[-1])]] if leaf.dim() >= 2 else []
    tries.append([list(leaf.shape), str(leaf.dtype).removeprefix("torch."), None])
    why = ""
    for found in tries:
        try:
            with warnings.catch_warnings():  # a try that does not fit may warn before it raises (mse_loss's sizes)
                warnings.simplefilter("ignore")
                _check_loss(fn, what, output, _draw_target(found, 1, torch.Generator().manual_seed(0)), rows)
            return found
        except TargetError as exc:
            why = first_line(exc.__cause__ or exc)
    shapes = " or ".join(f"{'class ids' if h is not None else 'floats'} {s}" for s, _, h in tries)
    raise TargetError(f"{what} takes no synthetic target ({shapes}; last: {why}); pass --data FILE.py:FUNCTION "
                      "with your targets")


def _check_batch(batch: tuple[Any, Any], plan: Any, ctx: Any, spec: str) -> None:
    """A data function's first batch against the plan's inputs (one replica's batch: microbatches x rows)."""
    import torch

    from fxpipe.errors import OptionError

    inputs, target = batch
    want = ctx.inputs
    if inputs is None or len(inputs) != len(want):
        raise OptionError(f"--data {spec} gave {0 if inputs is None else len(inputs)} inputs per batch, and the plan "
                          f"takes {len(want)} ({', '.join(n for n, _, _ in want)}); give (inputs, target) with "
                          "the model's inputs")
    for x, (name, shape, dtype) in zip(inputs, want):
        got = f"{list(x.shape)} {str(x.dtype).removeprefix('torch.')}" if isinstance(x, torch.Tensor) else \
            type(x).__name__
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape or x.dtype != dtype:
            raise OptionError(f"--data {spec} gave input {name} as {got}, and the plan expects {list(shape)} "
                              f"{str(dtype).removeprefix('torch.')} ({ctx.microbatches} microbatches x "
                              f"{ctx.rows} rows, as compiled); give batches of that shape (ctx.batch_size rows)")
    if isinstance(target, torch.Tensor) and (target.dim() == 0 or target.shape[0] != ctx.batch_size):
        raise OptionError(f"--data {spec} gave a target of shape {list(target.shape)}, and a batch has "
                          f"{ctx.batch_size} rows ({ctx.microbatches} microbatches x {ctx.rows}); give one target "
                          "row per input row")


def _check_loss(fn: Callable[..., Any], what: str, output: Any, target: Any, rows: int, *,
                fix: str = "fix the loss: it is called as loss(outputs, target) on one microbatch",
                timeout: float | None = None) -> None:
    """The loss (``what`` names it) on an output of the plan's shape (random, on the CPU) and one microbatch's
    target: a scalar that depends on the output, returned within ``timeout`` seconds."""
    import torch

    from fxpipe._compat import pytree
    from fxpipe.errors import OptionError
    from fxpipe.targets import call_user

    gen = torch.Generator().manual_seed(0)
    leaves, spec_tree = pytree.tree_flatten(output)
    real = [torch.randn(x.shape, generator=gen, dtype=x.dtype).requires_grad_(True)
            if isinstance(x, torch.Tensor) and x.is_floating_point() else
            torch.zeros(x.shape, dtype=x.dtype) if isinstance(x, torch.Tensor) else x for x in leaves]
    out = pytree.tree_unflatten(real, spec_tree)
    if isinstance(target, torch.Tensor) and target.dim() > 0:
        target = target[:rows]
    with torch.enable_grad():
        loss = _within(lambda: call_user(lambda: fn(out, target), what, fix), timeout,
                       f"{what} did not return within --timeout {timeout or 0:g} s (the launcher's check, on one "
                       "microbatch of random outputs); make it return, or raise --timeout")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.dim() != 0:
        got = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}"
        raise OptionError(f"{what} returned {got}, not a scalar tensor; reduce it to one value (e.g. .mean())")
    if not loss.requires_grad:
        raise OptionError(f"{what} returned a scalar that does not depend on the model's outputs; compute it "
                          "from the outputs it is given")
