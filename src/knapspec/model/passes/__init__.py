"""How the engine runs many tokens in one pass, beside its single-sequence forward.

- :mod:`~knapspec.model.passes.batched`: :func:`~knapspec.model.passes.batched.forward_batch`,
  one pass over ragged rows of a batch, each at its own position;
- :mod:`~knapspec.model.passes.exact_pass`: an exact pass's layer items with their
  per-pass work done once (the lean pass);
- :mod:`~knapspec.model.passes.tree`: token trees verified in one pass;
- :mod:`~knapspec.model.passes.sliding_window`: sliding-window layers (Gemma 3), exact.

:class:`~knapspec.model.engine.SublayerEngine` is the entry point; these modules hold the
parts of its passes that do not need the whole engine.
"""
