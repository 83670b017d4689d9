"""``scaled_mm_fast``: torch._scaled_mm with fast accumulation, a candidate of fp8 products only,
checked like every candidate (on the CPU, torch's CPU kernel stands in)."""

import pytest
import torch

from gemmtune import backends
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.tuning import verify
from scaled_mm_support import scales_rows_on

FAST = backends.get("scaled_mm_fast")


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_it_computes_the_product_of_the_dequantized_operands(scaling):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if scaling == "row" and not scales_rows_on(device):
        pytest.skip(f"torch {torch.__version__}'s _scaled_mm has no row-wise scaling on {device}")
    # what cuBLASLt's fp8 kernels take: N a multiple of 16, not two e5m2 operands
    p = Problem(33, 144, 256, "float8_e4m3fn", scaling=scaling, bias=True, activation="relu")
    inputs = verify.make_inputs(p, device, seed=2)
    assert verify.check(FAST.build(p, FAST.parse_config({}), current()), p, inputs).ok


def test_it_serves_fp8_products_alone():
    assert FAST.candidates(Problem(8, 8, 8, "bfloat16"), current()) == []
    assert len(FAST.candidates(Problem(8, 16, 16, "float8_e4m3fn", scaling="row"), current())) == 1
    assert backends.takes("scaled_mm_fast", Problem(8, 8, 8, "float8_e4m3fn", scaling="row"))
    assert not backends.takes("scaled_mm_fast", Problem(8, 8, 8, "bfloat16"))
    with pytest.raises(ValueError, match="fp8 \\(scaled\\) problems only"):
        FAST.build(Problem(8, 8, 8), FAST.parse_config({}), current())
    # where torch has no fast-accumulating kernel (H100, torch 2.11), nothing is offered
    for refused in (Problem(8, 16, 16, "float8_e4m3fn", scaling="block"),
                    Problem(8, 8, 8, "float8_e4m3fn", scaling="tensor"),
                    Problem(8, 16, 16, "float8_e5m2", scaling="tensor"),
                    Problem(8, 16, 16, "float8_e4m3fn", scaling="tensor", bias=True, out_dtype="float32")):
        assert FAST.candidates(refused, current()) == [], refused
    with pytest.raises(ValueError, match="takes no config parameters"):
        FAST.parse_config({"fast": 1})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("scaling", ["tensor", "row"])
@pytest.mark.parametrize("m, n, k", [(1, 4096, 14336), (16, 6144, 4096), (2048, 4096, 4096)])
def test_on_the_gpu_fast_accumulation_is_near_the_fp8_tolerance(scaling, m, n, k):
    # Fast accumulation keeps Hopper's ~14-bit fp8 accumulator over all of K: on an H100 its
    # worst element read 1.06-1.13x the fp8 tolerance at 2048 x 4096 x 4096 (and within it at
    # M <= 16). Verification then rejects it like any wrong candidate; this bounds how far off it is.
    p = Problem(m, n, k, "float8_e4m3fn", scaling=scaling)
    inputs = verify.make_inputs(p, "cuda", seed=3)
    verdict = verify.check(FAST.build(p, FAST.parse_config({}), current()), p, inputs)
    assert verdict.worst < 2, verdict.reason()
