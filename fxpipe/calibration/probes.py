"""The small models fxpipe's calibrations time: what the zoo's graphs are made of, at sizes where the arithmetic
is negligible, so that what is timed is the host's work per op and per action.

Both calibrations run the same model: ``fxpipe.calibration.compute`` times its split graphs for the host
time per node and per ATen op, and ``fxpipe.calibration.runtime_costs.overheads_on_ranks`` runs it as a two-stage
pipeline for the runtime's fixed costs per action, message and step. A model of many kinds of op, because inside a
pipeline an action of many kinds starts colder after each wait than one of two (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Mix(nn.Module):
    """One of each kind of node the zoo's graphs hold but the convolution, batch norm and max pool (whose host time
    the compute calibration takes from the convolutions' own cold intercept): a linear, a transformer block's
    layer norms, attention, dropout and GELU MLP, views, a mean and a log-softmax. Input ``(batch, 4, 2, 2)``, output
    ``(batch, 4)``; each sample is a sequence of 2 tokens of width 8."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.ln_1 = nn.LayerNorm(8)
        self.qkv = nn.Linear(8, 24)
        self.proj = nn.Linear(8, 8)
        self.ln_2 = nn.LayerNorm(8)
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(torch.flatten(x, 1)).view(-1, 2, 8)  # (batch, sequence 2, width 8)
        q, k, v = self.qkv(self.ln_1(h)).split(8, dim=2)
        q, k, v = (t.view(-1, 2, 2, 4).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(-1, 2, 8)
        h = h + F.dropout(self.proj(a), 0.1, self.training)
        h = h + self.down(F.gelu(self.up(self.ln_2(h))))
        return self.head(h.mean(dim=1)).log_softmax(dim=-1)
