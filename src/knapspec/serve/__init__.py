"""``knapspec serve``: an OpenAI-compatible HTTP server over one speculative decoder.

:mod:`~knapspec.serve.protocol` (request and response models), :mod:`~knapspec.serve.app`
(routes: parse, validate, hand over, stream back), :mod:`~knapspec.serve.errors` (OpenAI's
error bodies), :mod:`~knapspec.serve.scheduler` (the one thread that owns the model and
batches requests continuously), :mod:`~knapspec.serve.metrics` (Prometheus),
:mod:`~knapspec.serve.text` (tokens in and text out, stop strings) and
:mod:`~knapspec.serve.server` (the process: uvicorn, SIGTERM drain). Needs the ``serve``
extra: ``pip install 'knapspec[serve]'``. See docs/serving.md.
"""
