"""The copies of a misaligned GEMM (odd-4k: x 4095x4095, w 4095x4097, the result cut to 4097
columns), where rows of odd length keep every load and store at 2 bytes. Times the 2-D copy
``copy_padded`` uses against kernels that index the contiguous side flat (``i`` itself, so that
side's accesses are 16-byte vectors) and address the other side by row and column computed from
constant sizes; torch's copy of as many aligned bytes is the bandwidth beside them. Every result
is compared with torch's.

    PYTHONPATH=src python3 benchmarks/odd_copy.py OUT.json
"""
from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl

from gemmtune.tuning import measure
from gemmtune.backends.cublas_padded import copy_padded
from gemmtune.device import current


@triton.jit
def from_flat_source(src_ptr, dst_ptr, total, SRC_COLS: tl.constexpr, DST_STRIDE: tl.constexpr,
                     PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Contiguous source, (rows, SRC_COLS), into rows DST_STRIDE apart, the PAD columns after each
    row's end zeroed."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < total
    x = tl.load(src_ptr + i, mask=inside)
    r = i // SRC_COLS
    c = i - r * SRC_COLS
    tl.store(dst_ptr + r * DST_STRIDE + c, x, mask=inside)
    if PAD > 0:
        tl.store(dst_ptr + r * DST_STRIDE + SRC_COLS + c, tl.zeros_like(x), mask=inside & (c < PAD))


@triton.jit
def to_flat_destination(src_ptr, dst_ptr, total, DST_COLS: tl.constexpr, SRC_STRIDE: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Rows SRC_STRIDE apart cut to DST_COLS columns into a contiguous destination."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < total
    r = i // DST_COLS
    c = i - r * DST_COLS
    tl.store(dst_ptr + i, tl.load(src_ptr + r * SRC_STRIDE + c, mask=inside), mask=inside)


def pad_in(src: torch.Tensor, rows: int, cols: int, block: int, warps: int) -> torch.Tensor:
    dst = torch.empty(rows, cols, dtype=src.dtype, device=src.device)
    total = src.numel()
    from_flat_source[(triton.cdiv(total, block),)](src, dst, total, SRC_COLS=src.shape[1], DST_STRIDE=cols,
                                                   PAD=cols - src.shape[1], BLOCK=block, num_warps=warps)
    if rows > src.shape[0]:
        dst[src.shape[0]:].zero_()
    return dst


def cut_out(src: torch.Tensor, cols: int, block: int, warps: int) -> torch.Tensor:
    dst = torch.empty(src.shape[0], cols, dtype=src.dtype, device=src.device)
    total = dst.numel()
    to_flat_destination[(triton.cdiv(total, block),)](src, dst, total, DST_COLS=cols, SRC_STRIDE=src.stride(0),
                                                      BLOCK=block, num_warps=warps)
    return dst


def main() -> None:
    dev = current()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    cases = {  # name: (source, rows, cols, direction)
        "x 4095x4095->4096": (rand(4095, 4095), 4095, 4096, "in"),
        "x 4095x4095->4160": (rand(4095, 4095), 4095, 4160, "in"),
        "w 4095x4097->4096x4104": (rand(4095, 4097), 4096, 4104, "in"),
        "cut 4095x4104->4097": (rand(4095, 4104), 4095, 4097, "out"),
    }
    rows_out = []
    for name, (src, rows, cols, direction) in cases.items():
        expected = copy_padded(src, rows, cols)
        fns = {"copy_padded": lambda: copy_padded(src, rows, cols)}
        same_bytes = torch.empty(src.numel() // 8 * 8, dtype=src.dtype, device="cuda")
        flat = src.reshape(-1)[:same_bytes.numel()]
        fns["torch_aligned_copy"] = lambda: same_bytes.copy_(flat)
        for block in (1024, 2048, 4096):
            for warps in (4, 8):
                label = f"flat_{block}_w{warps}"
                if direction == "in":
                    fns[label] = lambda b=block, w=warps: pad_in(src, rows, cols, b, w)
                else:
                    fns[label] = lambda b=block, w=warps: cut_out(src, cols, b, w)
        equal = {label: bool(torch.equal(fn(), expected)) for label, fn in fns.items() if label != "torch_aligned_copy"}
        t = measure.measure(fns, dev, budget_ms=1000, min_rounds=30)
        us = {label: v.median * 1e3 for label, v in t.items()}
        moved = 2 * src.numel() * src.element_size()
        best = min((v, k) for k, v in us.items() if k != "torch_aligned_copy")
        row = {"case": name, "us": us, "equal": equal, "best": best[1],
               "best_tbps": moved / best[0] / 1e6, "copy_padded_tbps": moved / us["copy_padded"] / 1e6}
        rows_out.append(row)
        print(name, {k: round(v, 1) for k, v in us.items()}, "all equal:", all(equal.values()),
              f"best {best[1]} {row['best_tbps']:.2f} TB/s, copy_padded {row['copy_padded_tbps']:.2f}", flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "sm_count": dev.sm_count, "rows": rows_out},
              open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
