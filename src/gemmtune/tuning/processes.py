"""Child processes for gemmtune's own work (isolated tuning) that never re-run the user's
script.

multiprocessing's spawn and forkserver children import the parent's ``__main__`` before they
run anything: a training script without an ``if __name__ == "__main__"`` guard would start
training again in every one of them. gemmtune's children need nothing from ``__main__``, so
while they are launched it looks, to multiprocessing, like a main without a file or a spec.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

_LOCK = threading.Lock()
_MISSING = object()


@contextlib.contextmanager
def main_hidden() -> Iterator[None]:
    """Children started inside this block do not import the parent's ``__main__``."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    with _LOCK:
        saved_file = main.__dict__.pop("__file__", _MISSING)
        saved_spec = main.__dict__.get("__spec__", _MISSING)
        main.__spec__ = None
        try:
            yield
        finally:
            if saved_file is not _MISSING:
                main.__file__ = saved_file
            if saved_spec is _MISSING:
                del main.__spec__
            else:
                main.__spec__ = saved_spec
