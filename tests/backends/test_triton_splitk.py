"""The split-K decode kernel against a float64 reference, its in-launch reduction, its config and
its search space. Kernels run under the interpreter without a GPU (programs one after another,
so the last program of every tile takes the reduction path) and on the GPU when there is one."""

import re

import pytest
import torch

from gemmtune.backends import get
from gemmtune.backends.triton_splitk import BACKEND, GEMV_TILES, SplitKConfig, space
from gemmtune.device import Device, current
from gemmtune.problem import Problem
from gemmtune.tuning import verify

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = ["float32", "float16", "bfloat16"]
SIZES = [(1, 1, 1), (1, 33, 4095), (7, 33, 65), (16, 100, 300), (33, 7, 129), (64, 48, 40), (5, 24, 1000)]

H100 = Device("H100", (9, 0), 132, 232448, 50 << 20)
T4 = Device("Tesla T4", (7, 5), 40, 65536, 4 << 20)
TINY = Device("tiny", (8, 0), 2, 16384, 1 << 20)
INTERPRETER = Device("CPU (Triton interpreter)", (0, 0), 2, 101376, 4 << 20, interpreter=True)


def _pow2(x):
    return 1 << max(0, (x - 1).bit_length())


def fma(m, split_k, block_n=32, block_k=64):
    """The FMA form with the BLOCK_M the space would pick (several row-blocks past M=16)."""
    return SplitKConfig(min(16, _pow2(m)), block_n, block_k, split_k, False, 1, 1)


def dot(m, split_k, block_n=32, block_k=64):
    return SplitKConfig(max(16, min(64, _pow2(m))), block_n, block_k, split_k, True, 1, 1)


def check(problem, config, inputs=None):
    inputs = inputs or verify.make_inputs(problem, DEVICE)
    err = verify.check(BACKEND.build(problem, config, current()), problem, inputs)  # NaN-poisoned out
    assert err.ok, (problem.describe(), config.key(), err.reason())


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["linear", "nn"])
@pytest.mark.parametrize("m,n,k", SIZES)
def test_split_k_matches_reference(m, n, k, layout, dtype):
    # SPLIT_K=4 at K=1 leaves three slices empty: they must still report to the counter
    problem = Problem(m, n, k, dtype, layout, bias=(m + n) % 2 == 0)
    inputs = verify.make_inputs(problem, DEVICE)
    for config in (fma(m, 4), dot(m, 2, block_k=128)):
        check(problem, config, inputs)


@pytest.mark.interpreter
@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("m,n,k", SIZES)
def test_single_split_matches_reference(m, n, k, use_dot):
    layout = "nn" if (m + k) % 2 else "linear"
    problem = Problem(m, n, k, "float32", layout, bias=True)
    check(problem, (dot if use_dot else fma)(m, 1, block_k=128))


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 7, 4095), (1, 16, 4096), (2, 33, 1500), (3, 5, 2049)])
def test_gemv_tiles_match_reference(m, n, k, dtype):
    """The GEMV tiles: 1 to 8 weight rows, K steps of 1024 to 4096 (past K, or dividing it), one split or two."""
    problem = Problem(m, n, k, dtype, "linear", bias=True, activation="silu")
    inputs = verify.make_inputs(problem, DEVICE)
    for block_n, block_k, split_k in ((4, 1024, 1), (8, 2048, 1), (4, 1024, 2), (1, 4096, 1), (2, 2048, 2)):
        check(problem, SplitKConfig(_pow2(m), block_n, block_k, split_k, False, 4, 1), inputs)


@pytest.mark.interpreter
@pytest.mark.parametrize("use_dot", [False, True])
def test_rows_aligned_to_8_elements_but_not_16(use_dot):
    """Sizes and strides that are multiples of 8 elements but not 16 carry gemmtune's own
    alignment hints; views whose rows start 8 bytes past a 16-byte boundary must stay right."""
    m, n, k = 3, 40, 1000
    problem = Problem(m, n, k, "float16", "linear")
    x = torch.randn(m, k + 8, device=DEVICE, dtype=torch.float16)[:, 4:k + 4]
    w = torch.randn(n, k, device=DEVICE, dtype=torch.float16)
    ref = x.double() @ w.double().t()
    for split_k in (1, 2):
        kernel = BACKEND.build(problem, (dot if use_dot else fma)(m, split_k, block_k=128), current())
        assert verify.rel_err(kernel(x, w, None), ref) < 1e-2
        assert verify.rel_err(kernel(x.contiguous(), w, None), ref) < 1e-2


def test_hinted_weight_rows_of_1000_are_read_16_bytes_at_a_time():
    """A decode GEMV on weight rows of 1000 bf16 elements, in the PTX: 16-byte loads with the
    hints, 2-byte loads without (Triton marks only integers divisible by 16)."""
    from ptx import sm90_ptx

    from gemmtune.backends.launch import gemm_hints

    scalars = (1, 1000, 1000, 1024, 1000, 1, 1, 1000, 1000, 1)  # m, n, k, k_per_split, then the strides
    constexprs = dict(HAS_BIAS=False, ACTIVATION="none", EVEN_K=False, EVEN_N=True, PRECISION="ieee", USE_DOT=False,
                      SPLIT_K=1, STAGES=1, BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=1)
    hinted = sm90_ptx("splitk", scalars, constexprs | gemm_hints(scalars))
    plain = sm90_ptx("splitk", scalars, constexprs | {"HINTS": (1,) * 9})
    assert "ld.global.b16" not in hinted and "ld.global.b16" in plain


def _qkv_gemv_ptx(**constexprs) -> str:
    """The decode GEMV of qkv (1x6144x4096, K-contiguous weights, one split, no pipeline)
    compiled for sm_90, with gemmtune's alignment hints and ``constexprs`` on top."""
    from ptx import sm90_ptx

    from gemmtune.backends.launch import gemm_hints

    scalars = (1, 6144, 4096, 4096, 4096, 1, 1, 4096, 6144, 1)  # m, n, k, k_per_split, then the strides
    base = dict(HAS_BIAS=False, ACTIVATION="none", EVEN_K=True, EVEN_N=True, PRECISION="ieee", USE_DOT=False,
                SPLIT_K=1, STAGES=1, BLOCK_M=1, num_stages=1)
    return sm90_ptx("splitk", scalars, base | constexprs | gemm_hints(scalars))


def test_one_row_gemv_on_16_warps_reads_16_bytes_at_a_time():
    """The widest GEMV program (one weight row, K in steps of 4096, 16 warps) in the PTX: every
    weight load 16 bytes wide, none narrower."""
    ptx = _qkv_gemv_ptx(BLOCK_N=1, BLOCK_K=4096, num_warps=16)
    weight_loads = re.findall(r"ld\.global\.L1::evict_first\S*", ptx)  # the weights are read evict-first
    assert weight_loads and all(load.endswith(".v4.b32") for load in weight_loads), weight_loads


@pytest.mark.parametrize("block_k,warps", [(2048, 8), (1024, 4)])
def test_gemv_issues_two_k_steps_of_loads_before_multiplying(block_k, warps):
    """The one-row GEMV tiles (one 16-byte weight vector per thread per K step) in the SASS:
    wherever the loop holds two K steps, all four loads go out before the first multiply-add,
    so a program waits on memory once. Scheduled the other way they read 7% slower."""
    from ptx import sm90_sass

    from gemmtune.backends.launch import gemm_hints

    scalars = (1, 6144, 4096, 4096, 4096, 1, 1, 4096, 6144, 1)
    constexprs = dict(HAS_BIAS=False, ACTIVATION="none", EVEN_K=True, EVEN_N=True, PRECISION="ieee", USE_DOT=False,
                      SPLIT_K=1, STAGES=1, BLOCK_M=1, BLOCK_N=1, BLOCK_K=block_k, num_warps=warps, num_stages=1)
    sections, section = [], None  # per stretch of code between branches: loads before the first FFMA
    for op in sm90_sass("splitk", scalars, constexprs | gemm_hints(scalars)):
        if op.split()[-1] == "BRA" or " BRA " in f" {op} ":
            section = None
        elif op.startswith("LDG"):
            if section is None:
                section = [0, False]
                sections.append(section)
            section[0] += 0 if section[1] else 1
        elif op.startswith("FFMA") and section is not None:
            section[1] = True
    assert sections and all(loads >= 4 for loads, _ in sections[:-1]), sections


def test_gemv_k_loop_has_no_barrier_or_shared_memory():
    """One row of A against a tile of weights: the K loop must be loads, converts and FMAs. The
    3-D product form put six barriers and a shared-memory round trip in every K step."""
    ptx = _qkv_gemv_ptx(HAS_BIAS=True, ACTIVATION="silu", BLOCK_N=4, BLOCK_K=1024, num_warps=4)
    loop = re.search(r"Inner Loop Header(.*?)\n\s*@%p\d+ bra", ptx, re.S).group(1)
    assert "fma.rn.f32" in loop and "evict_first" in loop
    assert "bar.sync" not in loop and "st.shared" not in loop and "ldmatrix" not in loop


@pytest.mark.interpreter
@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("use_dot", [False, True])
def test_fused_activations_match_reference(act, use_dot):
    problem = Problem(7, 33, 65, "float32", "linear", bias=True, activation=act)
    check(problem, (dot if use_dot else fma)(7, 2))


@pytest.mark.interpreter
@pytest.mark.parametrize("use_dot", [False, True])
def test_a_kernel_called_again_finds_its_counters_reset(use_dot):
    problem = Problem(5, 40, 200, "float16", "linear", bias=True)
    config = (dot if use_dot else fma)(5, 4, block_n=16)
    kernel = BACKEND.build(problem, config, current())
    for seed in (1, 2, 3):  # fresh inputs every call; a counter left at SPLIT_K would leave NaNs
        inputs = verify.make_inputs(problem, DEVICE, seed=seed)
        assert verify.check(kernel, problem, inputs).ok, seed
        (workspace, counters, *_addresses), = kernel._scratch.values()
        assert counters.numel() == 3 and not counters.any()
    assert len(kernel._scratch) == 1  # one workspace, reused


@pytest.mark.interpreter
def test_split_k_sum_is_deterministic():
    problem = Problem(3, 50, 1000, "float32", "linear")
    inputs = verify.make_inputs(problem, DEVICE, seed=7)
    kernel = BACKEND.build(problem, fma(3, 8, block_k=128), current())
    first = kernel(inputs.a, inputs.b, None).clone()
    assert torch.equal(first, kernel(inputs.a, inputs.b, None))


@pytest.mark.interpreter
def test_strided_and_transposed_views():
    problem = Problem(6, 24, 72, "float32", "nn")
    a = torch.randn(72, 10, device=DEVICE)[:, :6].t()  # (6, 72) transposed view, non-contiguous
    b = torch.randn(24, 144, device=DEVICE)[:, ::2].t()  # (72, 24) strided
    ref = a.double() @ b.double()
    for config in (fma(6, 2, block_n=16, block_k=32), dot(6, 2, block_n=16, block_k=32)):
        assert verify.rel_err(BACKEND.build(problem, config, current())(a, b, None), ref) < 1e-5


def test_tf32_precision_is_requested_only_when_allowed():
    ieee = BACKEND.build(Problem(8, 8, 8, "float32", tf32=False), dot(8, 1), current())
    tf32 = BACKEND.build(Problem(8, 8, 8, "float32", tf32=True), dot(8, 1), current())
    assert ieee._constexprs[False, True, True]["PRECISION"] == "ieee"
    assert tf32._constexprs[False, True, True]["PRECISION"] == "tf32"


# --- config -------------------------------------------------------------------------------

GOOD = {"BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 4, "USE_DOT": False, "num_warps": 4,
        "num_stages": 3}


@pytest.mark.parametrize("change, message", [
    ({"BLOCK_M": 32}, r"BLOCK_M=32 is out of bounds with USE_DOT=False; accepted: \(1, 2, 4, 8, 16\)"),
    ({"BLOCK_M": 8, "USE_DOT": True}, r"BLOCK_M=8 is out of bounds with USE_DOT=True; accepted: \(16, 32, 64\)"),
    ({"BLOCK_N": 512}, "BLOCK_N=512"),
    ({"BLOCK_K": 16}, "BLOCK_K=16"),
    ({"SPLIT_K": 3}, r"SPLIT_K=3 is out of bounds; accepted: \(1, 2, 4, 8, 16, 32\)"),
    ({"SPLIT_K": True}, "SPLIT_K=True"),
    ({"USE_DOT": 1}, r"USE_DOT=1 is out of bounds; accepted: \(False, True\)"),
    ({"num_warps": 32}, "num_warps=32"),
    ({"num_stages": 0}, "num_stages=0"),
    ({"num_stages": 2.0}, "num_stages=2.0"),
])
def test_untrusted_configs_are_rejected(change, message):
    with pytest.raises(ValueError, match=message):
        get("triton_splitk").parse_config({**GOOD, **change})


@pytest.mark.parametrize("data", [
    {k: v for k, v in GOOD.items() if k != "SPLIT_K"}, {**GOOD, "GROUP_M": 8}, [1, 2, 3], None,
])
def test_configs_need_exactly_the_keys(data):
    with pytest.raises(ValueError, match="exactly the keys"):
        get("triton_splitk").parse_config(data)


def test_config_dict_round_trips():
    c = get("triton_splitk").parse_config(GOOD)
    assert c == SplitKConfig(1, 64, 256, 4, False, 4, 3) and c.as_dict() == GOOD
    assert c.key() == "BLOCK_M=1,BLOCK_N=64,BLOCK_K=256,SPLIT_K=4,USE_DOT=False,num_warps=4,num_stages=3"


# --- space --------------------------------------------------------------------------------

DEVICES = [H100, T4, TINY, INTERPRETER]
DECODE = [Problem(1, 6144, 4096), Problem(16, 4096, 14336), Problem(32, 128256, 4096),
          Problem(5, 33, 7, "float32", "nn"), Problem(1, 1, 1), Problem(64, 4096, 4096, "float16")]


@pytest.mark.parametrize("device", DEVICES, ids=lambda d: d.name)
@pytest.mark.parametrize("m", [1, 2, 3, 7, 16, 17, 33, 64])
def test_space_is_never_empty_for_small_m(device, m):
    for problem in (Problem(m, 4096, 4096), Problem(m, 7, 13, "float32", "nn")):
        assert space(problem, device) and BACKEND.candidates(problem, device)


@pytest.mark.parametrize("device", DEVICES, ids=lambda d: d.name)
def test_no_candidates_past_m_64(device):
    assert space(Problem(65, 4096, 4096), device) == []
    assert BACKEND.candidates(Problem(4096, 4096, 4096), device) == []


@pytest.mark.parametrize("device", DEVICES, ids=lambda d: d.name)
@pytest.mark.parametrize("problem", DECODE, ids=lambda p: p.describe())
def test_every_config_fits_the_device_and_the_problem(device, problem):
    configs = space(problem, device)
    assert configs and len(set(configs)) == len(configs)
    for c in configs:
        assert c.smem_bytes(problem.element_size) <= device.smem_per_block, c
        assert c.block_m >= problem.m, c  # one row-block covers M
        assert c.block_m <= max(16, _pow2(problem.m)), c
        assert c.block_k <= max(32, _pow2(problem.k)) and c.block_n <= max(16, _pow2(problem.n)), c
        assert c.split_k == 1 or problem.k >= c.split_k * c.block_k, c
        assert get("triton_splitk").parse_config(c.as_dict()) == c
    programs = [c.programs(problem) for c in configs]
    assert min(programs) >= device.sm_count or min(programs) == max(programs)


def test_decode_space_on_an_h100_fills_the_sms_with_tensor_core_tiles():
    """M = 16: FMA tiles would spill (16 rows of products per weight), so only dot tiles stay."""
    problem = Problem(16, 6144, 4096)
    configs = space(problem, H100)
    assert 10 <= len(configs) <= 30
    assert all(c.programs(problem) >= H100.sm_count for c in configs)
    assert all(c.use_dot for c in configs)
    assert any(c.split_k > 1 for c in configs)  # 6144 / 64 = 96 tiles: a split is needed to fill 132 SMs


@pytest.mark.parametrize("n,k", [(6144, 4096), (28672, 4096), (4096, 14336), (7, 4095)])
def test_a_single_row_gets_the_gemv_tiles_alone(n, k):
    """M = 1: GEMV programs only (one row of A, no tensor cores), register-direct and pipelined;
    a pipeline no deeper than a slice has K steps; a split only where the tiles alone cannot
    fill the SMs."""
    problem = Problem(1, n, k)
    configs = space(problem, H100)
    assert configs and all(not c.use_dot and c.block_m == 1 for c in configs)
    depth = {(bn, bk, warps): stages for bn, bk, warps, stages in GEMV_TILES}
    assert all(c.num_stages <= depth[c.block_n, c.block_k, c.num_warps] for c in configs)
    assert all(c.num_stages <= -(-k // (c.split_k * c.block_k)) for c in configs)
    if n >= 6144:
        assert len(configs) == len(GEMV_TILES) and all(c.split_k == 1 for c in configs)
    else:
        assert any(c.split_k > 1 for c in configs)  # 7 weight rows cannot keep 132 SMs busy


def test_splits_that_would_move_more_partials_than_weights_are_dropped():
    for c in space(Problem(64, 4096, 4096), H100):
        assert 8 * c.split_k * 64 <= 0.25 * 2 * 4096


def test_the_interpreter_gets_a_tiny_space():
    for problem in DECODE:
        configs = space(problem, INTERPRETER)
        assert 1 <= len(configs) <= 4 and all(c.num_stages == 1 for c in configs)
    assert 2 <= len(space(Problem(1, 6144, 4096), INTERPRETER)) <= 4


def test_registered():
    assert get("triton_splitk") is BACKEND


# --- GPU ----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 6144, 4096), (16, 4096, 14336)])
def test_decode_candidates_match_reference_on_gpu(m, n, k):
    problem = Problem(m, n, k, "bfloat16", "linear")
    device = current()
    for config in space(problem, device):
        kernel = BACKEND.build(problem, config, device)
        for seed in (1, 2):  # twice: the second call proves the counters were left at zero
            inputs = verify.make_inputs(problem, "cuda", seed=seed)
            err = verify.check(kernel, problem, inputs)
            assert err.ok, (config.key(), seed, err.reason())


@pytest.mark.gpu
def test_cuda_graph_replays_reduce_correctly():
    problem = Problem(1, 6144, 4096, "bfloat16", "linear", bias=True)
    config = SplitKConfig(1, 64, 256, 4, False, 4, 3)
    kernel = BACKEND.build(problem, config, current())
    inputs = verify.make_inputs(problem, "cuda", seed=1)
    a, b, bias = inputs.a.clone(), inputs.b.clone(), inputs.bias.clone()
    out = torch.empty(1, 6144, dtype=torch.bfloat16, device="cuda")
    kernel(a, b, bias, out=out)  # workspace and counters exist before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel(a, b, bias, out=out)
    for seed in (2, 3, 4):
        fresh = verify.make_inputs(problem, "cuda", seed=seed)
        a.copy_(fresh.a), b.copy_(fresh.b), bias.copy_(fresh.bias)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert verify.rel_err(out, fresh.reference) <= verify.tolerance(problem), seed
