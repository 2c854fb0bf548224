"""Which kernel runs each product on this machine: measured, and probed for exactness.

- :mod:`~knapspec.model.tuning.autotune`: :func:`resolve_kernel_table`, the kernel table
  an engine asks for when it is built (measured once per machine and model shape, cached);
- :mod:`~knapspec.model.tuning.timing` and :mod:`~knapspec.model.tuning.checks`: timing the
  candidates per product, then checking the choice with whole engine steps;
- :mod:`~knapspec.model.tuning.probe` and :mod:`~knapspec.model.tuning.invariance`: the
  row-invariance probe and the exact engine's table built from its verdicts;
- :mod:`~knapspec.model.tuning.prefill`: a cold prefill's many-row kernels, timed once;
- :mod:`~knapspec.model.tuning.tunable`: what the tuner reads of an engine (so it never
  imports the engine).

The kernels themselves live in :mod:`knapspec.model.kernels`.
"""
