"""``fxpipe inspect PLAN_DIR`` and ``fxpipe models``: a plan directory's tables again (with the inputs a batch needs
and what the loss expects), and the built-in zoo."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fxpipe.cli.command_configs import InspectConfig, ModelsConfig
from fxpipe.cli.common import one_line_errors, out
from fxpipe.cli.config import command

if TYPE_CHECKING:
    from fxpipe.report import Report


def _inspect(ctx: Any, config: InspectConfig) -> None:
    """Print a plan directory's tables again, without recompiling, and its inputs (name, shape per microbatch,
    dtype, values) and what its loss expects: what a batch for PipelineRuntime.step must hold."""
    plan_dir, as_json, plain, torchtitan = config.plan_dir, config.as_json, config.plain, config.torchtitan
    with one_line_errors():
        if torchtitan:
            _torchtitan(plan_dir)
            return
        from fxpipe.plan_dir import check_allocations, read_plan_json
        from fxpipe.report import Report

        doc = read_plan_json(plan_dir)
        check_allocations(plan_dir)  # every stage loaded through the allow-list and run on meta, as fxpipe run does
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
        batch = _batch_spec(doc)
        if as_json:
            print(json.dumps({"schema": "fxpipe.inspect/v1", "plan": doc, "batch": batch}, default=str))
            return
        from fxpipe.render import print_reports

        print_reports([*reports, summary, _batch_report(batch)], plain=plain, console=out)


inspect_cmd = command(InspectConfig, _inspect, "inspect")


def _torchtitan(plan_dir: Path) -> None:
    """The fragment on stdout; where no export holds the plan's CSV yet, the command that writes it on stderr."""
    from fxpipe.cli.common import say
    from fxpipe.plan_dir import read_plan
    from fxpipe.runtime.torch_export import COMPUTE_CSV, MANIFEST, resolve_plan_dir, torchtitan_toml

    path = resolve_plan_dir(plan_dir)
    export_dir = next((d for d in (plan_dir, path.parent) if (d / MANIFEST).is_file()), None)
    csv = (export_dir or Path(f"{str(plan_dir).rstrip('/')}-torch")) / COMPUTE_CSV
    print(torchtitan_toml(read_plan(path), str(csv)), end="")
    if export_dir is None:
        say(f"the schedule CSV is not written yet: fxpipe export {plan_dir} --to torch --out {csv.parent}")


def _models(ctx: Any, config: ModelsConfig) -> None:
    """List the built-in models and their sizes with parameter counts."""
    as_json, plain = config.as_json, config.plain
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


models_cmd = command(ModelsConfig, _models, "models")


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
    nodes, stages = record.get("nodes"), record.get("stages")
    nodes = nodes if isinstance(nodes, list) else []
    stages = stages if isinstance(stages, list) else []
    split = sum(1 for n in nodes if isinstance(n, list) and len(n) == 2 and any(ch in str(n[1]) for ch in "crh"))
    if stages:  # pipelined: each stage's group of ranks, where it ends, its own search
        parts = "; ".join(f"stage {i} {s.get('first')}..{s.get('last')} ({s.get('method')})" for i, s in
                          enumerate(stages) if isinstance(s, dict))
        return (f"strategy {record.get('name')} ({record.get('method')}) in {len(stages)} stages x "
                f"{record.get('ranks')} ranks, {record.get('microbatches')} microbatches (gpipe): {len(nodes)} nodes, "
                f"{split} split beyond the batch; {parts}",)
    return (f"strategy {record.get('name')} ({record.get('method')}) on {record.get('ranks')} ranks: "
            f"{len(nodes)} nodes, {split} split beyond the batch",)



def _batch_spec(doc: dict) -> dict:
    """The plan's inputs (one microbatch each, as compiled) and, for a built-in model, what its loss takes: the
    target's shape, dtype and values, and the range of each integer input (the embedding it indexes)."""
    plan = doc.get("plan") or {}
    specs = [s for s in plan.get("inputs") or [] if isinstance(s, dict)]
    inputs = [{"name": str(s.get("name")), "shape": [int(d) for d in s.get("shape") or []],
               "dtype": str(s.get("dtype")), "values": None} for s in specs]
    model = (plan.get("provenance") or {}).get("model")
    loss = None
    if isinstance(model, str) and ":" not in model and inputs and inputs[0]["shape"]:
        loss = _zoo_loss(model, inputs, (plan.get("provenance") or {}).get("build") or {})
    for spec in inputs:
        dtype = spec["dtype"]
        if spec["values"] is None and isinstance(dtype, str):
            spec["values"] = "any" if dtype.startswith(("float", "bfloat")) else "integers"
    return {"model": model, "inputs": inputs, "loss": loss}


def _zoo_loss(model: str, inputs: list[dict], build: dict) -> dict | None:
    """Built-in ``model`` on the meta device (no weights, nothing computed): its loss, target and index ranges."""
    import torch

    from fxpipe import models
    from fxpipe.data import index_bounds
    from fxpipe.errors import FxpipeError

    try:
        dtype = getattr(torch, str(build.get("dtype") or "float32"))
        zoo = models.build(model, device="meta", batch_size=inputs[0]["shape"][0], dtype=dtype)
    except (FxpipeError, AttributeError, TypeError):
        return None
    output, bounds = index_bounds(zoo.model, zoo.example_inputs)
    for i, rows in bounds.items():
        if i < len(inputs):
            inputs[i]["values"] = f"[0, {rows})"
    target = zoo.example_target
    values = "any"
    if not target.is_floating_point() and isinstance(output, torch.Tensor):
        values = f"[0, {output.shape[-1]})"
    what = (zoo.loss_fn.__doc__ or "").strip().split("\n")[0].rstrip(".").replace("``", "")
    return {"loss": what or getattr(zoo.loss_fn, "__name__", "loss"), "target_shape": list(target.shape),
            "target_dtype": str(target.dtype).removeprefix("torch."), "target_values": values,
            "output_shape": list(output.shape) if isinstance(output, torch.Tensor) else None}


def _batch_report(batch: dict) -> Report:
    """The inputs and target one microbatch holds; a batch for ``PipelineRuntime.step`` stacks M of them."""
    from fxpipe.report import Report

    rows = [(s["name"], "x".join(map(str, s["shape"])) or "scalar", s["dtype"], s["values"]) for s in batch["inputs"]]
    loss = batch["loss"]
    if loss:
        rows.append(("target", "x".join(map(str, loss["target_shape"])) or "scalar", loss["target_dtype"],
                     loss["target_values"]))
        note = (f"loss: {loss['loss']}, on the output {tuple(loss['output_shape'] or ())} and the target; "
                f"fxpipe run builds these batches itself")
    else:
        note = ("loss: the one you pass (fxpipe run --loss FILE.py:FUNCTION, or PipelineRuntime(loss_fn=...)); the "
                "plan does not record it")
    return Report(title="one microbatch: the inputs as compiled, and the target (a step's batch stacks "
                        "microbatches along the first dimension)",
                  columns=("tensor", "shape", "dtype", "values"), rows=tuple(rows), notes=(note,))
