"""Per-layer timings of a real step, for the adaptive policy's profile (``tba.policy.Profile``).

Hooks that change nothing:

* forward: a forward pre-hook and a forward hook on every layer take ``time.perf_counter()``;
* backward (measured, not estimated): the pre-hook puts a gradient hook on the layer's input and
  the forward hook one on its output; ``b_i`` is the time between the gradient reaching the
  layer's output and reaching its input. Where a layer's input or output does not require grad,
  nothing is measured and the profile says so (``backward_measured=False``).

Each stamp also takes ``time.thread_time()``, the CPU seconds of the thread running the hook (the
training thread in forward; in backward the thread autograd runs the layer on, the caller's for
CPU tensors). Note: [Compute time under contention]: on a CPU box whose cores torch already
fills, tba's I/O threads preempt the training thread and the wall-clock time of an offloaded step's
layers grows by what they take (on the 2-core VM the training thread was off its core for about 70
of a 300 ms forward while tba's own threads used 35 ms of CPU). The training thread's CPU time
leaves that out: it is the layer's compute, as it would run without tba. Profiles of CPU models use
it (``tba/runtime/_profiling.py``).

Note: [Layer time on a GPU]
CUDA kernels run asynchronously: without a synchronisation the host's clock measures how long the
layer took to *launch*, and the first wait that fills the queue lands on some later layer. On a GPU
the timer therefore synchronises the current stream at every stamp (``synchronize``; profiled steps
only), so a layer's wall-clock time covers its kernels. The current stream only: tba's copy streams
move bytes meanwhile and must not be counted. It also leaves out the seconds the thread spent
blocked inside tba (:func:`tba._control.waited_s`: a read backward waited for, writes draining),
which are I/O the cost model predicts from bandwidths, not compute. Without that, a profile on the
first GPU it ran on (an H100 writing at 1.9 GB/s) counted every read wait as backward compute, put
keep-all at 21 s per step instead of well under one, and planned recompute everywhere at a
predicted +1%. What the device ran while the thread waited is left out with the wait, so a layer's
time errs low by at most its waits.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tba._control import waited_s
from tba.runtime import _preempted
from tba.runtime._block_entries import entered
from tba.runtime._call_args import call_tensor_versions, updated_cache
from tba.runtime._call_objects import attribute_tensors
from tba.runtime._compiled_call import add_layer_hook
from tba.runtime._compiling import compiling
from tba.runtime._input_signature import tensors_in
from tba.runtime._layer_hooks import measuring_hook
from tba.runtime._layer_state import held_iterator, passed_iterator
from tba.runtime._nested_state import unwatchable
from tba.runtime._outside import OutsideCalls, hooks_run_again
from tba.runtime._private_state import Signature, first_change, private_state
from tba.runtime._recompute import in_dual_level
from tba.runtime._timer_spans import LayerSpans, own_s


def tensor_bytes(values: Sequence[Any]) -> int:
    """Bytes of the distinct storages of the tensors among ``values``."""
    seen: dict[int, int] = {}
    for value in values:
        if isinstance(value, torch.Tensor):
            try:
                storage = value.untyped_storage()
            except (NotImplementedError, RuntimeError):  # a batched tensor of torch.vmap: its logical size
                seen[id(value)] = value.numel() * value.element_size()
                continue
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


class LayerTimer(LayerSpans):
    """Forward and backward time and input bytes of each layer, for one step at a time.

    Wall-clock times leave out the seconds the thread waited inside tba (Note [Layer time on a
    GPU]); :meth:`span_s` does not.

    Args:
        layers: The layers to time.
        synchronize: Called before every stamp (a CUDA model's ``current_stream().synchronize``), or
            None (CPU).
    """

    def __init__(self, layers: Sequence[nn.Module], synchronize: Callable[[], None] | None = None) -> None:
        self._layer_refs = [weakref.ref(layer) for layer in layers]
        self._handles: list[Any] = []
        self._outside = OutsideCalls()
        self.synchronize = synchronize
        self.reset()

    def reset(self) -> None:
        count = len(self._layer_refs)
        self.forward_s: list[float | None] = [None] * count
        self.forward_cpu_s: list[float | None] = [None] * count
        self.input_bytes = [0] * count
        self.changes_input = [False] * count
        """Per layer: its forward changed one of its tensor arguments in place, or private state of its modules
        (it cannot be recomputed)."""
        self.ran_with_grad = False
        """Whether a layer's forward ran with grad enabled (Note [A forward without grad is no sample] in
        ``tba/runtime/_profiled_step.py``)."""
        self._input_versions: list[list[tuple[torch.Tensor, int]]] = [[] for _ in range(count)]
        self._inputs_after: list[tuple[int, weakref.ref, int]] = []
        """Layer index, a tensor of its call (or its base), weakly, and its version when the forward ended (Note [A
        recomputed layer's input changed after its forward])."""
        self._last_inputs: list[tuple[int, torch.Tensor, int]] = []
        """The same for the layer that ran last, held until the next layer's call or the offloader's exit."""
        self._state_after: list[tuple[int, weakref.ref, Signature]] = []
        """Layer index, the layer, weakly, and its private and nested state when its forward ended: a change before the
        offloader exits (the model writing into an object the layers share, between their calls) is read by a
        recomputation, so it marks the layer not recomputable (:meth:`check_state_after_forward`)."""
        self._private: list[Signature] = [[] for _ in range(count)]
        """Per layer: its modules' private state when its forward started (Note [Private state of a recomputed layer])."""
        self._started = [(0.0, 0.0, 0.0)] * count
        self._entries = [0] * count
        """Per layer: this thread's count of tba blocks entered when its forward started (Note [A layer that enters a
        tba block is not recomputed] in ``tba/runtime/_block_entries.py``)."""
        self._ended = [(0.0, 0.0, 0.0)] * count
        self._grad_at_output: list[tuple[float, float, float] | None] = [None] * count
        self._grad_at_input: list[tuple[float, float, float] | None] = [None] * count
        self.awaiting_grad: list[weakref.ref] = []
        """The gradient hooks on the layers' outputs, weakly: alive while their graph is (Note [A step whose loss was
        dropped is no sample] in ``tba/runtime/_profiled_step.py``)."""
        self._marks: dict[str, _preempted.Snapshot | None] = {}
        """Other compute threads' clocks at the span's ends: forward's start and end, backward's (CPU only)."""

    def _mark(self, key: str) -> None:
        # Note [A preempted partner costs the training thread CPU time] in tba/runtime/_preempted.py
        if self.synchronize is None:
            self._marks[key] = _preempted.snapshot()

    def _stamp_now(self) -> tuple[float, float, float]:
        """(wall-clock, thread CPU, seconds waited in tba) now, after the device's queue ran."""
        if self.synchronize is not None:
            self.synchronize()
        return time.perf_counter(), time.thread_time(), waited_s()

    def attach(self) -> None:
        for index, ref in enumerate(self._layer_refs):
            layer = ref()
            if layer is None:
                continue
            # Note [Hooks traced into a whole-model graph do nothing] in tba/runtime/_layer_hooks.py
            self._handles.append(add_layer_hook(layer, measuring_hook(layer, self._pre(index)), pre=True, with_kwargs=True))
            self._handles.append(add_layer_hook(layer, measuring_hook(layer, self._post(index)), pre=False))
        self._outside.attach([ref() for ref in self._layer_refs])

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._outside.detach()
        self._input_versions = [[] for _ in self._input_versions]  # a forward that raised left its inputs here
        self._private = [[] for _ in self._private]

    def _pre(self, index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.check_inputs_after_forward()
            self.ran_with_grad = self.ran_with_grad or torch.is_grad_enabled()
            # Inside containers too: Note [An input shape is read inside containers] in tba/runtime/_input_signature.py.
            self.input_bytes[index] = tensor_bytes(list(tensors_in(args)))
            # Its parameters too: Note [A recomputed layer that changes its own parameters] in tba/runtime/_first_call.py.
            # Not an inference tensor's, which has none (the fast weights of a functional_call under inference_mode:
            # Note [Under inference mode a recomputed layer runs as it is] in tba/runtime/_recompute.py).
            parameters = [(p, p._version) for p in module.parameters() if not p.is_inference()]
            self._input_versions[index] = _versions(args, kwargs) + parameters
            self._private[index] = [] if compiling() else private_state(module)
            if updated_cache(args, kwargs) is not None:  # Note [A layer given a key/value cache is not recomputed]
                self.changes_input[index] = True
            if unwatchable(getattr(self._private[index], "deep", {})) is not None:  # a recomputation would refuse it
                self.changes_input[index] = True  # Note [The walk of nested state] in tba/runtime/_nested_state.py
            if hooks_run_again(module):  # Note [A recomputed forward reaches beyond its layer] in tba/runtime/_outside.py
                self.changes_input[index] = True
            # Note [Under forward-mode AD a recomputed layer runs as it is] in tba/runtime/_recompute.py, Note [An
            # iterator a layer holds is not put back] in tba/runtime/_layer_state.py
            if in_dual_level() or held_iterator(module) is not None or passed_iterator(args, kwargs) is not None:
                self.changes_input[index] = True
            first = next(tensors_in(args), None)
            if first is not None and first.requires_grad:
                first.register_hook(self._stamp(self._grad_at_input, index))
            self._outside.enter(index)
            if index == 0:
                self._mark("forward_start")
            self._entries[index] = entered()
            self._started[index] = self._stamp_now()

        return hook

    def _post(self, index: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            start = self._started[index]
            self._ended[index] = now = self._stamp_now()
            if index == len(self._layer_refs) - 1:
                self._mark("forward_end")
            self.forward_s[index] = own_s(start, now)
            versions, self._input_versions[index] = self._input_versions[index], []
            private, self._private[index] = self._private[index], []
            if self._outside.leave(index) or entered() != self._entries[index]:
                self.changes_input[index] = True
            after = private_state(module) if private else private
            if any(tensor._version != version for tensor, version in versions) or (
                    private and first_change(private, after) is not None):
                self.changes_input[index] = True
            if after:  # Note [State a recomputed layer changes that tba does not put back] in tba/runtime/_private_state.py
                self._state_after.append((index, weakref.ref(module), after))
            parameters = {id(p) for p in module.parameters()}
            self._last_inputs = [(index, t, t._version) for tensor, _ in versions
                                 if id(tensor) not in parameters for t in (tensor, tensor._base) if t is not None]
            self.forward_cpu_s[index] = now[1] - start[1]
            first = next(tensors_in(output), None)
            if first is not None and first.requires_grad:
                stamp = self._stamp(self._grad_at_output, index)
                first.register_hook(stamp)
                self.awaiting_grad.append(weakref.ref(stamp))  # the graph holds it as long as it can run

        return hook

    def _stamp(self, slots: list, index: int):
        start = slots is self._grad_at_output and index == len(self._layer_refs) - 1
        end = slots is self._grad_at_input and index == 0

        def hook(grad: torch.Tensor) -> None:
            if compiling():  # compiled autograd: Note [Hooks traced into a whole-model graph do nothing]
                return
            if slots is self._grad_at_output:
                self.check_inputs_after_forward()
            if slots[index] is None:
                if start:
                    self._mark("backward_start")
                slots[index] = self._stamp_now()
                if end:
                    self._mark("backward_end")

        return hook

    def check_inputs_after_forward(self) -> None:
        """Mark each layer one of whose call's tensors, still alive, was changed in place after its forward ended
        as changing its input.

        Note: [A recomputed layer's input changed after its forward]
        Checkpoint keeps a recomputed layer's inputs and checks their versions at unpack. A model that
        changes a layer's input in place after the layer returned (``h += block(h)`` in its loop, legal
        without tba when the block saves no tensor sharing ``h``'s version counter, a block starting
        with dropout) made the adaptive default plan ``R`` for that block, and the first planned step's
        backward raised torch's in-place error, for a recomputation the user never asked for. The
        timer keeps each call's tensors with their versions when the forward ended, and looks again at
        every later layer's call, as the offloader exits and as backward reaches each layer's output: a
        change marks the layer not recomputable. It holds them weakly (holding every layer's input
        would raise the profiled peak to full recompute's; one no longer referenced anywhere cannot
        change) except the last call's, held until the next call or the exit: the last block's input
        changed by the model's loop dies before the exit (found by a review: ``OOOR`` still raised).
        A change after backward (an input buffer refilled for the next step) is not one.
        """
        held, self._last_inputs = self._last_inputs, []
        alive = []
        for index, ref, version in [*self._inputs_after, *((i, weakref.ref(t), v) for i, t, v in held)]:
            tensor = ref()
            if tensor is None:
                continue
            if tensor._version != version:
                self.changes_input[index] = True
            else:
                alive.append((index, ref, version))
        self._inputs_after = alive

    def check_state_after_forward(self) -> None:
        """As the offloader exits: mark each layer whose private or nested state changed since its forward ended (Note
        [State a recomputed layer changes that tba does not put back] in ``tba/runtime/_private_state.py``), then stop
        watching (a change in backward, or a schedule's after it, is no change of the forward's). Once, at the exit:
        the state a recomputation reads is the state then, whatever it went through between the layers."""
        states, self._state_after = self._state_after, []
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return
        for index, ref, state in states:
            module = ref()
            if module is not None and first_change(state, private_state(module)) is not None:
                self.changes_input[index] = True

    def gradient_reached(self) -> bool:
        """Whether a gradient reached a layer's output in this step's backward so far."""
        return any(stamp is not None for stamp in self._grad_at_output)


def _versions(args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, int]]:
    """The tensors of a layer's call with their versions, as the recompute check sees them
    (:func:`~tba.runtime._call_args.call_tensor_versions`); none while a compiled graph is traced (a layer inside
    a whole-model graph: it is not watched here, and its recomputation still raises at once). A layer compiled on its
    own runs tba's hooks outside its graph (Note [Hooks traced into a whole-model graph do nothing])."""
    if compiling():
        return []
    return [(tensor, version) for _, tensor, version in call_tensor_versions(args, kwargs, attribute_tensors)]
