"""Timelines of a simulated (or measured) run: ASCII rows, Chrome/Perfetto trace JSON, and an SVG Gantt chart.

Every view reads only ``SimResult.events`` (and ``ranks``, ``makespan``, ``schedule``), so a
runtime that records the same events from a measured run gets the same views (:func:`measured_result`
makes its SimResult). ``zb-h1`` on 2 stages, 2 microbatches, unit costs, ``ascii_timeline(result, width=14)``::

    zb-h1: 2 ranks, makespan 7, 1 column = 0.5
    F forward  B input gradient  W weight gradient  X fused backward (BW)  . idle  digits: microbatch
    rank 0 |F0F1..B0W0B1W1|
    rank 1 |..F0B0F1B1W0W1|

With data parallelism (``SimResult.dp`` > 1) each rank gets a second row, its all-reduce lane:
``A`` per bucket, the digit its stage (``simulate(..., dp=2, allreduce=[1.5, 1.5])``, 1f1b)::

    1f1b: 2 ranks x dp 2, makespan 10.5, 1 column = 0.5
    ...
    rank 0    |F0F1....X0XX..X1XX...|
    rank 0 ar |..................A0A|
    rank 1    |..F0X0XXF1X1XX.......|
    rank 1 ar |..............A1A....|
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from html import escape
from pathlib import Path

from fxpipe.errors import OptionError
from fxpipe.files import write_file
from fxpipe.schedules.ir import COMM, COMPUTE, Action, Kind
from fxpipe.schedules.simulate import AllReduceEvent, Event, RankStats, SimResult

LETTER: dict[Kind, str] = {Kind.F: "F", Kind.B: "B", Kind.W: "W", Kind.BW: "X"}
FILL: dict[Kind, str] = {Kind.F: "#4e79a7", Kind.B: "#f28e2b", Kind.W: "#59a14f", Kind.BW: "#e15759"}
_KIND_NAME: dict[Kind, str] = {Kind.F: "forward", Kind.B: "input gradient", Kind.W: "weight gradient",
                               Kind.BW: "fused backward"}
_LEGEND = ("  ".join(f"{LETTER[k]} {_KIND_NAME[k]}" for k in (Kind.F, Kind.B, Kind.W, Kind.BW))
           + " (BW)  . idle  digits: microbatch")
ALLREDUCE_LETTER = "A"
MIXED_LETTER = "*"  # a summarized column where no kind runs more than half the busy time
ALLREDUCE_FILL = "#9c6ade"
_COMM_TINY = 1e-3  # a zero-length send/receive is drawn this fraction of the makespan long, so viewers show it
_SENDS = frozenset({Kind.SEND_F, Kind.SEND_B})


def ascii_timeline(result: SimResult, *, width: int = 100, unit: str | None = None) -> str:
    """One row per rank, time scaled to ``width`` columns; a compute action is its kind letter over its duration.

    The microbatch number follows the letter when the action spans enough columns (``F3FF``);
    fused backward is ``X``, idle ``.``. Sends and receives take no time and are not drawn.
    Column edges are rounded from the action's start and end, so adjacent actions never overlap.
    When a rank has more actions than columns, each column shows instead the kind that runs longest
    in it (``*`` if none runs more than half, ``.`` if the rank idles for half of it), without digits.
    ``unit``: the costs' time unit, named in the header: ``"s"`` (shown as ms) or ``"unit"`` (units); None names
    none.
    """
    if width < 1:
        raise OptionError(f"a timeline needs at least one column (width: {width}); use width >= 1")
    ranks = _rank_ids(result)
    compute = _compute(result.events)
    origin, span = _window(result, compute)
    scale = width / span if span > 0 else 0.0
    rows: dict[int, list[str]] = {r: ["."] * width for r in ranks}
    per_rank: dict[int, int] = {}
    for e in compute:
        per_rank[e.rank] = per_rank.get(e.rank, 0) + 1
    summarized = max(per_rank.values(), default=0) > width
    if summarized:  # more actions than columns: each column says what fills it
        _draw_dominant(rows, compute, origin, scale, width)
        compute = []
    for e in compute:
        # lo = min(width, max(0, start)), hi = min(width, max(lo, end)), in columns; an action under
        # half a column draws nothing (most of them, in a long schedule)
        lo = round((e.start - origin) * scale)
        lo = 0 if lo < 0 else width if lo > width else lo
        hi = round((e.end - origin) * scale)
        hi = lo if hi < lo else width if hi > width else hi
        if hi == lo:
            continue
        cells = [LETTER[e.action.kind]] * (hi - lo)
        digits = str(e.action.mb)
        if hi - lo >= 1 + len(digits):
            cells[1:1 + len(digits)] = digits
        rows[e.rank][lo:hi] = cells
    lanes: dict[int, list[str]] = {}
    for ar in result.allreduce:
        lo = min(width, max(0, round((ar.start - origin) * scale)))
        hi = min(width, max(lo, round((ar.end - origin) * scale)))
        cells = [ALLREDUCE_LETTER] * (hi - lo)
        digits = str(ar.stage)
        if hi - lo >= 1 + len(digits):
            cells[1:1 + len(digits)] = digits
        lanes.setdefault(ar.rank, ["."] * width)[lo:hi] = cells
    names = {r: f"rank {r}" for r in ranks}
    label = max((len(n) + (3 if lanes else 0) for n in names.values()), default=0)
    scale_to, shown = (1e3, " ms") if unit == "s" else (1.0, " units") if unit == "unit" else (1.0, "")
    column = f"{span / width * scale_to:{'.4g' if shown else 'g'}}"
    header = (f"{result.schedule}: {len(ranks)} ranks{f' x dp {result.dp}' if result.dp > 1 else ''}, "
              f"makespan {result.makespan * scale_to:.6g}{shown}, 1 column = {column}{shown}")
    legend = (_LEGEND if not summarized else _LEGEND.replace("digits: microbatch", f"{MIXED_LETTER} mixed")) + (
        f"  {ALLREDUCE_LETTER} all-reduce (digit: stage)" if lanes else "")
    lines = [header, legend]
    for r in ranks:
        lines.append(names[r].ljust(label) + " |" + "".join(rows[r]) + "|")
        if r in lanes:
            lines.append(f"{names[r]} ar".ljust(label) + " |" + "".join(lanes[r]) + "|")
    return "\n".join(lines)


def chrome_trace(result: SimResult, *, time_unit_us: float = 1e6, name: str | None = None) -> dict[str, object]:
    """The run in Trace Event Format, for chrome://tracing and ui.perfetto.dev.

    One process per rank (pid = rank) with a ``compute`` thread (tid 0) holding an ``X`` event per
    F/B/W/BW (name ``1F3``, cat the kind) and a ``comm`` thread (tid 1) holding the sends and
    receives, each send linked to its receive by a flow (``s`` then ``f`` with ``bp: "e"``, one
    ``id``). An ``in flight`` counter per rank counts microbatch-stages with F done and their
    last backward not done (its peak is ``RankStats.peak_in_flight``). With data parallelism an
    ``all-reduce`` thread (tid 2) holds one ``X`` event per gradient bucket (cat ``allreduce``).
    Event times are in the costs' unit; ``time_unit_us`` converts them to microseconds (the
    default assumes seconds).
    """
    if not time_unit_us > 0 or math.isinf(time_unit_us):
        raise OptionError(f"time_unit_us must be a positive number of microseconds per unit (time_unit_us: "
                          f"{time_unit_us}); use 1e6 for seconds, 1e3 for milliseconds")
    ranks = _rank_ids(result)
    tiny = (result.makespan * time_unit_us * _COMM_TINY) or 1e-3
    trace: list[dict[str, object]] = []
    for r in ranks:
        trace.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        trace.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        threads = ((0, "compute"), (1, "comm")) + (((2, "all-reduce"),) if result.allreduce else ())
        for tid, thread in threads:
            trace.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": thread}})
            trace.append({"ph": "M", "name": "thread_sort_index", "pid": r, "tid": tid, "args": {"sort_index": tid}})
    sends: dict[tuple[str, int, int], Event] = {}
    recvs: dict[tuple[str, int, int], Event] = {}
    for e in result.events:
        a = e.action
        ts, dur = e.start * time_unit_us, (e.end - e.start) * time_unit_us
        if a.kind in COMPUTE:
            trace.append({"ph": "X", "name": str(a), "cat": a.kind.value, "pid": e.rank, "tid": 0, "ts": ts,
                          "dur": dur, "args": {"stage": a.stage, "microbatch": a.mb, "kind": a.kind.value}})
        elif a.kind in COMM:
            trace.append({"ph": "X", "name": str(a), "cat": a.kind.value, "pid": e.rank, "tid": 1, "ts": ts,
                          "dur": dur if dur > 0 else tiny,
                          "args": {"stage": a.stage, "microbatch": a.mb, "kind": a.kind.value}})
            (sends if a.kind in _SENDS else recvs)[_link(a)] = e
    for ar in result.allreduce:
        trace.append({"ph": "X", "name": f"all-reduce stage {ar.stage} bucket {ar.bucket}", "cat": "allreduce",
                      "pid": ar.rank, "tid": 2, "ts": ar.start * time_unit_us,
                      "dur": (ar.end - ar.start) * time_unit_us,
                      "args": {"stage": ar.stage, "bucket": ar.bucket, "dp": result.dp}})
    for flow_id, key in enumerate(sorted(k for k in sends if k in recvs)):
        send, recv = sends[key], recvs[key]
        flow_name = f"{send.action} -> {recv.action}"
        trace.append({"ph": "s", "name": flow_name, "cat": "flow", "id": flow_id, "pid": send.rank, "tid": 1,
                      "ts": send.start * time_unit_us})
        trace.append({"ph": "f", "bp": "e", "name": flow_name, "cat": "flow", "id": flow_id, "pid": recv.rank,
                      "tid": 1, "ts": recv.start * time_unit_us})
    for r in ranks:
        for t, n in in_flight(result.events, r):
            trace.append({"ph": "C", "name": "in flight", "pid": r, "tid": 0, "ts": t * time_unit_us,
                          "args": {"microbatches": n}})
    return {
        "traceEvents": trace,
        "displayTimeUnit": "ms",
        "otherData": {"name": name if name is not None else result.schedule, "schedule": result.schedule,
                      "makespan": result.makespan, "max_stage_span": result.max_stage_span,
                      "time_unit_us": time_unit_us, **({"dp": result.dp, "allreduce_hidden_fraction":
                                                        result.hidden_fraction} if result.dp > 1 else {})},
    }


TRACE_MARK = '{"fxpipe": "chrome-trace"'  # how a trace file fxpipe wrote begins (Chrome ignores the key)
SVG_MARK = "<!-- fxpipe schedule -->"


def is_fxpipe_trace(path: Path) -> bool:
    """Whether ``path`` begins as a trace fxpipe wrote: the only existing file ``--trace`` replaces."""
    return _begins(path, TRACE_MARK)


def is_fxpipe_svg(path: Path) -> bool:
    return _begins(path, SVG_MARK)


def _begins(path: Path, mark: str) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(len(mark)) == mark.encode()
    except OSError:
        return False


def write_chrome_trace(result: SimResult, path: str | Path, **kw: object) -> Path:
    """Write :func:`chrome_trace` as JSON to ``path`` (``fxpipe.files.write_file``: never through a link, never
    over a file fxpipe did not write); returns the path."""
    doc = {"fxpipe": "chrome-trace", **chrome_trace(result, **kw)}  # type: ignore[arg-type]
    return write_file(path, json.dumps(doc), what="--trace", ours=is_fxpipe_trace)


def measured_result(events_per_rank: Mapping[int, Sequence[tuple[Action | str, float, float]]],
                    name: str, *, allreduce: Mapping[int, Sequence[tuple[int, float, float]]] | None = None,
                    dp: int = 1) -> SimResult:
    """A measured run's ``(action, start, end)`` per rank (actions as ``Action`` or as printed, ``1F0``) as a
    SimResult, so every view here draws it as it draws a simulated one.

    A rank's stats are its first start, last end and busy time; the makespan is the last end. What the
    simulator models and a run does not measure (memory held, microbatches in flight, bytes sent) is 0.
    ``allreduce``: per rank, its measured all-reduces as ``(stage, start, end)``, one per bucket in order;
    they give the rank's all-reduce, exposed and hidden seconds as the simulator counts them.

    >>> measured_result({0: [("0F0", 0.0, 1.0)], 1: [("1F0", 1.5, 2.5)]}, "measured 1f1b").makespan
    2.5
    >>> measured_result({0: [("0F0", 0.0, 1.0)]}, "dp", allreduce={0: [(0, 0.5, 1.5)]}, dp=2).hidden_fraction
    0.5
    """
    events = [Event(rank, a if isinstance(a, Action) else Action.parse(a), t0, t1)
              for rank, acts in events_per_rank.items() for a, t0, t1 in acts]
    lanes: list[AllReduceEvent] = []
    for rank, reduces in (allreduce or {}).items():
        count: dict[int, int] = {}
        for stage, t0, t1 in reduces:
            lanes.append(AllReduceEvent(rank, stage, count.get(stage, 0), t0, t1))
            count[stage] = count.get(stage, 0) + 1
    step_end = max((e.end for e in events), default=0.0)
    ranks = []
    for rank, acts in events_per_rank.items():
        end = max((t1 for _, _, t1 in acts), default=0.0)
        lane = [e for e in lanes if e.rank == rank]
        ranks.append(RankStats(rank, min((t0 for _, t0, _ in acts), default=0.0), end,
                               sum(t1 - t0 for _, t0, t1 in acts), 0.0, 0, 0.0,
                               sum(e.end - e.start for e in lane), max((e.end for e in lane), default=0.0),
                               sum(max(0.0, e.end - max(e.start, end)) for e in lane),
                               sum(max(0.0, e.end - max(e.start, step_end)) for e in lane)))
    return SimResult(name, max([e.end for e in events] + [e.end for e in lanes], default=0.0),
                     max((r.step_end - r.start for r in ranks), default=0.0), tuple(ranks), tuple(events),
                     dp=dp, allreduce=tuple(sorted(lanes, key=lambda e: (e.rank, e.start))))


def in_flight(events: Iterable[Event], rank: int) -> list[tuple[float, int]]:
    """``(time, count)`` steps of the rank's microbatch-stages in flight: +1 at an F's end, -1 at a W's or BW's end.

    Starts at 0 at the rank's first compute start; one step per distinct time, in time order.
    """
    compute = [e for e in _compute(events) if e.rank == rank]
    if not compute:
        return []
    steps: list[tuple[float, int]] = [(min(e.start for e in compute), 0)]
    level = 0
    for e in sorted(compute, key=lambda e: e.end):
        level += {Kind.F: 1, Kind.W: -1, Kind.BW: -1}.get(e.action.kind, 0)
        if e.action.kind is Kind.B:
            continue
        if steps[-1][0] == e.end:
            steps[-1] = (e.end, level)
        else:
            steps.append((e.end, level))
    return steps


def svg_gantt(result: SimResult, *, width: int = 1000, row_height: int = 24) -> str:
    """A standalone SVG Gantt chart: one row per rank, one ``<rect class="action">`` per compute action.

    Each action rect has a ``<title>`` tooltip ``1F3 [start, end]`` and, when wide enough, a text
    label; below the rows a time axis with a few ticks and a legend of the four kinds. Rects other
    than actions are ``class="background"`` (one), ``class="lane"`` (one per rank) and
    ``class="legend"`` (one per kind). With data parallelism every rank's row is followed by a
    half-height all-reduce row (``class="arlane"``) with one ``<rect class="allreduce">`` per
    bucket, and the legend gains an all-reduce entry.
    """
    if width < 200 or row_height < 8:
        raise OptionError(f"an SVG Gantt chart needs width >= 200 and row_height >= 8 (width: {width}, "
                          f"row_height: {row_height}); use larger values")
    ranks = _rank_ids(result)
    origin, span = _window(result)
    left, right, top = 70, 20, 30
    plot = width - left - right
    ar_height = row_height // 2 if result.allreduce else 0
    axis_y = top + (row_height + ar_height) * len(ranks)
    legend_y = axis_y + 34
    height = legend_y + 24
    font = max(8, min(12, row_height // 2))

    def x(t: float) -> float:
        return left + ((t - origin) / span * plot if span > 0 else 0.0)

    title = f"{result.schedule}: {len(ranks)} ranks, makespan {result.makespan:g}"
    out = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="{font}">'),
           f"<title>{escape(title)}</title>",
           f'<rect class="background" x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
           f'<text x="{left}" y="{top - 10}" font-size="{font + 2}">{escape(title)}</text>']
    for i, r in enumerate(ranks):
        y = top + i * (row_height + ar_height)
        out.append(f'<rect class="lane" x="{left}" y="{y}" width="{plot}" height="{row_height}" '
                   f'fill="{"#f4f4f4" if i % 2 == 0 else "#e9e9e9"}"/>')
        out.append(f'<text x="{left - 6}" y="{y + row_height / 2:.2f}" text-anchor="end" '
                   f'dominant-baseline="middle">{escape(f"rank {r}")}</text>')
        if ar_height:
            out.append(f'<rect class="arlane" x="{left}" y="{y + row_height}" width="{plot}" height="{ar_height}" '
                       f'fill="#fbfaff"/>')
            out.append(f'<text x="{left - 6}" y="{y + row_height + ar_height / 2:.2f}" text-anchor="end" '
                       f'dominant-baseline="middle" font-size="{max(6, font - 2)}">all-reduce</text>')
    row_of = {r: i for i, r in enumerate(ranks)}
    for ar in result.allreduce:
        x0, x1 = x(ar.start), x(ar.end)
        y = top + row_of[ar.rank] * (row_height + ar_height) + row_height + 1
        out.append(f'<rect class="allreduce" data-stage="{ar.stage}" x="{x0:.2f}" y="{y}" width="{x1 - x0:.2f}" '
                   f'height="{max(1, ar_height - 2)}" fill="{ALLREDUCE_FILL}" stroke="#ffffff" stroke-width="0.5">'
                   f"<title>{escape(f'all-reduce stage {ar.stage} bucket {ar.bucket} [{ar.start:g}, {ar.end:g}]')}"
                   "</title></rect>")
    for e in _compute(result.events):
        a = e.action
        x0, x1 = x(e.start), x(e.end)
        y = top + row_of[e.rank] * (row_height + ar_height) + 2
        h = row_height - 4
        label = str(a)
        out.append(f'<rect class="action" data-kind="{a.kind.value}" x="{x0:.2f}" y="{y}" '
                   f'width="{x1 - x0:.2f}" height="{h}" fill="{FILL[a.kind]}" stroke="#ffffff" stroke-width="0.5">'
                   f"<title>{escape(f'{label} [{e.start:g}, {e.end:g}]')}</title></rect>")
        if x1 - x0 >= len(label) * font * 0.62 + 4:
            out.append(f'<text class="label" x="{(x0 + x1) / 2:.2f}" y="{y + h / 2:.2f}" text-anchor="middle" '
                       f'dominant-baseline="middle" fill="#ffffff">{escape(label)}</text>')
    out.append(f'<line x1="{left}" y1="{axis_y}" x2="{left + plot}" y2="{axis_y}" stroke="#333333"/>')
    for t in _ticks(span):
        tx = x(origin + t)
        out.append(f'<line x1="{tx:.2f}" y1="{axis_y}" x2="{tx:.2f}" y2="{axis_y + 5}" stroke="#333333"/>')
        out.append(f'<text class="tick" x="{tx:.2f}" y="{axis_y + 8 + font}" text-anchor="middle">'
                   f"{escape(f'{origin + t:g}')}</text>")
    lx = left
    for k in (Kind.F, Kind.B, Kind.W, Kind.BW):
        text = f"{k.value} {_KIND_NAME[k]}"
        out.append(f'<rect class="legend" x="{lx}" y="{legend_y}" width="12" height="12" fill="{FILL[k]}"/>')
        out.append(f'<text x="{lx + 16}" y="{legend_y + 10}">{escape(text)}</text>')
        lx += 16 + int(len(text) * font * 0.62) + 16
    if result.allreduce:
        text = f"all-reduce (dp {result.dp})"
        out.append(f'<rect class="legend" x="{lx}" y="{legend_y}" width="12" height="12" fill="{ALLREDUCE_FILL}"/>')
        out.append(f'<text x="{lx + 16}" y="{legend_y + 10}">{escape(text)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_svg(result: SimResult, path: str | Path, **kw: object) -> Path:
    """Write :func:`svg_gantt` to ``path``, as :func:`write_chrome_trace` writes; returns the path."""
    return write_file(path, SVG_MARK + "\n" + svg_gantt(result, **kw), what="--svg",  # type: ignore[arg-type]
                      ours=is_fxpipe_svg)


def _draw_dominant(rows: dict[int, list[str]], compute: Sequence[Event], origin: float, scale: float,
                   width: int) -> None:
    """A schedule too long to draw action by action: each column shows the kind that runs more than
    half the busy time in it, ``*`` when none does (F, B and W alike in a steady zero-bubble
    schedule), or ``.`` when the rank idles for half the column or more (no microbatch digits).

    Drawing whichever action happens to cross a column edge would alias: a steady 1F1B (F, BW, F,
    BW, ...) would come out as long stripes of F and of X that the schedule does not have.
    """
    busy: dict[int, list[dict[Kind, float]]] = {r: [{} for _ in range(width)] for r in rows}
    for e in compute:
        lo, hi = (e.start - origin) * scale, (e.end - origin) * scale
        cols, kind = busy[e.rank], e.action.kind
        c = int(lo)
        while c < width and c < hi:
            part = min(hi, c + 1) - max(lo, c)
            if part > 0:
                cols[c][kind] = cols[c].get(kind, 0.0) + part
            c += 1
    for r, cols in busy.items():
        row = rows[r]
        for c, kinds in enumerate(cols):
            total = sum(kinds.values())
            if total > 0.5:
                kind = max(kinds, key=kinds.__getitem__)
                row[c] = LETTER[kind] if kinds[kind] > total / 2 else MIXED_LETTER


def _compute(events: Iterable[Event]) -> list[Event]:
    # by identity: ``kind in COMPUTE`` would hash every member in Python
    sf, rf, sb, rb = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
    return [e for e in events if (k := e.action.kind) is not sf and k is not rf and k is not sb and k is not rb]


def _rank_ids(result: SimResult) -> list[int]:
    return sorted({r.rank for r in result.ranks} | set(map(_RANK, result.events)))


_RANK, _START, _END = operator.attrgetter("rank"), operator.attrgetter("start"), operator.attrgetter("end")


def _window(result: SimResult, compute: Sequence[Event] | None = None) -> tuple[float, float]:
    """The drawn time range: from the first compute start, ``makespan`` long (or the events' own span)."""
    compute = _compute(result.events) if compute is None else compute
    if not compute:
        return 0.0, 0.0
    origin = min(map(_START, compute))
    return origin, max(result.makespan, max(map(_END, compute)) - origin)


def _link(a: Action) -> tuple[str, int, int]:
    """The stage boundary a send or receive crosses: (direction, lower stage, microbatch), equal for a matched pair."""
    if a.kind is Kind.SEND_F:
        return ("F", a.stage, a.mb)
    if a.kind is Kind.RECV_F:
        return ("F", a.stage - 1, a.mb)
    if a.kind is Kind.SEND_B:
        return ("B", a.stage - 1, a.mb)
    return ("B", a.stage, a.mb)  # RECV_B: the gradient comes from stage + 1


def _ticks(span: float, target: int = 6) -> Sequence[float]:
    """About ``target`` evenly spaced round values (steps of 1, 2 or 5 times a power of ten) from 0 to ``span``."""
    if span <= 0:
        return [0.0]
    raw = span / target
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    count = math.floor(span / step + 1e-9)
    return [round(i * step, 12) for i in range(count + 1)]
