"""Find a model's repeated blocks while its forward runs, so that ``layers=`` can be left out.

Prefetch goes layer by layer only when storages carry a layer index. Without ``layers=``,
:class:`LayerDiscovery` learns the layers from the forward itself:

1. While the context is active, global module forward hooks (``tba/runtime/_global_hooks.py``: torch's
   :func:`~torch.nn.modules.module.register_module_forward_pre_hook` and its post-hook twin, one key each) keep
   the stack of modules whose forward is running in the context's thread. Every saved storage is
   recorded with that stack (a tuple of modules, outermost first).
2. When forward ends, every module on a recorded stack is a candidate *instance* of the group
   ``(parent on the stack, class)``: the blocks of a GPT are instances of ``(GPT, Block)``, its
   attention projections of ``(Attention #3, Linear)``. A group with at least two instances is a
   set of repeated blocks.
3. The group whose instances hold the most saved bytes wins (ties: more instances). Other repeated
   groups join it when no stack holds an instance of both (they are neither inside its blocks nor
   around them) and they hold at least :data:`tba.defaults.DISCOVERY_MIN_BYTES_SHARE` of its
   bytes: a model with two kinds of blocks (attention and MLP blocks alternating in one list, an
   encoder's blocks then a decoder's) gets all of them. A chosen group whose instances hold repeated
   blocks of their own that cover most of its bytes (an encoder and a decoder of one class, each a
   stack of blocks) gives way to those blocks. The instances of the chosen groups, in the order
   they first saved something, are the layers. Each storage is tagged with the index of the
   outermost instance on its stack, and storages saved outside every instance (the embedding, the
   loss) stay untagged, as with explicit layers.

Tags are therefore known from the end of forward on, which is all prefetch needs: backward is the
first to read them. Hooks of other threads are ignored, so concurrent contexts do not mix. Inside
a compiled graph the hooks do nothing (:func:`~tba.runtime._compiling.compiling`): the graph's saves carry
no module stack, as with explicit layers there (``tba/runtime/_compile.py``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from torch import nn

from tba import defaults
from tba.runtime._compile import is_compiled_module
from tba.runtime._compiled_call import add_layer_hook, compiled_in_place, remove_layer_hooks
from tba.runtime._entry import StorageEntry
from tba.runtime._global_hooks import add_forward_hook, add_forward_pre_hook

logger = logging.getLogger("tba")


class LayerDiscovery:
    """Module stack during forward, and the repeated blocks found from it at the end."""

    def __init__(self) -> None:
        self.layers: list[nn.Module] = []
        """The repeated blocks found by the last :meth:`finish` (empty: none found)."""
        self._stack: tuple[nn.Module, ...] = ()
        self._saved: list[tuple[StorageEntry, tuple[nn.Module, ...]]] = []
        self.tagged_bytes: dict[int | None, int] = {}
        """Bytes of the storages the last :meth:`finish` tagged, by layer index (None: outside every layer)."""
        self._handles: list[Any] = []
        self._around: dict[int, nn.Module] = {}
        """The blocks compiled in place met so far, by id, whose compiled call the discovery hooks (Note [Discovery sees
        blocks compiled in place])."""
        self._scanned: set[int] = set()
        """The modules whose children were looked at for blocks compiled in place since :meth:`attach`, by id."""
        self._thread = 0

    def attach(self, thread: int | None = None) -> None:
        """Start recording module stacks in ``thread`` (an ident; default: the calling thread).

        The offloader attaches from its control thread on behalf of the thread that enters it.
        """
        self._stack = ()
        self._saved = []
        self._thread = threading.get_ident() if thread is None else thread
        # Note [One key per process for tba's global module hooks] in tba/runtime/_global_hooks.py
        self._handles = [add_forward_pre_hook(self._enter), add_forward_hook(self._leave)]

    def detach(self) -> None:
        """Remove the global hooks and those around compiled blocks (the recorded stacks stay until :meth:`finish`)."""
        for handle in self._handles:
            handle.remove()
        for block in self._around.values():  # Note [Discovery takes off whatever it put on a block]
            remove_layer_hooks(block, (self._enter, self._leave))
        self._handles, self._around, self._scanned = [], {}, set()

    def _enter(self, module: nn.Module, args: Any) -> None:
        """tba's global pre-hook, or a :class:`~tba.runtime._compiled_call.CompiledCall`, calls this only outside a
        trace (Note [One key per process for tba's global module hooks]): it need not ask."""
        if threading.get_ident() == self._thread:
            self._stack = (*self._stack, module)
            if id(module) not in self._scanned:
                self._scanned.add(id(module))
                if not is_compiled_module(module):
                    self._hook_compiled_children(module)

    def _hook_compiled_children(self, module: nn.Module) -> None:
        """Note: [Discovery sees blocks compiled in place]
        A block compiled in place (``block.compile()``, torchtitan's per-block compile) runs the global hooks only
        inside its graph, where they do nothing (they cannot be traced), so it never stood on a stack: the bare context
        found no repeated blocks in such a model and planned nothing. Before a module's children run, each child
        compiled in place gets the discovery's hooks around its compiled call (Note [Hooks on a block compiled in place
        run around its graph] in ``tba/runtime/_compiled_call.py``) until :meth:`detach`; so do those in a
        ``ModuleList`` or ``ModuleDict`` child, which is never called itself (torchtitan's ``model.layers``).

        Note: [Discovery takes off whatever it put on a block]
        This runs in the training thread, inside the global pre-hook, where a signal handler's exception can land.
        Kept as handles, one landing between the block's two hooks, or inside :func:`add_layer_hook` after it had put
        the CompiledCall in place, left the block a CompiledCall holding the discovery's pre-hook for good after the
        context ended (found raising at every line here). The block is noted before its hooks go on, and
        :meth:`detach` takes the discovery's own hooks off it by value (:func:`remove_layer_hooks`), whatever of them
        is there.
        """
        for child in module._modules.values():
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                self._hook_compiled_children(child)
            elif child is not None and id(child) not in self._around and compiled_in_place(child):
                self._around[id(child)] = child
                add_layer_hook(child, self._enter, pre=True)
                add_layer_hook(child, self._leave, pre=False)

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() != self._thread or module not in self._stack:  # called outside a trace, as _enter
            return
        stack = self._stack
        index = len(stack) - 1
        while stack[index] is not module:
            index -= 1
        self._stack = stack[:index]

    @property
    def stack(self) -> tuple[nn.Module, ...]:
        """The modules running now, outermost first (read by the pack hook, for :meth:`note_saved`)."""
        return self._stack

    def note_saved(self, entry: StorageEntry, stack: tuple[nn.Module, ...] | None = None) -> None:
        """Record that ``entry`` was first saved under ``stack`` (default: the current module stack)."""
        self._saved.append((entry, self._stack if stack is None else stack))

    def finish(self) -> list[nn.Module]:
        """Pick the repeated blocks, tag every recorded entry with its layer index, and forget the stacks."""
        saved, self._saved, self._stack = self._saved, [], ()
        groups: dict[tuple[int, type], list[nn.Module]] = {}
        covered: dict[tuple[int, type], int] = {}
        seen: set[tuple[tuple[int, type], int]] = set()
        keyed = [_instances_on(stack) for _, stack in saved]
        for (entry, _), instances in zip(saved, keyed):
            for key, module in instances:
                if (key, id(module)) not in seen:
                    seen.add((key, id(module)))
                    groups.setdefault(key, []).append(module)
                covered[key] = covered.get(key, 0) + entry.nbytes
        candidates = sorted((key for key, instances in groups.items() if len(instances) >= 2),
                            key=lambda key: (covered[key], len(groups[key])), reverse=True)
        if not candidates:
            self.layers, self.tagged_bytes = [], {}
            return self.layers
        relations = _Relations([key for key, _ in instances] for instances in keyed)
        chosen = relations.refine(relations.disjoint(candidates, covered), candidates, covered, groups)
        members = {id(module) for key in chosen for module in groups[key]}
        index_of: dict[int, int] = {}
        self.layers = []
        for _, stack in saved:
            for module in stack:
                if id(module) in members and id(module) not in index_of:
                    index_of[id(module)] = len(self.layers)
                    self.layers.append(module)
        self.tagged_bytes = {}
        for entry, stack in saved:
            entry.layer = next((index_of[id(m)] for m in stack if id(m) in index_of), None)
            self.tagged_bytes[entry.layer] = self.tagged_bytes.get(entry.layer, 0) + entry.nbytes
        logger.debug("tba: found %d repeated blocks (%s) holding %d of %d saved bytes", len(self.layers),
                     ", ".join(sorted({type(m).__name__ for m in self.layers})),
                     sum(n for k, n in self.tagged_bytes.items() if k is not None), sum(self.tagged_bytes.values()))
        return self.layers

    def retag(self, layer_saved_bytes: dict[int | None, int]) -> None:
        """Move the last forward's bytes, counted under None at save, to the layers :meth:`finish` found."""
        for layer, nbytes in self.tagged_bytes.items():
            if layer is not None:
                layer_saved_bytes[None] = layer_saved_bytes.get(None, 0) - nbytes
                layer_saved_bytes[layer] = layer_saved_bytes.get(layer, 0) + nbytes
        if layer_saved_bytes.get(None) == 0:
            del layer_saved_bytes[None]


def _instances_on(stack: tuple[nn.Module, ...]) -> list[tuple[tuple[int, type], nn.Module]]:
    """Each module of ``stack`` with its group key ``(id of the module above it, or 0; its class)``."""
    return [((id(stack[depth - 1]) if depth else 0, type(module)), module) for depth, module in enumerate(stack)]


class _Relations:
    """Which groups share a module stack, and which groups lie inside the instances of which."""

    def __init__(self, stacks: Iterable[list[tuple[int, type]]]) -> None:
        self.beside: dict[tuple[int, type], set[tuple[int, type]]] = {}
        """Groups with an instance on some stack where the key's group has one too."""
        self.inside: dict[tuple[int, type], set[tuple[int, type]]] = {}
        """Groups with an instance above the key's group's on every stack that holds the latter."""
        for keys in stacks:
            for depth, key in enumerate(keys):
                self.beside.setdefault(key, set()).update(keys)
                above = set(keys[:depth])
                self.inside[key] = self.inside[key] & above if key in self.inside else above

    def disjoint(self, candidates: list[tuple[int, type]], covered: dict[tuple[int, type], int]) -> list[tuple[int, type]]:
        """The first candidate (most bytes), and every later one big enough that shares no stack with a chosen one."""
        chosen = [candidates[0]]
        floor = covered[candidates[0]] * defaults.DISCOVERY_MIN_BYTES_SHARE
        for key in candidates[1:]:
            if covered[key] < floor:
                break
            if self.beside[key].isdisjoint(chosen):
                chosen.append(key)
        return chosen

    def refine(self, chosen: list[tuple[int, type]], candidates: list[tuple[int, type]],
               covered: dict[tuple[int, type], int], groups: dict[tuple[int, type], list[nn.Module]]) -> list[tuple[int, type]]:
        """Replace a chosen group by the repeated blocks inside its instances when those hold most of its bytes.

        An encoder and a decoder of one class are two instances of a repeated group, but their blocks
        are the layers prefetch wants: the blocks inside replace the group when they are more
        instances and hold at least :data:`tba.defaults.DISCOVERY_REFINE_SHARE` of its bytes.
        """
        refined: list[tuple[int, type]] = []
        for group in chosen:
            inner = [key for key in candidates if group in self.inside[key]]
            if inner:
                blocks = self.refine(self.disjoint(inner, covered), inner, covered, groups)
                if (sum(covered[key] for key in blocks) >= defaults.DISCOVERY_REFINE_SHARE * covered[group]
                        and sum(len(groups[key]) for key in blocks) > len(groups[group])):
                    refined.extend(blocks)
                    continue
            refined.append(group)
        return refined
