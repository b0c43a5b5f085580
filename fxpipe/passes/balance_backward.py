"""balance_backward: LayerPipe's inter-layer balance: move activation derivatives across a cut when that lowers the bottleneck.

When stage k sends v = relu(u) (or tanh, sigmoid) to stage k+1, stage k's B starts with the
element-wise derivative ``threshold_backward(dv, v, 0)``. That op needs only dv and v, and
stage k+1 holds both (v is its input), so stage k+1's B can run it and send du instead of dv.
The work moves from stage k to stage k+1; we move it only when the larger of the two stage
times drops.

    before: stage k  B: du = threshold_backward(dv, v); ...      stage k+1  B: ...; return dv
    after:  stage k  B: ... (its incoming gradient is du)        stage k+1  B: ...; return threshold_backward(dv, v)
"""

from __future__ import annotations

import torch.fx

from fxpipe.graphs.convention import StageGraphs
from fxpipe.graphs.fx import clone
from fxpipe.graphs.moves import apply_move, find_move
from fxpipe.passes.driver import PassResult
from fxpipe.plan import DEFAULTS, BackwardMove
from fxpipe.report import Report


def balance_backward(root: torch.fx.GraphModule, *, device_mem_bw: float | None = None) -> PassResult:
    """Move movable activation derivatives from the start of stage k's B to the end of stage k+1's B.

    Reads: the stage graphs (split_backward), the wiring (split_stages) and the stage times of
    the plan (partition_stages). A move's cost is its memory traffic, 3 x bytes / device_mem_bw.
    Writes: new StageGraphs for the stages it changes, the plan's stage times in the report, and
    ``root.meta["fxpipe_backward_moves"]`` (``plan.BackwardMove`` each): the plan records them, and a
    loaded plan's ranks make the same moves on the graphs they split (``Pipeline.build_backward``).
    Only values read by the next stage alone (not the model output, not a skip connection) move.
    """
    device_mem_bw = DEFAULTS.device_mem_bw if device_mem_bw is None else device_mem_bw
    out = clone(root)
    graphs: list[StageGraphs] = list(root.meta["fxpipe_stage_graphs"])
    wiring = root.meta["fxpipe_wiring"]
    plan = root.meta["fxpipe_stage_plan"]
    times = list(plan.stage_times)
    before = max(times)
    readers: dict[str, list[int]] = {}
    for k, w in enumerate(wiring["stages"]):
        for name in w["inputs"]:
            readers.setdefault(name, []).append(k)
    rows = []
    moves: list[BackwardMove] = []
    for k in range(len(graphs) - 1):
        for i, name in enumerate(wiring["stages"][k]["outputs"]):
            if readers.get(name) != [k + 1] or name in wiring["outputs"]:
                continue
            move = find_move(graphs[k], graphs[k + 1], i, wiring["stages"][k + 1]["inputs"].index(name))
            if move is None:
                continue
            cost = 3 * move.nbytes / device_mem_bw
            if max(times[k] - cost, times[k + 1] + cost) >= max(times[k], times[k + 1]):
                rows.append((k, name, str(move.op).replace("aten.", "").replace(".default", ""),
                             round(cost * 1e3, 5), "kept: would not lower the slower of the two stages"))
                continue
            graphs[k], graphs[k + 1] = apply_move(move, graphs[k], graphs[k + 1])
            times[k] -= cost
            times[k + 1] += cost
            moves.append(BackwardMove(k, name, cost))
            rows.append((k, name, str(move.op).replace("aten.", "").replace(".default", ""), round(cost * 1e3, 5),
                         f"moved to stage {k + 1}'s B"))
    out.meta["fxpipe_stage_graphs"] = graphs
    out.meta["fxpipe_backward_moves"] = moves
    notes = (f"bottleneck before {before * 1e3:.4f} ms, after {max(times) * 1e3:.4f} ms",
             *(() if rows else ("no stage sends an activation whose derivative could move (relu, tanh, sigmoid)",)))
    report = Report(title="balance-backward: activation derivatives moved across cuts",
                    columns=("cut after stage", "value", "derivative", "ms", "decision"), rows=tuple(rows), notes=notes)
    return PassResult(out, bool(rows), (report,))


