"""gemmtune: the fastest correct GEMM kernel for each shape, tuned once and remembered.

``import gemmtune`` imports torch and registers gemmtune's custom ops, ``torch.ops.gemmtune.linear``
and ``torch.ops.gemmtune.mm`` (``gemmtune.torch_ops``), so that code calling them, or a graph
that holds them, needs nothing more. It imports no triton (Triton chooses its CPU interpreter
when first imported: ``gemmtune.device`` must be able to ask for it first), initialises no CUDA
and touches no file: kernels, the GPU and the store are loaded when a public function first
needs them.
"""

from __future__ import annotations

__version__ = "0.1.0"  # before the imports below: modules they import read it

from gemmtune import torch_ops  # noqa: E402, F401 - registers the ops
from gemmtune.api import linear, matmul, tune  # noqa: E402
from gemmtune.nn import optimize  # noqa: E402
from gemmtune.problem import Problem  # noqa: E402
from gemmtune.recording import record  # noqa: E402
from gemmtune.results import TuneResult  # noqa: E402

__all__ = ["Problem", "TuneResult", "tune", "matmul", "linear", "record", "optimize", "__version__"]
