"""What a served ``linear`` or ``matmul`` call does below the public functions: the checks
(shared with the custom ops and their fake implementations, so a malformed call raises the
same error wherever it is made), the dispatch key, and the run of the kernel that serves it,
which is kept for ``linear``'s front path. ``gemmtune.api`` is the public face over these."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from gemmtune import activation as activations
from gemmtune.backends.launch import any_rank, front_entry
from gemmtune.problem import ACTIVATIONS, torch_dtypes
from gemmtune.serving import recording as recorder
from gemmtune.serving.dispatch import DISPATCHER, DispatchKey
from gemmtune.serving.modes import ByMode

DTYPE_NAMES = {dtype: name for name, dtype in torch_dtypes().items()}
_FLOAT32 = torch.float32
any_autocast = torch._C._is_any_autocast_enabled  # torch.autocast on for some device (looked up once)


def _no_gpu() -> int:
    return -1


# the current GPU's index, without torch.cuda.current_device's frames (a CPU-only torch has none)
current_gpu = torch._C._cuda_getDevice if torch.cuda._is_compiled() else _no_gpu


def matmul_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``matmul`` on checked 2-D operands, without autograd (the body of the custom op)."""
    m, k = a.shape
    n = b.shape[1]
    if recorder.active() is not None:
        record_call("nn", a, None, m, n, k, "none")
    if falls_back(a, n):
        return torch.mm(a, b)
    return run("nn", a, b, None, m, n, k, "none")


def check_mm(a, b) -> None:
    """What ``torch.ops.gemmtune.mm`` (and its fake) requires: ``matmul``'s checks, and both
    operands 2-D (the op has no ``torch.matmul`` fallback for other ranks). Raises the error
    naming the argument that ``matmul`` raises."""
    for name, operand in (("a", a), ("b", b)):
        require_tensor(name, operand)
        if operand.dim() != 2:
            raise ValueError(f"mm: {name} must be 2-D, got shape {tuple(operand.shape)} "
                             "(gemmtune.matmul takes other ranks by torch.matmul's rules)")
    check_mm_2d(a, b)


def check_mm_2d(a: torch.Tensor, b: torch.Tensor) -> None:
    """``matmul``'s checks of 2-D operands: K agrees, one device, one dtype."""
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: a is {tuple(a.shape)} and b is {tuple(b.shape)}; a.shape[1] must equal b.shape[0]")
    require_same("b", b, a)


def check_linear(x, weight, bias, activation, *, mixed_dtypes: bool = False) -> str:
    """What ``linear`` requires, and ``torch.ops.gemmtune.linear`` (and its fake) too: x (..., K),
    weight (N, K) and bias (N,) or None, tensors of one dtype (unless ``mixed_dtypes``) on one
    device, and a known activation (None or its name). Returns the activation's name ("none" for
    None); raises an error naming the argument."""
    act = "none" if activation is None else activation
    if act not in ACTIVATIONS:
        raise ValueError(f"linear: activation={activation!r} is not supported; accepted: None, "
                         + ", ".join(ACTIVATIONS[1:]))
    require_tensor("x", x)
    require_tensor("weight", weight)
    shape = weight.shape
    if len(shape) != 2:
        raise ValueError(f"linear: weight must be 2-D (N, K), got shape {tuple(shape)}")
    n, k = shape
    x_shape = x.shape
    if not x_shape or x_shape[-1] != k:
        raise ValueError(f"linear: x has shape {tuple(x_shape)}; its last dimension must be weight's K={k}")
    require_same("weight", weight, x, dtype=not mixed_dtypes)
    if bias is not None:
        require_tensor("bias", bias)
        if bias.shape != (n,):
            raise ValueError(f"linear: bias must have shape ({n},), got {tuple(bias.shape)}")
        require_same("bias", bias, x, dtype=not mixed_dtypes)
    return act


def autocast_linear(x, weight, bias, activation) -> torch.Tensor:
    """``linear`` while torch.autocast is on: torch's ``F.linear``, whose operands autocast casts
    (their dtypes may differ: an autocast op's output meets a float32 weight), then the activation
    as torch's op, as the model without gemmtune computes them. gemmtune serves none of it."""
    act = check_linear(x, weight, bias, activation, mixed_dtypes=True)
    return activations.apply(F.linear(x, weight, bias), act, inplace=False)


def front_key(x, weight, bias, activation, px: int, pw: int, pb: int) -> tuple:
    """What linear's front path is keyed by: everything a served call's checks and its kernel's
    launch depend on (``px``, ``pw``, ``pb``: the operands' addresses, pb 0 without a bias), the
    current GPU among them for a CUDA x (``run`` switches to x's where they differ)."""
    dtype, gpu = x.dtype, x.get_device()
    return (x.shape, x.stride(), dtype, gpu, gpu >= 0 and current_gpu(), px & 15, weight.shape, weight.stride(),
            weight.dtype, weight.get_device(), pw & 15, activation, dtype is _FLOAT32 and tf32_allowed(),
            None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.get_device(), pb & 15))


def serve_front(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on operands checked by their caller (compiled code), through
    ``api.linear``'s front path: a call like one already served (its ``front_key``) goes straight
    to the launch bound to it, any other is served and bound for the next."""
    px, pw = x.data_ptr(), weight.data_ptr()
    pb = 0 if bias is None else bias.data_ptr()
    front = front_key(x, weight, bias, None, px, pw, pb)
    call = DISPATCHER.front.get(front)
    if call is not None:
        return call(x, weight, bias, px, pw, pb)
    n, k = weight.shape
    return serve_linear(x, weight, bias, "none", x.shape, n, k, front)


def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str) -> torch.Tensor:
    """``linear`` on checked operands, without autograd (the body of the custom op)."""
    n, k = weight.shape
    return serve_linear(x, weight, bias, act, x.shape, n, k)


def serve_linear(x, weight, bias, act: str, x_shape, n: int, k: int, front: tuple | None = None) -> torch.Tensor:
    """``front``: the call's front-path key, under which the kernel serving ``x`` is kept."""
    if recorder.active() is not None:
        record_call("linear", x, bias, x.numel() // k if k else 0, n, k, act)
    if falls_back(x, n):
        return activations.apply(F.linear(x, weight, bias), act, inplace=False)
    # a model's (batch, tokens, K) activations are M = batch * tokens rows of one GEMM
    return run("linear", x, weight, bias, x_shape[0] if len(x_shape) == 2 else x.numel() // k, n, k, act, front)


def dispatch_key(layout: str, a, bias, m: int, n: int, k: int, act: str) -> DispatchKey:
    """What the dispatcher's kernels are keyed by, for a served call (``a``'s dtype one of
    DTYPE_NAMES)."""
    return DispatchKey(layout, m, n, k, DTYPE_NAMES[a.dtype], bias is not None, uses_tf32(a), act, a.get_device())


def run(layout: str, a, b, bias, m: int, n: int, k: int, act: str, front: tuple | None = None) -> torch.Tensor:
    """The kernel for the key of (a, b, bias) run on them (a (..., K) in layout linear), and kept
    for linear's front path under ``front``."""
    gpu = a.get_device()
    if gpu >= 0 and gpu != current_gpu():
        return _on_its_gpu(gpu, layout, a, b, bias, m, n, k, act, front)
    key = dispatch_key(layout, a, bias, m, n, k, act)
    kernel = DISPATCHER.kernels.get(key)
    if kernel is None:  # the slow path: store, then tuning; never while a CUDA graph is captured
        if torch.cuda.is_current_stream_capturing():
            DISPATCHER.capture_miss(key)
            out = F.linear(a, b, bias) if layout == "linear" else torch_mm(a, b, bias)
            return activations.apply(out, act)
        kernel = DISPATCHER.kernel(key)
        if isinstance(kernel, ByMode):
            kernel.warm(a, b, bias)
    served = kernel if a.dim() == 2 else any_rank(kernel)
    out = served(a, b, bias)
    if front is not None:  # later calls like this one (of this rank too) take linear's front path
        DISPATCHER.front[front] = front_entry(kernel, a, b, bias)
    return out


def _on_its_gpu(gpu: int, layout: str, a, b, bias, m: int, n: int, k: int, act: str, front: tuple | None):
    """``run`` for operands on another GPU than the current one (a model whose layers lie on
    several GPUs, as ``device_map`` places them; torch's own ops switch devices): the kernel made,
    launched and bound with their GPU current, since a Triton launch or a cuBLASLt call runs on
    the current GPU's context, which must be the operands' own. The front path's entry for such
    calls switches too (its key holds the current GPU)."""
    with torch.cuda.device(gpu):
        out = run(layout, a, b, bias, m, n, k, act)
        kernel = DISPATCHER.kernels.get(dispatch_key(layout, a, bias, m, n, k, act))
        if front is not None and kernel is not None:
            DISPATCHER.front[front] = on_gpu(gpu, front_entry(kernel, a, b, bias))
    return out


def on_gpu(gpu: int, entry: Callable) -> Callable:
    """``entry``, called with GPU ``gpu`` current (and the caller's current again after)."""

    def call(*args):
        with torch.cuda.device(gpu):
            return entry(*args)

    return call


def record_call(layout: str, a: torch.Tensor, bias, m: int, n: int, k: int, act: str) -> None:
    recording = recorder.active()
    if recording is not None and a.dtype in DTYPE_NAMES and m * n * k > 0:
        recording.add(m, n, k, DTYPE_NAMES[a.dtype], layout, bias is not None, uses_tf32(a), act)


def tf32_allowed() -> bool:
    return torch.get_float32_matmul_precision() != "highest"


def uses_tf32(a: torch.Tensor) -> bool:
    """Whether cuBLAS may run this float32 product in TF32 now: part of what the call is keyed by."""
    return a.dtype is _FLOAT32 and tf32_allowed()


def torch_mm(a, b, bias):
    return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)


def falls_back(first: torch.Tensor, n: int) -> bool:
    """Whether torch computes this call: ``first`` (a or x; the other operands match its device
    and dtype) off the GPU, in a dtype gemmtune does not serve, or an empty product (M or K of
    ``first`` zero, or N zero)."""
    return not first.is_cuda or first.dtype not in DTYPE_NAMES or first.numel() == 0 or n == 0


def require_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def same_device(tensor: torch.Tensor, like: torch.Tensor) -> bool:
    """Whether two tensors lie on one device: two CUDA tensors told apart by their device indices
    alone (building two torch.device objects costs more than the rest of a served call's checks),
    any other pair by their devices whole (a CPU and a meta tensor both have index -1)."""
    return tensor.get_device() == like.get_device() and (tensor.is_cuda and like.is_cuda
                                                         or tensor.device == like.device)


def require_same(name: str, tensor: torch.Tensor, like: torch.Tensor, *, dtype: bool = True) -> None:
    """Same device (``same_device``) and, where ``dtype``, dtype as the first operand; a clear
    error where torch's would be vague."""
    if not same_device(tensor, like):
        raise ValueError(f"{name} is on {tensor.device} but the first operand is on {like.device}; move both to one device")
    if dtype and tensor.dtype != like.dtype:
        raise TypeError(f"{name} has dtype {tensor.dtype} but the first operand has {like.dtype}; gemmtune does not mix dtypes")
