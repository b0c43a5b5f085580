"""``fxpipe strategy MODEL``: per-layer parallel configurations (OptCNN's search, SplitBrain's preset, or dp) on a
group of ranks, as a per-layer table and totals against data parallelism and SplitBrain."""

from __future__ import annotations

import json
from typing import Any

from fxpipe.cli.command_configs import StrategyConfig, optimizer_state, sizes
from fxpipe.cli.common import one_line_errors, out
from fxpipe.cli.config import command
from fxpipe.errors import OptionError


def _strategy(ctx: Any, config: StrategyConfig) -> None:
    """Choose a configuration per layer (degrees over batch, output and input channels) for MODEL on --ranks ranks;
    print each layer's compute, sync, transfer and memory, and the totals against dp and SplitBrain: the tables of
    fxpipe compile --stages 1 --dp D --strategy (which records the choice for fxpipe run), without a plan."""
    with one_line_errors():
        report = _report(config)
        if config.as_json:
            print(json.dumps(report["json"]))
            return
        from fxpipe.render import print_reports

        print_reports(report["tables"], plain=config.plain, console=out)


strategy_cmd = command(StrategyConfig, _strategy, "strategy")


def _report(config: StrategyConfig) -> dict[str, Any]:
    """``fxpipe compile --strategy``'s choice and tables (``api.choose_strategy``) on the model built on meta,
    without compiling it: a preview that may also cost all-to-all and height splits."""
    from fxpipe import models
    from fxpipe.api import choose_strategy

    target, ranks, choice, batch = config.target, config.ranks, config.strategy, config.batch_size
    size = sizes(bandwidth=config.bandwidth, memory_per_device=config.memory_per_device)
    zoo = models.build(target, device="meta", batch_size=batch)
    rows = zoo.example_inputs[0].shape[0]
    try:
        chosen = choose_strategy(zoo.model, zoo.example_inputs, choice, ranks=ranks, group=config.group,
                                 bandwidth=size["bandwidth"], latency=config.latency, alltoall=config.alltoall,
                                 heights=config.heights, memory_cap=size["memory_per_device"],
                                 optimizer=optimizer_state(config.optimizer, config.momentum))
    except OptionError as exc:  # planning's refusal speaks of --dp; this command's ranks are --ranks
        if not rows % ranks or "no even split" not in str(exc):
            raise
        given = f"--batch-size {batch}" if batch is not None else f"{target}'s example batch"
        raise OptionError(f"the batch of {rows} rows ({given}) does not split evenly over --ranks {ranks}; "
                          f"give --batch-size {ranks * max(1, -(-rows // ranks))} (a multiple of {ranks})") from None
    per_layer, summary = chosen.reports
    record = chosen.record
    payload = {"target": target, "ranks": ranks, "strategy": choice, "method": record.method, "cost_s": record.cost,
               "layers": [{"node": node, "config": config} for node, config in record.nodes],
               "totals": [dict(zip(summary.columns, t)) for t in summary.rows]}
    return {"tables": [per_layer, summary], "json": payload}
