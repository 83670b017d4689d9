"""A tiled GEMM for any M, N, K >= 1: C = act(A @ B + bias), fp32 accumulation.

A is (M, K) and B is (K, N), each given by its strides, so nn.Linear's ``x @ w.T`` is the same
kernel with B's strides swapped. Edges are masked, so sizes like 4095 need no padding. Tiles
are visited in groups of GROUP_M rows so that neighbouring programs share B tiles in L2. The
grid's second axis is a batch (``torch.bmm``): program ``(t, q)`` computes tile ``t`` of the
``q``-th product, each operand offset by ``q`` times its batch stride (0 where unbatched).
K is a constant of the binary (one compile per K); M, N and the strides are run-time integers.
"""

import triton
import triton.language as tl

from gemmtune.backends.kernels.epilogue import activate
from gemmtune.backends.kernels.mma import mma
from gemmtune.backends.kernels.order import grouped_tile


@triton.jit
def tiled_matmul(
    a_ptr, b_ptr, c_ptr, bias_ptr,
    M, N,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    stride_aq, stride_bq, stride_cq,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HINTS: tl.constexpr,
):
    # K is a constant of each binary: with the K loop's trip count known, the same loop ran
    # 1.15-1.17x cuBLAS's time with K a run-time integer and 1.01-1.08x with K fixed on an H200
    # (docs/performance.md, a compile-time K).
    EVEN_K: tl.constexpr = K % BLOCK_K == 0
    # Alignment Triton cannot see (launch.gemm_hints): N and the strides that step rows are
    # multiples of these many elements, or 1 for nothing known beyond what Triton knows.
    # (multiple_of must be written here: a hint set inside a called jit function is lost.)
    HINT_N: tl.constexpr = HINTS[0]
    HINT_AM: tl.constexpr = HINTS[1]
    HINT_BK: tl.constexpr = HINTS[3]
    HINT_BN: tl.constexpr = HINTS[4]
    HINT_CM: tl.constexpr = HINTS[5]
    q = tl.program_id(1).to(tl.int64)  # the batch's product: 64-bit offsets past 2^31 elements
    a_ptr += q * stride_aq
    b_ptr += q * stride_bq
    c_ptr += q * stride_cq
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Rows and columns past the edge wrap to valid ones instead of being masked, so loads along
    # M and N stay unmasked (and vectorized where N is a multiple of 16); the store drops them.
    n_bound = tl.full((BLOCK_N,), N, tl.int32)
    if HINT_N > 1:
        n_bound = tl.multiple_of(n_bound, HINT_N)
    rm_safe = rm % M
    rn_safe = rn % n_bound
    a_rows = rm_safe * stride_am
    if HINT_AM > 1:
        a_rows = tl.multiple_of(a_rows, HINT_AM)
    b_rows = rk * stride_bk
    if HINT_BK > 1:
        b_rows = tl.multiple_of(b_rows, HINT_BK)
    b_cols = rn_safe * stride_bn
    if HINT_BN > 1:
        b_cols = tl.multiple_of(b_cols, HINT_BN)
    a_ptrs = a_ptr + a_rows[:, None] + rk[None, :] * stride_ak
    b_ptrs = b_ptr + b_rows[:, None] + b_cols[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_in = rk < K - k0 * BLOCK_K
            a = tl.load(a_ptrs, mask=k_in[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_in[:, None], other=0.0)
        acc = mma(a, b, acc, PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < n_bound, other=0.0).to(tl.float32)[None, :]
    acc = activate(acc, ACTIVATION)
    c_rows = rm * stride_cm
    if HINT_CM > 1:
        c_rows = tl.multiple_of(c_rows, HINT_CM)
    c_ptrs = c_ptr + c_rows[:, None] + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn < n_bound)[None, :])
