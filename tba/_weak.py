"""Objects remembered weakly, for hooks that must reach every live one (``os.register_at_fork``).

Plain weak references without callbacks: a ``WeakSet`` runs Python code when a member dies, where
an asynchronous exception would be swallowed (Note [Asynchronous exceptions] in
``tba/_control.py``). Dead references are pruned at the next :meth:`WeakRegistry.add`.
"""

from __future__ import annotations

import weakref
from typing import Any


class WeakRegistry:
    """Live objects by identity, held weakly."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def add(self, obj: Any) -> None:
        """Remember ``obj`` (weakly), forgetting the ones that died since."""
        for key, ref in list(self._refs.items()):
            if ref() is None:
                del self._refs[key]
        self._refs[id(obj)] = weakref.ref(obj)

    def alive(self) -> list[Any]:
        """The remembered objects still alive."""
        return [obj for obj in (ref() for ref in list(self._refs.values())) if obj is not None]
