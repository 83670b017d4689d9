"""The search space follows the device and the problem, and is pruned before compiling."""

import pytest

from gemmtune.backends import get
from gemmtune.backends.triton_tiled import FFMA_CONFIGS, TiledConfig, space
from gemmtune.device import Device
from gemmtune.problem import Problem

H100 = Device("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448, 50 << 20)
RTX3060 = Device("NVIDIA GeForce RTX 3060", (8, 6), 28, 101376, 3 << 20)
T4 = Device("Tesla T4", (7, 5), 40, 65536, 4 << 20)
TINY = Device("tiny", (8, 0), 2, 16384, 1 << 20)


@pytest.mark.parametrize("device", [H100, RTX3060, T4, TINY])
@pytest.mark.parametrize("problem", [Problem(8192, 8192, 8192), Problem(1, 4096, 4096), Problem(4095, 4097, 4095, "float32", "nn")])
def test_every_config_fits_the_device(device, problem):
    configs = space(problem, device)
    assert configs, "the space is never empty"
    for c in configs:
        assert c.smem_bytes(problem.element_size) <= device.smem_per_block
        assert c.acc_regs_per_thread() <= 128


def test_inductor_failure_config_is_pruned_before_compiling():
    # inductor compiled a config needing 262144 bytes on a 232448-byte device and failed there
    big = TiledConfig(256, 256, 64, 8, 8, 4)
    assert big.smem_bytes(2) == 262144
    assert big not in space(Problem(8192, 8192, 8192), H100)


def test_smaller_shared_memory_gives_a_smaller_space_of_smaller_tiles():
    problem = Problem(8192, 8192, 8192)
    big, small = space(problem, H100), space(problem, T4)
    assert len(small) < len(big)
    assert max(c.smem_bytes(2) for c in small) <= T4.smem_per_block < max(c.smem_bytes(2) for c in big)


def test_tiles_never_exceed_the_problem():
    for c in space(Problem(1, 6144, 4096), H100):
        assert c.block_m == 16
    for c in space(Problem(33, 47, 20), H100):
        assert c.block_m <= 64 and c.block_n <= 64 and c.block_k <= 32


def test_grids_that_leave_most_sms_idle_are_dropped():
    problem = Problem(1, 4096, 4096)
    tiles = lambda c: -(-problem.n // c.block_n)  # noqa: E731
    configs = space(problem, H100)
    assert min(tiles(c) for c in configs) >= max(tiles(c) for c in configs) / 4


def _shape(config: TiledConfig) -> tuple:
    return config.block_m, config.block_n, config.block_k, config.num_warps, config.num_stages


def test_float32_without_tf32_gets_the_cuda_cores_configs_all_measured():
    """FMAs on the CUDA cores: FFMA_CONFIGS, which no cost model ranks (all are measured);
    with TF32 the tensor cores' tiles, ranked."""
    backend = get("triton_tiled")
    ieee, tf32 = (Problem(128, 128, 64, "float32", "nn", tf32=tf32, batch=384) for tf32 in (False, True))
    configs = space(ieee, H100)
    assert configs and {_shape(c) for c in configs} <= set(FFMA_CONFIGS)
    assert all(backend.predict_ms(ieee, H100, c) is None for c in configs)
    ranked = space(tf32, H100)
    assert not {_shape(c) for c in ranked} <= set(FFMA_CONFIGS)
    assert all(backend.predict_ms(tf32, H100, c) is not None for c in ranked)


@pytest.mark.parametrize("m", [1, 4, 24, 32])
def test_float32_of_a_few_rows_keeps_the_ranked_tiles(m):
    """FFMA_CONFIGS were chosen on products of 64 rows and columns and more: one of at most
    FFMA_MIN rows keeps the ranked space, its thin tiles among it."""
    problem = Problem(m, 4096, 4096, "float32", "linear")
    configs = space(problem, H100)
    assert configs and any(c.block_m == 16 for c in configs)
    assert all(get("triton_tiled").predict_ms(problem, H100, c) is not None for c in configs)


def test_the_tiniest_device_still_gets_a_config():
    # 16 KiB of shared memory fits none of the regular tiles in fp32: the fallback tile remains
    assert space(Problem(4096, 4096, 4096, "float32"), TINY) == [TiledConfig(16, 16, 16, 8, 2, 2)]


@pytest.mark.parametrize("data, message", [
    ({"BLOCK_M": 3, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}, "BLOCK_M=3"),
    ({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 64, "num_stages": 3}, "num_warps=64"),
    ({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": True}, "num_stages=True"),
    ({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4}, "exactly the keys"),
    ({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3, "x": 1}, "exactly the keys"),
    ([1, 2, 3], "exactly the keys"),
])
def test_untrusted_configs_are_rejected(data, message):
    with pytest.raises(ValueError, match=message):
        get("triton_tiled").parse_config(data)


def test_config_dict_round_trips():
    c = TiledConfig(128, 256, 64, 8, 8, 3)
    assert get("triton_tiled").parse_config(c.as_dict()) == c
    assert c.key() == "BLOCK_M=128,BLOCK_N=256,BLOCK_K=64,GROUP_M=8,num_warps=8,num_stages=3"


def test_cublas_takes_no_config():
    assert get("cublas").parse_config({}).as_dict() == {}
    with pytest.raises(ValueError):
        get("cublas").parse_config({"BLOCK_M": 64})


def test_unknown_backend():
    with pytest.raises(ValueError, match="known: cublas, cublas_padded, cublaslt, cute, scaled_mm_fast, triton_persistent, triton_scaled, triton_scaled_stream, triton_splitk, triton_stream, triton_tiled"):
        get("cutlass")


# --- an H100 as an MPS share of it shows itself (issue: GPUs under inductor's 68-SM gate) ---------

def h100_with(sms: int) -> Device:
    return Device(f"NVIDIA H100 80GB HBM3 ({sms} SMs)", (9, 0), sms, 232448, 50 << 20)


SHARES = [16, 38, 66, 132]
PUBLIC = [Problem(1, 6144, 4096), Problem(16, 28672, 4096), Problem(2048, 4096, 14336), Problem(8192, 8192, 8192),
          Problem(4095, 4097, 4095, "bfloat16", "nn")]


@pytest.mark.parametrize("sms", SHARES)
@pytest.mark.parametrize("problem", PUBLIC, ids=lambda p: p.describe())
def test_every_backend_keeps_a_space_under_the_gate(sms, problem):
    """Inductor drops every Triton GEMM below 68 SMs; gemmtune's spaces only change size."""
    device = h100_with(sms)
    tiled = get("triton_tiled").candidates(problem, device)
    assert tiled and len(tiled) <= get("triton_tiled").space_size
    if problem.m <= 64:
        assert get("triton_splitk").candidates(problem, device)
    elif problem.rows_aligned:
        assert get("triton_persistent").candidates(problem, device)


@pytest.mark.parametrize("problem", [p for p in PUBLIC if 1 < p.m <= 64][:2], ids=lambda p: p.describe())
def test_split_k_follows_the_sm_count(problem):
    """Fewer SMs fill with fewer programs: the largest split kept never grows as SMs shrink,
    and every split kept still fits in two waves' worth of programs."""
    largest = []
    for sms in SHARES:
        configs = get("triton_splitk").candidates(problem, h100_with(sms))
        assert all(c.split_k == 1 or c.programs(problem) // 2 < 2 * sms for c in configs)
        largest.append(max(c.split_k for c in configs))
    assert largest == sorted(largest)
    assert largest[0] < largest[-1]


def test_tiles_follow_the_sm_count():
    """A 512x1024 output is 8 tiles of 128x256 (or 2048 of 16x16): with 16 or 38 SMs such large
    tiles still fill the GPU, with 132 they would leave most SMs idle and are dropped."""
    problem = Problem(512, 1024, 1024)
    shapes = {sms: {(c.block_m, c.block_n) for c in get("triton_tiled").candidates(problem, h100_with(sms))}
              for sms in SHARES}
    assert shapes[132] < shapes[66] <= shapes[38] <= shapes[16]
    assert (128, 256) in shapes[38] and (128, 256) not in shapes[132]


def test_the_cost_model_and_the_persistent_grid_see_the_share():
    from gemmtune.backends import costmodel
    from gemmtune.backends.triton_persistent import PersistentConfig, PersistentKernel

    square = Problem(8192, 8192, 8192)
    t38, t132 = (costmodel.tile_gemm_ms(square, h100_with(s), 128, 256, 64, 3) for s in (38, 132))
    assert t38 / t132 > 2.0  # 3.5x fewer SMs; the model has the 132-SM case partly memory-bound
    try:
        kernel = PersistentKernel(square, PersistentConfig(128, 256, 64, 8, 8, 3), h100_with(38))
    except ImportError:
        pytest.skip("triton's tensor descriptors are not importable here")
    assert kernel._sm_count == 38  # one program per SM the process sees
