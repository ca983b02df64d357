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
"""

from __future__ import annotations

import functools
import queue
import types
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
    """

    def __init__(self, python_exit: Callable[..., Any], pop: Callable[[], Any], top: Callable[[bool], Any],
                 job: str) -> None:
        self.python_exit = python_exit
        self.pop = pop
        self.top = top
        self.job = job
        functools.update_wrapper(self, python_exit)  # type: ignore[arg-type]

    def __get__(self, obj: object, owner: type | None = None) -> Callable[..., Any]:
        if obj is None:
            return self.python_exit
        method = types.MethodType(self.python_exit, obj)
        if exit_block is None:
            return method
        return functools.partial(exit_block, self.pop, self.top, _control, queue.SimpleQueue(), getattr(obj, self.job),
                                 method)
