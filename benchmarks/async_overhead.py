"""Where asynchronous training's time goes on a small model: ms per microbatch of the one-process reference
executor, asynchronous (each policy) against synchronous 1F1B, then a cProfile of the stale run.

    python benchmarks/async_overhead.py

mlp-small, 2 stages, 64 microbatches, one thread. Asynchronous training steps each stage's optimizer once per
microbatch (synchronous: once per batch of 4) and adds each W's gradients into zeroed buffers (synchronous: accumulated
inside W's GEMMs).
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

import fxpipe
from fxpipe import models
from fxpipe.runtime.reference import ReferenceExecutor
from fxpipe.schedules.generators import async_1f1b, one_f_one_b


def main() -> None:
    torch.set_num_threads(1)
    zoo = models.build("mlp-small")
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2)
    stream = [(zoo.example_inputs, zoo.example_target)] * 64
    ex = ReferenceExecutor(pipe, zoo.loss_fn)

    def sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)

    for policy in ("stale", "stash", "predict"):
        t0 = time.perf_counter()
        ex.run_async(async_1f1b(2, 64), stream, sgd, weights=policy)
        print(f"async {policy:8s} {(time.perf_counter() - t0) / 64 * 1e3:.2f} ms per microbatch")
    t0 = time.perf_counter()
    for _ in range(16):
        ex.run_schedule(one_f_one_b(2, 4), stream[:4])
    print(f"sync 1f1b       {(time.perf_counter() - t0) / 64 * 1e3:.2f} ms per microbatch")
    profile = cProfile.Profile()
    profile.enable()
    ex.run_async(async_1f1b(2, 64), stream, sgd, weights="stale")
    profile.disable()
    pstats.Stats(profile).sort_stats("cumtime").print_stats(15)


if __name__ == "__main__":
    main()
