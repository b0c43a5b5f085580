"""fxpipe.host_memory: with the thresholds raised, a large temporary freed and allocated again is reused from the
heap instead of faulting its pages in again (measured in a fresh process each, as the setting is process-wide and
cannot be undone); the switch, and what a bad value says."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fxpipe import host_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="glibc's mallopt: Linux only")

PROBE = """
import json, resource, torch
from fxpipe.host_memory import keep_freed_memory
kept = keep_freed_memory()
torch.set_num_threads(1)
# the weight gradient of a 3x3 convolution over 2 x 512 x 7 x 7, as a W graph runs it: a 9.4 MB result and
# oneDNN's scratch space, allocated and freed each call
x, w, grad = torch.randn(2, 512, 7, 7), torch.randn(512, 512, 3, 3), torch.randn(2, 512, 7, 7)
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ops.aten.convolution_backward(grad, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                        [False, True, False])
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": faults}))
"""


def _probe(setting: str) -> dict[str, object]:
    env = {**os.environ, host_memory.ENV: setting}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_memory_is_reused_without_faulting_its_pages_again() -> None:
    kept, default = _probe("1"), _probe("0")
    assert kept["kept"] is True and default["kept"] is False
    pages = 9437184 // 4096  # the gradient's
    # glibc's defaults: its pages (and the scratch space's) are returned to the kernel at each free and faulted in
    # again at the next call (4,600 faults per call here)
    assert all(f >= pages for f in default["faults"][2:]), default  # type: ignore[index,union-attr]
    # kept: from the third call on (the second may still grow the heap: an aligned allocation does not fit the
    # exactly-sized block the first one freed), the same memory comes back with its pages in place
    assert all(f < pages // 20 for f in kept["faults"][2:]), kept  # type: ignore[index,union-attr]


def test_a_bad_setting_names_the_variable_and_the_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(host_memory.ENV, "yes")
    with pytest.raises(Exception, match="FXPIPE_KEEP_FREED_MEMORY takes 0 or 1"):
        host_memory._enabled()
    monkeypatch.setenv(host_memory.ENV, "0")
    assert host_memory._enabled() is False
