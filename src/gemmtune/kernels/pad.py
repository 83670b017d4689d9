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
