"""Profiled steps of the adaptive policy: samples per input shape, and the profile built from them.

A profiled step runs with every layer offloaded (the placement with the least memory), while a
:class:`~tba.runtime._timer.LayerTimer` times every layer and a
:class:`~tba.runtime._peak.StepPeak` measures the step's activation peak. At the next entry
(backward of that step has run by then) :meth:`Samples.collect` finishes the sample from the
offloader's counters; once ``profile_steps`` samples of one input shape are in,
:meth:`Samples.profile` builds the :class:`tba.policy.Profile` of that shape:

* ``f_i``, ``b_i``: the minimum over the samples (noise from other work only adds time); for a
  model on the CPU, the training thread's CPU seconds, not wall-clock seconds, so that tba's own
  I/O threads, which preempt it on a machine whose cores torch fills, are not counted as compute
  (Note [Compute time under contention] in ``tba/runtime/_timer.py``); for a model on a GPU,
  wall-clock seconds with the stream synchronised at each stamp and the seconds waited inside tba
  left out (Note [Layer time on a GPU]);
* ``io_overhead_s_per_byte`` and ``read_stall_credit_s_per_byte``: the time offloading adds that is not
  compute. On the CPU, measured within each profiled step as its span's wall-clock less the
  training thread's CPU seconds over it, plus what the other compute threads waited for a core
  (Note [I/O time is measured within one step]); the
  shortest of these is the model's read stall first (``read_stall_credit_s_per_byte``: what the
  stall the model predicts for the profiled steps exceeds all of it by), the rest per spilled byte: CPU
  taken from compute by tba's threads, memory bandwidth. On a GPU: what the fastest profiled step
  took beyond the model's prediction for it (offload-all at the window in force), per spilled
  byte. Never below zero;
* ``outside_s``: the shortest of the profiled steps' periods (from the step's entry to the next
  entry) less its span, never below zero: the head, the loss, the optimiser and the loop, which
  every placement pays alike (Note [The rest of the step]);
* ``s_i``: the offloader's ``layer_saved_bytes`` growth over the last sample; the last layer's count
  includes what runs after it (the head and loss), since tba tags storages with the last layer
  entered;
* ``W``, ``R``: bytes over busy seconds of the offloader's write and read clocks over the samples;
  for memory budgets, ``W`` lowered where the last sample's forward left more unwritten than the
  model would (``drain_bytes_per_s``, Note [Slack is calibrated on the measured backlog]);
  the largest storage is read from the offloader's live entries at the end of forward;
* ``memory_slack_bytes``: the last sample's measured peak (``tba/runtime/_peak.py``) minus the
  model's prediction for the profiled placement (offload-all at the window in force, with the
  write backlog measured at the end of that step's forward), never below zero: what the model
  leaves out (compute's transient buffers, gradients, allocator slack), added to every
  prediction as measured;
* ``memory_headroom_per_io_byte``: what taking that peak :data:`tba.defaults.PEAK_HEADROOM` higher
  adds beyond the model's prediction with the slack, over the bytes of the profiled placement's
  peak that move with the disk (its backlog and read buffers, :func:`tba.policy.io_bytes`): each
  plan is charged it per such byte of its own, so offload-all at the profiled window is predicted
  at the peak taken ``PEAK_HEADROOM`` higher, as before, and keep-all at the model plus the slack
  (Note [Headroom scales with a plan's I/O]). The calibration holds at the profiled window, not above it (a larger
  window measured more than the model adds for it), so plans use windows up to the profiled one
  (at least two of the largest storage).

Note: [Headroom scales with a plan's I/O]
Offload-all's peak varies from step to step with the disk: how much of forward's writes are still
queued when backward starts, how many reads the window has in flight. ``PEAK_HEADROOM`` covers that
(later steps of offload-heavy plans peaked up to 1.26x the profiled one). It was once folded into
the slack and added to every plan, keep-all included, whose peak has no I/O in it to vary, and
whose prediction then exceeded what keep-all measures: on an uneven 6-block MLP (keep-all
120.9 MiB) a 90.7 MiB budget was refused, the model claiming at least 125.3 MiB (plan ``OSSSSK``),
where full recompute measured 87.4 MiB and offloaded recompute 70.9 MiB; on the ``small`` preset a
budget of 1.1x keep-all's 232 MiB was planned ``RKKKKK``, keep-all being predicted above it; a
synthetic 6-block model whose offload-all saved nothing (40 of 43 MiB still queued) refused 1.1x
keep-all's 46 MiB, claiming 61.2 MiB. The slack is now the measured excess alone, and the headroom is
charged in proportion to the bytes of a plan's peak that the disk moves (``io_bytes``: backlog plus
the most read buffers held at once) against the profiled placement's: a plan with half of
offload-all's I/O gets half of its headroom, and one with none (keep-all, recompute only) is
predicted at the model plus what was measured. The least a refusal names is then no more than
keep-all's prediction.

Note: [Slack is calibrated on the measured backlog]
The model's write backlog (bytes not yet written when forward ends) is its least certain term:
forward times are the training thread's CPU seconds, a lower bound, and the write bandwidth is
bytes over the seconds writes were busy, not the rate forward saw them drain. On a model whose
layers run in a few milliseconds the model could put nearly every offloaded byte of offload-all
in the backlog, or none. Calibrated against that guess, the slack came out near zero although the
step's transient buffers were several MiB, and placements with less backlog were predicted that
much too low: on the ROK test model (3 layers of about 10 MiB) the plan ``OKK`` was predicted at
28.0 MiB for a 28.8 MiB budget and measured 32.8-34.5 MiB, in about one run in ten. So the
offloader reports the bytes still unwritten when a profiled forward ends, and

* the slack is calibrated against the model with that backlog in place of its own;
* a memory budget plans with the write bandwidth lowered, when needed, to the one at which the
  model leaves at least that backlog for offload-all (``Profile.drain_bytes_per_s``), so that
  every plan's backlog comes from a write queue that drains no faster than the one measured (the
  write bandwidth enters only the backlog, which writes are hidden, and the write caps; never a
  step time). With it, 14 runs of that model's 90% budget: none over, 2 refused.

Other goals keep the measured bandwidth: the lowered one is offload-all's, whose many writes
compete with each other and with compute, and it is pessimistic for plans that write less. On
``make demo``'s ``small`` preset it made the default goal's model say that offloading a second
layer saved nothing, and the plan went from ``OOKKKK`` (measured 0.79x keep-all's peak) to
``OKKKKK`` (0.95x).

Note: [I/O time is measured within one step]
The model's keep-all is the sum of the layers' compute, each layer's shortest over the profiled
steps; an offloaded placement adds I/O time to it. That I/O time was once the fastest profiled
step's span less the model's prediction for it, which also counted the step-to-step noise of
compute: a sum of per-layer minima is shorter than any one step's compute. On the ``bench`` preset
(8 layers, about 3.3 s a step on the 2-core VM) the fastest span was 0.27 s beyond the compute
minima, of which the step's own wall-clock less its training thread's CPU seconds was 0.14 s; a
keep-all step's is 3-12 ms. The within-step difference leaves the noise of compute out. It misses
what a preempted OpenMP partner costs, which the training thread spends spinning at a barrier
(CPU seconds, not a gap): that is measured as the partner's run-queue wait (Note [A preempted
partner costs the training thread CPU time] in ``tba/runtime/_preempted.py``). With both, the
I/O time of an offload-all step came to 0.20-0.29 s (6-9%), as much as it measured slower than
keep-all's steps alternating with it.
It is also an upper bound on the read stall: where the model's stall for the profiled steps is
longer (it was 0.21 s, from the window exposure fitted on the ``small`` preset's 36 MiB layers,
on 120 MiB layers whose reads run 3x faster than backward consumes them), the excess is a credit
per spilled byte, taken off every placement's stall: what the model adds for a window smaller
than the profiled one still counts in full.

Note: [The rest of the step]
A period is known only once the next step enters, so a loop that does other work between steps
makes only that step's figure longer, and the shortest one is kept. Three things the profiled
(offload-all) steps add there are not the rest of a keep-all step, and each would make overheads
look smaller than they are, since the rest is added to keep-all's time too:

* tba's I/O threads preempting the training thread during the head, the loss and the optimiser: on
  the CPU the rest is the training thread's CPU seconds, as for ``f_i`` and ``b_i`` (measured on a
  4-layer GPT, five runs: 34-42 ms of wall-clock rest under offload-all against 25-32 ms under
  keep-all); a wait for data counts nothing there, which errs toward a dearer-looking offload;
* the very first step of a runner, with its one-off costs (the optimiser's state, lazy
  initialisation): its period is not used, so a single profiled first step leaves the rest at 0,
  as before the rest was measured;
* on a GPU, wall-clock seconds (the stream's tail of the step is not synchronised, which errs low).

The *shape* of a step is the shapes and dtypes of the tensors the first layer receives: another
sequence length or batch size is another shape, profiled and planned on its own
(:func:`tba.runtime._input_shapes.signature`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tba.defaults import PEAK_HEADROOM
from tba.policy import OFFLOAD, LayerProfile, Profile, estimate, io_bytes
from tba.runtime._profile_fit import forward_write_bps, io_time


@dataclasses.dataclass(frozen=True)
class StepCounters:
    """What an offloader has counted so far (summed over steps): the runner's only view of it."""

    layer_saved_bytes: dict[int | None, int]
    bytes_written: int
    write_busy_s: float
    bytes_read: int
    read_busy_s: float
    pool_idle_bytes: int = 0
    window_bytes: int = 0


class Samples:
    """The finished samples of profiled steps, by input shape."""

    def __init__(self) -> None:
        self.by_shape: dict[tuple, list[dict[str, Any]]] = {}
        self.collected = 0
        """Samples collected since the last :meth:`clear`, of any shape (the first is the runner's warm-up)."""

    def count(self, shape: tuple | None) -> int:
        return len(self.by_shape.get(shape, []))

    def plannable(self, shape: tuple | None, profile_steps: int) -> bool:
        """Whether ``shape``'s samples suffice for a plan: ``profile_steps`` of them, or one taken after the
        runner's first ``profile_steps`` profiled steps of any shape.

        Note: [A warm step is enough for a new shape]
        A shape was planned after ``profile_steps`` profiled steps of its own, so that the first step
        of a process (lazy initialisation, first-touch page faults, thread pools) was never a plan's only
        measurement. That first step is the process's warm-up, not the shape's: inputs padded per batch
        to a new length at almost every step had to see one length twice before any plan existed (28
        profiled steps on a 4-layer GPT fed lengths 64 to 128 at random), although every step after
        the first was warm. Once the runner has profiled ``profile_steps`` steps of any shapes, one
        sample taken after its first step plans a shape; a fixed shape is planned as before.
        """
        samples = self.by_shape.get(shape, [])
        return len(samples) >= profile_steps or (
            self.collected >= profile_steps and any(not sample.get("first") for sample in samples))

    def clear(self) -> None:
        self.by_shape.clear()
        self.collected = 0

    def collect(self, pending: dict[str, Any], now: StepCounters, layer_count: int) -> None:
        """Finish a profiled step's sample with the counters taken after its backward."""
        start: StepCounters = pending.pop("start")
        saved, before = now.layer_saved_bytes, start.layer_saved_bytes
        pending["saved_bytes"] = [saved.get(i, 0) - before.get(i, 0) for i in range(layer_count)]
        pending["written"] = now.bytes_written - start.bytes_written
        pending["write_s"] = now.write_busy_s - start.write_busy_s
        pending["read"] = now.bytes_read - start.bytes_read
        pending["read_s"] = now.read_busy_s - start.read_busy_s
        self.by_shape.setdefault(pending.pop("shape"), []).append(pending)
        self.collected += 1

    def profile(self, shape: tuple | None, layer_count: int, prefetch_depth_layers: int,
                max_window_bytes: int, wrappable: list[bool] | None = None) -> Profile:
        """The profile of ``shape`` from its samples (see the module docstring); ``wrappable[i]`` False marks
        layer ``i`` not recomputable whatever it did (a ``torch.compile(block)`` wrapper)."""
        samples = self.by_shape[shape]
        cpu = all(s.get("cpu_times") for s in samples)
        forward_key, backward_key = ("forward_cpu_s", "backward_cpu_s") if cpu else ("forward_s", "backward_s")
        layers = []
        for i in range(layer_count):
            # Never below zero: Note [A profile the model cannot price] in tba/policy/_profile.py.
            forward = [max(0.0, s[forward_key][i]) for s in samples if s[forward_key][i] is not None]
            backward = [max(0.0, s[backward_key][i]) for s in samples if s[backward_key][i] is not None]
            layers.append(LayerProfile(
                forward_s=min(forward, default=0.0),
                saved_bytes=samples[-1]["saved_bytes"][i],
                input_bytes=samples[-1]["input_bytes"][i],
                backward_s=min(backward) if backward else None,
                backward_measured=bool(backward),
                recomputable=(wrappable is None or wrappable[i])
                and not any(s.get("changes_input", [False] * layer_count)[i] for s in samples),
            ))
        written, write_s = sum(s["written"] for s in samples), sum(s["write_s"] for s in samples)
        read, read_s = sum(s["read"] for s in samples), sum(s["read_s"] for s in samples)
        profile = Profile(
            layers=tuple(layers),
            write_bytes_per_s=written / write_s if written and write_s else float("inf"),
            read_bytes_per_s=read / read_s if read and read_s else float("inf"),
            max_storage_bytes=max(s["max_storage"] for s in samples),
            prefetch_depth_layers=prefetch_depth_layers,
            max_window_bytes=max_window_bytes,
        )
        last = samples[-1]
        window = max(last.get("window_bytes", 0), profile.max_storage_bytes)
        if last.get("backlog_bytes") is not None:
            # Note: [Slack is calibrated on the measured backlog]
            profile = dataclasses.replace(profile, drain_bytes_per_s=forward_write_bps(profile, last["backlog_bytes"]))
        # One prediction of the profiled placement (offload-all at the window in force, with the backlog
        # measured: Note [Slack is calibrated on the measured backlog]) calibrates both time and memory:
        # neither part of it depends on what the other calibration adds, nor the time on the backlog.
        profiled = estimate(profile, (OFFLOAD,) * layer_count, window, backlog_bytes=last.get("backlog_bytes"))
        overhead, credit = io_time(profile, samples, profiled, cpu)
        profile = dataclasses.replace(profile, io_overhead_s_per_byte=overhead, read_stall_credit_s_per_byte=credit,
                                      outside_s=_outside(samples, cpu))
        if last.get("peak_bytes") is None:
            return profile
        # Note: [Headroom scales with a plan's I/O]
        peak = last["peak_bytes"]
        slack = max(0, peak - profiled.memory_bytes)
        headroom = max(0, int(peak * (1 + PEAK_HEADROOM)) - max(peak, profiled.memory_bytes))
        io = io_bytes(profile, (OFFLOAD,) * layer_count, window, profiled.backlog_bytes)
        return dataclasses.replace(profile, memory_slack_bytes=slack,
                                   memory_headroom_per_io_byte=headroom / io if io else 0.0,
                                   max_window_bytes=min(max_window_bytes, max(window, 2 * profile.max_storage_bytes)))


def _outside(samples: list[dict[str, Any]], cpu: bool) -> float:
    """The shortest profiled step's period less its span (seconds, never below zero; the training
    thread's CPU seconds when ``cpu``), the runner's first step left out; 0 when unknown."""
    period, span = ("period_cpu_s", "span_cpu_s") if cpu else ("period_s", "span_s")
    rests = [s[period] - s[span] for s in samples
             if not s.get("first") and s.get(period) is not None and s.get(span) is not None]
    return max(0.0, min(rests)) if rests else 0.0
