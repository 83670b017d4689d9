"""The cost model against results recorded on an H200 (tests/data): replayed, no GPU needed."""

import json
from pathlib import Path

import pytest

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
