"""The views of a saved storage that autograd holds, and the tensors kept in memory instead.

The unit of offloading is the *storage*, not the tensor (its entry is :class:`~tba.runtime._entry.StorageEntry`,
in ``tba/runtime/_entry.py``): autograd often saves several views of one buffer (a ``transpose`` here, a slice
there, the same activation for two ops). Each saved tensor becomes a small :class:`SavedView` that records how to
rebuild it from the storage bytes (dtype, shape, stride and offset in elements) and points at the entry; a tensor
that stays in memory is wrapped in a :class:`Kept`. See Note [Dedup by storage identity] in
``tba/runtime/_writes.py`` for how a storage is recognised.
"""

from __future__ import annotations

import operator

import torch

from tba._untrack import untrack
from tba.errors import TbaError, error_text
from tba.runtime._entry import StorageEntry

_CPU = torch.device("cpu")

_NO_BYTES = torch.empty(0, device=_CPU)
"""The version watch's data. On the CPU whatever the default device when tba is imported: made on a meta or CUDA
default device (``torch.set_default_device`` before ``import tba``), it could not be set as a CPU tensor's data,
and every pack of one failed."""


def version_watch(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor that shares ``tensor``'s version counter and holds none of its bytes.

    Note: [In-place after saving]
    Without hooks autograd compares the saved tensor's version counter at unpack with the one it
    recorded at save. A tensor returned by a pack hook is not checked by autograd, so tba records
    the version itself and checks it at unpack. Every alias of the storage that can change it in
    place without torch noticing at save (the tensor, its base, its other views, a ``detach()`` of
    any of them) shares one version counter, and the change counts whether or not the saved tensor
    is still alive at unpack: a forward that modified its activation in place and then dropped it
    gave wrong gradients when tba only looked at a weak reference to the tensor. So the check reads
    a *watch*: a detached alias of the tensor (which shares the counter) whose data is then replaced
    by an empty tensor (``set_data`` keeps the counter and does not bump it), so it holds no bytes of
    the storage tba offloads. A tensor tba keeps in memory is checked through the alias it keeps
    (:class:`Kept`). The alias comes from ``Tensor._make_subclass``, which calls ``detach`` from C++
    holding the GIL; ``tensor.detach()`` goes through the Python binding, which releases the GIL
    around the operator: one more point per saved tensor where the training thread hands the GIL to
    tba's threads and waits to get it back (Note [Holding a storage without releasing the GIL] in
    ``tba/runtime/_entry.py``).
    """
    watch = torch.Tensor._make_subclass(torch.Tensor, tensor)
    watch.data = _NO_BYTES
    return watch


def inplace_error(current: int, version: int, dtype: torch.dtype, size: tuple[int, ...]) -> RuntimeError:
    """Torch's in-place error for a saved tensor at version ``current`` that was saved at ``version``."""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{dtype} {list(size)}] is at version {current}; expected version {version} "
        "instead. Hint: the tensor was saved by tba's hooks; clone it before changing it in place, or "
        "change it after backward."
    )


class Kept:
    """What a pack hook returns for a tensor that stays in memory: the tensor, and its version at save.

    Unpack (:meth:`get`) raises torch's in-place error when the tensor changed in place since
    (Note [In-place after saving]); it shares the version counter of the saved tensor.

    Note: [Kept tensors are returned detached]
    Autograd keeps what pack returns with a strong reference from the node. When the saved
    tensor is the node's own output, the tensor itself would point back at the node
    (node -> tensor -> grad_fn -> node): a cycle that only the cycle collector frees, and a
    dropped loss would keep the whole graph, and every offloaded entry, alive. So ``Offloader.pack``
    keeps a detached alias, which has no grad_fn; autograd re-attaches the node (or the accumulator
    of a leaf) at unpack from the metadata it recorded at save. It shares the version counter, and
    it is kept with its version, checked at unpack: autograd checks none of what a pack hook returns.
    """

    __slots__ = ("tensor", "version", "layer")

    def __init__(self, tensor: torch.Tensor, version: int, layer: int | None = None) -> None:
        self.tensor = tensor
        self.version = version
        self.layer = layer
        """The layer whose forward saved it (Note [Backward through kept layers] in ``tba/runtime/_prefetch.py``)."""
        untrack(self)  # Note [Objects the cycle collector need not see] in tba/_untrack.py

    def get(self) -> torch.Tensor:
        """The kept tensor, after the version check."""
        tensor = self.tensor
        if tensor._version != self.version:
            raise inplace_error(tensor._version, self.version, tensor.dtype, tuple(tensor.shape))
        return tensor


class SavedView:
    """What the pack hook returns for an offloaded tensor: an entry plus the view's geometry.

    Dropping the last reference (autograd frees its saved tensors after backward) tells the
    offloader, which frees the file extent once no view of the entry is left. That message goes
    through :func:`tba._control.on_death`, registered by the offloader: a view has no ``__del__``
    (Note [Asynchronous exceptions] in ``tba/_control.py``).
    """

    __slots__ = ("entry", "kept", "error", "dtype", "size", "stride", "storage_offset", "watch", "version", "owner",
                 "__weakref__")

    def __init__(self, entry: StorageEntry | None, tensor: torch.Tensor, owner: int = -1) -> None:
        self.entry = entry
        """The storage's entry; None until the deferred save has run (or when it failed and ``kept`` is set)."""
        self.owner = owner
        """The serial number of the offloader whose pack made this view: only its unpack reads the entry (Note [A view
        is unpacked by its own offloader] in ``tba/runtime/_unpack_hooks.py``)."""
        self.kept: torch.Tensor | None = None
        """The tensor itself, when its save could not start and it stays in memory."""
        self.error: str | None = None
        """The message of the TbaError unpack raises: the deferred save found the storage too small (:meth:`uncovered`),
        or it failed and went up (:meth:`save_failed`)."""
        self.dtype = tensor.dtype
        self.size = tuple(tensor.shape)
        self.stride = tuple(tensor.stride())
        self.storage_offset = tensor.storage_offset()
        self.watch = watch = torch.Tensor._make_subclass(torch.Tensor, tensor)
        """Shares ``tensor``'s version counter and holds none of its bytes (Note [In-place after saving]): made as
        :func:`version_watch` makes it, inline, a Python call less per saved storage on the training thread."""
        watch.data = _NO_BYTES
        self.version = tensor._version
        untrack(self, watch)  # Note [Objects the cycle collector need not see] in tba/_untrack.py

    def keep(self, tensor: torch.Tensor) -> None:
        """Hold ``tensor`` itself instead of an entry (detached: Note [Kept tensors are returned detached])."""
        self.kept = tensor.detach() if tensor.grad_fn is not None else tensor

    def uncovered(self, storage: torch.UntypedStorage) -> str | None:
        """Why the deferred save cannot write ``storage`` (the one taken at pack) under the packed geometry, else None.

        Note: [A save writes the storage its tensor had at pack]
        The save runs after pack (Note [A save is deferred] in ``tba/runtime/_hooks.py``), and
        ``tensor.data = other`` in between bumps no version. The save wrote the storage the tensor had
        then, under the geometry recorded at pack: one too small was read past its end (NaN in
        backward), and a same-shaped one replaced an output's data, which autograd without tba keeps
        (it holds the output's old storage): wrong gradients, no error (helper-61, helper-62). So pack
        takes the storage itself (0.1 µs) and the save writes that one: backward gets the data the
        tensor had when it was saved, whatever its ``.data`` became (as torch's ``save_on_cpu`` does for a
        CUDA tensor, which it copies at pack; a CPU tensor it keeps as it is, and sees the new data).
        Megatron frees a pipeline stage's sent output that way (``deallocate_output_tensor`` swaps its
        ``.data`` for one element) and relies on it; a saved *input* swapped after its save is the case
        where autograd without hooks would use the new data (docs/api.md). Only a storage shrunk below
        the packed geometry before the save (``untyped_storage().resize_``, which no version sees) is not
        written: unpack raises a TbaError with this message. A message, not the error: raised, an error
        holds its traceback, whose frames hold the caller's locals (the loss, so the graph, so this view),
        a cycle through autograd's C++ node that the cycle collector cannot see (helper-62).
        """
        size, stride = self.size, self.stride
        # The last element's index is the offset plus the sum of (size - 1) * stride, taken here as two sums in C: a
        # Python loop over the dimensions ran once per saved storage on the control thread (docs/host-cost.md).
        last = self.storage_offset + sum(map(operator.mul, size, stride)) - sum(stride)
        if 0 in size or (last + 1) * self.dtype.itemsize <= storage.nbytes():
            return None
        return (f"a tensor saved for backward ({self.dtype} {list(self.size)}) had its storage resized below it "
                "between its save and tba's write of it; resize it after backward, or clone it before saving")

    def save_failed(self, error: BaseException) -> None:
        """Make unpack say that this tensor's save failed with ``error``, which goes up (a KeyboardInterrupt: Note [A save
        job that fails after the store saved] in ``tba/runtime/_hooks.py``). Its type and text, not the error itself,
        whose traceback's frames would hold the graph (Note [A save writes the storage its tensor had at pack])."""
        text = error_text(error)  # an error without text is named by its type
        cause = f"{type(error).__name__}: {text}" if text else type(error).__name__
        self.error = (f"cannot unpack a saved tensor ({self.dtype} {list(self.size)}): the save of this tensor failed "
                      f"({cause}); run forward again")

    def check_version(self) -> None:
        """Raise torch's in-place error when the saved tensor was modified in place after pack."""
        if self.watch._version != self.version:
            raise inplace_error(self.watch._version, self.version, self.dtype, self.size)

    def rebuild(self, data: torch.Tensor) -> torch.Tensor:
        """The saved tensor, as a view on ``data`` (a ``uint8`` tensor holding the storage bytes)."""
        itemsize = self.dtype.itemsize
        base_bytes = data.storage_offset()
        if base_bytes % itemsize:
            raise AssertionError(f"storage bytes at offset {base_bytes} are misaligned for {self.dtype}")
        # A host storage's shell names the CPU through a constant: building ``data.device`` cost 1.1 of 2.8 µs here.
        # Always named: an unpack called from Python (``grad_fn._saved_result``) inside ``with torch.device("meta"):``
        # made an unnamed one a meta tensor, which ``set_`` refused. Not ``data.new_empty``: an operator on ``data``
        # reads it for a stream-order checker (the simulated device's, torch's CUDA sanitizer).
        storage = data.untyped_storage()
        if storage.nbytes() < base_bytes + data.numel():
            # Note: [A storage shrunk after its save is refused at unpack]
            # Served from memory, ``data`` aliases the program's own storage. One the program shrank after the save
            # (``untyped_storage().resize_``) no longer holds the saved bytes, and ``set_`` below grows a resizable
            # storage to fit the view instead of refusing it: backward got the first bytes and then whatever the new
            # allocation held, with no error, where torch alone refuses the shrunken tensor at backward.
            raise TbaError(f"a tensor saved for backward ({self.dtype} {list(self.size)}) had its storage resized "
                           f"below it after it was saved ({storage.nbytes()} bytes left of {data.numel()}); resize it "
                           "after backward, or clone it before saving")
        out = (torch.empty(0, dtype=self.dtype, device=_CPU) if data.is_cpu
               else torch.empty((0,), dtype=self.dtype, device=data.device))
        out.set_(storage, base_bytes // itemsize + self.storage_offset, self.size, self.stride)
        # Note: [An unpacked tensor shares the saved tensor's version counter]
        # Without hooks, what autograd unpacks shares the saved tensor's version counter, so a backward that
        # changes it in place (a custom Function's ``x.mul_(2)`` on its ``ctx.saved_tensors``) makes every later
        # unpack of that tensor, or of any view of it, raise torch's in-place error. A tensor rebuilt by ``set_``
        # has a counter of its own: the change went unseen, and the other nodes that saved the same storage got
        # its changed bytes, which dedup shares (wrong gradients, no error: helper-95). So the tensor returned
        # is an alias of the watch, which shares the saved tensor's counter, given the rebuilt tensor's data:
        # ``set_data`` keeps the receiver's counter and bumps nothing, and neither it nor ``_make_subclass``
        # is an operator that a dispatch mode (a stream-order checker) sees as a read of the bytes.
        tensor = torch.Tensor._make_subclass(torch.Tensor, self.watch)
        tensor.data = out
        return tensor
