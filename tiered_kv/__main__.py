"""``python -m tiered_kv``: the ``tiered-kv`` command."""

from .tools.cli import main

raise SystemExit(main())
