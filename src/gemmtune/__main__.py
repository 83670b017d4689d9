"""``python -m gemmtune``: the same command line as ``gemmtune``."""

from gemmtune.cli import main

raise SystemExit(main())
