"""Recompute chosen layers in backward with non-reentrant ``torch.utils.checkpoint``.

A recomputed layer saves only its inputs during forward; its internals are computed again in
backward. Where its inputs live is the placement's: a ``recompute`` layer keeps them in memory, as
plain checkpoint does; an ``offloaded_recompute`` layer saves them through tba, which writes them
to the spill file and reads them back (prefetched) for the recomputation (Note [Hook nesting of a
recomputed layer]). RNG state is preserved (torch's, Python's and numpy's global generators, and
the layer's own: Note [Generators of a recomputed layer]), so dropout masks are identical in the
recomputation. Under CUDA memory history
or the CUDA sanitizer, each recomputation runs the layer to its end (Note [Recomputation runs to the end]
in ``tba/runtime/_early_stop.py``).

Note: [Hook nesting of a recomputed layer]
Saved-tensor hooks form a per-thread stack and autograd uses only the top pair. Non-reentrant
checkpoint saves the layer's tensor arguments (``_CheckpointFrame.save_inputs``, or
``_NoopSaveInputs`` in older torch) *before* it pushes its own pair, so those saves go to whatever
pair was on top when the layer was called: tba's, inside ``with offloader:``. It then pushes its
pair for the layer's forward: every tensor saved inside is replaced by a placeholder and dropped,
whatever pairs lie below, so nothing inside the layer reaches tba. In backward, the first unpack
of a placeholder runs the recomputation under checkpoint's recomputation pair, again on top: the
rebuilt internals stay in memory, never offloaded a second time, even when backward runs inside
the ``with`` block. So:

* ``offloaded_recompute`` calls checkpoint with tba's pair on top: the inputs are offloaded like any
  saved tensor (below ``min_offload_bytes``, or parameters, they stay in memory), tagged with the
  layer (its forward pre-hook has run), and read back when backward reaches the layer. Checkpoint
  saves only *top-level* tensor arguments; tensors in keyword arguments or nested in tuples would
  stay referenced by its closure, in memory. The wrapper therefore passes every tensor argument,
  keyword ones and those in lists, tuples and dicts too, as a top-level argument and rebuilds the
  call inside, so each one is saved, and offloaded, on its own (Note [A recomputation gets the call
  as it was] in ``tba/runtime/_call_args.py``); a view stays a view of its storage (tba writes the
  storage once and rebuilds the view). A ``recompute`` layer's are taken apart the same way.
* ``recompute`` pushes a pair of its own around the checkpoint call, so its inputs are held by
  autograd as without tba (the cost model counts them as held; tba's stats do not see them); the
  pair checks their versions at unpack, as autograd does without hooks, and raises a TbaError
  naming the layer (Note [A recomputed layer's input changed before backward] in
  ``tba/runtime/_recompute_inputs.py``). ``offloaded_recompute`` pushes one above tba's that passes
  each input to tba's pack and unpack and makes the same check first.
* When the pair on top is neither tba's nor a checkpoint's (another hooks context inside tba's, such
  as ``save_on_cpu`` or a memory meter), or there is none (recomputation without an offloader, as
  ``python -m tba`` benchmarks' full recompute runs it), an ``offloaded_recompute`` layer runs as
  ``recompute``: its inputs are kept in memory by the pair ``recompute`` pushes on top, and its
  internals are dropped as planned. Under ``allow_mutation_on_saved_tensors()``'s pair, which clones a
  saved tensor before an in-place change, either placement gives the inputs to that pair instead, as
  plain checkpoint does: the pair pushed above took them from it, and changing a recomputed layer's
  input after its forward, legal there (and exact without tba), raised torch's in-place error in backward.

Note: [Inside a user's checkpoint a recomputed layer runs as it is]
When the pair on top is torch's non-reentrant checkpoint's (the user's own checkpoint around the
layer, in its forward or in its recomputation), a recomputed layer runs its forward as it is,
unwrapped: what it saves goes to that checkpoint, as without tba. The user's checkpoint recomputes
its segment in backward, usually after the ``with`` block has ended and tba's wrapper is gone, and
matches the recomputation's saves to forward's by their order: a forward that ran tba's checkpoint
(its inputs kept by tba's pair, its internals dropped) saved in another order than the plain
recomputation. Two blocks in one user segment with the first recomputed by tba (``RKKK``) gave
silently wrong gradients (a review found it), torch's metadata error when shapes differed; an
``offloaded_recompute`` layer's inputs saved into the user's frame did the same. The user's
checkpoint already drops the layer's internals, so nothing is held that tba's would not hold.
Under any other pair tba still recomputes (a review found a pass-through pair, unwrapped, holding a
whole all-``R`` plan's internals: 7.5 MB instead of 131 kB).

What a recomputed layer's forward reads and changes besides its inputs (buffers, attributes, generators)
is copied and put back by ``tba/runtime/_layer_state.py``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import nn
from torch.utils.checkpoint import checkpoint

from tba.runtime._call_args import call_tensor_versions, refuse_cache, take_apart
from tba.runtime._call_objects import attribute_tensors
from tba.runtime._checkpoint_errors import named_errors
from tba.runtime._compile import check_compiled_autograd_backend, is_compiled_module
from tba.runtime._compiling import compiling
from tba.runtime._early_stop import checkpoint_keywords
from tba.runtime._first_call import FirstCall
from tba.runtime._generators import set_states, states_now, unknown_draws_refused
from tba.runtime._global_settings import settings_now, switch_to
from tba.runtime._layer_hooks import Recomputing
from tba.runtime._layer_restore import restore
from tba.runtime._layer_state import snapshot
from tba.runtime._learned import Learned, learned_for
from tba.runtime._outside_state import first_call as outside_first_call
from tba.runtime._overlap import Use
from tba.runtime._pairs import is_checkpoint_pair, is_mutation_pair, is_tba_pair
from tba.runtime._private_state import (
    DeepLabel,
    check_private_unchanged,
    check_restorable,
    check_watchable,
    first_change,
    private_state,
    put_back_nested,
)
from tba.runtime._recompute_inputs import check_inputs_unchanged, inputs_left_alone, saved_as_bases, watched_inputs
from tba.runtime._search_reads import kept_searches
from tba.runtime._wrappable import check_wrappable

_functorch_level = torch._C._functorch.maybe_current_level
"""The level of the innermost torch.func transform running (None outside every one)."""


class RecomputeLayers:
    """Wraps ``layers``' forward with checkpoint until :meth:`remove` (or the ``with`` block ends).

    Args:
        layers: The layers to recompute.
        indices: Their indices in the model's layers (for messages). Default: 0, 1, ...
        offload_inputs: Per layer (or one value for all): save its inputs through the hooks below
            (tba's: ``offloaded_recompute``) instead of keeping them in memory (``recompute``).
            Default False.
        thread: The identity of the training thread whose context this is, for messages. Default: the
            calling thread.

    Raises:
        TbaConfigError: a layer cannot be wrapped (``tba/runtime/_wrappable.py``): it is inside another
            recomputed one, another context wraps it, it is compiled, or its ``forward`` is set on the
            instance (patched by hand or by another tool) and wrapping it would hide that one.
    """

    def __init__(self, layers: Iterable[nn.Module], indices: Iterable[int] | None = None,
                 offload_inputs: bool | Iterable[bool] = False, thread: int | None = None) -> None:
        layers = list(layers)
        thread = threading.get_ident() if thread is None else thread
        indices = list(indices) if indices is not None else list(range(len(layers)))
        offload = [offload_inputs] * len(layers) if isinstance(offload_inputs, bool) else list(offload_inputs)
        check_wrappable(layers, indices, thread)
        self.layers = layers
        for layer, index, spill in zip(self.layers, indices, offload):  # Note [A copy of a hooked layer holds none of tba's]
            layer.forward = Recomputing(layer, _checkpointed(layer, index, layer.forward, spill), thread)

    def remove(self) -> None:
        for layer in self.layers:
            if "forward" in vars(layer):
                del layer.forward
        self.layers = []

    def __enter__(self) -> RecomputeLayers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _checkpointed(layer: nn.Module, index: int, forward: Any, offload_inputs: bool) -> Any:
    # Note [A generator search is reused while what it read holds] in tba/runtime/_search_reads.py
    first_search, again_search = kept_searches(layer)

    def first_or_again(calls: list[int], first: FirstCall, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        use = Use("first call" if calls[0] == 1 else "recomputation", layer, watch=calls[0] > 1 and not compiled_within)
        try:  # Note [A recomputation and a first call of its state in two threads] in tba/runtime/_overlap.py
            modules = [*layer.modules(), *(state.module for state in first.outside)]
            use.begin(modules)
            if calls[0] == 1:
                return first_call(first, use, learned_for(layer), *args, **kwargs)
            return again(first, learned_for(layer), modules, *args, **kwargs)
        finally:
            use.end()
            use.check()  # here too when torch's early stop ends the recomputation with an exception

    def first_call(first: FirstCall, use: Use, learned: Learned, *args: Any, **kwargs: Any) -> Any:
        refuse_cache(layer, args, kwargs)
        first.start(layer, args, kwargs, learned, first_search)
        inputs, private = call_tensor_versions(args, kwargs, attribute_tensors), private_state(layer)
        check_watchable(layer, private.deep)  # Note [The walk of nested state]
        if compiled_within:
            out = forward(*args, **kwargs)
        else:  # Note [A recomputation puts back the modules outside its layer that it calls] in tba/runtime/_outside_state.py
            out = outside_first_call(layer, learned, first, private, forward, args, kwargs, use)
        first.private, first.nested = (private_state(layer, outside=first.outside_groups) if private else []), private
        change = first_change(private, first.private) if private else None
        if isinstance(change, DeepLabel):  # Note [Nested state a recomputation is given back]: or raises
            check_restorable(layer, private.deep, first.private.deep)
            change = None
        check_inputs_unchanged(layer, inputs, change)
        first.settle(layer, learned)
        return out

    def again(first: FirstCall, learned: Learned, modules: list[nn.Module], *args: Any, **kwargs: Any) -> Any:
        first.check_unchanged(layer)
        check_private_unchanged(layer, first.private, first.outside_groups)
        after = snapshot(modules, learned)
        after_generators = states_now(first.generators)
        # Note: [A recomputation runs under the first call's default dtype]
        # torch.set_default_dtype is process-wide: a program that changed it between forward and
        # backward had the recomputation create its tensors (torch.linspace, torch.tensor(0.1)) in
        # another dtype, and a layer casting them back got other gradients than training without
        # tba, silently. The first call's is put back around the recomputation, then the program's,
        # with the other process-wide settings the forward ran under (Note [A recomputation runs
        # under the first call's global settings] in tba/runtime/_global_settings.py).
        program, displaced, nested = settings_now(), [], None
        try:  # Note [A recomputation interrupted while it sets up leaves the state it found] in tba/runtime/_first_call.py
            # Note [Nested state a recomputation is given back]; taken after the snapshot and put
            # back last, so a list held both in a public attribute and nested in another ends as it is now.
            nested = put_back_nested(layer, first.nested)
            restore(after, first.before + first.outside)
            set_states(first.generators)
            first.put_parameters(displaced)  # Note [A recomputation runs with the parameters its first call ran with]
            switch_to(first.settings)  # inside the try: a switch that raised midway is undone
            with unknown_draws_refused(layer, args, kwargs, first.generators, again_search):
                return forward(*args, **kwargs)
        finally:
            switch_to(program)
            first.take_back(displaced)
            restore(after, after)
            set_states(after_generators)
            if nested is not None:
                nested()
            first.recomputed()

    compiled_itself = is_compiled_module(layer)
    compiled_within = any(map(is_compiled_module, layer.modules()))  # no outside watch there: tba/runtime/_outside_state.py

    def run(*args: Any, **kwargs: Any) -> Any:
        if (not compiled_itself and compiling()) or _functorch_level() is not None or in_dual_level():
            # Note: [Inside an enclosing compiled graph a recomputed layer runs as it is]
            # Under a whole-model torch.compile, Dynamo traces this wrapper as part of the model's
            # graph. The checkpoint below is not traceable: the graph broke here, the layer ran
            # outside it, and its kernels differed from those of the same model compiled without
            # tba (gradients 1e-8 apart on the tiny GPT, the loss too). Such a graph saves every
            # activation when the whole forward has run, so recomputing one layer lowered no peak
            # anyway (tba/runtime/_compile.py); the layer is traced as it is, the graph is the one
            # compiled without tba, and what it saves reaches tba as any whole-model graph's does.
            # Inside a torch.func transform (torch.vmap) the same holds for another reason: the
            # recomputation would run in backward, outside the transform, on batched tensors that
            # exist only inside it (functorch's "escaped" error, as under plain checkpoint). And under
            # forward-mode AD: Note [Under forward-mode AD a recomputed layer runs as it is].
            return forward(*args, **kwargs)
        if torch.is_inference_mode_enabled():
            # Note: [Under inference mode a recomputed layer runs as it is]
            # Nothing computed under inference_mode is saved for backward, so nothing is recomputed; the first-call
            # bookkeeping read each parameter's version, which fast weights made in that mode (inference tensors) lack:
            # an evaluation through functional_call failed ('Inference tensors do not track version counter').
            return forward(*args, **kwargs)
        top = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if top is not None and is_checkpoint_pair(top):
            return forward(*args, **kwargs)  # Note [Inside a user's checkpoint a recomputed layer runs as it is]
        calls: list[int] = [0]
        first = FirstCall()
        template, tensors = take_apart(args, kwargs)  # Note [A recomputation gets the call as it was]
        # Note [A recomputation gets its input's view-ness]
        tensors, views_again, bases = saved_as_bases(tensors, is_mutation_pair(top))
        originals = [(args, kwargs)]  # the first call's, dropped by it
        del args, kwargs
        announce = _backward_announcer(top)

        def call(calls: list[int], first: FirstCall, *saved: torch.Tensor) -> Any:
            if calls[0]:  # a recomputation: torch's checkpoint hooks break compiled autograd's graph as tba's unpack does
                check_compiled_autograd_backend()  # Note [Compiled autograd under a backend not known exact]
                if announce is not None:
                    announce()
            if originals:
                call_args, call_kwargs = originals.pop()
                with named_errors(type(layer), index):  # Note [Torch's checkpoint errors name the recomputed layer]
                    return first_or_again(calls, first, *call_args, **call_kwargs)
            with template.as_called():  # Note [An object passed to a recomputed layer is called as it was]
                inputs = views_again(saved)
                call_args, call_kwargs = template.call(inputs)
                with inputs_left_alone(layer, index, inputs):  # Note [A recomputation must leave its inputs as they are]
                    return first_or_again(calls, first, *call_args, **call_kwargs)

        keep = not is_mutation_pair(top) and (not offload_inputs or top is None or not is_tba_pair(top))
        with watched_inputs(layer, index, top, keep, bases):  # Note [A recomputed layer's input changed before backward]
            return _checkpoint(call, calls, first, *tensors)

    return run


def _checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Non-reentrant checkpoint of ``function``, run to its end under CUDA memory history or the sanitizer
    (Note [Recomputation runs to the end] in ``tba/runtime/_early_stop.py``)."""
    return checkpoint(function, *args, use_reentrant=False, **checkpoint_keywords(), **kwargs)


def in_dual_level() -> bool:
    """Whether a ``torch.autograd.forward_ad.dual_level`` is entered (forward-mode AD may run).

    Note: [Under forward-mode AD a recomputed layer runs as it is]
    The recomputation runs in backward, outside the dual level: it computes no tangents, so it saves
    fewer tensors than the first call, which computed them (with grad) too, and torch's checkpoint
    refused it ('A different number of tensors was saved during the original forward and
    recomputation'), as under plain checkpoint. The adaptive default planned ``RRKKKK`` for a model
    trained with a Jacobian regulariser (a JVP through the blocks), and the first planned step's
    backward failed with that error. So a layer called inside a dual level runs unwrapped, its saves
    going to the pair below (tba's: offloaded), and the profiled steps mark it not recomputable
    (``tba/runtime/_timer.py``).
    """
    return _forward_ad._current_level >= 0


def _backward_announcer(top: tuple[Any, Any] | None) -> Callable[[], None] | None:
    """What a recomputation calls to tell tba's offloader (``top``'s, if it is tba's) that backward is in this
    layer, whose inputs never reach that offloader's unpack: the layer below is read now (Note [Backward through
    kept layers] in ``tba/runtime/_prefetch.py``)."""
    if top is None or not is_tba_pair(top):
        return None
    hooks = top[0].__self__
    layer = hooks.current_layer
    return None if layer is None else functools.partial(hooks.reached_layer, layer)
