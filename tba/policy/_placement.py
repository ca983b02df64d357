"""The four placements of a layer, the vocabulary of plans and of the cost model.

Each layer's saved activations are kept in memory (``K``), offloaded to the spill file (``O``),
not saved and recomputed in backward (``R``), or recomputed with the layer's input offloaded
(``S``). :data:`SPILLED` and :data:`RECOMPUTED` group them by what they cost: the spilled ones
write :func:`spilled_bytes` during forward and read them back in backward (``s_i``, the layer's
saved bytes, for ``O``; ``x_i``, its input's, for ``S``), the recomputed ones run the layer's
forward again in backward. :func:`check_decisions` validates a plan's decisions against a model.
The cost model that prices a placement is ``tba/policy/_model.py``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from tba.errors import TbaConfigError, did_you_mean
from tba.policy._profile import LayerProfile


class Placement(str, enum.Enum):
    """Where one layer's saved activations live between its forward and its backward.

    A ``str`` enum: each member equals its name in plans, JSON files and logs (``"offload"``).
    """

    KEEP = "keep"
    """In memory, as without tba."""
    OFFLOAD = "offload"
    """Written to the spill file during forward, read back (prefetched) for backward."""
    RECOMPUTE = "recompute"
    """Not saved: the layer runs forward again in backward; only its input is kept, in memory."""
    OFFLOADED_RECOMPUTE = "offloaded_recompute"
    """Recomputed in backward, and its input is written to the spill file (read back, prefetched,
    for the recomputation): the layer holds nothing in memory between forward and backward."""

    def __str__(self) -> str:
        return self.value


KEEP, OFFLOAD, RECOMPUTE = Placement.KEEP, Placement.OFFLOAD, Placement.RECOMPUTE
OFFLOADED_RECOMPUTE = Placement.OFFLOADED_RECOMPUTE
DECISIONS = tuple(Placement)
SPILLED = frozenset({OFFLOAD, OFFLOADED_RECOMPUTE})
"""Placements that write to the spill file and read back in backward."""
RECOMPUTED = frozenset({RECOMPUTE, OFFLOADED_RECOMPUTE})
"""Placements that run the layer's forward again in backward."""


def holds_layers_through_forward(decisions: Sequence[str]) -> bool:
    """Whether a placement holds something of a layer in memory from its forward to its backward (``K`` or
    ``R``): its peak is then at backward's start, and tba frees its idle read buffers before forward (Note [Idle
    read buffers and kept layers] in ``tba/policy/_memory.py``)."""
    return any(decision in (KEEP, RECOMPUTE) for decision in decisions)


def spilled_bytes(layer: LayerProfile, decision: str) -> int:
    """Bytes ``decision`` writes for ``layer`` (and reads back): ``s_i`` for O, ``x_i`` for S, else 0."""
    if decision == OFFLOAD:
        return layer.saved_bytes
    return layer.input_bytes if decision == OFFLOADED_RECOMPUTE else 0


def check_decisions(decisions: Sequence[str], layer_count: int) -> tuple[str, ...]:
    """``decisions`` as a tuple, after checking its length and values.

    Raises:
        TbaConfigError: a length other than ``layer_count``, or a decision that is not a placement.
    """
    decisions = tuple(decisions)
    if len(decisions) != layer_count:
        raise TbaConfigError(f"a plan for {len(decisions)} layers cannot drive a model with {layer_count} layers")
    names = [p.value for p in Placement]
    for index, decision in enumerate(decisions):
        if decision not in names:
            raise TbaConfigError(f"unknown decision {decision!r} (layer {index}); {did_you_mean(decision, names)}"
                                 f"use one of {', '.join(names)}")
    return tuple(Placement(decision) for decision in decisions)
