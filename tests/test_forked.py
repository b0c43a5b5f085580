"""The tests' forked processes (tests/_helpers.py: ``Forked``, ``run_forked``) behave as ``python ARGV`` would."""

from __future__ import annotations

import os

from tests._helpers import run_forked


def test_a_forked_process_computes_on_the_threads_its_environment_names() -> None:
    """torch reads ``OMP_NUM_THREADS`` as it loads, which the fork server did before the child's environment was
    set: a child given 1 (as every rank is) would otherwise compute on the server's count, all of them on 2 cores."""
    code = "import torch; print(torch.get_num_threads())"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    one = run_forked(["-c", code], env={**env, "OMP_NUM_THREADS": "1"})
    assert one.returncode == 0, one.stderr[-2000:]
    assert one.stdout.split() == ["1"]
