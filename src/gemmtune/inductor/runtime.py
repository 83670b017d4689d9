"""What a compiled graph calls where gemmtune chose one of its own kernels (a cuBLASLt
algorithm, a split-K, streaming or persistent Triton kernel): a plain function, called from the
compiler's generated code as ``extern_kernels.gemmtune_gemm`` with no custom op between, which
serves the call through gemmtune's dispatch table."""

from __future__ import annotations

import torch

from gemmtune.inductor.problems import layout_of
from gemmtune.serving import calls


def gemm(*operands: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for operands ``(a, b)``, ``bias + a @ b`` for ``(bias, a, b)`` where ``bias``
    is (N,) or (M, N) repeating one row; a row-major, b row-major or a transposed (N, K) weight,
    as ``problems.problem_of`` admitted them when the graph was compiled."""
    *added, a, b = operands
    if added and added[0].dim() == 2 and added[0].stride(0) != 0 and added[0].shape[0] > 1:
        return torch.addmm(added[0], a, b)  # not one row repeated: no bias gemmtune takes
    bias = None if not added else added[0] if added[0].dim() == 1 else added[0][0]
    (m, k), n = a.shape, b.shape[1]
    if calls.falls_back(a, n):
        return calls.torch_mm(a, b, bias)
    layout = layout_of(b.stride(), k, n)
    if layout == "linear":  # a weight's product: linear's front path, as gemmtune.linear's calls take
        return calls.serve_front(a, b.t(), bias)
    if layout == "nn":
        return calls.run("nn", a, b, bias, m, n, k, "none")
    return calls.torch_mm(a, b, bias)  # not a layout gemmtune was given: torch computes it
