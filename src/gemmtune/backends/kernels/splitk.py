"""A split-K GEMM for decode and other small-M shapes: C = act(A @ B + bias), fp32 accumulation.

With M <= 64 a GEMM is a stream over the weights: tiles along N alone leave most SMs idle, so
K is split too. Program (pid_n, pid_k, pid_m) covers output tile (pid_m, pid_n) over one slice
of K. A is (M, K); B is (K, N) given by its strides, so nn.Linear's ``x @ w.T`` (w (N, K),
K-contiguous) is the same kernel with B's strides swapped and the weights are read along K.

The partial sums are reduced inside the same launch: every program writes its fp32 partial to
a workspace and bumps a per-tile counter; the program that arrives last sums the partials in
a fixed order (so the result is deterministic), applies the epilogue and stores the output.
"""

import triton
import triton.language as tl

from gemmtune.backends.kernels.epilogue import activate
from gemmtune.backends.kernels.mma import mma


@triton.jit
def _store_output(acc, rm, rn, c_rows, n_bound, c_ptr, bias_ptr, M, stride_cn,
                  HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
    """The fused epilogue on a finished fp32 tile: bias, activation, one cast, masked store.
    ``c_rows`` (rm * stride_cm) and ``n_bound`` (N per column) come with the caller's hints."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < n_bound, other=0.0).to(tl.float32)[None, :]
    acc = activate(acc, ACTIVATION)
    c_ptrs = c_ptr + c_rows[:, None] + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn < n_bound)[None, :])


@triton.jit
def splitk_matmul(
    a_ptr, b_ptr, c_ptr, bias_ptr, ws_ptr, counter_ptr,
    M, N, K, k_per_split,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    PRECISION: tl.constexpr, USE_DOT: tl.constexpr, SPLIT_K: tl.constexpr, STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HINTS: tl.constexpr,
):
    """``k_per_split`` is a multiple of BLOCK_K with SPLIT_K * k_per_split >= K; EVEN_K says
    every slice lies wholly inside K, so no load along K needs a mask; EVEN_N that BLOCK_N
    divides N (read by the GEMV form alone)."""
    # Alignment Triton cannot see (launch.gemm_hints, one per scalar after M): N, K and the
    # strides that step rows are multiples of these many elements, or 1 for nothing more known.
    # (multiple_of must be written here: a hint set inside a called jit function is lost.)
    HINT_N: tl.constexpr = HINTS[0]
    HINT_K: tl.constexpr = HINTS[1]
    HINT_AM: tl.constexpr = HINTS[3]
    HINT_BK: tl.constexpr = HINTS[5]
    HINT_BN: tl.constexpr = HINTS[6]
    HINT_CM: tl.constexpr = HINTS[7]
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    n_bound = tl.full((BLOCK_N,), N, tl.int32)
    if HINT_N > 1:
        n_bound = tl.multiple_of(n_bound, HINT_N)

    if BLOCK_M == 1 and not USE_DOT:
        # A GEMV: the one row of A broadcast over a (BLOCK_N, BLOCK_K) tile of weights. Kept
        # 2-D: the 3-D form below made Triton move its operands through shared memory, with
        # six barriers, on every K step. Each load's addresses are the rows' starts plus the K
        # step's offset, and rows past N are masked: the other forms' pointers advanced in place
        # and their wrapped rows cost a GEMV 5-10% of its reading rate on the H200 (docs/performance.md, decode).
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        b_rows = rn * stride_bn
        if HINT_BN > 1:
            b_rows = tl.multiple_of(b_rows, HINT_BN)
        n_in = rn < n_bound
        k_bound = tl.full((BLOCK_K,), K, tl.int32)
        if HINT_K > 1:
            k_bound = tl.multiple_of(k_bound, HINT_K)
        a_start = pid_m * stride_am  # BLOCK_M is 1: this program's row of A
        if HINT_AM > 1:
            a_start = tl.multiple_of(a_start, HINT_AM)
        a_row = a_ptr + a_start
        if SPLIT_K == 1:
            k_first = 0  # a constant, as pid_k is
        else:
            k_first = k_start
        for k0 in tl.range(k_first, k_first + k_per_split, BLOCK_K, num_stages=STAGES):
            ks = k0 + rk
            b_ks = ks * stride_bk
            if HINT_BK > 1:
                b_ks = tl.multiple_of(b_ks, HINT_BK)
            b_ptrs = b_ptr + b_rows[:, None] + b_ks[None, :]
            # The weights are read once: first out of L2, which keeps A and the partials instead.
            if EVEN_K and EVEN_N:
                # x's addresses not built from ks, which the weights' share: with that offset in
                # common, ptxas multiplied the first K step's values before it issued the next
                # step's loads, and each program waited on memory twice (7% slower on the H200)
                a = tl.load(a_row + k0 * stride_ak + rk * stride_ak)
                b = tl.load(b_ptrs, eviction_policy="evict_first")
            else:
                k_in = ks < k_bound
                a = tl.load(a_row + ks * stride_ak, mask=k_in, other=0.0)
                b = tl.load(b_ptrs, mask=n_in[:, None] & k_in[None, :], other=0.0, eviction_policy="evict_first")
            acc += a.to(tl.float32)[None, :] * b.to(tl.float32)
        acc = tl.sum(acc, axis=1)[None, :]
    else:
        # Rows and columns past the edge wrap to valid ones instead of being masked, so the
        # loads stay unmasked along M and N; the store drops what they produce.
        rm_safe = rm % M
        rn_safe = rn % n_bound
        a_rows = rm_safe * stride_am
        if HINT_AM > 1:
            a_rows = tl.multiple_of(a_rows, HINT_AM)
        b_ks = (k_start + rk) * stride_bk
        if HINT_BK > 1:
            b_ks = tl.multiple_of(b_ks, HINT_BK)
        b_ns = rn_safe * stride_bn
        if HINT_BN > 1:
            b_ns = tl.multiple_of(b_ns, HINT_BN)
        a_ptrs = a_ptr + a_rows[:, None] + (k_start + rk)[None, :] * stride_ak
        if USE_DOT:  # B as (BLOCK_K, BLOCK_N) for tl.dot
            b_ptrs = b_ptr + b_ks[:, None] + b_ns[None, :]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            # Tiny M: tensor cores would waste most of each 16-row instruction; multiply-add in
            # fp32 on the CUDA cores, each product into its own lane of a 3-D accumulator, and
            # reduce over K once after the loop (a reduction per K step costs a round of warp
            # shuffles). B as (BLOCK_N, BLOCK_K): each weight row is read along K, its
            # contiguous dimension.
            b_ptrs = b_ptr + b_ns[:, None] + b_ks[None, :]
            acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, k_per_split, BLOCK_K, num_stages=STAGES):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs, eviction_policy="evict_first")
            else:
                k_left = tl.full((BLOCK_K,), K - k_start - k0, tl.int32)  # <= 0 in a slice past K: all masked
                if HINT_K > 1:
                    k_left = tl.multiple_of(k_left, HINT_K)
                k_in = rk < k_left
                a = tl.load(a_ptrs, mask=k_in[None, :], other=0.0)
                if USE_DOT:
                    b = tl.load(b_ptrs, mask=k_in[:, None], other=0.0, eviction_policy="evict_first")
                else:
                    b = tl.load(b_ptrs, mask=k_in[None, :], other=0.0, eviction_policy="evict_first")
            if USE_DOT:
                acc = mma(a, b, acc, PRECISION)
            else:
                acc += a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :]
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        if not USE_DOT:
            acc = tl.sum(acc, axis=2)

    c_rows = rm * stride_cm
    if HINT_CM > 1:
        c_rows = tl.multiple_of(c_rows, HINT_CM)
    if SPLIT_K == 1:
        _store_output(acc, rm, rn, c_rows, n_bound, c_ptr, bias_ptr, M, stride_cn, HAS_BIAS, ACTIVATION)
    else:
        # Workspace [SPLIT_K, M, N] fp32, contiguous.
        tile_mask = (rm[:, None] < M) & (rn[None, :] < N)
        tile_offs = rm[:, None] * N + rn[None, :]
        tl.store(ws_ptr + pid_k * M * N + tile_offs, acc, mask=tile_mask)
        # Every thread's partial is written before the one thread doing the atomic releases it.
        tl.debug_barrier()
        tile_id = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counter_ptr + tile_id, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last of this tile's programs: all partials are written
            tl.debug_barrier()
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # fixed order: the sum does not depend on who was last
                # .cg reads L2, never an L1 line that could predate another SM's write
                total += tl.load(ws_ptr + s * M * N + tile_offs, mask=tile_mask, other=0.0,
                                 cache_modifier=".cg")
            _store_output(total, rm, rn, c_rows, n_bound, c_ptr, bias_ptr, M, stride_cn, HAS_BIAS, ACTIVATION)
            # Leave the counter at zero for the next launch: no memset launch before each call,
            # and a CUDA graph that replays this kernel finds its counters zeroed every time.
            tl.atomic_xchg(counter_ptr + tile_id, 0)
