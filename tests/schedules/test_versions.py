"""The weight versions an asynchronous schedule implies, per policy, read off the schedule's order."""

from __future__ import annotations

import dataclasses

import pytest

from fxpipe.errors import OptionError
from fxpipe.schedules.generators import GENERATORS, async_1f1b, layerpipe_async
from fxpipe.schedules.ir import Kind
from fxpipe.schedules.simulate import Costs, simulate
from fxpipe.schedules.versions import (
    POLICIES,
    Read,
    Timing,
    held_peaks_with_versions,
    memory_report,
    reads,
    timings,
    versions_kept,
)


def test_async_1f1b_two_stages_by_hand() -> None:
    # stage 0: F0 F1 BW0 F2 BW1 F3 BW2 BW3; stage 1: F0 BW0 F1 BW1 F2 BW2 F3 BW3
    t = timings(async_1f1b(2, 4))
    assert [t[(0, m)] for m in range(4)] == [Timing(0, 0, 0), Timing(0, 1, 1), Timing(1, 2, 2), Timing(2, 3, 3)]
    assert [t[(1, m)] for m in range(4)] == [Timing(m, m, m) for m in range(4)]
    stash, predict = reads(async_1f1b(2, 4), "stash"), reads(async_1f1b(2, 4), "predict")
    assert [stash[(0, 2, phase)] for phase in "FBW"] == [Read(1), Read(1), Read(1)]
    assert [predict[(0, 2, phase)] for phase in "FBW"] == [Read(1, 1), Read(2, 0), Read(2, 0)]
    assert reads(async_1f1b(2, 4), "stale")[(0, 2, "B")] == Read(2)


def _asynchronous(name: str, p: int, m: int):  # type: ignore[no-untyped-def]
    return dataclasses.replace(GENERATORS[name](p, m), synchronous=False)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "layerpipe", "layerpipe-async"])
def test_timings_follow_the_order_for_any_schedule(name: str, p: int) -> None:
    """For fused and split backwards: f <= b <= w, each stage's updates are 0..m-1 once each, and each
    phase's count is the number of W/BW of its stage before it in the rank's order."""
    m = 2 * p
    schedule = _asynchronous(name, p, m)
    t = timings(schedule)
    for actions in schedule.ranks:
        for i, a in enumerate(actions):
            if a.kind not in (Kind.F, Kind.B, Kind.W, Kind.BW):
                continue
            before = sum(1 for x in actions[:i] if x.stage == a.stage and x.kind in (Kind.W, Kind.BW))
            got = {Kind.F: t[(a.stage, a.mb)].f, Kind.B: t[(a.stage, a.mb)].b}.get(a.kind, t[(a.stage, a.mb)].w)
            assert got == before, (name, a)
    for s in range(p):
        assert sorted(t[(s, mb)].w for mb in range(m)) == list(range(m))
        assert all(t[(s, mb)].f <= t[(s, mb)].b <= t[(s, mb)].w for mb in range(m))
    for policy in POLICIES:
        r = reads(schedule, policy)
        for (s, mb), tm in t.items():
            if policy == "stash":
                assert {r[(s, mb, ph)] for ph in "FBW"} == {Read(tm.f)}
            elif policy.startswith("predict"):  # every phase aims at one version: the update's (+ k // 2, the paper's)
                lag = s // 2 if policy == "predict" else 0
                assert (r[(s, mb, "F")], r[(s, mb, "B")], r[(s, mb, "W")]) == \
                    (Read(tm.f, tm.w - tm.f + lag), Read(tm.b, tm.w - tm.b + lag), Read(tm.w, lag))
                assert {x.version + x.ahead for x in (r[(s, mb, ph)] for ph in "FBW")} == {tm.w + lag}
            else:
                assert (r[(s, mb, "F")], r[(s, mb, "B")], r[(s, mb, "W")]) == (Read(tm.f), Read(tm.b), Read(tm.w))


def test_zero_bubble_orders_defer_w_and_predict_looks_further() -> None:
    schedule = _asynchronous("zb-h2", 4, 8)
    t = timings(schedule)
    assert any(tm.w > tm.b for tm in t.values())  # some W runs after other stages' updates of its stage
    r = reads(schedule, "predict")
    assert any(r[(s, mb, "B")].ahead > 0 for (s, mb) in t)


def test_versions_kept_per_stage() -> None:
    # 1F1B: stage s holds p - s microbatches in flight, each with its own F version (PipeDream's count)
    assert versions_kept(async_1f1b(4, 12), "stash") == {0: 4, 1: 3, 2: 2, 3: 1}
    assert versions_kept(async_1f1b(4, 12), "stale") == {0: 0, 1: 0, 2: 0, 3: 0}


def test_unknown_policy_is_one_error() -> None:
    with pytest.raises(OptionError, match="unknown weight policy 'newest'; use one of stale, stash, predict, "
                                          "predict-consistent"):
        reads(async_1f1b(2, 2), "newest")


def test_memory_report_counts_versions_and_bytes() -> None:
    report = memory_report(async_1f1b(2, 6), [2**20, 2 * 2**20])
    rows = {(r[0], r[1]): r[2:] for r in report.rows}
    assert rows[("stale", 0)] == (0, 0.0) and rows[("stash", 0)] == (2, 2.0) and rows[("stash", 1)] == (1, 2.0)


def test_predict_keeps_copies_only_where_a_phase_looks_ahead() -> None:
    # one prediction alive at most (while its phase runs); 1F1B's last stage runs each BW right after its F, so the
    # consistent variant has nothing to predict there, and the paper's version looks k // 2 = 1 further
    assert versions_kept(async_1f1b(3, 9), "predict") == {0: 1, 1: 1, 2: 1}
    assert versions_kept(async_1f1b(3, 9), "predict-consistent") == {0: 1, 1: 1, 2: 0}
    assert versions_kept(async_1f1b(3, 9), "stash") == {0: 3, 1: 2, 2: 1}


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_predict_uses_the_papers_version_distances_on_async_1f1b(n: int) -> None:
    """SpecTrain (PAPERS.md 5(a)), stage k of N, wherever the optimizer has stepped (so a prediction is made): the
    paper's version predicts floor(k/2) + N - k - 1 ahead in F and floor(k/2) in B; the consistent variant N - k - 1
    in F and none in B (1F1B's fused backward reads the version F aimed at: the live one)."""
    m = 3 * n
    schedule = async_1f1b(n, m)
    paper, consistent = reads(schedule, "predict"), reads(schedule, "predict-consistent")
    steady = 0
    for k in range(n):
        for mb in range(n, m):  # past the warm-up: every F met a stepped optimizer
            assert paper[(k, mb, "F")].version > 0
            assert paper[(k, mb, "F")].ahead == k // 2 + n - k - 1
            assert paper[(k, mb, "B")].ahead == paper[(k, mb, "W")].ahead == k // 2
            assert consistent[(k, mb, "F")].ahead == n - k - 1
            assert consistent[(k, mb, "B")].ahead == consistent[(k, mb, "W")].ahead == 0
            steady += 1
    assert steady == n * (m - n)


def test_predicted_copies_add_one_version_to_the_held_bytes() -> None:
    """Per stage, predict's peak is the activations' plus at most one copy of the stage's weights; stash's is the
    activations' plus one copy per version in flight (PipeDream's N - k)."""
    n, m = 4, 16
    sched = async_1f1b(n, m)
    fb, bw, wb = [10.0] * n, [4.0] * n, [100.0] * n
    act = held_peaks_with_versions(sched, "stale", fb, bw, wb)
    stash = held_peaks_with_versions(sched, "stash", fb, bw, wb)
    for policy in ("predict", "predict-consistent"):
        pred = held_peaks_with_versions(sched, policy, fb, bw, wb)
        kept = versions_kept(sched, policy)
        for k in range(n):
            assert act[k] + kept[k] * wb[k] >= pred[k] >= act[k] and kept[k] <= 1
            assert stash[k] == act[k] + (n - k) * wb[k]
    assert held_peaks_with_versions(sched, "predict", fb, bw, wb) == tuple(a + w for a, w in zip(act, wb))


def test_layerpipe_async_defers_each_w_one_slot_and_never_flushes() -> None:
    """LayerPipe's delayed-gradient schedule: 1F1B's F/B order, W one backward slot after its B, updates in
    microbatch order; B no longer waits for W, so with W as costly as B the stream ends sooner than fused async
    1F1B's (the gradient reaches the stage before earlier)."""
    p, m = 4, 12
    sched = layerpipe_async(p, m)
    assert not sched.synchronous
    t = timings(sched)
    for s in range(p):
        order = [a for a in sched.ranks[s] if a.stage == s]
        bs = [i for i, a in enumerate(order) if a.kind is Kind.B]
        ws = [i for i, a in enumerate(order) if a.kind is Kind.W]
        assert [order[i].mb for i in ws] == list(range(m))  # updates in microbatch order
        assert all(order[ws[i]].mb == i and ws[i] > bs[i + 1] for i in range(m - 1))  # after the next B
        assert [t[(s, mb)].w for mb in range(m)] == list(range(m))
    costs = Costs.uniform(p, 1.0, 1.0, 1.0)
    costs = Costs(costs.f, costs.b, costs.w, (1.0,) * p, costs.held_fb, costs.held_bw, latency=2.0)
    assert simulate(sched, costs).makespan < simulate(async_1f1b(p, m), costs).makespan


@pytest.mark.parametrize("p", [4, 8, 16])
def test_async_streams_keep_only_the_start_up_bubble(p: int) -> None:
    """64 microbatches with unit F, B and W: asynchronous 1F1B takes (64 + p - 1) x 3, only the start-up bubble,
    where synchronous 1F1B flushing every 8 microbatches pays its bubble 8 times."""
    from fxpipe.schedules.generators import one_f_one_b
    from fxpipe.schedules.simulate import Costs, simulate

    costs = Costs.uniform(p, 1.0, 1.0, 1.0)
    stream = simulate(async_1f1b(p, 64), costs).makespan
    flushed = 8 * simulate(one_f_one_b(p, 8), costs).makespan
    assert stream == pytest.approx((64 + p - 1) * 3)
    assert flushed == pytest.approx(8 * (8 + p - 1) * 3)
