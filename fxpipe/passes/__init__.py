"""Graph-to-graph passes, one module each, and the ordered pipeline that runs them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fxpipe.passes.annotate_costs import DEFAULT_DEVICE_FLOPS, DEFAULT_DEVICE_MEM_BW, annotate_costs, verify_costs
from fxpipe.errors import OptionError
from fxpipe.passes.driver import History, PassRecord, PassResult, Step, run_steps, verify
from fxpipe.passes.group_layers import group_layers, verify_layers
from fxpipe.passes.partition_stages import DEFAULT_BANDWIDTH, DEFAULT_LATENCY, partition_stages, verify_stages
from fxpipe.passes.split_stages import split_stages, verify_split
from fxpipe.passes.trace import trace

PASS_NAMES = ("trace", "annotate-costs", "group-layers", "count-backward", "profile-layers", "partition-stages",
              "split-stages", "split-backward", "balance-backward")
OPTIONAL_PASSES = ("profile-layers", "balance-backward")  # run only with --profile / --balance-backward
DEFAULT_PASSES = tuple(name for name in PASS_NAMES if name not in OPTIONAL_PASSES)


@dataclass(frozen=True)
class CompileOptions:
    """Every knob of ``fxpipe compile``, with the CLI's defaults."""

    stages: int = 2
    tracer: str = "export"
    granularity: str = "auto"
    bandwidth: float = DEFAULT_BANDWIDTH
    latency: float = DEFAULT_LATENCY
    memory_per_stage: float | None = None
    microbatches: int | None = None
    profile: bool = False
    profile_runs: int = 5
    device_flops: float = DEFAULT_DEVICE_FLOPS
    device_mem_bw: float = DEFAULT_DEVICE_MEM_BW
    split_backward: bool = True
    input_grads: bool = False
    balance_backward: bool = False
    verify_each: bool = False
    stop_after: str | None = None
    print_after: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


def build_steps(model: torch.nn.Module, example_inputs: Sequence[Any], options: CompileOptions,
                example_kwargs: dict[str, Any] | None = None) -> list[Step]:
    """The compile pipeline as an explicit ordered list of named steps."""
    from fxpipe.passes.profile_layers import profile_layers

    def need(gm: torch.fx.GraphModule | None) -> torch.fx.GraphModule:
        assert gm is not None  # every step after trace receives the previous step's graph
        return gm

    steps = [
        Step("trace", lambda gm: trace(model, example_inputs, tracer=options.tracer, example_kwargs=example_kwargs)),
        Step("annotate-costs", lambda gm: annotate_costs(need(gm), _flat_inputs(need(gm), example_inputs, example_kwargs),
                                                          device_flops=options.device_flops,
                                                          device_mem_bw=options.device_mem_bw), verify_costs),
        Step("group-layers", lambda gm: group_layers(need(gm), granularity=options.granularity), verify_layers),
    ]
    if options.split_backward:
        from fxpipe.passes.count_backward import count_backward

        steps.append(Step("count-backward", lambda gm: count_backward(
            need(gm), _flat_inputs(need(gm), example_inputs, example_kwargs), device_flops=options.device_flops),
            verify_costs))
    if options.profile:
        steps.append(Step("profile-layers", lambda gm: profile_layers(
            need(gm), _flat_inputs(need(gm), example_inputs, example_kwargs), runs=options.profile_runs), verify_layers))
    steps += [
        Step("partition-stages", lambda gm: partition_stages(
            need(gm), num_stages=options.stages, bandwidth=options.bandwidth, latency=options.latency,
            memory_per_stage=options.memory_per_stage, microbatches=options.microbatches), verify_stages),
        Step("split-stages", lambda gm: split_stages(need(gm)), verify_split),
    ]
    if options.split_backward:
        from fxpipe.passes.split_backward import split_backward, verify_split_backward

        steps.append(Step("split-backward", lambda gm: split_backward(
            need(gm), _flat_inputs(need(gm), example_inputs, example_kwargs), input_grads=options.input_grads,
            profile_runs=options.profile_runs if options.profile else 0),
            verify_split_backward))
        if options.balance_backward:
            from fxpipe.passes.balance_backward import balance_backward

            steps.append(Step("balance-backward", lambda gm: balance_backward(
                need(gm), device_mem_bw=options.device_mem_bw), verify_split_backward))
    elif options.balance_backward:
        raise OptionError("--balance-backward moves work between the split backward graphs; drop --no-split-backward")
    return steps


def _flat_inputs(gm: torch.fx.GraphModule, args: Sequence[Any], kwargs: dict[str, Any] | None) -> list[Any]:
    from fxpipe.graphs.convention import flatten_inputs

    return flatten_inputs(gm.meta.get("fxpipe_in_spec"), tuple(args), dict(kwargs or {}))


__all__ = [
    "DEFAULT_PASSES", "OPTIONAL_PASSES", "PASS_NAMES", "CompileOptions", "History", "PassRecord", "PassResult", "Step", "annotate_costs", "build_steps",
    "group_layers", "partition_stages", "run_steps", "split_stages", "trace", "verify",
]
