"""A decode GEMM for Hopper that streams the weights by TMA: C = act(A @ B + bias) for M <= 64.

The roles are swapped: a tile of weight rows (BLOCK_N of them) is the matrix instruction's
64- or 128-row side and the few rows of A its narrow side, so the warpgroup MMA runs at its own
shape and the output tile is (BLOCK_N, BLOCK_M), stored transposed. The programs are persistent
and the K loops of all the tiles a program walks are flattened into one software pipeline, so
the weight bytes in flight never drain between tiles. Descriptors zero-fill past the tensors'
edges, so any M, N, K works without load masks; they need 16-byte aligned rows.
"""

import triton
import triton.language as tl

from gemmtune.backends.kernels.epilogue import activate
from gemmtune.backends.kernels.mma import mma


@triton.jit
def stream_matmul(
    a_desc, b_desc, c_ptr, bias_ptr,
    M, N, K, stride_cm, stride_cn, NUM_PROGRAMS,
    B_IS_NK: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    n_tiles = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), n_tiles * tl.cdiv(M, BLOCK_M), NUM_PROGRAMS, flatten=True):
        off_n = (tile % n_tiles) * BLOCK_N
        off_m = (tile // n_tiles) * BLOCK_M
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            if B_IS_NK:
                w = b_desc.load([off_n, off_k])
            else:
                w = b_desc.load([off_k, off_n]).T
            a = a_desc.load([off_m, off_k])
            acc = mma(w, a.T, acc, PRECISION)

        rn = off_n + tl.arange(0, BLOCK_N)
        rm = off_m + tl.arange(0, BLOCK_M)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
        acc = activate(acc, ACTIVATION)
        c_ptrs = c_ptr + rm[None, :] * stride_cm + rn[:, None] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[None, :] < M) & (rn[:, None] < N))
