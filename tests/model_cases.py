"""Small models whose saved tensors are awkward: views, in-place ops, shared storages; and the tiny GPT.

Shared by the CPU exactness tests and the CUDA suite.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tba.bench.models import PRESETS, make_batch, make_gpt


def tiny_gpt() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """The ``tiny`` preset's GPT and its forward over a fixed batch (the loss)."""
    config = PRESETS["tiny"]
    model = make_gpt(config)
    tokens, targets = make_batch(config)
    return model, lambda m: m(tokens, targets)


class ViewsModel(nn.Module):
    """Views, slices, transposes, expands and in-place ops on saved tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(48, 48))
        self.v = nn.Parameter(torch.randn(24))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w
        h.relu_()
        a, b = h[:, :24], h[:, 24:]
        y = a * self.v + b.t().t() * a
        z = h.t()[5:29] @ h[:, 3:27]
        s = h.view(-1, 8, 6).transpose(0, 1).contiguous().sigmoid()
        g = torch.gather(h, 1, torch.arange(48, device=x.device).repeat(x.shape[0], 1) % 7)
        e = self.v.expand(x.shape[0], 24) * h.narrow(1, 10, 24)
        w = torch.where(h > 0.5, h, h * 0.1)
        n = h.as_strided((10, 10), (96, 2), 3).exp()
        return y.sum() + z.tanh().sum() + s.sum() + g.pow(2).sum() + e.sum() + w.pow(3).sum() + n.sum()


class SharedStorage(nn.Module):
    """Same-shape views of one storage at different offsets, and one tensor saved by many ops."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(64))
        self.w2 = nn.Parameter(torch.randn(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buf = x.exp()
        first, second = buf[:, :64], buf[:, 64:]
        out = first * self.w1 + second * self.w2
        chunks = buf.chunk(4, dim=1)
        for chunk in chunks:
            out = out + (chunk * self.w1[:32]).sin().repeat(1, 2)
        return (out * buf[:, 32:96]).sum()


WIDTH = 128
"""The width of :class:`Block`."""


class Block(nn.Module):
    """A pre-norm MLP block with a residual, the unit of the compile tests' models."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
