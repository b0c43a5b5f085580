"""benchmarks/papers.py: the Akintoye and OptCNN tables (quick) have their rows and a verdict, from the committed
profiles (the numbers are the benchmark's business, not this test's)."""

from __future__ import annotations

import hashlib
import importlib
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tracked_results() -> dict[str, str]:
    """Content hash of every file under benchmarks/results and benchmarks/profiles, tracked or new (what papers.py
    reads and could write)."""
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "benchmarks/results", "benchmarks/profiles"],
                           capture_output=True, text=True, cwd=ROOT, check=True).stdout.split()
    return {n: hashlib.sha256((ROOT / n).read_bytes()).hexdigest() for n in names if (ROOT / n).is_file()}


def test_papers_quick_prints_five_graded_tables_and_writes_no_tracked_file() -> None:
    before = _tracked_results()
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "papers.py"), "--quick"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert _tracked_results() == before
    verdicts = re.findall(r"\*\*Verdict: (reproduced|partly|not reproduced)\*\*", done.stdout)
    assert len(verdicts) == 5
    akintoye, optcnn = done.stdout.split("## OptCNN")[0], done.stdout.split("## OptCNN")[1].split("## SplitBrain")[0]
    rows = [line for line in akintoye.splitlines() if line.startswith("| vgg-16-512")]
    assert [int(r.split("|")[3]) for r in rows] == [1, 2, 3, 4]  # N = 1..4 in quick mode
    rows = [line for line in optcnn.splitlines() if line.startswith("| vgg-16-4096")]
    assert [r.split("|")[3].strip() for r in rows] == ["data parallel", "model parallel", "OptCNN search"]


def test_the_full_tables_that_used_to_write_write_nothing(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """LayerPipe's and SpecTrain's full tables (they once rewrote their summaries): any write fails the test."""
    papers = _bench("papers")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"papers.py wrote without --measure: {args[:1]}")

    real_open = open

    def read_only(file, mode="r", *args, **kwargs):  # type: ignore[no-untyped-def]
        if any(c in mode for c in "wax+"):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    lp, st = _bench("paper_layerpipe"), _bench("paper_spectrain")
    # the full (not quick) code path on one model each, to keep the test short
    monkeypatch.setattr(lp, "PROFILED", lp.QUICK_PROFILED)
    monkeypatch.setattr(lp, "MODELS", lp.QUICK_MODELS)
    monkeypatch.setattr(lp, "STAGES", (4, 8))
    monkeypatch.setattr(st, "PROFILED", st.QUICK_PROFILED)
    monkeypatch.setattr(st, "THROUGHPUT", st.QUICK_THROUGHPUT)
    monkeypatch.setattr(Path, "write_text", refuse)
    monkeypatch.setattr(Path, "write_bytes", refuse)
    monkeypatch.setattr(Path, "mkdir", refuse)
    monkeypatch.setattr("builtins.open", read_only)
    for name in ("layerpipe", "spectrain"):
        assert "**Verdict: " in papers.run(name, quick=False)


def test_a_missing_paper_module_is_one_line() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import papers
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    text = papers.run("nosuchpaper", quick=True)
    assert "paper_nosuchpaper.py is not there yet" in text and len(text.strip().splitlines()) == 1


def _bench(name: str):  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_model_against_measured_is_within_20_percent_of_the_measurement() -> None:
    profiles = _bench("paper_profiles")
    assert profiles.model_over_measured(120.0, 100.0) == 1.2 and profiles.model_over_measured(0.0, 0.0) == 1.0
    assert profiles.within(120.0, 100.0) and profiles.within(80.0, 100.0) and profiles.within(0.0, 0.0)
    assert not profiles.within(121.0, 100.0) and not profiles.within(79.0, 100.0) and not profiles.within(1.0, 0.0)


def test_measure_goes_only_to_the_modules_that_measure(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    papers = _bench("papers")
    seen = {}
    measuring = types.ModuleType("paper_measuring")
    measuring.main = lambda quick=False, measure=False: seen.setdefault("measuring", (quick, measure)) and "a"
    plain = types.ModuleType("paper_plain")
    plain.main = lambda quick=False: seen.setdefault("plain", quick) is not None and "b"
    monkeypatch.setitem(sys.modules, "paper_measuring", measuring)
    monkeypatch.setitem(sys.modules, "paper_plain", plain)
    assert papers.run("measuring", quick=True, measure=True).startswith("a")
    assert papers.run("plain", quick=False, measure=True).startswith("b")
    assert seen == {"measuring": (True, True), "plain": False}


def test_splitbrain_sets_its_cost_model_against_the_measured_bytes() -> None:
    sb = _bench("paper_splitbrain")
    model = sb.memory_rows("vgg-16-512", (1, 2), measured={})
    assert all(r[3] == "-" and r[8] == "-" for r in model)  # nothing measured: no comparison
    mib = sb.MIB
    # measured = the model's own bytes at K = 1, and 1.5x them at K = 2
    doc = {"vgg-16-512": {"1": {"dp": model[0][2] * mib, "splitbrain": model[0][5] * mib,
                                "parts": {"params": 1, "grads": 1, "momentum": 1}},
                          "2": {"dp": model[1][2] * mib * 1.5, "splitbrain": model[1][5] * mib,
                                "dp_parts": {"params": 2, "grads": 2, "momentum": 2},
                                "splitbrain_parts": {"params": 1, "grads": 1, "momentum": 1}}}}
    rows = sb.memory_rows("vgg-16-512", (1, 2), measured=doc)
    assert [r[4] for r in rows] == [1.0, round(1 / 1.5, 3)] and [r[7] for r in rows] == [1.0, 1.0]
    assert [r[8] for r in rows] == ["yes", "no"] and rows[1][11] == "50%"
    # the batch scales the activations, not the state: twice the batch adds exactly the activations again
    specs, _ = sb._specs(sb.paper_profiles.load("vgg-16-512"))
    one, two = sb.at_batch(specs, 16), sb.at_batch(specs, 32)
    assert sum(s.saved_bytes for s in two) == 2 * sum(s.saved_bytes for s in one) > 0
    assert [s.param_bytes for s in one] == [s.param_bytes for s in specs] and two[1].shape[0] == 32


def test_splitbrain_measured_steps_set_it_against_data_parallelism(tmp_path: Path) -> None:
    sb = _bench("paper_splitbrain")
    rows = [{"model": "m", "ranks": 2, "strategy": "dp", "predicted_s": 0.1, "measured_s": 0.1},
            {"model": "m", "ranks": 2, "strategy": "splitbrain-2", "predicted_s": 0.1, "measured_s": 0.08},
            {"model": "m", "ranks": 2, "strategy": "auto", "predicted_s": 0.1, "measured_s": 0.5}]
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"rows": rows}))
    (row,) = sb.step_rows((run,))
    # SplitBrain's step is 0.08 s against dp's 0.1 s: +25% measured, 0% modelled; the model is 1.00 and 1.25 of them
    assert row == ("m", 2, "100.0 / 100.0", "100.0 / 80.0", "+0.0% / +25.0%", "1.00, 1.25")
    assert "SplitBrain (K = 2) ran +25% to +25%" in sb._measured_steps((run,))
    assert "(1 of 2 within 20%)" in sb._measured_steps((run,))  # the search's own pick is not SplitBrain's
    assert sb.step_rows((tmp_path / "none.json",)) == [] and sb._measured_steps(()) == ""


def test_spectrain_memory_rows_count_the_copies_and_the_ratio() -> None:
    st = _bench("paper_spectrain")
    doc = {"weight_bytes": [100.0, 100.0], "policies": {
        "stale": {"measured": [10.0, 5.0], "simulated": [10.0, 5.0]},
        "stash": {"measured": [210.0, 105.0], "simulated": [210.0, 105.0]},
        "predict": {"measured": [110.0, 105.0], "simulated": [140.0, 105.0]}}}
    rows = {r["policy"]: r for r in st.memory_rows(doc)}
    assert rows["stash"]["copies"] == [2, 1] and rows["predict"]["copies"] == [1, 1]
    assert rows["stale"]["within"] and rows["stash"]["worst"] == 1.0
    assert not rows["predict"]["within"] and rows["predict"]["worst"] == 140.0 / 110.0
    assert "| predict (SpecTrain, paper) | 0.000 / 0.000 |" in st.memory_table(list(rows.values()))


def test_optcnn_sets_the_search_model_against_each_measured_run(tmp_path: Path) -> None:
    optcnn = _bench("paper_optcnn")
    row = {"model": "m", "ranks": 2, "strategy": "dp", "predicted_s": 0.09, "measured_s": 0.1, "dp_compute_s": 0.05,
           "eager_local_s": 0.06}
    paths = (tmp_path / "1.json", tmp_path / "2.json")
    paths[0].write_text(json.dumps({"rows": [row, dict(row, strategy="auto")]}))
    paths[1].write_text(json.dumps({"rows": [row, dict(row, strategy="auto", predicted_s=0.05)]}))
    rows = optcnn.measured_rows(paths)
    assert [(r[2], r[5], r[6], r[7]) for r in rows] == [("dp", "0.90 / 0.90", "yes", "-"),
                                                        ("auto", "0.90 / 0.50", "no", "-")]
    assert rows[0][8] == "50.0 / 60.0"
    assert optcnn._pick_against_dp(rows) == (", where the pick's step was +0% to +0% against data parallelism's "
                                             "(run 1; positive: slower)")
    assert optcnn._pick_against_dp(rows[:1]) == ""
    verdict = optcnn.measured_verdict(rows, paths)
    assert "within 20% in 1 of 2" in verdict and "m 2 ranks auto" in verdict and "load average" not in verdict.lower()
    assert "under-predicts" in verdict and "profile_layers.py --nodes" not in verdict
    # 50 ms of compute against 60: within 20%, so the miss is put on the runtime beyond compute
    assert "more than 20% under" not in verdict and "the runtime beyond compute" in verdict
    slow = [dict(row, dp_compute_s=0.04), dict(row, strategy="auto", dp_compute_s=0.04, predicted_s=0.05)]
    paths[1].write_text(json.dumps({"rows": slow}))
    under = optcnn.measured_verdict(optcnn.measured_rows(paths[1:]), paths[1:])
    assert "more than 20% under in m at 2 ranks 40.0 / 60.0 ms" in under
    paths[1].write_text(json.dumps({"rows": [row, dict(row, strategy="auto", predicted_s=0.05)]}))
    assert optcnn.measured_rows((tmp_path / "none.json",)) == []
    # a profiled run records the calibrated model beside it, and its load average
    paths[0].write_text(json.dumps({"rows": [dict(row, calibrated_s=0.07, predicted_s=0.11)], "argv": ["--profiles"],
                                    "load": [[0.5, 1, 1], [1.5, 1, 1]]}))
    rows = optcnn.measured_rows(paths[:1])
    assert (rows[0][5], rows[0][7]) == ("1.10", "0.70")
    verdict = optcnn.measured_verdict(rows, paths[:1])
    assert "over-predicts" in verdict and "calibrated model" in verdict and "0.70-0.70" in verdict
    assert "Load average (1 min) at the runs' start and end: 0.5-1.5" in verdict
    assert "--beside" not in verdict
    paths[0].write_text(json.dumps({"rows": [dict(row, calibrated_s=0.07, predicted_s=0.11)],
                                    "argv": ["--profiles", "--beside"]}))
    assert "as measured in the same run" in optcnn.measured_verdict(rows, paths[:1])


def test_profiled_scales_each_node_to_its_measured_share_of_the_whole_model() -> None:
    sm = _bench("strategy_measured")
    from fxpipe.planning.strategies import LayerSpec
    specs = [LayerSpec("x", kind="input"), LayerSpec("conv", seconds=0.4, fixed_seconds=0.1),
             LayerSpec("flat", kind="elementwise"), LayerSpec("fc", seconds=0.2)]
    # at 2 ranks the estimates are conv 0.3 s, fc 0.1 s; the nodes measured 0.6 and 0.3 (0.1 for the view), and the
    # whole model 0.5: the nodes are taken at 0.5 / 1.0 of what each measured alone
    doc = {"model": "m", "seconds": {"16": {"conv": 0.6, "flat": 0.1, "fc": 0.3}}, "model_seconds": {"16": 0.5}}
    out = sm.profiled(specs, ["x", "conv", "flat", "fc"], doc, 16, 2)
    assert [s.name for s in out] == ["x", "conv", "flat", "fc"]
    assert (out[1].seconds, out[1].fixed_seconds) == pytest.approx((0.4, 0.1))  # 0.3 s -> 0.3 s
    assert out[3].seconds == pytest.approx(0.3) and out[3].seconds / 2 == pytest.approx(0.15)
    assert out[2].seconds == out[2].fixed_seconds == 0.0 and out[0] == specs[0]  # no estimate: no compute
    with pytest.raises(SystemExit, match="not a rank's share 8"):
        sm.profiled(specs, ["x", "conv", "flat", "fc"], doc, 8, 4)


def test_node_seconds_times_every_call_node_and_leaves_the_statistics() -> None:
    import torch
    from torch import nn
    pl = _bench("profile_layers")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(inplace=True), nn.Linear(8, 2)).train()
    gm = torch.fx.symbolic_trace(net)
    before = {n: b.clone() for n, b in gm.named_buffers()}
    seconds = pl.node_seconds(gm, torch.randn(6, 4), runs=2)
    calls = [n.name for n in gm.graph.nodes if n.op.startswith("call_")]
    assert list(seconds) == calls == ["_0", "_1", "_2", "_3"] and all(t > 0 for t in seconds.values())
    assert all(torch.equal(b, before[n]) for n, b in gm.named_buffers())


def test_measured_papers_tables_set_each_run_against_its_simulation() -> None:
    pm = _bench("papers_measured")
    head = {"command": "python benchmarks/papers_measured.py", "started": "now", "steps": 8, "repeat": 3, "cores": 2,
            "load_before": 1.0, "load_after": 1.0}

    def case(replay: float = 1.0, **kw: object) -> dict[str, object]:
        out = {"model": "m", "ranks": 2, "batch": 32, "microbatches": 4, "bounds": [0, 3, 6], **kw}
        out["ratio"] = round(out["simulated_ms"] / out["measured_ms"], 3)  # type: ignore[operator]
        out["within_goal"] = abs(out["ratio"] - 1) <= pm.GOAL  # type: ignore[operator]
        out["replay_ratio"] = replay
        return out

    lp = pm.layerpipe_table({**head, "paper": "layerpipe", "cases": [
        case(stages=2, schedule="async-1f1b", measured_ms=100.0, simulated_ms=90.0, replay=0.97),
        case(stages=2, schedule="layerpipe-async", measured_ms=80.0, simulated_ms=50.0, replay=0.75),
        case(stages=2, schedule="1f1b", measured_ms=120.0, simulated_ms=110.0, replay=1.05)]})
    # PipeDream 100 ms against LayerPipe 80: +25% measured; simulated 90 against 50: +80%
    assert "| m | 2 (2; 4 microbatches) | 100.0 / 90.0 | 80.0 / 50.0 | +25.0% / +80.0% | 0.90, 0.62 | 0.97, 0.75 | " \
           "120.0 / 110.0 (0.92, 1.05) |" in lp
    assert "within 20% in 1 of 2 configurations (not: m 2 layerpipe-async)" in lp
    assert "The control, synchronous 1F1B: simulated / measured: 0.92-0.92; within 20% in 1 of 1" in lp
    # the runs replayed on their own action times: LayerPipe's 0.75 is the schedule model's miss, not the costs'
    assert "Replayed / measured: 0.75-0.97; within 20% in 1 of 2 configurations (not: m 2 layerpipe-async)" in lp
    assert "The control: replayed / measured: 1.05-1.05; within 20% in 1 of 1" in lp
    ak = pm.akintoye_table({**head, "paper": "akintoye", "cases": [
        case(n=1, how="1 rank", measured_ms=100.0, simulated_ms=100.0),
        case(n=2, how="dp", measured_ms=50.0, simulated_ms=40.0)]})
    # samples/s: 320 against 320 on one rank; 640 measured (S = 2.00) and 800 simulated (S = 2.50) on two
    assert "| m | 2 | dp | [0, 3, 6] | 640.0 / 800.0 | 2.00 / 2.50 | 0.80 | 1.00 |" in ak
    assert "Replayed / measured: 1.00-1.00; within 20% in 2 of 2 configurations." in ak


# --- the verdicts: each paper's thresholds, reached word by word from made-up tables ------------------------------


def test_a_part_is_met_at_the_claim_partly_at_half_the_gain_and_not_below() -> None:
    v = _bench("paper_verdicts")
    assert [v.Part("x", g, 0.25).word for g in (0.30, 0.25, 0.125, 0.12, -0.1)] == [
        "reproduced", "reproduced", "partly", "not reproduced", "not reproduced"]
    # a speedup ratio: the gain is over 1.0, so half of 8.91x is 4.955x
    assert v.Part("x", 4.96, 8.91, base=1.0).word == "partly" and v.Part("x", 4.95, 8.91, base=1.0).word == \
        "not reproduced"
    # the worst part decides; nothing to grade is not reproduced
    assert v.grade([v.Part("a", 1, 1), v.Part("b", 0.6, 1)]) == "partly" and v.grade([]) == "not reproduced"


def test_each_papers_verdict_reaches_every_word() -> None:
    v = _bench("paper_verdicts")
    words = {
        "layerpipe": [v.grade(v.layerpipe(g)) for g in ([0.3, 0.9], [0.15, 0.45], [0.15, 0.2], [])],
        "spectrain": [v.grade(v.spectrain(s)) for s in ([9.0, 1.0], [5.0], [1.3])],
        "splitbrain": [v.grade(v.splitbrain(s, e)) for s, e in ((0.67, 0.9), (0.49, 0.99), (0.49, 0.3))],
        "optcnn": [v.grade(v.optcnn(s)) for s in ([1.0, 1.5], [1.2], [1.19])],
        "akintoye": [v.grade(v.akintoye(e, d)) for e, d in ((0.85, 1.1), (0.5, 1.0), (0.9, 0.99))],
    }
    expected = ["reproduced", "partly", "not reproduced"]
    assert words == {"layerpipe": expected + ["not reproduced"], "spectrain": expected, "splitbrain": expected,
                     "optcnn": expected, "akintoye": expected}
    text = v.sentence(v.LAYERPIPE, v.layerpipe([0.1, 0.3]), "+.1%", "here")
    assert text.startswith("**Verdict: not reproduced** (here).") and "average gain +20.0% against the paper's +25.0%" \
        in text and "best gain +30.0% against the paper's +80.0% (half the gain: +40.0%)" in text


def test_spectrain_accuracy_word_needs_predicts_gain_over_stale_beyond_the_spread() -> None:
    v = _bench("paper_verdicts")
    sync = [0.90, 0.92, 0.94]
    word, why = v.spectrain_accuracy([0.90, 0.91, 0.92], [0.50, 0.60, 0.70], sync)
    assert word == "reproduced" and "above stale on 3 of 3 paired seeds" in why
    # a mean gain of 0.18 inside a standard deviation of 0.30 (stale 0.1, 0.9, 0.9): not resolved, comparable to sync
    word, why = v.spectrain_accuracy([0.90, 0.91, 0.92], [0.10, 0.90, 0.90], sync)
    assert word == "partly" and "not larger than the larger standard deviation of the two (0.377" in why
    assert v.spectrain_accuracy([0.40, 0.41, 0.42], [0.40, 0.40, 0.41], sync)[0] == "not reproduced"


def test_the_committed_tables_verdicts_follow_from_their_rows() -> None:
    """The verdict functions of the five scripts on made-up rows: the word moves with the numbers."""
    lp, ak, sb = _bench("paper_layerpipe"), _bench("paper_akintoye"), _bench("paper_splitbrain")
    row = {"stages": 8, "pd": 10.0, "lp": 10.0, "lpm": None, "pd_bytes": 1.0, "lp_bytes": 1.0}
    assert "**Verdict: not reproduced**" in lp.verdict([row])
    assert "**Verdict: reproduced**" in lp.verdict([dict(row, lp=13.0), dict(row, lp=19.0)])
    # with the moves planned, the gain is LayerPipe with moves over PipeDream on that planner's partition
    assert lp.best_gain(dict(row, lpm=15.0, pd2=10.0)) == 0.5 and lp.graded([dict(row, stages=4)]) == []
    akrow = ("m", "l", 8, 7.0, 0.875, 8, 3, 7.0, 0.875, 6.0, 0.75, "yes")
    assert "**Verdict: reproduced**" in ak.verdict([akrow])
    assert "**Verdict: not reproduced**" in ak.verdict([akrow[:9] + (8.0, 1.0, "no")])
    mem = [("vgg-16-4096", 4, 100.0, "-", "-", 40.0, "-", "-", "-", "70%", "60%", "-", "-")]
    tput = [("vgg-16-4096", "l", 16, 4, 10.0, 10.0, 15.0, 14.0, 0.88)]
    assert "**Verdict: reproduced**" in sb.verdict(mem, tput, None, ())
    assert "**Verdict: partly**" in sb.verdict([mem[0][:9] + ("40%",) + mem[0][10:]], tput, None, ())


def test_regimes_grade_each_cell_and_name_where_the_setups_sit(  # type: ignore[no-untyped-def]
        tmp_path: Path, monkeypatch) -> None:
    reg = _bench("paper_regimes")
    n, m = len(reg.SCALES), len(reg.LINKS)
    values = [[0.3 if (i, j) == (0, 0) else 0.13 if i == 1 else 0.0 for j in range(m)] for i in range(n)]
    words = [["reproduced" if v >= 0.25 else "partly" if v >= 0.125 else "not reproduced" for v in row]
             for row in values]
    text = reg.render(reg.Grid("P", "gain", "claim", values, words, "+.0%"))
    assert f"- Holds (R) in 1 of {n * m} cells: {reg.SCALES[0][0]} / {reg.LINKS[0][0]}." in text
    assert f"- Half the gain (P) in {m}:" in text
    assert "- this CPU with gloo here (profiled): +30% (reproduced)" in text
    assert "- H100 + NVLink 4 (modelled): +0% (not reproduced)" in text
    # a real sweep (SpecTrain's, quick) prints its grid; --plot without matplotlib says so in one line
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the sweep imports its paper's module
    out = reg.main(["spectrain"], quick=True, plot_dir=tmp_path)
    assert out.startswith("### SpecTrain")
    assert out.count("\n| ") == n + 2  # the header, its rule, a row per compute speed
    assert out.splitlines()[-1].startswith("--plot: matplotlib is not installed") and not list(tmp_path.iterdir())
