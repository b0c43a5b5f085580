"""Moves of an activation's derivative across a cut (LayerPipe's inter-layer balance), on split stage graphs.

``balance_backward`` (a pass) decides which cuts move; a loaded plan records its decisions
(``Plan.backward_moves``) and ``Pipeline.build_backward`` makes the same moves on the graphs it splits,
so a plan directory trains the graphs its compile balanced.

    before: stage k  B: du = threshold_backward(dv, v); ...      stage k+1  B: ...; return dv
    after:  stage k  B: ... (its incoming gradient is du)        stage k+1  B: ...; return threshold_backward(dv, v)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from fxpipe.errors import PlanFileError
from fxpipe.graphs.convention import StageGraphs
from fxpipe.graphs.fx import copy_graph, output_node, returned, value_bytes

# Derivatives of element-wise activations that read the activation's *output* (which the next
# stage holds as its input), with the position of that output among the op's arguments.
MOVABLE = {
    torch.ops.aten.threshold_backward.default: 1,
    torch.ops.aten.tanh_backward.default: 1,
    torch.ops.aten.sigmoid_backward.default: 1,
}


@dataclasses.dataclass(frozen=True)
class Move:
    op: Any
    grad_slot: int  # position j in graphs[k].grad_outputs of the value's gradient
    out_pos: int  # the value's position among stage k's outputs
    in_pos: int  # its position among stage k+1's inputs
    nbytes: int
    tail: tuple[Any, ...]  # the derivative's constant arguments after its two tensors (relu's threshold)


def find_move(gk: StageGraphs, gk1: StageGraphs, out_pos: int, in_pos: int) -> Move | None:
    if gk.fused or gk1.fused or out_pos not in gk.grad_outputs or in_pos not in gk1.grad_inputs:
        return None
    j = gk.grad_outputs.index(out_pos)
    if ("grad", j) not in gk.b_slots or ("grad", j) in gk.w_slots:
        return None
    ph = _placeholders(gk.backward_input)[gk.b_slots.index(("grad", j))]
    users = list(ph.users)
    if len(users) != 1 or users[0].target not in MOVABLE or users[0].args[0] is not ph:
        return None
    deriv = users[0]
    other = deriv.args[MOVABLE[deriv.target]]  # type: ignore[index]
    if not isinstance(other, torch.fx.Node) or other.op != "placeholder":
        return None
    slot = gk.b_slots[_placeholders(gk.backward_input).index(other)]
    if slot[0] != "saved" or not _saved_is_output(gk, slot[1], out_pos):
        return None
    return Move(deriv.target, j, out_pos, in_pos, value_bytes(ph.meta.get("val")), tuple(deriv.args[2:]))


def apply_move(move: Move, gk: StageGraphs, gk1: StageGraphs) -> tuple[StageGraphs, StageGraphs]:
    # Stage k: its B takes du where it took dv.
    b = copy_graph(gk.split_graphs()[1].graph)
    phs = [n for n in b.nodes if n.op == "placeholder"]
    ph = phs[gk.b_slots.index(("grad", move.grad_slot))]
    deriv = next(iter(ph.users))
    extra = deriv.args[MOVABLE[deriv.target]]
    deriv.replace_all_uses_with(ph)
    b.erase_node(deriv)
    b_slots = list(gk.b_slots)
    if isinstance(extra, torch.fx.Node) and not extra.users:
        b_slots.pop(phs.index(extra))
        b.erase_node(extra)
    new_k = dataclasses.replace(gk, backward_input=torch.fx.GraphModule(gk.backward_input or {}, b,
                                                                        class_name="StageBackwardInput"),
                                b_slots=tuple(b_slots))

    # Stage k+1: F saves its input v (if it did not already), B applies the derivative to dv.
    f = copy_graph(gk1.split_graphs()[0].graph)
    f_out = output_node(f)
    f_inputs = [n for n in f.nodes if n.op == "placeholder"]
    results = returned(f_out)
    saved = results[gk1.num_outputs:]
    if f_inputs[move.in_pos] in saved:
        s = saved.index(f_inputs[move.in_pos])
        num_saved = gk1.num_saved
    else:
        results.append(f_inputs[move.in_pos])
        f_out.args = (tuple(results),)
        s, num_saved = gk1.num_saved, gk1.num_saved + 1
    b1 = copy_graph(gk1.split_graphs()[1].graph)
    b1_slots = list(gk1.b_slots)
    phs1 = [n for n in b1.nodes if n.op == "placeholder"]
    if ("saved", s) in b1_slots:
        v = phs1[b1_slots.index(("saved", s))]
    else:
        with b1.inserting_after(phs1[-1] if phs1 else None):
            v = b1.placeholder(f"saved_{s}")
        v.meta = dict(f_inputs[move.in_pos].meta)
        b1_slots.append(("saved", s))
    b1_out = output_node(b1)
    results1 = returned(b1_out)
    pos = gk1.grad_inputs.index(move.in_pos)
    args = [results1[pos], v] if MOVABLE[move.op] == 1 else [v, results1[pos]]
    with b1.inserting_before(b1_out):
        results1[pos] = b1.call_function(move.op, (*args, *move.tail))
    b1_out.args = (tuple(results1),)
    added = 0 if num_saved == gk1.num_saved else value_bytes(f_inputs[move.in_pos].meta.get("val"))
    new_k1 = dataclasses.replace(
        gk1,
        forward=torch.fx.GraphModule(gk1.forward or {}, f, class_name="StageForward"),
        backward_input=torch.fx.GraphModule(gk1.backward_input or {}, b1, class_name="StageBackwardInput"),
        num_saved=num_saved,
        b_slots=tuple(b1_slots),
        bytes_f_to_b=gk1.bytes_f_to_b + added,
    )
    return new_k, new_k1


def _placeholders(gm: torch.fx.GraphModule | None) -> list[torch.fx.Node]:
    return [] if gm is None else [n for n in gm.graph.nodes if n.op == "placeholder"]


def _saved_is_output(g: StageGraphs, saved_idx: int, out_pos: int) -> bool:
    results = returned(output_node(g.split_graphs()[0].graph))

    def base(node: Any) -> Any:
        while isinstance(node, torch.fx.Node) and node.target is torch.ops.aten.detach.default:
            node = node.args[0]
        return node

    return base(results[g.num_outputs + saved_idx]) is base(results[out_pos])


def apply_recorded(graphs: Sequence[StageGraphs], wiring: dict[str, Any],
                   moves: Sequence[tuple[int, str]]) -> list[StageGraphs]:
    """``graphs`` with each recorded move (cut k, value name) made, in order; PlanFileError when a recorded move
    is not there to make (the plan's graphs differ from the ones it was compiled with)."""
    out = list(graphs)
    for k, name in moves:
        stages = wiring["stages"]
        if not (0 <= k < len(out) - 1) or name not in stages[k]["outputs"] or name not in stages[k + 1]["inputs"]:
            raise PlanFileError(f"the plan moves the derivative of {name!r} across cut {k}, which the stages do not "
                                "have; re-run fxpipe compile")
        move = find_move(out[k], out[k + 1], stages[k]["outputs"].index(name), stages[k + 1]["inputs"].index(name))
        if move is None:
            raise PlanFileError(f"the plan moves the derivative of {name!r} across cut {k}, but stage {k}'s B does not "
                                "start with one; re-run fxpipe compile")
        out[k], out[k + 1] = apply_move(move, out[k], out[k + 1])
    return out
