"""``python -m knapspec.cli``: the same as the ``knapspec`` command."""

from knapspec.cli import main

raise SystemExit(main())
