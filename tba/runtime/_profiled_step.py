"""One profiled step of the adaptive policy, measured from its entry to the next entry.

While a :class:`~tba.runtime._runner.PolicyRunner` profiles, every step offloads every layer and
its :class:`ProfiledStep` measures it, in four calls:

1. :meth:`~ProfiledStep.start`, as the offloader is entered: a
   :class:`~tba.runtime._timer.LayerTimer` goes on the layers (on a GPU each stamp waits for the
   current stream, :func:`stream_sync`, Note [Layer time on a GPU] in ``tba/runtime/_timer.py``),
   the offloader's counters are read, the wall clock and the entering thread's CPU clock are noted
   and the :class:`~tba.runtime._peak.StepPeak` starts.
2. :meth:`~ProfiledStep.note_shape`, from the first layer's forward pre-hook: the step's input
   shape, and a hook on its first input that requires grad (else on its first output that does:
   Note [The peak stops where backward ends]), where backward ends and the peak stops.
3. :meth:`~ProfiledStep.end_forward`, as the offloader exits: the timer comes off the layers and
   forward's times, the layers' input bytes, the largest live storage, the window and the bytes
   still unwritten are noted (a step that failed is dropped).
4. :meth:`~ProfiledStep.finish`, at the next entry (that step's backward has run by then): its
   backward times, its span, its period since the entry (wall-clock, and CPU seconds when the
   same thread enters again: Note [The rest of the step] in ``tba/runtime/_profiling.py``) and its
   peak complete the sample, which :meth:`~tba.runtime._profiling.Samples.collect` takes with the
   offloader's counters of that moment.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tba.runtime._compiled_call import add_layer_hook
from tba.runtime._input_signature import tensors_in
from tba.runtime._layer_hooks import LayerHook
from tba.runtime._peak import StepPeak
from tba.runtime._profiling import StepCounters
from tba.runtime._timer import LayerTimer

COMPILING_STEPS_DROPPED = 1
"""At most this many steps that compiled are dropped, the cold compile: a ``block.compile()`` block compiles again at
every profiled step (its graph guards on the timer's hooks on the layer), and a program may compile something new at
every step; dropping those too would delay or forbid the plan."""


class ProfiledStep:
    """The profiled step of one runner that is still being measured (at most one at a time)."""

    def __init__(self) -> None:
        self.timer = LayerTimer([])
        self.peak = StepPeak()
        self.pending: dict[str, Any] | None = None
        """The step's sample: begun at entry, None when no profiled step is being measured."""
        self._unpacks: dict[int, int] = {}
        """Saved tensors unpacked in this step's backward: the identity of what pack returned -> the graph task
        (Note [A saved tensor unpacked twice in one backward])."""
        self._compiling_dropped = 0
        """Profiled steps dropped because torch.compile compiled in them (Note [A step that compiles is no sample])."""
        self._output_hook: Any = None
        """The first layer's forward hook that puts the peak's stop on its output (Note [The peak stops where backward
        ends]), until it runs."""

    def set_layers(self, layers: list[nn.Module]) -> None:
        """Time these layers from the next profiled step on."""
        self.timer = LayerTimer(layers)

    def start(self, counters: Callable[[], StepCounters], shape: tuple | None, thread: int | None, *, first: bool,
              synchronize: Callable[[], None] | None, cuda: bool, release: bool) -> None:
        """Begin measuring a step (``first``: the runner's first step; ``release``: its last profiled one)."""
        self.timer.reset()
        self._unpacks.clear()
        self.timer.synchronize = synchronize
        self.timer.attach()
        start = counters()
        # The step's own counters: a one-shot context's next step counts in a new offloader.
        self.pending = {"start": start, "shape": shape, "counters": counters,
                        "entered_at": (time.perf_counter(), thread_cpu_s(thread), thread),
                        "first": first, "compiled": compilations()}
        self.peak.start(start.pool_idle_bytes, cuda=cuda, release=release)

    def note_unpack(self, packed: object, layer: int | None) -> None:
        """Backward unpacked ``packed``, saved in ``layer``; a second unpack in one backward marks the layer not recomputable.

        Note: [A saved tensor unpacked twice in one backward]
        A custom Function whose backward reads ``ctx.saved_tensors`` twice, or a hook reading a node's
        ``_saved_self`` before the node runs, unpacks one saved tensor twice in one backward: legal without
        tba, and under offload or keep. Torch's non-reentrant checkpoint hands each recomputed tensor out
        once and raises its CheckpointError at the second unpack, so the adaptive default, which profiles
        offloading everything, planned such a layer recomputed and training failed at the first planned
        step. The profiled steps see every unpack and mark the layer not recomputable; a pinned plan that
        recomputes it still gets torch's error (docs/api.md).
        """
        if self.pending is None or layer is None or layer >= len(self.timer.changes_input):
            return
        task = torch._C._current_graph_task_id()
        if task == -1:  # outside backward: checkpoint recomputes for each such unpack
            return
        key = id(packed)
        if self._unpacks.get(key) == task:
            self.timer.changes_input[layer] = True
        self._unpacks[key] = task

    def note_shape(self, shape: tuple, layer: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """The first layer's inputs: the step's shape, and where its backward will end.

        Note: [The peak stops where backward ends]
        The peak is read once the backward pass has finished (a callback queued from a gradient hook
        runs then). The hook went on the first layer's first input that requires grad; a model whose
        first layer takes the batch itself (an MLP on features, no embedding before it) has none, and
        the peak was read only at the next step's entry. Whatever ran in between counted, and a
        measurement of the user's own that reset the kernel's peak counter in between (``rok``'s, around
        every step) erased the step's peak: under glibc an uneven 6-block MLP's offload-all step read
        11-23 MiB where 73 MiB were resident at its peak, the slack came out 0, and budgets of 53-95 MiB
        were planned into peaks 1.11-1.36x over them. Such a layer's first output that requires grad
        (its parameters give it one) carries the hook instead; only a step with neither still stops at
        the next entry.
        """
        self.pending["shape"] = shape
        first = _needing_grad((*args, *kwargs.values()))
        if first is not None:
            first.register_hook(self.peak.stop_after_backward)
            return

        def on_output(module: nn.Module, inputs: tuple, output: Any) -> None:
            self._drop_output_hook()
            tensor = _needing_grad(output)
            if tensor is not None and self.pending is not None:
                tensor.register_hook(self.peak.stop_after_backward)

        self._drop_output_hook()
        self._output_hook = add_layer_hook(layer, LayerHook(on_output), pre=False)

    def _drop_output_hook(self) -> None:
        """Take :meth:`note_shape`'s hook off the first layer (it ran, or forward ended or failed without it)."""
        if self._output_hook is not None:
            self._output_hook.remove()
            self._output_hook = None

    def cancel(self) -> None:
        """Stop measuring the step, which leaves no sample (its first layer found a shape with a plan to follow)."""
        self.timer.detach()
        self._drop_output_hook()
        self.pending = None
        self._unpacks.clear()

    def end_forward(self, failed: bool, on_cuda: Callable[[], bool], largest_live_storage_bytes: Callable[[], int],
                    window_bytes: int, backlog_bytes: Callable[[], int] | None) -> None:
        """Note forward's measurements as the offloader exits (a failed step is dropped)."""
        self._drop_output_hook()
        if self.pending is None:
            return
        self.timer.detach()
        self.timer.check_inputs_after_forward()
        self.timer.check_state_after_forward()
        if failed or not self.timer.ran_with_grad:
            # Note: [A forward without grad is no sample]
            # A forward under torch.no_grad() or inference mode (a validation pass, a trainer's sanity
            # check before training) saves nothing and has no backward. Counted as a profiled step, it
            # gave every layer 0 saved bytes: a memory budget of 40 MiB then planned keep-all for a
            # model whose training steps kept 27 MiB beside 16 MiB of transient buffers, silently over
            # the contract (a review found it with two no-grad passes before training). It is dropped,
            # like a failed step, and the next step is profiled instead.
            self.pending = None
            return
        self.pending["forward_s"] = list(self.timer.forward_s)
        self.pending["forward_cpu_s"] = list(self.timer.forward_cpu_s)
        self.pending["cpu_times"] = not on_cuda()
        self.pending["input_bytes"] = list(self.timer.input_bytes)
        self.pending["changes_input"] = list(self.timer.changes_input)
        self.pending["max_storage"] = largest_live_storage_bytes()
        self.pending["window_bytes"] = window_bytes
        self.pending["backlog_bytes"] = backlog_bytes() if backlog_bytes is not None else None

    def finish(self, thread: int | None = None) -> dict[str, Any] | None:
        """The step's sample, complete, once its backward has run; None when no step reached its exit.

        ``thread``: the training thread entering the next step."""
        pending, self.pending = self.pending, None
        self._unpacks.clear()
        if pending is None or "forward_s" not in pending:
            return None
        self.peak.stop()
        awaiting = self.timer.awaiting_grad
        if awaiting and not self.timer.gradient_reached() and all(hook() is None for hook in awaiting):
            # Note: [A step whose loss was dropped is no sample]
            # A forward with grad whose loss is dropped (an evaluation pass left with grad enabled, a NaN loss
            # skipped, a loop left early) has no backward. Counted as a profiled step, it gave the profile its saved
            # bytes and its peak: an eval-mode pass as the last profiled step (no dropout masks saved, no backward's
            # buffers) gave 1.5 MiB a layer and an 8 MiB peak where training steps saved 2 MiB a layer and peaked at
            # 13-21 MiB, and a memory budget's plan predicted 10.9 MB for keep-all where training needed 16.5 MB:
            # a budget planned under the memory its steps take. Like a forward without grad (Note [A
            # forward without grad is no sample]) it is dropped and the next step is profiled instead. Only once
            # the graph is gone (the gradient hooks on the layers' outputs, which it holds, were freed without
            # running): a micro-batch whose backward comes after the next entry (accumulation, 1F1B) is still a
            # sample, as before.
            return None
        if pending.pop("compiled") != compilations() and self._compiling_dropped < COMPILING_STEPS_DROPPED:
            self._compiling_dropped += 1
            return None  # Note [A step that compiles is no sample]
        pending["changes_input"] = list(self.timer.changes_input)  # as backward found them too
        pending["backward_s"] = self.timer.backward_s()
        pending["backward_cpu_s"] = self.timer.backward_s(cpu=True)
        pending["span_s"] = self.timer.span_s()
        pending["span_cpu_s"] = self.timer.span_cpu_s()
        pending["span_preempted_s"] = self.timer.span_preempted_s()
        wall, cpu, entered_by = pending.pop("entered_at")
        pending["period_s"] = time.perf_counter() - wall
        now = thread_cpu_s(thread) if thread == entered_by else None  # one thread's clock, or none
        pending["period_cpu_s"] = now - cpu if now is not None and cpu is not None else None
        pending["peak_bytes"] = self.peak.peak_bytes
        return pending


def compilations() -> int:
    """How many frames and graphs ``torch.compile`` has compiled in this process so far (0 before it is imported).

    Note: [A step that compiles is no sample]
    A step in which ``torch.compile`` compiled (a compiled block's first step, its backward's first run, a new
    input shape) measured the compiler, not the model: on CPU, Dynamo's tracing and inductor took some 30 MiB of
    the process's memory, which the profile took for transient buffers, so a per-block compiled GPT whose eager
    steps fit in 8 MiB was refused ``memory_budget="24MiB"`` as "needs at least 40.2 MiB" (helper-154). Like a
    step without grad (Note [A forward without grad is no sample]) it is dropped, and the next step is profiled
    instead, only the first such step (:data:`COMPILING_STEPS_DROPPED`). Dynamo's frames and AOTAutograd's and inductor's graphs
    (a backward is compiled at its first run) are counted, cache hits too. tba's own hooks must not make Dynamo
    compile again at every profiled step (Note [One global hook key across profiled steps] in
    ``tba/runtime/_outside.py``), or no step would be a sample.
    """
    if "torch._dynamo.utils" not in sys.modules:
        return 0
    counters = sys.modules["torch._dynamo.utils"].counters
    inductor = counters.get("inductor", {})
    return (counters.get("frames", {}).get("total", 0) + counters.get("aot_autograd", {}).get("total", 0)
            + inductor.get("fxgraph_cache_miss", 0) + inductor.get("fxgraph_cache_hit", 0))


def stream_sync(device: torch.device | None) -> Callable[[], None] | None:
    """What the timer calls before each stamp: the current stream's synchronisation on a GPU
    (Note [Layer time on a GPU] in ``tba/runtime/_timer.py``), nothing on the CPU (``device`` None)."""
    if device is None:
        return None

    def synchronize() -> None:
        if not torch.cuda.is_current_stream_capturing():  # a graph being captured may not synchronise
            torch.cuda.current_stream(device).synchronize()

    return synchronize


def thread_cpu_s(thread: int | None) -> float | None:
    """CPU seconds of thread ``thread`` (a :func:`threading.get_ident`) so far, read from any thread;
    None when unknown (no thread given, no per-thread clock on this platform, the thread is gone)."""
    if thread is None or not hasattr(time, "pthread_getcpuclockid"):
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread))
    except (OSError, OverflowError):
        return None


def _needing_grad(values: Any) -> torch.Tensor | None:
    """The first tensor in ``values`` (in the tuples, lists, dicts and dataclasses it holds too: Note [An input
    shape is read inside containers] in ``tba/runtime/_input_signature.py``) that requires grad, else None."""
    return next((v for v in tensors_in(values) if v.requires_grad), None)
