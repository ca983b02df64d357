"""Benchmark harness, memory meters and built-in models; used by the tools and tests, never by the runtime.

* :mod:`tba.bench.models`: a small GPT and its presets (``small``, ``bench``);
* :mod:`tba.bench.meters`: the activation-peak meters (:class:`~tba.bench.meters.PeakRSS`,
  :class:`~tba.bench.meters.CudaPeak`);
* :mod:`tba.bench.harness`: training steps under one placement strategy (keep, tba, recompute,
  ``save_on_cpu``, adaptive) and what they measured;
* :mod:`tba.bench.mode_run`: one mode's model, optimiser and context, stepped one step at a time;
* :mod:`tba.bench.isolated`: the same in a fresh process;
* :mod:`tba.bench.interleaved`: several modes in one process, one step of each in turn (speeds);
* :mod:`tba.bench.io_load`: disk traffic from another process (the ``keep_io`` baseline).
"""
