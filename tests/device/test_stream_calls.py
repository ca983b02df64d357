"""tba.device._stream_calls against fakes of torch's four C bindings (a CPU build of torch has none).

The fake keeps what CUDA keeps per thread: a current device, and a current stream per device;
``_cuda_setStream`` also makes the stream's device current, as torch's binding does. On a GPU the
same code runs against the real bindings in ``tests/device/test_cuda.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tba.device import _cuda, _stream_calls
from tba.device._stream_calls import StreamContext


@dataclasses.dataclass(frozen=True)
class FakeStream:
    stream_id: int
    device_index: int
    device_type: int = 1


class FakeCuda:
    def __init__(self) -> None:
        self.device = 0
        self.current = {0: 0, 1: 0}

    def get_device(self) -> int:
        return self.device

    def set_device(self, index: int) -> None:
        self.device = index

    def get_current_stream(self, index: int) -> tuple[int, int, int]:
        return (self.current[index], index, 1)

    def set_stream(self, stream_id: int, device_index: int, device_type: int) -> None:
        self.device = device_index
        self.current[device_index] = stream_id


@pytest.fixture
def fake(monkeypatch):
    cuda = FakeCuda()
    for name, method in (("_cuda_getDevice", cuda.get_device), ("_cuda_setDevice", cuda.set_device),
                         ("_cuda_getCurrentStream", cuda.get_current_stream), ("_cuda_setStream", cuda.set_stream)):
        monkeypatch.setattr(torch._C, name, method, raising=False)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(_stream_calls, "_streams", {})
    return cuda


def test_a_stream_on_the_current_device_is_current_inside_and_the_old_one_after(fake):
    fake.current[0] = 7
    with StreamContext(FakeStream(3, 0)):
        assert (fake.device, fake.current[0]) == (0, 3)
    assert (fake.device, fake.current) == (0, {0: 7, 1: 0})


def test_a_stream_on_another_device_selects_that_device_and_both_come_back(fake):
    fake.current = {0: 5, 1: 9}
    with StreamContext(FakeStream(4, 1)):
        assert (fake.device, fake.current) == (1, {0: 5, 1: 4})
    assert (fake.device, fake.current) == (0, {0: 5, 1: 9})


def test_nested_contexts_and_an_exception_restore_everything(fake):
    with pytest.raises(KeyError):
        with StreamContext(FakeStream(2, 0)):
            with StreamContext(FakeStream(6, 1)):
                assert (fake.device, fake.current) == (1, {0: 2, 1: 6})
                raise KeyError
    assert (fake.device, fake.current) == (0, {0: 0, 1: 0})


def test_current_stream_keeps_one_object_per_stream(fake, monkeypatch):
    first = _stream_calls.current_stream(None)
    assert first == FakeStream(0, 0) and _stream_calls.current_stream(torch.device("cuda", 0)) is first
    fake.current[1] = 8
    assert _stream_calls.current_stream(torch.device("cuda", 1)) == FakeStream(8, 1)
    fake.device = 1
    assert _stream_calls.current_stream(torch.device("cuda")) == FakeStream(8, 1)
    monkeypatch.setattr(_stream_calls, "CACHED_STREAMS", 3)
    for stream_id in range(10):
        fake.current[0] = stream_id
        assert _stream_calls.current_stream(torch.device("cuda", 0)).stream_id == stream_id
        assert len(_stream_calls._streams) <= 3


def test_torch_cuda_takes_them_once_cuda_is_initialised(fake, monkeypatch):
    monkeypatch.setattr(_cuda, "_FAST_STREAMS", True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    api = _cuda.TorchCuda()
    assert isinstance(api.stream(FakeStream(1, 0)), StreamContext)
    assert api.current_stream(torch.device("cuda", 0)) == FakeStream(0, 0)


def test_no_stream_selects_nothing_as_in_torch(fake, monkeypatch):
    """``torch.cuda.stream(None)`` is a no-op; the C-binding context read ``None.device_index`` on entry."""
    monkeypatch.setattr(_cuda, "_FAST_STREAMS", True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: torch.cuda.StreamContext(stream))
    fake.current = {0: 5, 1: 9}
    with _cuda.TorchCuda().stream(None):
        assert (fake.device, fake.current) == (0, {0: 5, 1: 9})
    assert (fake.device, fake.current) == (0, {0: 5, 1: 9})


def test_a_cpu_build_has_no_bindings_and_keeps_the_wrappers():
    if torch.cuda.is_available():
        pytest.skip("a CUDA build has the bindings")
    assert not _stream_calls.available() and not _cuda._FAST_STREAMS
