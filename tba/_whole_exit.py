"""A context manager's ``__exit__`` that an asynchronous exception cannot skip.

Note: [An exit that always runs]
CPython runs pending signal handlers when a Python frame starts, before its first line. A
handler's exception (Ctrl-C, a user's timer) that arrives as ``with`` calls a Python ``__exit__``
is raised there: the exit's body never runs. For :class:`tba.Offloader` that left its saved-tensor
hooks pushed on the thread and the offloader active for good, holding its spill file, its engine
(an io_uring descriptor) and every later step's saved tensors; the randomised signal test
(``tests/runtime/test_async_exceptions.py``) hit it about once in a hundred runs. No line of Python
can close that gap, since the gap is before the first line.

So the offloader's ``__exit__`` is a :class:`WholeExit` descriptor. Reading ``offloader.__exit__``
(``with`` reads it before calling ``__enter__``) returns the C function
``tba._shield.exit_block`` with its first arguments bound (``functools.partial``, also C). The
exit then runs no Python frame on the calling thread: it pops the hooks (a C call of torch's),
queues the exit job for the control thread (a C queue put, on the queue of the control thread
running then: a block entered before ``os.fork()`` exits in the child through the child's), and
waits for the job's reply; a handler's exception raised while it waits is raised once the job has
run (``native/tba_shield.c``). Read from the class (``type(cm).__exit__``, as ``contextlib.ExitStack``
does) it is the plain Python exit, as it also is without the extension. The C exit calls the
Python one where the control thread cannot take the job when the block ends (the caller is the
control thread itself, finalizing a generator suspended in a block, or it has stopped at
interpreter exit): that one runs the job inline.

What is left open: a block left through ``contextlib.ExitStack`` (whose own exit is Python), and
a second handler's exception while an entry that failed is being undone.

Note: [A block's hooks come off only on its thread]
Saved-tensor hooks are a stack per thread. An exit called on another thread than the one that
entered the block (``off.__exit__`` called by hand from a worker, an ``ExitStack`` closed there, a
generator suspended in the block and finalized by a collection another thread runs) popped the pair
on top of *that* thread's stack, whoever had pushed it: another context's there (``save_on_cpu``,
another offloader) stopped seeing its saves, and its own exit then popped a pair not its own, or
torch's assertion on an empty stack. So the entry records its thread (``entered``, a one-item list
the offloader keeps, which the exit reads) and only an exit on that thread pops, once: the first exit
sets it to 0, and a second exit, on any thread, pops nothing either. An exit elsewhere still runs the
exit job (the offloader is closed or made idle as usual, nothing leaks); the entering thread keeps
the pair, and what it saves later stays in memory with one warning (Note [Hooks left installed after their
block] in ``tba/runtime/_keep.py``). Such an exit is always the Python one (the C exit hands it over), which
notes the entering thread as one whose block was ended elsewhere: that thread's own exit, when it comes, pops
its pair if it is on top and ends nothing more. It ended the block another thread had entered since on a
reusable offloader (helper-132: thread A's late exit closed thread C's block). That exit elsewhere also sets
``entered`` to 0, so that the entering thread's own exit is the Python one too, wherever it comes: the C exit,
which sees no note, popped A's pair and left A noted, and A's later exit of C's block was then taken for A's late
exit and ended nothing (helper-137). The note holds the entering thread itself, not its identity alone, which the
system hands to a new thread once it has ended (:func:`is_calling_thread`).
"""

from __future__ import annotations

import functools
import queue
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

from tba import _control

try:
    from tba._shield import exit_block
except ImportError:  # the optional extension was not built (setup.py)
    exit_block = None


class WholeExit:
    """``__exit__`` of a context manager whose exit is ``pop()`` then ``job(failed)`` on the control thread.

    Args:
        python_exit: The same exit in Python: the class's ``__exit__`` and the fallback.
        pop: Called first, on the exiting thread, with no arguments (a C function, to be whole).
        top: ``top(True)`` is the pair on top of the thread's stack, or None (a C function): ``pop``
            is not called on an empty stack.
        job: The name of the instance's method that runs on the control thread with one argument:
            whether the block raised.
        entered: The name of the instance's one-item list that holds the identity of the thread that
            entered the block, 0 once it was exited (Note [A block's hooks come off only on its thread]).
    """

    def __init__(self, python_exit: Callable[..., Any], pop: Callable[[], Any], top: Callable[[bool], Any],
                 job: str, entered: str) -> None:
        self.python_exit = python_exit
        self.pop = pop
        self.top = top
        self.job = job
        self.entered = entered
        functools.update_wrapper(self, python_exit)  # type: ignore[arg-type]

    def __get__(self, obj: object, owner: type | None = None) -> Callable[..., Any]:
        if obj is None:
            return self.python_exit
        method = types.MethodType(self.python_exit, obj)
        if exit_block is None:
            return method
        return functools.partial(exit_block, self.pop, self.top, _control, queue.SimpleQueue(), getattr(obj, self.job),
                                 method, getattr(obj, self.entered))


def pop_own(entered: list[int], pop: Callable[[], Any], top: Callable[[bool], Any]) -> None:
    """``pop()`` where the calling thread is ``entered[0]`` and the stack is not empty, once (``pop_own`` in
    native/tba_shield.c; Note [A block's hooks come off only on its thread])."""
    if entered[0] == 0 or entered[0] != threading.get_ident():
        return
    entered[0] = 0
    if top(True) is not None:
        pop()


def is_calling_thread(thread: threading.Thread | None) -> bool:
    """Whether ``thread`` (one noted by an exit elsewhere) is the calling thread itself, not a new one given its identity.

    A thread ``threading`` made is its own object for good. A thread it did not make (a C library's,
    ``_thread.start_new_thread``'s) is a ``_DummyThread``, which Python 3.11 keeps under its identity after it ends and
    hands to the next thread given that identity, alive by ``is_alive``: its native id, the kernel's, tells the two
    apart (helper-141: a new such thread ending a block by hand was taken for the dead one's late exit and ended
    nothing). The kernel hands a native id out again only after cycling through every other.
    """
    if thread is not threading.current_thread():
        return False
    return not isinstance(thread, threading._DummyThread) or thread.native_id == threading.get_native_id()


def still_runs(thread: weakref.ref[threading.Thread]) -> bool:
    """Whether the thread a weak reference names still runs (an entering thread noted by an exit elsewhere)."""
    held = thread()
    return held is not None and held.is_alive()
