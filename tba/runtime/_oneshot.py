"""The one-shot context, :func:`offload_activations`: a new :class:`~tba.runtime._offloader.Offloader` per step.

Each call builds an offloader that closes itself once backward has released every saved tensor;
its spill file, engine and read buffers come from (and go back to) the per-directory runtime
(``tba/runtime/_shared.py``), and its placement policy's runner is shared with the contexts of
the other steps (``tba/runtime/_runner.py``), so that successive steps profile once and follow one
plan.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from torch import nn

from tba.config import OffloadConfig, options_doc, signature_with_options
from tba.runtime._offloader import Offloader


def offload_activations(directory: str | os.PathLike | None = None, *,
                        layers: nn.Module | Sequence[nn.Module] | None = None,
                        config: OffloadConfig | None = None, **options: Any) -> Offloader:
    """Offload the activations autograd saves inside the ``with`` block to files in ``directory``.

    Typical use: ``with tba.offload_activations(): loss = model(batch)``, then ``loss.backward()``.

    Args:
        directory: Where the spill file lives. None (default): ``$TBA_DIR``, else the system temp
            directory. Created with its parents if missing (logged at DEBUG); the command line refuses a missing one.
        layers: The model's repeated blocks (a list of modules), or a module to search for them.
            None (default): found during the first forward. Used to tag storages for prefetch and
            for placement policies; their parameters and buffers are never written.
        config: A :class:`tba.OffloadConfig`; keywords given here override its fields.
        **options: Any field of :class:`tba.OffloadConfig` (each also read from ``TBA_<NAME>``, ``TBA_DIR`` for ``directory``):
{options}

    The returned offloader is one-shot: it closes its file once backward has released every
    saved tensor. To reuse one file across steps, build :class:`tba.Offloader` once and enter it
    every step.

    Returns:
        The :class:`Offloader`; use it as a context manager and read ``.stats`` after backward.

    Raises:
        TbaConfigError: for an unknown option or an invalid value (at this line), or at the
            ``with`` line for a directory that cannot be created or written.
    """
    return Offloader(directory, layers=layers, config=config, _reusable=False, **options)


offload_activations.__doc__ = offload_activations.__doc__.format(options=options_doc(indent=12))
offload_activations.__signature__ = signature_with_options(offload_activations)  # type: ignore[attr-defined]
