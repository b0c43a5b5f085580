"""The five papers' comparisons, each in its own paper's terms, from the committed cost profiles: one table each.

    python benchmarks/papers.py [--paper akintoye|optcnn|splitbrain|spectrain|layerpipe] [--quick] [--measure]
                                [--profiles benchmarks/profiles] [--compute-scale X] [--regimes [--plot DIR]]

Each paper is a module ``benchmarks/paper_<name>.py`` exposing ``main(quick: bool = False) -> str`` (markdown: a
table and a verdict line). A missing module prints one line and the others still run. What this machine measures
(SpecTrain's accuracy and memory, SplitBrain's memory) is read from the committed results under
``benchmarks/results/``; ``--measure`` measures it again (minutes), passed to the modules whose ``main`` takes
``measure``; without ``--measure`` nothing is written. Each table ends in a verdict graded by ``paper_verdicts``.
``--regimes`` prints, instead, each headline swept over compute speed against link bandwidth (``paper_regimes``);
``--plot DIR`` also draws them (matplotlib, the ``plot`` extra). Costs come from
``--profiles`` (``profile_layers.py`` writes them; GPU profiles are preferred to CPU ones); schedules are
simulated by ``fxpipe.schedules.simulate``, strategies costed by ``fxpipe.planning.strategies``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import paper_profiles  # noqa: E402

PAPERS = ("akintoye", "optcnn", "splitbrain", "spectrain", "layerpipe")


def run(name: str, quick: bool, measure: bool = False) -> str:
    try:
        module = importlib.import_module(f"paper_{name}")
    except ModuleNotFoundError as err:
        if err.name != f"paper_{name}":
            raise
        return f"## {name}: benchmarks/paper_{name}.py is not there yet (no table)\n"
    started = time.perf_counter()
    live = {"measure": measure} if "measure" in inspect.signature(module.main).parameters else {}
    text = module.main(quick=quick, **live)
    return f"{text.rstrip()}\n\n({time.perf_counter() - started:.1f} s)\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paper", choices=PAPERS, action="append",
                        help="one paper (repeat for several); default: all five")
    parser.add_argument("--quick", action="store_true", help="fewer models and points (a smoke test)")
    parser.add_argument("--measure", action="store_true",
                        help="measure again what this machine measures (minutes), instead of reading the committed "
                             "results")
    parser.add_argument("--profiles", type=Path, default=paper_profiles.DIR,
                        help="the profiles directory (gpu-*.json preferred to cpu-*.json)")
    parser.add_argument("--compute-scale", type=float, default=1.0,
                        help="divide every profiled compute time by this (a what-if: a device X times faster)")
    parser.add_argument("--regimes", action="store_true",
                        help="where each headline holds: the metric over compute speed x link (and other axes)")
    parser.add_argument("--plot", type=Path, nargs="?", const=Path(__file__).parent / "results" / "papers_regimes",
                        default=None, help="with --regimes: write one figure per paper into this directory (default "
                        "benchmarks/results/papers_regimes/)")
    args = parser.parse_args(argv)
    paper_profiles.DIR = args.profiles
    paper_profiles.COMPUTE_SCALE = args.compute_scale
    if args.regimes:
        import paper_regimes

        print(paper_regimes.main(args.paper or PAPERS, quick=args.quick, plot_dir=args.plot))
        return
    for name in args.paper or PAPERS:
        print(run(name, args.quick, args.measure))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
