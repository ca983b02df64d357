"""The C record of ``tba._record`` is the Python record, field for field, and training gives the same numbers with either.

Note [One record, two builds] in tba/runtime/_entry.py: the store's per-storage record is a C type when the
extension is built, the dataclass :class:`~tba.runtime._entry.PyStorageEntry` when not. The tests here compare
the two where both exist and train through each as the store's record.
"""

from __future__ import annotations

import dataclasses
import gc
import os

import pytest
import torch
from python_runs import run_python
from torch import nn

import tba
from tba.runtime import _entry, _host_requests, _writes
from tba.runtime._entry import PyStorageEntry, State

needs_extension = pytest.mark.skipif(not _entry.NATIVE, reason="the native extension tba._record is not built")

FIELDS = [field.name for field in dataclasses.fields(PyStorageEntry)]


def _make(record, storage: torch.UntypedStorage, **given):
    return record(seq=3, layer=given.pop("layer", None), nbytes=storage.nbytes(), phase_bytes=given.pop("phase_bytes", 0),
                  version=0, cdata=storage._weak_ref(), data=None, **given)


@needs_extension
@pytest.mark.parametrize("layer", [None, 2])
@pytest.mark.parametrize("phase_bytes", [0, 1, 4095])
def test_the_c_record_has_the_fields_defaults_and_answers_of_the_python_one(layer, phase_bytes):
    storage = torch.UntypedStorage(5000)
    native = _make(_entry.StorageEntry, storage, layer=layer, phase_bytes=phase_bytes)
    python = _make(PyStorageEntry, storage, layer=layer, phase_bytes=phase_bytes)
    for name in FIELDS:
        if name == "cdata":
            continue  # each holds a weak reference of its own
        native_value, python_value = getattr(native, name), getattr(python, name)
        assert native_value is python_value or native_value == python_value, name
    assert native.root() is None and native.state is State.WRITING
    assert (native.extent_bytes, native.describe(), native.expired()) == \
        (python.extent_bytes, python.describe(), python.expired())
    del storage
    assert native.expired() and python.expired()


@needs_extension
def test_the_c_record_takes_its_fields_positionally_and_refuses_what_the_dataclass_refuses():
    storage = torch.UntypedStorage(16)
    values = [1, None, 16, 0, 0, storage._weak_ref(), None, lambda: None, State.ON_DISK, 4096]
    entry = _entry.StorageEntry(*values)
    assert [getattr(entry, name) for name in FIELDS[:len(values)]] == values
    with pytest.raises(TypeError, match="missing required argument 'data'"):
        _entry.StorageEntry(seq=0, layer=None, nbytes=16, phase_bytes=0, version=0, cdata=0)
    with pytest.raises(TypeError, match="multiple values for argument 'seq'"):
        _entry.StorageEntry(0, seq=0, layer=None, nbytes=16, phase_bytes=0, version=0, cdata=0, data=None)


@needs_extension
def test_the_c_record_takes_only_its_fields_and_keeps_its_weak_reference():
    entry = _make(_entry.StorageEntry, torch.UntypedStorage(16))
    entry.state, entry.offset, entry.io_error = State.ON_DISK, 8192, None
    assert (entry.state, entry.offset) == (State.ON_DISK, 8192)
    with pytest.raises(AttributeError):
        entry.not_a_field = 1
    with pytest.raises(AttributeError):
        entry.cdata = 0


@needs_extension
def test_a_stale_extension_is_refused_and_the_record_in_force_stays():
    names = tuple(FIELDS)
    with pytest.raises(RuntimeError, match="rebuild the extension"):
        _entry._record.configure(names + ("added",), {}, print, print, 4096)
    with pytest.raises(RuntimeError, match="rebuild the extension"):
        _entry._record.configure(names[1:] + names[:1], {}, print, print, 4096)
    with pytest.raises(RuntimeError, match="lacks a default"):
        _entry._record.configure(names, {}, print, print, 4096)
    storage = torch.UntypedStorage(16)
    entry = _make(_entry.StorageEntry, storage)
    assert entry.extent_bytes == 4096 and not entry.expired()


@needs_extension
def test_a_c_record_in_a_reference_cycle_is_collected_and_frees_its_weak_reference(request):
    freed: list[int] = []
    free = torch.UntypedStorage._free_weak_ref

    def counted(cdata: int) -> None:
        freed.append(cdata)
        free(cdata)

    _entry._configure(counted)
    request.addfinalizer(_entry._configure)
    cdata = _in_a_cycle(_entry.StorageEntry)
    assert freed == []
    gc.collect()
    assert freed == [cdata]


def _in_a_cycle(record) -> int:
    """Makes a record that only a reference cycle holds, and returns its weak reference's number."""
    entry = _make(record, torch.UntypedStorage(16))
    assert gc.is_tracked(entry)
    try:
        raise OSError("write failed")
    except OSError as err:
        entry.io_error = err  # its traceback holds this frame, which holds the entry
    return entry.cdata


def _train(directory) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)))
    x = torch.randn(32, 64)
    if directory is None:
        model(x).square().sum().backward()
    else:
        with tba.offload_activations(directory, min_offload_bytes=0):
            loss = model(x).square().sum()
        loss.backward()
    return [parameter.grad for parameter in model.parameters()]


@pytest.mark.parametrize("record", [PyStorageEntry, _entry.StorageEntry], ids=["python", "store's"])
def test_training_through_either_record_gives_the_gradients_without_tba(tmp_path, monkeypatch, record):
    monkeypatch.setattr(_writes, "StorageEntry", record)
    made: list[object] = []
    start_write = _writes.StoreWrites._start_write

    def recording(self, *args, **kwargs):
        entry = start_write(self, *args, **kwargs)
        made.append(type(entry))
        return entry

    monkeypatch.setattr(_writes.StoreWrites, "_start_write", recording)
    expected = _train(None)
    got = _train(tmp_path)
    assert made and set(made) == {record}
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@needs_extension
@pytest.mark.skipif(not _host_requests.NATIVE, reason="the native extension tba._requests is not built")
@pytest.mark.parametrize("error", ["RuntimeError", "TypeError"])  # its fields differ; its configure takes other arguments
def test_a_stale_build_falls_back_to_python_with_one_warning(tmp_path, error):
    """A build that does not match this tba (a checkout updated without rebuilding) is not used: the Python
    record and request loop serve, training works, and one warning names the rebuild."""
    script = (
        "import glob, importlib.util, logging, os, sys, torch\n"
        "logging.basicConfig(level=logging.WARNING, stream=sys.stdout)\n"
        "def stale(*args):\n"
        f"    raise {error}('tba._x does not match: rebuild the extension')\n"
        f"for name in ('_record', '_requests', '_save'):  # loaded and made stale before tba's own import configures them\n"
        f"    [path] = glob.glob(os.path.join({os.path.dirname(tba.__file__)!r}, name + '.*.so'))\n"
        "    spec = importlib.util.spec_from_file_location('tba.' + name, path)\n"
        "    module = importlib.util.module_from_spec(spec)\n"
        "    spec.loader.exec_module(module)\n"
        "    module.configure = stale\n"
        "    sys.modules['tba.' + name] = module\n"
        "import tba\n"
        "from tba.runtime import _entry, _host_requests, _writes\n"
        "print('native', _entry.NATIVE, _host_requests.NATIVE, _writes.NATIVE)\n"
        "def step(offload):\n"
        "    x = torch.linspace(-2, 2, 65536).reshape(256, 256).requires_grad_()\n"
        f"    with tba.offload_activations(directory={str(tmp_path)!r}, backend='threads', policy='offload') if offload \\\n"
        "            else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):\n"
        "        y = (x * 2).tanh().sum()\n"
        "    y.backward()\n"
        "    return x.grad\n"
        "print('grad ok', torch.equal(step(True), step(False)))\n"
    )
    done = run_python(["-c", script], timeout=120, env=dict(os.environ, PYTHONNOUSERSITE="1"))  # a fresh process
    assert done.returncode == 0, done.stderr
    assert "native False False False" in done.stdout
    assert "grad ok True" in done.stdout
    assert done.stdout.count("rebuild the extension") == 3  # one warning each


_FIELD_FREED_WHILE_READ = """
import torch
from tba.runtime import _entry

entry = _entry.StorageEntry(1, None, 16, 0, 0, torch.UntypedStorage(16)._weak_ref(), None)
dead, late = set(), []

class Held:
    # Only the record holds it; what reads it after its death is reading freed memory. Each is told apart by a
    # number of its own, not its id: a later Held may be made at a dead one's address.
    made = 0
    def __init__(self):
        Held.made += 1
        self.number = Held.made
    def __index__(self):
        late.append(self.number in dead)
        return 4096
    def __str__(self):
        late.append(self.number in dead)
        return "held"
    def __repr__(self):
        late.append(self.number in dead)
        return "held"
    def __del__(self):
        dead.add(self.number)

class Replacing:
    # Converting it replaces the record's other field, dropping the record's reference to that field's value.
    def __init__(self, name):
        self.name = name
    def __index__(self):
        setattr(entry, self.name, 8192)
        return 0
    def __str__(self):
        setattr(entry, self.name, 8192)
        return "replacing"

entry.phase_bytes, entry.nbytes = Replacing("nbytes"), Held()
try:
    entry.extent_bytes
except TypeError:
    pass
entry.seq, entry.nbytes, entry.layer = Replacing("layer"), 16, Held()
entry.describe()
entry.seq, entry.layer, entry.state = Replacing("state"), None, Held()
repr(entry)
print("late reads:", late.count(True))
"""


@needs_extension
def test_a_field_replaced_while_the_record_reads_another_is_not_read_after_its_death():
    """The C record's ``extent_bytes``, ``describe()`` and ``repr()`` held borrowed references to its fields while
    converting one of them, which can run Python that sets another: that one's value was freed and then read (a
    segmentation fault at the end of this run)."""
    done = run_python(["-c", _FIELD_FREED_WHILE_READ], timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "late reads: 0" in done.stdout, done.stdout


_A_LONG_CHAIN = """
import sys
import torch
from tba.runtime import _entry

storage = torch.UntypedStorage(4)
record = _entry.StorageEntry if sys.argv[1] == "c" else _entry.PyStorageEntry
head = None
for seq in range(300_000):
    entry = record(seq, None, 4, 0, 0, storage._weak_ref(), None)
    entry.route = head  # each record holds the one made before it
    head = entry
del entry
head = None
print("freed", flush=True)
"""


@needs_extension
@pytest.mark.parametrize("record", ["python", "c"])
def test_a_long_chain_of_records_is_freed_as_the_dataclass_frees_it(record):
    """Note [A chain of records is freed without recursion] in native/tba_record.c: each C record freed the next from
    inside its deallocator, and a chain of 300,000 overflowed the C stack (a segmentation fault); the dataclass's
    instances go through CPython's trashcan."""
    done = run_python(["-c", _A_LONG_CHAIN, record], timeout=120)
    assert done.returncode == 0 and done.stdout == "freed\n", (done.returncode, done.stdout, done.stderr[-2000:])
