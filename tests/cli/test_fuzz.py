"""A fuzzer over the command line (issue 11): hypothesis picks option values at and past their edges (0,
negative, nan, inf, huge, empty and bracketed strings, missing and unwritable paths) for compile, simulate,
inspect, models and the checks ``run`` makes before any rank starts. Whatever it picks, fxpipe exits 0 or 2
and prints no traceback."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from fxpipe.cli.main import app

FUZZ = settings(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

EDGE_NUMBERS = ["0", "1", "2", "3", "-1", "nan", "-nan", "inf", "-inf", "1e308", "1e-320", "1e7", "9" * 30, "0.5",
                "1.5", "0x10", "1_000", "", " ", "[/bold]", "2[bold]"]
numbers = st.one_of(st.sampled_from(EDGE_NUMBERS), st.integers(-3, 9).map(str),
                    st.floats(allow_nan=True, allow_infinity=True).map(repr))
sizes = st.one_of(numbers, st.sampled_from(["8GiB", "1KB", "0B", "-1MB", "nanGB", "infGiB", "1e400", "1.5e9", "1 mib"]))
strings = st.one_of(st.sampled_from(["", " ", "[/bold]", "[bold]x[/]", "auto", "1f1b", "gpipe", "zb-h1", "zb-h2",
                                     "interleaved-1f1b", "layerpipe", "async-1f1b", "node", "1", "2", "trace",
                                     "split-stages", "nope", "-", "--json"]),
                    st.text(max_size=6))
costs = st.one_of(st.tuples(numbers, numbers, numbers).map(",".join), strings)


@dataclass(frozen=True)
class Places:
    plan: Path  # a compiled mlp-tiny plan
    outputs: tuple[str, ...]  # output paths: fine, missing directory, unwritable, a directory, bracketed


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> Places:
    root = tmp_path_factory.mktemp("fuzz")
    plan = root / "plan"
    result = CliRunner().invoke(app, ["compile", "mlp-tiny", "--out", str(plan)])
    assert result.exit_code == 0, result.output
    (root / "a-file").write_text("")
    return Places(plan, (str(root / "t.out"), str(root / "missing" / "t.out"), str(root / "a-file" / "t.out"),
                         str(root), str(root / "x[/bold]y.out"), ""))


def check(args: list[str]) -> Result:
    result = CliRunner().invoke(app, args)
    assert result.exit_code in (0, 2), f"fxpipe {' '.join(map(repr, args))}: exit {result.exit_code}\n{result.output}"
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        f"fxpipe {' '.join(map(repr, args))}: {result.exception!r}\n{result.output}"
    assert "Traceback" not in result.output, f"fxpipe {' '.join(map(repr, args))}\n{result.output}"
    return result


def options(draw: Any, pairs: dict[str, st.SearchStrategy[str]]) -> list[str]:
    """Some of ``pairs``' options, each with a drawn value."""
    chosen = draw(st.lists(st.sampled_from(sorted(pairs)), unique=True, max_size=4))
    return [item for name in chosen for item in (name, draw(pairs[name]))]


@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_simulate(places: Places, data: st.DataObject) -> None:
    outputs = st.sampled_from(places.outputs)
    target = data.draw(st.sampled_from([[], [str(places.plan)], ["[/bold]"], [places.outputs[1]]]))
    args = ["simulate", *target, *options(data.draw, {
        "--schedule": strings, "--microbatches": numbers, "--stages": numbers, "--uniform-costs": costs,
        "--memory-per-stage": sizes, "--trace": outputs, "--svg": outputs})]
    args += data.draw(st.sampled_from([[], ["--json"], ["--plain"]]))
    check(args)


@settings(FUZZ, max_examples=20)
@given(data=st.data())
def test_compile(places: Places, data: st.DataObject) -> None:
    outputs = st.sampled_from(places.outputs[1:])  # never a real plan written per example (slow), but every refusal
    args = ["compile", "mlp-tiny", *options(data.draw, {
        "--stages": numbers, "--granularity": strings, "--bandwidth": sizes, "--latency": numbers,
        "--memory-per-stage": sizes, "--microbatches": numbers, "--schedule": strings, "--device-flops": numbers,
        "--device-mem-bw": sizes, "--batch-size": numbers, "--seed": numbers, "--stop-after": strings,
        "--print-after": strings, "--out": outputs, "--profile-threads": numbers}), "--json"]
    check(args)


@settings(FUZZ, max_examples=25)
@given(data=st.data())
def test_inspect_and_models(places: Places, data: st.DataObject) -> None:
    path = data.draw(st.sampled_from([str(places.plan), *places.outputs]) | strings)
    fmt = data.draw(st.sampled_from([[], ["--json"], ["--plain"]]))
    check(["inspect", path, *fmt])
    check(["models", *fmt])


@settings(FUZZ, max_examples=25)
@given(data=st.data())
def test_run_refuses_before_any_rank_starts(places: Places, data: st.DataObject) -> None:
    # --data is never a known source, so every run is refused before a rank starts; the fuzzer shows that the
    # checks before it (schedule, microbatches, ranks, checkpoint and trace paths) refuse in one line too.
    bad_data = strings.filter(lambda s: s.strip() not in ("synthetic", "digits") and not s.startswith(("-", "text:")))
    args = ["run", str(places.plan), "--data", data.draw(bad_data), *options(data.draw, {
        "--nproc": numbers, "--steps": numbers, "--schedule": strings, "--microbatches": numbers, "--lr": numbers,
        "--timeout": numbers, "--trace": st.sampled_from(places.outputs)}), "--json"]
    result = check(args)
    assert result.exit_code == 2
