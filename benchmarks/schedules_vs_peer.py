"""torch.distributed.pipelining's own schedules, converted into fxpipe's IR and simulated beside ours on the same costs.

The peer's orders come from its real schedule code: we call its order-building methods
(``_get_pipeline_order`` for single-stage schedules, ``_calculate_single_rank_operations`` and
``_add_bubbles_to_actions`` for multi-stage ones) on an instance given the attributes those
methods read, with no process group needed. Its actions map F->F, I->B, W->W, B->BW.

    python benchmarks/schedules_vs_peer.py [--models gpt mlp] [--microbatches 8] [--ranks 4]

Costs: each model compiled by fxpipe (counted FLOPs, default roofline and link), ``ranks``
stages for one-stage-per-rank schedules and ``2 x ranks`` stages for the two-per-rank ones.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from torch.distributed.pipelining import schedules as peer

import fxpipe
from fxpipe import models
from fxpipe.errors import ScheduleError
from fxpipe.schedules.auto import auto
from fxpipe.schedules.generators import generate
from fxpipe.schedules.ir import Action, Kind, Schedule
from fxpipe.schedules.simulate import Costs, simulate, validate

_KINDS = {"F": Kind.F, "I": Kind.B, "W": Kind.W, "B": Kind.BW}


def peer_schedule(cls: Any, ranks: int, local: int, m: int) -> Schedule:
    obj = object.__new__(cls)
    style = "v" if cls is peer.ScheduleZBVZeroBubble else "loop"
    mapping = peer.generate_stage_to_rank_mapping(ranks, ranks * local, style=style)
    attrs = {"_n_microbatches": m, "_num_stages": ranks * local, "num_stages": ranks * local, "pp_group_size": ranks,
             "n_local_stages": local, "number_of_rounds": max(1, m // ranks),
             "microbatches_per_round": m // max(1, m // ranks), "stage_index_to_group_rank": mapping}
    for k, v in attrs.items():
        setattr(obj, k, v)
    if local == 1:
        order = obj._get_pipeline_order()
    else:
        obj.pipeline_order = {r: obj._calculate_single_rank_operations(r) for r in range(ranks)}
        order = obj._add_bubbles_to_actions(ranks * local) if hasattr(obj, "_add_bubbles_to_actions") else obj.pipeline_order
    rank_actions = []
    for r in range(ranks):
        acts = []
        for a in order[r]:
            if a is None or a.computation_type.value not in _KINDS:
                continue
            acts.append(Action(a.stage_index, _KINDS[a.computation_type.value], a.microbatch_index))
        rank_actions.append(tuple(acts))
    return Schedule(f"peer:{cls.__name__}", ranks * local, m, tuple(mapping[s] for s in range(ranks * local)),
                    tuple(rank_actions))


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
            ("peer", peer_schedule(peer.ScheduleGPipe, p, 1, m), one),
            ("peer", peer_schedule(peer.Schedule1F1B, p, 1, m), one),
            ("fxpipe", generate("gpipe", p, m, one), one),
            ("fxpipe", generate("1f1b", p, m, one), one),
            ("fxpipe", generate("zb-h1", p, m, one), one),
            ("fxpipe", generate("zb-h2", p, m, one), one),
            ("fxpipe", generate("layerpipe", p, m, one), one),
            ("fxpipe", auto(p, one, microbatches=[m]).schedule, one),
            ("peer", peer_schedule(peer.ScheduleInterleaved1F1B, p, 2, m), two),
            ("peer", peer_schedule(peer.ScheduleInterleavedZeroBubble, p, 2, m), two),
            ("peer", peer_schedule(peer.ScheduleZBVZeroBubble, p, 2, m), two),
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
