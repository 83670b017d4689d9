"""Probe: why the compiler's GEMM template runs faster than gemmtune's own tiled kernel with the
same config (docs/compile.md: 1.08 against 1.23 of cuBLAS on 1024x4096x4096 on an H200).

Compiled for sm_90 on a CPU, the two kernels' main loops are the same instructions, so this times
them beside forms that part the differences still possible, each replayed in a CUDA graph over
weight copies that pass the L2 twice, in one set of interleaved rounds (a new order each round), ratios to cuBLAS:

    cublas        torch.addmm (the reference)
    gemmtune      gemmtune's triton_tiled kernel with the config, as its dispatch launches it
    form_runtime  the template's own loop (offsets recomputed from the K index, max_contiguous
                  hints on the rows) written here, sizes and strides run-time integers
    form_static   the same with sizes and strides compile-time constants, as the compiler bakes them
    form_k        K and the strides constants, M and N run-time
    form_nk       N, K and the strides constants, M run-time (a layer's weight fixes all but M)
    form_strides  the strides constants, the sizes run-time
    template      the compiler's template with the config (template_time's template_call)

Run with TRITON_CACHE_DIR set to keep every compiled kernel's code and metadata to read after:

    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 TRITON_CACHE_DIR=DIR PYTHONPATH=src \
        python3 benchmarks/probes/tile_forms.py OUT.json [--shapes 1024x4096x4096,...] [--rounds 30]
"""
import argparse
import logging
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from gemmtune import backends
from gemmtune.device import current
from gemmtune.problem import Problem

sys.path.insert(0, str(Path(__file__).resolve().parent))
from template_time import L2_PASSES, graphed, operands, rounds, template_call, write_result  # noqa: E402

log = logging.getLogger("tile_forms")
CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
SHAPES = "1024x4096x4096,1024x4096x16384,4096x3072x768,2048x2048x2048"


@triton.jit
def _form(A, B, C, BIAS, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = (M + BLOCK_M - 1) // BLOCK_M
    grid_n = (N + BLOCK_N - 1) // BLOCK_N
    width = GROUP_M * grid_n
    group_id = pid // width
    group_size = min(grid_m - group_id * GROUP_M, GROUP_M)
    pid_m = group_id * GROUP_M + (pid % group_size)
    pid_n = (pid % width) // group_size
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_a_m = tl.max_contiguous(tl.multiple_of(rm % M, BLOCK_M), BLOCK_M)
    offs_b_n = tl.max_contiguous(tl.multiple_of(rn % N, BLOCK_N), BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_idx in range(0, tl.cdiv(K, BLOCK_K)):
        a_k = offs_k[None, :] + k_idx * BLOCK_K
        b_k = offs_k[:, None] + k_idx * BLOCK_K
        a = tl.load(A + offs_a_m[:, None] * stride_am + a_k * stride_ak)
        b = tl.load(B + b_k * stride_bk + offs_b_n[None, :] * stride_bn)
        acc += tl.dot(a, b, allow_tf32=False, out_dtype=tl.float32)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc += tl.load(BIAS + rn, mask=rn < N).to(tl.float32)[None, :]
    tl.store(C + rm[:, None] * N + rn[None, :], acc.to(C.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def form_runtime(A, B, C, BIAS, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    _form(A, B, C, BIAS, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)


@triton.jit
def form_static(A, B, C, BIAS, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                stride_am: tl.constexpr, stride_ak: tl.constexpr, stride_bk: tl.constexpr, stride_bn: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    _form(A, B, C, BIAS, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)


@triton.jit
def form_k(A, B, C, BIAS, M, N, K: tl.constexpr,
           stride_am: tl.constexpr, stride_ak: tl.constexpr, stride_bk: tl.constexpr, stride_bn: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    _form(A, B, C, BIAS, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)


@triton.jit
def form_nk(A, B, C, BIAS, M, N: tl.constexpr, K: tl.constexpr,
            stride_am: tl.constexpr, stride_ak: tl.constexpr, stride_bk: tl.constexpr, stride_bn: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    _form(A, B, C, BIAS, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)


@triton.jit
def form_strides(A, B, C, BIAS, M, N, K,
                 stride_am: tl.constexpr, stride_ak: tl.constexpr, stride_bk: tl.constexpr, stride_bn: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    _form(A, B, C, BIAS, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)


def form_call(kernel, problem: Problem):
    """``kernel`` (a form) as a call (a, w, bias) -> a @ w.T + bias, w of nn.Linear's layout."""
    m, n, k = problem.m, problem.n, problem.k
    grid = (triton.cdiv(m, CONFIG["BLOCK_M"]) * triton.cdiv(n, CONFIG["BLOCK_N"]),)
    tiles = {f: CONFIG[f] for f in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}

    def call(a, w, bias):
        out = a.new_empty((m, n))
        kernel[grid](a, w, out, bias, m, n, k, a.stride(0), a.stride(1), w.stride(1), w.stride(0),
                     num_warps=CONFIG["num_warps"], num_stages=CONFIG["num_stages"], **tiles)
        return out

    return call


def checked(call, a, w, bias) -> float:
    """``call``'s largest error against a float64 product, over the reference's largest value."""
    want = torch.addmm(bias.double(), a.double(), w.double().t())
    return float((call(a, w, bias).double() - want).abs().max() / want.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the JSON file to write")
    parser.add_argument("--shapes", default=SHAPES, help="MxNxK products with a bias, comma-separated")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    rows = []
    for text in args.shapes.split(","):
        m, n, k = (int(v) for v in text.split("x"))
        problem = Problem(m, n, k, bias=True)
        copies = max(1, -(-L2_PASSES * current().l2_bytes // (n * k * 2)))
        a, weights, bias = operands(problem, copies)
        calls = {"cublas": lambda x, w, b: torch.addmm(b, x, w.t()),
                 "gemmtune": backends.build(problem, "triton_tiled", CONFIG, current()),
                 "form_runtime": form_call(form_runtime, problem),
                 "form_static": form_call(form_static, problem), "form_k": form_call(form_k, problem),
                 "form_nk": form_call(form_nk, problem), "form_strides": form_call(form_strides, problem)}
        errors = {name: checked(call, a, weights[0], bias) for name, call in calls.items()}
        graphs = {name: graphed(call, a, weights, bias) for name, call in calls.items()}
        compiled, launches = template_call(problem, CONFIG)
        graphs["template"] = graphed(compiled, a, weights, bias)
        errors["template"] = checked(compiled, a, weights[0], bias)
        row = {"shape": text, "copies": copies, "errors": errors, "timed": rounds(graphs, args.rounds),
               "template_launches": launches["launches"], "template_code": launches["code"]}
        rows.append(row)
        log.info("%s: %s", text, {name: round(t["vs_cublas"], 3) for name, t in row["timed"].items()})
    write_result(args.out, "tile-forms", rows, config=CONFIG)


if __name__ == "__main__":
    main()
