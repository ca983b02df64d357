"""Small built-in GPT used by the demo, the benchmarks and the tests.

A decoder-only transformer with explicit attention (the ``[batch, heads, seq, seq]`` score
tensors are saved for backward, as in most training code), pre-norm blocks, GELU MLPs and dropout.
Everything is deterministic under a fixed seed, so runs with and without tba can be compared
bit for bit. Presets size it for a laptop CPU up to the end-to-end benchmark.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn
from torch.nn import functional as F


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of the model and of one batch."""

    vocab_size: int = 1024
    seq_len: int = 256
    width: int = 512
    layers: int = 8
    heads: int = 8
    dropout: float = 0.1
    batch_size: int = 8


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=128, seq_len=32, width=64, layers=2, heads=4, batch_size=2),
    "demo": GPTConfig(vocab_size=512, seq_len=128, width=256, layers=4, heads=4, batch_size=8),
    "small": GPTConfig(vocab_size=512, seq_len=128, width=384, layers=6, heads=6, batch_size=8),
    "bench": GPTConfig(),
    # Many narrow layers (python -m tba capacity): full recompute keeps every layer's input, about
    # 1.5 MiB a sample here, the largest part of its memory; offloaded recompute writes them out.
    "deep": GPTConfig(vocab_size=128, seq_len=128, width=128, layers=24, heads=2, batch_size=8),
}


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)
        self.dropout = nn.Dropout(config.dropout)
        mask = torch.ones(config.seq_len, config.seq_len, dtype=torch.bool).triu(1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(width // self.heads)
        scores = scores.masked_fill(self.causal_mask[:seq, :seq], float("-inf"))
        weights = self.dropout(scores.softmax(dim=-1))
        out = (weights @ v).transpose(1, 2).reshape(batch, seq, width)
        return self.dropout(self.proj(out))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.width)
        self.attn = Attention(config)
        self.norm2 = nn.LayerNorm(config.width)
        self.mlp = nn.Sequential(
            nn.Linear(config.width, 4 * config.width),
            nn.GELU(),
            nn.Linear(4 * config.width, config.width),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """``GPT(config)(tokens, targets)`` returns the mean cross-entropy loss."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.width)
        self.pos = nn.Parameter(torch.zeros(config.seq_len, config.width))
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_gpt(config: GPTConfig, seed: int = 0) -> GPT:
    """The model with weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return GPT(config)


def make_batch(config: GPTConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic ``(tokens, targets)`` of shape ``[batch_size, seq_len]``, drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(config.vocab_size, (config.batch_size, config.seq_len + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
