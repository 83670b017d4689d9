"""The fp8 twin of kernels/stream.py: a decode GEMM for Hopper that streams fp8 weights by TMA,
C = act(sum_k A[m, k] sa(m, k) * B[n, k] sb(n, k) + bias) for M <= 64.

As in stream.py the roles are swapped: BLOCK_N weight rows are the warpgroup MMA's wide side and
the few rows of A its narrow side, the output tile is (BLOCK_N, BLOCK_M) and is stored
transposed, and the persistent programs' K loops are flattened into one pipeline. fp8 wgmma
takes both operands K-major: the weight tile (BLOCK_N, BLOCK_K) and A's tile (BLOCK_M, BLOCK_K)
arrive so, and ``a.T`` only names A's tile as the instruction's K x BLOCK_M operand. Descriptors
zero-fill past the tensors' edges, so any M, N, K works without load masks (rows of 16 bytes:
K % 16 == 0); the scales are read by pointer, rows past M and N wrapped to valid ones.

The scales and FAST_ACC are kernels/scaled.py's, transposed to this tile: ``tensor`` multiplies
the accumulator by sa * sb in the epilogue; ``row`` by sb[n] along the tile's rows and sa[m]
along its columns; ``block`` multiplies each K tile's product by sb[n // 128, j] * sa[m, j]
before it joins the fp32 accumulator: BLOCK_K divides 128, so a K tile lies in one scale block
j, and BLOCK_N divides 128, so a tile of weight rows lies in one block of them (one sb per K
tile). FAST_ACC=0 promotes wgmma's reduced-precision partial sums to fp32 every
min(BLOCK_K, 128) elements of K, FAST_ACC=1 never (block scaling promotes every K tile anyway).
"""

import triton
import triton.language as tl

from gemmtune.backends.kernels.epilogue import activate
from gemmtune.backends.kernels.scaled import PROMOTE_EVERY, SCALE_BLOCK


@triton.jit
def scaled_stream_matmul(
    a_desc, b_desc, c_ptr, bias_ptr, sa_ptr, sb_ptr,
    M, N, K, stride_cm, stride_cn, stride_bias, stride_sam, stride_sak, stride_sbn, stride_sbk, NUM_PROGRAMS,
    SCALING: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, FAST_ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    n_tiles = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), n_tiles * tl.cdiv(M, BLOCK_M), NUM_PROGRAMS, flatten=True):
        off_n = (tile % n_tiles) * BLOCK_N
        off_m = (tile // n_tiles) * BLOCK_M
        rn = off_n + tl.arange(0, BLOCK_N)
        rm = off_m + tl.arange(0, BLOCK_M)
        sa_rows = sa_ptr + (rm % M) * stride_sam  # row and block scaling: each row's scales
        sb_block = sb_ptr + (off_n // SCALE_BLOCK) * stride_sbn  # block scaling: the tile's block of rows
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            w = b_desc.load([off_n, off_k])
            a = a_desc.load([off_m, off_k])
            if SCALING == "block":
                j = off_k // SCALE_BLOCK
                scales = tl.load(sa_rows + j * stride_sak) * tl.load(sb_block + j * stride_sbk)
                acc += tl.dot(w, a.T) * scales[None, :]
            elif FAST_ACC:
                acc = tl.dot(w, a.T, acc)
            else:
                acc = tl.dot(w, a.T, acc, max_num_imprecise_acc=min(BLOCK_K, PROMOTE_EVERY))

        if SCALING == "tensor":
            acc = acc * (tl.load(sa_ptr) * tl.load(sb_ptr))
        elif SCALING == "row":
            acc = acc * tl.load(sb_ptr + (rn % N) * stride_sbn)[:, None] * tl.load(sa_rows)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + (rn % N) * stride_bias).to(tl.float32)[:, None]
        acc = activate(acc, ACTIVATION)
        c_ptrs = c_ptr + rm[None, :] * stride_cm + rn[:, None] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[None, :] < M) & (rn[:, None] < N))
