"""torch.compile and tba: per-block compile works, a whole-model compile is detected and reported.

tba works through saved-tensor hooks. How they meet ``torch.compile`` depends on what is compiled:

* **Per-block compile** (``model.layers[i] = torch.compile(block)``, or ``block.compile()`` as torchtitan does,
  with ``fullgraph=True``; tba's hooks stay out of the block's graph: Notes [One key per process for tba's global
  module hooks] and [Hooks on a block compiled in place run around its graph]). Each block becomes one AOTAutograd
  ``CompiledFunction``, an
  ``autograd.Function`` that saves its activations with ``save_for_backward`` when the block's
  forward returns. Outer saved-tensor hooks see those tensors as they see any other, so tba packs
  them block by block during forward and unpacks them block by block during backward: the peak
  falls as in eager and gradients are bit-exact.
* **Whole-model compile** (``torch.compile(model)`` or ``model.compile()``). The whole forward is
  one ``CompiledFunction``: nothing is saved until the entire forward has run, so every
  activation is alive at once, and PyTorch runs every unpack hook when backward starts
  (pytorch/pytorch#148222). Gradients stay exact, but offloading cannot lower the peak
  (reading everything back at once raised it: 1153 MiB against 836 MiB keep-all for the
  compiled ``bench`` GPT on CPU). torch 2.13 inlines only traceable hooks (``torch.fx.GraphModule`` pack and unpack, see
  ``torch._functorch.config.saved_tensors_hooks_filtering_mode``); tba's hooks do file I/O and
  cannot be traced, and Dynamo never compiles them either, even where a graph breaks
  (:func:`never_traced`). A layer a plan recomputes is traced as it is, not recomputed (Note [Inside an
  enclosing compiled graph a recomputed layer runs as it is] in ``tba/runtime/_recompute.py``).

Detection needs ``layers`` (``tba/layers.py``), and uses two signs, checked when forward ends:

1. The layer tracker's forward pre-hook asks :func:`torch.compiler.is_compiling`. Dynamo traces
   that hook only when the layer runs inside a compiled graph; for a layer that is not compiled
   itself (:func:`is_compiled_module`) that graph is an enclosing one. Dynamo replays the hook's
   attribute write after the graph has run, so the flag is set by the time forward returns.
2. Dynamo does not guard on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``), so
   a model compiled before tba registered its hooks never runs them. Then no layer is ever
   entered, while the saved tensors arrive from an AOTAutograd function
   (:func:`saved_by_compiled_graph` looks at the caller's frames, only while no layer is running).

Either way :meth:`tba.Offloader.__exit__` calls :func:`warn_whole_model_compile`, which logs one
warning per model naming the per-block alternative. Without ``layers`` nothing is detected;
gradients are exact either way.

**Compiled autograd** hands backward's graph, tba's unpack hooks in it, to Dynamo: the hook refuses to
be traced, so Dynamo splits the graph there and runs it eagerly. That is exact under the ``aot_eager`` and
``eager`` backends; under any other the first unpack raises a :class:`~tba.errors.TbaError` naming the fix
(Notes [Compiled autograd traces the unpack hook] and [Compiled autograd under a backend not known exact]).
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn

from tba.errors import TbaError

logger = logging.getLogger("tba")

_warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()

WHOLE_MODEL_COMPILE_WARNING = (
    "tba: the model's layers ran inside one whole-model torch.compile graph. Such a graph saves "
    "all of its activations only when the whole forward has run, and PyTorch unpacks all of them "
    "when backward starts (pytorch/pytorch#148222), so offloading cannot lower the activation peak "
    "and reading everything back at once raises it (gradients stay exact). Compile each block instead of the whole model, e.g. "
    "`for i, block in enumerate(model.layers): model.layers[i] = torch.compile(block)`, "
    "and pass layers=model to tba."
)

# Note: [Compiled autograd traces the unpack hook]
# Compiled autograd (``torch._dynamo.config.compiled_autograd``, ``compiled_autograd._enable``)
# records each unpack hook as a ``call_hook`` node of the backward graph and hands that graph
# to Dynamo, which inlines the hook: :func:`never_traced` marks only the frames Dynamo's
# callback is asked about, not code it inlines. Traced, tba's bookkeeping either failed with
# torch's own error about tba's internals (``fullgraph=True``: "Could not guard on
# data-dependent expression" at the version check in ``tba/runtime/_views.py``, or at the
# ``nvtx`` import) or ran partly traced between graph breaks, with guards on tba's objects.
# Traced, ``is_compiling`` is the constant True: the hook (``SavedTensorHooks.unpack``) raises
# at once, so Dynamo breaks the graph before any of tba's code and runs the hook eagerly (exact
# under ``aot_eager`` and ``eager``, loud under any other backend: Note [Compiled autograd under a
# backend not known exact]), and a ``fullgraph=True`` compile fails with this message in its cause.
# Eager, it costs one call (about 0.1 µs) per unpack.
COMPILED_AUTOGRAD_MESSAGE = (
    "tba's unpack hook reads saved tensors back from disk and cannot be traced into a compiled graph, "
    "and compiled autograd (torch._dynamo.config.compiled_autograd or compiled_autograd._enable) "
    "compiled backward with it under fullgraph=True. Compile backward without fullgraph=True "
    "(Dynamo then runs tba's hook eagerly, between graphs), or run backward without compiled autograd."
)

# Note: [Compiled autograd under a backend not known exact]
# Without ``fullgraph=True``, Dynamo breaks compiled autograd's backward graph at each of tba's unpack hooks
# (Note [Compiled autograd traces the unpack hook]) and runs the hook eagerly between the pieces, where the step
# without tba, whose saved tensors are plain inputs of that graph, compiles it whole. Backends that run the
# pieces' operators as they are (``aot_eager``, ``eager``) give ``torch.equal`` gradients; inductor generates
# other kernels for the pieces than for the whole graph, and on CPU the gradients differed in the last bits,
# silently (helper-125's MLP: five of six). So each eager unpack inside compiled autograd's graph
# (``compiled_autograd.in_compiled_autograd_region``, read from ``sys.modules``: no import, about 0.15 µs an
# unpack outside it, against 9-30 µs for the hook) asks which backend compiled the graph that called it. The
# hook runs with Dynamo's callback unset (:func:`never_traced` skips it and all it calls), so it is read off the
# stack: the ``compile_wrapper`` frame of ``torch/_dynamo/eval_frame.py`` that runs the graph holds it as
# ``callback``, which unwraps along ``_torchdynamo_orig_backend`` down to ``torch.compile``'s wrapper, whose
# ``compiler_fn`` is the registered backend. The region flag is one for the process, so only an unpack with
# compiled autograd's ``runtime_wrapper`` on its own thread's stack is checked: an eager backward on another
# thread meanwhile is left alone. The whole stack is looked at (only inside that region): each graph break
# before an unpack (a gradient hook that logs) nests one more frame above it, and a walk of 64 frames took an unpack
# below 56 such breaks for another thread's. Anything but the registered ``aot_eager`` or ``eager`` (inductor, a custom
# backend, a compiler that is not Dynamo, a torch whose wrapper is named otherwise) raises
# :class:`~tba.errors.TbaError` naming the fix: loud where not known exact. Gradients of parameters whose last
# use precedes the first unpack may already have been accumulated by then: the step failed as a whole.
# A recomputation asks too (``call`` in ``tba/runtime/_recompute.py``): the checkpoint hooks a plan puts around a
# recomputed layer break the graph at each tensor saved inside it as tba's unpack does, and a backward whose saves
# were all inside recomputed layers reached no unpack of tba's, under any backend, silently (helper-132).
_COMPILED_AUTOGRAD_MODULE = "torch._dynamo.compiled_autograd"
EXACT_COMPILED_AUTOGRAD_BACKENDS = ("aot_eager", "eager")
_BACKEND_WRAPPERS_UNWRAPPED = 8
_DYNAMO_WRAPPER_FILE = "_dynamo/eval_frame.py"
_COMPILED_AUTOGRAD_FILE = "_dynamo/compiled_autograd.py"
_loaded_module = sys.modules.get

COMPILED_AUTOGRAD_BACKEND_FIX = (
    "Compile backward with the aot_eager or eager backend, whose split graphs are exact "
    "(torch._dynamo.compiled_autograd._enable(torch.compile(backend='aot_eager'))), run backward without compiled "
    "autograd (torch._dynamo.config.compiled_autograd = False), or run this forward outside tba's context."
)


def _running_backend() -> tuple[bool, object, str]:
    """Whether compiled autograd's graph called this unpack on this thread, the Dynamo backend that compiled that
    graph and its name (None and "none ..." where no ``torch.compile`` wrapper runs it)."""
    frame = sys._getframe(2)
    callback, reached = None, False
    while frame is not None:  # the whole stack: each graph break before this unpack nests a frame more (helper-132)
        code = frame.f_code
        if callback is None and code.co_name == "compile_wrapper" and code.co_filename.endswith(_DYNAMO_WRAPPER_FILE):
            callback = frame.f_locals.get("callback")
        if code.co_name == "runtime_wrapper" and code.co_filename.endswith(_COMPILED_AUTOGRAD_FILE):
            reached = True
            break
        frame = frame.f_back
    if not reached:
        return False, None, ""
    backend = callback
    for _ in range(_BACKEND_WRAPPERS_UNWRAPPED):
        backend = getattr(backend, "_torchdynamo_orig_backend", None) or backend
    if backend is None:
        return True, None, "none (no torch.compile graph called tba's hook)"
    name = getattr(backend, "compiler_name", None) or type(backend).__name__
    return True, getattr(backend, "compiler_fn", backend), str(name)


def check_compiled_autograd_backend() -> None:
    """Raise :class:`~tba.errors.TbaError` when an eager unpack runs between the pieces of compiled autograd's
    graph under a backend not known exact (Note [Compiled autograd under a backend not known exact])."""
    compiled_autograd = _loaded_module(_COMPILED_AUTOGRAD_MODULE)
    if compiled_autograd is None or not getattr(compiled_autograd, "in_compiled_autograd_region", False):
        return
    called_by_graph, backend, name = _running_backend()
    if not called_by_graph:
        return  # another thread's compiled autograd: the region flag is one for the process
    from torch._dynamo.backends.registry import lookup_backend  # imported by then: compiled autograd is running
    if any(backend is lookup_backend(exact) for exact in EXACT_COMPILED_AUTOGRAD_BACKENDS):
        return
    raise TbaError(f"tba cannot promise exact gradients under compiled autograd with the backend {name}: Dynamo breaks "
                   "backward's graph at each of tba's unpack hooks (they read saved tensors back from disk and cannot be "
                   "traced), and a backend that generates kernels builds other ones for the pieces than for the whole "
                   f"graph without tba (inductor's gradients differed in the last bits). {COMPILED_AUTOGRAD_BACKEND_FIX}")


def is_optimized_module(module: nn.Module) -> bool:
    """True when ``module`` is a ``torch.compile(module)`` wrapper.

    Note: [Asking about compiled modules imports nothing]
    ``torch._dynamo`` is imported lazily, and its first import leaves the frames that triggered it in
    a reference cycle. Reached through ``torch._dynamo.eval_frame`` from an entry's setup, that
    made the first offloader of a process (the frame of its entry job holds it, with the layers it
    was given) outlive its user's last reference until a garbage collection: what Note [Dropping
    an offloader frees it] in tba/runtime/_step_cycle.py removed for every other one. No wrapper can
    exist before its module is imported, so an unimported module answers without importing it.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def is_compiled_module(module: nn.Module) -> bool:
    """True when ``module`` itself is compiled: ``torch.compile(module)`` or ``module.compile()``."""
    if is_optimized_module(module):
        return True
    return getattr(module, "_compiled_call_impl", None) is not None


_AOT_AUTOGRAD_DIR = "_functorch/_aot_autograd"
_FRAMES_CHECKED = 8


def saved_by_compiled_graph() -> bool:
    """Whether the tensor being packed now is saved by an AOTAutograd ``CompiledFunction``.

    Autograd calls pack hooks for a custom function's saved tensors when its ``apply`` returns;
    for a compiled graph the caller of ``apply`` is AOTAutograd's runtime wrapper.
    """
    frame = sys._getframe(1)
    for _ in range(_FRAMES_CHECKED):
        if frame is None:
            return False
        if _AOT_AUTOGRAD_DIR in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def compile_blocks(layers: Sequence[nn.Module], parent: nn.Module, **compile_options: object) -> list[nn.Module]:
    """Replace each of ``layers`` in ``parent``'s submodules by ``torch.compile(layer, **compile_options)``.

    Args:
        layers: The repeated blocks (for instance :func:`tba.find_layers` of ``parent``).
        parent: A module containing them, e.g. the model.
        compile_options: Passed to :func:`torch.compile` (``backend``, ``mode``, ...).

    Returns:
        The compiled blocks, in the order of ``layers``.

    Raises:
        ValueError: a layer is not a submodule of ``parent``.
    """
    owners = {id(child): (owner, name) for owner in parent.modules() for name, child in owner.named_children()}
    compiled = []
    for layer in layers:
        if id(layer) not in owners:
            raise ValueError(f"{type(layer).__name__} is not a submodule of {type(parent).__name__}")
        owner, name = owners[id(layer)]
        block = torch.compile(layer, **compile_options)
        owner.register_module(name, block)
        compiled.append(block)
    return compiled


COMPILED_AFTER_WARNING = (
    "tba: the model's blocks were compiled after the offloader was given them: tba holds the blocks inside the "
    "torch.compile wrappers, whose graphs trace its layer hooks, and a plan cannot recompute them there. Build the "
    "offloader after compiling the blocks (`for i, block in enumerate(model.layers): model.layers[i] = "
    "torch.compile(block)` first; layers=model then finds the compiled ones)."
)


def warn_whole_model_compile(layers: Sequence[nn.Module], wrapped_after_given: Callable[[], bool] = bool) -> None:
    """Log :data:`WHOLE_MODEL_COMPILE_WARNING` once for the model whose first layer is ``layers[0]``, or
    :data:`COMPILED_AFTER_WARNING` when ``wrapped_after_given()`` (asked only then: it walks the model).

    Note: [Blocks compiled after tba was given them]
    ``model.layers[i] = torch.compile(block)`` after ``tba.Offloader(layers=model)`` leaves tba holding the
    blocks inside the wrappers. They are not compiled themselves, so their hooks, traced into each
    wrapper's graph, read as an enclosing whole-model graph, and the warning told the user to compile
    each block, which they had done. When forward ends the two cannot be told apart by what was saved (a
    whole-model graph under a one-shot context saved block by block too), so the module given as
    ``layers=`` is looked at: if it now holds a wrapper whose ``_orig_mod`` is one of tba's layers, the
    warning names the order to change. Gradients are exact either way.
    """
    if not layers or layers[0] in _warned:
        return
    _warned.add(layers[0])
    logger.warning(COMPILED_AFTER_WARNING if wrapped_after_given() else WHOLE_MODEL_COMPILE_WARNING)


def never_traced(*functions: Callable[..., object]) -> None:
    """Mark ``functions``' code, and every frame it calls, for Dynamo to skip: they always run eagerly.

    Note [Dynamo never runs tba's hooks] in ``tba/runtime/_hooks.py``. ``torch.compiler.disable`` would
    wrap each call (about 0.4 µs, twice per saved tensor) and importing it imports ``torch._dynamo``
    (seconds, which importing tba must not cost); the code object's own execution strategy, which
    Dynamo's frame callback reads, costs nothing per call. It is torch's private binding: where it
    is missing the hooks are left as they were (traced after a graph break, as before).
    """
    try:
        from torch._C._dynamo import eval_frame
        skip = eval_frame._FrameExecStrategy(eval_frame._FrameAction.SKIP, eval_frame._FrameAction.SKIP)
        for function in functions:
            eval_frame.set_code_exec_strategy(function.__code__, skip)
    except (ImportError, AttributeError, TypeError) as err:
        logger.debug("tba: cannot mark the saved-tensor hooks for Dynamo to skip (%s)", err)
