"""Glue between tba and training frameworks; each framework lives in its own submodule.

Submodules import their framework lazily, so ``import tba.integrations.megatron`` works without
megatron-core installed and only the functions that need it raise, naming the extra to install.
:mod:`tba.integrations.deepspeed` does not import DeepSpeed at all: it reads the ``"tba"`` block of
a DeepSpeed config and wraps a ``DeepSpeedEngine``'s forward.
"""
