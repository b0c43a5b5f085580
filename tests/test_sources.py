"""The sources say what and why: no lab notebook (dates, cache-format histories) and short module docstrings."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SOURCES = sorted((Path(__file__).resolve().parents[1] / "fxpipe").rglob("*.py"))
ISO_DATE = re.compile(r"\b(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])\b")
MODULE_DOC_LINES = 25  # a concept that needs more is a page under docs/


@pytest.fixture(scope="module")
def texts() -> dict[Path, str]:
    return {p: p.read_text(encoding="utf-8") for p in SOURCES}


def test_sources_were_found() -> None:
    assert len(SOURCES) > 50, SOURCES


def test_no_iso_date_in_sources(texts: dict[Path, str]) -> None:
    hits = [f"{p.name}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
            for p, text in texts.items() for m in ISO_DATE.finditer(text)]
    assert not hits, "dates belong in benchmarks/RESULTS.md or git, not in sources: " + ", ".join(hits)


def test_no_cache_format_history_in_sources(texts: dict[Path, str]) -> None:
    hits = [f"{p.name}:{text[:m.start()].count(chr(10)) + 1}"
            for p, text in texts.items() for m in re.finditer(r"cache format", text, re.IGNORECASE)]
    assert not hits, "format histories belong in git, not in sources: " + ", ".join(hits)


def test_module_docstrings_are_short(texts: dict[Path, str]) -> None:
    long = []
    for p, text in texts.items():
        doc = ast.get_docstring(ast.parse(text), clean=False)
        if doc is not None and doc.count("\n") + 1 > MODULE_DOC_LINES:
            long.append(f"{p.name} ({doc.count(chr(10)) + 1} lines)")
    assert not long, f"module docstrings over {MODULE_DOC_LINES} lines (move the concept to docs/): " + ", ".join(long)


def test_the_checks_can_fail() -> None:
    assert ISO_DATE.search("measured 2026-11-27 on the CPU")
    assert not ISO_DATE.search("shape 2026-13-40 and version 2.13.0")
