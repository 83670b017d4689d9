"""What a served fp8 product does below ``gemmtune.scaled_mm``: the checks (each error names the
argument at fault), the scaling read from the scales' shapes, the dispatch key and the run.

The operands are ``torch._scaled_mm``'s: a (M, K) and b (K, N) in one fp8 format, b the transpose
of an (N, K) weight; float32 scales, one per tensor (``tensor``), (M, 1) and (1, N) (``row``), or
(M, K/128) and (K/128, N/128) (``block``: 1 x 128 blocks of a, 128 x 128 of b). gemmtune's scaled
kernels take the weight (N, K) and its scales in the weight's orientation (``Problem.scaling``):
transposed views, no copy."""

from __future__ import annotations

import torch

from gemmtune import activation as activations
from gemmtune import scaling as scaling_math
from gemmtune.problem import ACTIVATIONS, SCALE_BLOCK, scaled_torch_dtypes, torch_dtypes
from gemmtune.serving import recording as recorder
from gemmtune.serving.calls import current_gpu, same_device
from gemmtune.serving.dispatch import DISPATCHER, DispatchKey
from gemmtune.serving.modes import ByMode

FP8_NAMES = {dtype: name for name, dtype in scaled_torch_dtypes().items()}
OUT_NAMES = {dtype: name for name, dtype in torch_dtypes().items()}


def check(a, b, scale_a, scale_b, bias, out_dtype, activation) -> tuple[str, str]:
    """The scaling (``Problem.scaling``) and the activation ("none" for None) of a well-formed
    call; a TypeError or ValueError naming the argument otherwise."""
    for name, value in (("a", a), ("b", b), ("scale_a", scale_a), ("scale_b", scale_b)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"scaled_mm: {name} must be a torch.Tensor, got {type(value).__name__}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"scaled_mm: a (M, K) and b (K, N) must be 2-D with the same K, got a {tuple(a.shape)} "
                         f"and b {tuple(b.shape)}")
    if a.dtype not in FP8_NAMES or b.dtype != a.dtype:
        raise TypeError(f"scaled_mm: a and b must share one fp8 dtype ({', '.join(FP8_NAMES.values())}), "
                        f"got {a.dtype} and {b.dtype}")
    for name, scale in (("scale_a", scale_a), ("scale_b", scale_b)):
        if scale.dtype != torch.float32 or not same_device(scale, a):
            raise TypeError(f"scaled_mm: {name} must be float32 on {a.device}, got {scale.dtype} on {scale.device}")
    if out_dtype not in OUT_NAMES:
        raise TypeError(f"scaled_mm: out_dtype must be one of {', '.join(map(str, OUT_NAMES))}, got {out_dtype}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (b.shape[1],)
                             or bias.dtype != out_dtype or not same_device(bias, a)):
        raise ValueError(f"scaled_mm: bias must be a ({b.shape[1]},) tensor of out_dtype {out_dtype} on {a.device}, "
                         f"got {_described(bias)}")
    act = "none" if activation is None else activation
    if act not in ACTIVATIONS:
        raise ValueError(f"scaled_mm: activation {activation!r} is not supported; accepted: None, "
                         f"{', '.join(ACTIVATIONS[1:])}")
    return scaling_of(a, b, scale_a, scale_b), act


def scaling_of(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> str:
    """How the scales are laid, read from their shapes as ``torch._scaled_mm`` reads them."""
    (m, k), n = a.shape, b.shape[1]
    blocks_k, blocks_n = -(-k // SCALE_BLOCK), -(-n // SCALE_BLOCK)
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return "tensor"
    if tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n):
        return "row"
    if tuple(scale_a.shape) == (m, blocks_k) and tuple(scale_b.shape) == (blocks_k, blocks_n):
        return "block"
    raise ValueError(f"scaled_mm: scale_a {tuple(scale_a.shape)} and scale_b {tuple(scale_b.shape)} are no scaling "
                     f"of a ({m}, {k}) @ b ({k}, {n}); accepted: one element each (per tensor), ({m}, 1) and "
                     f"(1, {n}) (per row), ({m}, {blocks_k}) and ({blocks_k}, {blocks_n}) "
                     "(1 x 128 and 128 x 128 blocks)")


def forward(a, b, scale_a, scale_b, bias, out_dtype, scaling: str, act: str) -> torch.Tensor:
    """The checked call, recorded where ``gemmtune.record`` is on, and served: by torch where
    gemmtune does not serve it (not on a CUDA device, an empty product), else by the kernel of
    its key."""
    if a.is_cuda and a.get_device() != current_gpu():  # a layer on another GPU than the current one:
        with torch.cuda.device(a.device):               # its kernel made and launched on its own (calls.run)
            return forward(a, b, scale_a, scale_b, bias, out_dtype, scaling, act)
    (m, k), n = a.shape, b.shape[1]
    recording = recorder.active()
    if recording is not None and m * n * k > 0:
        recording.add(m, n, k, FP8_NAMES[a.dtype], "linear", bias is not None, False, act, scaling,
                      OUT_NAMES[out_dtype])
    if not a.is_cuda or m * n * k == 0:
        return by_torch(a, b, scale_a, scale_b, bias, out_dtype, scaling, act)
    key = DispatchKey("linear", m, n, k, FP8_NAMES[a.dtype], bias is not None, False, act, a.get_device(),
                      scaling, OUT_NAMES[out_dtype])
    kernel = DISPATCHER.kernels.get(key)
    if kernel is None:
        if torch.cuda.is_current_stream_capturing():  # nothing is tuned or built inside a capture
            DISPATCHER.capture_miss(key)
            return by_torch(a, b, scale_a, scale_b, bias, out_dtype, scaling, act)
        kernel = DISPATCHER.kernel(key)
        if isinstance(kernel, ByMode):
            kernel.warm(a, b.t(), bias, scale_a, _weight_oriented(scale_b))
    return kernel(a, b.t(), bias, scale_a, _weight_oriented(scale_b))


def _weight_oriented(scale_b: torch.Tensor) -> torch.Tensor:
    """torch's scale_b for b (K, N) as gemmtune's scaled kernels take it for the weight b.t():
    a row-wise (1, N) as (N, 1), a block-wise (K/128, N/128) as (N/128, K/128); views."""
    return scale_b.t() if scale_b.dim() == 2 else scale_b


def by_torch(a, b, scale_a, scale_b, bias, out_dtype, scaling: str, act: str) -> torch.Tensor:
    """The call as torch computes it on a GPU: ``torch._scaled_mm``, then the activation. Where
    torch has no such kernel, and on the CPU, the product of the dequantized operands in float32
    instead, the activation applied before the one rounding to ``out_dtype`` as a fused epilogue
    applies it (slower, as exact). On a GPU torch refuses block scaling at M = 1, an N not a
    multiple of 16, a bias with a float32 output and two e5m2 operands (H100, torch 2.11 + CUDA
    13); its CPU ``_scaled_mm`` scales per tensor only, and the activation after its rounded
    output read 2.8% off the float64 reference at M = N = K = 1 (silu at -11.4, where silu
    multiplies the input's error by 11). The call was checked already (``check``): what torch
    raises here is a kernel it lacks."""
    if a.is_cuda:
        try:
            return activations.apply(torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype), act)
        except (RuntimeError, ValueError):
            if torch.compiler.is_compiling():
                raise
    return activations.apply(dequantized_product(a, b, scale_a, scale_b, bias, scaling), act).to(out_dtype)


def dequantized_product(a, b, scale_a, scale_b, bias, scaling: str) -> torch.Tensor:
    """a @ b on torch's operands (b (K, N), its scales in that orientation), each operand times
    its scales in float32 first (``scaling.dequantize``), the bias added: a float32 (M, N)."""
    wide_a = scaling_math.dequantize(a, scale_a, scaling, False, torch.float32)
    wide_b = scaling_math.dequantize(b.t(), _weight_oriented(scale_b), scaling, True, torch.float32).t()
    product = wide_a @ wide_b
    return product if bias is None else product + bias.float()


def _described(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype} on {value.device}"
    return type(value).__name__
