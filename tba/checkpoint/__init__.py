"""Checkpoints of model and optimizer state through DCP, written by tba's engine.

``TbaStorageWriter`` / ``TbaStorageReader`` plug into ``torch.distributed.checkpoint``
(``dcp.save``, ``dcp.async_save``, ``dcp.load``) and keep DCP's file format, so DCP's own
``FileSystemReader`` loads what they write. ``save_lazy`` takes a checkpoint the way
DataStates-LLM does: it returns at once, copies the tensors to host memory while the next forward
and backward run, and writes them to disk with O_DIRECT while training goes on; only the next
optimizer step waits, and only for what is not yet copied.
"""

from tba.checkpoint._io import DEFAULT_CHUNK_BYTES, DEFAULT_QUEUE_DEPTH, ImagePool, TbaCheckpointError
from tba.checkpoint._lazy import LazyCheckpoint, LazyCheckpointer, save_lazy
from tba.checkpoint._reader import TbaStorageReader
from tba.checkpoint._state import load, state_dict
from tba.checkpoint._writer import TbaStorageWriter

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_QUEUE_DEPTH",
    "ImagePool",
    "LazyCheckpoint",
    "LazyCheckpointer",
    "TbaCheckpointError",
    "TbaStorageReader",
    "TbaStorageWriter",
    "load",
    "save_lazy",
    "state_dict",
]
