"""gemmtune: the fastest correct GEMM kernel for each shape, tuned once and remembered.

``import gemmtune`` imports torch and registers gemmtune's custom ops, ``torch.ops.gemmtune.linear``
and ``torch.ops.gemmtune.mm`` (``gemmtune.serving.torch_ops``), so that code calling them, or a graph
that holds them, needs nothing more. It imports no triton (Triton chooses its CPU interpreter
when first imported: ``gemmtune.device`` must be able to ask for it first), initialises no CUDA
and touches no file: kernels, the GPU and the store are loaded when a public function first
needs them.
"""

from __future__ import annotations

from gemmtune.api import compile, linear, matmul, scaled_mm, tune
from gemmtune.autotune import autotune
from gemmtune.nn import optimize
from gemmtune.problem import Problem
from gemmtune.results import TuneResult
from gemmtune.serving import torch_ops  # noqa: F401 - registers the ops
from gemmtune.serving.recording import record
from gemmtune.version import __version__

__all__ = ["Problem", "TuneResult", "tune", "matmul", "linear", "scaled_mm", "record", "optimize", "compile", "autotune",
           "__version__"]
