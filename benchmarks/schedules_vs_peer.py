"""torch.distributed.pipelining's own schedules, converted into fxpipe's IR and simulated beside ours on the same costs.

The peer's orders come from its real schedule classes, built on stand-in stages and read back from the CSV its
``_dump_csv`` writes (``fxpipe.schedules.torch_csv``: ``torch_generated_csv``, ``read_torch_csv``; its actions map
F->F, I->B, W->W, B->BW), as ``fxpipe simulate --schedule-csv`` reads them.

    python benchmarks/schedules_vs_peer.py [--models gpt mlp] [--microbatches 8] [--ranks 4]

Costs: each model compiled by fxpipe (counted FLOPs, default roofline and link), ``ranks``
stages for one-stage-per-rank schedules and ``2 x ranks`` stages for the two-per-rank ones.
"""

from __future__ import annotations

import argparse
import json

import fxpipe
from fxpipe import models
from fxpipe.errors import ScheduleError
from fxpipe.schedules.auto import auto
from fxpipe.schedules.generators import generate
from fxpipe.schedules.ir import Schedule
from fxpipe.schedules.simulate import Costs, simulate, validate
from fxpipe.schedules.torch_csv import read_torch_csv, torch_generated_csv


def peer_schedule(name: str, ranks: int, local: int, m: int) -> Schedule:
    """Torch's schedule ``name`` (a ``get_schedule_class`` name) for ``ranks`` ranks, ``local`` stages each."""
    text = torch_generated_csv(name, ranks, m, stages_per_rank=None if local == 1 else local)
    return read_torch_csv(text, f"peer:Schedule{name}").compute_only()


def costs_for(name: str, stages: int) -> Costs:
    zoo = models.build(name)
    return Costs.from_plan(fxpipe.compile(zoo.model, zoo.example_inputs, stages=stages).plan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="*", default=["gpt", "mlp"])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    p, m = args.ranks, args.microbatches
    rows = []
    for name in args.models:
        one, two = costs_for(name, p), costs_for(name, 2 * p)
        candidates: list[tuple[str, Schedule, Costs]] = [
            ("peer", peer_schedule("GPipe", p, 1, m), one),
            ("peer", peer_schedule("1F1B", p, 1, m), one),
            ("fxpipe", generate("gpipe", p, m, one), one),
            ("fxpipe", generate("1f1b", p, m, one), one),
            ("fxpipe", generate("zb-h1", p, m, one), one),
            ("fxpipe", generate("zb-h2", p, m, one), one),
            ("fxpipe", generate("layerpipe", p, m, one), one),
            ("fxpipe", auto(p, one, microbatches=[m]).schedule, one),
            ("peer", peer_schedule("Interleaved1F1B", p, 2, m), two),
            ("peer", peer_schedule("InterleavedZeroBubble", p, 2, m), two),
            ("peer", peer_schedule("ZBVZeroBubble", p, 2, m), two),
            ("peer", peer_schedule("DualPipeV", p, 2, m), two),
            ("fxpipe", generate("interleaved-1f1b", 2 * p, m, two), two),
        ]
        for who, sched, costs in candidates:
            try:
                validate(sched)
            except ScheduleError as exc:
                rows.append({"model": name, "who": who, "schedule": sched.name, "invalid": str(exc).splitlines()[0]})
                continue
            result = simulate(sched, costs)
            rows.append({"model": name, "who": who, "schedule": sched.name, "stages": sched.num_stages,
                         "ranks": sched.num_ranks, "makespan_ms": round(result.makespan * 1e3, 4),
                         "max_stage_span_ms": round(result.max_stage_span * 1e3, 4),
                         "peak_in_flight": max(r.peak_in_flight for r in result.ranks),
                         "peak_activation_MiB": round(max(r.peak_memory for r in result.ranks) / 2**20, 3)})
    print(json.dumps({"ranks": p, "microbatches": m, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
