"""One value per key for the whole test session, shared by every test module that asks.

pytest imports a test file by its own name (``test_distributed``, with ``tests/runtime`` on the path: there is no
``__init__.py``), and another test module importing it as ``tests.runtime.test_distributed`` gets a second copy with
caches of its own; a launch cached there would run twice. Both copies import this module under one name."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")
_VALUES: dict[Hashable, Any] = {}


def once(key: Hashable, make: Callable[[], T]) -> T:
    """``make()``'s value, made the first time ``key`` is asked for (a failure is not kept: asked again, it runs
    again)."""
    if key not in _VALUES:
        _VALUES[key] = make()
    return _VALUES[key]
