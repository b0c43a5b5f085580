"""gpt: a nanoGPT-style decoder-only transformer with the LM head tied to the token embedding."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fxpipe.errors import OptionError

DESCRIPTION = "nanoGPT-style decoder transformer, LM head tied to the token embedding"
DEFAULT_SIZE = "small"


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT: vocabulary, context length, depth, heads and width."""

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0


@dataclass(frozen=True)
class GPTSize:
    """One zoo size: the model's config and the example batch's shape ``(batch_size, seq_len)``."""

    config: GPTConfig
    batch_size: int
    seq_len: int


SIZES: dict[str, GPTSize] = {
    "tiny": GPTSize(
        GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32), 2, 16
    ),
    "small": GPTSize(
        GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64), 4, 32
    ),
    "medium": GPTSize(
        GPTConfig(vocab_size=512, block_size=128, n_layer=8, n_head=4, n_embd=128), 4, 64
    ),
    # The runtime benchmark's GPT: 8 blocks, d=256, seq 128; batch 16 = 8 microbatches of 2.
    "base": GPTSize(
        GPTConfig(vocab_size=512, block_size=128, n_layer=8, n_head=4, n_embd=256), 2, 128
    ),
    # GPT-2 XL: the shape of a real pipeline-parallel job; build it on the meta device.
    "1.5b": GPTSize(
        GPTConfig(vocab_size=50257, block_size=1024, n_layer=48, n_head=25, n_embd=1600), 1, 1024
    ),
}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask, one fused ``c_attn`` projection for q, k, v."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(
                f"n_embd must be a multiple of n_head (n_embd: {config.n_embd}, "
                f"n_head: {config.n_head}); change one of them"
            )
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        head_dim = C // self.n_head
        q = q.view(B, T, self.n_head, head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_head, head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """The transformer feed-forward: expand to ``4 * n_embd``, GELU, project back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token ids ``(B, T)`` to next-token logits ``(B, T, vocab_size)``.

    ``lm_head.weight`` is the same Parameter as ``wte.weight`` (weight tying, as in GPT-2), so it
    is counted once by ``parameters()`` and a pipeline split must place or share it explicitly.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2 scales the projections that write into the residual stream by 1/sqrt(2 * n_layer).
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.size()
        if T > self.config.block_size:
            raise OptionError(
                f"sequence longer than the context (seq_len: {T}, block_size: "
                f"{self.config.block_size}); shorten the input or raise GPTConfig.block_size"
            )
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def make_model(size: str) -> GPT:
    """The GPT of zoo size ``size`` (a key of ``SIZES``)."""
    return GPT(SIZES[size].config)


def make_example(
    size: str, batch_size: int, generator: torch.Generator
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Random token ids ``(B, T)`` and, as targets, the same sequence shifted left by one."""
    spec = SIZES[size]
    tokens = torch.randint(
        0, spec.config.vocab_size, (batch_size, spec.seq_len + 1), generator=generator
    )
    return (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous()


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of logits ``(B, T, vocab)`` against token ids ``(B, T)``."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
