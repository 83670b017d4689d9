"""The tiled Triton kernel against a float64 reference, under the interpreter without a GPU
(tier 2) and on the GPU when there is one, at the awkward sizes where masking bugs live."""

import re

import pytest
import torch

from gemmtune.backends.triton_tiled import BACKEND, FFMA_CONFIGS, TiledConfig
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.tuning import verify

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = ["float32", "float16", "bfloat16"]
SIZES = [(1, 1, 1), (1, 33, 7), (7, 33, 65), (33, 7, 4095), (64, 48, 40), (4095, 3, 17)]
CONFIGS = [TiledConfig(16, 16, 16, 8, 1, 1), TiledConfig(32, 16, 64, 2, 1, 1)]


def run(problem, config, inputs, out=None):
    kernel = BACKEND.build(problem, config, current())
    return kernel(inputs.a, inputs.b, inputs.bias, out=out)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["linear", "nn"])
@pytest.mark.parametrize("m,n,k", SIZES)
def test_matches_reference(m, n, k, layout, dtype):
    problem = Problem(m, n, k, dtype, layout, bias=(m + n) % 2 == 0, tf32=False)
    inputs = verify.make_inputs(problem, DEVICE)
    for config in CONFIGS:
        err = verify.check(BACKEND.build(problem, config, current()), problem, inputs)
        assert err.ok, (config, err.reason())


@pytest.mark.interpreter
@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("layout", ["linear", "nn"])
def test_fused_activations_match_reference(act, layout):
    problem = Problem(33, 47, 65, "float32", layout, bias=True, activation=act)
    inputs = verify.make_inputs(problem, DEVICE)
    for config in CONFIGS:
        err = verify.check(BACKEND.build(problem, config, current()), problem, inputs)
        assert err.ok, (config, act, err.reason())


@pytest.mark.interpreter
@pytest.mark.parametrize("bm,bn,bk,warps,stages", FFMA_CONFIGS)
def test_the_cuda_core_configs_match_reference(bm, bn, bk, warps, stages):
    """Each float32 config of the CUDA cores' space, on a product that leaves every tile partial
    (a bias, K not a multiple of BLOCK_K) and on a batch of products, against float64."""
    config = TiledConfig(bm, bn, bk, 8, warps, stages)
    for problem in (Problem(133, 71, 35, "float32", "linear", bias=True), Problem(37, 65, 33, "float32", "nn", batch=3)):
        inputs = verify.make_inputs(problem, DEVICE)
        err = verify.check(BACKEND.build(problem, config, current()), problem, inputs)
        assert err.ok, (config, problem.describe(), err.reason())


@pytest.mark.interpreter
def test_every_output_element_is_written():
    problem = Problem(33, 47, 65, "float32", "nn")
    inputs = verify.make_inputs(problem, DEVICE)
    out = torch.full((33, 47), float("nan"), device=DEVICE)
    run(problem, CONFIGS[0], inputs, out=out)
    assert torch.isfinite(out).all()


@pytest.mark.interpreter
def test_strided_and_transposed_views():
    problem = Problem(20, 24, 36, "float32", "nn")
    a = torch.randn(36, 40, device=DEVICE)[:, :20].t()  # (20, 36) transposed view, non-contiguous
    b = torch.randn(24, 72, device=DEVICE)[:, ::2].t()  # (36, 24) strided
    ref = a.double() @ b.double()
    kernel = BACKEND.build(problem, CONFIGS[1], current())
    assert verify.rel_err(kernel(a, b, None), ref) < 1e-5


def test_tf32_precision_is_requested_only_when_allowed():
    ieee = BACKEND.build(Problem(8, 8, 8, "float32", tf32=False), CONFIGS[0], current())
    tf32 = BACKEND.build(Problem(8, 8, 8, "float32", tf32=True), CONFIGS[0], current())
    assert ieee._constexprs[False]["PRECISION"] == "ieee" and tf32._constexprs[True]["PRECISION"] == "tf32"


@pytest.mark.interpreter
@pytest.mark.parametrize("batch", [1, 3])
def test_a_kernel_refuses_another_k_than_it_was_built_for(batch):
    """K is a constant of the binary: a kernel built for one K and called with another would run
    the wrong number of K steps, so it says so instead; M and N may vary."""
    problem = Problem(8, 16, 32, "float32", "nn", batch=batch)
    kernel = BACKEND.build(problem, CONFIGS[0], current())
    shape = (batch,) if batch > 1 else ()
    a = torch.randn(*shape, 5, 32, device=DEVICE)
    b = torch.randn(*shape, 32, 24, device=DEVICE)
    assert verify.rel_err(kernel(a, b, None), (a.double() @ b.double())) < 1e-5  # other M and N
    with pytest.raises(ValueError, match="built for K=32, called with K=48"):
        kernel(torch.randn(*shape, 8, 48, device=DEVICE), torch.randn(*shape, 48, 16, device=DEVICE), None)


@pytest.mark.interpreter
def test_a_broken_kernel_fails_verification():
    problem = Problem(7, 33, 65, "float32", "linear")
    inputs = verify.make_inputs(problem, DEVICE)
    good = BACKEND.build(problem, CONFIGS[0], current())

    def drops_last_column(a, b, bias, out=None):
        result = good(a, b, bias, out=out)
        result[:, -1] = 0.0
        return result

    def writes_nothing(a, b, bias, out=None):
        return out

    assert not verify.check(drops_last_column, problem, inputs).ok
    unwritten = verify.check(writes_nothing, problem, inputs)
    assert unwritten.worst == unwritten.rel_err == float("inf")


@pytest.mark.interpreter
@pytest.mark.parametrize("m,n,k", [(5, 24, 40), (3, 40, 1000)])
def test_rows_aligned_to_8_elements_but_not_16(m, n, k):
    """Sizes and strides that are multiples of 8 elements (16 bytes in half precision) but not
    of 16 carry gemmtune's own alignment hints; views offset from 16 bytes must stay right."""
    problem = Problem(m, n, k, "float16", "nn")
    a = torch.randn(m, k + 8, device=DEVICE, dtype=torch.float16)[:, 4:k + 4]  # rows of k + 8, 8 bytes in
    b = torch.randn(k, n, device=DEVICE, dtype=torch.float16)
    ref = a.double() @ b.double()
    for config in CONFIGS:
        kernel = BACKEND.build(problem, config, current())
        assert verify.rel_err(kernel(a, b, None), ref) < 1e-2
        assert verify.rel_err(kernel(a.contiguous(), b, None), ref) < 1e-2


def test_hinted_rows_of_1000_compile_to_16_byte_copies():
    """The failure the hints fix, checked in the PTX: bf16 1000x1000x1000, rows 2000 bytes."""
    from ptx import sm90_ptx

    from gemmtune.backends.launch import gemm_hints

    scalars = (1000, 1000, 1000, 1, 1000, 1, 1000, 1, 0, 0, 0)  # m, n, the strides, no batch
    constexprs = dict(K=1000, HAS_BIAS=False, ACTIVATION="none", PRECISION="ieee", BLOCK_M=128,
                      BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    hinted = sm90_ptx("tiled", scalars, constexprs | gemm_hints(scalars))
    plain = sm90_ptx("tiled", scalars, constexprs | {"HINTS": (1,) * 10})
    assert "cp.async.cg.shared.global" in hinted and "ld.global.b16" not in hinted
    assert "cp.async" not in plain and "ld.global.b16" in plain  # what Triton does unaided
    # bf16 products on Hopper's own instruction: the interpreter's widening of bf16 operands
    # (gemmtune.backends.kernels.mma) never reaches a compiled kernel
    assert re.search(r"wgmma\.mma_async\S*\.bf16\.bf16", hinted)
