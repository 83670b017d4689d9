"""Checking fp8 (scaled) products: the operands drawn for them, their scales' layouts, the float64
reference from the dequantized inputs, and the judgement of right and wrong kernels (torch's
``_scaled_mm`` on the CPU is the right one for per-tensor and row-wise scaling)."""

import pytest
import torch

from gemmtune import backends
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.tuning import verify
from scaled_mm_support import scales_rows_on

SIZES = [(1, 33, 200), (7, 130, 256), (33, 16, 128)]


@pytest.mark.parametrize("scaling", ["tensor", "row", "block"])
@pytest.mark.parametrize("m, n, k", SIZES)
def test_operands_are_fp8_with_scales_laid_as_torch_takes_them(scaling, m, n, k):
    p = Problem(m, n, k, "float8_e5m2", scaling=scaling, bias=True)
    a, b, bias, sa, sb = verify.make_operands(p, "cpu", seed=3)
    assert (a.shape, b.shape, bias.shape) == ((m, k), (n, k), (n,))
    assert a.dtype == b.dtype == torch.float8_e5m2 and bias.dtype == torch.bfloat16
    assert sa.dtype == sb.dtype == torch.float32 and bool((sa > 0).all()) and bool((sb > 0).all())
    kb, nb = -(-k // 128), -(-n // 128)
    shapes = {"tensor": ((), ()), "row": ((m, 1), (n, 1)), "block": ((m, kb), (nb, kb))}[scaling]
    assert (tuple(sa.shape), tuple(sb.shape)) == shapes
    if scaling == "block":
        assert sa.stride() == (1, m)  # column-major, as torch._scaled_mm's 1 x 128 scales
    assert a.float().abs().amax() > 0 and b.float().abs().amax() > 0  # never zeros


@pytest.mark.parametrize("scaling", ["tensor", "row", "block"])
def test_the_reference_is_the_product_of_the_dequantized_operands(scaling):
    p = Problem(5, 140, 300, "float8_e4m3fn", scaling=scaling)
    a, b, _, sa, sb = verify.make_operands(p, "cpu", seed=4)
    a64, b64 = a.double(), b.double()
    for i in range(p.m):  # the scales spelled out element by element
        for j in range(p.k):
            a64[i, j] *= float(sa.reshape(-1)[0] if scaling == "tensor" else sa[i, 0] if scaling == "row"
                               else sa[i, j // 128])
    for i in range(p.n):
        for j in range(0, p.k, 128):
            factor = float(sb.reshape(-1)[0] if scaling == "tensor" else sb[i, 0] if scaling == "row"
                           else sb[i // 128, j // 128])
            b64[i, j:j + 128] *= factor
    torch.testing.assert_close(verify.reference(p, a, b, None, sa, sb), a64 @ b64.t())


@pytest.mark.parametrize("scaling", ["tensor", "row"])
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_torch_scaled_mm_passes_and_a_kernel_that_drops_a_scale_fails(scaling, out_dtype):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if scaling == "row" and not scales_rows_on(device):
        pytest.skip(f"torch {torch.__version__}'s _scaled_mm has no row-wise scaling on {device}")
    # what torch's GPU kernel takes: N a multiple of 16, a bias with a 16-bit output only
    p = Problem(33, 144, 256, "float8_e4m3fn", scaling=scaling, out_dtype=out_dtype, bias=out_dtype != "float32",
                activation="gelu")
    inputs = verify.make_inputs(p, device, seed=5)
    right = backends.build(p, "cublas", {}, current())
    assert verify.check(right, p, inputs).ok

    def unscaled_b(a, b, bias, scale_a, scale_b, out=None):
        return right(a, b, bias, scale_a, torch.ones_like(scale_b), out=out)

    verdict = verify.check(unscaled_b, p, inputs)
    assert not verdict.ok and verdict.worst > 1


def test_a_kernel_that_misses_one_block_scale_fails():
    p = Problem(7, 130, 256, "float8_e4m3fn", scaling="block")
    inputs = verify.make_inputs(p, "cpu", seed=6)

    def one_block_off(a, b, bias, scale_a, scale_b, out):
        sb = scale_b.clone()
        sb[1, 1] *= 1.02  # 2% off on one 128 x 128 block of the weight
        out.copy_(verify.reference(p, a, b, None, scale_a, sb))
        return out

    def right(a, b, bias, scale_a, scale_b, out):
        return out.copy_(verify.reference(p, a, b, None, scale_a, scale_b))

    assert verify.check(right, p, inputs).ok
    assert not verify.check(one_block_off, p, inputs).ok
