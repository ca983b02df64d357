"""What the planner knows about a model: per-layer costs and the disk's bandwidth.

A :class:`Profile` is plain data (JSON round-trip): per layer ``i`` its forward time ``f_i``, the
bytes of distinct storages it saves for backward ``s_i`` (after dedup, as tba would write them),
the bytes of its inputs ``x_i`` (what a recomputed layer still holds) and its backward time
``b_i``; plus the engine's write and read bandwidth and the largest single storage.

:class:`tba.runtime.LayerTimer` (``tba/runtime/_timer.py``) measures them during a real step:

* forward: a forward pre-hook and a forward hook on every layer take ``time.perf_counter()``;
* backward (measured, not estimated): the pre-hook puts a gradient hook on the layer's input and
  the forward hook one on its output; ``b_i`` is the time between the gradient reaching the
  layer's output and reaching its input. Where a layer's input or output does not require grad,
  ``b_i`` is estimated as ``2 * f_i`` and the profile says so (``backward_measured=False``).

Times are wall-clock on the host; on CUDA they are only meaningful after a synchronising step and
count launch time, not kernel time (a known limitation). The bytes come from the offloader's own
accounting (``Offloader.layer_saved_bytes``) and the bandwidths from its stats.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from tba.defaults import POLICY_MAX_WINDOW_BYTES
from tba.errors import TbaConfigError

BACKWARD_ESTIMATE_FACTOR = 2.0


def _require_finite(name: str, value: float, unit: str) -> None:
    """Raise TbaConfigError (a ValueError) unless ``value`` is a finite number >= 0.

    Note: [A profile the model cannot price]
    The planner is pure and trusts its profile, which may be synthetic (``tba.policy.plan`` on a
    profile built by hand or loaded from JSON). A NaN passed every ``x < 0`` check and every
    comparison of the search came out false: a NaN memory slack made each prediction NaN and a
    budget's plan "fit" at nan bytes, NaN layer times planned RRK for the default goal, a negative
    forward made recomputing look faster than keeping (RRR, "fits"), negative bytes predicted a
    peak of 0. Such values are refused where the profile is built. The measured ones cannot be:
    a layer that returns its own input gets its input's gradient hook called before its output's
    (both are one tensor), a backward of about -0.2 ms, which ``tba/runtime/_profiling.py`` clamps.
    """
    if not 0 <= value < math.inf:
        raise TbaConfigError(f"{name} must be a finite number >= 0 ({unit}), got {value!r}")


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """One layer's costs. Times in seconds, sizes in bytes."""

    forward_s: float
    saved_bytes: int
    input_bytes: int = 0
    backward_s: float | None = None
    backward_measured: bool = False
    recomputable: bool = True
    """False when the layer's forward changed one of its inputs in place while profiled: a plan never
    recomputes it (Note [A recomputed layer must not change its input] in ``tba/runtime/_recompute_inputs.py``)."""

    def __post_init__(self) -> None:
        _require_finite("forward_s", self.forward_s, "seconds")
        if self.backward_s is None:
            object.__setattr__(self, "backward_s", BACKWARD_ESTIMATE_FACTOR * self.forward_s)
            object.__setattr__(self, "backward_measured", False)
        _require_finite("backward_s", self.backward_s, "seconds")
        _require_finite("saved_bytes", self.saved_bytes, "bytes")
        _require_finite("input_bytes", self.input_bytes, "bytes")


@dataclasses.dataclass(frozen=True)
class Profile:
    """Per-layer costs in forward order, and the I/O engine's speed.

    Attributes:
        layers: One :class:`LayerProfile` per layer, in forward order.
        write_bytes_per_s / read_bytes_per_s: Engine bandwidth to and from the spill file.
        max_storage_bytes: The largest single saved storage (a prefetch window must hold one).
        prefetch_depth_layers: Layers read ahead in backward, as configured on the offloader.
        max_window_bytes: The offloader's prefetch budget; a plan never sets a larger window.
        memory_slack_bytes: Measured activation peak of the profiled steps minus the model's
            prediction for them (never negative): transient buffers and allocator slack the model
            leaves out, added to every memory prediction as measured.
        memory_headroom_per_io_byte: Headroom added to a memory prediction per byte of the
            placement's peak that the disk's speed moves (its write backlog and read buffers:
            ``tba.policy._memory.io_bytes``), never negative: the profiled placement's share of
            :data:`tba.defaults.PEAK_HEADROOM`, over its own such bytes, so that a placement
            with no I/O (keep-all) gets none (Note [Headroom scales with a plan's I/O] in
            ``tba/runtime/_profiling.py``).
        io_overhead_s_per_byte: Measured time of the profiled steps beyond the model's prediction for
            them, per spilled byte (never negative): what offloading costs that the model leaves out
            (CPU taken from compute by tba's threads), added per spilled byte to every time
            prediction.
        read_stall_credit_s_per_byte: Seconds per spilled byte by which the model's read stall for
            the profiled steps exceeded all the I/O time they measured (Note [I/O time is measured
            within one step] in ``tba/runtime/_profiling.py``), taken off every placement's stall
            (never below zero), so that a smaller window still costs what the model adds for it;
            0 when the stall was within the measurement or nothing was measured.
        outside_s: Seconds of a step spent outside what the model times (the head and the loss between
            forward and backward, the optimiser, data loading, the loop until the next step): the
            shortest profiled step's time from one entry to the next, minus its span (the training
            thread's CPU seconds for a model on the CPU, wall-clock seconds on a GPU).
            Added to every placement's step time and to keep-all's alike, so that an overhead bound
            holds for the whole step, as a user times it.
        drain_bytes_per_s: The write bandwidth at which the model leaves as much of offload-all
            unwritten at the end of forward as the profiled step measured (at most
            ``write_bytes_per_s``); None when not measured. A memory budget plans against it, so
            that its contract errs toward memory; other goals use ``write_bytes_per_s`` (Note
            [Slack is calibrated on the measured backlog] in ``tba/runtime/_profiling.py``).
    """

    layers: tuple[LayerProfile, ...]
    write_bytes_per_s: float
    read_bytes_per_s: float
    max_storage_bytes: int = 0
    prefetch_depth_layers: int = 1
    max_window_bytes: int = POLICY_MAX_WINDOW_BYTES
    memory_slack_bytes: int = 0
    memory_headroom_per_io_byte: float = 0.0
    io_overhead_s_per_byte: float = 0.0
    read_stall_credit_s_per_byte: float = 0.0
    outside_s: float = 0.0
    drain_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise TbaConfigError("a profile needs at least one layer")
        # ``not x > 0`` rather than ``x <= 0``: NaN passes the latter (Note [A profile the model cannot price]).
        if not self.write_bytes_per_s > 0 or not self.read_bytes_per_s > 0:
            raise TbaConfigError(f"write_bytes_per_s and read_bytes_per_s must be > 0 (inf: no transfer was timed), got "
                             f"{self.write_bytes_per_s} and {self.read_bytes_per_s}")
        if self.memory_slack_bytes < 0 or self.io_overhead_s_per_byte < 0:
            raise TbaConfigError(f"memory_slack_bytes and io_overhead_s_per_byte must be >= 0 (measured minus predicted, "
                             f"never below zero), got {self.memory_slack_bytes} and {self.io_overhead_s_per_byte}")
        if not self.memory_headroom_per_io_byte >= 0:
            raise TbaConfigError(f"memory_headroom_per_io_byte must be >= 0, got {self.memory_headroom_per_io_byte}")
        if self.read_stall_credit_s_per_byte < 0:
            raise TbaConfigError(f"read_stall_credit_s_per_byte must be >= 0 (modelled minus measured, never below "
                             f"zero), got {self.read_stall_credit_s_per_byte}")
        if self.drain_bytes_per_s is not None and not self.drain_bytes_per_s > 0:
            raise TbaConfigError(f"drain_bytes_per_s must be > 0 or None, got {self.drain_bytes_per_s}")
        if self.outside_s < 0:
            raise TbaConfigError(f"outside_s must be >= 0 (seconds of a step outside the layers), got {self.outside_s}")
        for name in ("memory_slack_bytes", "memory_headroom_per_io_byte", "io_overhead_s_per_byte",
                     "read_stall_credit_s_per_byte", "outside_s"):
            _require_finite(name, getattr(self, name), "a calibration")
        for name in ("max_storage_bytes", "prefetch_depth_layers", "max_window_bytes"):
            _require_finite(name, getattr(self, name), "a count")

    def for_budget(self) -> Profile:
        """This profile with the write bandwidth a memory budget plans against (``drain_bytes_per_s``)."""
        if self.drain_bytes_per_s is None or self.drain_bytes_per_s >= self.write_bytes_per_s:
            return self
        return dataclasses.replace(self, write_bytes_per_s=self.drain_bytes_per_s)

    def to_dict(self) -> dict[str, Any]:
        """This profile as plain values (its layers as dicts), which :meth:`from_dict` reads back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """The profile that :meth:`to_dict` gave."""
        fields = dict(data)
        fields["layers"] = tuple(LayerProfile(**layer) for layer in fields["layers"])
        return cls(**fields)

    def to_json(self) -> str:
        """This profile as JSON, which :meth:`from_json` reads back."""
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        """The profile that :meth:`to_json` wrote."""
        return cls.from_dict(json.loads(text))
