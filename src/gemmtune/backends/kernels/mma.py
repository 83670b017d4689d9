"""The tile product every gemmtune kernel accumulates with: ``tl.dot`` into an fp32 accumulator.

Triton's CPU interpreter holds bfloat16 values as their 16-bit patterns and has no bfloat16
arithmetic: its ``tl.dot`` multiplies the patterns (triton-lang/triton#11584), and its
documentation says to widen bfloat16 to float32 first. Under the interpreter the operands are
widened here, so the CPU tests check the bfloat16 kernels too; a compiled kernel never has the
branch (its PTX is byte for byte what ``tl.dot`` alone gives).
"""

import os

import triton
import triton.language as tl

try:
    from triton import knobs

    INTERPRETED = tl.constexpr(bool(knobs.runtime.interpret))
except ImportError:  # Triton before 3.4 reads the variable itself
    INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr):
    """``acc + a @ b`` on the tensor cores (``PRECISION``: tl.dot's input_precision)."""
    if INTERPRETED:
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)
