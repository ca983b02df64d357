"""Objects remembered weakly, for hooks that must reach every live one (``os.register_at_fork``).

Plain weak references without callbacks: a ``WeakSet`` runs Python code when a member dies, where
an asynchronous exception would be swallowed (Note [Asynchronous exceptions] in
``tba/_control.py``). Dead references are pruned at the next :meth:`WeakRegistry.add`.

Note: [A registry that threads and the collector can share]
Objects are added from any thread: the training thread builds an offloader's read pool while the
control thread builds the empty one a closing store detaches to. The registry once pruned its dict in
place, so two threads deleted the same dead key (``KeyError``), and ``list(refs.items())`` raised
"dictionary changed size during iteration" when the cycle collector, run by an allocation inside
that copy, ran a finalizer that let another thread add (the fuzzer met the second 16 times in 33,000
cases, all with bare contexts; a stress test with four threads met the first within 3 s). Now the
dict is never changed once published: :meth:`WeakRegistry.add` (and :meth:`~WeakRegistry.value_for`
for an object not yet remembered) builds the next one under a lock and swaps it in; reads take
whichever is current without a lock, so a fork's child, whose lock another thread may have held, can
read it. A child that adds makes itself a fresh lock first. ``learned_for``
(``tba/runtime/_learned.py``) keeps each recomputed layer's knowledge in one such registry.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any


class WeakRegistry:
    """Live objects by identity, held weakly, each with an optional value (Note [A registry that threads
    and the collector can share])."""

    def __init__(self) -> None:
        self._refs: dict[int, tuple[weakref.ref, Any]] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def add(self, obj: Any) -> None:
        """Remember ``obj`` (weakly), forgetting the ones that died since."""
        with self._locked():
            self._publish(obj, None)

    def value_for(self, obj: Any, factory: Callable[[], Any]) -> Any:
        """The value remembered with ``obj``; the first call for it remembers ``factory()`` (without a lock
        when it is there already)."""
        found = self._refs.get(id(obj))
        if found is not None and found[0]() is obj:
            return found[1]
        with self._locked():
            found = self._refs.get(id(obj))
            if found is not None and found[0]() is obj:
                return found[1]
            value = factory()
            self._publish(obj, value)
        return value

    def alive(self) -> list[Any]:
        """The remembered objects still alive."""
        return [obj for obj in (ref() for ref, _ in self._refs.values()) if obj is not None]

    def _locked(self) -> threading.Lock:
        if self._pid != os.getpid():  # a fork's child: the parent's lock may be held for good
            self._lock, self._pid = threading.Lock(), os.getpid()
        return self._lock

    def _publish(self, obj: Any, value: Any) -> None:
        """Swap in a new dict: the live entries, and ``obj`` with ``value`` (the lock is held)."""
        refs = {key: entry for key, entry in self._refs.items() if entry[0]() is not None}
        refs[id(obj)] = (weakref.ref(obj), value)
        self._refs = refs

    def __repr__(self) -> str:
        return f"WeakRegistry(remembered={len(self._refs)})"
