"""``fxpipe export PLAN --to torch --out DIR``: a plan for torch.distributed.pipelining's runtime (schedule CSVs,
a manifest, and the plan that ``fxpipe.torch_schedule`` rebuilds the stages from)."""

from __future__ import annotations

import json
from typing import Any

from fxpipe.cli.command_configs import ExportConfig
from fxpipe.cli.common import check_outputs, check_writable_dir, one_line_errors, say
from fxpipe.cli.config import command
from fxpipe.errors import OptionError


def _export(ctx: Any, config: ExportConfig) -> None:
    """Export a plan to torch's pipelining runtime: its schedule as torch's action CSV and the stages' interfaces;
    ``fxpipe.torch_schedule(DIR, rank, world, loss_fn)`` then builds the PipelineStages and the schedule."""
    plan_dir, out_dir = config.plan_dir, config.out
    with one_line_errors():
        check_outputs([("the plan", plan_dir)], [("--out", out_dir)])
        check_writable_dir(out_dir, "--out")
        if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())
                                 and not (out_dir / "torch_export.json").is_file()):
            raise OptionError(f"--out {str(out_dir)!r} exists and is not an export directory fxpipe wrote; choose a "
                              "new path")
        from fxpipe.runtime.torch_export import COMMS_CSV, COMPUTE_CSV, export_torch

        export = export_torch(plan_dir, out=out_dir)
        if config.as_json:
            print(json.dumps(export.manifest()))
            return
        sched = export.schedule
        print(f"{sched.name}: {len(export.modules)} stages on {sched.num_ranks} ranks, {sched.num_microbatches} "
              f"microbatches")
        for m in export.modules:
            print(f"  stage {m.index} (rank {export.rank_of_stage[m.index]}): takes {', '.join(m.takes)}; gives "
                  f"{', '.join(n for n in m.gives if n is not None)}; {sum(1 for _ in m.parameters())} parameters")
        say(f"wrote {out_dir / COMPUTE_CSV}, {out_dir / COMMS_CSV}, torch_export.json and plan/; on each rank: "
            f"stages, schedule = fxpipe.torch_schedule({str(out_dir)!r}, rank, world, loss_fn)")


export_cmd = command(ExportConfig, _export, "export")
