"""The fp8 twin of kernels/stream.py: a decode GEMM for Hopper that streams fp8 weights by TMA,
C = act(sum_k A[m, k] sa(m, k) * B[n, k] sb(n, k) + bias) for M <= 64.

As in stream.py the roles are swapped: BLOCK_N weight rows are the warpgroup MMA's wide side and
the few rows of A its narrow side, the output tile is (BLOCK_N, BLOCK_M) and is stored
transposed, and the persistent programs' K loops are flattened into one pipeline. fp8 wgmma
takes both operands K-major: the weight tile (BLOCK_N, BLOCK_K) and A's tile (BLOCK_M, BLOCK_K)
arrive so, and ``a.T`` only names A's tile as the instruction's K x BLOCK_M operand. Descriptors
zero-fill past the tensors' edges, so any M, N, K works without load masks (rows of 16 bytes:
K % 16 == 0); the scales are read by pointer, rows past M and N wrapped to valid ones.

The scales are kernels/scaled.py's, transposed to this tile: ``tensor`` multiplies the
accumulator by sa * sb in the epilogue; ``row`` by sb[n] along the tile's rows and sa[m] along
its columns; ``block`` multiplies each K tile's product by sb[n // 128, j] * sa[m, j] before it
joins the fp32 accumulator: BLOCK_K divides 128, so a K tile lies in one scale block j, and
BLOCK_N divides 128, so a tile of weight rows lies in one block of them (one sb per K tile).
Accumulation is always precise: wgmma's reduced-precision partial sums are promoted to fp32
every min(BLOCK_K, 128) elements of K. Fast accumulation (never promoting) was dropped after an
H100 run: at K = 14336 its results were 1.25-1.9x the fp8 tolerance at their worst element,
while at decode sizes the promotions cost nothing measurable.

Split-K (SPLIT_K > 1): a decode product of few weight rows (6144 rows are 96 tiles of 64, for
132 SMs) leaves SMs idle, so each output tile's K loop is cut into SPLIT_K slices of ``k_tiles``
K tiles, and the work units (slice, tile) are what the persistent programs walk. Each unit
writes its fp32 partial (block scales applied, the others not) to a [SPLIT_K, M, N] workspace,
which kernels/scaled.py's ``scaled_reduce`` sums in slice order through the epilogue.
"""

import triton
import triton.language as tl

from gemmtune.backends.kernels.epilogue import activate
from gemmtune.backends.kernels.scaled import PROMOTE_EVERY, SCALE_BLOCK


@triton.jit
def scaled_stream_matmul(
    a_desc, b_desc, c_ptr, bias_ptr, sa_ptr, sb_ptr, ws_ptr,
    M, N, K, k_tiles, stride_cm, stride_cn, stride_bias, stride_sam, stride_sak, stride_sbn, stride_sbk,
    NUM_PROGRAMS,
    SCALING: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``k_tiles``: K tiles per slice (read with SPLIT_K > 1); ``ws_ptr``: the [SPLIT_K, M, N]
    fp32 workspace (written with SPLIT_K > 1)."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    tiles = n_tiles * tl.cdiv(M, BLOCK_M)
    all_k_tiles = tl.cdiv(K, BLOCK_K)
    for unit in tl.range(tl.program_id(0), tiles * SPLIT_K, NUM_PROGRAMS, flatten=True):
        tile = unit % tiles
        off_n = (tile % n_tiles) * BLOCK_N
        off_m = (tile // n_tiles) * BLOCK_M
        if SPLIT_K == 1:
            first = 0
            last = all_k_tiles
        else:
            first = (unit // tiles) * k_tiles
            last = tl.minimum(first + k_tiles, all_k_tiles)
        rn = off_n + tl.arange(0, BLOCK_N)
        rm = off_m + tl.arange(0, BLOCK_M)
        sa_rows = sa_ptr + (rm % M) * stride_sam  # row and block scaling: each row's scales
        sb_block = sb_ptr + (off_n // SCALE_BLOCK) * stride_sbn  # block scaling: the tile's block of rows
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for ki in range(first, last):
            off_k = ki * BLOCK_K
            w = b_desc.load([off_n, off_k])
            a = a_desc.load([off_m, off_k])
            if SCALING == "block":
                j = off_k // SCALE_BLOCK
                scales = tl.load(sa_rows + j * stride_sak) * tl.load(sb_block + j * stride_sbk)
                acc += tl.dot(w, a.T) * scales[None, :]
            else:
                acc = tl.dot(w, a.T, acc, max_num_imprecise_acc=min(BLOCK_K, PROMOTE_EVERY))

        inside = (rm[None, :] < M) & (rn[:, None] < N)
        if SPLIT_K == 1:
            if SCALING == "tensor":
                acc = acc * (tl.load(sa_ptr) * tl.load(sb_ptr))
            elif SCALING == "row":
                acc = acc * tl.load(sb_ptr + (rn % N) * stride_sbn)[:, None] * tl.load(sa_rows)[None, :]
            if HAS_BIAS:
                acc += tl.load(bias_ptr + (rn % N) * stride_bias).to(tl.float32)[:, None]
            acc = activate(acc, ACTIVATION)
            c_ptrs = c_ptr + rm[None, :] * stride_cm + rn[:, None] * stride_cn
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=inside)
        else:
            ws_ptrs = ws_ptr + (unit // tiles) * M * N + rm[None, :] * N + rn[:, None]
            tl.store(ws_ptrs, acc, mask=inside)
