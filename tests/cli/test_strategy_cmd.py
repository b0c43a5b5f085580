"""``fxpipe strategy``: the per-layer table and the totals against dp and SplitBrain; bad input is one line, exit 2."""

from __future__ import annotations

import json
import re

import pytest

from tests._helpers import fxpipe_cli


def _json(*args: str) -> dict:
    result = fxpipe_cli("strategy", *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_the_search_is_never_slower_than_the_presets_and_splits_more_than_the_batch() -> None:
    got = _json("vgg-tiny", "--ranks", "4", "--batch", "8")  # the zoo's 2-row example does not split 4 ways
    totals = {t["strategy"].split(" ")[0]: t for t in got["totals"]}
    assert got["method"].startswith("elimination")
    assert totals["auto"]["step ms"] <= totals["dp"]["step ms"]
    assert totals["auto"]["step ms"] <= totals["splitbrain-2"]["step ms"]
    assert totals["auto"]["received MB"] < totals["dp"]["received MB"]
    configs = {layer["config"] for layer in got["layers"]}
    assert configs - {"s4"}  # not pure data parallelism on this link
    assert not any("h" in c for c in configs)  # no height splits unless --heights


def test_presets() -> None:
    dp = _json("vgg-tiny", "--ranks", "2", "--strategy", "dp")
    assert {layer["config"] for layer in dp["layers"]} == {"s2"}
    sb = _json("vgg-tiny", "--ranks", "4", "--strategy", "splitbrain", "--group", "2", "--batch", "8")
    by = {layer["node"]: layer["config"] for layer in sb["layers"]}
    assert by["features_0"] == "s4" and by["classifier_0"] == "s2c2" and by["classifier_3"] == "s2r2"


def test_the_table_prints_every_layer_and_the_totals() -> None:
    result = fxpipe_cli("strategy", "resnet-tiny", "--ranks", "2", "--plain")
    assert result.exit_code == 0, result.output
    assert "layer1_0_conv1" in result.stdout and "totals per step and rank" in result.stdout
    assert "splitbrain-2" in result.stdout and "(chosen)" in result.stdout


@pytest.mark.parametrize(("args", "words"), [
    (("vgg-tiny", "--ranks", "3"), "power of two"),
    (("vgg-tiny", "--ranks", "4"), "the batch of 2 rows (vgg-tiny's example batch) does not split evenly over "
                                   "--ranks 4; give --batch-size 4"),
    (("vgg-tiny", "--ranks", "4", "--batch-size", "6"), "the batch of 6 rows (--batch-size 6) does not split evenly "
                                                        "over --ranks 4; give --batch-size 8"),
    (("vgg-tiny", "--ranks", "4", "--group", "8"), "--group 8 must divide --ranks 4"),
    (("gpt-tiny",), "symbolic_trace"),
    (("no-such-model",), "no-such-model"),
])
def test_bad_input_is_one_line_and_exit_2(args: tuple[str, ...], words: str) -> None:
    result = fxpipe_cli("strategy", *args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize("flag", ["--batch", "--batch-size"])
def test_the_batch_hint_names_a_flag_and_a_value_that_work(flag: str) -> None:
    """The one-line refusal of a batch the ranks do not divide names this command's flag and a batch that
    splits; given as said (under either spelling, --batch-size being fxpipe compile's), the command runs."""
    result = fxpipe_cli("strategy", "vgg-tiny", "--ranks", "4", "--strategy", "splitbrain")
    assert result.exit_code == 2, result.output
    fix = re.search(r"give (--batch-size) (\d+)", result.stderr)
    assert fix, result.stderr
    got = _json("vgg-tiny", "--ranks", "4", "--strategy", "splitbrain", flag, fix.group(2))
    assert got["strategy"] == "splitbrain" and got["layers"]
