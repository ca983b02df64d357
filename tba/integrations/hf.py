"""Hugging Face ``transformers.Trainer`` with tba: each training forward's activations offloaded.

``TbaTrainer`` is a ``Trainer`` whose ``compute_loss_context_manager`` (the context the Trainer
enters around each micro-batch's forward in ``training_step``) also enters one reusable
:class:`tba.Offloader`. Backward, gradient accumulation, the optimizer and the scheduler stay the
Trainer's. The offloader is built at the first training forward with ``layers=model`` (the
decoder blocks are found through :func:`tba.find_layers`) and closed when ``train()`` returns;
evaluation runs under ``torch.no_grad()``, where nothing is saved, so the context is skipped there.

Usage::

    from tba.integrations.hf import TbaTrainer

    trainer = TbaTrainer(model=model, args=training_args, train_dataset=data,
                         tba_options={"directory": "/nvme/tba"})
    trainer.train()
    print(trainer.tba_stats)

For a ``Trainer`` subclass of your own, put :class:`TbaTrainerMixin` first in its bases.
``transformers`` is imported only when ``TbaTrainer`` is first used (``pip install 'tba-offload[hf]'``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from tba.config import OffloadConfig
from tba.errors import TbaConfigError
from tba.integrations import check_goal, integration_policy
from tba.runtime import Offloader, OffloadStats, resolve_layers

HF_EXTRA_HINT = "pip install 'tba-offload[hf]'"


class TbaTrainerMixin:
    """Adds tba to a ``transformers.Trainer`` subclass; list it before the Trainer in the bases.

    Args:
        tba_options: Keyword arguments for :class:`tba.Offloader` (``directory``, ``backend``,
            any :class:`tba.OffloadConfig` field); ``{}`` uses the defaults, None (default) turns
            tba off. ``layers`` defaults to the model, and ``policy`` to ``"offload"``, as in every
            integration (docs/policies.md); ``"adaptive"`` plans per block after profiling.
        *args, **kwargs: As for the Trainer.

    Attributes:
        offloader: The offloader while ``train()`` runs (None before and after).
        tba_stats: The offloader's :class:`tba.OffloadStats` once ``train()`` has returned.
    """

    def __init__(self, *args: Any, tba_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if tba_options is not None:  # refused here, not at the first step inside train()
            if not isinstance(tba_options, Mapping):
                raise TbaConfigError(f"tba_options must be a dict of tba.Offloader options ({{}} for the defaults, None "
                                     f"for off), got {type(tba_options).__name__}")
            resolve_layers(tba_options.get("layers"))
            config = tba_options.get("config")
            rest = {name: value for name, value in tba_options.items() if name not in ("layers", "config")}
            if config is None:  # the variables too (Note [A goal variable beside a policy that plans nothing])
                policy = integration_policy(tba_options)
                _trainer_goal(rest, policy, "policy" in tba_options)
                OffloadConfig.from_env(**{**rest, "policy": policy})
            elif not isinstance(config, OffloadConfig):  # refused at the first step's forward before (helper-125)
                raise TbaConfigError(f"tba_options' config must be a tba.OffloadConfig, got {type(config).__name__}")
            else:
                _trainer_goal(rest, integration_policy(tba_options), "policy" in tba_options)
                config.replace(**rest)
        super().__init__(*args, **kwargs)
        self.tba_options = tba_options
        self.offloader: Offloader | None = None
        self.tba_stats: OffloadStats | None = None

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        stack = super().compute_loss_context_manager()
        if self.tba_options is not None and torch.is_grad_enabled() and self.model.training:
            if self.offloader is None:
                policy = integration_policy(self.tba_options)  # Note [An integration's offload default and a given config]
                self.offloader = Offloader(**{"layers": self.model, **self.tba_options, "policy": policy})
            stack.enter_context(self.offloader)
        return stack

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            if self.offloader is not None:
                self.offloader.close()
                self.tba_stats = self.offloader.stats
                self.offloader = None


def _trainer_goal(options: Mapping[str, Any], policy: Any, policy_given: bool) -> None:
    """A goal in ``tba_options`` beside a policy that plans nothing, refused where the trainer is built."""
    check_goal(options, policy, policy_given=policy_given, owner="tba_options'",
               fix='add "policy": "adaptive" to tba_options')


def _trainer_class() -> type:
    try:
        import transformers
    except ImportError as err:
        raise ImportError(f"tba.integrations.hf.TbaTrainer needs transformers ({err}); {HF_EXTRA_HINT}") from err

    class TbaTrainer(TbaTrainerMixin, transformers.Trainer):
        """A ``transformers.Trainer`` that offloads each training forward's activations with tba
        (see :class:`TbaTrainerMixin` for ``tba_options``)."""

    TbaTrainer.__module__ = __name__
    return TbaTrainer


def __getattr__(name: str) -> Any:
    if name == "TbaTrainer":
        cls = _trainer_class()
        globals()["TbaTrainer"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["TbaTrainer", "TbaTrainerMixin"]  # noqa: F822 - TbaTrainer is built on first access (module __getattr__)
