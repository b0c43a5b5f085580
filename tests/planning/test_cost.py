"""The cost model against the simulator: every schedule's memory in flight, over a grid of stage and
microbatch counts; one link formula; no torch in fxpipe.planning."""

from __future__ import annotations

import ast
import math
import random
from pathlib import Path

import pytest

import fxpipe.planning
from fxpipe.errors import OptionError
from fxpipe.planning.cost import SCHEDULES, InFlight, activation_memory, in_flight, limited_in_flight, transfer_time
from fxpipe.schedules.generators import GENERATORS, generate
from fxpipe.schedules.ir import Schedule
from fxpipe.schedules.simulate import Costs, simulate

# Weights (bytes per microbatch F->B, B->W). (1, 0) and (0, 1) measure each kind's own peak,
# (1, 1) the total; (2, 1) and (1, 2) are exact only if the peak state (fb, total - fb),
# respectively (total - bw, bw), really occurs, which makes InFlight.memory exact for all weights.
WEIGHTS = ((1.0, 1.0), (1.0, 0.0), (0.0, 1.0), (2.0, 1.0), (1.0, 2.0))
ONE_STAGE_PER_RANK = [name for name in SCHEDULES if name != "interleaved-1f1b"]


def _grid(p: int) -> list[int]:
    """Microbatch counts: every count up to past 2p (where the shapes change), and two larger."""
    return sorted({*range(1, 2 * p + 3), 3 * p, 4 * p + 1})


def _peaks(sched: Schedule, held_fb: list[float], held_bw: list[float]) -> list[float]:
    """Each rank's peak activation memory, as the simulator measures it."""
    p = sched.num_stages
    costs = Costs((1.0,) * p, (1.0,) * p, (1.0,) * p, (0.0,) * p, tuple(held_fb), tuple(held_bw))
    return [r.peak_memory for r in simulate(sched, costs).ranks]


@pytest.mark.parametrize("name", ONE_STAGE_PER_RANK)
def test_in_flight_is_the_simulated_peak(name: str) -> None:
    """One stage per rank: InFlight.memory(a, b) equals the simulated peak for every weight."""
    for p in range(1, 7):
        for m in _grid(p):
            sched = generate(name, p, m)
            flights = in_flight(name, p, m)
            assert len(flights) == p
            uniform = simulate(sched, Costs.uniform(p, 1.0, 1.0, 1.0))
            assert [f.total for f in flights] == [r.peak_in_flight for r in uniform.ranks], (name, p, m)
            for a, b in WEIGHTS:
                want = [f.memory(a, b) for f in flights]
                assert _peaks(sched, [a] * p, [b] * p) == want, (name, p, m, (a, b))


@pytest.mark.parametrize("name", ONE_STAGE_PER_RANK)
def test_activation_memory_is_the_simulated_peak_for_any_bytes(name: str) -> None:
    rng = random.Random(f"activation-{name}")
    for p in range(1, 6):
        for m in _grid(p):
            held_fb = [rng.choice([0.0, rng.uniform(0, 100)]) for _ in range(p)]
            held_bw = [rng.choice([0.0, rng.uniform(0, 100)]) for _ in range(p)]
            got = activation_memory(name, m, held_fb, held_bw)
            assert got == pytest.approx(_peaks(generate(name, p, m), held_fb, held_bw), rel=1e-12), (p, m)


def test_interleaved_stages_exact_and_ranks_at_most_their_sum() -> None:
    """Two stages per rank: each stage's form is exact (the other stage's bytes set to 0); a
    rank's peak is at most the sum of its stages', equal when m = ranks, and 3q - 2r - 1 (q
    ranks) once m >= 2q."""
    for num_stages in range(2, 11, 2):
        q = num_stages // 2
        for m in range(q, 4 * q + 1, q):
            sched = generate("interleaved-1f1b", num_stages, m)
            flights = in_flight("interleaved-1f1b", num_stages, m)
            assert all(f.bw == 0 and f.fb == f.total for f in flights)
            for s in range(num_stages):
                alone = [1.0 if t == s else 0.0 for t in range(num_stages)]
                assert _peaks(sched, alone, alone)[sched.rank_of_stage[s]] == flights[s].total, (num_stages, m, s)
            ranks = _peaks(sched, [1.0] * num_stages, [1.0] * num_stages)
            sums = [flights[r].total + flights[r + q].total for r in range(q)]
            assert all(got <= bound for got, bound in zip(ranks, sums)), (num_stages, m)
            if m == q:
                assert ranks == sums
            if m >= 2 * q:
                assert ranks == [3 * q - 2 * r - 1 for r in range(q)]


def test_zb_h2_under_other_times_stays_within_its_limit() -> None:
    """zb-h2's order depends on the times; only its total in flight is bounded for all of them."""
    rng = random.Random("zb-h2")
    for _ in range(150):
        p = rng.randint(1, 6)
        m = rng.randint(1, 4 * p)
        times = [tuple(rng.uniform(0.05, 3.0) for _ in range(p)) for _ in range(3)]
        sched = generate("zb-h2", p, m, Costs(*times))
        bound = limited_in_flight(p, m, 2 * p - 1)
        assert max(in_flight("zb-h2", p, m)[s].total for s in range(p)) == min(m, 2 * p - 1)
        for a, b in ((1.0, 1.0), (3.0, 1.0), (1.0, 3.0)):
            peaks = _peaks(sched, [a] * p, [b] * p)
            assert all(got <= f.memory(a, b) for got, f in zip(peaks, bound)), (p, m, times)


def test_one_f_one_b_holds_what_the_partitioner_always_planned() -> None:
    for p in range(1, 9):
        for m in range(1, 3 * p):
            assert [f.total for f in in_flight("1f1b", p, m)] == [min(p - k, m) for k in range(p)]


def test_memory_picks_the_heavier_end_of_the_peak() -> None:
    f = InFlight(fb=3, bw=2, total=4)  # zb-h1, stage 1 of 4: peaks at (3, 1) and (2, 2)
    assert f.memory(10.0, 1.0) == 31.0
    assert f.memory(1.0, 10.0) == 22.0
    assert f.memory(5.0, 5.0) == 20.0


def test_every_generator_has_a_closed_form() -> None:
    assert set(SCHEDULES) == set(GENERATORS)


def test_errors_name_the_rule_and_the_fix() -> None:
    with pytest.raises(OptionError, match=r"no memory model for schedule 'x' \(known: gpipe, 1f1b.*pick one"):
        in_flight("x", 2, 2)
    with pytest.raises(OptionError, match=r"at least 1 microbatch \(microbatches: 0\)"):
        in_flight("1f1b", 2, 0)
    with pytest.raises(OptionError, match=r"at least 1 stage \(stages: 0\)"):
        in_flight("gpipe", 0, 2)
    with pytest.raises(OptionError, match=r"multiple of 2 \(stages: 3\); use 4 stages"):
        in_flight("interleaved-1f1b", 3, 3)
    with pytest.raises(OptionError, match=r"multiple of the ranks \(microbatches: 3, ranks: 2\); use 4"):
        in_flight("interleaved-1f1b", 4, 3)
    with pytest.raises(OptionError, match=r"held_fb: 2 values, held_bw: 1"):
        activation_memory("1f1b", 2, [1.0, 1.0], [1.0])
    with pytest.raises(OptionError, match=r"limit: 0"):
        limited_in_flight(2, 2, 0)


# --- the link ---------------------------------------------------------------------------------


def test_transfer_time() -> None:
    assert transfer_time(0, bandwidth=1.0, latency=3.0) == 0.0
    assert transfer_time(100, bandwidth=50.0, latency=0.5) == 2.5
    assert transfer_time(100, bandwidth=math.inf, latency=0.5) == 0.5


def test_the_simulator_uses_the_same_link_formula() -> None:
    costs = Costs((1.0,) * 3, (1.0,) * 3, (1.0,) * 3, (0.0, 100.0, 3e6), latency=1e-4, bandwidth=1.5e9)
    for stage, nbytes in enumerate(costs.send_bytes):
        assert costs.transfer(stage) == transfer_time(nbytes, bandwidth=1.5e9, latency=1e-4)
    assert Costs((1.0,), (1.0,), (1.0,)).transfer(0) == 0.0  # no bytes given: nothing to send


# --- purity -----------------------------------------------------------------------------------


def test_planning_imports_only_the_standard_library_and_fxpipe_errors() -> None:
    """Module level: the few standard modules and fxpipe.errors. Inside a function, also the optional ILP solver
    (the strategies extra: highspy, and numpy for its arrays), never torch."""
    allowed = {"__future__", "math", "collections.abc", "dataclasses", "typing", "fxpipe.errors"}
    optional = {"highspy", "numpy"}
    package = Path(fxpipe.planning.__file__).parent
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())
        inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f)}
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for name in names:
                ok = name in allowed or name.startswith("fxpipe.planning") or (id(node) in inside and name in optional)
                assert ok, f"{path.name} imports {name}"
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
                raise AssertionError(f"{path.name} calls __import__: import by name, so this test sees it")
