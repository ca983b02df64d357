"""How adversarial the simulated device is: :class:`SimConfig`, given to :func:`~tba.device.sim.simulate`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """How adversarial the simulated device is."""

    seed: int = 0
    """Seed of every random delay."""
    max_delay_s: float = 0.0005
    """Longest sleep of the scheduler between two device operations."""
    lag_probability: float = 0.02
    """Chance, per operation, that its stream then pauses (a side stream lagging a forward)."""
    max_lag_s: float = 0.02
    """Longest such pause."""
    memory_bytes: int = 256 << 20
    """Size of the simulated device memory (the caching allocator's arena)."""
    track_compute: bool = True
    """Check the model's own operators (a dispatch mode on the entering thread) as compute-stream accesses."""
    lagging_compute: bool = True
    """The compute stream is a queue the scheduler runs, as the others (only with ``track_compute``):
    tba's records, copies and the allocator's poison on it run when the device gets to them, and a
    model operator runs after what is queued before it (Note [The compute stream lags too])."""
