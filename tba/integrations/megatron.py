"""tba for megatron-core models: command-line flags and a Megatron-aware offloader.

A megatron-core ``GPTModel`` keeps its repeated blocks in ``TransformerBlock.layers``.
:class:`MegatronOffloader` finds every ``TransformerBlock`` in the model (through wrappers such as
DDP or ``Float16Module``) and hands those layers to :class:`tba.Offloader`, which tags each saved
storage with the layer that was running so that backward prefetches layer ``i-1`` while layer
``i`` runs. Enter the offloader around each forward step and run backward after the block, as
Megatron's schedules do (``forward_step`` and ``backward_step`` are separate calls).

Megatron's own recompute (``recompute_granularity`` ``"full"``, or ``"selective"`` with the
modules that use ``tensor_parallel.checkpoint``) runs the checkpointed region under
``CheckpointFunction``: its forward runs without grad and only the region's inputs are saved, and
those go through tba's hooks like any other saved tensor, so they are offloaded once. Inside the
region Megatron re-enables grad for bias-dropout-add, so autograd saves dropout masks into a
small graph that is thrown away when the region returns; a plain offloader would write those to
disk for nothing. :class:`MegatronOffloader` keeps every tensor saved while Megatron's
``is_checkpointing()`` is true in memory, uncounted by the offload path: what Megatron recomputes
is never written, and the region's inputs are written exactly once. With
``recompute_method="uniform"`` a region of ``recompute_num_layers`` layers saves its input after
its last layer ran, so the prefetch depth defaults to ``recompute_num_layers``.

:func:`add_tba_arguments` adds the ``--tba-*`` flags to an ``argparse`` parser (it can be passed as
Megatron-LM's ``extra_args_provider``), :func:`offloader_from_args` builds the offloader those
flags ask for, and :func:`wrap_forward_step` wraps a Megatron-LM ``forward_step_func`` (the flags themselves are
``tba/integrations/_megatron_flags.py``). The module
never patches Megatron: it only reads the model's config and Megatron's checkpointing flag.
"""

from __future__ import annotations

import argparse
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tba.defaults import PREFETCH_DEPTH_LAYERS
from tba.errors import TbaConfigError
from tba.integrations import check_goal, integration_policy, option_chosen
from tba.integrations._megatron_flags import FLAG_HELP, FLAG_NAMES, add_tba_arguments, flag_name, options_from_args
from tba.policy import Plan
from tba.runtime import KeepReason, Offloader

__all__ = ["FLAG_HELP", "FLAG_NAMES", "MegatronOffloader", "add_tba_arguments", "check_recompute_config", "flag_name",
           "offloader_from_args", "options_from_args", "recompute_prefetch_depth", "transformer_blocks",
           "wrap_forward_step"]

logger = logging.getLogger("tba")

UNSUPPORTED_RECOMPUTE_MODULES = ("layernorm", "moe_act", "mla_up_proj")
"""Selective-recompute modules that use ``CheckpointWithoutOutput``: it frees its output's storage
(``resize_(0)``) right after use, which tba may still be writing, and refills it in backward."""

def _megatron() -> tuple[type, Callable[[], bool]]:
    """``(TransformerBlock, is_checkpointing)`` from megatron-core, or a clear error."""
    try:
        from megatron.core.tensor_parallel.random import is_checkpointing
        from megatron.core.transformer.transformer_block import TransformerBlock
    except ImportError as err:
        raise TbaConfigError(
            f"megatron-core is not importable ({err}); install it with pip install 'tba-offload[megatron]'") from err
    return TransformerBlock, is_checkpointing


def transformer_blocks(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """Every megatron-core ``TransformerBlock`` in ``model`` (or in each model chunk), in order.

    Raises:
        TbaConfigError: when there is none.
    """
    block_type, _ = _megatron()
    chunks = [model] if isinstance(model, nn.Module) else list(model) if isinstance(model, Sequence) else [model]
    if not all(isinstance(chunk, nn.Module) for chunk in chunks):
        raise TbaConfigError(f"the model must be a module or a list of model chunks (modules), got {model!r:.80}")
    blocks = [m for chunk in chunks for m in chunk.modules() if isinstance(m, block_type)]
    if not blocks:
        raise TbaConfigError(
            "no megatron-core TransformerBlock found in the model; pass a model built from "
            "megatron-core (GPTModel, or any module holding a TransformerBlock), or use tba.Offloader "
            "with layers=[...] for other models")
    return blocks


def check_recompute_config(config: Any) -> None:
    """Reject Megatron settings that cannot be combined with tba, naming the fix.

    Raises:
        TbaConfigError: for Megatron's own activation offloading, or selective recompute of a module
            that uses ``CheckpointWithoutOutput``.
    """
    for name in ("cpu_offloading", "fine_grained_activation_offloading"):
        if getattr(config, name, False):
            raise TbaConfigError(f"Megatron's {name} is on; use either it or tba, not both: set {name}=False")
    if getattr(config, "recompute_granularity", None) == "selective":
        clashing = sorted(set(getattr(config, "recompute_modules", None) or ()) & set(UNSUPPORTED_RECOMPUTE_MODULES))
        if clashing:
            raise TbaConfigError(
                f"recompute_modules {clashing} use CheckpointWithoutOutput, which frees its output while tba "
                "may still be writing it; drop them or use recompute_granularity='full'")


def recompute_prefetch_depth(blocks: Sequence[nn.Module]) -> int:
    """Prefetch depth in layers: ``recompute_num_layers`` under full uniform recompute, else the default."""
    depth = PREFETCH_DEPTH_LAYERS
    for block in blocks:
        config = block.config
        if config.recompute_granularity == "full" and config.recompute_method == "uniform":
            depth = max(depth, int(config.recompute_num_layers or 1))
    return depth


class MegatronOffloader(Offloader):
    """A reusable :class:`tba.Offloader` whose layers are the model's transformer layers.

    Tensors saved while Megatron's ``CheckpointFunction`` is running its forward are kept in memory
    (they belong to a throw-away graph and are recomputed in backward); see the module docstring.

    Args:
        model: A megatron-core model (``GPTModel``, a ``TransformerBlock``, a wrapper holding one),
            or a list of model chunks.
        directory: Where the spill file lives (default ``$TBA_DIR``, else the system temp dir).
        **options: Further :class:`tba.Offloader` options. ``policy`` defaults to ``"offload"`` (as in
            every integration; ``TBA_POLICY`` is not read), ``prefetch_depth_layers`` (where neither
            ``config=`` nor ``TBA_PREFETCH_DEPTH_LAYERS`` sets it) to ``recompute_num_layers`` under full uniform
            recompute, else 1.

    Raises:
        TbaConfigError: no TransformerBlock in ``model``, a Megatron setting tba cannot combine
            with, megatron-core missing, or any :class:`tba.Offloader` option error.
    """

    def __init__(self, model: nn.Module | Sequence[nn.Module], directory: str | None = None, **options: Any) -> None:
        if "layers" in options:
            raise TypeError("MegatronOffloader takes its layers from the model; use tba.Offloader to pass layers=")
        _, self._is_checkpointing = _megatron()
        blocks = transformer_blocks(model)
        # Integrations offload unless told to plan (docs/policies.md): Offloader's own default, "adaptive",
        # would also slip past the recompute check below. Note [An integration's offload default and a given config]
        policy_given = "policy" in options
        options["policy"] = integration_policy(options)
        check_goal(options, options["policy"], policy_given=policy_given, owner="MegatronOffloader's",
                   fix="pass policy='adaptive' too")
        for block in blocks:
            check_recompute_config(block.config)
            if block.config.recompute_granularity:
                _check_recomputes_nothing(options["policy"], block.config.recompute_granularity)
        if not option_chosen(options, "prefetch_depth_layers"):  # Note [An integration's default yields to a chosen option]
            options["prefetch_depth_layers"] = recompute_prefetch_depth(blocks)
        super().__init__(directory, layers=[layer for block in blocks for layer in block.layers], **options)

    @property
    def tensors_kept_in_recompute(self) -> int:
        """Saved tensors kept in memory because Megatron recomputes them (summed over steps)."""
        return self.stats.kept_by_reason.get(KeepReason.RECOMPUTED_ELSEWHERE.value, 0)

    @property
    def bytes_kept_in_recompute(self) -> int:
        """Their activation bytes (parameters excluded), summed over steps."""
        return self.stats.bytes_kept_by_reason.get(KeepReason.RECOMPUTED_ELSEWHERE.value, 0)

    def keep_reason(self, tensor: torch.Tensor) -> KeepReason | None:
        """Why ``tensor`` stays in memory; also: saved inside Megatron's recomputed forward (a throw-away graph)."""
        if self._is_checkpointing():
            return KeepReason.RECOMPUTED_ELSEWHERE
        return super().keep_reason(tensor)


def _check_recomputes_nothing(policy: Any, granularity: str) -> None:
    """Refuse a policy that may recompute a layer beside Megatron's recompute: "adaptive", a policy object, or a
    ``tba.Plan`` that recomputes one (a plan that only keeps and offloads runs)."""
    if isinstance(policy, str) and policy in ("offload", "keep"):
        return
    if isinstance(policy, Plan):
        recomputed = [index for index, decision in enumerate(policy.decisions) if "recompute" in decision]
        if recomputed:
            raise TbaConfigError(f"the plan recomputes layer {recomputed[0]} itself; Megatron's recompute_granularity="
                                 f"{granularity!r} would recompute it twice: drop Megatron's recompute flags, or "
                                 "keep or offload that layer in the plan")
        return
    raise TbaConfigError(
        f"tba's {policy if isinstance(policy, str) else type(policy).__name__} policy chooses which layers to recompute "
        f"itself; Megatron's recompute_granularity={granularity!r} would recompute them twice: drop Megatron's "
        "recompute flags or use --tba-policy offload")


def _check_flags(args: Any) -> None:
    if not hasattr(args, "tba_offload_activations"):  # None, a dict, or Megatron's args without the flags: not "off"
        raise TbaConfigError(f"args has no --tba-* flags (got {type(args).__name__}); parse them with add_tba_arguments "
                             "(Megatron-LM: pretrain(..., extra_args_provider=add_tba_arguments))")


def _paired_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The options the flags give, ``policy`` defaulting to ``"offload"``; refused where ``--tba-policy adaptive``
    comes without its goal or the other way round."""
    flags = options_from_args(args)
    flags.setdefault("policy", "offload")  # under Megatron tba offloads unless told to plan (its recompute may be on)
    adaptive = flags.get("policy") == "adaptive"
    if adaptive != ("memory_budget" in flags or "overhead_bound" in flags):
        raise TbaConfigError(
            "--tba-policy adaptive and its goal (--tba-memory-budget or --tba-overhead-bound) go together "
            "(use --tba-policy offload without a goal to write every activation)")
    return flags


def offloader_from_args(args: argparse.Namespace, model: nn.Module | Sequence[nn.Module],
                        **options: Any) -> MegatronOffloader | None:
    """The offloader the ``--tba-*`` flags ask for, or None when activations stay in memory.

    None when ``--tba-offload-activations`` is absent (a warning names any other ``--tba-*`` flag given then)
    or ``--tba-policy keep`` is given. Further
    ``options`` go to :class:`MegatronOffloader`. Call ``close()`` on the result when training ends.

    Raises:
        TbaConfigError: ``args`` without the ``--tba-*`` flags (:func:`add_tba_arguments` not used),
            ``--tba-memory-budget`` without ``--tba-policy adaptive`` or the other way
            round, ``adaptive`` together with Megatron's own recompute, or any error of
            :class:`MegatronOffloader`.
    """
    _check_flags(args)
    if not args.tba_offload_activations:
        given = [flag_name(name) for name in options_from_args(args)]
        if given:  # a budget or a directory asked for, and silently no tba
            logger.warning("tba: %s given without --tba-offload-activations, so tba is off and activations stay in "
                           "memory; add --tba-offload-activations to offload", " ".join(given))
        return None
    flags = _paired_flags(args)
    if flags.get("policy") == "keep":
        logger.info("tba: --tba-policy keep: activations stay in memory")
        return None
    return MegatronOffloader(model, **{**flags, **options})


def wrap_forward_step(forward_step_func: Callable[..., Any],
                      args: argparse.Namespace | Callable[[], argparse.Namespace]) -> Callable[..., Any]:
    """Wrap a Megatron-LM ``forward_step_func(data_iterator, model, ...)`` to run inside tba.

    The offloader is built on the first call with grad enabled, from that call's ``model`` and the
    parsed flags (``args``, or a function returning them such as Megatron-LM's ``get_args``, for
    flags parsed after the wrapper is made). Calls without grad (evaluation) run as they are. The
    wrapper's ``tba_offloader()`` returns the offloader (None before the first call or when the
    flags keep activations in memory); close it when training ends. With virtual pipeline stages
    the first chunk's layers are the tagged ones.
    """
    if not callable(args):  # refused here, not at the first training step's forward (helper-125)
        _check_flags(args)
        if args.tba_offload_activations:
            _paired_flags(args)
    built: list[MegatronOffloader | None] = []

    @functools.wraps(forward_step_func)
    def forward_step(data_iterator: Any, model: nn.Module, *rest: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward_step_func(data_iterator, model, *rest, **kwargs)
        if not built:
            built.append(offloader_from_args(args() if callable(args) else args, model))
        if built[0] is None:
            return forward_step_func(data_iterator, model, *rest, **kwargs)
        with built[0]:
            return forward_step_func(data_iterator, model, *rest, **kwargs)

    forward_step.tba_offloader = lambda: built[0] if built else None
    return forward_step
