"""The math of fp8 (scaled) products: an operand quantized with the scales of a ``Problem.scaling``
and dequantized back. gemmtune serves weights quantized by their owner; this quantizes the inputs
of its own checks, and ``gemmtune.nn.ScaledLinear``'s activations on each call, the way serving
stacks do (each scale the amax of the values it scales over the format's largest value)."""

from __future__ import annotations

import torch

from gemmtune.problem import SCALE_BLOCK

# The largest finite value of each fp8 format.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def quantize(t: torch.Tensor, dtype: torch.dtype, scaling: str, weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (rows, K) in fp8 ``dtype`` and its float32 scales, laid out as gemmtune's scaled
    kernels take them (``Problem.scaling``): one per tensor (shape ()), one per row ((rows, 1)),
    or one per block: 1 x 128 for activations ((rows, K/128), column-major, as torch._scaled_mm
    takes them), 128 x 128 for a weight (``weight``: (rows/128, K/128), row-major)."""
    wide = t.float()

    def scale_of(amax: torch.Tensor) -> torch.Tensor:  # an all-zero block keeps a finite scale
        return amax.div(FP8_MAX[dtype]).clamp_(min=torch.finfo(torch.float32).tiny)

    if scaling == "tensor":
        scale = scale_of(wide.abs().amax()).reshape(())
        return (wide / scale).to(dtype), scale
    if scaling == "row":
        scale = scale_of(wide.abs().amax(dim=1, keepdim=True))
        return (wide / scale).to(dtype), scale
    rows = SCALE_BLOCK if weight else 1
    blocks = scale_of(_block_amax(wide, rows))
    quantized = (wide / expand_blocks(blocks, t.shape, rows)).to(dtype)
    if weight:
        return quantized, blocks
    count, cols = blocks.shape
    return quantized, torch.empty_strided((count, cols), (1, count), device=t.device).copy_(blocks)


def dequantize(t: torch.Tensor, scale: torch.Tensor, scaling: str, weight: bool,
               dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """An fp8 operand (rows, K) times its scales, in ``dtype`` (float64: the checks' reference;
    float32: torch's fallback product, exact for the operand as it is for the product's terms)."""
    wide, scale = t.to(dtype, copy=True), scale.to(dtype)  # wide is scaled in place
    if scaling == "block":
        return wide.mul_(expand_blocks(scale, t.shape, SCALE_BLOCK if weight else 1))
    return wide.mul_(scale.reshape(-1, 1) if scaling == "row" else scale.reshape(()))


def expand_blocks(scale: torch.Tensor, shape: tuple, rows: int) -> torch.Tensor:
    """Block scales (one per ``rows`` x SCALE_BLOCK block) as one value per element of ``shape``."""
    full = scale.repeat_interleave(rows, dim=0).repeat_interleave(SCALE_BLOCK, dim=1)
    return full[:shape[0], :shape[1]]


def _block_amax(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The amax of each ``rows`` x SCALE_BLOCK block of ``t`` (edge blocks partial)."""
    r, k = t.shape
    pad_r, pad_k = -r % rows, -k % SCALE_BLOCK
    padded = torch.nn.functional.pad(t.abs(), (0, pad_k, 0, pad_r))
    view = padded.reshape((r + pad_r) // rows, rows, (k + pad_k) // SCALE_BLOCK, SCALE_BLOCK)
    return view.amax(dim=(1, 3)).contiguous()


def check_scales(scaling: str, m: int, n: int, k: int, scale_a, scale_b) -> None:
    """Scales of the shapes ``Problem.scaling`` lays (the kernels read them unchecked: a smaller
    tensor would be read past its end), else a ValueError naming the argument."""
    if scaling == "block":
        blocks_k = -(-k // SCALE_BLOCK)
        expected = {"scale_a": ((m, blocks_k), scale_a), "scale_b": ((-(-n // SCALE_BLOCK), blocks_k), scale_b)}
        for name, (shape, scale) in expected.items():
            if tuple(scale.shape) != shape:
                raise ValueError(f"{name} of shape {tuple(scale.shape)} for block scaling of a {m}x{n}x{k} "
                                 f"product; accepted: {shape}")
        return
    for name, scale, count in (("scale_a", scale_a, m), ("scale_b", scale_b, n)):
        count = 1 if scaling == "tensor" else count
        if scale.numel() != count:
            raise ValueError(f"{name} has {scale.numel()} elements for {scaling} scaling of a "
                             f"{m}x{n}x{k} product; accepted: {count}")
