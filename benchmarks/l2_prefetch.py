"""Can a decode GEMM's weights be brought into L2 while the kernels before it leave DRAM idle?

In a Llama's decode step the o projection follows rope, the cache update and attention: several
short kernels that read little. A weight that fits in L2 (60 MB on the H200; o's is 33.5 MB)
could be fetched during them, so that the GEMM reads L2 instead of DRAM. This probe times eight
layers of (a gap that reads nothing, then the m=16 GEMM on that layer's weights) as one CUDA
graph, with the weights fetched ahead five ways:

- ``none``: no prefetch;
- ``lines``: a kernel on the same stream, before the gap, issuing ``prefetch.global.L2::evict_last``
  for each 128-byte line (fire and forget: it returns before the lines arrive);
- ``bulk``: as ``lines`` with ``cp.async.bulk.prefetch.L2`` over 16 KB chunks;
- ``side lines``: the ``lines`` kernel on a second stream, forked before the gap and joined
  before the GEMM;
- ``side load``: a kernel on a second stream that loads the weights (evict_last) and discards them.

The gap is ``torch.cuda._sleep``: one thread spinning, no memory traffic. Each variant's output
is compared with ``none``'s (the same kernel on the same inputs: equal). Beside it, o's GEMM
read from L2 (run twice on one weight) by cuBLAS, stream tiles and split-K tiles.

    PYTHONPATH=src:benchmarks python3 benchmarks/l2_prefetch.py OUT.json
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gemmtune.tuning import measure
from gemmtune.backends.triton_splitk import SplitKConfig, SplitKKernel
from gemmtune.backends.triton_stream import StreamConfig, StreamKernel
from gemmtune.device import current
from gemmtune.problem import Problem

LAYERS, M = 8, 16
SHAPES = {"o": (4096, 4096, StreamConfig(M, 64, 256, 4, 5)), "qkv": (6144, 4096, StreamConfig(M, 64, 256, 4, 4))}
GAPS_US = (12, 20)
VARIANTS = ("none", "side lines", "side load", "gap only")  # lines and bulk: measured in the -20261123 file
LINE, CHUNK = 128, 16384


@triton.jit
def prefetch_l2(base, nbytes, STEP: tl.constexpr, BLOCK: tl.constexpr, BULK: tl.constexpr):
    """Asks L2 for ``nbytes`` from ``base``: one prefetch per STEP bytes, BLOCK of them a program."""
    off = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * STEP
    size = tl.minimum(nbytes - off, STEP).to(tl.int32)
    inside = off < nbytes
    ptrs = base.to(tl.pointer_type(tl.int8)) + tl.where(inside, off, 0)
    size = tl.where(inside, size, STEP)
    if BULK:
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                                  [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                  [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def load_l2(base, sink, n_words, never, BLOCK: tl.constexpr):
    """Loads ``n_words`` int32 from ``base`` with evict_last and keeps nothing of them."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(base + offs, mask=offs < n_words, other=0, eviction_policy="evict_last")
    if never:
        tl.store(sink + tl.program_id(0), tl.sum(v))


@triton.jit
def load_l2_looped(base, sink, n_words, never, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
    """``load_l2`` by a few programs that each walk every PROGRAMS-th block: little of the GPU held."""
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in tl.range(tl.program_id(0) * BLOCK, n_words, PROGRAMS * BLOCK, num_stages=4):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(base + offs, mask=offs < n_words, other=0, eviction_policy="evict_last")
    if never:
        tl.store(sink + tl.program_id(0), tl.sum(acc))


def prefetch(w: torch.Tensor, bulk: bool) -> None:
    nbytes = w.numel() * w.element_size()
    step, block = (CHUNK, 64) if bulk else (LINE, 1024)
    prefetch_l2[(triton.cdiv(nbytes, step * block),)](w, nbytes, STEP=step, BLOCK=block, BULK=bulk, num_warps=4)


SINK = {}


def load(w: torch.Tensor, programs: int = 0, nbytes: int | None = None) -> None:
    """``w``'s first ``nbytes`` (all by default) loaded into L2: by one program per 16 KB, or by
    ``programs`` programs looping."""
    words = w.view(-1).view(torch.int32)[:None if nbytes is None else nbytes // 4]
    sink = SINK.setdefault(w.device, torch.zeros(1 << 16, dtype=torch.int32, device=w.device))
    if programs:
        load_l2_looped[(programs,)](words, sink, words.numel(), 0, BLOCK=4096, PROGRAMS=programs, num_warps=8)
    else:
        load_l2[(triton.cdiv(words.numel(), 4096),)](words, sink, words.numel(), 0, BLOCK=4096, num_warps=8)


def chains(gemm, weights, x, cycles: int, side: torch.cuda.Stream) -> dict:
    def run(how):
        def go():
            y = None
            main = torch.cuda.current_stream()
            for w in weights:
                if how in ("lines", "bulk"):
                    prefetch(w, how == "bulk")
                if how.startswith("side"):
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        prefetch(w, False) if how == "side lines" else load(w)
                if cycles:
                    torch.cuda._sleep(cycles)
                if how.startswith("side"):
                    main.wait_stream(side)
                if how != "gap only":
                    y = gemm(x, w)
            return y
        return go
    return {how: run(how) for how in VARIANTS}


def hot_rows(dev, g) -> list[dict]:
    """o's m=16 GEMM from L2: each kernel run twice on one weight (the second finds it in L2)
    against once, both after a flush; more programs may read L2 faster than the stream tile."""
    n = k = 4096
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(torch.bfloat16)
    x = torch.randn(M, k, device="cuda", generator=g).to(torch.bfloat16)
    problem = Problem(M, n, k)
    kernels = {"cublas": lambda a, b: F.linear(a, b)}
    for bn, bk, st in ((64, 256, 5), (64, 256, 4), (64, 128, 4), (128, 128, 3), (128, 64, 4)):
        kernels[f"stream {bn}x{bk} s{st}"] = (lambda kern: lambda a, b: kern(a, b, None))(
            StreamKernel(problem, StreamConfig(M, bn, bk, 4, st), dev))
    for bn, bk, split, st in ((32, 256, 2, 3), (32, 256, 4, 3), (64, 128, 2, 4), (16, 512, 2, 3), (32, 128, 4, 4)):
        kernels[f"splitk {bn}x{bk} split{split} s{st}"] = (lambda kern: lambda a, b: kern(a, b, None))(
            SplitKKernel(problem, SplitKConfig(M, bn, bk, split, True, 4, st)))
    ref = x.double() @ w.double().t()
    fns = {}
    for label, kern in kernels.items():
        try:
            err = float((kern(x, w).double() - ref).norm() / ref.norm())
        except Exception as exc:  # noqa: BLE001 - a tile that does not build is left out
            print(label, "failed:", type(exc).__name__, str(exc)[:120], flush=True)
            continue
        if not err < 1e-2:
            print(label, "WRONG", err, flush=True)
            continue
        fns[f"{label}|once"] = lambda kern=kern: kern(x, w)
        fns[f"{label}|twice"] = lambda kern=kern: (kern(x, w), kern(x, w))[1]
    t = measure.measure(fns, dev, budget_ms=1500, min_rounds=30)
    rows = []
    for label in sorted({f.split("|")[0] for f in fns}, key=lambda lab: t[f"{lab}|twice"].median - t[f"{lab}|once"].median):
        once, twice = t[f"{label}|once"].median * 1e3, t[f"{label}|twice"].median * 1e3
        rows.append({"kernel": label, "cold_us": once, "hot_us": twice - once})
        print(f"hot o.m16 {label:28s} cold {once:6.2f} us   hot (from L2) {twice - once:6.2f} us", flush=True)
    return rows


def main() -> None:
    dev = current()
    g = torch.Generator(device="cuda").manual_seed(0)
    side = torch.cuda.Stream()
    # the sleep kernel's cycles per microsecond, from a graph of 8 long sleeps
    probe = measure.measure({"sleep": lambda: [torch.cuda._sleep(100_000) for _ in range(LAYERS)]}, dev, budget_ms=200)
    cycles_per_us = 100_000 * LAYERS / (probe["sleep"].median * 1e3)
    print(f"sleep: {cycles_per_us:.0f} cycles/us", flush=True)
    hot = hot_rows(dev, g)
    rows = []
    for shape, (n, k, config) in SHAPES.items():
        weights = [(torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(torch.bfloat16) for _ in range(LAYERS)]
        x = torch.randn(M, k, device="cuda", generator=g).to(torch.bfloat16)
        stream = StreamKernel(Problem(M, n, k), config, dev)
        gemms = {"stream": lambda a, w: stream(a, w, None), "cublas": lambda a, w: F.linear(a, w)}
        ref = x.double() @ weights[-1].double().t()
        for gname, gemm in gemms.items():
            for gap in GAPS_US:
                fns = chains(gemm, weights, x, int(gap * cycles_per_us), side)
                outs = {how: fn() for how, fn in fns.items() if how != "gap only"}
                torch.cuda.synchronize()
                err = float((outs["none"].double() - ref).norm() / ref.norm())
                same = {how: bool(torch.equal(out, outs["none"])) for how, out in outs.items()}
                t = measure.measure(fns, dev, budget_ms=800, min_rounds=30)
                gap_ms = t["gap only"].median
                for how in fns:
                    if how == "gap only":
                        continue
                    per_layer = (t[how].median - gap_ms) * 1e3 / LAYERS
                    rows.append({"shape": shape, "gemm": gname, "gap_us": gap, "variant": how,
                                 "chain_ms": t[how].median, "gap_only_ms": gap_ms,
                                 "beyond_gap_us_per_layer": per_layer, "spread": t[how].spread,
                                 "equal_to_none": same[how], "rel_err": err})
                    print(f"{shape:4s} {gname:6s} gap {gap:2d} us  {how:10s} chain {t[how].median * 1e3:8.2f} us  "
                          f"beyond the gap {per_layer:6.2f} us/layer  same={same[how]} err={err:.1e}", flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "sm_count": dev.sm_count,
               "l2_bytes": torch.cuda.get_device_properties(0).L2_cache_size, "layers": LAYERS, "m": M,
               "hot": hot, "rows": rows}, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
