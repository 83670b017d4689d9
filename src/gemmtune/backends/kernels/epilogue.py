"""The fused epilogue every gemmtune kernel applies to its fp32 accumulator: bias, then the
activation, before the cast to the output dtype (one rounding, no extra pass over memory)."""

import triton
import triton.language as tl


@triton.jit
def activate(x, ACTIVATION: tl.constexpr):
    """``x`` (fp32) through the activation named by ACTIVATION (Problem.activation)."""
    if ACTIVATION == "relu":
        x = tl.maximum(x, 0.0)
    elif ACTIVATION == "gelu":
        x = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        # tanh(y) = 2 * sigmoid(2y) - 1, so 0.5 * x * (1 + tanh(y)) = x * sigmoid(2y)
        y = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        x = x * tl.sigmoid(2.0 * y)
    elif ACTIVATION == "silu":
        x = x * tl.sigmoid(x)
    return x
