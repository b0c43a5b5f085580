"""Graph-to-graph passes, one module each, and the driver that runs them in order (assembled by fxpipe.api)."""

from __future__ import annotations

from fxpipe.passes.annotate_costs import annotate_costs, verify_costs
from fxpipe.passes.driver import History, PassRecord, PassResult, Step, run_steps, verify
from fxpipe.passes.group_layers import group_layers, verify_layers
from fxpipe.passes.partition_stages import partition_stages, verify_stages
from fxpipe.passes.split_stages import split_stages, verify_split
from fxpipe.passes.trace import trace

PASS_NAMES = ("trace", "annotate-costs", "group-layers", "count-backward", "profile-layers", "partition-stages",
              "split-stages", "split-backward", "balance-backward")
OPTIONAL_PASSES = ("profile-layers", "balance-backward")  # run only with --profile / --balance-backward
DEFAULT_PASSES = tuple(name for name in PASS_NAMES if name not in OPTIONAL_PASSES)


__all__ = [
    "DEFAULT_PASSES", "OPTIONAL_PASSES", "PASS_NAMES", "History", "PassRecord", "PassResult", "Step", "annotate_costs",
    "group_layers", "partition_stages", "run_steps", "split_stages", "trace", "verify", "verify_costs", "verify_layers",
    "verify_split", "verify_stages",
]
