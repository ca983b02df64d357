"""What the first call of a recomputed layer's forward leaves for its recomputation, and the checks in between.

:class:`FirstCall` holds the generators' states and the state the call started from (Note [Side effects
of a recomputed forward] in ``tba/runtime/_layer_state.py``), and checks that nothing the recomputation
reads moved in between.

Note: [A recomputed layer's parameters must not change before backward]
Without tba, a parameter autograd saved and the optimiser (or the user) changed in place before
backward makes unpack raise torch's in-place error; one it did not save is not read again. A
recomputation reads every parameter of the layer again, so a change between forward and backward
would silently give the gradients of another forward. :class:`FirstCall` records each parameter's
version counter (and each state tensor's that the first call left unchanged, whose value it does not
keep) when the first call ends, and before the recomputation raises :class:`~tba.errors.TbaError`
naming the tensor when one moved. Loud where torch may be silent (a weight that no saved tensor
aliases), never wrong.

Note: [A recomputation runs with the parameters its first call ran with]
``torch.func.functional_call(model, params, args)`` (fast weights in MAML, a weight ensemble,
``torch.nn.utils.stateless``) puts the given tensors into the modules' ``_parameters`` for the
forward and puts the model's own back when the call returns, before backward. The recomputation
then read the model's own weights: the gradients of another forward, silently (an adversarial
review found it, 0.05 apart on a three-block model; the adaptive default plans recompute for such a
model). :class:`FirstCall` records which tensor each parameter slot of the layer's modules held when
the first call began, and the recomputation runs with those (:meth:`FirstCall.put_parameters`), then
puts back what the slots hold now (:meth:`FirstCall.take_back`). A slot that holds the same object
(the usual case, FSDP2's and DeepSpeed's too: they change a parameter's data, not the object) is
left alone. The tensors are those ``parameters_before`` already holds: nothing more is kept.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tba.errors import TbaError
from tba.runtime._generators import generator_states
from tba.runtime._global_settings import settings_now
from tba.runtime._layer_state import NOT_COPIED, ModuleState, always_copied, held_tensors, snapshot
from tba.runtime._learned import Learned
from tba.runtime._search_reads import KeptSearch

_MISSING = object()
"""A parameter slot that a module no longer has."""


class FirstCall:
    """What the first call of a recomputed layer's forward left for its recomputation: the generators' states and
    the state it started from (Note [Side effects of a recomputed forward]), and the versions to check (Note [A
    recomputed layer's parameters must not change before backward])."""

    __slots__ = ("generators", "before", "outside", "outside_groups", "outside_parameters", "parameters_before", "slots",
                 "versions", "requires_grad", "private", "nested", "settings")

    def __init__(self) -> None:
        self.generators: dict[int, tuple[Any, Any]] = {}
        self.before: list[ModuleState] = []
        self.outside: list[ModuleState] = []
        """The state of the modules outside the layer that the first call ran, each before its first call there (Note [A
        recomputation puts back the modules outside its layer that it calls] in ``tba/runtime/_outside_state.py``)."""
        self.outside_groups: list[list[nn.Module]] = []
        """Those modules, a group per call the first call made to one of them (whose private state is compared as
        ``tba/runtime/_private_state.py``'s ``private_state`` takes it)."""
        self.outside_parameters: list[tuple[str, torch.Tensor, int]] = []
        """``(what, parameter, version)`` of those modules' parameters, each when its module's first call there began."""
        self.parameters_before: list[tuple[str, torch.Tensor, int]] = []
        """``(what, parameter, version)`` when the first call began (``what``: ``its parameter 'name'``), and those of
        the modules outside the layer that it ran, each when its first call there began."""
        self.slots: list[tuple[nn.Module, str, torch.Tensor | None]] = []
        """``(module, name, tensor)`` for every parameter slot of the layer's modules when the first call began
        (Note [A recomputation runs with the parameters its first call ran with])."""
        self.versions: list[tuple[str, torch.Tensor, int]] = []
        self.requires_grad: list[tuple[str, torch.Tensor, bool]] = []
        """``(name, parameter, requires_grad)`` when the first call ended."""
        self.private: list = []
        """The signature of the layer's private state when the first call ended (Note [Private state of a recomputed
        layer] in ``tba/runtime/_private_state.py``), checked before the recomputation; empty: nothing to check."""
        self.nested: list = []
        """The same signature when the first call began: the nested state put back for the recomputation (Note [Nested
        state a recomputation is given back] in ``tba/runtime/_private_state.py``)."""
        self.settings: tuple[Any, ...] = ()
        """The process-wide settings the first call ran under (Note [A recomputation runs under the first call's global
        settings] in ``tba/runtime/_global_settings.py``); empty until it starts."""

    def start(self, layer: nn.Module, args: tuple, kwargs: dict[str, Any], learned: Learned, search: KeptSearch) -> None:
        """Before the first call: take the generators' states (the layer's ``search`` kept), the state it starts from and
        the parameters' versions."""
        self.generators = generator_states(layer, args, kwargs, search)
        self.settings = settings_now()
        self.before = snapshot(layer.modules(), learned)
        self.parameters_before = [(f"its parameter {name!r}", p, p._version) for name, p in layer.named_parameters()]
        self.slots = [(module, name, p) for module in layer.modules() for name, p in module._parameters.items()]

    def add_outside(self, states: list[ModuleState], parameters: list[tuple[str, torch.Tensor, int]],
                    slots: list[tuple[nn.Module, str, torch.Tensor | None]], groups: list[list[nn.Module]]) -> None:
        """After the first call: the state, the parameters' versions and the parameter slots of the modules outside the
        layer that it ran, each taken before its first call there (Note [A recomputation puts back the modules outside
        its layer that it calls] in ``tba/runtime/_outside_state.py``): watched and put back as the layer's own."""
        self.outside, self.outside_groups, self.outside_parameters = states, groups, parameters
        self.parameters_before += parameters
        self.slots += slots

    def put_parameters(self, displaced: list[tuple[nn.Module, str, Any]]) -> None:
        """Before a recomputation: put back into each parameter slot the tensor the first call ran with, where the slot
        holds another one now (Note [A recomputation runs with the parameters its first call ran with]); appends what
        they held to ``displaced``, for :meth:`take_back`, each before its slot changes.

        Note: [A recomputation interrupted while it sets up leaves the state it found]
        Without tba an interrupted backward (a signal handler's ``KeyboardInterrupt``) changes no buffer and draws
        nothing: the next step trains from the state forward left. A recomputation loads the state its first call
        started from (running statistics, generators, nested contents, parameters, settings) and puts the present
        state back in a ``finally``. Those loads ran before the ``try``: an exception among them, or inside one
        (``restore`` loops over tensors, where a signal handler can run), left BatchNorm's running statistics at the
        previous step's values and the generators at the first call's, and training went on from there, silently
        (helper-155's signal loop found it; ``tests/runtime/test_recompute_interrupted.py`` raises at each line). So
        every load runs inside the ``try``, whose ``finally`` puts back all it snapshotted whatever was loaded, and
        what this method displaces is recorded before each slot changes. Still open: an exception inside the
        ``finally`` itself, or inside :func:`put_back_nested` midway through its contents.
        """
        for module, name, tensor in self.slots:
            now = module._parameters.get(name, _MISSING)
            if now is not tensor:
                displaced.append((module, name, now))
                module._parameters[name] = tensor

    @staticmethod
    def take_back(displaced: list[tuple[nn.Module, str, Any]]) -> None:
        """After a recomputation: put back what :meth:`put_parameters` displaced."""
        for module, name, now in reversed(displaced):
            if now is _MISSING:
                module._parameters.pop(name, None)
            else:
                module._parameters[name] = now

    def _check_parameters_kept(self, layer: nn.Module) -> None:
        """After the first call: raise :class:`TbaError` when it changed one of the layer's parameters in place.

        Note: [A recomputed layer that changes its own parameters]
        A forward may change its own weights in place: a clamp or a max-norm constraint before or
        after the weight is used, ``nn.Embedding(max_norm=...)``, which renormalises the rows it
        looks up. The recomputation starts from the weights the first call left. Whether it then
        computes what the first call computed depends on the change (a clamp before use repeats
        exactly; one after use, a division by the norm times 1.01, or an embedding row whose
        renormalised norm rounds to just above ``max_norm`` do not), and torch's early stop may end
        the recomputation before the change is made again, so nothing after it can tell. Such a
        layer gave wrong gradients without a word. Its first call now raises, right after the
        forward, naming the parameter; the adaptive default never plans to recompute such a layer
        (its profiled steps see the change: ``tba/runtime/_timer.py``).
        """
        for what, parameter, version in self.parameters_before:
            if parameter._version != version:
                raise TbaError(
                    f"the forward of a recomputed layer ({type(layer).__name__}) changed {what} in "
                    f"place (version {version}, now {parameter._version}; a clamp, a max-norm constraint, "
                    "nn.Embedding(max_norm=...)): its recomputation in backward would start from the changed "
                    "weights and could compute another forward. Keep or offload this layer instead of recomputing it")

    def settle(self, layer: nn.Module, learned: Learned) -> None:
        """After the first call: learn what it changed, keep copies of that only, and record the versions to check.

        Raises:
            TbaError: the call changed one of the layer's parameters in place, added or removed submodules, or
                changed a state tensor earlier forwards left alone.
        """
        self._check_parameters_kept(layer)  # Note [A recomputed layer that changes its own parameters]
        if [id(m) for m in layer.modules()] != [id(state.module) for state in self.before]:
            raise TbaError(f"the forward of a recomputed layer ({type(layer).__name__}) added or removed submodules: "
                           "its recomputation would run another model; keep or offload this layer, or run one forward "
                           "of the model before offloading with a plan that recomputes it")
        for state in self.before + self.outside:
            module = state.module
            found = [((module._buffers.get(name) if copied.is_buffer else vars(module).get(name)), copied,
                      (id(module), name, state.training), f"{'buffer' if copied.is_buffer else 'tensor attribute'} {name!r}")
                     for name, copied in state.tensors.items()]
            found += [(copied.tensor, copied, key, f"tensor {key[1]}") for key, copied in state.items]
            held = held_tensors(module)
            for now, copied, key, what in found:
                # Some kernels update a tensor without bumping its version (BatchNorm's running statistics, and any
                # update through ``.data``), so the bytes are compared too, on the first forward watched.
                same = now is copied.tensor and now._version == copied.version
                watch = (f"{what} of {type(module).__name__}", now, copied.version)
                if copied.value is NOT_COPIED:
                    if not same:
                        learned.unchanged.discard(key)
                        raise TbaError(f"{what} of a recomputed layer ({type(layer).__name__}) was changed by this "
                                       "forward, which earlier forwards left alone, and tba kept no copy to recompute "
                                       "from; from the next forward on tba copies it: run the step again (with a new "
                                       "Offloader, since this block raised), or keep or offload the layer")
                    self.versions.append(watch)
                elif key in learned.changed:
                    continue
                elif always_copied(copied.value):  # its copy stays until the recomputation puts it back
                    # Left alone, or changed without a version bump: a change before backward is loud. Not one the
                    # forward took out of its container, which is not written into (Note [A rebound tensor is not
                    # written back] in tba/runtime/_layer_restore.py).
                    if same and id(now) in held:
                        self.versions.append(watch)
                    continue
                elif same and torch.equal(now, copied.value):
                    learned.unchanged.add(key)
                    self.versions.append(watch)
                    copied.value = NOT_COPIED
                else:
                    learned.changed.add(key)
        parameters = list(layer.named_parameters())
        self.versions += [(f"parameter {name!r}", p, p._version) for name, p in parameters]
        self.versions += [(what, p, p._version) for what, p, _ in self.outside_parameters]
        self.requires_grad = [(name, p, p.requires_grad) for name, p in parameters]

    def check_unchanged(self, layer: nn.Module) -> None:
        """Raise :class:`TbaError` when a parameter (or a state tensor whose value was not kept) changed in place
        since the first call (Note [A recomputed layer's parameters must not change before backward])."""
        for name, parameter, flag in self.requires_grad:
            if parameter.requires_grad != flag:
                raise TbaError(
                    f"parameter {name!r} of a recomputed layer ({type(layer).__name__}) was "
                    f"{'frozen' if flag else 'unfrozen'} (requires_grad={not flag}) between its forward and backward: "
                    "its recomputation would save other tensors than the first forward did, which torch's checkpoint "
                    "refuses; change requires_grad after backward, or keep or offload this layer")
        for what, tensor, version in self.versions:
            if tensor._version != version:
                raise TbaError(
                    f"{what} of a recomputed layer ({type(layer).__name__}) was modified in place after its "
                    f"forward (version {version}, now {tensor._version}): recomputing the layer in backward would "
                    "give the gradients of another forward. Change it after backward (optimizer.step() after "
                    "loss.backward()), or keep or offload this layer instead of recomputing it")

    def recomputed(self) -> None:
        """After a recomputation: what it bumped itself (a buffer it updates and tba puts back, keeping the bumped
        version) is not a change made outside, which only a later recomputation (``retain_graph``) would check."""
        self.versions = [(what, tensor, tensor._version) for what, tensor, _ in self.versions]
