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
dict is never changed once published: :meth:`WeakRegistry.add` builds the next one under a lock and
swaps it in, and :meth:`WeakRegistry.alive` reads whichever is current without a lock, so a fork's
child, whose lock another thread may have held, can read it. A child that adds makes itself a fresh
lock first.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any


class WeakRegistry:
    """Live objects by identity, held weakly (Note [A registry that threads and the collector can share])."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def add(self, obj: Any) -> None:
        """Remember ``obj`` (weakly), forgetting the ones that died since."""
        if self._pid != os.getpid():  # a fork's child: the parent's lock may be held for good
            self._lock, self._pid = threading.Lock(), os.getpid()
        with self._lock:
            refs = {key: ref for key, ref in self._refs.items() if ref() is not None}
            refs[id(obj)] = weakref.ref(obj)
            self._refs = refs

    def alive(self) -> list[Any]:
        """The remembered objects still alive."""
        return [obj for obj in (ref() for ref in self._refs.values()) if obj is not None]

    def __repr__(self) -> str:
        return f"WeakRegistry(remembered={len(self._refs)})"
