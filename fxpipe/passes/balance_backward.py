"""balance_backward: LayerPipe's inter-layer balance: make the activation derivatives' moves across cuts that the
partitioner planned.

When stage k sends v = relu(u) (or tanh, sigmoid) to stage k+1, stage k's B starts with the
element-wise derivative ``threshold_backward(dv, v, 0)``. That op needs only dv and v, and
stage k+1 holds both (v is its input), so stage k+1's B can run it and send du instead of dv.
The work moves from stage k to stage k+1. Which derivatives move is decided with the cuts, inside
the partitioner's DP (``partition_stages(..., balance_backward=True)``); this pass makes those moves.

    before: stage k  B: du = threshold_backward(dv, v); ...      stage k+1  B: ...; return dv
    after:  stage k  B: ... (its incoming gradient is du)        stage k+1  B: ...; return threshold_backward(dv, v)
"""

from __future__ import annotations

import torch.fx

from fxpipe.graphs.convention import StageGraphs
from fxpipe.graphs.fx import clone
from fxpipe.graphs.moves import apply_move, find_move
from fxpipe.passes.driver import PassResult
from fxpipe.plan import BackwardMove
from fxpipe.report import Report


def balance_backward(root: torch.fx.GraphModule) -> PassResult:
    """Make the moves the partitioner planned (``StagePlan.moves``): each activation derivative from the start of
    stage k's B to the end of stage k+1's B.

    Reads: the stage graphs (split_backward), the wiring (split_stages) and the stage plan, whose DP chose the cuts
    and the moves together (``partition_stages(..., balance_backward=True)``). A planned move the split graphs
    cannot make (the stage's backward is fused, or B does not start with the derivative) is taken back out of the
    plan's times. Writes: new StageGraphs for the stages it changes, the plan without the moves not made, and
    ``root.meta["fxpipe_backward_moves"]`` (``plan.BackwardMove`` each): the plan records them, and a loaded plan's
    ranks make the same moves on the graphs they split (``Pipeline.build_backward``).
    """
    out = clone(root)
    graphs: list[StageGraphs] = list(root.meta["fxpipe_stage_graphs"])
    wiring = root.meta["fxpipe_wiring"]
    plan = root.meta["fxpipe_stage_plan"]
    planned = {(c, value): seconds for c, value, seconds in plan.moves}
    before = plan
    for c, value, _ in plan.moves:
        before = before.without(c, value)
    readers: dict[str, list[int]] = {}
    for k, w in enumerate(wiring["stages"]):
        for name in w["inputs"]:
            readers.setdefault(name, []).append(k)
    rows = []
    moves: list[BackwardMove] = []
    for k in range(len(graphs) - 1):
        cut = plan.bounds[k + 1]
        for i, name in enumerate(wiring["stages"][k]["outputs"]):
            move = None
            if readers.get(name) == [k + 1] and name not in wiring["outputs"]:
                move = find_move(graphs[k], graphs[k + 1], i, wiring["stages"][k + 1]["inputs"].index(name))
            seconds = planned.pop((cut, name), None)
            if move is None:
                if seconds is not None:
                    plan = plan.without(cut, name)
                    rows.append((k, name, "", round(seconds * 1e3, 5),
                                 "kept: planned, but the split graphs cannot move it (B does not start with it)"))
                continue
            op = str(move.op).replace("aten.", "").replace(".default", "")
            if seconds is None:
                rows.append((k, name, op, "",
                             "kept: the partitioner did not plan it (it would not lower the bottleneck)"))
                continue
            graphs[k], graphs[k + 1] = apply_move(move, graphs[k], graphs[k + 1])
            moves.append(BackwardMove(k, name, seconds))
            rows.append((k, name, op, round(seconds * 1e3, 5), f"moved to stage {k + 1}'s B"))
    for (cut, name), seconds in planned.items():  # not sent across its cut by the split stages
        plan = plan.without(cut, name)
        rows.append((plan.bounds.index(cut) - 1, name, "", round(seconds * 1e3, 5),
                     "kept: planned, but the stages do not send it across that cut"))
    out.meta["fxpipe_stage_graphs"] = graphs
    out.meta["fxpipe_stage_plan"] = plan
    out.meta["fxpipe_backward_moves"] = moves
    notes = (f"bottleneck before {before.bottleneck * 1e3:.4f} ms, after {plan.bottleneck * 1e3:.4f} ms "
             "(the moves chosen with the cuts, by partition-stages' DP)",
             *(() if rows else ("no stage sends an activation whose derivative could move (relu, tanh, sigmoid)",)))
    report = Report(title="balance-backward: activation derivatives moved across cuts",
                    columns=("cut after stage", "value", "derivative", "ms", "decision"), rows=tuple(rows), notes=notes)
    return PassResult(out, bool(rows), (report,))
