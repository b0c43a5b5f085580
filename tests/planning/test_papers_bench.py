"""benchmarks/papers.py: the Akintoye and OptCNN tables (quick) have their rows and a verdict, from the committed
profiles (the numbers are the benchmark's business, not this test's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_papers_quick_prints_each_table_with_its_rows_and_a_verdict() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "papers.py"), "--paper", "akintoye",
                           "--paper", "optcnn", "--quick"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    akintoye, optcnn = done.stdout.split("## OptCNN")
    assert akintoye.startswith("## Akintoye")
    rows = [line for line in akintoye.splitlines() if line.startswith("| vgg-16-512")]
    assert [int(r.split("|")[3]) for r in rows] == [1, 2, 3, 4]  # N = 1..4 in quick mode
    assert "**Verdict: " in akintoye and any(w in akintoye for w in ("reproduced.", "partly.", "not."))
    rows = [line for line in optcnn.splitlines() if line.startswith("| vgg-16-4096")]
    assert [r.split("|")[3].strip() for r in rows] == ["data parallel", "model parallel", "OptCNN search"]
    assert "**Verdict: " in optcnn


def test_a_missing_paper_module_is_one_line() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import papers
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    text = papers.run("nosuchpaper", quick=True)
    assert "paper_nosuchpaper.py is not there yet" in text and len(text.strip().splitlines()) == 1
