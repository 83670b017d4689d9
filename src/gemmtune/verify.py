"""Correctness: every candidate is checked on fresh random inputs against a float64 reference
before it may be timed. The output is poisoned with NaN first, so an element the kernel never
wrote fails the check instead of passing on leftover memory."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from gemmtune import activation
from gemmtune.problem import Problem

# ||out - ref|| / ||ref|| allowed per precision. Rounding the output alone costs about 2e-3 in
# bf16 and 3e-4 in fp16; the bounds leave room for accumulation order but stay tight enough
# that dropping one K-slice of a 4096-long sum (an error near 1.5e-2) fails.
TOLERANCE = {"bfloat16": 8e-3, "float16": 2e-3, "float32+tf32": 2e-3, "float32": 1e-4}

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class Inputs:
    a: torch.Tensor
    b: torch.Tensor
    bias: torch.Tensor | None
    reference: torch.Tensor  # float64


def tolerance(problem: Problem) -> float:
    return TOLERANCE["float32+tf32" if problem.tf32 else problem.dtype]


def make_inputs(problem: Problem, device: str, *, seed: int | None = None) -> Inputs:
    """Fresh random operands (never zeros) for ``problem`` and their float64 product."""
    a, b, bias = make_operands(problem, device, seed=seed)
    return Inputs(a, b, bias, reference(problem, a, b, bias))


def make_operands(problem: Problem, device: str, *, seed: int | None = None) -> tuple:
    """a, b and bias (or None) for ``problem``: random, contiguous, in the problem's dtype."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
    dtype = TORCH_DTYPES[problem.dtype]

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    a = randn(problem.m, problem.k)
    b = randn(problem.n, problem.k) if problem.layout == "linear" else randn(problem.k, problem.n)
    bias = randn(problem.n) if problem.bias else None
    return a, b, bias


def reference(problem: Problem, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    b64 = b.double().t() if problem.layout == "linear" else b.double()
    out = a.double() @ b64
    out = out if bias is None else out + bias.double()
    return activation.apply(out, problem.activation)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error; NaN or inf anywhere in ``out`` gives inf."""
    diff = out.double() - ref
    if not bool(torch.isfinite(diff).all()):
        return math.inf
    denom = float(torch.linalg.vector_norm(ref))
    return float(torch.linalg.vector_norm(diff)) / denom if denom > 0 else float(torch.linalg.vector_norm(diff))


def warm_up(problem: Problem, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The reference and the error measure run once on ``problem``'s operands, for the kernels
    they load on first use (cuBLAS's float64 GEMM among them), while something else waits."""
    ref = reference(problem, a, b, bias)
    rel_err(ref.to(a.dtype), ref)


def check(kernel, problem: Problem, inputs: Inputs) -> float:
    """Run ``kernel`` once into a NaN-poisoned output; its relative error (inf if unwritten)."""
    out = torch.full((problem.m, problem.n), float("nan"), dtype=inputs.a.dtype, device=inputs.a.device)
    result = kernel(inputs.a, inputs.b, inputs.bias, out=out)
    if result.data_ptr() != out.data_ptr():
        raise RuntimeError("kernel ignored its out= argument")
    return rel_err(out, inputs.reference)
