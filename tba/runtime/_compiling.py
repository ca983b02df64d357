"""Whether the calling code is being compiled: :func:`torch.compiler.is_compiling` for the calling thread alone.

Note: [Another thread's compile is not this thread's]
torch holds the flag :func:`torch.compiler.is_compiling` reads True for the whole of a compile session
(``torch.compiler._compile_session_context``: Dynamo's tracing, AOTAutograd, the backend), so that code the session runs
without tracing it sees it; the flag is one for the process. While one thread compiled (a block's first call, a
recompile), tba's code in every other thread took itself for traced: a training thread's unpack hook raised the
compiled-autograd TbaError in backward, its layer discovery and its global module hooks did nothing (no repeated
blocks), the profiling timer measured no layer, and the layer tracker took its layers for ones inside a whole-model
graph. :func:`compiling` asks the flag first (False in eager code, at no cost); traced by Dynamo,
:func:`torch.compiler.is_dynamo_compiling` is the constant True; run eagerly while the flag is up, it is this thread's
compile only where this thread holds Dynamo's compile lock, under which every compile session runs, or where no thread
holds it (the flag raised by something else, an export).
"""

from __future__ import annotations

import sys

import torch

__all__ = ["compiling"]

_is_compiling = torch.compiler.is_compiling
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling


def compiling() -> bool:
    """:func:`torch.compiler.is_compiling` for the calling thread alone (Note [Another thread's compile is not this
    thread's])."""
    if not _is_compiling():
        return False
    return _is_dynamo_compiling() or _compiling_here()


def _compiling_here() -> bool:
    """Eagerly, while torch's compiling flag is up: whether the compile is this thread's (or not Dynamo's)."""
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    lock = getattr(convert_frame, "compile_lock", None)
    if lock is None or not hasattr(lock, "_is_owned"):
        return True
    if lock._is_owned():
        return True
    if lock.acquire(blocking=False):  # no thread compiles under Dynamo's lock: the flag is not another's compile
        lock.release()
        return True
    return False
