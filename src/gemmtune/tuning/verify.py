"""Correctness: every candidate is checked on fresh random inputs against a float64 reference
before it may be timed, element by element.

Each output element gets a bound of its own that scales with the magnitudes behind it, as careful
GEMM test suites do, instead of one norm over the whole output: a norm lets a kernel that zeroes a
handful of bf16 outputs pass (8 of 65,536 passed an 8e-3 norm bound), an element bound does not.
For the pre-activation product ``pre = A @ B + bias`` (float64) and ``out = act(pre)``:

    |out - ref| <= LIPSCHITZ * (ROUNDING * (|pre| + |bias|) + ACCUMULATION * scale) + ROUNDING * |ref|

where ``scale = sqrt((A * A) @ (B * B))`` is the root of the sum of the squared terms of the dot
product: the size of what an accumulation of random-signed terms can lose, and of the product
itself (docs/verification.md gives the reasoning and each constant's margin). The output is
poisoned with NaN first, so an element the kernel never wrote fails instead of passing on
leftover memory. The runner checks every candidate on two independent input sets, and its
finalists once more after the timing rounds, so a kernel whose result depends on what it saw
before (a stale cache, a counter left set) fails too.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import numpy
import torch

from gemmtune import activation, scaling
from gemmtune.problem import Problem, scaled_torch_dtypes, torch_dtypes

# Rounding of one value to the output dtype, relative to it: a unit in the last place (twice
# the round-to-nearest error: Triton's interpreter truncates bfloat16 instead of rounding).
ROUNDING = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10, "float32": 2.0 ** -20}
# What accumulating K products may lose, relative to ``scale``: fp32 accumulation of exact
# bf16/fp16 products loses ~sqrt(K) * 2^-24 (1e-5 of scale at K = 16384); cuBLAS may reduce
# split-K partial sums in the output dtype (torch allows it by default), a few roundings of
# 2^-8 (bf16) or 2^-11 (fp16) each; TF32 cuts each input to 10 mantissa bits (Triton truncates:
# about 8e-4 * scale standard deviation, and 1.08x a 2^-8 bound was seen on an H100 at 4096^2
# outputs); IEEE fp32, about sqrt(K) * 6e-8.
# fp8 products (their inputs exact in float32, their products too): accumulation in float32, as
# torch._scaled_mm's default and kernels promoting their partial sums every 128 of K give it.
# Hopper's fast accumulation (about 14 bits kept) read 1.06-1.9x this bound at its worst element
# on an H100 (K = 4096-14336) and fails it, as a wrong result does (docs/verification.md).
ACCUMULATION = {"bfloat16": 2.0 ** -6, "float16": 2.0 ** -9, "float32+tf32": 2.0 ** -7, "float32": 2.0 ** -14,
                "float8": 2.0 ** -7}
# ||out - ref|| / ||ref|| allowed besides: a scale error that stays inside every element's bound
# (x1.01 in bf16 is under 3 ulps) is still systematic, and the norm sees it. Rounding the output
# alone costs about 2e-3 in bf16 and 3e-4 in fp16.
NORM_TOLERANCE = {"bfloat16": 8e-3, "float16": 2e-3, "float32+tf32": 2e-3, "float32": 1e-4, "float8": 8e-3}
# The steepest slope of the fused activations (GELU's, 1.13): an error before the activation
# is at most this much larger after it.
LIPSCHITZ = 1.13
# float32's unit roundoff: epilogues compute their activation in float32 (``norm_floor``)
COMPUTE_ROUNDING = 2.0 ** -24

TORCH_DTYPES = torch_dtypes() | scaled_torch_dtypes()

log = logging.getLogger("gemmtune")


@dataclass(frozen=True)
class Inputs:
    a: torch.Tensor
    b: torch.Tensor
    bias: torch.Tensor | None
    reference: torch.Tensor  # float64
    bound: torch.Tensor  # float32: each output element's largest allowed error
    scales: tuple = ()  # an fp8 product's (scale_a, scale_b)
    norm_floor: float = 0.0  # the least reference norm the relative error is taken against (``relative``)

    @property
    def operands(self) -> tuple:
        """What a kernel is called with: (a, b, bias), and an fp8 product's scales after them."""
        return (self.a, self.b, self.bias, *self.scales)


@dataclass(frozen=True)
class Verdict:
    """One output judged against its reference: ``rel_err`` the relative Frobenius error (for
    reports), ``worst`` the largest |error| / bound over the elements (inf where any element is
    not finite; above 1 fails), ``where`` that element's (row, column), (batch, row, column) in a
    batched product's output."""

    rel_err: float
    norm_tolerance: float
    worst: float
    where: tuple[int, ...] | None = None
    value: float = math.nan
    expected: float = math.nan

    @property
    def ok(self) -> bool:
        return self.worst <= 1.0 and self.rel_err <= self.norm_tolerance

    def reason(self) -> str:
        if self.worst <= 1.0:
            return f"rel_err {self.rel_err:.3g} > tolerance {self.norm_tolerance:.3g}"
        at = f"element {self.where}" if self.where is not None else "the output"
        return (f"{at} is {self.value:.6g} where {self.expected:.6g} is right: {self.worst:.3g}x its tolerance "
                f"(rel_err {self.rel_err:.3g})")

    def worse(self, other: Verdict) -> Verdict:
        return self if self.worst >= other.worst else other


def tolerance_key(problem: Problem) -> str:
    return "float8" if problem.scaled else "float32+tf32" if problem.tf32 else problem.dtype


def tolerance(problem: Problem) -> float:
    """The relative Frobenius error allowed for ``problem`` (one of the two checks of ``judge``)."""
    return NORM_TOLERANCE[tolerance_key(problem)]


def make_inputs(problem: Problem, device: str, *, seed: int | None = None) -> Inputs:
    """Fresh random operands (never zeros) for ``problem``, their float64 product and each
    element's error bound."""
    return inputs_of(problem, *make_operands(problem, device, seed=seed))


def inputs_of(problem: Problem, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, *scales) -> Inputs:
    """``a``, ``b`` and ``bias`` (and an fp8 product's scales) with their float64 product and
    each element's error bound."""
    pre, scale = _product(problem, a, b, bias, scales)
    ref = activation.apply(pre.clone(), problem.activation)
    return Inputs(a, b, bias, ref, _bound(problem, pre, scale, bias, ref), tuple(scales), norm_floor(problem, pre))


def norm_floor(problem: Problem, pre: torch.Tensor) -> float:
    """The least reference norm an output's relative error is taken against where an activation
    follows the product: the norm of float32's rounding of the pre-activation ``pre``, over the
    norm tolerance, so that errors no larger than that rounding pass. Where the activation squashes
    the product by orders of magnitude (GELU's and SiLU's negative tails), no float32 epilogue
    computes the output to relative precision: gelu(-7.5) is -1.9e-13, and float32's erf makes it
    0 (torch's own GELU too; the property test of torch's fp8 fallback found a one-element output
    of that kind, relative error 1.0)."""
    if problem.activation == "none":
        return 0.0
    return COMPUTE_ROUNDING * float(torch.linalg.vector_norm(pre)) / tolerance(problem)


def make_operands(problem: Problem, device: str, *, seed: int | None = None) -> tuple:
    """a, b and bias (or None) for ``problem``: random, contiguous, in the problem's dtype (the
    bias in its output dtype), each with a leading batch size where the product is batched; for
    an fp8 product, then its scales (``scaling.quantize``)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))

    batch = (problem.batch,) if problem.batch > 1 else ()

    def randn(*shape):
        return torch.randn(*batch, *shape, generator=gen, device=device, dtype=torch.float32)

    a = randn(problem.m, problem.k)
    b = randn(problem.n, problem.k) if problem.layout == "linear" else randn(problem.k, problem.n)
    bias = randn(problem.n).to(TORCH_DTYPES[problem.out_dtype]) if problem.bias else None
    if not problem.scaled:
        dtype = TORCH_DTYPES[problem.dtype]
        return a.to(dtype), b.to(dtype), bias
    # rows of different magnitudes, as activations' tokens and weights' channels are
    a *= torch.rand(problem.m, 1, generator=gen, device=device).mul_(4).exp2_()
    b *= torch.rand(problem.n, 1, generator=gen, device=device).mul_(4).exp2_()
    fp8 = TORCH_DTYPES[problem.dtype]
    (qa, sa), (qb, sb) = (scaling.quantize(t, fp8, problem.scaling, weight) for t, weight in ((a, False), (b, True)))
    return qa, qb, bias, sa, sb


def reference(problem: Problem, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, *scales) -> torch.Tensor:
    """``act(a @ b + bias)`` in float64 (an fp8 product's operands dequantized by ``scales``)."""
    return activation.apply(_product(problem, a, b, bias, scales, scale=False)[0], problem.activation)


def _product(problem: Problem, a, b, bias, scales: tuple = (), scale: bool = True):
    """The float64 pre-activation product, and ``scale`` (see the module's docstring)."""
    if problem.scaled:
        a64 = scaling.dequantize(a, scales[0], problem.scaling, False)
        b64 = scaling.dequantize(b, scales[1], problem.scaling, True).t()
    else:
        a64 = a.double()
        b64 = b.double().transpose(-1, -2) if problem.layout == "linear" else b.double()
    pre = a64 @ b64
    if bias is not None:
        pre += bias.double()
    return pre, (a64.square() @ b64.square()).sqrt_() if scale else None


def _bound(problem: Problem, pre: torch.Tensor, scale: torch.Tensor, bias, ref: torch.Tensor) -> torch.Tensor:
    rounding = ROUNDING[problem.out_dtype]
    bound = scale.mul_(ACCUMULATION[tolerance_key(problem)])
    if bias is not None or problem.activation != "none":  # the dot product may be rounded before them
        bound.add_(pre.abs() if bias is None else (pre - bias.double()).abs_(), alpha=rounding)
    if problem.activation != "none":
        bound.mul_(LIPSCHITZ)
    # Kept in float32 (a bound needs no more digits): the two input sets of an 8192 x 28672
    # product hold 1.9 GB of float64 references already.
    return bound.add_(ref.abs(), alpha=rounding).add_(_least_step(problem.out_dtype)).float()


def _least_step(dtype: str) -> float:
    """The rounding no element's bound goes below: a unit in the last place among the output
    dtype's subnormals, where relative rounding no longer holds (float16's are 2^-24 apart, and a
    k = 1 product of 7.36e-6 came out 7.33e-6, one step down, from a right kernel), and at least
    the smallest normal float32, so that an exact zero does not demand an exact zero of fp32
    rounding."""
    info = torch.finfo(TORCH_DTYPES[dtype])
    return max(info.tiny * info.eps, torch.finfo(torch.float32).tiny)


def rel_err(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """Relative Frobenius error (``relative``); NaN or inf anywhere in ``out`` gives inf."""
    diff = out.double() - ref
    if not bool(torch.isfinite(diff).all()):
        return math.inf
    return relative(float(torch.linalg.vector_norm(diff)), float(torch.linalg.vector_norm(ref)), out, floor)


def relative(error_norm: float, ref_norm: float, out: torch.Tensor, floor: float = 0.0) -> float:
    """||out - ref|| / ||ref||, the reference's norm taken as no less than what ``out``'s format
    holds (its smallest normal in every element) nor than ``floor`` (``norm_floor``): an output
    whose every element is below it (silu at -70 in float16, 3e-30) is rounded to zero or near it
    by any kernel, so no kernel could pass a relative check there (the property test of torch's fp8
    fallback found one)."""
    denom = max(ref_norm, torch.finfo(out.dtype).tiny * math.sqrt(out.numel()), floor)
    return error_norm / denom if denom > 0 else error_norm


def judge(out: torch.Tensor, problem: Problem, inputs: Inputs) -> Verdict:
    """``out`` against ``inputs``' reference: element by element, and as a whole (on a GPU in one
    pass over memory: ``judging``, once it agreed with this judgement in the process)."""
    if out.is_cuda and _one_pass["trusted"] is not False:
        verdict = _judged_in_one_pass(out, problem, inputs)
        if verdict is not None:
            return verdict
    return _judged_in_torch(out, problem, inputs)


def _judged_in_torch(out: torch.Tensor, problem: Problem, inputs: Inputs) -> Verdict:
    ratio = (out.double() - inputs.reference).abs_().div_(inputs.bound)
    ratio[~torch.isfinite(ratio)] = math.inf  # NaN compares false: make it the worst
    flat = int(torch.argmax(ratio))
    where = _index(flat, ratio.shape)

    def at(t: torch.Tensor) -> float:
        return float(t.reshape(-1)[flat])

    return Verdict(rel_err(out, inputs.reference, inputs.norm_floor), tolerance(problem), at(ratio), where,
                   at(out), at(inputs.reference))


# Whether the one-pass judgement gave this judgement's verdict on the first output it judged in
# this process (None: not tried yet). A kernel that cannot compile here, or that disagrees, is
# not used again: verification is what keeps wrong kernels out, so it is checked before trusted.
_one_pass: dict[str, bool | None] = {"trusted": None}


def _judged_in_one_pass(out: torch.Tensor, problem: Problem, inputs: Inputs) -> Verdict | None:
    """``judge``'s verdict from the one-pass GPU kernel, where it can read ``out`` (else None);
    the first time in a process, compared with the torch judgement's first."""
    from gemmtune.tuning import judging  # imports triton, which ``import gemmtune`` must not

    if not judging.takes(out, inputs.reference, inputs.bound):
        return None
    try:
        found = judging.judge(out, inputs.reference, inputs.bound)
    except Exception as exc:  # noqa: BLE001 - a kernel that fails here leaves the torch judgement
        log.warning("gemmtune: the one-pass verification kernel failed (%s: %s); verifying in torch",
                    type(exc).__name__, exc)
        _one_pass["trusted"] = False
        return None
    where = _index(found.flat, out.shape)
    verdict = Verdict(relative(found.error_norm, found.ref_norm, out, inputs.norm_floor), tolerance(problem),
                      found.worst, where, found.value, found.expected)
    if _one_pass["trusted"] is None:
        expected = _judged_in_torch(out, problem, inputs)
        _one_pass["trusted"] = _same(verdict, expected)
        if not _one_pass["trusted"]:
            log.warning("gemmtune: the one-pass verification kernel disagreed with torch's judgement "
                        "(%s against %s); verifying in torch", verdict, expected)
            return expected
    return verdict


def _index(flat: int, shape: torch.Size) -> tuple[int, ...]:
    """The element at ``flat`` in a contiguous tensor of ``shape``, as its index per dimension."""
    return tuple(int(i) for i in numpy.unravel_index(flat, tuple(shape)))


def _same(mine: Verdict, theirs: Verdict) -> bool:
    """Two verdicts on one output alike: the same worst element and ratio, the same error norm
    to rounding (their sums run in different orders)."""
    def close(x: float, y: float) -> bool:
        return x == y or math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-300)

    return (close(mine.worst, theirs.worst) and mine.where == theirs.where and close(mine.rel_err, theirs.rel_err)
            and close(mine.expected, theirs.expected))


def warm_up(problem: Problem, *operands) -> None:
    """The reference, the bound and the judgement run once on ``problem``'s operands, for the
    kernels they load on first use (cuBLAS's float64 GEMM among them), while something else waits."""
    inputs = inputs_of(problem, *operands)
    judge(inputs.reference.to(TORCH_DTYPES[problem.out_dtype]), problem, inputs)


def out_shape(problem: Problem) -> tuple[int, ...]:
    """The output's shape: (M, N), with the batch first where the product is batched."""
    return (problem.batch, problem.m, problem.n) if problem.batch > 1 else (problem.m, problem.n)


def check(kernel, problem: Problem, inputs: Inputs) -> Verdict:
    """Run ``kernel`` once into a NaN-poisoned output and judge it."""
    out = torch.full(out_shape(problem), float("nan"), dtype=TORCH_DTYPES[problem.out_dtype],
                     device=inputs.a.device)
    result = kernel(*inputs.operands, out=out)
    if result.data_ptr() != out.data_ptr():
        raise RuntimeError("kernel ignored its out= argument")
    return judge(out, problem, inputs)
