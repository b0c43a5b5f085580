"""Generators: closed forms hold in simulation, every schedule validates, and the executor gives eager's gradients."""

from __future__ import annotations

import copy

import pytest
import torch

import fxpipe
from fxpipe import models
from fxpipe.errors import OptionError
from fxpipe.schedules.generators import GENERATORS, generate
from fxpipe.schedules.simulate import Costs, simulate, validate
from tests.schedules._gradients import every_generator_gives_eagers_gradients

COSTS = [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (1.0, 1.5, 0.5), (1.0, 2.0, 1.0)]


def _bubble(name: str, p: int, m: int, fbw: tuple[float, float, float]) -> tuple[float, int, int]:
    costs = Costs.uniform(p, *fbw)
    result = simulate(generate(name, p, m, costs), costs)
    return (result.max_stage_span - m * sum(fbw), max(r.peak_in_flight for r in result.ranks),
            round(result.max_stage_span, 9))  # type: ignore[return-value]


@pytest.mark.parametrize("fbw", COSTS)
@pytest.mark.parametrize("p, m", [(2, 4), (3, 7), (4, 8), (4, 16), (8, 16), (8, 24)])
def test_closed_forms(p: int, m: int, fbw: tuple[float, float, float]) -> None:
    f, b, w = fbw
    for name in ("gpipe", "1f1b"):
        bubble, _, span = _bubble(name, p, m, fbw)
        assert bubble == pytest.approx((p - 1) * (f + b + w))
        assert bubble / span == pytest.approx((p - 1) / (m + p - 1))  # of the span, with BW = B + W
    _, peak_1f1b, _ = _bubble("1f1b", p, m, fbw)
    assert peak_1f1b == p
    bubble, peak, _ = _bubble("zb-h1", p, m, fbw)
    assert bubble == pytest.approx((p - 1) * (f + b - w)) and peak <= peak_1f1b
    bubble, peak, _ = _bubble("zb-h2", p, m, fbw)
    assert bubble == pytest.approx(max(0.0, (p - 1) * (f + b - 2 * w))) and peak <= 2 * peak_1f1b


def test_the_worked_example() -> None:
    costs = Costs.uniform(4, 1, 1, 1)
    spans = {n: simulate(generate(n, 4, 8, costs), costs).max_stage_span for n in ("1f1b", "zb-h1", "zb-h2")}
    assert spans == {"1f1b": 33, "zb-h1": 27, "zb-h2": 24}


def test_1f1b_keeps_p_minus_s_microbatches_in_flight_on_stage_s() -> None:
    costs = Costs.uniform(4, 1, 1, 1)
    result = simulate(generate("1f1b", 4, 8, costs), costs)
    assert [r.peak_in_flight for r in result.ranks] == [4, 3, 2, 1]


def test_interleaved_bubble_is_divided_by_the_stages_per_rank() -> None:
    costs = Costs.uniform(8, 1, 1, 1)  # 8 stages on 4 ranks, 2 per rank
    result = simulate(generate("interleaved-1f1b", 8, 8, costs), costs)
    ideal = 2 * 8 * 3  # per rank: 2 stages x 8 microbatches x (F + B + W)
    # Megatron: the bubble is (p-1)/(v m) of the ideal, half of 1F1B's over the same 2-stage ranks.
    assert result.max_stage_span - ideal == pytest.approx((4 - 1) / (2 * 8) * ideal)
    one_rank_per_pair = Costs.uniform(4, 2, 2, 2)
    plain = simulate(generate("1f1b", 4, 8, one_rank_per_pair), one_rank_per_pair)
    assert result.max_stage_span - ideal == pytest.approx((plain.max_stage_span - ideal) / 2)


def test_async_1f1b_reports_pipedreams_staleness() -> None:
    costs = Costs.uniform(4, 1, 1, 1)
    result = simulate(generate("async-1f1b", 4, 8, costs), costs)
    assert result.staleness == {0: 3, 1: 2, 2: 1, 3: 0}  # p - 1 - s weight updates between F and B
    per_mb = result.staleness_per_microbatch
    assert [per_mb[(0, m)] for m in range(8)] == [0, 1, 2, 3, 3, 3, 3, 3]  # the warm-up sees fresher weights
    assert simulate(generate("1f1b", 4, 8, costs), costs).staleness_per_microbatch == {}


@pytest.mark.parametrize("name", sorted(GENERATORS))
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_every_generator_validates(name: str, p: int) -> None:
    for m in sorted({1, p, 2 * p, 4 * p, 2 * p + 1}):
        if name == "interleaved-1f1b":
            if p % 2:
                with pytest.raises(OptionError, match="multiple of 2"):
                    generate(name, p, m)
                continue
            if m % (p // 2):
                with pytest.raises(OptionError, match="multiple of the ranks"):
                    generate(name, p, m)
                continue
        validate(generate(name, p, m))


# 2 and 4 stages:
# tests/runtime/test_schedules_eager.py::test_every_generator_and_microbatch_count_gives_eagers_gradients
# makes this same check on the pipelines it compiles for those stage counts anyway (one compile instead of two).
@pytest.mark.parametrize("stages", [3])
@pytest.mark.parametrize("model", ["mlp-tiny", "gpt-tiny"])
def test_every_schedule_gives_eagers_gradients_through_the_reference_executor(model: str, stages: int) -> None:
    zoo = models.build(model, dtype=torch.float64)
    mine = copy.deepcopy(zoo.model)
    pipe = fxpipe.compile(mine, zoo.example_inputs, stages=stages)
    every_generator_gives_eagers_gradients(mine, pipe, zoo, stages)


@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 2), (3, 5), (4, 8)])
@pytest.mark.parametrize("defer_w", [True, False])
def test_the_backends_one_rank_order_is_a_valid_schedule(p: int, m: int, defer_w: bool) -> None:
    """backend="fxpipe" runs a Schedule too: every F first, then B back with W deferred by one microbatch."""
    from fxpipe.schedules.generators import one_rank
    from fxpipe.schedules.simulate import validate

    sched = one_rank(p, m, defer_w=defer_w)
    validate(sched)
    assert sched.num_ranks == 1 and sched.rank_of_stage == (0,) * p
    acts = sched.ranks[0]
    assert [str(a) for a in acts[: p * m]] == [f"{s}F{i}" for i in range(m) for s in range(p)]
    if defer_w and m > 1:
        assert str(acts[p * m + p]) == f"{p - 1}B1" and str(acts[p * m + p + 1]) == f"{p - 1}W0"


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_zero_bubble_orders_do_not_depend_on_the_time_unit(name: str) -> None:
    """At costs of 1e7 a wait of t + 1e-9 rounds back to t; the greedy generator used to loop forever there."""
    from fxpipe.schedules.generators import GENERATORS
    from fxpipe.schedules.simulate import Costs

    big = GENERATORS[name](4, 8, Costs.uniform(4, 1e7, 1e7, 1e7))
    assert big.ranks == GENERATORS[name](4, 8, Costs.uniform(4, 1.0, 1.0, 1.0)).ranks


def test_zero_bubble_jumps_to_the_next_arrival_when_transfers_dwarf_compute() -> None:
    """Microsecond stages over a 100 ms link (the zoo's tiny models on the default link): an idle stage used to
    re-check every 1e-9 s until the message arrived, 1e8 steps per wait (minutes for 4 stages x 8 microbatches;
    the schedule test of `auto` on mlp took 80 s). Each wait is now one step to the next arrival, and the order is
    the one the same costs give at a unit where the old 1e-9 step was fine."""
    import dataclasses

    from fxpipe.schedules.generators import zb_h2
    from fxpipe.schedules.simulate import Costs, simulate

    fast = dataclasses.replace(Costs.uniform(4, 1e-6, 1e-6, 1e-6), send_bytes=(1.0,) * 4, bandwidth=1e12, latency=0.1)
    sched = zb_h2(4, 8, fast)
    validate(sched)
    scaled = dataclasses.replace(Costs.uniform(4, 1e3, 1e3, 1e3), send_bytes=(1.0,) * 4, bandwidth=1e3, latency=1e8)
    assert sched.ranks == zb_h2(4, 8, scaled).ranks
    # every microbatch crosses 3 links forward and 3 back, one after another
    assert simulate(sched, fast).makespan >= 6 * 0.1
