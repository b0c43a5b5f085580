"""``fxpipe strategy MODEL``: per-layer parallel configurations (OptCNN's search, SplitBrain's preset, or dp) on a
group of ranks, as a per-layer table and totals against data parallelism and SplitBrain."""

from __future__ import annotations

import json
from enum import Enum
from typing import Annotated, Any, Optional

import typer

from fxpipe.cli.common import one_line_errors, out, parse_size
from fxpipe.errors import OptionError


class Choice(str, Enum):
    auto = "auto"
    splitbrain = "splitbrain"
    dp = "dp"


def strategy_cmd(
    target: Annotated[str, typer.Argument(help="A zoo model that torch.fx traces: vgg-tiny, vgg-16, resnet-50, "
                                               "mlp-small, ...")],
    ranks: Annotated[int, typer.Option("--ranks", "-r", help="The group of ranks (a power of two: the DTensor "
                                       "runtime's (2, ..., 2) mesh).")] = 4,
    strategy: Annotated[Choice, typer.Option(help="auto: the search (node/edge elimination, exact); splitbrain: "
                                             "convolutions data-parallel, fully connected layers sharded in "
                                             "groups of --group; dp: every layer splits the batch.")] = Choice.auto,
    group: Annotated[int, typer.Option(min=1, help="SplitBrain's group of ranks (divides --ranks).")] = 2,
    batch: Annotated[Optional[int], typer.Option("--batch", "--batch-size", min=1, help="Global batch, a multiple of "
                                                 "--ranks (default: the zoo's example batch).")] = None,
    bandwidth: Annotated[str, typer.Option(help="Link bandwidth per second between ranks, e.g. 1.5GB.")] = "1.5GB",
    latency: Annotated[float, typer.Option(help="Seconds per ring step of a collective.")] = 1e-4,
    alltoall: Annotated[bool, typer.Option(help="The backend has all-to-all (NCCL); gloo does not, and moving a "
                                           "split between dims then all-gathers.")] = False,
    heights: Annotated[bool, typer.Option(help="Also consider height (spatial) splits of convolutions: cost model "
                                          "only, the DTensor runtime does not run them.")] = False,
    memory_per_device: Annotated[Optional[str], typer.Option(help="Memory cap per rank for the search, e.g. "
                                                             "8GiB.")] = None,
    optimizer: Annotated[str, typer.Option(help="Optimizer state in the memory column: sgd, momentum or adam.")
                         ] = "sgd",
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout, nothing else.")] = False,
    plain: Annotated[bool, typer.Option(help="Plain-text tables.")] = False,
) -> None:
    """Choose a configuration per layer (degrees over batch, output and input channels) for MODEL on --ranks ranks;
    print each layer's compute, sync, transfer and memory, and the totals against dp and SplitBrain: the tables of
    fxpipe compile --stages 1 --dp D --strategy (which records the choice for fxpipe run), without a plan."""
    with one_line_errors():
        k = ranks.bit_length() - 1
        if ranks < 2 or 1 << k != ranks:
            raise OptionError(f"--ranks must be a power of two of at least 2 (the runtime's (2, ..., 2) mesh; "
                              f"given: {ranks}); use 2, 4, 8, ...")
        if ranks % group:
            raise OptionError(f"--group {group} must divide --ranks {ranks}; use a power of two up to {ranks}")
        link = parse_size(bandwidth, "--bandwidth")
        cap = parse_size(memory_per_device, "--memory-per-device") if memory_per_device else None
        report = _report(target, ranks, strategy.value, group, batch, link, latency, alltoall, heights, cap,
                         optimizer)
        if as_json:
            print(json.dumps(report["json"]))
            return
        from fxpipe.render import print_reports

        print_reports(report["tables"], plain=plain, console=out)


def _report(target: str, ranks: int, choice: str, group: int, batch: int | None, bandwidth: float, latency: float,
            alltoall: bool, heights: bool, cap: float | None, optimizer: str) -> dict[str, Any]:
    """``fxpipe compile --strategy``'s choice and tables (``api.choose_strategy``) on the model built on meta,
    without compiling it: a preview that may also cost all-to-all and height splits."""
    from fxpipe import models
    from fxpipe.api import choose_strategy

    zoo = models.build(target, device="meta", batch_size=batch)
    rows = zoo.example_inputs[0].shape[0]
    try:
        chosen = choose_strategy(zoo.model, zoo.example_inputs, choice, ranks=ranks, group=group,
                                 bandwidth=bandwidth, latency=latency, alltoall=alltoall, heights=heights,
                                 memory_cap=cap, optimizer=optimizer)
    except OptionError as exc:  # planning's refusal names fxpipe compile's --batch-size; this command's is --batch
        if not rows % ranks or "no even split" not in str(exc):
            raise
        given = f"--batch {batch}" if batch is not None else f"{target}'s example batch"
        raise OptionError(f"the batch of {rows} rows ({given}) does not split evenly over --ranks {ranks}; "
                          f"give --batch {ranks * max(1, -(-rows // ranks))} (a multiple of {ranks})") from None
    per_layer, summary = chosen.reports
    record = chosen.record
    payload = {"target": target, "ranks": ranks, "strategy": choice, "method": record.method, "cost_s": record.cost,
               "layers": [{"node": node, "config": config} for node, config in record.nodes],
               "totals": [dict(zip(summary.columns, t)) for t in summary.rows]}
    return {"tables": [per_layer, summary], "json": payload}
