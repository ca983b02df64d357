"""Randomized differential test: exotic flavours of saved tensors, with tba against without it.

Each case builds one activation storage ``h`` from a leaf (float32/64, float16, bfloat16 or complex)
and reaches it through several flavours at once: slices with a storage offset, transposes and
permutations, channels_last and channels_last_3d views, stride-0 expansions, overlapping
``as_strided`` views, 0-dim and zero-size views, the conj and neg bits, ``view_as_real``, and
dtype-reinterpreting views of a detached alias. Beside it come storages of their own: bool and
integer tensors, float8 (e4m3fn, e5m2), numpy memory (writable, read-only, unaligned), sparse COO
and CSR, quantized, and a ``__torch_function__`` subclass sharing ``h``'s storage (a nested tensor
is left out: torch's own ``Function.apply`` rejects one, 'NestedTensorImpl doesn't support sizes').
Half of them are saved by a custom Function (``save_for_backward``), the differentiable ones also
by ``conv2d``/``conv3d`` (channels_last inputs), ``mm`` or ``mul``. Backward logs every tensor the
Function unpacks (type, dtype, layout, shape, strides, offset, lazy bits, memory format and bytes);
loss, gradients, log and the program's own tensors after backward must match bit for bit. Some
cases change a saved tensor in place after forward: then both runs must raise (torch's in-place
error, or a TbaError). Writes finish before backward or race it; the program holds its tensors
through backward (served live) or drops them (read back). ``TBA_FLAVOUR_CASES`` sets the number of
cases (seeded by ``TBA_FLAVOUR_SEED``; the seed and case are in each failure's message).

``tensor.data = other`` between a save and tba's deferred write of it is checked on its own, last: the
oracle there is torch's result or a TbaError.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch.nn import functional as F
from utils import SaveSum

import tba
from tba.errors import TbaError

CASES = int(os.environ.get("TBA_FLAVOUR_CASES", "64"))
SEED = int(os.environ.get("TBA_FLAVOUR_SEED", "62"))
N = 1024

_LOG: list = []
STATS: list = []


class Save(torch.autograd.Function):
    """Saves its extra arguments for backward, where it logs them; the gradient of ``x`` passes through."""

    @staticmethod
    def forward(ctx, x, *extra):
        ctx.save_for_backward(*extra)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _LOG.extend(describe(t) for t in ctx.saved_tensors)
        return (grad,) + (None,) * len(ctx.saved_tensors)


class Sub(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as bytes (NaN-safe for torch.equal), whatever its flavour."""
    t = t.as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t
    if t.is_nested:
        return torch.cat([bits(piece) for piece in t.unbind()])
    if t.is_quantized:
        return torch.cat([bits(t.int_repr()), bits(torch.tensor([t.q_scale(), float(t.q_zero_point())]))])
    if t.layout is not torch.strided:
        return bits(t.to_dense())
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).clone()


def describe(t: torch.Tensor) -> tuple:
    geometry = None
    if t.layout is torch.strided and not t.is_nested:
        formats = {4: torch.channels_last, 5: torch.channels_last_3d}
        geometry = (tuple(t.shape), t.stride(), t.storage_offset(),
                    t.dim() in formats and t.is_contiguous(memory_format=formats[t.dim()]))
    return (type(t).__name__, t.dtype, t.layout, t.is_nested, geometry,
            t.is_conj(), t.is_neg(), bits(t))


def views(h: torch.Tensor, rng: random.Random) -> list[torch.Tensor]:
    """Differentiable flavours of the one storage ``h`` (1-D, ``N`` elements)."""
    a = rng.randrange(1, 64)
    out = [
        h[a:a + rng.randrange(0, 300)], h[a::rng.randrange(2, 5)], h[:12 * 40].view(12, 40).t()[3:],
        h[a:a + 120].view(2, 3, 4, 5).permute(*rng.sample(range(4), 4)),
        h[a:a + 120].view(2, 4, 5, 3).permute(0, 3, 1, 2),
        h[a:a + 240].view(2, 4, 5, 2, 3).permute(0, 4, 1, 2, 3),
        h[a:a + 5].view(5, 1).expand(5, 7), h[a].expand(3, 4),
        h.as_strided((8, 8), (1, 1), a), h.as_strided((6, 6), (2, 3), a), h[a], h[a:a], h.as_strided((0, 3), (3, 1), a),
    ]
    if h.is_complex():
        out += [h[a:].conj(), h.conj()[::3], torch.view_as_real(h[a:a + 40]), h.imag[a:], torch._neg_view(h.real[a:])]
    else:
        out += [torch._neg_view(h[a:a + 50])]
    return out


def others(h: torch.Tensor, rng: random.Random) -> list[torch.Tensor]:
    """Non-differentiable flavours: aliases of ``h``'s storage of other dtypes, and storages of their own."""
    d = h.detach()
    r = d.real if d.is_complex() else d
    a = rng.randrange(1, 64)
    array = np.random.RandomState(rng.randrange(1 << 16)).randn(N).astype(np.float32)
    frozen = array.copy()
    frozen.setflags(write=False)
    unaligned = np.frombuffer(array.tobytes() + b"\0", dtype=np.uint8)[1:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = [
            d.view(torch.uint8)[a:], d.view(torch.int16)[::3], d.as_subclass(Sub)[a:],
            r > 0, (r * 10).long()[a:], (r * 10).to(torch.int8),
            r.float().to(torch.float8_e4m3fn), r.float().to(torch.float8_e5m2)[a:],
            torch.from_numpy(array)[a:], torch.from_numpy(frozen).view(32, 32).t(), torch.from_numpy(unaligned)[a:],
            r[:1024].reshape(32, 32).relu().to_sparse(), r[:1024].reshape(32, 32).relu().to_sparse_csr(),
            torch.quantize_per_tensor(r.float(), 0.1, 3, torch.quint8),
            torch.tensor(3.5, dtype=h.dtype), torch.empty(0, 3, dtype=h.dtype).t(),
        ]
    return out


DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128)


def run_case(seed: int, directory: str | None, inplace: bool):
    """Loss, gradient, backward's log and the program's tensors after backward; or the error class."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dtype, verify, hold, flush = rng.choice(DTYPES), rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.7
    leaf = torch.randn(N, dtype=torch.float64, generator=gen, requires_grad=True)
    weights = {d: torch.randn((3, 3) + (2,) * (d - 2), dtype=torch.float64, generator=gen).to(dtype).requires_grad_()
               for d in (2, 4, 5)}
    _LOG.clear()

    def use(t: torch.Tensor) -> torch.Tensor:
        """``t`` through an operator that saves it: conv2d/conv3d (channels_last), mm, or mul."""
        if t.dim() in (4, 5) and t.shape[1] == 3 and dtype in (torch.float32, torch.float64) and rng.random() < 0.7:
            return (F.conv2d if t.dim() == 4 else F.conv3d)(t, weights[t.dim()]).sum().double()
        if t.dim() == 2 and t.shape[0] >= 3 and dtype in (torch.float32, torch.float64) and rng.random() < 0.5:
            return (weights[2] @ t[:3]).sum().double()
        return (t * t).real.sum().double()

    def forward():
        h = leaf.to(dtype) * 1.5
        made = rng.sample(views(h, rng), rng.randrange(2, 8)) + rng.sample(others(h, rng), rng.randrange(1, 6))
        saved, used = [], []
        for t in made:
            (used if t.requires_grad and rng.random() < 0.5 else saved).append(t)
        out = Save.apply(h, *saved).real.sum().double()
        for t in used:
            out = out + use(t)
        return out, h, made

    try:
        if directory is None:
            loss, h, made = forward()
        else:
            with tba.offload_activations(directory=directory, min_offload_bytes=0, verify=verify,
                                         prefetch_budget_bytes=0) as offloader:
                loss, h, made = forward()
                if flush:  # every write done before backward (else the writes race it)
                    offloader.flush()
        if inplace:
            h.detach()[rng.randrange(N)] += 1
        if not hold:  # the storages are read back from the file, not served live
            del h, made
            made = []
        loss.backward()
    except (RuntimeError, TbaError) as err:
        return "inplace" if isinstance(err, TbaError) or "modified by an inplace" in str(err) else repr(err)
    if directory is not None:
        STATS.append(offloader.stats)
    grads = [bits(w.grad) for w in weights.values() if w.grad is not None]
    return bits(loss), torch.cat([bits(leaf.grad)] + grads), list(_LOG), [bits(t) for t in made]


def test_flavours_match_training_without_tba(spill_dir):
    master = random.Random(SEED)
    STATS.clear()
    for case in range(CASES):
        seed, inplace = master.randrange(1 << 30), master.random() < 0.2
        expected = run_case(seed, None, inplace)
        got = run_case(seed, spill_dir, inplace)
        where = f"TBA_FLAVOUR_SEED={SEED} case {case} (seed {seed}, inplace={inplace})"
        if isinstance(expected, str) or isinstance(got, str):
            assert got == expected, where
            continue
        for name, left, right in zip(("loss", "grad"), expected, got):
            assert torch.equal(left, right), f"{where}: {name}"
        assert len(expected[2]) == len(got[2]), where
        for i, (left, right) in enumerate(zip(expected[2], got[2])):
            assert left[:-1] == right[:-1], f"{where}: saved tensor {i}: {left[:-1]} != {right[:-1]}"
            assert torch.equal(left[-1], right[-1]), f"{where}: saved tensor {i} {left[:-1]}: bytes"
        for i, (left, right) in enumerate(zip(expected[3], got[3])):
            assert torch.equal(left, right), f"{where}: the program's tensor {i} changed"
    assert sum(stats.bytes_read for stats in STATS) > 0 and sum(stats.storages_written for stats in STATS) > CASES


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_dtype_is_drawn(dtype):
    """The sample is big enough to reach every dtype (a cheap guard on the draw itself)."""
    master = random.Random(SEED)
    drawn = set()
    for _ in range(CASES):
        drawn.add(random.Random(master.randrange(1 << 30)).choice(DTYPES))
        master.random()
    assert dtype in drawn


@pytest.mark.parametrize("written", [False, True], ids=["queued", "written"])
@pytest.mark.parametrize("replacement", [(10,), (4096,), (32, 32), (1024,)], ids=["smaller", "larger", "2-d", "same"])
def test_data_replaced_after_its_save_is_the_data_it_was_saved_with(spill_dir, replacement, written):
    """Note [A save writes the storage its tensor had at pack] in tba/runtime/_views.py: backward gets the data ``h``
    had when it was saved, whenever ``.data`` is replaced. The save wrote the replacement instead when it came
    first: a smaller one was rebuilt past its end (NaN in the gradient), a larger one cut to the packed shape, no
    error; and once written, the old data came back. Autograd without hooks uses an input's replacement (20, 2048
    or 8192 here): the documented exception (docs/api.md), now the same whatever the timing. Queued: the one small
    save has not run yet when ``.data`` is replaced (below the waker's thresholds)."""
    def step(context):
        x = torch.ones(4, requires_grad=True)
        h = torch.ones(N)
        with context as offloader:
            y = SaveSum.apply(x, h)
            if written:
                offloader.flush()
            h.data = torch.full(replacement, 2.0)
        y.sum().backward()
        return x.grad

    got = step(tba.offload_activations(directory=spill_dir, min_offload_bytes=0))
    assert torch.equal(got, torch.full((4,), float(N)))


class SaveOutput(torch.autograd.Function):
    """Saves its own output: autograd keeps that output's storage as it was, whatever ``.data`` becomes later."""

    @staticmethod
    def forward(ctx, x):
        y = x * torch.arange(N, dtype=x.dtype)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * y


def test_an_output_whose_data_is_replaced_before_the_write_is_exact(spill_dir):
    """Megatron's ``deallocate_output_tensor`` swaps a sent output's ``.data`` for one element; autograd keeps the
    output's old storage. tba wrote the same-shaped replacement here and gave 7s for 0, 1, 2, ... (helper-62)."""
    def step(directory):
        x = torch.ones(N, requires_grad=True)
        with tba.offload_activations(directory=directory, min_offload_bytes=0) if directory else contextlib.nullcontext():
            y = SaveOutput.apply(x)
            y.data = torch.full((N,), 7.0)
        y.sum().backward()
        return x.grad

    expected = step(None)
    assert torch.equal(expected, torch.arange(N, dtype=torch.float32))
    assert torch.equal(step(spill_dir), expected)


def test_a_saved_tensor_moved_to_shared_memory_before_the_write_is_exact(spill_dir):
    """``share_memory_()`` (``multiprocessing.Queue.put`` of an activation) moves a storage's bytes and keeps the
    storage: the save writes the bytes where they are then (helper-62)."""
    def step(directory):
        x = torch.ones(4, requires_grad=True)
        h = torch.arange(N, dtype=torch.float32)
        with tba.offload_activations(directory=directory, min_offload_bytes=0) if directory else contextlib.nullcontext():
            y = SaveSum.apply(x, h)
            h.share_memory_()
        y.sum().backward()
        return x.grad

    assert torch.equal(step(spill_dir), step(None))


def test_a_storage_shrunk_before_its_write_raises_and_frees_the_step(spill_dir):
    """A storage resized below the saved tensor before its write cannot be written: unpack raises. The view held
    the TbaError it raised, whose traceback held the caller's frame (the loss, the graph, the view): a cycle
    through autograd's C++ node that ``gc.collect()`` left, and the step's locals and the offloader with it
    (helper-62)."""
    def step():
        x = torch.ones(4, requires_grad=True)
        h = torch.ones(N)
        local = torch.ones(N)
        with tba.offload_activations(directory=spill_dir, min_offload_bytes=0) as offloader:
            y = SaveSum.apply(x, h)
            h.untyped_storage().resize_(0)
        with pytest.raises(TbaError, match="resized below it"):
            y.sum().backward()
        return weakref.ref(local), weakref.ref(offloader)

    refs = step()
    gc.collect()
    assert [ref() for ref in refs] == [None, None]


def test_a_storage_already_too_small_when_saved_raises_a_clear_error(spill_dir):
    """A tensor saved (not read) after its storage was shrunk below it, the storage grown back before backward: without
    tba backward runs on whatever the storage then holds; with tba, whose write took the shrunk storage, unpack raises
    the TbaError naming the resize (helper-82: a save that checked the geometry only against a storage shrunk since pack
    let this one through, and backward met torch's bare 'Trying to resize storage that is not resizable')."""
    x = torch.ones(4, requires_grad=True)
    h = torch.ones(N)
    h.untyped_storage().resize_(64)
    with tba.offload_activations(directory=spill_dir, min_offload_bytes=0):
        y = SaveSum.apply(x, h)
    h.untyped_storage().resize_(N * 4)
    with pytest.raises(TbaError, match="resized below it"):
        y.sum().backward()


def test_the_save_refuses_exactly_the_storages_too_small_for_the_packed_geometry():
    """``SavedView.uncovered`` (Note [A save writes the storage its tensor had at pack] in tba/runtime/_views.py) takes
    the last element's index as two sums; random strided views, storages of every size around their last byte: it
    refuses the storage exactly when the view's last byte lies past its end, as the loop over the dimensions did."""
    from tba.runtime._views import SavedView

    rng = random.Random(0)
    for _ in range(300):
        dtype = rng.choice([torch.uint8, torch.float16, torch.float32, torch.float64])
        size = tuple(rng.randrange(0, 4) for _ in range(rng.randrange(0, 4)))
        stride = tuple(rng.randrange(0, 6) for _ in size)
        offset = rng.randrange(0, 5)
        view = SavedView(None, torch.empty(size, dtype=dtype))
        view.storage_offset, view.stride = offset, stride  # the packed geometry, any the view could have had
        last = offset
        for n, step in zip(size, stride):
            last += (n - 1) * step
        needed = 0 if 0 in size else (last + 1) * dtype.itemsize
        for nbytes in {0, max(needed - 1, 0), needed, needed + 1}:
            refused = view.uncovered(torch.UntypedStorage(nbytes)) is not None
            assert refused == (nbytes < needed), (size, stride, offset, dtype, nbytes)


def test_a_view_saved_after_its_storage_grew_is_exact(spill_dir):
    """A storage grown by ``resize_`` (which bumps no version) between two saves of one tensor family, the second a view
    reaching into the grown part: it shared the entry written at the old size, and its unpack met torch's bare 'Trying
    to resize storage that is not resizable' (helper-95). An entry is shared only by saves of a storage of its size."""
    def step(offloader):
        w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
        with offloader if offloader is not None else contextlib.nullcontext():
            h = w.exp()  # ExpBackward saves h
            if offloader is not None:
                offloader.flush()  # h written at its first size
            storage = h.untyped_storage()
            storage.resize_(storage.nbytes() + 64)
            torch.empty(0).set_(storage, 64 * 64, (16,), (1,)).fill_(0.5)  # the grown part, through a counter of its own
            loss = h.as_strided((64 * 64 + 16,), (1,)).sin().sum() + h.sum()
        loss.backward()
        return loss.detach(), w.grad

    offloader = tba.Offloader(spill_dir, policy="offload", min_offload_bytes=0)
    try:
        got = step(offloader)
    finally:
        offloader.close()
    want = step(None)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("hold", [False, True], ids=["dropped", "held"])
def test_a_tensor_saved_again_after_its_storage_was_freed_and_refilled_is_exact(spill_dir, hold):
    """FSDP's pattern on a saved tensor: its storage freed (``resize_(0)``), grown back to the same size (new memory)
    and refilled through a tensor with a counter of its own, then the tensor saved again. No version moved and the size
    is the same: the second save shared the entry written before the refill, and its backward got the old bytes
    (x.grad 1024 for 2048, no error; helper-159). Only the second node runs backward: without tba it reads the
    storage as refilled."""
    def step(offloader):
        x = torch.ones(4, requires_grad=True)
        h = torch.ones(N)
        with offloader if offloader is not None else contextlib.nullcontext():
            first = SaveSum.apply(x, h)  # saved, and written, with its first bytes; its node stays alive
            if offloader is not None:
                offloader.flush()
            storage = h.untyped_storage()
            address = storage.data_ptr()
            storage.resize_(0)
            blocker = torch.empty(N)  # takes the freed memory if the allocator hands it out again
            storage.resize_(N * 4)
            assert storage.data_ptr() != address, "the storage came back at its old address"
            torch.empty(0).set_(storage, 0, (N,), (1,)).fill_(2.0)  # refilled through a counter of its own
            y = SaveSum.apply(x, h)
        if not hold:
            del h, storage, blocker
        y.sum().backward()
        del first
        return x.grad

    offloader = tba.Offloader(spill_dir, policy="offload", min_offload_bytes=0, prefetch_budget_bytes=0)
    try:
        got = step(offloader)
    finally:
        offloader.close()
    want = step(None)
    assert torch.equal(want, torch.full((4,), 2.0 * N))
    assert torch.equal(got, want), f"x.grad {got.tolist()}, without tba {want.tolist()}"


class Saved(torch.autograd.Function):
    """Saves its second argument for backward and keeps what backward got in ``Saved.got``."""

    got: torch.Tensor

    @staticmethod
    def forward(ctx, x, kept):
        ctx.save_for_backward(kept)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (Saved.got,) = ctx.saved_tensors
        return grad, None


def test_a_quantized_dtype_on_an_unquantized_tensor_stays_in_memory(spill_dir):
    """``int32.view(torch.qint32)`` has a quantized dtype but ``is_quantized`` False: tba offloaded it, and
    rebuilding it failed in backward with torch's ``INTERNAL ASSERT FAILED`` in Quantizer.cpp (helper-61)."""
    def step(directory):
        x = torch.ones(4, requires_grad=True)
        odd = torch.arange(4096, dtype=torch.int32).view(torch.qint32)
        with tba.offload_activations(directory=directory, min_offload_bytes=0) if directory else contextlib.nullcontext():
            y = Saved.apply(x, odd)
        y.sum().backward()
        return x.grad, Saved.got.view(torch.int32).clone()

    expected, got = step(None), step(spill_dir)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
