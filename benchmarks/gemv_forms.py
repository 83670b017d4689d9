"""The M = 1 decode rows (a GEMV over the weights) in two studies, each timed side by side in
interleaved rounds with L2 flushed, in one process:

- ``tiles``: a plain GEMV kernel over a grid of tiles (weight rows per program, K step, warps),
  gemmtune's split-K kernel on its GEMV tiles, gemmtune's tuned choice, cuBLAS and inductor
  max-autotune; then gemmtune's tiles timed one at a time, twice, as the tuner's screening does.
- ``forms``: what separates gemmtune's split-K kernel from the plain GEMV at one tile: pointers
  advanced in place, rows wrapped with a modulo, the whole kernel called through Triton's JIT and
  through gemmtune's launch.

    PYTHONPATH=src:benchmarks python3 benchmarks/gemv_forms.py --out gemv.json [--study forms]

GPU only. (NOTES, step 18.)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gemmtune import backends, shapes
from gemmtune.tuning import measure, verify
from gemmtune.backends.triton_splitk import GEMV_TILES
from gemmtune.device import current
from gemmtune.tuning.tuner import tune_problem

PTX: dict[str, str] = {}  # the PTX of each Triton launch checked, by name (--ptx)
ROWS = ("llama3-8b.qkv.m1", "llama3-8b.o.m1", "llama3-8b.gate_up.m1", "llama3-8b.down.m1")


@triton.jit
def plain_gemv(x_ptr, w_ptr, y_ptr, K, BN: tl.constexpr, BK: tl.constexpr):
    """y = x @ w.T for x (1, K), w (N, K) K-contiguous, BN dividing N, BK dividing K: each load's
    addresses are the rows' starts plus the K step's offset."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BN, BK), tl.float32)
    for k0 in tl.range(0, K, BK):
        x = tl.load(x_ptr + k0 + rk)
        w = tl.load(w_ptr + rn[:, None] * K + (k0 + rk)[None, :], eviction_policy="evict_first")
        acc += x.to(tl.float32)[None, :] * w.to(tl.float32)
    tl.store(y_ptr + rn, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))


@triton.jit
def probed_gemv(x_ptr, w_ptr, y_ptr, K, KP, STRIDE_XM, BN: tl.constexpr, BK: tl.constexpr, STAGED: tl.constexpr,
                OWN_BOUND: tl.constexpr, ROW: tl.constexpr, MASKED: tl.constexpr):
    """``plain_gemv`` with one of the split-K kernel's traits at a time: the K loop given
    num_stages (STAGED), bounded by an argument of its own (OWN_BOUND: KP, equal to K), x's row
    found from a grid axis and a stride (ROW: the grid's second axis, of size 1), the output
    stored under a mask (MASKED)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    x_row = x_ptr
    if ROW:
        x_row = x_ptr + tl.program_id(1) * STRIDE_XM
    bound = K
    if OWN_BOUND:
        bound = KP
    acc = tl.zeros((BN, BK), tl.float32)
    if STAGED:
        for k0 in tl.range(0, bound, BK, num_stages=1):
            x = tl.load(x_row + k0 + rk)
            w = tl.load(w_ptr + rn[:, None] * K + (k0 + rk)[None, :], eviction_policy="evict_first")
            acc += x.to(tl.float32)[None, :] * w.to(tl.float32)
    else:
        for k0 in tl.range(0, bound, BK):
            x = tl.load(x_row + k0 + rk)
            w = tl.load(w_ptr + rn[:, None] * K + (k0 + rk)[None, :], eviction_policy="evict_first")
            acc += x.to(tl.float32)[None, :] * w.to(tl.float32)
    out = tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty)
    if MASKED:
        tl.store(y_ptr + rn, out, mask=rn < K)  # K >= N on every probed row
    else:
        tl.store(y_ptr + rn, out)


@triton.jit
def advancing_gemv(x_ptr, w_ptr, y_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr, WRAP: tl.constexpr):
    """``plain_gemv`` with its pointer tensors advanced in place each K step, as gemmtune's split-K
    kernel did, and (WRAP) its rows wrapped modulo N."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    if WRAP:
        rn = rn % N
    rk = tl.arange(0, BK)
    x_ptrs = x_ptr + rk[None, :]
    w_ptrs = w_ptr + rn[:, None] * K + rk[None, :]
    acc = tl.zeros((BN, BK), tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=1):
        acc += tl.load(x_ptrs).to(tl.float32) * tl.load(w_ptrs, eviction_policy="evict_first").to(tl.float32)
        x_ptrs += BK
        w_ptrs += BK
    tl.store(y_ptr + rn, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))


def splitk(p, bn: int, bk: int, warps: int, stages: int = 1):
    config = {"BLOCK_M": 1, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1, "USE_DOT": False, "num_warps": warps,
              "num_stages": stages}
    return backends.build(p, "triton_splitk", config, current())


def checked(fns: dict, inputs, y) -> dict:
    """Each callable run once and its output checked; the registers per thread (and spills) of
    those that are Triton launches, which return their compiled kernel (gemmtune's calls and
    torch's return the output)."""
    registers = {}
    for name, fn in fns.items():
        out = fn()
        err = verify.rel_err(out if isinstance(out, torch.Tensor) else y, inputs.reference)
        if not err < 1e-2:
            raise AssertionError(f"{name}: rel_err {err:.3g}")
        if hasattr(out, "n_regs"):
            registers[name] = (out.n_regs, out.n_spills)
            PTX[name] = out.asm["ptx"]
    return registers


def tiles(p, inputs) -> dict:
    from suite import inductor

    x, w = inputs.a, inputs.b
    y = torch.empty(1, p.n, device="cuda", dtype=x.dtype)
    fns = {}
    for bn in (1, 2, 4, 8, 16):
        for bk in (512, 1024, 2048):
            for warps in (2, 4, 8):
                if 8 <= bn * bk // (32 * warps) <= 64 and p.k % bk == 0:
                    fns[f"plain {bn},{bk},{warps}"] = (lambda bn=bn, bk=bk, warps=warps: plain_gemv[(p.n // bn,)](
                        x, w, y, p.k, BN=bn, BK=bk, num_warps=warps, num_stages=1))
    for bn, bk, warps, stages in GEMV_TILES:
        kernel = splitk(p, bn, bk, warps, stages)
        fns[f"gemmtune {bn},{bk},{warps},{stages}"] = lambda kernel=kernel: kernel(x, w, None)
    result = tune_problem(p, current())
    chosen = backends.build(p, result.backend, result.config, current())
    fns["gemmtune's choice"] = lambda: chosen(x, w, None)
    fns["cublas"] = lambda: F.linear(x, w)
    registers = checked(fns, inputs, y)
    fns["inductor"], _ = inductor(fns["cublas"])
    timed = measure.measure(fns, current(), budget_ms=3000, min_rounds=40)
    alone = {}
    for rep in range(2):  # gemmtune's tiles screened one at a time, as the tuner does, in shuffled orders
        names = [name for name in fns if name.startswith("gemmtune ")]
        random.Random(rep).shuffle(names)
        for name in names:
            alone.setdefault(name, []).append(
                measure.measure({name: fns[name]}, current(), budget_ms=6.0, min_rounds=3)[name].median * 1e3)
    return {"choice": result.label(), "us": {name: t.median * 1e3 for name, t in timed.items()}, "alone_us": alone,
            "registers": registers}


def forms(p, inputs) -> dict:
    from gemmtune.backends.kernels.splitk import splitk_matmul

    x, w = inputs.a, inputs.b
    n, k = p.n, p.k
    y = torch.empty(1, n, device="cuda", dtype=x.dtype)
    fns = {}
    for bn, bk, warps in ((1, 2048, 8), (1, 2048, 4), (1, 1024, 4)):
        tag = f"{bn},{bk},{warps}"
        fns[f"plain {tag}"] = lambda bn=bn, bk=bk, warps=warps: plain_gemv[(n // bn,)](
            x, w, y, k, BN=bn, BK=bk, num_warps=warps, num_stages=1)
        if (bn, bk, warps) == (1, 2048, 8):
            for trait in ("STAGED", "OWN_BOUND", "ROW", "MASKED"):
                traits = {name: name == trait for name in ("STAGED", "OWN_BOUND", "ROW", "MASKED")}
                fns[f"plain+{trait.lower()} {tag}"] = lambda traits=traits: probed_gemv[(n, 1, 1)](
                    x, w, y, k, k, k, BN=1, BK=2048, **traits, num_warps=8, num_stages=1)
        for wrap in (False, True):
            fns[f"advancing{'+wrap' if wrap else ''} {tag}"] = lambda bn=bn, bk=bk, warps=warps, wrap=wrap: \
                advancing_gemv[(n // bn,)](x, w, y, n, k, BN=bn, BK=bk, WRAP=wrap, num_warps=warps, num_stages=1)
        for cap in (None, 32, 40):  # registers per thread: a cap lets more programs share an SM
            if cap is not None and cap < 32 * 8 // warps:
                continue
            fns[f"split-K through the JIT {tag}" + (f" maxnreg={cap}" if cap else "")] = \
                lambda bn=bn, bk=bk, warps=warps, cap=cap: splitk_matmul[(n // bn, 1, 1)](
                    x, w, y, y, y, y, 1, n, k, k, k, 1, 1, k, n, 1, HAS_BIAS=False, ACTIVATION="none", EVEN_K=True,
                    EVEN_N=True, PRECISION="tf32", USE_DOT=False, SPLIT_K=1, STAGES=1, BLOCK_M=1, BLOCK_N=bn,
                    BLOCK_K=bk, HINTS=(1,) * 9, num_warps=warps, num_stages=1, maxnreg=cap)
        kernel = splitk(p, bn, bk, warps)
        fns[f"split-K through gemmtune {tag}"] = lambda kernel=kernel: kernel(x, w, None)
    launched = checked(fns, inputs, y)
    timed = measure.measure(fns, current(), budget_ms=3000, min_rounds=60)
    return {"us": {name: t.median * 1e3 for name, t in timed.items()}, "registers": launched}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", choices=("tiles", "forms"), default="tiles")
    parser.add_argument("--only", nargs="*", default=list(ROWS), help="names of m=1 shapes")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ptx", type=Path, default=None, metavar="DIR", help="write each Triton launch's PTX there")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gemv_forms.py needs a CUDA GPU", file=sys.stderr)
        return 2
    doc = {"kind": f"gemv-{args.study}", "device": torch.cuda.get_device_name(), "sm_count": current().sm_count,
           "torch": torch.__version__, "triton": triton.__version__, "rows": []}
    study = tiles if args.study == "tiles" else forms
    with torch.no_grad():
        for named in [n for n in shapes.load() if n.name in args.only]:
            row = {"name": named.name, **study(named.problem, verify.make_inputs(named.problem, "cuda", seed=1))}
            doc["rows"].append(row)
            args.out.write_text(json.dumps(doc, indent=1))
            print(named.name, flush=True)
            for name, us in sorted(row["us"].items(), key=lambda kv: kv[1])[:14]:
                extra = row.get("alone_us", {}).get(name)
                regs = row.get("registers", {}).get(name)
                print(f"   {us:7.2f} us  {name}" + (f"  (alone {extra[0]:.2f}, {extra[1]:.2f})" if extra else "")
                      + (f"  ({regs[0]} registers, {regs[1]} spilled)" if regs else ""), flush=True)
    if args.ptx is not None:
        args.ptx.mkdir(parents=True, exist_ok=True)
        for name, text in PTX.items():
            (args.ptx / (name.replace(" ", "_").replace(",", "-").replace("=", "") + ".ptx")).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
