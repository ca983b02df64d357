"""What the tests of saves that fail half way share (tests/runtime/test_write_not_queued.py, test_save_job_fails.py):
a small model, its gradients without tba, and tba's log read as text."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from tba.errors import TbaError


def model_and_input() -> tuple[nn.Module, torch.Tensor]:
    """Four Linear+Tanh blocks of width 64 (a Tanh's output is saved twice: by it and the next Linear) and a batch."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)))
    return model, torch.randn(32, 64)


def gradients_without_tba() -> list[torch.Tensor]:
    """The parameters' gradients of one step of :func:`model_and_input` without tba."""
    model, x = model_and_input()
    model(x).square().sum().backward()
    return [p.grad for p in model.parameters()]


class LogLines(logging.Handler):
    """tba's log as text, formatted at once: no record is kept (pytest's handlers keep each one, and with it the
    traceback of a failed job, whose frames hold the saved tensor and, through its grad_fn, the graph)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def backward_after_failed_save(loss: torch.Tensor, model: nn.Module, error: type[BaseException]) -> list[torch.Tensor] | None:
    """Backward of a step one of whose saves failed with ``error``: the gradients, or None for a KeyboardInterrupt,
    whose save was undone and whose backward must raise the TbaError saying that this tensor's save failed, and why
    (not that the process was forked: it was not)."""
    if error is KeyboardInterrupt:
        # The whole message, anchored: it says why this tensor's save failed, not that the process was forked.
        with pytest.raises(TbaError, match=r"^cannot unpack a saved tensor \([^)]*\): the save of this tensor failed "
                                           r"\(KeyboardInterrupt: a test fails[^)]*\); run forward again$"):
            loss.backward()
        return None
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]
