"""A host storage's fresh save in C (``tba._save``) does what the Python path does, and training gives the same numbers.

Note [A host save in C] in tba/runtime/_writes.py: with the extension built, a CPU storage below DISCARD_MIN_BYTES on
the host route starts its write in one C call; without it, or with a stale build, the Python serves. The tests train
through both and compare the records, the stats and the gradients, with the spill file failing midway too.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import tba
from tba import _control, defaults
from tba.io import SpillFile
from tba.runtime import _writes

needs_extension = pytest.mark.skipif(not _writes.NATIVE, reason="the native extension tba._save is not built")

PATHS = ["python"] + (["c"] if _writes.NATIVE else [])


def _train(directory, monkeypatch, path: str) -> tuple[list[torch.Tensor], list[tuple], dict[str, int]]:
    """Gradients, each fresh record's facts in save order, and the stats, through ``path``'s save (None: no tba)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)))
    x = torch.randn(32, 64)
    if directory is None:
        model(x).square().sum().backward()
        return [p.grad for p in model.parameters()], [], {}
    native = _writes._start_host_write
    calls = [0]

    def counted(*args):
        calls[0] += 1
        return native(*args)

    monkeypatch.setattr(_writes, "_start_host_write", counted if path == "c" else None)
    made: list = []
    start_write = _writes.StoreWrites._start_write

    def recording(self, *args):  # under the store's lock (save holds it): nothing else moves these figures meanwhile
        before = (self._next_seq, self.live_entries, self.stats.resident_bytes, self._writing, self.unwritten_bytes)
        entry = start_write(self, *args)
        after = (self._next_seq, self.live_entries, self.stats.resident_bytes, self._writing, self.unwritten_bytes)
        made.append((entry.seq, entry.layer, entry.nbytes, entry.phase_bytes == entry.address % 4096, entry.version,
                     entry.offset >= 0, entry.own_memory, entry.route is self.routes.host, entry.device, entry.state,
                     entry.transfer_in_flight, entry.data.numel(), type(entry), self._by_storage[args[0]._cdata] is entry,
                     self.window._order[-1] is entry, tuple(b - a for a, b in zip(before, after, strict=True))))
        return entry

    monkeypatch.setattr(_writes.StoreWrites, "_start_write", recording)
    with tba.offload_activations(directory, min_offload_bytes=0, policy="offload") as offloader:
        loss = model(x).square().sum()
    loss.backward()
    stats = offloader.stats
    numbers = {name: getattr(stats, name) for name in ("tensors_offloaded", "bytes_deduplicated", "tensors_kept_on_error")}
    assert (calls[0] >= len(made) > 0) if path == "c" else calls[0] == 0, (calls, len(made))
    monkeypatch.undo()
    return [p.grad for p in model.parameters()], made, numbers


@needs_extension
def test_the_c_save_makes_the_records_and_stats_of_the_python_one_and_the_gradients_without_tba(tmp_path, monkeypatch):
    expected, _, _ = _train(None, monkeypatch, "python")
    python = _train(tmp_path / "python", monkeypatch, "python")
    c = _train(tmp_path / "c", monkeypatch, "c")
    assert c[1] == python[1] and c[2] == python[2]
    for got in (python, c):
        assert all(torch.equal(a, b) for a, b in zip(got[0], expected, strict=True))


def test_a_spill_file_that_fails_midway_keeps_the_tensor_in_memory_and_the_gradients_exact(tmp_path, monkeypatch, caplog):
    """The third extent refused: that storage stays in memory as a failed write does, with its warning (Note [A save
    that fails after its entry is registered] in tba/runtime/_store_lifetime.py), the others are written, and the C
    save leaves the records and the stats as the Python one does."""
    expected, _, _ = _train(None, monkeypatch, "python")
    allocate = SpillFile.allocate
    runs = {}
    for path in PATHS:
        count = [0]

        def failing(self, nbytes, count=count):
            count[0] += 1
            if count[0] == 3:
                raise OSError(28, "No space left on device (a test)")
            return allocate(self, nbytes)

        monkeypatch.setattr(SpillFile, "allocate", failing)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tba"):
            got, facts, numbers = _train(tmp_path / path, monkeypatch, path)
        monkeypatch.undo()
        assert count[0] > 3 and "writing activations to" in caplog.text and "No space left" in caplog.text, path
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), path
        runs[path] = facts, numbers
    assert runs.get("c", runs["python"]) == runs["python"]


@needs_extension
def test_a_stale_build_is_refused_and_python_serves_with_one_warning(monkeypatch, caplog):
    from tba import _save

    with pytest.raises(RuntimeError, match="abi"):
        _save.configure(_writes._SAVE_ABI + 1, _writes._RECORD_KEYWORDS, torch.ByteTensor, print, print)
    with pytest.raises(RuntimeError, match="keywords"):
        _save.configure(_writes._SAVE_ABI, _writes._RECORD_KEYWORDS[1:] + ("added",), torch.ByteTensor, print, print)

    def stale(*args):
        raise RuntimeError("tba._save was built for abi 0")

    monkeypatch.setattr(_save, "configure", stale)
    with caplog.at_level(logging.WARNING, logger="tba"):
        assert _writes._native_save() is None
    assert "starts host writes in Python" in caplog.text
    monkeypatch.undo()
    assert _writes._native_save() is _save.start_host_write  # configured again as tba's import left it


class _SavesBytes(torch.autograd.Function):
    """Saves the byte tensors it is given (plain tensors, not leaves that require grad: each is offloaded); the
    gradient is the weight times the sum of their bytes, so a wrong byte read back changes it."""

    @staticmethod
    def forward(ctx, weight, *saved):
        ctx.save_for_backward(*saved)
        return weight * 1.0

    @staticmethod
    def backward(ctx, grad):
        total = sum(int(saved.sum()) for saved in ctx.saved_tensors)
        return (grad * total, *(None for _ in ctx.saved_tensors))


@needs_extension
def test_the_c_save_takes_storages_below_discard_min_bytes_and_the_python_one_from_there(tmp_path, monkeypatch):
    """Note [A host save in C]: a storage of DISCARD_MIN_BYTES may hand its pages back (own_memory, under glibc),
    which the C save never says; it is the Python's, and one byte less is the C's."""
    limit = defaults.DISCARD_MIN_BYTES
    native = _writes._start_host_write
    seen: list[int] = []

    def counted(store, storage, *args):
        seen.append(storage.nbytes())
        return native(store, storage, *args)

    made: list[tuple[int, bool]] = []
    start_write = _writes.StoreWrites._start_write

    def recording(self, storage, *args):
        entry = start_write(self, storage, *args)
        made.append((entry.nbytes, entry.own_memory))
        return entry

    monkeypatch.setattr(_writes, "_start_host_write", counted)
    monkeypatch.setattr(_writes.StoreWrites, "_start_write", recording)
    monkeypatch.setattr(_writes, "hands_back_pages", lambda: True)  # own_memory as glibc's malloc gives it
    weight = torch.ones(4, requires_grad=True)
    saved = [torch.full((nbytes,), 3, dtype=torch.uint8) for nbytes in (limit - 1, limit)]
    with tba.offload_activations(tmp_path, min_offload_bytes=0, policy="offload"):
        loss = _SavesBytes.apply(weight, *saved).sum()
    loss.backward()
    assert seen == [limit - 1]
    assert sorted(made) == [(limit - 1, False), (limit, True)]
    assert torch.equal(weight.grad, torch.full((4,), 3.0 * (2 * limit - 1)))
    assert all(bool((held == 3).all()) for held in saved)  # the program's own tensors: no page handed back under them


@pytest.mark.parametrize("path", PATHS)
def test_an_empty_view_whose_storage_is_freed_before_its_save_stays_in_memory_and_its_offloader_closes(
        spill_dir, monkeypatch, caplog, path):
    """A view of no elements passes the save's geometry check whatever its storage holds; freed (``resize_(0)``)
    between pack and save, that storage had nothing to write: the spill file refused its extent of 0 bytes after
    the entry was counted live, and that entry outlived every view, so the one-shot offloader never closed (its
    spill file and engine stayed open) and warned that a tensor could not be written. Kept, it was then counted
    neither offloaded nor kept."""
    if path == "python":
        monkeypatch.setattr(_writes, "_start_host_write", None)
    weight = torch.ones(4, requires_grad=True)
    hidden = torch.full((1024,), 3, dtype=torch.uint8)
    with caplog.at_level(logging.WARNING, logger="tba"):
        with tba.offload_activations(spill_dir, min_offload_bytes=0, policy="offload") as offloader:
            loss = _SavesBytes.apply(weight, hidden[1024:], torch.full((64,), 5, dtype=torch.uint8)).sum()
            hidden.untyped_storage().resize_(0)
        loss.backward()
    del loss
    _control.settle()  # the views' deaths, which the control thread hears
    assert torch.equal(weight.grad, torch.full((4,), 320.0))
    assert offloader._runtime is None and offloader.stats.tensors_offloaded == 1  # closed: its file given back
    assert "could not start writing" not in caplog.text
    stats = offloader.stats  # the empty one is counted as kept, as every tensor tba keeps in memory is
    assert (stats.tensors_kept, stats.bytes_kept, stats.kept_by_reason) == (1, 0, {str(tba.KeepReason.EMPTY_STORAGE): 1})


class _Answer:
    """What a replaced ``_write_not_queued`` returns: a truth value that is not a bool, or one that raises."""

    def __init__(self, truth):
        self.truth = truth

    def __bool__(self):
        if isinstance(self.truth, BaseException):
            raise self.truth
        return self.truth

    def __repr__(self):
        # A stable test id: pytest-xdist's workers must collect the same names (an address differed between them).
        return f"_Answer({self.truth!r})"


class _Store(_writes.StoreWrites):
    """The attributes and methods a host save uses, its ``_resident`` failing and its ``_write_not_queued`` answering
    ``answer`` (Note [A save that fails after its entry is registered])."""

    def __init__(self, answer):
        class Route:
            def phase_bytes(self, address):
                return address % 4096

        class Routes:
            staged_devices = ()
            host = Route()

        class Window:
            def add(self, entry):
                pass

        self.routes = Routes()
        self.window = Window()
        self._next_seq = self.live_entries = 0
        self._by_storage = {}
        self.answer = answer
        self.told = []

    def _resident(self, nbytes):
        raise ValueError("a test fails _resident")

    def _write_not_queued(self, entry, error, done):
        self.told.append((error, done))
        return self.answer


@needs_extension
@pytest.mark.parametrize("answer", [1, 0, "kept", _Answer(True), _Answer(False), _Answer(LookupError("bool"))],
                         ids=repr)
def test_the_c_save_takes_the_answer_of_write_not_queued_as_the_python_one_does(monkeypatch, answer):
    """The Python save asks ``not self._write_not_queued(...)``, any truth value (a replaced one's too); the C save
    took only True as kept, and raised where the Python kept the entry, or hid the error of the answer's ``__bool__``."""
    tensor = torch.ones(16)
    native = _writes._start_host_write
    outcomes = {}
    for path in ("python", "c"):
        monkeypatch.setattr(_writes, "_start_host_write", None if path == "python" else native)
        store = _Store(answer)
        try:
            entry = store._start_write(tensor.untyped_storage(), 0, 0, None, tensor)
        except Exception as error:  # noqa: BLE001 - compared below
            outcomes[path] = type(error), str(error), repr(error.__context__)
        else:
            outcomes[path] = type(entry).__name__, entry.seq
        assert [(str(error), done) for error, done in store.told] == [("a test fails _resident", 3)], path
    monkeypatch.undo()
    assert outcomes["c"] == outcomes["python"]
