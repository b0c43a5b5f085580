"""--plan auto's screen: every (stages, dp, schedule, microbatches) candidate on a device budget, its partition
the exact minimiser of the step model under the memory cap, against brute force over every partition."""

from __future__ import annotations

import itertools
import random

import pytest
from torch.testing import assert_close

from fxpipe.errors import PlanError
from fxpipe.planning.cost import allreduce_seconds, in_flight, transfer_time
from fxpipe.planning.plan_search import PLAN_SCHEDULES, Layers, plan_candidates, time_sharing


def _partitions(n: int, p: int):
    for cuts in itertools.combinations(range(1, n), p - 1):
        yield (0, *cuts, n)


@pytest.mark.parametrize("shared_cache", [False, True])
@pytest.mark.parametrize("cores", [None, 1, 2, 3])
@pytest.mark.parametrize("seed", range(12))
def test_the_best_candidate_equals_brute_force_over_every_partition(seed: int, cores: int | None,
                                                                    shared_cache: bool) -> None:
    """With ``cores``, P x dp ranks on them compute max(1, P x dp / cores) times slower (transfers do not); with a
    shared cache, each layer's time grows by its ``cold`` slope times the shift its dp replicas' copies cause."""
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    cold = tuple(rng.uniform(0, 1.5) for _ in range(n)) if shared_cache else ()
    shifts = {dp: 0.0 if dp == 1 else rng.uniform(0, 0.9) for dp in range(1, 7)}
    cache = shifts.__getitem__ if shared_cache else None
    layers = Layers(tuple(rng.uniform(0.5, 2.0) for _ in range(n)), tuple(rng.uniform(0, 3) for _ in range(n)),
                    tuple(rng.uniform(0, 8) for _ in range(n)), tuple(rng.uniform(0, 2) for _ in range(n)),
                    tuple(rng.uniform(0, 1) for _ in range(n - 1)), cold)
    devices = rng.randint(1, 6)
    bw, lat = rng.choice([1.0, 4.0]), rng.choice([0.0, 0.1])
    cap = rng.choice([None, 0.5 * (sum(layers.static_bytes) + 4 * sum(layers.activation_bytes))])
    cut_s = [transfer_time(b, bandwidth=bw, latency=lat) for b in layers.cut_bytes]
    best, fits_any = 0.0, False
    for p in range(1, min(n, devices) + 1):
        for m in (p, 2 * p, 4 * p):
            for schedule in PLAN_SCHEDULES:
                flights = [f.total for f in in_flight(schedule, p, m)]
                for bounds in _partitions(n, p):
                    spans = list(zip(bounds, bounds[1:]))
                    memory = max(sum(layers.static_bytes[i:j]) + flights[k] * sum(layers.activation_bytes[i:j])
                                 for k, (i, j) in enumerate(spans))
                    if cap is not None and memory > cap:
                        continue
                    fits_any = True
                    c = [cut_s[b - 1] for b in bounds[1:-1]]
                    every = range(1, devices // p + 1)
                    if shared_cache and (cores is None or cores >= devices):  # the search's documented counts
                        every = sorted({d for d in every if d & (d - 1) == 0} | {devices // p})
                    for dp in every:
                        scale = 1.0 if cores is None else max(1.0, p * dp / cores)
                        shift = shifts[dp] if shared_cache else 0.0
                        t = [scale * sum(layers.times[k] + shift * (cold[k] if cold else 0.0) for k in range(i, j))
                             for i, j in spans]
                        step = sum(t) + 2 * sum(c) + (m - 1) * max(t + c)
                        sync = max(allreduce_seconds(sum(layers.param_bytes[i:j]), dp, bw, lat) for i, j in spans)
                        best = max(best, dp * m / (step + sync))
    if not fits_any:
        with pytest.raises(PlanError, match="no plan on .* fits --memory-per-stage"):
            plan_candidates(layers, devices, bandwidth=bw, latency=lat, memory_cap=cap, cores=cores, cache=cache)
        return
    got = plan_candidates(layers, devices, bandwidth=bw, latency=lat, memory_cap=cap, cores=cores, cache=cache)
    # Without time-sharing the search tries dp at powers of two and the budget's most, brute force every count: the
    # model's throughput dp x m / (step + a + b x dp) (a ring's cost grows at most linearly in dp) grows with dp, so
    # the most wins. With fewer cores than devices it no longer does, and the search tries every dp. A shared cache's
    # shifts (arbitrary here) break that too: brute force then takes the counts the search documents.
    assert_close(got[0].throughput(got[0].model_s), best, rtol=1e-9, atol=0.0)
    assert all(c.devices <= devices and (cap is None or c.memory_bytes <= cap) for c in got)
    ranked = [c.throughput(c.model_s) for c in got]
    assert ranked == sorted(ranked, reverse=True)


def test_time_sharing_prefers_as_many_ranks_as_cores_when_compute_dominates() -> None:
    # 8 equal layers, free links: on 4 devices every rank a core of its own, 4 ranks are fastest; on 2 cores
    # the 4-rank candidates compute twice as slowly and the best uses no more ranks than cores.
    layers = Layers((1.0,) * 8, (0.0,) * 8, (0.0,) * 8, (0.0,) * 8, (0.0,) * 7)
    free = plan_candidates(layers, 4, bandwidth=float("inf"), latency=0.0)
    assert free[0].devices == 4
    shared = plan_candidates(layers, 4, bandwidth=float("inf"), latency=0.0, cores=2)
    assert shared[0].devices <= 2  # ties (4 ranks at half speed) go to fewer devices
    assert shared[0].throughput(shared[0].model_s) == pytest.approx(free[0].throughput(free[0].model_s) / 2)
    unshared = {(c.stages, c.dp, c.schedule, c.microbatches): c for c in free}
    for c in shared:  # free links: a candidate's step is its unshared step, max(1, ranks / 2) times over
        if (c.stages, c.dp, c.schedule, c.microbatches) in unshared:  # free tries dp 1, 2, 4; shared every dp
            assert c.model_s == pytest.approx(time_sharing(c.devices, 2)
                                              * unshared[c.stages, c.dp, c.schedule, c.microbatches].model_s)
    # As many cores as devices is no time-sharing at all.
    assert plan_candidates(layers, 4, bandwidth=float("inf"), latency=0.0, cores=4) == free


def test_replicas_that_overflow_the_shared_cache_lose_to_a_pipeline() -> None:
    # 2 equal layers, free links, 2 devices on 2 cores: two replicas of the whole model beat two stages (no fill)
    # until their two copies of the weights overflow the cache: at half of each weight read from memory more, each
    # layer takes 1 + 0.5 x 1 and the 2-stage pipeline wins.
    layers = Layers((1.0, 1.0), (0.0, 0.0), (0.0, 0.0), (0.0, 0.0), (0.0,), (1.0, 1.0))
    alone = plan_candidates(layers, 2, bandwidth=float("inf"), latency=0.0, cores=2)
    assert (alone[0].stages, alone[0].dp) == (1, 2)
    shared = plan_candidates(layers, 2, bandwidth=float("inf"), latency=0.0, cores=2, cache=lambda dp: 0.5 * (dp - 1))
    assert (shared[0].stages, shared[0].dp) == (2, 1)
    two = next(c for c in shared if c.dp == 2 and c.microbatches == 4 and c.schedule == "1f1b")
    assert two.model_s == pytest.approx(4 * 2 * 1.5)  # 4 microbatches of both layers at 1.5 each, no fill
    assert shared[0].model_s == next(c for c in alone if (c.stages, c.dp, c.schedule, c.microbatches)
                                     == (2, 1, shared[0].schedule, shared[0].microbatches)).model_s  # dp 1: as is


def test_a_budget_below_one_device_is_refused() -> None:
    layers = Layers((1.0,), (1.0,), (1.0,), (1.0,), ())
    with pytest.raises(PlanError, match="--devices must be at least 1"):
        plan_candidates(layers, 0, bandwidth=1.0, latency=0.0)
    with pytest.raises(PlanError, match="--cores must be at least 1"):
        plan_candidates(layers, 1, bandwidth=1.0, latency=0.0, cores=0)
