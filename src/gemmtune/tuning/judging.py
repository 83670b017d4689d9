"""An output judged against its float64 reference on the GPU in one pass over memory: each
block of elements gives its largest |error| / bound and where it lies, and the sums of squares
of the error and of the reference; the host reads the few numbers the verdict needs in one
synchronization.

In torch, the same judgement took about eight passes over float64 tensors of the output's size
(the error, its ratio to the bound, a mask of the non-finite, then the error again for the norm,
and two norms), and their allocations: on an 8192 x 28672 output (1.9 GB of float64 per pass) a
candidate's two checks cost about 36 ms, 2.3 s of a 4.6 s tuning on an H200 (docs/tuning-time.md).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements per program


@triton.jit
def _partials(out_ptr, ref_ptr, bound_ptr, worst_ptr, where_ptr, error_ptr, norm_ptr, count,
              BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < count
    ref = tl.load(ref_ptr + offsets, mask=inside, other=0.0)
    error = tl.load(out_ptr + offsets, mask=inside, other=0.0).to(tl.float64) - ref
    ratio = tl.abs(error) / tl.load(bound_ptr + offsets, mask=inside, other=1.0).to(tl.float64)
    ratio = tl.where(ratio == ratio, ratio, float("inf"))  # NaN compares false: make it the worst
    ratio = tl.where(inside, ratio, -1.0)
    worst, where = tl.max(ratio, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(worst_ptr + pid, worst)
    tl.store(where_ptr + pid, pid.to(tl.int64) * BLOCK + where)
    tl.store(error_ptr + pid, tl.sum(error * error, axis=0))
    tl.store(norm_ptr + pid, tl.sum(ref * ref, axis=0))


class Judged(NamedTuple):
    error_norm: float  # ||out - ref||; inf where any element is not finite
    ref_norm: float  # ||ref||
    worst: float  # the largest |out - ref| / bound; inf where any element is not finite
    flat: int  # where the worst lies, in the flattened output (its first occurrence)
    value: float  # the output there
    expected: float  # the reference there


def takes(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> bool:
    """Whether ``judge`` can read these: of one shape, not empty, each contiguous, the reference
    in float64 (the device is the caller's to choose: a GPU, or Triton's interpreter)."""
    return (out.shape == ref.shape == bound.shape and ref.dtype == torch.float64 and out.numel() > 0
            and all(t.is_contiguous() for t in (out, ref, bound)))


def judge(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> Judged:
    """``out`` against ``ref`` element by element (each error over its ``bound``) and as a whole."""
    count = out.numel()
    blocks = triton.cdiv(count, BLOCK)
    worst, error, norm = (torch.empty(blocks, dtype=torch.float64, device=out.device) for _ in range(3))
    where = torch.empty(blocks, dtype=torch.int64, device=out.device)
    _partials[(blocks,)](out, ref, bound, worst, where, error, norm, count, BLOCK=BLOCK)
    block = torch.argmax(worst)  # the first block holding the largest ratio
    flat = where[block]
    numbers = torch.stack([worst[block], flat.double(), error.sum(), norm.sum(), out.reshape(-1)[flat].double(),
                           ref.reshape(-1)[flat]]).tolist()  # one synchronization
    worst_ratio, flat_index, error_sq, norm_sq, value, expected = numbers
    error_norm = math.sqrt(error_sq) if math.isfinite(error_sq) else math.inf
    return Judged(error_norm, math.sqrt(norm_sq), worst_ratio, int(flat_index), value, expected)
