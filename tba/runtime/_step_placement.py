"""What one step applies: the :class:`StepPlacement` a policy runner hands the offloader at entry
(``tba/runtime/_runner.py``), or mid-step when the input shape changes (``tba/runtime/_input_shapes.py``)."""

from __future__ import annotations

import dataclasses

from torch import nn

from tba.policy import Placement, Plan, holds_layers_through_forward

__all__ = ["StepPlacement", "placement_of"]


@dataclasses.dataclass(frozen=True)
class StepPlacement:
    """What the coming step applies: layers whose tensors stay in memory, and the prefetch window."""

    keep_layers: frozenset[int | None] | None = None
    """None: leave the offloader's ``keep_layers`` as they are (no placement policy)."""
    window_bytes: int | None = None
    """None: leave the window as it is."""
    layers: list[nn.Module] | None = None
    """Layers learned by the runner for an offloader given none (None: the offloader's own)."""
    write_caps: tuple[int, ...] | None = None
    """Per layer, the most offloaded bytes forward may hold unwritten (Note [A budget holds back
    forward's writes] in ``tba/policy/_model.py``); None: writes never hold forward back."""
    release_idle_reads: bool = False
    """Free the read buffers kept idle since the last backward before forward starts (Note [Idle read
    buffers and kept layers] in ``tba/policy/_memory.py``)."""
    keep_caps: tuple[int, ...] | None = None
    """Per layer, the most bytes a kept layer keeps in the step; past it, the layer offloads (what the layer saved
    in the profiled step its plan was made from: Note [A covered step keeps no more than the plan was made for] in
    ``tba/runtime/_input_shapes.py``); None: no limit (a pinned plan)."""


def placement_of(plan: Plan, layers: list[nn.Module] | None = None,
                 keep_caps: tuple[int, ...] | None = None) -> StepPlacement:
    """The placement that applies ``plan``; ``layers``: those learned by the runner, if any; ``keep_caps``:
    see :attr:`StepPlacement.keep_caps`."""
    return StepPlacement(frozenset(plan.layers(Placement.KEEP)), plan.window_bytes, layers,
                         plan.write_caps_bytes or None, holds_layers_through_forward(plan.decisions), keep_caps)
