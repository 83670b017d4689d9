"""What a compiled graph calls where gemmtune chose one of its own kernels: plain functions,
called from the compiler's generated code as ``extern_kernels.gemmtune_linear`` (b a transposed
(N, K) weight) or ``extern_kernels.gemmtune_mm`` (b row-major), with no custom op between. The
layout was read when the graph was compiled (``problems.problem_of``): a call only serves it,
through gemmtune's dispatch table."""

from __future__ import annotations

import torch

from gemmtune.serving import calls


def linear(*operands: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for ``(a, b)``, ``bias + a @ b`` for ``(bias, a, b)``; b the (K, N) transpose
    of a weight (N, K): linear's front path, as gemmtune.linear's calls take it."""
    bias, a, b = _split(operands)
    if bias is not None and bias.dim() == 2:
        return torch.addmm(bias, a, b)
    if calls.falls_back(a, b.shape[1]):
        return calls.torch_mm(a, b, bias)
    return calls.serve_front(a, b.t(), bias)


def mm(*operands: torch.Tensor) -> torch.Tensor:
    """As ``linear``, for b row-major (K, N)."""
    bias, a, b = _split(operands)
    if bias is not None and bias.dim() == 2:
        return torch.addmm(bias, a, b)
    (m, k), n = a.shape, b.shape[1]
    if calls.falls_back(a, n):
        return calls.torch_mm(a, b, bias)
    return calls.run("nn", a, b, bias, m, n, k, "none")


def _split(operands: tuple) -> tuple:
    """(bias, a, b): the bias as (N,) where the added term is one, or repeats one row; a full
    (M, N) term is passed as it is (no bias gemmtune takes: torch adds it)."""
    *added, a, b = operands
    if not added:
        return None, a, b
    term = added[0]
    if term.dim() == 2 and (term.stride(0) == 0 or term.shape[0] == 1):
        term = term[0]
    return term, a, b
