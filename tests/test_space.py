"""The search space follows the device and the problem, and is pruned before compiling."""

import pytest

from gemmtune.backends import get
from gemmtune.backends.triton_tiled import TiledConfig, space
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
    with pytest.raises(ValueError, match="known: cublas, cublas_padded, triton_persistent, triton_splitk, triton_tiled"):
        get("cutlass")
