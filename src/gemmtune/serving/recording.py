"""Recording the GEMMs a run performs, for tuning them offline (record -> tune -> deploy).

    with gemmtune.record("gemms.json"):
        model(batch)                      # every gemmtune.linear / matmul call is counted
    $ gemmtune tune --from gemms.json     # tune them, e.g. on the serving machine before deploy
    $ GEMMTUNE_MODE=lookup python serve.py

The file is a shapes file (the format of the public benchmark shapes) with a ``count`` per
shape, so every tool that reads shapes reads it.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from gemmtune.problem import Problem
from gemmtune.shapes import entry

_ACTIVE: Recording | None = None
_LOCK = threading.Lock()


class Recording:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        # Problem's fields in order: (m, n, k, dtype, layout, bias, tf32, activation, scaling, out_dtype)
        self.counts: Counter[tuple] = Counter()
        self.trace: list[tuple] | None = None  # where a list is put here, every call's tuple in order

    def add(self, m: int, n: int, k: int, dtype: str, layout: str, bias: bool, tf32: bool, activation: str,
            scaling: str = "none", out_dtype: str = "") -> None:
        call = (m, n, k, dtype, layout, bias, tf32, activation, scaling, out_dtype)
        self.counts[call] += 1
        if self.trace is not None:
            self.trace.append(call)

    def problems(self) -> list[tuple[Problem, int]]:
        """Each recorded problem with its count, most frequent first."""
        return [(Problem(*call), count) for call, count in self.counts.most_common()]

    def save(self) -> None:
        shapes = [entry(problem) | {"count": count} for problem, count in self.problems()]
        doc = {"about": "GEMMs recorded by gemmtune.record; tune them with `gemmtune tune --from FILE`",
               "shapes": shapes}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(doc, indent=1) + "\n")


@contextlib.contextmanager
def record(path: str | Path | None = None) -> Iterator[Recording]:
    """Count every GEMM that goes through gemmtune while the block runs (forward and backward,
    served or falling back), and write them to ``path`` when it ends, even on an exception.
    Without a path they are only kept in the Recording the block receives."""
    global _ACTIVE
    recording = Recording(None if path is None else Path(path))
    with _LOCK:
        if _ACTIVE is not None:
            raise RuntimeError(f"gemmtune.record({str(path)!r}): already recording (to {_ACTIVE.path}); "
                               "recordings do not nest")
        _ACTIVE = recording
    try:
        yield recording
    finally:
        with _LOCK:
            _ACTIVE = None
        if recording.path is not None:
            recording.save()


def active() -> Recording | None:
    return _ACTIVE
