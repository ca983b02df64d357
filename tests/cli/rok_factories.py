"""A user's own model for the ROK tests, named by file path in a fresh process."""

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.layers(x), y)


def make_model() -> nn.Module:
    return Net()


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(512, 64, generator=generator), torch.randn(512, 64, generator=generator)


def make_big_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Enough rows that keep-all's activations (about 30 MiB) are well above resident-set noise."""
    generator = torch.Generator().manual_seed(1)
    return torch.randn(4096, 64, generator=generator), torch.randn(4096, 64, generator=generator)


class Output(dict):
    """What a Hugging Face model returns: a dict whose ``loss`` is also an attribute."""

    def __getattr__(self, name):
        return self[name]


class HFStyleNet(Net):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Output:
        return Output(loss=super().forward(x, y), logits=x)


class NoLossNet(Net):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple:
        return (self.layers(x),)


def make_hf_style_model() -> nn.Module:
    return HFStyleNet()


def make_no_loss_model() -> nn.Module:
    return NoLossNet()
