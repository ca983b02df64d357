"""Offloader.pack / unpack called directly: keep rules, dedup, forwarding, release, reuse."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from python_runs import run_python
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from utils import FaultyEngine

import tba
from tba.errors import TbaError
from tba.io._memory import aligned_empty, storage_view

# These tests hold what they pack, to compare with; what they check is the file's round trip.
pytestmark = pytest.mark.usefixtures("read_back_always")


def offloader(directory: str, backend="threads", **options) -> tba.Offloader:
    """An offloader that writes everything, in small blocks so that one storage spans many requests."""
    options.setdefault("min_offload_bytes", 0)
    options.setdefault("block_size_bytes", 8192)
    return tba.Offloader(directory, backend=backend, **options)


def round_trip(off: tba.Offloader, tensor: torch.Tensor) -> torch.Tensor:
    packed = off.pack(tensor)
    off.flush()
    out = off.unpack(packed)
    del packed
    return out


def assert_same_view(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.stride() == want.stride() and got.storage_offset() == want.storage_offset()
    assert torch.equal(got, want)


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 4097, (1 << 20) + 1])
@pytest.mark.parametrize("view_offset", [0, 1, 4095])
def test_round_trip_awkward_sizes_and_offsets(spill_dir, backend, nbytes, view_offset):
    storage = torch.randint(0, 256, (nbytes + view_offset,), dtype=torch.uint8)
    view = storage[view_offset:]
    with offloader(spill_dir, backend) as off:
        got = round_trip(off, view)
    assert_same_view(got, view)
    assert off.stats.bytes_written == nbytes + view_offset
    assert off.stats.bytes_read == nbytes + view_offset
    off.close()


def test_an_unpack_under_another_default_device_keeps_the_tensors_own(spill_dir):
    """A saved tensor read back from Python (``grad_fn._saved_result``) inside a default-device context comes back
    on its own device, bit for bit: the rebuilt tensor is not made by a factory the context redirects."""
    leaf = torch.randn(64, 1024, requires_grad=True)
    with offloader(spill_dir) as off:
        out = torch.tanh(leaf)
    off.flush()
    with torch.device("meta"):
        saved = out.grad_fn._saved_result
    assert saved.device.type == "cpu" and torch.equal(saved, torch.tanh(leaf.detach()))
    assert off.stats.tensors_offloaded >= 1
    del out, saved
    off.close()


DEFAULT_DEVICE_FIRST = """
import sys, torch
torch.set_default_device("meta")
import tba
cpu = torch.device("cpu")
w = torch.randn(256, 1024, device=cpu, requires_grad=True)
x = torch.randn(64, 256, device=cpu)
def step(context):
    w.grad = None
    with context:
        loss = torch.tanh(x @ w).square().sum()
    loss.backward()
    return loss.detach().clone(), w.grad.clone()
want = step(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
for _ in range(2):
    got = step(tba.offload_activations(directory=sys.argv[1], min_offload_bytes=0))
    assert all(torch.equal(a, b) for a, b in zip(got, want)), "differs"
print("same")
"""


def test_a_default_device_set_before_import_leaves_cpu_training_exact(spill_dir):
    """``torch.set_default_device`` before ``import tba``: tba's own tensors made at import stay on the CPU, and a
    CPU model trains bit for bit as without tba (each pack of a CPU tensor used to fail setting its version watch)."""
    done = run_python(["-c", DEFAULT_DEVICE_FIRST, spill_dir], timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "same", done.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                   torch.int64, torch.bool, torch.complex64])
def test_round_trip_dtypes_non_contiguous(spill_dir, dtype):
    base = (torch.randn(37, 53) * 100).to(dtype)
    view = base.t()[3:, ::2]
    with offloader(spill_dir) as off:
        assert_same_view(round_trip(off, view), view)
    off.close()


def test_dedup_writes_a_storage_once_and_rebuilds_every_view(spill_dir):
    x = torch.randn(64, 128)
    views = [x, x.t(), x[1:], x[:, 64:], x[:, :64], x]
    with offloader(spill_dir) as off:
        packed = [off.pack(v) for v in views]
        off.flush()
        assert off.stats.storages_written == 1
        assert off.stats.tensors_offloaded == 6
        assert off.stats.bytes_deduplicated == 5 * x.nbytes
        for view, p in zip(views, packed):
            assert_same_view(off.unpack(p), view)
    del packed
    off.close()


def test_allocator_address_reuse_is_a_new_storage(spill_dir):
    """A new storage at a freed storage's address must not be mistaken for it."""
    pool = aligned_empty(1 << 16)
    with offloader(spill_dir) as off:
        a = storage_view(pool, 0, 1 << 16)
        a.copy_(torch.randint(0, 256, (1 << 16,), dtype=torch.uint8))
        want_a = a.clone()
        packed_a = off.pack(a)
        off.flush()
        del a
        b = storage_view(pool, 0, 1 << 16)
        b.copy_(torch.randint(0, 256, (1 << 16,), dtype=torch.uint8))
        assert b.data_ptr() == pool.data_ptr()
        packed_b = off.pack(b)
        off.flush()
        assert off.stats.storages_written == 2
        assert torch.equal(off.unpack(packed_a), want_a)
        assert torch.equal(off.unpack(packed_b), b)
    del packed_a, packed_b
    off.close()


def test_in_place_change_after_save_is_a_new_snapshot(spill_dir):
    x = torch.randn(1000)
    with offloader(spill_dir) as off:
        first_value = x.clone()
        first = off.pack(x)
        off.flush()
        x.mul_(2)
        second = off.pack(x)
        off.flush()
        assert off.stats.storages_written == 2
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            off.unpack(first)
        assert torch.equal(off.unpack(second), x)
    del first, second, first_value
    off.close()


def test_memory_is_released_when_the_write_completes(spill_dir):
    with offloader(spill_dir) as off:
        x = torch.randn(1 << 18)
        ref = StorageWeakRef(x.untyped_storage())
        packed = off.pack(x)
        del x
        off.flush()
        assert ref.expired(), "tba still holds the storage after its write completed"
        assert off.stats.resident_bytes == 0
        assert off.unpack(packed).shape == (1 << 18,)
    del packed
    off.close()


def test_unpack_while_write_in_flight_is_served_from_memory(spill_dir):
    gate = threading.Event()
    engine = FaultyEngine(gate=gate)
    x = torch.randn(1 << 16)
    with offloader(spill_dir, engine) as off:
        packed = off.pack(x)
        assert torch.equal(off.unpack(packed), x)
        assert off.stats.unpacks_from_memory == 1 and off.stats.bytes_read == 0
        gate.set()
        off.flush()
    del packed
    off.close()
    engine.close()


class Parameterised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 64))
        self.register_buffer("table", torch.randn(64, 64))


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda m: m.weight, "parameter"),
        (lambda m: m.weight.t(), "parameter"),
        (lambda m: torch.randn(64, 64, requires_grad=True), "parameter"),
        (lambda m: m.table, "parameter or buffer"),
        (lambda m: m.table[3:], "parameter or buffer"),
        (lambda m: torch.randn(4), "small"),
        (lambda m: torch.empty(0), "small"),
        (lambda m: torch.randn(64, 64).to_sparse(), "not a plain strided tensor"),
        (lambda m: torch.empty(64, 64, device="meta"), "not a plain strided tensor"),
        (lambda m: torch.randn(64, 64, dtype=torch.complex64).conj(), "lazy conjugate or negative view"),
        (lambda m: torch.randn(64, 64).as_subclass(SubTensor), "tensor subclass"),
        (lambda m: _with_scale(torch.randn(64, 64)), "tensor with attributes"),
        (lambda m: _with_scale(m.weight * 2), None),  # requires grad: autograd returns a new object anyway
        (lambda m: torch.randn(64, 64), None),
    ],
)
def test_keep_rules(spill_dir, make, reason):
    module = Parameterised()
    off = offloader(spill_dir, layers=[module], min_offload_bytes=1024)
    assert off.keep_reason(make(module)) == reason


def test_the_attribute_rule_makes_no_dict_on_a_tensor_that_requires_grad(spill_dir):
    """Reading ``__dict__`` makes one (Python 3.11): a dict per saved activation, counted toward the cycle collector's
    young generation (Note [A tensor with attributes stays in memory]). Most saved activations require grad, and their
    rule is settled by ``requires_grad`` first."""
    module = Parameterised()
    off = offloader(spill_dir, layers=[module], min_offload_bytes=1024)
    activation = module.weight * 2
    assert off.keep_reason(activation) is None
    assert not any(isinstance(referent, dict) for referent in gc.get_referents(activation))


class SubTensor(torch.Tensor):
    pass


def _with_scale(tensor: torch.Tensor) -> torch.Tensor:
    tensor.scale = 3.0
    return tensor


def test_reusable_offloader_reuses_file_space_across_steps(spill_dir, open_fds):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64))
    x = torch.randn(128, 64)
    fds = open_fds()
    off = offloader(spill_dir)
    sizes = []
    steps = 6
    for _ in range(steps):
        with off:
            loss = model(x).sum()
            off.flush()  # every write done before forward ends: backward reads them (none is held)
        loss.backward()
        sizes.append(off.spill.size_bytes)
    # Without reuse the file would grow by sizes[0] every step; a read still in flight when the
    # next step allocates can shift a hole, so allow some slack but no growth per step.
    assert sizes[0] > 0 and max(sizes) <= 1.5 * sizes[0], sizes
    assert off.stats.tensors_offloaded == 3 * steps
    stats = off.stats
    assert stats.read_buffers_allocated <= 3 and stats.read_buffers_reused > 0, "read buffers were not reused across steps"
    assert off.pool_idle_bytes > 0
    assert open_fds() == fds + 1
    off.close()
    assert open_fds() == fds and off.pool_idle_bytes == 0


def test_reusable_offloader_dropped_without_close_gives_back_its_file_and_threads(spill_dir, open_fds, backend):
    # A training function that raises (a NaN check) loses its offloader before close(): once it is
    # collected, its spill file and engine threads must go too, as a file object's do.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64))
    x = torch.randn(128, 64)
    model(x).sum().backward()
    expected = model[0].weight.grad.clone()
    fds, threads = open_fds(), set(threading.enumerate())

    def train() -> torch.Tensor:
        off = offloader(spill_dir, backend=backend, policy="offload")
        for _ in range(2):
            model.zero_grad()
            with off:
                loss = model(x).sum()
            loss.backward()
        with off:
            return model(x).sum()  # the offloader goes out of scope, this step's graph saved in it

    for _ in range(3):
        loss = train()
        model.zero_grad()
        loss.backward()  # the graph keeps its offloader alive until backward has released it
        assert torch.equal(model[0].weight.grad, expected)
        del loss
    open_fds()  # the last views' finalizers, run on the control thread, let go of the last offloader
    # The threads this test started (not a count: under pytest-xdist an earlier test's threads may end meanwhile).
    assert open_fds() == fds and [t.name for t in set(threading.enumerate()) - threads if t.is_alive()] == []


def test_unpack_after_close_raises(spill_dir):
    with offloader(spill_dir) as off:
        packed = off.pack(torch.randn(1000))
        off.flush()
    off.close()
    with pytest.raises(TbaError, match="closed"):
        off.unpack(packed)


def test_entering_twice_at_once_raises(spill_dir):
    off = offloader(spill_dir)
    with off:
        with pytest.raises(TbaError, match="cannot be entered"):
            off.__enter__()
    off.close()


def test_keep_layers_and_saved_bytes_per_layer(spill_dir):
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)) for _ in range(3))
    x = torch.randn(32, 64)

    def step(off):
        with off:
            h = x
            for layer in layers:
                h = layer(h)
            loss = h.sum()
        off.flush()
        loss.backward()

    full = offloader(spill_dir, layers=list(layers))
    step(full)
    assert set(full.layer_saved_bytes) == {0, 1, 2}
    partial = offloader(spill_dir, layers=list(layers), policy="offload")  # keep_layers set by hand
    partial.keep_layers = {1}
    step(partial)
    assert set(partial.layer_saved_bytes) == {0, 2}
    assert partial.layer_saved_bytes[0] == full.layer_saved_bytes[0]
    assert partial.stats.tensors_kept > full.stats.tensors_kept
    full.close()
    partial.close()


def test_each_step_starts_outside_any_layer(spill_dir):
    torch.manual_seed(0)
    embed = nn.Linear(16, 64)
    layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(2))
    x = torch.randn(32, 16)
    off = offloader(spill_dir, layers=list(layers))
    per_step = []
    for _ in range(2):
        with off:
            h = embed(x).exp()
            for layer in layers:
                h = layer(h)
            loss = h.sum()
        off.flush()
        loss.backward()
        per_step.append(dict(off.layer_saved_bytes))
    assert set(per_step[0]) == {None, 0, 1} and per_step[0][None] > 0
    assert per_step[1] == {layer: 2 * nbytes for layer, nbytes in per_step[0].items()}
    off.close()


def test_unpacking_one_view_twice_keeps_the_storage_for_its_other_views(spill_dir):
    x = torch.randn(1 << 14)
    with offloader(spill_dir) as off:
        first, second = off.pack(x[:100]), off.pack(x[100:])
        off.flush()
        off.unpack(first)
        off.unpack(first)
        assert torch.equal(off.unpack(second), x[100:])
        assert off.stats.bytes_read == x.nbytes, "the storage was read twice"
        assert off.stats.resident_bytes == 0
    del first, second
    off.close()


@pytest.mark.parametrize(("budget_bytes", "wake_bytes"), [(1 << 20, 1 << 20), (8 << 20, 2 << 20), (64 << 20, 4 << 20)])
def test_backward_wakes_within_a_quarter_of_a_small_window(spill_dir, budget_bytes, wake_bytes):
    """Note [Backward wakes the control thread less often]: backward's deferred jobs move the window, so they wake the
    control thread after at most a quarter of it (never below forward's 1 MiB, at most 4 MiB)."""
    off = tba.Offloader(spill_dir, prefetch_budget_bytes=budget_bytes)
    with off:
        pass
    assert off._unpack_waker.nbytes == wake_bytes
    assert off._waker.nbytes == tba.defaults.DEFER_WAKE_BYTES
    off.close()
