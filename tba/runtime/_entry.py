"""One saved storage: what tba knows of it, and where its bytes are.

Each distinct storage autograd saves becomes one :class:`StorageEntry`, written once, whatever the number of its
views (:class:`~tba.runtime._views.SavedView`, in ``tba/runtime/_views.py``). An entry moves through these states::

    WRITING ──write ok──> ON_DISK ──(all views freed)──> DEAD
       │                    ↑ ↓ reads bring the bytes back into ``data`` and release them
       └──write failed──> KEPT (bytes stay in memory; the disk is not used)

``data`` holds the bytes in memory whenever they are resident: the original storage while its
write is in flight, or an aligned copy read back from the file. Whether resident bytes may be
dropped is the offloader's decision; the entry only carries the facts.

File layout: the storage's bytes sit at ``offset + phase_bytes`` in the spill file, where
``phase_bytes`` is the storage address modulo :data:`ALIGN_BYTES`. With that shift, every page of
the storage maps to one aligned block of the file, so the write can go straight from the storage's
own memory with ``O_DIRECT`` (no bounce copy), and a read lands in a buffer of the same phase.

Note: [One record, two builds]
:class:`StorageEntry` is made once per saved storage on the control thread, whose Python the forward waits
for (docs/host-cost.md, twenty-fifth pass). With the optional extension ``tba._record`` built (setup.py), it
is the C type of ``native/tba_record.c``: the same fields in the same order, the same defaults, the same
``expired()``, ``extent_bytes`` and ``describe()``, no copies, the storage's weak reference freed by its
deallocator; it is made by one call into C instead of the dataclass's 25-line ``__init__``. Setting a name that is
not a field raises there. Without the extension it is :class:`PyStorageEntry`, the dataclass below. The
dataclass is the one description of the fields: :func:`_configure` hands its names and defaults to the
extension, which refuses to be used when they differ from its own (a stale build): the dataclass then
serves, with one warning.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tba._outcome import Outcome
from tba.defaults import ALIGN_BYTES
from tba.io import round_up

try:
    from tba import _record
except ImportError:  # the optional extension was not built (setup.py)
    _record = None

if TYPE_CHECKING:
    from tba.device import Route

_EXPIRED = torch.UntypedStorage._expired
logger = logging.getLogger("tba")


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A ``uint8`` tensor over the whole of ``storage``, holding a reference to it.

    Note: [Holding a storage without releasing the GIL]
    The store holds each saved storage through such a tensor, made on the control thread once per
    storage. ``torch.empty((0,), dtype=torch.uint8).set_(storage)`` is two calls through torch's
    Python bindings, and each releases the GIL around its operator: when the training thread waits
    for the GIL at that moment, it takes it, and the control thread waits in turn, two hand-overs per
    save on a 2-core VM where each costs a futex wake and a context switch (docs/host-cost.md). For a
    CPU storage, the legacy constructor ``torch.ByteTensor(storage)`` builds the same tensor (offset
    0, one element per byte, the storage's own reference) with the same two operators called from
    C++, holding the GIL throughout, in 1 µs instead of 2. Other devices take the bindings.
    """
    if storage.device.type == "cpu":
        return torch.ByteTensor(storage)
    return torch.empty((0,), dtype=torch.uint8, device=storage.device).set_(storage)


class State(enum.Enum):
    WRITING = "writing"
    ON_DISK = "on_disk"
    KEPT = "kept"
    DEAD = "dead"


@dataclasses.dataclass(eq=False)
class PyStorageEntry:
    """Book-keeping of one offloaded storage. All mutation happens under the offloader's lock."""

    seq: int
    layer: int | None
    nbytes: int
    phase_bytes: int
    version: int
    cdata: int
    """A weak reference to the storage (``storage._weak_ref()``, what torch's ``StorageWeakRef`` holds),
    held by the entry itself and freed by its ``__del__``: one object less per saved storage for the
    cycle collector, whose full collections a step's thousands of long-lived objects trigger
    (docs/host-cost.md)."""
    data: torch.Tensor | None
    root: Callable[[], torch.Tensor | None] = lambda: None
    """A weak reference to the saved tensor's root (its ``_base``, else itself): only tensors of that view family,
    which share one version counter, share this entry (Note [One entry per version counter] in
    ``tba/runtime/_writes.py``)."""
    state: State = State.WRITING
    offset: int = -1
    live_views: int = 0
    """:class:`SavedView` objects of this storage that autograd still holds."""
    unpacked_views: set[int] | None = None
    """Identities of the live views unpacked in the current backward; None (no set made) while
    the entry has one live view, the common case."""
    hold_for_backward: bool = False
    """Keep the bytes in memory when the write completes: the prefetch window wants them soon."""
    fully_unpacked: bool = False
    """Every live view was unpacked: backward needs the bytes no more."""
    transfer_in_flight: bool = False
    io_error: BaseException | None = None
    read_done: Outcome | None = None
    """The read in flight (``tba/runtime/_reads.py``'s ``UNWATCHED`` until an unpack waits for it), else None."""
    device: torch.device = torch.device("cpu")
    route: Route | None = None
    ready_event: Any = None
    """Device event a consumer waits on before using ``data`` read back (None for host memory)."""
    checksum: int | None = None
    """CRC-32C of the bytes written (``verify=True``, host storages); None when not checked."""
    window_gen: int = -1
    """The prefetch window's walk generation that counts this entry against the budget (-1: none)."""
    address: int = 0
    """The storage's data pointer when it was saved (Note [A storage the program still holds is not read
    back] in ``tba/runtime/_reads.py``)."""
    pages_discarded: bool = False
    """The storage's pages were handed back to the kernel (they read as zeros now): it is never served
    live again, whoever still holds it (Note [A storage the program still holds is not read back])."""
    own_memory: bool = False
    """The storage's memory came from torch's own allocator and is not shared (Note [Whose pages tba may
    discard] in ``tba/runtime/_trim.py``): only then may its pages go back to the kernel early."""

    def expired(self) -> bool:
        """Whether the storage itself is gone."""
        return _EXPIRED(self.cdata)

    def __del__(self, _free: Any = torch.UntypedStorage._free_weak_ref) -> None:
        # ``_free`` is bound at definition: at interpreter shutdown module globals are cleared to None
        # before the last entries die. An entry whose ``__init__`` failed has no ``cdata``.
        cdata = getattr(self, "cdata", None)
        if cdata is not None:
            _free(cdata)

    def __copy__(self) -> PyStorageEntry:
        raise TypeError("a StorageEntry owns its storage's weak reference and cannot be copied")

    def __deepcopy__(self, memo: dict[int, Any]) -> PyStorageEntry:
        return self.__copy__()

    @property
    def extent_bytes(self) -> int:
        """Bytes of file space the entry occupies: the storage plus its phase, block aligned."""
        return round_up(self.phase_bytes + self.nbytes, ALIGN_BYTES)

    def describe(self) -> str:
        where = f"layer {self.layer}" if self.layer is not None else "no layer"
        return f"storage #{self.seq} ({self.nbytes} bytes, {where})"


def _configure(free_weak_ref: Callable[[int], None] = torch.UntypedStorage._free_weak_ref) -> None:
    """Hand ``tba._record`` the dataclass's fields and defaults (Note [One record, two builds]); ``free_weak_ref``
    is what its records call as they die (tests count the calls)."""
    fields = dataclasses.fields(PyStorageEntry)
    defaults = {field.name: field.default for field in fields if field.default is not dataclasses.MISSING}
    _record.configure(tuple(field.name for field in fields), defaults, free_weak_ref, _EXPIRED, ALIGN_BYTES)


def _native_record() -> Any:
    """The C record where ``tba._record`` is built for this dataclass, else None: a build that does not match it (a
    checkout updated without rebuilding) is not used, with one warning, and the dataclass serves."""
    if _record is None:
        return None
    try:
        _configure()
    except (RuntimeError, TypeError) as err:  # its fields differ; its configure takes other arguments
        logger.warning("tba: %s; tba uses its Python record meanwhile (python setup.py build_ext --inplace, or "
                       "reinstall tba)", err)
        return None
    return _record.StorageEntry


_NATIVE_RECORD = None if TYPE_CHECKING else _native_record()
NATIVE = _NATIVE_RECORD is not None
"""Whether :class:`StorageEntry` is the C record of ``tba._record``."""

if TYPE_CHECKING or _NATIVE_RECORD is None:
    StorageEntry = PyStorageEntry
else:
    StorageEntry = _NATIVE_RECORD
