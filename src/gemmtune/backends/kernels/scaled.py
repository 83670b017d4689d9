"""An fp8 GEMM with scales: C = act(sum_k A[m, k] sa(m, k) * B[n, k] sb(n, k) + bias), in fp32,
in two forms: tiled on tensor cores, or a GEMV (BLOCK_M = 1) for decode.

A is (M, K) and B is (N, K), nn.Linear's weight, each fp8 (e4m3fn or e5m2) and given by its
strides; the scales are float32, laid as ``Problem.scaling`` says (``SCALING`` here):

- ``tensor``: one value each; the accumulator is multiplied by sa * sb once, in the epilogue.
- ``row``: one per row of A and one per row of B (strides ``stride_sam``, ``stride_sbn``); the
  epilogue multiplies output (m, n) by sa[m] * sb[n].
- ``block``: sa[m, j] scales A's 1 x 128 block (m, 128j..), sb[i, j] B's 128 x 128 block
  (128i.., 128j..), each read through its two strides. In the tiled form BLOCK_K divides 128, so
  a K tile lies in one block j: its product starts from zero, is multiplied by
  sa[:, j] * sb[n // 128, j] and only then joins the fp32 accumulator. A tile of at most 128
  columns needs one sb per K tile. The GEMV form's BLOCK_K is a multiple of 128: it scales each
  128-wide chunk of A's row before the product (``scaled_gemv`` says how).

Accumulation (``FAST_ACC``, for tensor and row scaling): on sm_90 Triton lowers an fp8 ``tl.dot``
to wgmma, whose accumulator keeps fewer bits than fp32 (about 14), and by default never promotes
it (``max_num_imprecise_acc`` 2**30 on capability 9.0). FAST_ACC=1 keeps that default: one
accumulator through the whole K loop, as cuBLAS's fast accumulation. FAST_ACC=0 passes
``max_num_imprecise_acc=min(BLOCK_K, 128)``: the lowering gives each run of that many K a fresh
partial accumulator and adds it to the fp32 one with fp32 adds (DeepSeek-V3 promotes every 128),
at the cost of a second accumulator's registers. Block scaling promotes every K tile already.
Elsewhere (other GPUs, tiles on mma.sync) fp8 products accumulate in fp32 either way. Fast
accumulation can exceed the fp8 tolerance at large K (measured: K = 14336 on an H100, a
64 x 64 x 128 tile, 339 of 524288 elements out of bound), as cuBLAS's does; the tuner's
verification then rejects that config as a failed trial, and a precise one serves the problem.

GEMV form (BLOCK_M = 1, decode): no tensor cores and no FAST_ACC (its products are exact in
fp32 and summed in fp32); one program per (row of A, BLOCK_N weight rows, K slice), reading
the weights once at the rate of triton_splitk's bf16 GEMV (``scaled_gemv``).

Split-K (``SPLIT_K`` > 1, for decode): program (tile, s) covers ``k_tiles`` K tiles from
s * k_tiles and writes its fp32 partial (block scales applied, the others not) to a workspace
[SPLIT_K, M, N]; ``scaled_reduce`` then sums the partials in a fixed order and applies the rest
of the epilogue (either form). Tiles are visited in groups of GROUP_M rows so that neighbours
share B in L2; edges are masked, so any M, N, K >= 1 run without padding.
"""

import triton
import triton.language as tl

from gemmtune.backends.kernels.epilogue import activate
from gemmtune.backends.kernels.order import grouped_tile

SCALE_BLOCK = tl.constexpr(128)  # gemmtune.problem.SCALE_BLOCK
PROMOTE_EVERY = tl.constexpr(128)  # K elements a precise (FAST_ACC=0) accumulation lets wgmma sum


@triton.jit
def scaled_epilogue(acc, rm, rn, M, N, c_ptr, bias_ptr, sa_ptr, sb_ptr,
                    stride_cm, stride_cn, stride_bias, stride_sam, stride_sbn,
                    SCALING: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
    """A finished fp32 tile (rows ``rm``, columns ``rn``): the tensor or row scales (block scales
    are applied in the K loop), the bias, the activation, one cast, a masked store. Rows and
    columns past M and N read wrapped values, which the store drops."""
    rm_safe = rm % M
    rn_safe = rn % N
    if SCALING == "tensor":
        acc = acc * (tl.load(sa_ptr) * tl.load(sb_ptr))
    elif SCALING == "row":
        sa = tl.load(sa_ptr + rm_safe * stride_sam)
        sb = tl.load(sb_ptr + rn_safe * stride_sbn)
        acc = acc * (sa[:, None] * sb[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn_safe * stride_bias).to(tl.float32)[None, :]
    acc = activate(acc, ACTIVATION)
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def scaled_tile(a_ptr, b_ptr, sa_ptr, sb_ptr, pid_n, rm, rn, M, N, K, first, last,
                stride_am, stride_ak, stride_bn, stride_bk, stride_sam, stride_sak, stride_sbn, stride_sbk,
                SCALING: tl.constexpr, EVEN_K: tl.constexpr, FAST_ACC: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The tiled form: output tile (rows ``rm``, columns ``rn``) summed over K tiles [first,
    last) with tensor-core products, in fp32 (block scales applied, tensor and row scales not)."""
    rk = tl.arange(0, BLOCK_K)
    # Rows and columns past the edge wrap to valid ones, so loads along M and N stay unmasked.
    rm_safe = rm % M
    rn_safe = rn % N
    a_ptrs = a_ptr + rm_safe[:, None] * stride_am + (first * BLOCK_K + rk)[None, :] * stride_ak
    b_ptrs = b_ptr + (first * BLOCK_K + rk)[:, None] * stride_bk + rn_safe[None, :] * stride_bn
    # Block scaling: each row's scales, and the columns'. A tile no wider than a scale block lies
    # in one (BLOCK_N is a power of two): one scale of B per K tile, not a vector (fewer registers).
    sa_rows = sa_ptr + rm_safe * stride_sam
    if BLOCK_N <= SCALE_BLOCK:
        sb_cols = sb_ptr + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_sbn
    else:
        sb_cols = sb_ptr + (rn_safe // SCALE_BLOCK) * stride_sbn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(first, last):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_in = rk < K - t * BLOCK_K
            a = tl.load(a_ptrs, mask=k_in[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_in[:, None], other=0.0)
        if SCALING == "block":
            j = (t * BLOCK_K) // SCALE_BLOCK
            sa = tl.load(sa_rows + j * stride_sak)
            sb = tl.load(sb_cols + j * stride_sbk)
            if BLOCK_N <= SCALE_BLOCK:
                acc += tl.dot(a, b) * (sa * sb)[:, None]
            else:
                acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        elif FAST_ACC:
            acc = tl.dot(a, b, acc)
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=min(BLOCK_K, PROMOTE_EVERY))
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def scaled_gemv(a_ptr, b_ptr, sa_ptr, sb_ptr, pid_m, pid_n, N, K, first, last,
                stride_am, stride_ak, stride_bn, stride_bk, stride_sam, stride_sak, stride_sbn, stride_sbk,
                SCALING: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The GEMV form (BLOCK_M = 1): row ``pid_m`` of A against BLOCK_N weight rows over K tiles
    [first, last), as a (1, BLOCK_N) fp32 sum (block scales applied, tensor and row scales not).

    triton_splitk's GEMV: no tensor cores, A's row broadcast over a 2-D tile of weights, each
    product added into its own lane of a 2-D fp32 accumulator and the tile summed along K once,
    after the loop (a 3-D accumulator, or a reduction per K step, cost shared-memory round trips
    or warp shuffles in every step there). Weight addresses are the rows' starts plus the step's
    offset, A's written apart from them, rows past N masked, not wrapped: splitk.py says what
    each of these bought.

    Block scaling folds the tile: each of its BLOCK_N * CHUNKS rows is one weight row's 128-wide
    chunk of the K step (one scale block), so a chunk's scale sa[m, j] * sb[n // 128, j] is one
    value per tile row, broadcast along it like A's row is, not a gathered vector per K element.
    A's chunk is multiplied by it before the product joins the accumulator; the folded rows are
    summed back to weight rows after the loop. Tensor and row scaling keep one row per weight row.
    """
    CHUNKS: tl.constexpr = BLOCK_K // SCALE_BLOCK if SCALING == "block" else 1
    WIDTH: tl.constexpr = BLOCK_K // CHUNKS
    rows = tl.arange(0, BLOCK_N * CHUNKS)
    rw = tl.arange(0, WIDTH)
    rn = pid_n * BLOCK_N + rows // CHUNKS
    chunk_k = (rows % CHUNKS) * WIDTH  # each tile row's K offset within a K step
    n_in = rn < N
    b_rows = b_ptr + rn * stride_bn + chunk_k * stride_bk
    a_row = a_ptr + pid_m * stride_am
    sa_row = sa_ptr + pid_m * stride_sam
    sb_row = sb_ptr + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_sbn  # BLOCK_N divides the scale block

    acc = tl.zeros((BLOCK_N * CHUNKS, WIDTH), dtype=tl.float32)
    for t in range(first, last):
        k0 = t * BLOCK_K
        b_ptrs = b_rows[:, None] + ((k0 + rw) * stride_bk)[None, :]
        if CHUNKS == 1:  # one row of A, broadcast over the weight rows
            a_ptrs = a_row + k0 * stride_ak + rw * stride_ak
        else:  # A's chunk of each tile row
            a_ptrs = a_row + k0 * stride_ak + chunk_k[:, None] * stride_ak + rw[None, :] * stride_ak
        # The weights are read once: first out of L2, which keeps A, the scales and the partials.
        if EVEN_K and EVEN_N:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs, eviction_policy="evict_first")
        else:
            if CHUNKS == 1:
                a_in = k0 + rw < K
                k_in = a_in[None, :]
            else:
                k_in = (k0 + chunk_k)[:, None] + rw[None, :] < K
                a_in = k_in
            a = tl.load(a_ptrs, mask=a_in, other=0.0)
            b = tl.load(b_ptrs, mask=n_in[:, None] & k_in, other=0.0, eviction_policy="evict_first")
        a = a.to(tl.float32)
        if CHUNKS == 1:
            a = a[None, :]
        if SCALING == "block":
            j = t * CHUNKS + rows % CHUNKS
            j_in = k0 + chunk_k < K  # a chunk past K has no scale block (its products are zeros)
            sa = tl.load(sa_row + j * stride_sak, mask=j_in, other=0.0)
            sb = tl.load(sb_row + j * stride_sbk, mask=j_in, other=0.0)
            a = a * (sa * sb)[:, None]
        acc += a * b.to(tl.float32)
    partial = tl.sum(acc, axis=1)
    if CHUNKS > 1:
        partial = tl.sum(tl.reshape(partial, (BLOCK_N, CHUNKS)), axis=1)
    return partial[None, :]


@triton.jit
def scaled_matmul(
    a_ptr, b_ptr, c_ptr, bias_ptr, sa_ptr, sb_ptr, ws_ptr,
    M, N, K, k_tiles,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn, stride_bias,
    stride_sam, stride_sak, stride_sbn, stride_sbk,
    SCALING: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr, FAST_ACC: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Grid (output tiles, SPLIT_K). ``k_tiles``: K tiles per slice (read with SPLIT_K > 1);
    EVEN_K: BLOCK_K divides K, so no load along K needs a mask; EVEN_N: BLOCK_N divides N (read
    by the GEMV form alone); ``ws_ptr``: the [SPLIT_K, M, N] fp32 workspace (read with SPLIT_K >
    1). BLOCK_M = 1 selects the GEMV form, any other the tiled one."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if SPLIT_K == 1:
        first = 0
        last = tl.cdiv(K, BLOCK_K)
    else:
        first = tl.program_id(1) * k_tiles
        last = tl.minimum(first + k_tiles, tl.cdiv(K, BLOCK_K))
    if BLOCK_M == 1:
        acc = scaled_gemv(a_ptr, b_ptr, sa_ptr, sb_ptr, pid_m, pid_n, N, K, first, last,
                          stride_am, stride_ak, stride_bn, stride_bk, stride_sam, stride_sak, stride_sbn, stride_sbk,
                          SCALING, EVEN_K, EVEN_N, BLOCK_N, BLOCK_K)
    else:
        acc = scaled_tile(a_ptr, b_ptr, sa_ptr, sb_ptr, pid_n, rm, rn, M, N, K, first, last,
                          stride_am, stride_ak, stride_bn, stride_bk, stride_sam, stride_sak, stride_sbn, stride_sbk,
                          SCALING, EVEN_K, FAST_ACC, BLOCK_M, BLOCK_N, BLOCK_K)

    if SPLIT_K == 1:
        scaled_epilogue(acc, rm, rn, M, N, c_ptr, bias_ptr, sa_ptr, sb_ptr, stride_cm, stride_cn,
                        stride_bias, stride_sam, stride_sbn, SCALING, HAS_BIAS, ACTIVATION)
    else:
        ws_ptrs = ws_ptr + tl.program_id(1) * M * N + rm[:, None] * N + rn[None, :]
        tl.store(ws_ptrs, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def scaled_reduce(
    ws_ptr, c_ptr, bias_ptr, sa_ptr, sb_ptr,
    M, N,
    stride_cm, stride_cn, stride_bias, stride_sam, stride_sbn,
    SCALING: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (N tiles, M tiles): the sum of ``scaled_matmul``'s SPLIT_K partials of one output
    tile, in slice order (the result does not depend on which slice finished first), through
    ``scaled_epilogue``."""
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offsets = rm[:, None] * N + rn[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + s * M * N + offsets, mask=mask, other=0.0)
    scaled_epilogue(acc, rm, rn, M, N, c_ptr, bias_ptr, sa_ptr, sb_ptr, stride_cm, stride_cn,
                    stride_bias, stride_sam, stride_sbn, SCALING, HAS_BIAS, ACTIVATION)
