"""Keyword arguments of an older signature, applied to the frozen options dataclass that now holds them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def with_overrides(options: T, overrides: Mapping[str, Any], where: str) -> T:
    """``options`` with each field named in ``overrides`` replaced (``dataclasses.replace``).

    Callers written before the options dataclass keep working while they move to it: ``f(x, lr=0.1)`` is
    ``f(x, options=replace(options, lr=0.1))``.

    Args:
        options: A dataclass instance (frozen: the caller's value is never changed).
        overrides: Field name -> value, as the caller passed them.
        where: The callable's name, for the error.

    Returns:
        ``options`` itself when ``overrides`` is empty, else a new instance.

    Raises:
        TypeError: A name that is no field of ``options``, as Python's own unexpected keyword argument.
    """
    if not overrides:
        return options
    fields = [f.name for f in dataclasses.fields(options)]  # type: ignore[arg-type]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}; its options are "
                        f"{type(options).__name__}'s fields: {', '.join(fields)}")
    return dataclasses.replace(options, **overrides)  # type: ignore[type-var]
