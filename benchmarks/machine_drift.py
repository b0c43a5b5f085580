"""How steady this machine's compute is: one fixed matmul loop on one thread, timed again and again.

    OMP_NUM_THREADS=1 python benchmarks/machine_drift.py [--seconds 90] [--size 384] [--repeat 50] [--json FILE]

Each sample times ``--repeat`` products of two ``--size`` x ``--size`` float32 matrices, then sleeps half a second,
for ``--seconds``. Nothing in it changes between samples, so the spread of the samples is the machine's (other
guests on the host, frequency changes), not fxpipe's: it bounds how close any profile taken at one moment can come
to a step measured at another (issue 44's "simulated within 20% of measured"). Prints min, median, max and the
samples; run it with nothing else running.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def samples(seconds: float, size: int, repeat: int) -> list[float]:
    """Milliseconds of each sample of ``repeat`` products, over ``seconds``."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    out: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        for _ in range(repeat):
            a @ b
        out.append((time.perf_counter() - t0) * 1e3)
        time.sleep(0.5)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--size", type=int, default=384)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--json", help="also write the samples here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    got = samples(args.seconds, args.size, args.repeat)
    gflops = 2 * args.size ** 3 * args.repeat / 1e6
    med = statistics.median(got)
    print(f"{len(got)} samples of {args.repeat} x {args.size}^3 matmul, 1 thread, load average {load:.2f} before: "
          f"min {min(got):.1f}, median {med:.1f}, max {max(got):.1f} ms ({gflops / med:.1f} GFLOP/s at the median); "
          f"max / min {max(got) / min(got):.2f}; samples beyond 20% of the median: "
          f"{sum(abs(x / med - 1) > 0.2 for x in got)} of {len(got)}")
    print(" ".join(f"{x:.0f}" for x in got))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "repeat": args.repeat, "load_before": load, "ms": got}, f)


if __name__ == "__main__":
    main()
