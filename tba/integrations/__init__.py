"""Integrations of tba with training frameworks.

Each integration lives in its own module and imports its framework lazily (or not at all), so
``import tba`` never needs one: :mod:`tba.integrations.deepspeed` pairs tba with DeepSpeed's ZeRO
engines and reads its settings from a ``"tba"`` block of the DeepSpeed config.
"""
