"""Objects tba makes per saved tensor, kept out of CPython's cycle collector.

Note: [Objects the cycle collector need not see]
A step saves thousands of tensors, and each one that goes to disk leaves tba's objects alive from
forward to backward: the :class:`~tba.runtime._views.SavedView` autograd holds, its version watch,
the finalizer that hears of the view's death and the weak reference to the tensor's root. The cycle
collector walks every object it tracks that survives a young collection, and it runs a full
collection (every tracked object of the process, about 170,000 after ``import torch``) each time the
objects promoted since the last one reach a quarter of those that survived it. tba's survivors
brought a full collection every third step of the ``bench-hooks`` loop at 2000 storages of 64 KiB,
about 100 ms each, where the loop without tba ran none in sixteen steps (docs/host-cost.md,
sixteenth pass).

The collector is only needed for objects that can sit in a reference cycle; the others are freed by
their reference count the moment their last holder lets go. :func:`untrack` takes such objects out
of it (``native/tba_gc.c``). Each is given here because no cycle can pass through it:

* a ``SavedView`` refers to its entry, its watch, the tensor it keeps when its save failed, an error
  message and a dtype. No object tba reaches from these refers back to a view: the store, the
  routes and the engines keep entries and views' identities (numbers), never views; the finalizer
  refers to the view weakly. Autograd holds the view from its C++ graph, which the collector does not
  walk either way;
* a version watch is a tensor alias with no bytes, no ``grad_fn`` and no attributes: it refers to no
  Python object;
* a :class:`~tba.runtime._views.Kept` refers to one tensor and two numbers. The tensor is not always
  bare: pack keeps a leaf (a parameter) as itself, with its attributes and hooks, and the pair of a
  ``recompute`` layer (``tba/runtime/_recompute.py``) keeps a checkpointed layer's input as it is, with
  its ``grad_fn``. What makes a record safe is who refers to it: autograd's C++ graph, which the
  collector does not walk, and tba's own frames while pack or unpack runs. A cycle back to it from its
  tensor passes through the graph (a traceback kept from backward holds the loss too), which no collector
  frees, tracked or not; the same holds for a view's kept tensor;
* the view's finalizer (``_ViewDied``) is held by the control thread's table of pending finalizers
  (a module's global, so never garbage) until it fires, and dropped then; it refers to the
  offloader and the entry, which never refer to it;
* the weak reference to a tensor's root has no callback: it refers to nothing;
* the ``uint8`` tensor through which the store holds a storage until it is written (``entry.data``) has
  no ``grad_fn`` and no attributes: it refers to no Python object (unpack returns new tensors over its
  storage). Nor has the tensor over a read buffer that replaces it when the storage is read back
  (``_on_read_done`` in ``tba/runtime/_reads.py``): its storage keeps the buffer's lease token alive
  from C++, and the token refers to nothing. The prefetch window may read a storage back before
  backward starts, so both kinds of ``entry.data`` are seen between forward and backward;
* that lease token (``tba/io/_read_pool.py``) has one slot, its weak-reference list; and the
  finalizer that returns the buffer when the token dies (``_Returned``, which refers to the pool and
  the buffer, neither of which refers to it) is referred to only by the control thread's table of
  pending finalizers, as a view's finalizer is: no cycle can come back to either.

A finalizer (a weak reference with a callback) may be untracked only if its referent is untracked
too, as a view and a lease token are. When a collection finds a referent in cyclic garbage, CPython
moves each of its weak references that has a callback onto a list of callbacks to run, through the
reference's links in the collector's lists; an untracked reference has none, and the process died
with a segmentation fault in the collector when :func:`~tba._control.on_death`'s finalizers of
offloaders and layer maps were untracked. The weak reference to a root has no callback and is
never moved.

A tracked object they refer to stays tracked and is collected as before once they let it go. Without
the extension (no C compiler at install) :func:`untrack` does nothing: the same objects, collected
as before.
"""

from __future__ import annotations

from collections.abc import Callable

try:
    from tba._gc import untrack as _native_untrack
except ImportError:  # the optional extension was not built (setup.py)
    _native_untrack = None


def _track_all(*objects: object) -> None:
    """Without ``tba._gc``: every object stays with the cycle collector."""


untrack: Callable[..., None] = _native_untrack if _native_untrack is not None else _track_all
"""``untrack(*objects)``: take each object out of the cycle collector (Note [Objects the cycle collector need
not see]); only objects through which no reference cycle can pass may be given."""

NATIVE = _native_untrack is not None
"""Whether :func:`untrack` takes objects out of the collector (``tba._gc`` was built)."""
