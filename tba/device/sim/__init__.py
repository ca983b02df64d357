"""A simulated CUDA device faithful to CUDA's ordering rules, for CI machines without a GPU.

``with simulate() as sim:`` installs it behind :func:`tba.device.cuda_api`: tba's production CUDA
code (``CudaOps``, the staged and kvikio routes, the pinned pool) then runs unchanged on CPU
tensors, with streams as queues run out of order with adversarial delays, a stream-ordered caching
allocator that poisons freed blocks, and a vector-clock race checker (``sim.problems()``).
:class:`FakeKvikio` stands in for the ``kvikio`` package. See ``docs/gpu.md``.
"""

from tba.device.sim._config import SimConfig
from tba.device.sim._device import SimulatedCuda, simulate
from tba.device.sim._kvikio import FakeKvikio, fake_kvikio

__all__ = ["FakeKvikio", "SimConfig", "SimulatedCuda", "fake_kvikio", "simulate"]
