"""Measured ceilings for the kernel targets: what no kernel can beat, timed the way the suite
times cuBLAS (CUDA-graph replays after an L2 flush, in interleaved rounds), in one process.

- decode rows: the fastest pure read of the weight's bytes (a sweep of streaming-read kernels
  at exactly that size, so the launch and the ramp a small read pays are in it). A GEMM that
  reads its weight once cannot be faster; cuBLAS's time over it is the most any kernel can gain.
- prefill rows: cuBLAS's TFLOP/s with the SM clock and power read by NVML while it runs, and
  its rate per clock against the tensor cores' dense rate per SM per clock.
- odd-4k: cuBLAS on the misaligned operands against the same product on already-padded ones
  (padding for free) and the copies padding costs; and the whole padded call two ways, each as
  one sequence: cuBLAS then a cut into the output, or gemmtune's tiled kernel storing straight
  into the unaligned output (no cut), over a few large tiles.
- odd-1k: cuBLAS at 1000 and at 1024 cubed, and an empty kernel's time (the floor of a launch).

    PYTHONPATH=src python3 benchmarks/ceiling.py --out ceiling.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gemmtune import backends, shapes
from gemmtune.tuning import measure, verify
from gemmtune.backends.cublas_padded import copy_padded, padded_size
from gemmtune.device import current
from gemmtune.backends.kernels.pad import pad_copy
from gemmtune.problem import Problem

ROOT = Path(__file__).resolve().parent
READ_CONFIGS = [(block, unroll, warps) for block in (1024, 2048, 4096) for unroll in (1, 2, 4, 8) for warps in (4, 8)]
# Dense bf16/fp16 tensor-core FLOPs per SM per clock on Hopper (989.4 TFLOP/s = 132 SMs x
# 1.83 GHz x 4096 on the H100 SXM's datasheet).
HOPPER_FLOPS_PER_SM_CLOCK = 4096
# (BLOCK_R, BLOCK_C, num_warps) of the pad copy, swept on odd-4k's A
PAD_BLOCKS = ((16, 256, 4), (8, 512, 4), (4, 1024, 4), (32, 256, 8), (8, 1024, 8), (2, 2048, 8), (1, 4096, 8),
              (64, 64, 4), (32, 128, 4), (16, 512, 8))
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the tiled kernel's large tiles
DIRECT_TILES = ((128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (256, 128, 64, 8, 4), (128, 256, 64, 8, 4),
                (128, 128, 64, 4, 4), (128, 128, 64, 8, 4))


@triton.jit
def read_once(x_ptr, out_ptr, numel, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Reads its BLOCK * UNROLL elements once and writes one float: a weight stream, no math."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * UNROLL
    acc = tl.zeros((BLOCK,), tl.float32)
    for u in tl.static_range(UNROLL):
        offs = base + u * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < numel, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


@triton.jit
def empty_kernel(x_ptr):
    pass


def reads(numel: int, device) -> tuple[float, str]:
    """The fastest read of ``numel`` bf16 elements among READ_CONFIGS: (ms, config)."""
    x = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
    fns = {}
    for block, unroll, warps in READ_CONFIGS:
        programs = triton.cdiv(numel, block * unroll)
        out = torch.empty(programs, dtype=torch.float32, device="cuda")
        fns[f"BLOCK={block},UNROLL={unroll},num_warps={warps}"] = (
            lambda out=out, programs=programs, block=block, unroll=unroll, warps=warps:
            read_once[(programs,)](x, out, numel, BLOCK=block, UNROLL=unroll, num_warps=warps))
    timings = measure.measure(fns, device, min_rounds=30, budget_ms=600)
    best = min(timings, key=lambda name: timings[name].median)
    return timings[best].median, best


def decode_rows(named, device) -> list[dict]:
    rows = []
    for item in named:
        p = item.problem
        x = torch.randn(p.m, p.k, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(p.n, p.k, dtype=torch.bfloat16, device="cuda")
        cublas_ms = measure.measure({"cublas": lambda: F.linear(x, w)}, device, min_rounds=50)["cublas"].median
        read_ms, config = reads(p.n * p.k, device)
        weight_bytes = p.n * p.k * 2
        row = {"name": item.name, "m": p.m, "n": p.n, "k": p.k, "weight_mb": weight_bytes / 1e6,
               "cublas_ms": cublas_ms, "read_ms": read_ms, "read_config": config,
               "read_tbps": weight_bytes / (read_ms * 1e-3) / 1e12,
               "cublas_tbps": weight_bytes / (cublas_ms * 1e-3) / 1e12, "ceiling_speedup": cublas_ms / read_ms}
        rows.append(row)
        print(f"{item.name:24s} {row['weight_mb']:7.1f} MB  cublas {cublas_ms:.4f} ms ({row['cublas_tbps']:.2f} TB/s)  "
              f"read alone {read_ms:.4f} ms ({row['read_tbps']:.2f} TB/s)  ceiling x{row['ceiling_speedup']:.3f}",
              flush=True)
    return rows


class Sampler:
    """NVML's SM clock (MHz) and power (W), sampled every 20 ms on a thread while in use."""

    def __init__(self, index: int) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        self.samples: list[tuple[int, float]] = []

    def __enter__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        nvml = self._nvml
        while not self._stop.wait(0.02):
            self.samples.append((nvml.nvmlDeviceGetClockInfo(self._handle, nvml.NVML_CLOCK_SM),
                                 nvml.nvmlDeviceGetPowerUsage(self._handle) / 1e3))


def sustained(fn, seconds: float = 0.6):
    """Runs ``fn`` back to back for ``seconds``; the median SM clock and power over the second half."""
    try:
        sampler = Sampler(torch.cuda.current_device())
    except Exception as error:  # no NVML here: the rate per clock is left out
        print(f"NVML unavailable ({error}); no clock readings", file=sys.stderr)
        return None, None
    with sampler:
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
    late = sampler.samples[len(sampler.samples) // 2:]
    if not late:
        return None, None
    clocks, watts = sorted(s[0] for s in late), sorted(s[1] for s in late)
    return clocks[len(clocks) // 2], watts[len(watts) // 2]


def prefill_rows(named, device) -> list[dict]:
    rows = []
    for item in named:
        p = item.problem
        if p.dtype not in ("bfloat16", "float16"):
            continue
        dtype = getattr(torch, p.dtype)
        a = torch.randn(p.m, p.k, dtype=dtype, device="cuda")
        if p.layout == "linear":
            b = torch.randn(p.n, p.k, dtype=dtype, device="cuda")
            fn = lambda a=a, b=b: F.linear(a, b)  # noqa: E731
        else:
            b = torch.randn(p.k, p.n, dtype=dtype, device="cuda")
            fn = lambda a=a, b=b: torch.mm(a, b)  # noqa: E731
        ms = measure.measure({"cublas": fn}, device, min_rounds=30)["cublas"].median
        clock_mhz, watts = sustained(fn)
        tflops = 2 * p.m * p.n * p.k / (ms * 1e-3) / 1e12
        row = {"name": item.name, "m": p.m, "n": p.n, "k": p.k, "cublas_ms": ms, "tflops": tflops,
               "sm_clock_mhz": clock_mhz, "power_w": watts}
        if clock_mhz:
            peak = device.sm_count * HOPPER_FLOPS_PER_SM_CLOCK * clock_mhz * 1e6 / 1e12
            row |= {"peak_at_clock_tflops": peak, "fraction_of_peak_at_clock": tflops / peak}
        rows.append(row)
        frac = f" = {row['fraction_of_peak_at_clock']:.1%} of the tensor peak at that clock" if clock_mhz else ""
        print(f"{item.name:24s} cublas {ms:.4f} ms {tflops:6.1f} TFLOP/s at {clock_mhz} MHz, {watts} W{frac}",
              flush=True)
    return rows


def misaligned(device) -> dict:
    m, n, k = 4095, 4097, 4095
    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(k, n, dtype=torch.bfloat16, device="cuda")
    kp, np_ = padded_size(k, 8, 8), padded_size(n, 8, 8)
    a_p, b_p = copy_padded(a, m, kp), copy_padded(b, kp, np_)
    full = torch.mm(a_p, b_p)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    b_cols = b_p[:, :n]  # the padded B's first n columns: aligned rows, n wide
    fns = {"cublas": lambda: torch.mm(a, b), "mm_on_padded": lambda: torch.mm(a_p, b_p),
           "pad_a": lambda: copy_padded(a, m, kp, a_p), "pad_b": lambda: copy_padded(b, kp, np_, b_p),
           "cut_out": lambda: copy_padded(full, m, n, out),
           "mm_into_unaligned_out": lambda: torch.mm(a_p, b_cols, out=out)}
    fns["padded_cublas_then_cut"] = lambda: copy_padded(
        torch.mm(copy_padded(a, m, kp, a_p), copy_padded(b, kp, np_, b_p)), m, n, out)
    ref = full[:, :n].double()
    for bm, bn, bk, warps, stages in DIRECT_TILES:
        config = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps, "num_stages": stages}
        kernel = backends.build(Problem(m, n, kp, "bfloat16", "nn"), "triton_tiled", config, device)
        label = f"tiled_{bm}x{bn}x{bk}_w{warps}s{stages}"
        err = verify.rel_err(kernel(a_p, b_cols, None, out), ref)
        print(f"odd-4k: {label} into the unaligned output: rel_err against the padded cuBLAS product {err:.2e}")
        fns[f"padded_{label}_direct"] = (lambda kernel=kernel: kernel(copy_padded(a, m, kp, a_p),
                                                                      copy_padded(b, kp, np_, b_p)[:, :n], None, out))
    for br, bc, warps in PAD_BLOCKS:
        grid = (-(-m // br), -(-kp // bc))
        fns[f"pad_a_{br}x{bc}_w{warps}"] = (lambda grid=grid, br=br, bc=bc, warps=warps: pad_copy[grid](
            a, a_p, m, k, m, kp, a.stride(0), a.stride(1), a_p.stride(0), BLOCK_R=br, BLOCK_C=bc, num_warps=warps))
    t = {name: timing.median for name, timing in measure.measure(fns, device, min_rounds=30).items()}
    for name in sorted(t, key=t.get):
        print(f"    {name:44s} {t[name]:.4f} ms  x{t['cublas'] / t[name]:.2f} over cuBLAS", flush=True)
    odd4k = {"m": m, "n": n, "k": k, "padded_k": kp, "padded_n": np_, **{f"{name}_ms": v for name, v in t.items()},
             "ceiling_free_padding": t["cublas"] / t["mm_on_padded"],
             "ceiling_with_copies": t["cublas"] / (t["mm_on_padded"] + t["pad_a"] + t["pad_b"] + t["cut_out"])}
    same = torch.allclose(torch.mm(a_p, b_cols, out=out), full[:, :n], rtol=2e-2, atol=2e-2)  # bf16 rounding
    print(f"odd-4k: padded operands into the unaligned output directly {t['mm_into_unaligned_out']:.4f} ms "
          f"(the padded product's values: {same})", flush=True)
    print(f"odd-4k: cublas {t['cublas']:.4f} ms; on padded operands {t['mm_on_padded']:.4f} ms "
          f"(x{odd4k['ceiling_free_padding']:.2f} if padding were free); copies {t['pad_a']:.4f} + {t['pad_b']:.4f} "
          f"+ {t['cut_out']:.4f} ms (x{odd4k['ceiling_with_copies']:.2f} with them)", flush=True)

    small = {}
    for size in (1000, 1024):
        x = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
        y = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
        small[f"cublas_{size}"] = lambda x=x, y=y: torch.mm(x, y)
    dummy = torch.empty(1, device="cuda")
    small["empty_kernel"] = lambda: empty_kernel[(1,)](dummy)
    t = {name: timing.median for name, timing in measure.measure(small, device, min_rounds=50).items()}
    odd1k = {f"{name}_ms": v for name, v in t.items()}
    print(f"odd-1k: cublas {t['cublas_1000']:.4f} ms at 1000^3, {t['cublas_1024']:.4f} ms at 1024^3; "
          f"an empty kernel {t['empty_kernel']:.4f} ms", flush=True)
    return {"odd-4k": odd4k, "odd-1k": odd1k}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=Path, default=ROOT / "shapes" / "public.json")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--groups", nargs="*", default=["decode", "prefill", "misaligned"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("ceiling.py measures a GPU; there is none here", file=sys.stderr)
        return 2
    device = current()
    named = shapes.load(args.shapes, tf32=True)
    doc = {"kind": "ceiling", "device": device.name, "sm_count": device.sm_count, "torch": torch.__version__,
           "triton": triton.__version__, "date": datetime.date.today().isoformat()}
    with torch.no_grad():
        if "decode" in args.groups:
            doc["decode"] = decode_rows([n for n in named if n.group == "decode"], device)
            ceilings = [row["ceiling_speedup"] for row in doc["decode"]]
            doc["decode_ceiling_geomean"] = math.exp(sum(map(math.log, ceilings)) / len(ceilings))
            print(f"decode: geomean ceiling x{doc['decode_ceiling_geomean']:.3f}", flush=True)
        if "prefill" in args.groups:
            doc["prefill"] = prefill_rows([n for n in named if n.group == "prefill"], device)
        if "misaligned" in args.groups:
            doc |= misaligned(device)
    args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
