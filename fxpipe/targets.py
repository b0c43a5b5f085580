"""Resolve a CLI target, a zoo name (``gpt-small``) or a builder (``path/to/file.py:build``), to a model and inputs;
and a function spec (``fxpipe run --loss file.py:loss``, ``--data package.module:batches``) to the function."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fxpipe.errors import TargetError, first_line
from fxpipe.plan import LIMITS

SEED_LEAST, SEED_MOST = -(2**63), 2**64 - 1  # what torch.manual_seed takes


@dataclass(frozen=True, eq=False)
class Target:
    name: str
    model: torch.nn.Module
    example_inputs: tuple[Any, ...]
    example_kwargs: dict[str, Any]


def resolve(target: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32, batch_size: int | None = None,
            seed: int = 0) -> Target:
    """``gpt``, ``gpt-tiny`` or ``file.py:build`` / ``package.module:build`` -> model and example inputs.

    A builder is called with no arguments (under ``torch.device(device)``) and returns either
    ``(model, example_inputs)``, ``(model, example_inputs, example_kwargs)``, an object with
    ``.model`` and ``.example_inputs``, or a bare model when its file also defines
    ``example_inputs()``.
    """
    LIMITS.whole("--seed", seed, SEED_MOST, "torch's generator takes a 64-bit seed", least=SEED_LEAST)
    if batch_size is not None:
        LIMITS.whole("--batch-size", batch_size, LIMITS.batch_size, "the example batch is built before anything "
                     "else is checked")
    if ":" not in target:
        from fxpipe import models

        try:
            zoo = models.build(target, device=device, dtype=dtype, batch_size=batch_size, seed=seed)
        except (MemoryError, RuntimeError) as exc:  # torch's allocator raises RuntimeError when memory runs out
            if not isinstance(exc, MemoryError) and "alloc" not in str(exc):
                raise
            raise TargetError(f"building {target} ran out of memory ({first_line(exc)}); lower --batch-size or "
                              "build it with --build-device meta") from None
        return Target(zoo.name, zoo.model, tuple(zoo.example_inputs), {})
    where, _, attr = target.rpartition(":")
    module = _import(where, target)
    builder = getattr(module, attr, None)
    if not callable(builder):
        raise TargetError(f"{where} has no callable {attr!r}; name a function that builds the model, "
                          f"e.g. {where}:build")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            built = call_user(builder, target, "fix the builder")
            model, inputs, kwargs = _unpack(built, module, target)
    if dtype != torch.float32:
        model = model.to(dtype)
        inputs = tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs)
    return Target(target, model, inputs, kwargs)


def resolve_function(spec: str, option: str, example: str) -> Callable[..., Any]:
    """``file.py:function`` or ``package.module:function`` -> the function, imported as :func:`resolve` imports a
    builder (the file runs once per process). ``option`` and ``example`` name the flag and a spec in its errors.

    Raises: TargetError (one line) for a spec without ``:``, a missing file or module, a file that fails to import,
    or a name that is absent or not callable.
    """
    where, colon, attr = spec.rpartition(":")
    if not colon or not where or not attr:
        raise TargetError(f"{option} {spec!r} is not FILE.py:FUNCTION or package.module:FUNCTION; write e.g. "
                          f"{option} {example}")
    module = _import(where, f"{option} {spec}", example)
    fn = getattr(module, attr, None)
    if not callable(fn):
        found = "absent" if fn is None else f"a {type(fn).__name__}"
        raise TargetError(f"{option} {spec}: {where} has no callable {attr!r} ({found}); name a function defined "
                          f"there, e.g. {where}:{example.rpartition(':')[2]}")
    return fn


def call_user(fn: Callable[[], Any], spec: str, fix: str) -> Any:
    """``fn()``, a call into the user's code named by ``spec``: an exception or an exit becomes one line."""
    try:
        with _no_exit(f"calling {spec}"):
            return fn()
    except TargetError:
        raise
    except Exception as exc:
        raise TargetError(f"{spec} raised {first_line(exc)}; {fix}") from exc


def _import(where: str, target: str, example: str = "my_model.py:build") -> Any:
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise TargetError(f"no such file {where} (target {target}); give an existing path, e.g. {example}")
        spec = importlib.util.spec_from_file_location(f"fxpipe_user_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise TargetError(f"cannot import {where}; give a .py file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        try:
            with _no_exit(f"importing {where}"):
                spec.loader.exec_module(module)
        except TargetError:
            raise
        except Exception as exc:
            raise TargetError(f"importing {where} failed: {type(exc).__name__}: {exc}; fix the file") from exc
        return module
    try:
        with _no_exit(f"importing {where}"):
            return importlib.import_module(where)
    except (ImportError, TypeError, ValueError) as exc:  # TypeError: a relative name ('.x'); ValueError: an empty one
        raise TargetError(f"cannot import module {where!r} ({exc}); "
                          "give a path ending in .py or an importable module") from exc


class _Exited(BaseException):
    """``os._exit`` called by the user's file while fxpipe imports or calls it (see :func:`_no_exit`)."""


@contextmanager
def _no_exit(doing: str) -> Iterator[None]:
    """The user's file may not end fxpipe: ``sys.exit`` (SystemExit) and ``os._exit`` while ``doing`` become one
    line naming it. ``os._exit`` is replaced only for the call and put back after it."""
    real = os._exit

    def refuse(code: int) -> None:
        raise _Exited(code)

    os._exit = refuse  # type: ignore[assignment]
    try:
        yield
    except (SystemExit, _Exited) as exc:
        how = "os._exit" if isinstance(exc, _Exited) else "sys.exit"
        raise TargetError(f"{doing} called {how}({exc.args[0] if exc.args else ''}), which would end fxpipe; "
                          "a model file builds a model and returns it: move the exit under "
                          "`if __name__ == \"__main__\":`") from None
    finally:
        os._exit = real


def _unpack(built: Any, module: Any, target: str) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    kwargs: dict[str, Any] = {}
    if isinstance(built, torch.nn.Module):
        make = getattr(module, "example_inputs", None)
        if not callable(make):
            raise TargetError(f"{target} returned a model but no example inputs; return (model, example_inputs) "
                              "or define example_inputs() in the same file")
        model, inputs = built, make()
    elif hasattr(built, "model") and hasattr(built, "example_inputs"):
        model, inputs = built.model, built.example_inputs
    elif isinstance(built, tuple) and len(built) in (2, 3) and isinstance(built[0], torch.nn.Module):
        model, inputs = built[0], built[1]
        kwargs = dict(built[2]) if len(built) == 3 else {}
    else:
        raise TargetError(f"{target} returned {type(built).__name__}; return (model, example_inputs)")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    return model, tuple(inputs), kwargs
