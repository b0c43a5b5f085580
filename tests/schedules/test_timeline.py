"""Timelines: ASCII rows scale with durations, the Chrome trace is structurally valid, the SVG parses and escapes."""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

from fxpipe.errors import OptionError, OutputError
from fxpipe.schedules.generators import generate
from fxpipe.schedules.ir import COMM, COMPUTE, Kind
from fxpipe.schedules.simulate import Costs, Event, SimResult, simulate
from fxpipe.schedules.timeline import (
    LETTER,
    ascii_timeline,
    chrome_trace,
    measured_result,
    svg_gantt,
    write_chrome_trace,
    write_svg,
)

SVG = "{http://www.w3.org/2000/svg}"
CASES = [("zb-h1", 4, 8), ("1f1b", 2, 4), ("1f1b", 3, 6), ("1f1b", 4, 8), ("zb-h2", 3, 6), ("gpipe", 2, 3)]


def _sim(name: str, p: int, m: int, fbw: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> SimResult:
    costs = Costs.uniform(p, *fbw)
    return simulate(generate(name, p, m, costs), costs)


def _rows(text: str) -> dict[int, str]:
    """rank -> the cells between the bars."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("rank "):
            label, cells = line.split("|", 1)
            assert cells.endswith("|")
            rows[int(label.split()[1])] = cells[:-1]
    return rows


def _cells_by_kind(row: str) -> Counter[str]:
    """Cells per kind letter, counting a microbatch digit as a cell of the letter before it; '.' is idle."""
    out: Counter[str] = Counter()
    current = ""
    for c in row:
        if c.isdigit():
            assert current, f"digit with no letter before it in {row!r}"
            out[current] += 1
        else:
            current = "" if c == "." else c
            out[c] += 1
    return out


# ASCII ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, p, m", CASES)
def test_ascii_one_row_per_rank_all_the_same_width(name: str, p: int, m: int) -> None:
    result = _sim(name, p, m)
    text = ascii_timeline(result, width=60)
    lines = text.splitlines()
    rank_lines = [ln for ln in lines if ln.startswith("rank ")]
    assert len(rank_lines) == len(result.ranks) == p
    assert len({len(ln) for ln in rank_lines}) == 1
    assert all(len(row) == 60 for row in _rows(text).values())
    assert f"makespan {result.makespan:g}" in lines[0] and lines[0].startswith(name)
    assert any("idle" in ln and "F" in ln for ln in lines[:2])  # the legend


def test_ascii_unit_costs_at_one_column_per_unit_show_m_cells_of_each_letter() -> None:
    p, m = 4, 8
    result = _sim("zb-h1", p, m)
    text = ascii_timeline(result, width=int(result.makespan))
    rows = _rows(text)
    assert sorted(rows) == list(range(p))
    for rank, row in rows.items():
        counts = Counter(row)
        assert (counts["F"], counts["B"], counts["W"]) == (m, m, m), (rank, row)
        assert counts["."] == int(result.makespan) - 3 * m
        assert not any(c.isdigit() for c in row)  # one column per action: no room for the microbatch


@pytest.mark.parametrize("name, p, m", CASES)
@pytest.mark.parametrize("fbw", [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0)])
@pytest.mark.parametrize("columns_per_unit", [1, 2, 3])
def test_ascii_cells_are_proportional_to_durations(name: str, p: int, m: int, fbw: tuple[float, float, float],
                                                   columns_per_unit: int) -> None:
    result = _sim(name, p, m, fbw)
    width = int(result.makespan) * columns_per_unit
    rows = _rows(ascii_timeline(result, width=width))
    f, b, w = (columns_per_unit * int(x) for x in fbw)
    for rank, row in rows.items():
        split = any(e.action.kind is Kind.B for e in result.events if e.rank == rank)
        want = Counter({"F": m * f, "B": m * b, "W": m * w} if split else {"F": m * f, "X": m * (b + w)})
        got = _cells_by_kind(row)
        busy = sum(want.values())
        want["."] = width - busy
        assert got == want, (rank, row)
        assert result.ranks[rank].busy * columns_per_unit == busy


def test_ascii_writes_microbatch_numbers_where_room_allows() -> None:
    result = _sim("1f1b", 3, 12)
    rows = _rows(ascii_timeline(result, width=int(result.makespan) * 3))
    for row in rows.values():
        for mb in range(12):
            assert f"F{mb}" in row and f"X{mb}" in row
    assert LETTER[Kind.BW] == "X"


def test_ascii_does_not_draw_sends_and_receives() -> None:
    costs = Costs((1.0,) * 3, (1.0,) * 3, (1.0,) * 3, send_bytes=(1.0,) * 3, latency=0.5, bandwidth=2.0)
    result = simulate(generate("1f1b", 3, 4), costs)
    assert any(e.action.kind in COMM for e in result.events)
    scale = 4
    rows = _rows(ascii_timeline(result, width=int(result.makespan) * scale))
    for rank, row in rows.items():
        assert len(row) - row.count(".") == result.ranks[rank].busy * scale


def test_ascii_is_deterministic_and_rejects_zero_width() -> None:
    result = _sim("zb-h1", 4, 8)
    assert ascii_timeline(result, width=37) == ascii_timeline(result, width=37)
    assert ascii_timeline(result, width=37) != ascii_timeline(result, width=38)
    with pytest.raises(OptionError, match="width"):
        ascii_timeline(result, width=0)


# Chrome trace ---------------------------------------------------------------------------------------------------


def _trace(result: SimResult, **kw: object) -> list[dict]:  # type: ignore[type-arg]
    doc = chrome_trace(result, **kw)  # type: ignore[arg-type]
    again = json.loads(json.dumps(doc, allow_nan=False))
    assert again == doc
    assert again["displayTimeUnit"] == "ms"
    return again["traceEvents"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("name, p, m", CASES)
def test_chrome_trace_has_one_complete_event_per_compute_action(name: str, p: int, m: int) -> None:
    result = _sim(name, p, m, (1.0, 2.0, 0.5))
    events = _trace(result)
    compute = [e for e in events if e["ph"] == "X" and e["tid"] == 0]
    sim = [e for e in result.events if e.action.kind in COMPUTE]
    assert len(compute) == len(sim) == p * m * (3 if name.startswith("zb") else 2)
    by_name = {e["name"]: e for e in compute}
    assert len(by_name) == len(compute)
    for ev in sim:
        x = by_name[str(ev.action)]
        assert x["pid"] == ev.rank and x["cat"] == ev.action.kind.value
        assert x["ts"] == pytest.approx(ev.start * 1e6) and x["dur"] == pytest.approx((ev.end - ev.start) * 1e6)
        assert x["args"] == {"stage": ev.action.stage, "microbatch": ev.action.mb, "kind": ev.action.kind.value}
    assert {e["cat"] for e in compute} == ({"F", "B", "W"} if name.startswith("zb") else {"F", "BW"})


def test_chrome_trace_scales_times_by_the_unit() -> None:
    result = _sim("1f1b", 3, 4, (1.0, 2.0, 1.0))
    seconds = [e for e in _trace(result) if e["ph"] == "X"]
    millis = [e for e in _trace(result, time_unit_us=1e3) if e["ph"] == "X"]
    assert [e["name"] for e in seconds] == [e["name"] for e in millis]
    for s, ms in zip(seconds, millis):
        assert s["ts"] == pytest.approx(ms["ts"] * 1000) and s["dur"] == pytest.approx(ms["dur"] * 1000)
    with pytest.raises(OptionError, match="time_unit_us"):
        chrome_trace(result, time_unit_us=0.0)


@pytest.mark.parametrize("name, p, m", CASES)
def test_chrome_trace_names_one_process_per_rank_with_compute_and_comm_threads(name: str, p: int, m: int) -> None:
    result = _sim(name, p, m)
    events = _trace(result)
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {r: f"rank {r}" for r in range(p)}
    assert len([e for e in events if e["ph"] == "M" and e["name"] == "process_name"]) == p
    sort = {e["pid"]: e["args"]["sort_index"] for e in events if e["name"] == "process_sort_index"}
    assert sort == {r: r for r in range(p)}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert threads == {**{(r, 0): "compute" for r in range(p)}, **{(r, 1): "comm" for r in range(p)}}
    assert {e["pid"] for e in events} == set(range(p))


@pytest.mark.parametrize("name, p, m", CASES)
@pytest.mark.parametrize("latency", [0.0, 0.25])
def test_chrome_trace_links_every_send_to_its_receive(name: str, p: int, m: int, latency: float) -> None:
    costs = Costs((1.0,) * p, (1.0,) * p, (1.0,) * p, send_bytes=(1.0,) * p, latency=latency, bandwidth=4.0)
    result = simulate(generate(name, p, m, costs), costs)
    events = _trace(result)
    comm = [e for e in events if e["ph"] == "X" and e["tid"] == 1]
    sim_comm = [e for e in result.events if e.action.kind in COMM]
    assert len(comm) == len(sim_comm) == 2 * 2 * (p - 1) * m  # F and B boundaries, a send and a receive each
    assert all(e["dur"] > 0 for e in comm)  # zero-length transfers still show
    starts = [e for e in events if e["ph"] == "s"]
    finishes = [e for e in events if e["ph"] == "f"]
    assert len(starts) == len(finishes) == 2 * (p - 1) * m
    ids = Counter(e["id"] for e in starts)
    assert set(ids.values()) == {1}
    by_id = Counter(e["id"] for e in finishes)
    assert by_id == ids  # every "s" has exactly one "f" with its id, and no "f" is orphaned
    finish = {e["id"]: e for e in finishes}
    for s in starts:
        f = finish[s["id"]]
        assert f["bp"] == "e" and f["name"] == s["name"] and f["cat"] == s["cat"]
        assert s["tid"] == f["tid"] == 1 and s["pid"] != f["pid"]
        assert s["ts"] <= f["ts"]
        send, recv = s["name"].split(" -> ")
        assert "SEND" in send and "RECV" in recv and send[-1] == recv[-1]
        # the flow's ends lie on the comm slices of that send and that receive
        for end, action in ((s, send), (f, recv)):
            (slice_,) = [e for e in comm if e["name"] == action]
            assert slice_["pid"] == end["pid"] and slice_["ts"] <= end["ts"] <= slice_["ts"] + slice_["dur"]


@pytest.mark.parametrize("name, p, m", CASES + [("interleaved-1f1b", 4, 4)])
def test_chrome_trace_in_flight_counters_stay_non_negative_and_drain(name: str, p: int, m: int) -> None:
    result = _sim(name, p, m, (1.0, 1.5, 0.5))
    events = _trace(result)
    for rank in result.ranks:
        counter = [e for e in events if e["ph"] == "C" and e["pid"] == rank.rank]
        assert counter and all(e["name"] == "in flight" for e in counter)
        values = [e["args"]["microbatches"] for e in counter]
        times = [e["ts"] for e in counter]
        assert times == sorted(times) and len(set(times)) == len(times)
        assert min(values) >= 0 and values[0] == 0 and values[-1] == 0
        assert max(values) == rank.peak_in_flight


def test_chrome_trace_other_data_and_name() -> None:
    result = _sim("zb-h1", 4, 8)
    doc = chrome_trace(result, name="run 7")
    other = doc["otherData"]
    assert isinstance(other, dict)
    assert other["name"] == "run 7" and other["schedule"] == "zb-h1"
    assert other["makespan"] == result.makespan and other["max_stage_span"] == result.max_stage_span
    assert chrome_trace(result)["otherData"]["name"] == "zb-h1"  # type: ignore[index]


def test_write_chrome_trace(tmp_path: Path) -> None:
    result = _sim("1f1b", 2, 4)
    path = write_chrome_trace(result, tmp_path / "trace.json", time_unit_us=1.0)
    assert path == tmp_path / "trace.json" and path.is_file()
    assert json.loads(path.read_text()) == {"fxpipe": "chrome-trace",
                                            **json.loads(json.dumps(chrome_trace(result, time_unit_us=1.0)))}
    assert isinstance(write_chrome_trace(result, str(tmp_path / "t2.json")), Path)
    write_chrome_trace(result, path)  # its own trace: replaced
    (tmp_path / "mine.json").write_text("{}")  # the user's: refused, untouched
    with pytest.raises(OutputError, match="exists and fxpipe did not write it"):
        write_chrome_trace(result, tmp_path / "mine.json")
    assert (tmp_path / "mine.json").read_text() == "{}"


# SVG ------------------------------------------------------------------------------------------------------------


def _rects(root: ET.Element, cls: str) -> list[ET.Element]:
    return [r for r in root.iter(f"{SVG}rect") if cls in (r.get("class") or "").split()]


@pytest.mark.parametrize("name, p, m", CASES)
def test_svg_has_one_rect_per_compute_action(name: str, p: int, m: int) -> None:
    result = _sim(name, p, m, (1.0, 2.0, 1.0))
    text = svg_gantt(result)
    assert text.startswith('<svg xmlns="http://www.w3.org/2000/svg"')
    root = ET.fromstring(text)
    compute = [e for e in result.events if e.action.kind in COMPUTE]
    actions = _rects(root, "action")
    assert len(actions) == len(compute)
    assert len(_rects(root, "background")) == 1
    assert len(_rects(root, "lane")) == p
    assert len(_rects(root, "legend")) == 4
    assert len(list(root.iter(f"{SVG}rect"))) == len(compute) + 1 + p + 4
    titles = [r.find(f"{SVG}title").text for r in actions]  # type: ignore[union-attr]
    assert sorted(t.split(" [")[0] for t in titles) == sorted(str(e.action) for e in compute)  # type: ignore[union-attr]
    for e in compute:
        assert f"{e.action} [{e.start:g}, {e.end:g}]" in titles
    fills = {r.get("data-kind"): r.get("fill") for r in actions}
    assert len(set(fills.values())) == len(fills)  # one fill per kind
    legend_fills = {r.get("fill") for r in _rects(root, "legend")}
    assert len(legend_fills) == 4 and set(fills.values()) <= legend_fills
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert all(f"rank {r}" in texts for r in range(p))
    ticks = [t for t in root.iter(f"{SVG}text") if t.get("class") == "tick"]
    assert 3 <= len(ticks) <= 12
    labels = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "label"]
    assert labels and set(labels) <= {str(e.action) for e in compute}


def test_svg_geometry_follows_time() -> None:
    result = _sim("zb-h1", 4, 8)
    root = ET.fromstring(svg_gantt(result, width=1000))
    actions = _rects(root, "action")
    widths = {round(float(r.get("width", "0")), 1) for r in actions}
    assert len(widths) == 1  # unit costs: every action as wide as the others
    xs = [float(r.get("x", "0")) for r in actions]
    right = max(x + float(r.get("width", "0")) for x, r in zip(xs, actions))
    assert min(xs) == pytest.approx(70) and right == pytest.approx(1000 - 20)


def test_svg_escapes_text_and_is_deterministic() -> None:
    weird = 'zb <h1> & "friends"'
    result = dataclasses.replace(_sim("zb-h1", 2, 3), schedule=weird)
    text = svg_gantt(result)
    assert "<h1>" not in text and "&lt;h1&gt;" in text and "&amp;" in text
    root = ET.fromstring(text)
    assert root.find(f"{SVG}title").text.startswith(weird)  # type: ignore[union-attr]
    assert any((t.text or "").startswith(weird) for t in root.iter(f"{SVG}text"))
    assert svg_gantt(result) == text
    with pytest.raises(OptionError, match="width"):
        svg_gantt(result, width=10)


def test_write_svg(tmp_path: Path) -> None:
    result = _sim("1f1b", 3, 6)
    path = write_svg(result, tmp_path / "gantt.svg", row_height=30)
    assert path == tmp_path / "gantt.svg" and path.is_file()
    assert path.read_text(encoding="utf-8") == "<!-- fxpipe schedule -->\n" + svg_gantt(result, row_height=30)
    ET.parse(path)
    write_svg(result, path)  # its own: replaced


def test_chrome_trace_leaves_an_unmatched_send_without_a_flow() -> None:
    # a measured run cut short records a send whose receive never happened: no dangling flow start
    result = _sim("1f1b", 3, 4)
    recv = next(e for e in result.events if e.action.kind is Kind.RECV_B)
    cut = dataclasses.replace(result, events=tuple(e for e in result.events if e is not recv))
    events = _trace(cut)
    starts = [e for e in events if e["ph"] == "s"]
    finishes = [e for e in events if e["ph"] == "f"]
    assert len(starts) == len(finishes) == 2 * 2 * 4 - 1
    assert Counter(e["id"] for e in starts) == Counter(e["id"] for e in finishes)
    assert not any(str(recv.action) in e["name"] for e in starts)


def _when(e: Event) -> tuple[int, float, float]:
    return e.rank, e.start, e.end


def test_a_measured_run_becomes_a_result_every_view_draws() -> None:
    """``fxpipe run --trace``: each rank's measured (action, start, end), printed or parsed, as a SimResult."""
    sim = _sim("1f1b", 2, 2)
    per_rank: dict[int, list[tuple[object, float, float]]] = {}
    for e in sim.events:
        if e.action.kind in COMPUTE:
            per_rank.setdefault(e.rank, []).append((str(e.action) if e.rank else e.action, e.start, e.end))
    result = measured_result(per_rank, "measured 1f1b")  # type: ignore[arg-type]
    assert result.schedule == "measured 1f1b" and result.makespan == sim.makespan
    assert sorted(result.events, key=_when) == sorted((e for e in sim.events if e.action.kind in COMPUTE), key=_when)
    for mine, theirs in zip(result.ranks, sim.ranks):
        assert (mine.rank, mine.start, mine.end, mine.busy) == (theirs.rank, theirs.start, theirs.end, theirs.busy)
    assert result.max_stage_span == sim.max_stage_span
    assert _rows(ascii_timeline(result, width=20)) == _rows(ascii_timeline(sim, width=20))
    events = chrome_trace(result)["traceEvents"]
    assert sum(1 for e in events if e.get("ph") == "X") == len(result.events)  # type: ignore[union-attr]
    empty = measured_result({0: []}, "measured nothing")
    assert empty.makespan == 0.0 and empty.ranks[0].busy == 0.0 and empty.events == ()
