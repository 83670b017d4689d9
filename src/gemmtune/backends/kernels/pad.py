"""Copy a 2-D tensor into another of a different size, zero-filling what the source lacks.

One pass over the destination: padding operands to aligned sizes before a GEMM, and cutting
the wanted columns out of a padded result after it. Strided rows whose starts are not 16-byte
aligned defeat torch's vectorized copy; this kernel reads them with plain coalesced loads.
"""

import triton
import triton.language as tl


@triton.jit
def pad_copy(
    src_ptr, dst_ptr, src_rows, src_cols, dst_rows, dst_cols,
    stride_sr, stride_sc, stride_dr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    inside = (r[:, None] < src_rows) & (c[None, :] < src_cols)
    x = tl.load(src_ptr + r[:, None] * stride_sr + c[None, :] * stride_sc, mask=inside, other=0.0)
    tl.store(dst_ptr + r[:, None] * stride_dr + c[None, :], x, mask=(r[:, None] < dst_rows) & (c[None, :] < dst_cols))


@triton.jit
def pad_copy_flat(
    src_ptr, dst_ptr, src_rows, total,
    SRC_COLS: tl.constexpr, DST_COLS: tl.constexpr, SRC_STRIDE: tl.constexpr, DST_STRIDE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The same copy over the destination's elements in one flat index, for a source whose columns
    are contiguous: with its column count and both row strides constants, the compiler sees the
    alignment of every row (4100 is four times 1025) and moves 8-16 bytes per instruction, which
    run-time strides (and hints on them, tried) did not get it to do."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c = i % DST_COLS
    r = i // DST_COLS
    x = tl.load(src_ptr + r * SRC_STRIDE + c, mask=(i < total) & (c < SRC_COLS) & (r < src_rows), other=0.0)
    tl.store(dst_ptr + r * DST_STRIDE + c, x, mask=i < total)
