"""The fp8 (scaled) Triton kernel against a float64 reference, under the interpreter without a GPU
and against ``torch._scaled_mm`` on one, at the awkward sizes and on the views where masking
and stride bugs live; its config, space and scale checks.

Inputs are fresh random float32 values (rows of different magnitudes, and K blocks of different
magnitudes so that a scale read from the wrong block shows), quantized to fp8 with scales from
their amax. The reference is the dequantized product in float64, so quantization itself costs
nothing; each output element must lie within

    1.13 * 2**-7 * sqrt((A*A) @ (B*B).T) + ROUNDING[out_dtype] * |ref|

of it, A and B the dequantized inputs: 2**-7 of the product's natural scale for the accumulation
(room for Hopper's fast fp8 accumulation, about 2**-14 * sqrt(K / 2), and fp32 scale products),
1.13 the activations' steepest slope, and one unit in the last place of the output dtype (the
interpreter truncates bfloat16). A scale from a wrong row, column or block errs by far more:
neighbouring rows and K blocks differ in magnitude up to 16x.
"""

import pytest
import torch

from gemmtune import activation
from gemmtune.backends.triton_scaled import BACKEND, ScaledConfig, space
from gemmtune.device import Device, current
from gemmtune.problem import SCALE_BLOCK, Problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = ["float8_e4m3fn", "float8_e5m2"]
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
ROUNDING = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10, "float32": 2.0 ** -20}
ACCUMULATION = 2.0 ** -7
LIPSCHITZ = 1.13
# A plain tile, and a split-K one on the other FAST_ACC with K tiles of two per scale block
CONFIGS = [ScaledConfig(16, 16, 32, 8, 1, 0, 1, 1), ScaledConfig(32, 32, 64, 2, 2, 1, 1, 1)]
# (m, n, k, out_dtype, bias, activation): M of 1, 7, 33; N of 33 and 130 (past one 128-row scale
# block); K of 200 (a partial scale block and K tile) and 256
CASES = [(1, 130, 200, "bfloat16", True, "none"), (7, 33, 256, "float32", False, "relu"),
         (33, 130, 200, "bfloat16", False, "gelu"), (33, 33, 256, "float32", True, "silu")]
H100 = Device("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448, 50 << 20)
L4 = Device("NVIDIA L4", (8, 9), 58, 101376, 48 << 20)
A100 = Device("NVIDIA A100-SXM4-80GB", (8, 0), 108, 166912, 40 << 20)
TINY = Device("tiny", (9, 0), 2, 4096, 1 << 20)


def random_values(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """(rows, k) float32, never zero: each row and each 128-wide K block scaled by 2**[-2, 2) (products
    stay well inside float16's range)."""
    t = torch.randn(rows, k, generator=gen, device=DEVICE)
    t = t.sign().add_(t.eq(0)).mul_(t.abs().clamp_(min=1e-3))  # no zeros
    t *= torch.rand(rows, 1, generator=gen, device=DEVICE).mul_(4).sub_(2).exp2_()
    blocks = torch.rand(-(-k // SCALE_BLOCK), generator=gen, device=DEVICE).mul_(4).sub_(2).exp2_()
    return t * blocks.repeat_interleave(SCALE_BLOCK)[:k]


def block_amax(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The amax of each ``rows`` x SCALE_BLOCK block of ``t`` (edge blocks partial)."""
    r, k = t.shape
    padded = torch.nn.functional.pad(t.abs(), (0, -k % SCALE_BLOCK, 0, -r % rows))
    return padded.reshape(padded.shape[0] // rows, rows, -1, SCALE_BLOCK).amax(dim=(1, 3)).contiguous()


def expanded(scale: torch.Tensor, problem: Problem, shape: tuple, weight: bool) -> torch.Tensor:
    """``scale`` as one float64 value per element of an operand of ``shape``."""
    scale = scale.double()
    if problem.scaling == "tensor":
        return scale.reshape(1, 1).expand(shape)
    if problem.scaling == "row":
        return scale.reshape(-1, 1).expand(shape)
    rows = SCALE_BLOCK if weight else 1
    return scale.repeat_interleave(rows, 0).repeat_interleave(SCALE_BLOCK, 1)[:shape[0], :shape[1]]


def quantize(t: torch.Tensor, problem: Problem, weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in the problem's fp8 format and its float32 scales (amax over the format's largest)."""
    largest = FP8_MAX[problem.dtype]
    if problem.scaling == "tensor":
        scale = (t.abs().amax() / largest).reshape(())
    elif problem.scaling == "row":
        scale = t.abs().amax(dim=1, keepdim=True) / largest
    else:
        scale = block_amax(t, SCALE_BLOCK if weight else 1) / largest
    q = (t / expanded(scale, problem, t.shape, weight).float()).to(getattr(torch, problem.dtype))
    return q, scale


def operands(problem: Problem, seed: int) -> tuple:
    """(a, b, bias, scale_a, scale_b) for ``problem``, contiguous."""
    gen = torch.Generator(device=DEVICE)
    gen.manual_seed(seed)
    a, b = random_values(problem.m, problem.k, gen), random_values(problem.n, problem.k, gen)
    bias = None
    if problem.bias:  # as large as the products, so that a bias misread shows
        size = a.abs().mean() * b.abs().mean() * problem.k ** 0.5
        bias = (torch.randn(problem.n, generator=gen, device=DEVICE) * size).to(getattr(torch, problem.out_dtype))
    (qa, sa), (qb, sb) = quantize(a, problem, weight=False), quantize(b, problem, weight=True)
    return qa, qb, bias, sa, sb


def reference(problem: Problem, a, b, bias, sa, sb) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 result from the dequantized inputs, and each element's allowed error."""
    wide_a = a.double() * expanded(sa, problem, a.shape, weight=False)
    wide_b = b.double() * expanded(sb, problem, b.shape, weight=True)
    pre = wide_a @ wide_b.T
    if bias is not None:
        pre += bias.double()
    ref = activation.apply(pre, problem.activation)
    scale = ((wide_a * wide_a) @ (wide_b * wide_b).T).sqrt()
    return ref, LIPSCHITZ * ACCUMULATION * scale + ROUNDING[problem.out_dtype] * ref.abs()


def poisoned(problem: Problem) -> torch.Tensor:
    return torch.full((problem.m, problem.n), float("nan"), dtype=getattr(torch, problem.out_dtype), device=DEVICE)


def assert_close(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what) -> None:
    err = (out.double() - ref).abs()
    bad = ~(err <= bound)  # NaN (an element never written) fails too
    assert not bad.any(), (what, f"{int(bad.sum())} of {bad.numel()} elements out of bound; worst at "
                                 f"{divmod(int((err / bound).nan_to_num(float('inf')).argmax()), out.shape[1])}")


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scaling", ["tensor", "row", "block"])
@pytest.mark.parametrize("m,n,k,out_dtype,bias,act", CASES)
def test_matches_reference(m, n, k, out_dtype, bias, act, scaling, dtype):
    problem = Problem(m, n, k, dtype, bias=bias, activation=act, scaling=scaling, out_dtype=out_dtype)
    inputs = operands(problem, seed=m * n + k)
    ref, bound = reference(problem, *inputs)
    for config in CONFIGS:
        out = poisoned(problem)
        result = BACKEND.build(problem, config, current())(*inputs, out=out)
        assert result is out
        assert_close(out, ref, bound, config)


def views(problem: Problem, a, b, bias, sa, sb) -> dict:
    """The same operands as a caller may lay them: a as a transposed view or a strided slice of a
    bigger tensor, b as the transpose of a (K, N) tensor, block scales transposed, a strided bias."""
    wide = torch.zeros(problem.m, 2 * problem.k + 3, dtype=a.dtype, device=DEVICE)
    wide[:, 3::2] = a
    bias_view = None
    if bias is not None:
        bias_view = torch.zeros(2 * problem.n, dtype=bias.dtype, device=DEVICE)[::2]
        bias_view.copy_(bias)
    if problem.scaling == "block":
        sa, sb = sa.t().contiguous().t(), sb.t().contiguous().t()
    b_t = b.t().contiguous().t()
    return {"a transposed": (a.t().contiguous().t(), b_t, bias_view, sa, sb),
            "a strided": (wide[:, 3::2], b_t, bias_view, sa, sb)}


@pytest.mark.interpreter
@pytest.mark.parametrize("scaling", ["tensor", "row", "block"])
def test_strided_and_transposed_views(scaling):
    problem = Problem(33, 130, 200, "float8_e4m3fn", bias=True, activation="gelu_tanh", scaling=scaling)
    inputs = operands(problem, seed=7)
    ref, bound = reference(problem, *inputs)
    # K tiles as deep as a scale block, and a tile across two blocks of B's rows (130 > 128)
    for config in (ScaledConfig(16, 32, 128, 1, 1, 0, 1, 1), ScaledConfig(16, 256, 64, 1, 1, 0, 1, 1)):
        kernel = BACKEND.build(problem, config, current())
        for name, operands_view in views(problem, *inputs).items():
            assert not operands_view[0].is_contiguous() and not operands_view[1].is_contiguous()
            big = torch.full((problem.m + 2, 2 * problem.n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
            out = big[1:-1, ::2]  # a strided output: what lies between its elements stays untouched
            kernel(*operands_view, out=out)
            assert_close(out, ref, bound, (name, config))
            assert big[0].isnan().all() and big[1:-1, 1::2].isnan().all() and big[-1].isnan().all()


@pytest.mark.interpreter
def test_allocates_the_output_when_none_is_given():
    problem = Problem(7, 33, 200, "float8_e5m2", scaling="row", out_dtype="float16")
    inputs = operands(problem, seed=3)
    ref, bound = reference(problem, *inputs)
    out = BACKEND.build(problem, CONFIGS[1], current())(*inputs)
    assert out.dtype == torch.float16 and out.shape == (7, 33) and out.is_contiguous()
    assert_close(out, ref, bound, "allocated")


@pytest.mark.interpreter
def test_slices_past_k_are_empty_and_harmless():
    """More K slices than K tiles: the last slices have nothing to add, and their zero partials
    must not disturb the sum."""
    problem = Problem(3, 40, 200, "float8_e4m3fn", bias=True, scaling="block")
    inputs = operands(problem, seed=5)
    ref, bound = reference(problem, *inputs)
    out = BACKEND.build(problem, ScaledConfig(16, 16, 32, 8, 16, 0, 1, 1), current())(*inputs, out=poisoned(problem))
    assert_close(out, ref, bound, "SPLIT_K=16 over 7 K tiles")


@pytest.mark.parametrize("scaling, which, shape, message", [
    ("tensor", "a", (2,), "scale_a has 2 elements"),
    ("row", "b", (32, 1), "scale_b has 32 elements"),
    ("block", "a", (7, 1), r"scale_a of shape \(7, 1\).*accepted: \(7, 2\)"),
    ("block", "b", (2, 2), r"scale_b of shape \(2, 2\).*accepted: \(1, 2\)"),
])
def test_scales_of_the_wrong_shape_are_refused(scaling, which, shape, message):
    problem = Problem(7, 33, 200, "float8_e4m3fn", scaling=scaling)
    a, b, bias, sa, sb = operands(problem, seed=1)
    wrong = torch.ones(shape, device=DEVICE)
    sa, sb = (wrong, sb) if which == "a" else (sa, wrong)
    with pytest.raises(ValueError, match=message):
        BACKEND.build(problem, CONFIGS[0], current())(a, b, bias, sa, sb)


@pytest.mark.parametrize("field, value", [("BLOCK_M", 3), ("BLOCK_K", 16), ("GROUP_M", 0), ("SPLIT_K", 3),
                                          ("FAST_ACC", 2), ("FAST_ACC", True), ("num_warps", 16),
                                          ("num_stages", "3")])
def test_out_of_bounds_configs_are_refused(field, value):
    data = dict(CONFIGS[0].as_dict(), **{field: value})
    with pytest.raises(ValueError, match=f"triton_scaled {field}={value!r} is out of bounds"):
        BACKEND.parse_config(data)


def test_config_round_trip_and_exact_keys():
    for config in CONFIGS + space(Problem(1, 4096, 4096, "float8_e4m3fn", scaling="row"), H100):
        assert BACKEND.parse_config(config.as_dict()) == config
        assert config.key() == ",".join(f"{k}={v}" for k, v in config.as_dict().items())
    with pytest.raises(ValueError, match="exactly the keys"):
        BACKEND.parse_config({k: v for k, v in CONFIGS[0].as_dict().items() if k != "FAST_ACC"})


def test_build_refuses_what_the_kernel_cannot_compute():
    problem = Problem(16, 256, 512, "float8_e4m3fn", scaling="block")
    with pytest.raises(ValueError, match="BLOCK_K=256 does not divide the scale block"):
        BACKEND.build(problem, ScaledConfig(16, 64, 256), current())
    with pytest.raises(ValueError, match="serves fp8"):
        BACKEND.build(Problem(16, 256, 512), ScaledConfig(16, 64, 128), current())
    huge = Problem(65536, 65536, 128, "float8_e4m3fn", scaling="row")
    with pytest.raises(ValueError, match="SPLIT_K=2: the workspace"):
        BACKEND.build(huge, ScaledConfig(16, 64, 128, split_k=2), current())


@pytest.mark.parametrize("problem", [Problem(64, 64, 64), Problem(64, 64, 64, "float32", "nn")])
def test_unscaled_problems_get_no_candidates(problem):
    assert BACKEND.candidates(problem, H100) == [] and BACKEND.candidates(problem, current()) == []


SHAPES = [(1, 4096, 4096), (16, 14336, 4096), (32, 4096, 14336), (128, 4096, 4096), (4096, 4096, 4096),
          (33, 130, 200), (4095, 4097, 4095)]


@pytest.mark.parametrize("device", [H100, L4, TINY, current()], ids=["H100", "L4", "tiny", "here"])
@pytest.mark.parametrize("scaling", ["tensor", "row", "block"])
def test_the_space_fits_the_device_and_is_never_empty(device, scaling):
    for m, n, k in SHAPES:
        problem = Problem(m, n, k, "float8_e4m3fn", scaling=scaling)
        configs = BACKEND.candidates(problem, device)
        assert configs, (device.name, problem.describe())
        for c in configs:
            assert c.smem_bytes() <= device.smem_per_block
            assert c.acc_regs_per_thread(scaling) <= 128
            assert scaling != "block" or SCALE_BLOCK % c.block_k == 0
            assert c.split_k == 1 or m <= 32
            assert BACKEND.predict_ms(problem, device, c) > 0
        if device.interpreter:
            assert max(c.block_m * c.block_n * c.block_k for c in configs) <= 32 * 32 * 64


def test_fast_accumulation_is_offered_only_where_it_differs():
    """Both FAST_ACC values on Hopper's wgmma tiles with tensor or row scaling, each precise
    config ranked just behind its fast twin; the precise one alone elsewhere."""
    problem = Problem(4096, 4096, 4096, "float8_e4m3fn", scaling="row")
    configs = space(problem, H100)
    fast = {c for c in configs if c.fast_acc}
    assert fast and all(c.block_m % 64 == 0 and c.num_warps >= 4 for c in fast)
    for c in configs:
        if not c.fast_acc and c.__class__(**{**c.__dict__, "fast_acc": 1}) in fast:
            twin = c.__class__(**{**c.__dict__, "fast_acc": 1})
            assert BACKEND.predict_ms(problem, H100, c) > BACKEND.predict_ms(problem, H100, twin)
    assert not any(c.fast_acc for c in space(Problem(4096, 4096, 4096, "float8_e4m3fn", scaling="block"), H100))
    assert not any(c.fast_acc for c in space(problem, L4))


def test_decode_shapes_split_k_only_where_the_tiles_leave_sms_idle():
    decode = space(Problem(1, 4096, 4096, "float8_e4m3fn", scaling="tensor"), H100)
    assert {c.split_k for c in decode} > {1}
    assert all(c.programs(Problem(1, 4096, 4096, "float8_e4m3fn", scaling="tensor")) <= 2 * 132 for c in decode
               if c.split_k > 1)
    assert {c.split_k for c in space(Problem(64, 4096, 4096, "float8_e4m3fn", scaling="tensor"), H100)} == {1}


def test_available_with_fp8_tensor_cores_or_the_interpreter():
    here = current()
    assert BACKEND.is_available(here) == (here.interpreter or here.capability >= (8, 9))
    assert BACKEND.is_available(H100) and BACKEND.is_available(L4)
    assert not BACKEND.is_available(A100)  # no fp8 tensor cores before Ada (8.9)
    assert BACKEND.name == "triton_scaled" and BACKEND.space_size >= len(space(Problem(
        1, 4096, 4096, "float8_e4m3fn", scaling="row"), H100))


PRECISION_PROBE = """
import re, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gemmtune.backends.kernels.scaled import scaled_matmul

pointers = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "bias_ptr": "*bf16"}
for fast in (1, 0):
    constexprs = dict(SCALING="row", HAS_BIAS=False, ACTIVATION="none", EVEN_K=True, FAST_ACC=fast, SPLIT_K=1,
                      BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, stride_ak=1, stride_bk=1, stride_cn=1,
                      stride_bias=1, stride_sam=1, stride_sak=1, stride_sbn=1, stride_sbk=1, k_tiles=1)
    signature, fixed, attrs = {}, {}, {}
    for i, name in enumerate(scaled_matmul.arg_names):
        if name in constexprs:
            signature[name], fixed[(i,)] = "constexpr", constexprs[name]
        else:
            signature[name] = pointers.get(name, "*fp32" if name.endswith("_ptr") else "i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(scaled_matmul, signature, fixed, attrs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=3)).asm["ptx"]
    print(fast, len(re.findall(r"wgmma\\.mma_async\\S*e4m3\\.e4m3", ptx)), len(re.findall(r"\\badd\\.f32", ptx)))
"""


def test_precise_accumulation_promotes_each_k_tile_on_hopper():
    """Compiled for sm_90 (no GPU needed): both FAST_ACC values run on fp8 wgmma; the precise one
    adds each K tile's partial accumulator into the fp32 one (one add.f32 per accumulator register
    per K tile: 128 x 128 over 256 threads), the fast one never does."""
    from ptx import outside_interpreter

    counts = dict(line.split(" ", 1) for line in outside_interpreter(PRECISION_PROBE).split("\n") if line)
    (wgmma_fast, adds_fast), (wgmma_precise, adds_precise) = (map(int, counts[f].split()) for f in "10")
    assert wgmma_fast == wgmma_precise == 4  # four k32 instructions per K tile of 128
    assert adds_fast == 0 and adds_precise == 128 * 128 // 256


LLAMA_8B = [(4096, 4096), (14336, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", ["tensor", "row"])
@pytest.mark.parametrize("m", [1, 16, 128])
@pytest.mark.parametrize("n,k", LLAMA_8B)
def test_matches_torch_scaled_mm_on_the_gpu(n, k, m, scaling):
    """The first configs the cost model ranks, and the best precise one, within the bound of the
    float64 reference, as torch._scaled_mm is; the two within twice the bound of each other."""
    problem = Problem(m, n, k, "float8_e4m3fn", scaling=scaling)
    a, b, bias, sa, sb = operands(problem, seed=m + n + k)
    ref, bound = reference(problem, a, b, bias, sa, sb)
    theirs = torch._scaled_mm(a, b.t(), scale_a=sa.reshape(-1, 1) if scaling == "row" else sa,
                              scale_b=sb.reshape(1, -1) if scaling == "row" else sb, out_dtype=torch.bfloat16)
    assert_close(theirs, ref, bound, "torch._scaled_mm")
    device = current()
    ranked = sorted(BACKEND.candidates(problem, device), key=lambda c: BACKEND.predict_ms(problem, device, c))
    precise = [c for c in ranked if not c.fast_acc][:1]
    for config in dict.fromkeys(ranked[:3] + precise):
        out = BACKEND.build(problem, config, device)(a, b, bias, sa, sb, out=poisoned(problem))
        assert_close(out, ref, bound, config)
        assert ((out.double() - theirs.double()).abs() <= 2 * bound).all(), config
