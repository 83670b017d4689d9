"""cuBLAS through torch's own ``F.linear`` / ``mm`` / ``addmm`` / ``bmm`` (bias fused by cuBLAS), then
torch's activation: what eager PyTorch runs, and the reference every candidate must beat. An fp8
product is ``torch._scaled_mm`` (cuBLASLt), as a serving stack calls it. On a machine without a
GPU the same calls run torch's CPU kernels."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gemmtune import activation
from gemmtune.backends.base import FieldConfig, Kernel, function_kernel
from gemmtune.device import Device
from gemmtune.problem import Problem


@dataclass(frozen=True)
class CublasConfig(FieldConfig):
    FIELDS = {}  # no parameters: cuBLAS picks its own kernel


def _linear(a, b, bias, out=None):
    if out is None:
        return F.linear(a, b, bias)
    return _mm(a, b.t(), bias, out)


def _mm(a, b, bias, out=None):
    return torch.mm(a, b, out=out) if bias is None else torch.addmm(bias, a, b, out=out)


def _bmm(a, b, bias, out=None):
    """A batch of products, a (B, M, K) by b (B, K, N): torch.bmm, as a compiled graph's library
    call runs it (no bias: a batched product takes none)."""
    return torch.bmm(a, b, out=out)


def _bmm_linear(a, b, bias, out=None):
    """As ``_bmm`` for b (B, N, K), whose transposed view torch.bmm takes as it is."""
    return torch.bmm(a, b.transpose(1, 2), out=out)


# F.linear takes x (..., K) itself, so api.linear's front path passes it, and calls F.linear
# instead of _linear: the same result, one Python frame less
_linear = function_kernel(_linear, serves_any_rank=True, front=F.linear)
_mm = function_kernel(_mm)
_bmm, _bmm_linear = function_kernel(_bmm), function_kernel(_bmm_linear)


class CublasBackend:
    name = "cublas"
    space_size = 1

    def is_available(self, device: Device) -> bool:
        return True

    def candidates(self, problem: Problem, device: Device) -> list[CublasConfig]:
        return [CublasConfig()]

    def predict_ms(self, problem: Problem, device: Device, config) -> float | None:
        return None

    def parse_config(self, data: Mapping) -> CublasConfig:
        if not isinstance(data, Mapping) or data:
            raise ValueError(f"cublas takes no config parameters, got {data!r}")
        return CublasConfig()

    def build(self, problem: Problem, config: CublasConfig, device: Device) -> Kernel:
        if problem.scaled:
            return scaled_mm(problem)
        if problem.batch > 1:
            return _bmm_linear if problem.layout == "linear" else _bmm
        gemm = _linear if problem.layout == "linear" else _mm
        if problem.activation == "none":
            return gemm
        name = problem.activation

        def gemm_then_activation(a, b, bias, out=None):
            result = activation.apply(gemm(a, b, bias), name)
            return result if out is None else out.copy_(result)

        return function_kernel(gemm_then_activation, serves_any_rank=gemm is _linear)


def scaled_mm_takes(problem: Problem, fast_accum: bool = False) -> bool:
    """Whether ``torch._scaled_mm`` on a GPU has a kernel for this fp8 product, as far as its shape
    says: what torch 2.11 raised for on an H100 is left out (rows not 16-byte aligned, two e5m2
    operands, a bias with a float32 output, fast accumulation with block scales). cuBLASLt also
    refused block scaling at M = 1; that depends on the call's rows, and torch's fallback
    (``serving.scaled.by_torch``) meets it."""
    return (problem.rows_aligned and problem.dtype != "float8_e5m2"
            and not (problem.bias and problem.out_dtype == "float32")
            and not (fast_accum and problem.scaling == "block"))


def scaled_mm(problem: Problem, fast_accum: bool = False) -> Kernel:
    """``torch._scaled_mm`` on gemmtune's scaled-kernel operands (``Problem.scaling``), then
    torch's activation: b is the (N, K) weight, whose transpose is the column-major (K, N) torch
    takes, and its scales are transposed alike (a row-wise (N, 1) becomes torch's (1, N)).
    ``fast_accum``: torch's ``use_fast_accum`` (fp8 partial sums kept in the tensor cores'
    narrower accumulator)."""
    dtype, name = getattr(torch, problem.out_dtype), problem.activation

    def scaled(a, b, bias, scale_a, scale_b, out=None):
        scale_b = scale_b.t() if scale_b.dim() == 2 else scale_b
        if name == "none":
            return torch._scaled_mm(a, b.t(), scale_a, scale_b, bias=bias, out_dtype=dtype, out=out,
                                    use_fast_accum=fast_accum)
        result = torch._scaled_mm(a, b.t(), scale_a, scale_b, bias=bias, out_dtype=dtype, use_fast_accum=fast_accum)
        result = activation.apply(result, name)
        return result if out is None else out.copy_(result)

    return function_kernel(scaled)


BACKEND = CublasBackend()
