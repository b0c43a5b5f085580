"""``fxpipe inspect PLAN_DIR`` and ``fxpipe models``: a plan directory's tables again, and the built-in zoo."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from fxpipe.cli.common import one_line_errors, out


def inspect_cmd(
    plan_dir: Annotated[Path, typer.Argument(help="A plan directory written by fxpipe compile.")],
    as_json: Annotated[bool, typer.Option("--json", help="plan.json's summary as JSON.")] = False,
    plain: Annotated[bool, typer.Option(help="Plain-text tables.")] = False,
) -> None:
    """Print a plan directory's tables again, without recompiling."""
    with one_line_errors():
        from fxpipe.plan_dir import read_plan_json
        from fxpipe.report import Report

        doc = read_plan_json(plan_dir)
        reports = [Report.from_json(r) for r in doc.get("reports", [])]
        summary = Report(
            title=f"plan {plan_dir}",
            columns=("stage", "graph", "inputs", "outputs", "parameters", "param elements"),
            rows=tuple((s["index"], s["graph"], len(s["inputs"]), len(s["outputs"]), len(s["parameters"]),
                        sum(_numel(p["shape"]) for p in s["parameters"])) for s in doc["stages"]),
            notes=(f"schema {doc['schema']}, fxpipe {doc.get('fxpipe_version')}, torch {doc.get('torch_version')}, "
                   f"model {(doc.get('plan') or {}).get('provenance', {}).get('model', '?')}",
                   *_strategy_note(doc)),
        )
        if as_json:
            print(json.dumps({"schema": "fxpipe.inspect/v1", "plan": doc}, default=str))
            return
        from fxpipe.render import print_reports

        print_reports([*reports, summary], plain=plain, console=out)


def models_cmd(
    as_json: Annotated[bool, typer.Option("--json", help="The zoo as JSON.")] = False,
    plain: Annotated[bool, typer.Option(help="Plain-text table.")] = False,
) -> None:
    """List the built-in models and their sizes with parameter counts."""
    with one_line_errors():
        from fxpipe import models
        from fxpipe.report import Report

        rows = []
        for entry in models.entries():
            for size in entry.sizes:
                name = f"{entry.family}-{size}"
                rows.append((name, models.parameter_count(name), "yes" if size == entry.default_size else "",
                             entry.description))
        if as_json:
            print(json.dumps({"schema": "fxpipe.models/v1", "models": [
                {"name": r[0], "parameters": r[1], "default": bool(r[2]), "description": r[3]} for r in rows]}))
            return
        from fxpipe.render import print_reports

        print_reports([Report("fxpipe models (the bare family name is the default size)",
                              ("model", "parameters", "default", "description"), tuple(rows))],
                      plain=plain, console=out)


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _strategy_note(doc: dict) -> tuple[str, ...]:
    """A line naming the plan's per-layer strategy (fxpipe compile --strategy), when it has one."""
    record = (doc.get("plan") or {}).get("strategy")
    if not isinstance(record, dict):
        return ()
    nodes = record.get("nodes") if isinstance(record.get("nodes"), list) else []
    split = sum(1 for n in nodes if isinstance(n, list) and len(n) == 2 and any(ch in str(n[1]) for ch in "crh"))
    stages = record.get("stages") if isinstance(record.get("stages"), list) else []
    if stages:  # pipelined: each stage's group of ranks, where it ends, its own search
        parts = "; ".join(f"stage {i} {s.get('first')}..{s.get('last')} ({s.get('method')})" for i, s in
                          enumerate(stages) if isinstance(s, dict))
        return (f"strategy {record.get('name')} ({record.get('method')}) in {len(stages)} stages x "
                f"{record.get('ranks')} ranks, {record.get('microbatches')} microbatches (gpipe): {len(nodes)} nodes, "
                f"{split} split beyond the batch; {parts}",)
    return (f"strategy {record.get('name')} ({record.get('method')}) on {record.get('ranks')} ranks: "
            f"{len(nodes)} nodes, {split} split beyond the batch",)

