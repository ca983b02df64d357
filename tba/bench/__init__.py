"""Benchmark harness, memory meters and built-in models; used by the tools and tests, never by the runtime.

* :mod:`tba.bench.models`: a small GPT and its presets (``small``, ``bench``);
* :mod:`tba.bench.meters`: the activation-peak meters (:class:`~tba.bench.meters.PeakRSS`,
  :class:`~tba.bench.meters.CudaPeak`);
* :mod:`tba.bench.harness`: training steps under one placement strategy (keep, tba, recompute,
  ``save_on_cpu``, adaptive) and what they measured;
* :mod:`tba.bench.isolated`: the same in a fresh process.
"""
