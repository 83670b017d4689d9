"""gemmtune: the fastest correct GEMM kernel for each shape, tuned once and remembered.

``import gemmtune`` imports neither torch's CUDA state nor triton and touches no file: the
public functions below load what they need when first called.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Problem", "TuneResult", "tune", "matmul", "linear", "__version__"]


def __getattr__(name: str):
    if name == "Problem":
        from gemmtune.problem import Problem

        return Problem
    if name == "TuneResult":
        from gemmtune.results import TuneResult

        return TuneResult
    if name in ("tune", "matmul", "linear"):
        from gemmtune import api

        return getattr(api, name)
    raise AttributeError(f"module 'gemmtune' has no attribute {name!r}")
