"""The tuning store: every choice and every trial, keyed by (device fingerprint, problem key).

Two stores behind one interface: the default, one SQLite file per user (``sqlite.Store``), and a
server database a fleet shares (``server.ServerStore``, PostgreSQL), chosen by ``open_store``
from a location: a ``postgresql://`` URL, or a path (``GEMMTUNE_STORE`` or the CLI's ``--store``
names a location; without one, the SQLite file under ``GEMMTUNE_CACHE_DIR``). Whatever comes
out of either store, or into it from a shared JSON file, is validated the same way
(``entries``), because a config read from a store must not be able to launch an invalid kernel:
an invalid row is skipped with a warning, an invalid import file is refused whole. JSON and SQL
only; never pickle, eval or exec. A store that cannot be used never breaks the caller of
``gemmtune.linear``, ``matmul`` or ``tune``: it warns once and keeps nothing. ``merge`` copies
stores into one (``gemmtune cache merge``), newest choice first.
"""

from __future__ import annotations

from pathlib import Path

from gemmtune import settings
from gemmtune.store.server import ServerStore, is_url
from gemmtune.store.sqlite import APPLICATION_ID, SCHEMA_VERSION, Store

__all__ = ["APPLICATION_ID", "SCHEMA_VERSION", "ServerStore", "Store", "merge", "open_store"]


def open_store(location: str | Path | None = None, strict: bool = False) -> Store | ServerStore:
    """The store at ``location``: a server's URL, or a SQLite file or folder; by default
    ``GEMMTUNE_STORE``, else the SQLite file under ``GEMMTUNE_CACHE_DIR``. ``strict``: a store
    that cannot be used raises StoreError instead of warning and keeping nothing."""
    location = location if location is not None else settings.store_location()
    if is_url(location):
        return ServerStore(str(location), strict=strict)
    return Store(location, strict=strict)


def merge(sources: list[Store | ServerStore], into: Store | ServerStore) -> tuple[int, int]:
    """Copy every choice of ``sources`` into ``into`` with its trials, as it was made, where
    ``into`` does not hold it as new or newer: merging again copies nothing, and the newest choice
    of each (device, problem) wins whatever the order. Syncing a local store with a server is a
    merge each way. (choices copied, choices left as they were)."""
    copied = kept = 0
    for source in sources:
        for record in source.records():
            if into.put_record(record):
                copied += 1
            else:
                kept += 1
    return copied, kept
