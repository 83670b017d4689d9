"""gemmtune: the fastest correct GEMM kernel for each shape, tuned once and remembered.

``import gemmtune`` imports neither torch's CUDA state nor triton and touches no file: the
public functions below load what they need when first called.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Problem", "TuneResult", "tune", "matmul", "linear", "record", "optimize", "__version__"]


_LAZY = {"Problem": "gemmtune.problem", "TuneResult": "gemmtune.results",
         "tune": "gemmtune.api", "matmul": "gemmtune.api", "linear": "gemmtune.api", "record": "gemmtune.recording",
         "optimize": "gemmtune.nn"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'gemmtune' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function: gemmtune.linear is on the hot path
    return value
