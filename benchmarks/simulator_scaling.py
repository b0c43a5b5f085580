"""The simulator's time against schedule length (issue 15): generate + simulate in process, and ``fxpipe simulate``
end to end, for 4 stages x N microbatches, the simulator before issue 15 (``--old-rev``, loaded from git) against
this tree's.

    python benchmarks/simulator_scaling.py [--microbatches 500 1000 2000 10000 100000] [--schedules 1f1b zb-h1 gpipe]
                                           [--old-rev 769d855] [--old-max 2000] [--repeats 3]
                                           [--out benchmarks/results/simulator_scaling/scaling.json]

In process, each timing is the least of ``--repeats`` runs (one for the old simulator), wall and CPU seconds; the old
and new results are compared field by field (``SimResult.to_json``) where both ran. End to end is
``fxpipe simulate --uniform-costs 1,1,1 --stages 4 --schedule S --microbatches N`` in a subprocess (one run), the old
one from ``git archive`` of ``--old-rev``. The old simulator runs only up to ``--old-max`` microbatches (its CLI
refused more than 10,000 stage-microbatches anyway). ``actions``: the schedule's actions with its sends and receives.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fxpipe.schedules import ir  # noqa: E402
from fxpipe.schedules.generators import generate  # noqa: E402
from fxpipe.schedules.simulate import Costs, simulate  # noqa: E402


def _module(name: str, source: str, **overrides: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    module.__dict__.update(overrides)
    return module


def old_modules(rev: str) -> tuple[types.ModuleType, types.ModuleType]:
    """The generators and simulator at ``rev``, over this tree's Action, Kind and Schedule (unchanged since)."""
    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout

    old_ir = _module("old_ir", show("fxpipe/schedules/ir.py"))
    old_ir.__dict__.update(Kind=ir.Kind, Action=ir.Action, Schedule=ir.Schedule, COMM=ir.COMM, COMPUTE=ir.COMPUTE)
    old_sim = _module("old_simulate", show("fxpipe/schedules/simulate.py"))
    old_sim.__dict__["with_communication"] = old_ir.with_communication
    old_gen = _module("old_generators", show("fxpipe/schedules/generators.py"), Costs=old_sim.Costs)
    return old_gen, old_sim


def time_in_process(gen: Any, sim: Any, costs_cls: Any, name: str, m: int, repeats: int) -> dict[str, Any]:
    best: dict[str, Any] = {}
    for _ in range(repeats):
        gc.collect()
        wall, cpu = time.perf_counter(), time.process_time()
        costs = costs_cls.uniform(4, 1.0, 1.0, 1.0)
        sched = gen.generate(name, 4, m, costs)
        generated = time.perf_counter() - wall
        result = sim.simulate(sched, costs)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if not best or wall < best["seconds"]:
            best = {"seconds": round(wall, 4), "cpu_seconds": round(cpu, 4), "generate_seconds": round(generated, 4),
                    "actions": len(result.events), "makespan": result.makespan, "doc": result.to_json()}
        del sched, result
    return best


def time_cli(pythonpath: Path, name: str, m: int) -> dict[str, Any]:
    cmd = [sys.executable, "-c", "from fxpipe.cli.main import app; app()", "simulate", "--uniform-costs", "1,1,1",
           "--stages", "4", "--schedule", name, "--microbatches", str(m), "--plain"]
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    wall = time.perf_counter()
    usage = os.times()
    # cwd too: ``python -c`` puts the working directory first on sys.path
    done = subprocess.run(cmd, env=env, cwd=pythonpath, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - wall
    after = os.times()
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
    return {"seconds": round(wall, 4), "cpu_seconds": round((after.children_user - usage.children_user)
                                                            + (after.children_system - usage.children_system), 4),
            "stdout_lines": len(done.stdout.splitlines())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[500, 1000, 2000, 10000, 100000])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zb-h1", "gpipe"])
    parser.add_argument("--old-rev", default="769d855")
    parser.add_argument("--old-max", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/simulator_scaling/scaling.json")
    args = parser.parse_args()

    old_gen, old_sim = old_modules(args.old_rev)
    with tempfile.TemporaryDirectory(prefix="fxpipe-old-") as tmp:
        rows = run(args, old_gen, old_sim, Path(tmp))
    doc = {
        "benchmark": "simulator_scaling",
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
        "old_rev": args.old_rev,
        "new_rev": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                  text=True).stdout.strip() + " + working tree",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "load_average_at_end": os.getloadavg()},
        "costs": "uniform F = B = W = 1, free transfers, dp 1",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


def run(args: argparse.Namespace, old_gen: Any, old_sim: Any, old_tree: Path) -> list[dict[str, Any]]:
    archive = subprocess.run(["git", "archive", args.old_rev, "fxpipe"], cwd=ROOT, check=True, capture_output=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(old_tree, filter="data")
    new_gen = types.SimpleNamespace(generate=generate)
    new_sim = types.SimpleNamespace(simulate=simulate)
    rows: list[dict[str, Any]] = []
    for name in args.schedules:
        for m in args.microbatches:
            new = time_in_process(new_gen, new_sim, Costs, name, m, args.repeats if m <= 10000 else 1)
            row: dict[str, Any] = {"schedule": name, "stages": 4, "microbatches": m, "actions": new["actions"],
                                   "new_simulate": {k: v for k, v in new.items() if k not in ("doc", "actions")}}
            row["new_cli"] = time_cli(ROOT, name, m)
            if m <= args.old_max:
                old = time_in_process(old_gen, old_sim, old_sim.Costs, name, m, 1)
                row["old_simulate"] = {k: v for k, v in old.items() if k not in ("doc", "actions")}
                row["old_equals_new"] = old["doc"] == new["doc"] and old["actions"] == new["actions"]
                row["old_cli"] = time_cli(old_tree, name, m)
                row["speedup_simulate"] = round(old["seconds"] / new["seconds"], 1)
                row["speedup_cli"] = round(row["old_cli"]["seconds"] / row["new_cli"]["seconds"], 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
