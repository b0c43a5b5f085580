"""How a test worker script ends once its results are written and its process group destroyed."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def leave() -> NoReturn:
    """Exit 0 without the interpreter's teardown, as fxpipe's own ranks do (fxpipe/cli/rank.py). That teardown can
    abort in gloo/c10d's C++ ("terminate called without an active exception", pytorch/pytorch#179291): in CI on
    2026-11-26 tests/runtime/_api_worker.py aborted so after its destroy_process_group, failing a test whose training
    had passed. Only for the success path: a worker that raised exits as Python does, with its traceback."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
