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
    batch: Annotated[Optional[int], typer.Option(min=1, help="Global batch (default: the zoo's example batch).")] = None,
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
    print each layer's compute, sync, transfer and memory, and the totals against dp and SplitBrain. Run the
    choice with examples/train_strategy.py (torchrun)."""
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


def _ms(seconds: float) -> float:
    return round(1e3 * seconds, 4)


def _mb(nbytes: float) -> float:
    return round(nbytes / 1e6, 3)


def _report(target: str, ranks: int, choice: str, group: int, batch: int | None, bandwidth: float, latency: float,
            alltoall: bool, heights: bool, cap: float | None, optimizer: str) -> dict[str, Any]:
    from fxpipe import models
    from fxpipe.passes.strategy_graph import strategy_graph
    from fxpipe.planning.strategies import build_graph, data_parallel, solve, splitbrain, strategy_rows, \
        traffic_per_layer
    from fxpipe.report import Report

    zoo = models.build(target, device="meta", batch_size=batch)
    g = strategy_graph(zoo.model, zoo.example_inputs)
    graph = build_graph(g.specs, g.edges, ranks, bandwidth=bandwidth, latency=latency, optimizer=optimizer,
                        alltoall=alltoall, spatial=heights)
    presets = {"dp": data_parallel(graph), f"splitbrain-{group}": splitbrain(graph, g.specs, group),
               "auto": solve(graph, memory_cap=cap)}
    chosen = presets[{"auto": "auto", "dp": "dp", "splitbrain": f"splitbrain-{group}"}[choice]]
    rows = strategy_rows(graph, g.specs, chosen).rows
    per_layer = Report(f"strategy {choice} ({chosen.method}) on {ranks} ranks: {target}, batch "
                       f"{zoo.example_inputs[0].shape[0]}",
                       ("layer", "config", "compute ms", "sync ms", "transfer in ms", "memory MB"),
                       tuple((r[0], r[1], _ms(r[2]), _ms(r[3]), _ms(r[4]), _mb(r[5])) for r in rows),
                       notes=(f"link {bandwidth / 1e9:g} GB/s, {1e6 * latency:g} us per ring step; "
                              f"{'all-to-all' if alltoall else 'no all-to-all (gloo)'}; compute from FLOP "
                              f"estimates; memory: parameters, gradients, {optimizer} state, saved activations",))
    totals = []
    for name, s in presets.items():
        name = f"{name} (chosen)" if s is chosen else name
        degrees = [graph.layers[v].configs[c].degrees for v, c in enumerate(s.choice)]
        total = strategy_rows(graph, g.specs, s).rows[-1]
        totals.append((name, _ms(s.cost), _ms(total[2]), _ms(total[3]), _ms(total[4]), _mb(total[5]),
                       _mb(sum(traffic_per_layer(g.specs, g.edges, degrees, alltoall=alltoall)))))
    summary = Report("totals per step and rank",
                     ("strategy", "step ms", "compute ms", "sync ms", "transfer ms", "memory MB", "received MB"),
                     tuple(totals))
    payload = {"target": target, "ranks": ranks, "strategy": choice, "method": chosen.method,
               "cost_s": chosen.cost, "layers": [{"node": r[0], "config": r[1]} for r in rows[:-1]],
               "totals": [dict(zip(summary.columns, t)) for t in totals]}
    return {"tables": [per_layer, summary], "json": payload}
