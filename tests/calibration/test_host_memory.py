"""fxpipe.calibration.host_memory: with the thresholds raised, a large temporary freed and allocated again is reused
from the heap instead of faulting its pages in again (counted in a fresh process each, as the setting is process-wide
and cannot be undone); nothing is raised unless asked."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from fxpipe.calibration import host_memory
from fxpipe.calibration.host import HostTuning

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="glibc's mallopt: Linux only")

PROBE = """
import json, resource, torch
import sys
from fxpipe.calibration.host import HostTuning
kept = HostTuning(keep_freed_memory=sys.argv[1] == "1").apply(0, 1)[1]
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


def _probe(setting: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", PROBE, setting], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_memory_is_reused_without_faulting_its_pages_again() -> None:
    kept, default = _probe("1"), _probe("0")
    assert kept["kept"] is True and default["kept"] is False
    pages = 9437184 // 4096  # the gradient's
    # glibc's defaults: its pages (and the scratch space's) are returned to the kernel at a free and faulted in again
    # at the next call (4,600 faults per call here); not at every free: its dynamic thresholds, and whatever else sits
    # at the heap's top, can keep them for a call (once in the suite, the sixth call faulted none)
    assert sum(f >= pages for f in default["faults"][2:]) >= 2, default
    # kept: from the third call on (the second may still grow the heap: an aligned allocation does not fit the
    # exactly-sized block the first one freed), the same memory comes back with its pages in place
    assert all(f < pages // 20 for f in kept["faults"][2:]), kept


def test_mallopt_is_called_once_and_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(host_memory, "_kept", None)  # as in a fresh process
    monkeypatch.setattr(host_memory, "_raise_thresholds", lambda: calls.append(1) or True)
    assert HostTuning().apply(0, 1) == (0, False) and calls == []
    assert HostTuning(keep_freed_memory=True).apply(0, 1)[1] is True and calls == [1]
    assert host_memory.keep_freed_memory() is True and calls == [1]  # once per process
