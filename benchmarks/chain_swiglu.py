"""What would a SwiGLU epilogue save in a Llama's batch-16 decode step? Eight layers of the MLP
as a model runs them (an elementwise op making x, gate and up as one GEMM, silu(gate) * up, the
down GEMM), each on its own weights, replayed as one CUDA graph, three ways:

- ``unfused``: the stream kernel on the joined gate/up weights, one elementwise kernel for
  silu(gate) * up (as inductor fuses it), the stream kernel for down;
- ``unfused, torch``: the same with torch's silu and multiply (two kernels);
- ``gated``: a copy of the stream kernel that loads each tile's gate rows and their up rows,
  keeps two accumulators and writes silu(gate) * up at half the width, then down;
- ``gated interleaved``: the weights stored as blocks of 64 gate rows each followed by its 64 up
  rows, so that one box of 128 rows a stage feeds both halves of one accumulator.

Each variant's output is checked against float64 first.

    PYTHONPATH=src python3 benchmarks/chain_swiglu.py OUT.json
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from gemmtune.tuning import measure
from gemmtune.backends.triton_stream import StreamConfig, StreamKernel
from gemmtune.device import current
from gemmtune.problem import Problem

LAYERS, M, HIDDEN, INTER = 8, 16, 4096, 14336
GATED_TILES = ((64, 128, 4), (64, 128, 5), (64, 256, 3), (64, 64, 6), (128, 64, 4))  # BLOCK_N, BLOCK_K, stages


@triton.jit
def gated_stream(a_desc, b_desc, c_ptr, M, N, K, stride_cm, NUM_PROGRAMS,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c (M, N) = silu(a @ gate.T) * (a @ up.T), b = [gate; up] (2N, K); N a multiple of BLOCK_N."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), n_tiles * tl.cdiv(M, BLOCK_M), NUM_PROGRAMS, flatten=True):
        off_n = (tile % n_tiles) * BLOCK_N
        off_m = (tile // n_tiles) * BLOCK_M
        gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            a = a_desc.load([off_m, off_k])
            gate = tl.dot(b_desc.load([off_n, off_k]), a.T, gate)
            up = tl.dot(b_desc.load([N + off_n, off_k]), a.T, up)
        h = gate * tl.sigmoid(gate) * up
        rn = off_n + tl.arange(0, BLOCK_N)
        rm = off_m + tl.arange(0, BLOCK_M)
        tl.store(c_ptr + rm[None, :] * stride_cm + rn[:, None], h.to(c_ptr.dtype.element_ty),
                 mask=(rm[None, :] < M) & (rn[:, None] < N))


@triton.jit
def gated_interleaved(a_desc, b_desc, c_ptr, M, N, K, stride_cm, NUM_PROGRAMS,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """As ``gated_stream`` with b stored interleaved: BLOCK_N gate rows, then the BLOCK_N up rows
    that pair with them, and so on (2N, K), so that one box of 2 * BLOCK_N rows feeds a tile."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), n_tiles * tl.cdiv(M, BLOCK_M), NUM_PROGRAMS, flatten=True):
        off_n = (tile % n_tiles) * BLOCK_N
        off_m = (tile // n_tiles) * BLOCK_M
        acc = tl.zeros((2 * BLOCK_N, BLOCK_M), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            acc = tl.dot(b_desc.load([2 * off_n, off_k]), a_desc.load([off_m, off_k]).T, acc)
        gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
        h = gate * tl.sigmoid(gate) * up
        rn = off_n + tl.arange(0, BLOCK_N)
        rm = off_m + tl.arange(0, BLOCK_M)
        tl.store(c_ptr + rm[None, :] * stride_cm + rn[:, None], h.to(c_ptr.dtype.element_ty),
                 mask=(rm[None, :] < M) & (rn[:, None] < N))


def interleaved(w: torch.Tensor, block: int) -> torch.Tensor:
    """[gate; up] (2N, K) stored as blocks of ``block`` gate rows each followed by its up rows."""
    n = w.shape[0] // 2
    return torch.stack((w[:n].view(n // block, block, -1), w[n:].view(n // block, block, -1)), 1).reshape(2 * n, -1)


def gated_il(x: torch.Tensor, w_il: torch.Tensor, tile: tuple, programs: int) -> torch.Tensor:
    bn, bk, stages = tile
    n = w_il.shape[0] // 2
    h = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    a_desc = TensorDescriptor(x, list(x.shape), [x.stride(0), 1], [M, bk])
    b_desc = TensorDescriptor(w_il, list(w_il.shape), [w_il.stride(0), 1], [2 * bn, bk])
    grid = min(programs, triton.cdiv(n, bn))
    gated_interleaved[(grid,)](a_desc, b_desc, h, x.shape[0], n, x.shape[1], h.stride(0), grid,
                               BLOCK_M=M, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=stages)
    return h


@triton.jit
def silu_mul(z_ptr, h_ptr, N, stride_z, BLOCK: tl.constexpr):
    """h (rows, N) = silu(z[:, :N]) * z[:, N:], one row per program axis 1."""
    row = tl.program_id(1)
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = c < N
    g = tl.load(z_ptr + row * stride_z + c, mask=inside).to(tl.float32)
    u = tl.load(z_ptr + row * stride_z + N + c, mask=inside).to(tl.float32)
    tl.store(h_ptr + row * N + c, (g * tl.sigmoid(g) * u).to(h_ptr.dtype.element_ty), mask=inside)


def gated(x: torch.Tensor, w: torch.Tensor, tile: tuple, programs: int) -> torch.Tensor:
    bn, bk, stages = tile
    n = w.shape[0] // 2
    h = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    a_desc = TensorDescriptor(x, list(x.shape), [x.stride(0), 1], [M, bk])
    b_desc = TensorDescriptor(w, list(w.shape), [w.stride(0), 1], [bn, bk])
    grid = min(programs, triton.cdiv(n, bn))
    gated_stream[(grid,)](a_desc, b_desc, h, x.shape[0], n, x.shape[1], h.stride(0), grid,
                          BLOCK_M=M, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=stages)
    return h


def main() -> None:
    dev = current()
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)

    w_gate_up = [rand(2 * INTER, HIDDEN, scale=HIDDEN ** -0.5) for _ in range(LAYERS)]
    w_down = [rand(HIDDEN, INTER, scale=INTER ** -0.5) for _ in range(LAYERS)]
    src, y0 = rand(M, HIDDEN), rand(M, HIDDEN)
    gate_up = StreamKernel(Problem(M, 2 * INTER, HIDDEN), StreamConfig(M, 128, 128, 4, 3), dev)
    down = StreamKernel(Problem(M, HIDDEN, INTER), StreamConfig(M, 64, 256, 4, 5), dev)

    def fused_triton(z):
        h = torch.empty(z.shape[0], INTER, dtype=z.dtype, device=z.device)
        silu_mul[(triton.cdiv(INTER, 1024), z.shape[0])](z, h, INTER, z.stride(0), BLOCK=1024, num_warps=4)
        return h

    mlps = {
        "unfused": lambda x, w: fused_triton(gate_up(x, w, None)),
        "unfused, torch": lambda x, w: (lambda z: F.silu(z[:, :INTER]) * z[:, INTER:])(gate_up(x, w, None)),
    }
    for tile in GATED_TILES:
        mlps[f"gated {tile[0]}x{tile[1]} s{tile[2]}"] = lambda x, w, t=tile: gated(x, w, t, dev.sm_count)
    il = {id(w): interleaved(w, 64) for w in w_gate_up}  # the layout a 64-row block needs (as a probe: a copy)
    for tile in ((64, 128, 3), (64, 128, 4), (64, 64, 6)):
        mlps[f"gated interleaved {tile[0]}x{tile[1]} s{tile[2]}"] = \
            lambda x, w, t=tile: gated_il(x, il[id(w)], t, dev.sm_count)

    x = src * y0[:, :1]
    ref_z = x.double() @ w_gate_up[0].double().t()
    ref = F.silu(ref_z[:, :INTER]) * ref_z[:, INTER:]
    errs = {}
    for label, mlp in list(mlps.items()):
        try:
            out = mlp(x, w_gate_up[0]).double()
            errs[label] = float((out - ref).norm() / ref.norm())
        except Exception as exc:  # noqa: BLE001 - a tile that does not fit is left out
            print(label, "failed:", type(exc).__name__, str(exc)[:160], flush=True)
            del mlps[label]
    for label, err in errs.items():
        if not err < 1e-2:
            print(label, "WRONG", err, flush=True)
            del mlps[label]

    def chain(mlp):
        def run():
            y = y0
            for wgu, wd in zip(w_gate_up, w_down):
                y = down(mlp(src * y[:, :1], wgu), wd, None)
            return y
        return run

    alone = measure.measure({label: (lambda mlp=mlp: mlp(x, w_gate_up[0])) for label, mlp in mlps.items()}, dev,
                          budget_ms=600, min_rounds=30)
    in_chain = measure.measure({label: chain(mlp) for label, mlp in mlps.items()}, dev, budget_ms=1500, min_rounds=30)
    base = in_chain["unfused"].median
    rows = []
    for label in sorted(mlps, key=lambda lab: in_chain[lab].median):
        per_layer = in_chain[label].median * 1e3 / LAYERS
        saved = (base - in_chain[label].median) * 1e3 / LAYERS
        rows.append({"variant": label, "chain_us_per_layer": per_layer, "saved_us_per_layer": saved,
                     "alone_us": alone[label].median * 1e3, "rel_err": errs[label]})
        print(f"{label:22s} chain {per_layer:7.2f} us/layer (saves {saved:5.2f})   gate/up part alone "
              f"{alone[label].median * 1e3:7.2f} us   err {errs[label]:.1e}", flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "sm_count": dev.sm_count, "layers": LAYERS, "m": M,
               "rows": rows}, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
