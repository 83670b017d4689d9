"""The persistent TMA kernel against a float64 reference: under the interpreter without a GPU,
on Hopper with one. Aligned rows only (the backend's contract); any M, N, K otherwise."""

import pytest
import torch

from gemmtune.backends.triton_persistent import BACKEND, PersistentConfig, space
from gemmtune.device import Device, current
from gemmtune.problem import Problem
from gemmtune.tuning import verify

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability() >= (9, 0)
H100 = Device("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448, 50 << 20)
A100 = Device("NVIDIA A100", (8, 0), 108, 166912, 40 << 20)
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not ON_HOPPER, reason="TMA descriptors need Hopper")

SMALL = [PersistentConfig(16, 16, 16, 8, 1, 1), PersistentConfig(32, 16, 32, 2, 1, 1)]
CONFIGS = SMALL if DEVICE == "cpu" else [PersistentConfig(128, 128, 64, 8, 8, 3),
                                         PersistentConfig(128, 256, 64, 8, 8, 3, True)]


@pytest.mark.interpreter
@pytest.mark.parametrize("layout", ["linear", "nn"])
@pytest.mark.parametrize("m,n,k", [(1, 8, 8), (33, 40, 72), (7, 16, 200), (70, 24, 40)])
@pytest.mark.parametrize("bias, act", [(False, "none"), (True, "gelu_tanh")])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_matches_reference(m, n, k, layout, bias, act, dtype):
    problem = Problem(m, n, k, dtype, layout, bias, activation=act)
    inputs = verify.make_inputs(problem, DEVICE)
    for config in CONFIGS:
        err = verify.check(BACKEND.build(problem, config, current()), problem, inputs)
        assert err.ok, (config, err.reason())


@pytest.mark.interpreter
@pytest.mark.parametrize("layout", ["linear", "nn"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_4095_rows_end_one_short_of_a_tile(layout, dtype):
    """M = 4095: the programs walk hundreds of tiles each, the last tile's rows clipped by the
    descriptors (N and K must stay 16-byte multiples: the backend's contract)."""
    problem = Problem(4095, 24, 16, dtype, layout, True, activation="relu")
    inputs = verify.make_inputs(problem, DEVICE)
    for config in CONFIGS:
        err = verify.check(BACKEND.build(problem, config, current()), problem, inputs)
        assert err.ok, (config, err.reason())


@pytest.mark.interpreter
def test_strided_views_are_copied_not_misread():
    problem = Problem(24, 16, 32, "float32", "nn")
    a = torch.randn(32, 48, device=DEVICE)[:, :24].t()  # (24, 32), column-major view
    b = torch.randn(32, 16, device=DEVICE)
    kernel = BACKEND.build(problem, CONFIGS[0], current())
    assert verify.rel_err(kernel(a, b, None), a.double() @ b.double()) < 1e-5


def test_space_is_hopper_only_and_fits():
    problem = Problem(8192, 8192, 8192)
    configs = space(problem, H100)
    assert configs and all(c.smem_bytes(2) <= H100.smem_per_block for c in configs)
    assert not any(c.warp_specialize for c in configs)  # the same kernel as without: see below
    assert space(problem, A100) == [] and space(Problem(16, 4096, 4096), H100) == []
    assert BACKEND.candidates(Problem(4095, 4097, 4095), H100) == []  # misaligned rows: padded path


def test_tiles_must_fill_the_last_round_and_operands_be_half_precision():
    """qkv at M=128 (6144 columns) on 38 SMs: 48 tiles of 128x128 leave the second round of
    programs 26% busy, 96 of 64x128 the third 53%: neither is kept. At 2048 rows every tile size
    keeps the rounds at least 90% full. float32 gets nothing (0.29x of cuBLAS where measured)."""
    sm38 = Device("NVIDIA H200 under MPS", (9, 0), 38, 232448, 60 << 20)
    assert space(Problem(128, 6144, 4096), sm38) == []
    kept = {(c.block_m, c.block_n) for c in space(Problem(2048, 6144, 4096), sm38)}
    assert (128, 256) in kept and (128, 128) in kept
    for c in space(Problem(2048, 6144, 4096), sm38):
        tiles = -(-2048 // c.block_m) * -(-6144 // c.block_n)
        assert tiles >= 0.9 * -(-tiles // 38) * 38
    assert space(Problem(4096, 4096, 4096, "float32", tf32=True), H100) == []
    assert space(Problem(4096, 4096, 4096, "float16"), H100)


def test_persistence_needs_more_tiles_than_sms():
    """The seeds' MLP (256x1024 outputs: 8 to 32 tiles) leaves each of 132 programs one tile at
    most: no persistent candidates there, some on a GPU with 16 SMs."""
    mlp = Problem(256, 1024, 1024)
    assert space(mlp, H100) == []
    small = Device("NVIDIA H100 under MPS", (9, 0), 16, 232448, 50 << 20)
    configs = space(mlp, small)
    assert configs and all(-(-256 // c.block_m) * -(-1024 // c.block_n) > 16 for c in configs)


@pytest.mark.parametrize("data", [
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3,
     "WARP_SPECIALIZE": 1},
    {"BLOCK_M": 100, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3,
     "WARP_SPECIALIZE": False},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
])
def test_untrusted_configs_are_rejected(data):
    with pytest.raises(ValueError):
        BACKEND.parse_config(data)


def test_config_round_trips():
    config = PersistentConfig(128, 256, 64, 8, 8, 4, True)
    assert BACKEND.parse_config(config.as_dict()) == config


@pytest.mark.gpu
def test_warp_specialization_compiles_to_the_same_kernel_on_hopper():
    """Why the space leaves WARP_SPECIALIZE out: Triton 3.6 compiles it on the persistent loop to
    the same PTX for sm_90, so each kernel was timed twice. If a Triton version makes it differ,
    this fails: put both schedules back into the space and measure them."""
    from ptx import sm90_ptx

    constexprs = dict(B_IS_NK=True, HAS_BIAS=False, ACTIVATION="none", PRECISION="ieee", BLOCK_M=128,
                      BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    descriptors = {"a_desc": (128, 64), "b_desc": (256, 64), "c_desc": (128, 256)}
    plain, specialized = (sm90_ptx("persistent", (8192, 8192, 8192, 132), constexprs | {"WARP_SPECIALIZE": ws},
                                   descriptors) for ws in (False, True))
    assert "wgmma.mma_async" in plain
    assert specialized == plain


@pytest.mark.parametrize("warp_specialize", [False, True])
def test_on_hopper_the_matrix_instructions_are_hgmma(warp_specialize):
    """The persistent kernel must use Hopper's warpgroup MMA (HGMMA in SASS), not the older
    HMMA path that Ampere-style code compiles to."""
    device = current()
    if not device.is_hopper:
        pytest.skip("a Hopper GPU is needed")
    from triton.tools.disasm import get_sass

    problem = Problem(256, 512, 512)
    kernel = BACKEND.build(problem, PersistentConfig(128, 128, 64, 8, 4, 3, warp_specialize), device)
    inputs = verify.make_inputs(problem, "cuda", seed=0)
    assert verify.rel_err(kernel(inputs.a, inputs.b, None), inputs.reference) < verify.tolerance(problem)
    assert "wgmma.mma_async" in kernel.compiled.asm["ptx"]
    sass = get_sass(kernel.compiled.asm["cubin"])
    assert "HGMMA" in sass and "HMMA" not in sass.replace("HGMMA", "")
    assert kernel.compiled.n_spills == 0
