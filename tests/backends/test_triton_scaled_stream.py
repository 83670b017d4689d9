"""The fp8 TMA decode kernel against the float64 dequantized reference (``verify``): under the
interpreter without a GPU, on Hopper with one; compiled for sm_90 without one (its wgmma and its
promotions); its space, configs and refusals; against ``torch._scaled_mm`` on Llama-8B's decode
shapes on a GPU."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gemmtune import backends
from gemmtune.backends.triton_scaled_stream import BACKEND, TILES, ScaledStreamConfig, space
from gemmtune.backends.triton_stream import STAGES
from gemmtune.device import Device, current
from gemmtune.problem import SCALE_BLOCK, Problem
from gemmtune.tuning import verify

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability() >= (9, 0)
H100 = Device("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448, 50 << 20)
A100 = Device("NVIDIA A100", (8, 0), 108, 166912, 40 << 20)
L4 = Device("NVIDIA L4", (8, 9), 58, 101376, 48 << 20)
FP8 = ["float8_e4m3fn", "float8_e5m2"]
SCALINGS = ["tensor", "row", "block"]
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not ON_HOPPER, reason="TMA descriptors need Hopper")


def _configs(problem: Problem) -> list[ScaledStreamConfig]:
    """The space here (the H100's on a GPU), and tiles beyond the interpreter's: the GPU's K
    depths, K split in four, BLOCK_N past 16, and several M tiles of 16 rows."""
    configs = space(problem, current() if DEVICE == "cpu" else H100)
    block_m = configs[0].block_m
    extra = [ScaledStreamConfig(block_m, 64, 128, 4, 2, 4), ScaledStreamConfig(16, 64, 64, 4, 2, 2)]
    if problem.scaling != "block":
        extra.append(ScaledStreamConfig(block_m, 128, 256, 4, 2, 1))
    return configs + [c for c in extra if c not in configs]


def _check(problem: Problem, inputs: verify.Inputs) -> None:
    for config in _configs(problem):
        verdict = verify.check(BACKEND.build(problem, config, current()), problem, inputs)
        assert verdict.ok, (config, verdict.reason())


# (m, n, k, out_dtype, bias, activation): M of 1 to 64 (one and several M tiles), N of 8 (under
# one tile), 33 and 130 (past one 128-row scale block), K of 16 (one partial K tile and scale
# block), 48 and 272 (a partial third scale block)
CASES = [(1, 130, 272, "bfloat16", True, "none"), (7, 33, 48, "float32", False, "relu"),
         (16, 8, 16, "float16", True, "gelu_tanh"), (33, 130, 272, "bfloat16", True, "silu"),
         (64, 33, 48, "bfloat16", False, "none")]


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("m,n,k,out_dtype,bias,act", CASES)
def test_matches_reference(m, n, k, out_dtype, bias, act, scaling, dtype):
    problem = Problem(m, n, k, dtype, bias=bias, activation=act, scaling=scaling, out_dtype=out_dtype)
    _check(problem, verify.make_inputs(problem, DEVICE, seed=m + n + k))


@pytest.mark.interpreter
@pytest.mark.parametrize("scaling", SCALINGS)
def test_4104_weight_rows_end_past_the_last_full_tile(scaling):
    """N = 4104, 8 past a multiple of every tile and of the scale block: the last tile of weight
    rows mostly zero-filled by the descriptor, its scales read wrapped, its outputs masked."""
    problem = Problem(7, 4104, 48, "float8_e4m3fn", bias=True, activation="silu", scaling=scaling)
    inputs = verify.make_inputs(problem, DEVICE, seed=4104)
    for config in space(problem, current() if DEVICE == "cpu" else H100):
        verdict = verify.check(BACKEND.build(problem, config, current()), problem, inputs)
        assert verdict.ok, (config, verdict.reason())


def _views(inputs: verify.Inputs, problem: Problem) -> tuple:
    """The operands as a caller may lay them: a a strided slice (no descriptor can address it:
    copied), b the transpose of a (K, N) tensor, a strided bias, B's block scales column-major."""
    a, b, bias, sa, sb = inputs.operands
    wide = torch.zeros(problem.m, 2 * problem.k, dtype=a.dtype, device=DEVICE)
    wide[:, 1::2] = a
    bias_view = torch.zeros(2 * problem.n, dtype=bias.dtype, device=DEVICE)[::2]
    bias_view.copy_(bias)
    if problem.scaling == "block":
        sb = sb.t().contiguous().t()
    return wide[:, 1::2], b.t().contiguous().t(), bias_view, sa, sb


@pytest.mark.interpreter
@pytest.mark.parametrize("scaling", SCALINGS)
def test_strided_operands_and_out(scaling):
    problem = Problem(5, 130, 272, "float8_e5m2", bias=True, activation="gelu", scaling=scaling)
    inputs = verify.make_inputs(problem, DEVICE, seed=5)
    operands = _views(inputs, problem)
    assert not operands[0].is_contiguous() and not operands[1].is_contiguous()
    for config in _configs(problem)[:2]:
        big = torch.full((problem.m + 2, 2 * problem.n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        out = big[1:-1, ::2]  # what lies between its elements must stay untouched
        assert BACKEND.build(problem, config, current())(*operands, out=out) is out
        verdict = verify.judge(out, problem, inputs)
        assert verdict.ok, (config, verdict.reason())
        assert big[0].isnan().all() and big[1:-1, 1::2].isnan().all() and big[-1].isnan().all()


@pytest.mark.interpreter
def test_allocates_the_output_when_none_is_given():
    problem = Problem(7, 33, 48, "float8_e4m3fn", scaling="row", out_dtype="float16")
    inputs = verify.make_inputs(problem, DEVICE, seed=3)
    out = BACKEND.build(problem, _configs(problem)[0], current())(*inputs.operands)
    assert out.dtype == torch.float16 and out.shape == (7, 33) and out.is_contiguous()
    assert verify.judge(out, problem, inputs).ok


@pytest.mark.parametrize("scaling, which, shape, message", [
    ("tensor", "a", (2,), "scale_a has 2 elements"),
    ("row", "b", (32, 1), "scale_b has 32 elements"),
    ("block", "b", (2, 3), r"scale_b of shape \(2, 3\).*accepted: \(1, 3\)"),
])
def test_scales_of_the_wrong_shape_are_refused(scaling, which, shape, message):
    problem = Problem(7, 33, 272, "float8_e4m3fn", scaling=scaling)
    a, b, bias, sa, sb = verify.make_operands(problem, DEVICE, seed=1)
    wrong = torch.ones(shape, device=DEVICE)
    sa, sb = (wrong, sb) if which == "a" else (sa, wrong)
    with pytest.raises(ValueError, match=message):
        BACKEND.build(problem, ScaledStreamConfig(16, 16, 32, 1, 1), current())(a, b, bias, sa, sb)


def test_space_serves_fp8_decode_on_hopper_only():
    decode = Problem(16, 4096, 4096, "float8_e4m3fn", scaling="row")
    configs = space(decode, H100)
    assert {(c.block_n, c.block_k) for c in configs} == {(bn, bk) for bn, bk, _, _ in TILES}
    assert all(c.block_m == 16 and c.smem_bytes(1) <= H100.smem_per_block for c in configs)
    assert space(Problem(1, 4096, 4096, "float8_e4m3fn", scaling="tensor"), H100)
    assert space(Problem(65, 4096, 4096, "float8_e4m3fn", scaling="row"), H100) == []
    assert space(Problem(16, 4096, 4104, "float8_e4m3fn", scaling="row"), H100) == []  # K % 16: no descriptor
    assert space(Problem(16, 4104, 4096, "float8_e4m3fn", scaling="row"), H100)  # any N
    assert space(Problem(16, 4096, 4096), H100) == []  # bf16: triton_stream's
    assert space(decode, A100) == [] and space(decode, L4) == []
    assert not BACKEND.is_available(A100) and not BACKEND.is_available(L4) and BACKEND.is_available(H100)


def test_block_scaling_takes_k_tiles_inside_a_scale_block():
    configs = space(Problem(16, 4096, 4096, "float8_e4m3fn", scaling="block"), H100)
    assert configs and all(SCALE_BLOCK % c.block_k == 0 for c in configs)


def test_k_is_split_where_the_tiles_leave_sms_idle():
    """6144 weight rows are 96 tiles of 64 for 132 SMs: split; 28672 rows fill them: not; each
    split's reduction launch is counted in its prediction."""
    few = space(Problem(16, 6144, 4096, "float8_e4m3fn", scaling="row"), H100)
    assert {c.split_k for c in few if c.block_n == 64} == {1, 2}
    assert {c.split_k for c in space(Problem(16, 28672, 4096, "float8_e4m3fn", scaling="row"), H100)} == {1}
    problem = Problem(16, 6144, 4096, "float8_e4m3fn", scaling="row")
    one, two = (next(c for c in few if c.block_n == 64 and c.block_k == 256 and c.split_k == s) for s in (1, 2))
    assert BACKEND.predict_ms(problem, H100, two) > 0 and BACKEND.predict_ms(problem, H100, one) > 0


def test_pipelines_fit_shared_memory_and_k():
    """Stages cut to what shared memory holds beside 64 rows of A, and to K's steps."""
    wide = space(Problem(64, 4096, 4096, "float8_e4m3fn", scaling="row"), H100)
    assert wide and all(c.block_m == 64 and c.smem_bytes(1) <= H100.smem_per_block for c in wide)
    assert {c.num_stages for c in wide if (c.block_n, c.block_k) == (64, 256)} == {7}
    shallow = space(Problem(16, 4096, 256, "float8_e4m3fn", scaling="row"), H100)
    assert all(c.num_stages == 2 for c in shallow)


def test_it_is_asked_for_fp8_products_alone():
    assert "triton_scaled_stream" in backends.names() and "triton_scaled_stream" in backends.SCALED
    assert backends.takes("triton_scaled_stream", Problem(16, 4096, 4096, "float8_e5m2", scaling="row"))
    assert not backends.takes("triton_scaled_stream", Problem(16, 4096, 4096))
    assert backends.get("triton_scaled_stream") is BACKEND


def test_build_refuses_what_the_kernel_cannot_compute():
    with pytest.raises(ValueError, match="BLOCK_K=256 does not divide the scale block"):
        BACKEND.build(Problem(16, 256, 512, "float8_e4m3fn", scaling="block"), ScaledStreamConfig(16, 64, 256),
                      current())
    with pytest.raises(ValueError, match="K=40; accepted: K % 16 == 0"):
        BACKEND.build(Problem(16, 256, 40, "float8_e4m3fn", scaling="row"), ScaledStreamConfig(16, 64, 128),
                      current())
    with pytest.raises(ValueError, match="serves fp8"):
        BACKEND.build(Problem(16, 256, 512), ScaledStreamConfig(16, 64, 128), current())


@pytest.mark.parametrize("field, value", [("BLOCK_M", 8), ("BLOCK_N", 32), ("BLOCK_K", 16), ("SPLIT_K", 3),
                                          ("SPLIT_K", True), ("num_warps", 8), ("num_stages", 9),
                                          ("num_stages", "3")])
def test_out_of_bounds_configs_are_refused(field, value):
    data = dict(ScaledStreamConfig(16, 64, 256, 4, 8).as_dict(), **{field: value})
    with pytest.raises(ValueError, match=f"triton_scaled_stream {field}={value!r} is out of bounds"):
        BACKEND.parse_config(data)


FIELDS = ScaledStreamConfig.FIELDS
# what a config may hold: every value some space yields, on some device or the interpreter
ACCEPTED = {"BLOCK_M": (16, 32, 64), "BLOCK_N": (16, 64, 128), "BLOCK_K": (32, 64, 128, 256), "SPLIT_K": (1, 2, 4, 8, 16),
            "num_warps": (1, 4), "num_stages": STAGES}
VALUES = st.one_of(st.sampled_from((0, 1, 2, 4, 8, 16, 32, 64, 128, 256)), st.integers(-1, 300), st.booleans(),
                   st.none(), st.just("16"))


@settings(max_examples=300, deadline=None, database=None)
@given(data=st.fixed_dictionaries({name: VALUES for name in FIELDS}), drop=st.sampled_from((None, *FIELDS)))
def test_an_untrusted_config_parses_only_within_bounds(data, drop):
    """Store entries are untrusted: anything parsed holds only accepted values, and round trips."""
    if drop is not None:
        data = {k: v for k, v in data.items() if k != drop}
    try:
        config = BACKEND.parse_config(data)
    except ValueError:
        return
    assert drop is None and BACKEND.parse_config(config.as_dict()) == config
    assert all(type(v) is int and v in ACCEPTED[name] for name, v in config.as_dict().items())


def test_every_config_of_the_space_round_trips():
    for scaling in SCALINGS:
        for m in (1, 16, 33, 64):
            for config in space(Problem(m, 14336, 4096, "float8_e4m3fn", scaling=scaling), H100):
                assert BACKEND.parse_config(config.as_dict()) == config
    with pytest.raises(ValueError, match="exactly the keys"):
        BACKEND.parse_config({k: v for k, v in ScaledStreamConfig(16, 64, 256).as_dict().items() if k != "SPLIT_K"})


SM90_PROBE = """
import json, re, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gemmtune.backends.kernels.scaled_stream import scaled_stream_matmul

fp8 = {"float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}
for scaling, dtype, split, bm, bn, bk, stages in json.loads(sys.argv[1]):
    constexprs = dict(SCALING=scaling, HAS_BIAS=True, ACTIVATION="silu", SPLIT_K=split, BLOCK_M=bm, BLOCK_N=bn,
                      BLOCK_K=bk, stride_cn=1, stride_bias=1, stride_sam=1, stride_sbn=1)
    signature, fixed, attrs = {}, {}, {}
    for i, name in enumerate(scaled_stream_matmul.arg_names):
        if name in constexprs:
            signature[name], fixed[(i,)] = "constexpr", constexprs[name]
        elif name.endswith("_desc"):
            signature[name] = f"tensordesc<{fp8[dtype]}[{bm if name == 'a_desc' else bn}, {bk}]>"
        elif name.endswith("_ptr"):
            signature[name] = "*bf16" if name in ("c_ptr", "bias_ptr") else "*fp32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name], attrs[(i,)] = "i32", [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(scaled_stream_matmul, signature, fixed, attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=stages))
    ptx = compiled.asm["ptx"]
    print(json.dumps([sorted(set(re.findall(r"wgmma\\.mma_async\\S*", ptx))),
                      len(re.findall(r"wgmma\\.mma_async", ptx)), len(re.findall(r"\\badd\\.f32", ptx)),
                      len(re.findall(r"cp\\.async\\.bulk\\.tensor", ptx)), compiled.metadata.shared]))
"""


def _sm90(*kernels: tuple) -> list:
    """Each (scaling, dtype, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K, stages) compiled for an H100:
    (its wgmma instructions, their count, add.f32 count, TMA loads, shared memory bytes)."""
    import json

    from ptx import outside_interpreter

    return [json.loads(line) for line in outside_interpreter(SM90_PROBE, json.dumps(kernels)).splitlines()]


def test_on_sm90_the_weights_are_the_fp8_wgmma_side_and_partial_sums_are_promoted():
    """Compiled for sm_90 (no GPU needed): the weight tile (64 rows) on fp8 wgmma's M side and the
    16 rows of A as its N, both operands K-major straight from the TMA tiles; a partial
    accumulator joins the fp32 one every 128 K: per K tile of 256, at least two adds for each of
    the 64 x 16 / 128 accumulator registers a thread holds; a split adds no MMA."""
    whole, split, e5m2 = _sm90(("row", "float8_e4m3fn", 1, 16, 64, 256, 8),
                               ("row", "float8_e4m3fn", 2, 16, 64, 256, 8),
                               ("tensor", "float8_e5m2", 1, 16, 64, 256, 8))
    assert whole[0] == split[0] == ["wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3"]
    assert e5m2[0] == ["wgmma.mma_async.sync.aligned.m64n16k32.f32.e5m2.e5m2"]
    assert whole[1] == split[1] == 8  # one k32 instruction per 32 of the K tile
    assert whole[2] >= 2 * 64 * 16 // 128
    assert whole[3] > 0  # the operands arrive by TMA


def test_on_sm90_each_tile_of_the_space_compiles_within_shared_memory():
    """The H100 space's tiles at M of 16 and 64, as Triton allocates them: within the 227 KB a
    block may opt in to, where the space's estimate counts the operand pipeline alone."""
    kernels = [(scaling, "float8_e4m3fn", c.split_k, c.block_m, c.block_n, c.block_k, c.num_stages)
               for scaling in ("row", "block") for m in (16, 64)
               for c in space(Problem(m, 4096, 4096, "float8_e4m3fn", scaling=scaling), H100)]
    for kernel, (wgmma, _, _, tma, shared) in zip(kernels, _sm90(*kernels)):
        assert wgmma and tma and shared <= H100.smem_per_block, (kernel, shared)


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", ["tensor", "row"])
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_matches_torch_scaled_mm_on_llama_8b_decode(n, k, m, scaling):
    """Every config of the space within the bound of the float64 reference, as torch._scaled_mm
    is, and the two within twice the bound of each other."""
    problem = Problem(m, n, k, "float8_e4m3fn", scaling=scaling)
    inputs = verify.make_inputs(problem, "cuda", seed=m + n + k)
    a, b, _, sa, sb = inputs.operands
    theirs = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb.t() if scaling == "row" else sb,
                              out_dtype=torch.bfloat16)
    assert verify.judge(theirs, problem, inputs).ok
    device = current()
    for config in BACKEND.candidates(problem, device):
        out = BACKEND.build(problem, config, device)(*inputs.operands)
        verdict = verify.judge(out, problem, inputs)
        assert verdict.ok, (config, verdict.reason())
        assert ((out.double() - theirs.double()).abs() <= 2 * inputs.bound).all(), config


@pytest.mark.gpu
def test_on_hopper_no_tile_of_the_space_spills():
    """Every config the space offers on this GPU, at M of 16 and 64 in each scaling: right, and
    compiled without spilling registers (the precise accumulation and block scaling keep two
    accumulators)."""
    from gemmtune.backends.kernels.scaled_stream import scaled_stream_matmul

    device = current()
    kernel_cache = scaled_stream_matmul.device_caches[torch.cuda.current_device()][0]
    kernel_cache.clear()  # so that the binaries left are this test's
    for scaling in SCALINGS:
        for m in (16, 64):
            problem = Problem(m, 4096, 4096, "float8_e4m3fn", scaling=scaling)
            inputs = verify.make_inputs(problem, "cuda", seed=m)
            for config in BACKEND.candidates(problem, device):
                verdict = verify.judge(BACKEND.build(problem, config, device)(*inputs.operands), problem, inputs)
                assert verdict.ok, (config, verdict.reason())
    assert kernel_cache and all(compiled.n_spills == 0 for compiled in kernel_cache.values())


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", SCALINGS)
def test_later_calls_launch_the_binary_directly(scaling):
    problem = Problem(16, 4096, 4096, "float8_e4m3fn", bias=True, activation="silu", scaling=scaling)
    kernel = BACKEND.build(problem, BACKEND.candidates(problem, current())[0], current())
    inputs = verify.make_inputs(problem, "cuda", seed=1)
    for _ in range(3):  # the first call goes through the JIT, the others through its launcher
        verdict = verify.judge(kernel(*inputs.operands), problem, inputs)
        assert verdict.ok, verdict.reason()
    assert kernel._launch.binaries() == 1
