import pytest
import torch
from tba.engine import available_backends

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
requires_io_uring = pytest.mark.skipif(
    available_backends()["io_uring"] is not None,
    reason=f"io_uring unavailable: {available_backends()['io_uring']}",
)
