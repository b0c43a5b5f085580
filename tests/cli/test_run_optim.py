"""``fxpipe run --optimizer adamw --lr-schedule cosine --warmup-steps --clip-grad-norm``: one launch of gpt-tiny on
2 pipeline ranks x 2 replicas (its tied embedding on both pipeline ranks) against one process with torch.optim.AdamW,
LambdaLR and torch.nn.utils.clip_grad_norm_; and the refusals, before any rank starts."""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch

from fxpipe import models
from fxpipe.cli.rank_common import synthetic_batch
from fxpipe.runtime.optim import LRSchedule
from tests._helpers import MLP_PLAN, cli_plan, fxpipe_cli, ok, one_line_error

STEPS, M, DP = 3, 4, 2
FLAGS = ("--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.1", "--betas", "0.9,0.95",
         "--lr-schedule", "cosine", "--warmup-steps", "1", "--clip-grad-norm", "0.5")


@functools.cache
def run() -> dict:
    plan = cli_plan("gpt-tiny", "--stages", "2", "--dp", str(DP), "--microbatches", str(M))
    return json.loads(ok(fxpipe_cli("run", plan, "--steps", STEPS, *FLAGS, "--json")).stdout)


def reference() -> list[tuple[float, float, float]]:
    """One process on the whole batch (dp x m microbatches): each step's mean loss, lr and norm before clipping."""
    zoo = models.build("gpt-tiny")
    ref = copy.deepcopy(zoo.model)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, LRSchedule("cosine", warmup_steps=1, total_steps=STEPS).factor)
    inputs, target = synthetic_batch(zoo, M * DP)
    xs, ts = inputs[0].tensor_split(M * DP), target.tensor_split(M * DP)
    rows = []
    for _ in range(STEPS):
        loss = sum(zoo.loss_fn(ref(x), t) for x, t in zip(xs, ts)) / (M * DP)
        loss.backward()
        lr = opt.param_groups[0]["lr"]
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        sched.step()
        rows.append((float(loss.detach()), lr, float(norm)))
    return rows


def test_adamw_cosine_and_global_clipping_on_2x2_ranks_train_like_one_process() -> None:
    doc = run()
    assert doc["ranks"] == 4 and doc["dp"] == 2
    got = list(zip(doc["losses"], doc["lrs"], doc["grad_norms"]))
    want = reference()
    # the norm over every stage and replica, the tied weight counted once: rtol 1e-5, as the losses and lrs
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=1e-5, atol=0)
    assert doc["lrs"][0] == 0.0 and min(doc["grad_norms"]) > 0.5  # warmup from 0; clipping acted every step


@pytest.mark.parametrize("flags, match", [
    (("--optimizer", "lamb"), "Invalid value for '--optimizer': 'lamb' is not one of 'sgd', 'adamw'"),
    (("--betas", "0.9"), "--betas takes two numbers"),
    (("--lr-schedule", "step"), "Invalid value for '--lr-schedule': 'step' is not one of 'constant', 'cosine'"),
    (("--precision", "fp8"), "Invalid value for '--precision': 'fp8' is not one of 'fp32', 'bf16', 'fp16'"),
    (("--clip-grad-norm", "0"), "--clip-grad-norm is the largest global gradient norm, > 0"),
    (("--schedule", "async-1f1b", "--clip-grad-norm", "1"), "async-1f1b steps each stage after every microbatch"),
])
def test_bad_optimizer_flags_are_one_line_before_any_rank_starts(flags: tuple[str, ...], match: str,
                                                                  no_rank_starts: list) -> None:
    plan = cli_plan(*MLP_PLAN)  # the plan most CLI tests run (compiled once per session)
    line = one_line_error(fxpipe_cli("run", plan, *flags))
    assert match in line, line
