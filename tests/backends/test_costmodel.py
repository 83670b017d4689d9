"""The cost model against results recorded on an H200 (tests/data): replayed, no GPU needed."""

import json
from pathlib import Path

import pytest

from gemmtune import search
from gemmtune.backends import costmodel, get
from gemmtune.device import Device
from gemmtune.problem import Problem
from gemmtune.search import DEFAULT_TOPK

RECORDED = json.loads((Path(__file__).parents[1] / "data" / "h200-tiled-trials.json").read_text())
H200 = Device(RECORDED["device"]["name"], tuple(RECORDED["device"]["capability"]), RECORDED["device"]["sm_count"],
              RECORDED["device"]["smem_per_block"], RECORDED["device"]["l2_bytes"])


def ranked(key):
    problem = Problem.from_key(key)
    backend = get("triton_tiled")
    trials = RECORDED["problems"][key]
    return sorted(trials, key=lambda t: backend.predict_ms(problem, H200, backend.parse_config(t["config"])))


@pytest.mark.parametrize("key", sorted(RECORDED["problems"]))
def test_the_topk_predictions_hold_the_measured_best(key):
    best = min(t["median_ms"] for t in RECORDED["problems"][key])
    assert min(t["median_ms"] for t in ranked(key)[:DEFAULT_TOPK]) == best


SPACE = json.loads((Path(__file__).parents[1] / "data" / "h200-tiled-space.json").read_text())
SMALL = "v2/linear/bfloat16/1024x1024x1024/bias=0/act=none"  # 64 tiles of 128x128 on 132 SMs


@pytest.mark.parametrize("key", [pytest.param(k, marks=pytest.mark.xfail(
    strict=True, reason="64x128 on 4 stages (1.20x cuBLAS) ranks 8th behind 128x128 tiles (1.41x) that fill half the "
                        "SMs: the roofline does not see the idle SMs")) if k == SMALL else k
    for k in sorted(SPACE["problems"])])
def test_the_topk_holds_the_best_tile_of_the_compile_time_k_kernel(key):
    """With K a constant of the binary, a 128x128 tile on four stages (one block an SM) ran
    1.00-1.39x its time on three (two blocks): ranked behind them (ALONE_PENALTY), the top-k
    holds the measured best of the space on the H200, within the rounds' noise (1%)."""
    problem, backend = Problem.from_key(key), get("triton_tiled")
    measured = {backend.parse_config(t["config"]): t["vs_cublas"] for t in SPACE["problems"][key]}
    configs = backend.candidates(problem, H200)
    assert set(configs) == set(measured)
    first = search.plan("topk", configs, search.Budget(), predict=lambda c: backend.predict_ms(problem, H200, c))
    assert min(measured[c] for c in first) <= 1.01 * min(measured.values())


def test_a_tile_alone_on_its_sm_ranks_behind_one_that_shares_it_when_the_grid_outnumbers_the_sms():
    backend = get("triton_tiled")
    two, one = (backend.parse_config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8,
                                              "num_stages": s})
                for s in (3, 4))
    assert costmodel.blocks_per_sm(H200, two.smem_bytes(2)) == 2 and costmodel.blocks_per_sm(H200, one.smem_bytes(2)) == 1
    many, few = Problem(4096, 4096, 4096), Problem(1024, 1024, 4096)  # 1024 and 64 tiles of 128x128
    assert backend.predict_ms(many, H200, two) < backend.predict_ms(many, H200, one)
    assert backend.predict_ms(few, H200, one) == costmodel.tile_gemm_ms(few, H200, 128, 128, 64, 4)  # no penalty


DECODE = json.loads((Path(__file__).parents[1] / "data" / "h200-decode-trials.json").read_text())


@pytest.mark.parametrize("recorded", DECODE["problems"], ids=lambda r: f"{r['m']}x{r['n']}x{r['k']}")
def test_the_topk_split_k_predictions_come_within_5_percent_of_the_measured_best(recorded):
    problem = Problem(recorded["m"], recorded["n"], recorded["k"], recorded["dtype"])
    backend = get("triton_splitk")
    trials = sorted(recorded["trials"],
                    key=lambda t: backend.predict_ms(problem, H200, backend.parse_config(t["config"])))
    assert min(t["ms"] for t in trials[:DEFAULT_TOPK]) <= 1.05 * min(t["ms"] for t in trials)


def test_wave_quantization_and_tile_intensity_order_configs():
    problem = Problem(4096, 4096, 4096)
    big = costmodel.tile_gemm_ms(problem, H200, 128, 256, 64, 3)
    small = costmodel.tile_gemm_ms(problem, H200, 32, 32, 64, 3)
    assert big < small
    # 132 SMs: 132 tiles take one wave, 133 tiles take two (IEEE fp32: compute-bound for sure)
    one_wave = costmodel.tile_gemm_ms(Problem(128 * 132, 128, 4096, "float32"), H200, 128, 128, 64, 3)
    two_waves = costmodel.tile_gemm_ms(Problem(128 * 133, 128, 4096, "float32"), H200, 128, 128, 64, 3)
    assert two_waves > 1.5 * one_wave


def test_decode_ranks_a_gemv_tile_above_a_split_tensor_core_tile_as_measured():
    """On qkv decode (decode-h200-20261122.json) a register-direct 1x16x512 tile took 20.1 us,
    the split-8 16x128x64 tensor-core tile 24.1 us."""
    qkv = Problem(1, 6144, 4096)
    gemv = costmodel.splitk_ms(qkv, H200, 1, 16, 1, 512, 1, use_dot=False, num_warps=4)
    assert gemv < costmodel.splitk_ms(qkv, H200, 16, 128, 8, 64, 4, use_dot=True, num_warps=4)


def test_a_shallow_pipeline_streams_slower():
    problem = Problem(1, 6144, 4096)
    assert costmodel.splitk_ms(problem, H200, 1, 64, 4, 256, 1) > costmodel.splitk_ms(problem, H200, 1, 64, 4, 256, 3)
    assert costmodel.tile_gemm_ms(problem, H200, 16, 64, 128, 3) > costmodel.tile_gemm_ms(problem, H200, 16, 64, 256, 4)


def test_backends_without_a_model_say_so():
    problem = Problem(4095, 4097, 4095)
    assert get("cublas").predict_ms(problem, H200, get("cublas").parse_config({})) is None
    assert get("cublas_padded").predict_ms(problem, H200, get("cublas_padded").parse_config({"align": 8})) is None
