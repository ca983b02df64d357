"""How many tba ``with`` blocks this thread has entered: what the profiled steps read around each layer's forward.

Note: [A layer that enters a tba block is not recomputed]
A layer whose forward enters a tba block of its own (``with tba.offload_activations(...)`` around part of a block,
nested in the step's block) runs as planned when kept or offloaded. Recomputed, its forward runs inside torch's
non-reentrant checkpoint, where an entry is refused (Note [A block inside a user's non-reentrant checkpoint] in
``tba/runtime/_pairs.py``): the adaptive default planned to recompute such a layer, and the first step that
followed the plan raised, a step after profiled steps that had all run. Each entry that succeeds counts here, per
thread; the profiled steps read the count before and after each layer's forward, and a layer whose forward changed it
is marked not recomputable (``tba/runtime/_timer.py``), as one that changes its input is. A plan that pins
``recompute`` on such a layer raises at that entry, naming the layer (:func:`tba.runtime._pairs.context_below`).
"""

from __future__ import annotations

import threading


class _Entries(threading.local):
    """This thread's count of entered blocks (a class default: a thread that entered none reads 0)."""

    count = 0


_entries = _Entries()


def note_entered() -> None:
    """Count one block entered on this thread."""
    _entries.count += 1


def entered() -> int:
    """How many blocks this thread has entered so far."""
    return _entries.count
