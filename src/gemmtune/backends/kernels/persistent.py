"""A persistent GEMM for Hopper: one program per SM walks the output tiles, operands arrive by
TMA (tensor descriptors), C = act(A @ B + bias) stored by TMA.

Descriptors clip at the tensor's edges (zero-filled loads, dropped stores), so any M, N, K >= 1
works without masks; they need 16-byte aligned rows, which the backend checks. B is given as
(N, K) when B_IS_NK (nn.Linear's weight) and (K, N) otherwise.
"""

import triton
import triton.language as tl

from gemmtune.backends.kernels.epilogue import activate
from gemmtune.backends.kernels.mma import mma
from gemmtune.backends.kernels.order import grouped_tile


@triton.jit
def persistent_matmul(
    a_desc, b_desc, c_desc, bias_ptr,
    M, N, K, NUM_PROGRAMS,
    B_IS_NK: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, NUM_PROGRAMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):
        tile_m, tile_n = grouped_tile(tile, grid_m, grid_n, GROUP_M)
        off_m = tile_m * BLOCK_M
        off_n = tile_n * BLOCK_N

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            a = a_desc.load([off_m, off_k])
            if B_IS_NK:
                b = b_desc.load([off_n, off_k]).T
            else:
                b = b_desc.load([off_k, off_n])
            acc = mma(a, b, acc, PRECISION)

        if HAS_BIAS:
            rn = off_n + tl.arange(0, BLOCK_N)
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        acc = activate(acc, ACTIVATION)
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))
