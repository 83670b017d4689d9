"""How fast could any kernel run the prefill rows? The tensor cores' rate with no global traffic,
under the same power cap, beside cuBLAS.

``mma_only`` runs a problem's matrix instructions and nothing else that a GEMM must do: each of
the persistent programs (one per SM) loads one pair of 128x128 and 128x256 operand tiles once
(random data: the eight k16 slices it cycles through toggle the multipliers as a real product's
do), then issues the problem's share of its 128x256 output tiles' products (K divided evenly over
the programs: no wave left part-empty), and stores one tile. Per FLOP it spends the MMA's and shared memory's
energy, not the loads from DRAM and L2 that feed a real GEMM, so its time is a floor for every
kernel built from the same instructions. Timed two ways beside cuBLAS on the same rows:
interleaved rounds with L2 flushed (as the suite times), and back to back for a second, where
the 700 W cap binds, with NVML's SM clock and power.

    PYTHONPATH=src:benchmarks python3 benchmarks/mma_ceiling.py OUT.json
"""
from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ceiling import HOPPER_FLOPS_PER_SM_CLOCK, Sampler
from gemmtune import shapes
from gemmtune.tuning import measure
from gemmtune.device import current

BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64  # the tiles the problem is counted in
MMA_K = 128  # K of each product mma_only issues: 8 different k16 slices of random data in turn


@triton.jit
def mma_only(a_ptr, b_ptr, c_ptr, iters, M, N, K,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``iters`` tile products on operands loaded once (BLOCK_K / 16 different slices a turn);
    a (M, K), b (K, N). One product a turn: Triton then keeps one in flight across turns, where
    two a turn made it drain the tensor cores between them."""
    pid = tl.program_id(0)
    rm = (pid * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rn = (pid * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    rk = tl.arange(0, BLOCK_K) % K
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(iters):
        acc = tl.dot(a, b, acc)
    out = c_ptr + pid * BLOCK_M * BLOCK_N + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty))


def runner(a, b, programs: int):
    m, k = a.shape
    n = b.shape[1]
    total = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N) * triton.cdiv(k, BLOCK_K)
    iters = triton.cdiv(total * BLOCK_K, programs * MMA_K)  # each program's share of the problem's K steps
    c = torch.empty(programs, BLOCK_M, BLOCK_N, dtype=a.dtype, device=a.device)

    def run():
        mma_only[(programs,)](a, b, c, iters, m, n, k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=MMA_K,
                              num_warps=8, num_stages=2)
        return c
    return run, iters * programs * 2 * BLOCK_M * BLOCK_N * MMA_K


def back_to_back(fn, seconds: float) -> dict:
    """``fn`` repeated for ``seconds``: ms per call over the second half, median SM clock and power."""
    sampler = Sampler(torch.cuda.current_device())
    times = []
    with sampler:
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 20)
    late = sampler.samples[len(sampler.samples) // 2:]
    half = times[len(times) // 2:]
    return {"ms": sum(half) / len(half), "sm_clock_mhz": sorted(s[0] for s in late)[len(late) // 2],
            "power_w": sorted(s[1] for s in late)[len(late) // 2]}


def main() -> None:
    dev = current()
    rows = []
    for item in shapes.load(tf32=True):
        p = item.problem
        if item.group != "prefill" or p.dtype not in ("bfloat16", "float16"):
            continue
        dtype = getattr(torch, p.dtype)
        a = torch.randn(p.m, p.k, dtype=dtype, device="cuda")
        b = torch.randn(p.k, p.n, dtype=dtype, device="cuda")
        bt = b.t().contiguous()
        cublas = (lambda: F.linear(a, bt)) if p.layout == "linear" else (lambda: torch.mm(a, b))
        mma, mma_flops = runner(a, b, dev.sm_count)
        mma()
        rounds = measure.measure({"cublas": cublas, "mma_only": mma}, dev, budget_ms=800, min_rounds=30)
        hot = {"cublas": back_to_back(cublas, 1.0), "mma_only": back_to_back(mma, 1.0)}
        flops = p.flops
        row = {"name": item.name, "m": p.m, "n": p.n, "k": p.k, "dtype": p.dtype,
               "mma_only_flops": mma_flops, "problem_flops": flops,
               "rounds": {name: t.median for name, t in rounds.items()}, "back_to_back": hot}
        # the floor: the problem's own FLOPs at mma_only's rate (it ran a few more, rounding up)
        floor_rounds = rounds["mma_only"].median * flops / mma_flops
        floor_hot = hot["mma_only"]["ms"] * flops / mma_flops
        row |= {"ceiling_rounds": rounds["cublas"].median / floor_rounds,
                "ceiling_back_to_back": hot["cublas"]["ms"] / floor_hot,
                "cublas_tflops_back_to_back": flops / (hot["cublas"]["ms"] * 1e-3) / 1e12,
                "mma_only_tflops_back_to_back": mma_flops / (hot["mma_only"]["ms"] * 1e-3) / 1e12}
        for name, tflops in (("cublas", row["cublas_tflops_back_to_back"]), ("mma_only", row["mma_only_tflops_back_to_back"])):
            peak = dev.sm_count * HOPPER_FLOPS_PER_SM_CLOCK * hot[name]["sm_clock_mhz"] * 1e6 / 1e12
            row[f"{name}_of_peak_at_clock"] = tflops / peak
        rows.append(row)
        print(f"{item.name:24s} cublas {rounds['cublas'].median:.4f} ms, MMA alone {floor_rounds:.4f}: ceiling "
              f"x{row['ceiling_rounds']:.3f} | back to back: cublas {row['cublas_tflops_back_to_back']:.0f} TFLOP/s "
              f"({hot['cublas']['sm_clock_mhz']} MHz, {hot['cublas']['power_w']:.0f} W), MMA alone "
              f"{row['mma_only_tflops_back_to_back']:.0f} ({hot['mma_only']['sm_clock_mhz']} MHz, "
              f"{hot['mma_only']['power_w']:.0f} W, {row['mma_only_of_peak_at_clock']:.0%} of the peak at that clock): "
              f"ceiling x{row['ceiling_back_to_back']:.3f}", flush=True)
    geo = {key: float(torch.tensor([r[key] for r in rows]).log().mean().exp()) for key in
           ("ceiling_rounds", "ceiling_back_to_back")}
    print(f"prefill ceiling geomean: x{geo['ceiling_rounds']:.3f} (rounds), x{geo['ceiling_back_to_back']:.3f} "
          "(back to back)", flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "sm_count": dev.sm_count, "tile": [BLOCK_M, BLOCK_N, BLOCK_K],
               "rows": rows, "geomean": geo}, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
