"""One step at a time on a shared runner: which entry holds a :class:`~tba.runtime._runner.PolicyRunner`'s
per-step state, and which thread's model its learned layers are.

:class:`OneStepAtATime` is a base of the runner. An entry claims the step (``_claim_step``) unless
another step holds it, the runner has layers wrapped for recomputation, or the learned layers belong
to a model another live thread trains; a refused entry offloads everything and its exit leaves the
runner alone (``_release_step`` tells which exit is the holder's).
"""

from __future__ import annotations

import threading
import weakref

# Note: [A runner shared by contexts at once]
# One-shot contexts on one directory share a runner, and contexts in two threads can be inside
# their steps at once. The runner's per-step state (the wrapped forwards of the recomputed layers,
# the shape hook, the profiled step's layer timer) is one slot: a second entry that planned without
# recomputation set it to None and the first step's wrappers stayed on its model's blocks for good
# (a review found them after both steps had ended). So while one step holds that state (from its
# entry to its exit: ``OneStepAtATime._owner``), another entry offloads everything, as a step with a new input
# shape does: exact, the least memory; it finds layers of its own (a learning runner's bypassed
# entry is handed no layers) and its exit leaves the runner alone. A bypass used to be made only
# while layers were wrapped: an entry during another thread's profiled step (two models trained in
# two threads on one directory) started the timer and the shape hook again on the *other* model's
# blocks and its exit took them off mid-forward there, whose module then called a hook registered
# with keyword arguments without them (a TypeError out of the other thread's forward, a review
# found it), or its exit asked for that model after the other thread had freed it (a TbaError
# saying the model no longer exists). Between the other thread's steps the same happened whenever
# this thread's step took the runner: a learning runner's layers were found by one thread's
# forward, and hooks put on them for another thread's step fire in, and come off during, the
# first thread's forward. So an entry from another thread than the one that found the layers is
# bypassed too while that thread lives (``OneStepAtATime._learned_elsewhere``); once it has ended, the runner
# serves the thread that enters (training moved to a new thread). A model trained in turn by two
# live threads therefore offloads everything in the second one's steps: exact, unplanned.


class OneStepAtATime:
    """Mixin of :class:`~tba.runtime._runner.PolicyRunner` (Note [A runner shared by contexts at once])."""

    def __init__(self) -> None:
        self._owner: object | None = None
        """The entry whose step holds the per-step state; None between steps."""
        self._owner_thread: int | None = None
        """The training thread of that entry."""
        self._learner: weakref.ref[threading.Thread] | None = None
        """The training thread whose step found the learned layers: its object, not its identity, which a
        thread started after it has ended may be given again."""

    learns: bool
    _layer_refs: list

    def _claim_step(self, owner: object | None, thread: int | None, busy: bool) -> bool:
        """Whether the entry ``owner`` (of ``thread``) takes the coming step; ``busy``: the runner's state is
        held otherwise (layers wrapped for recomputation)."""
        if self._owner is not None or busy or self._learned_elsewhere(thread):
            return False
        self._owner, self._owner_thread = object() if owner is None else owner, thread
        return True

    def _release_step(self, owner: object | None = None) -> bool:
        """Let go of the step when ``owner`` holds it (None: whoever does); whether it did."""
        if owner is not None and owner is not self._owner:
            return False
        self._owner = None
        return True

    def _learned_in_this_step(self) -> None:
        """The layers just learned were found by this step's thread."""
        learner = next((alive for alive in threading.enumerate() if alive.ident == self._owner_thread), None)
        self._learner = weakref.ref(learner) if learner is not None else None

    def _learned_elsewhere(self, thread: int | None) -> bool:
        """Whether the learned layers are those of a model that another live thread trains."""
        learner = self._learner() if self._learner is not None else None
        if not self.learns or learner is None or thread is None or not self._layer_refs:
            return False
        if learner.is_alive():
            return learner.ident != thread
        self._learner = None  # that thread has ended: the model may be trained on here
        return False
