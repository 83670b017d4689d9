"""gemmtune's own errors. Bad arguments raise Python's ``TypeError`` and ``ValueError``, naming
the argument; a candidate that fails while tuning is a ``Trial`` with a typed reason
(``gemmtune.results``), never an exception; what is left is below, all of them
``GemmtuneError``s."""

from __future__ import annotations


class GemmtuneError(Exception):
    """Any error of gemmtune's own."""


class StoreError(GemmtuneError):
    """The store file or an import file cannot be used as it is (``gemmtune.store``; a call that
    only reads or writes the store through the library gets a warning and torch's kernel instead)."""


class CublasLtError(GemmtuneError, RuntimeError):
    """A cuBLASLt call answered a status other than success, or refused a configuration."""
