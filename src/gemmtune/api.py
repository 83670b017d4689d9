"""The public functions: ``tune``, ``matmul`` and ``linear``.

What falls back to torch (documented, never a wrong result): tensors not on a CUDA device,
dtypes other than float16/bfloat16/float32, a zero-size dimension, a store miss during
CUDA-graph capture (no tuning while capturing), and for ``matmul`` operands that are not both
2-D (``torch.matmul``'s broadcasting rules apply). Everything else that is malformed raises an
error naming the argument. Inputs that require a gradient, and calls that torch.compile traces,
go through gemmtune's custom ops (``gemmtune.torch_ops``): autograd differentiates them (their
backward GEMMs are gemmtune's too) and the compiler keeps them whole instead of tracing into
the dispatcher.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F

from gemmtune import activation as activations
from gemmtune import recording as recorder
from gemmtune.device import current
from gemmtune.dispatch import DISPATCHER
from gemmtune.launch import any_rank, front_entry
from gemmtune.problem import ACTIVATIONS, Problem
from gemmtune.results import Trial, TuneResult
from gemmtune.store import Store
from gemmtune.tuner import TuneOptions, compile_batch, follower_plan, labels, shortlist, tune_problem
from gemmtune.worker import IsolatedRunner

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_FLOAT32 = torch.float32
# looked up once: linear's front path calls them on every call
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


def tune(problems: Problem | Iterable[Problem], *, store: Store | str | Path | None = None,
         options: TuneOptions | None = None, retune: bool = False, isolate: bool = False,
         on_result: Callable[[TuneResult], None] | None = None,
         on_trial: Callable[[Trial], None] | None = None) -> list[TuneResult]:
    """Tune each problem on the current device (the CPU interpreter without a GPU) and store
    the choice. A problem already in the store is returned from it unless ``retune``.

    ``isolate`` runs the candidates in a worker process (``gemmtune.worker``): a candidate that
    crashes or hangs becomes a failed trial instead of taking this process with it.
    """
    problems = [problems] if isinstance(problems, Problem) else list(problems)
    for i, problem in enumerate(problems):
        if not isinstance(problem, Problem):
            raise TypeError(f"tune(problems=...): item {i} is a {type(problem).__name__}, expected gemmtune.Problem")
    store = store if isinstance(store, Store) else Store(store)
    device = current()
    options = options or TuneOptions()
    runner = IsolatedRunner(device, device_index=torch.cuda.current_device() if not device.interpreter else 0) \
        if isolate else None
    known = {} if retune else {p.key(): store.get(device.fingerprint(), p.key()) for p in problems}
    new = list({p.key(): p for p in problems if known.get(p.key()) is None}.values())
    # A problem that differs from an earlier new one in its epilogue alone (a follower) tries
    # cuBLAS and that lead's best candidates after it, not a whole plan of its own.
    leads = {}
    for problem in new:
        leads.setdefault(problem.without_epilogue(), problem)
    # A model's shapes compile side by side (an isolated runner compiles each in its own process),
    # and so do the followers, each its lead's best-predicted candidates (follower_plan): which of
    # the lead's a follower tries is known only once the lead is measured, and compiling them
    # then would cost a second round.
    followers = {p.key(): follower_plan(p, device, options) for p in new if leads[p.without_epilogue()] is not p}
    compiled = compile_batch(new, device, options, followers) if runner is None and len(new) > 1 else {}
    results = []
    try:
        for problem in problems:
            result = known.get(problem.key())
            if result is None:
                lead = leads[problem.without_epilogue()]
                own = options
                if lead is not problem:  # a follower compiled in the batch tries what it compiled there
                    among = labels(followers[problem.key()]) if problem.key() in compiled else None
                    own = dataclasses.replace(options, shortlist=shortlist(known[lead.key()], among=among))
                result = tune_problem(problem, device, options=own, on_trial=on_trial, runner=runner,
                                      compiled=compiled.get(problem.key()))
                store.put(result)
                known[problem.key()] = result  # a problem listed twice is tuned once
            results.append(result)
            if on_result is not None:
                on_result(result)
    finally:
        if runner is not None:
            runner.close()
    DISPATCHER.forget()
    return results


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-D ``a`` (M, K) and ``b`` (K, N) through the tuned kernel; differentiable
    (through ``torch.ops.gemmtune.mm``) when an operand requires a gradient."""
    _require_tensor("a", a)
    _require_tensor("b", b)
    if a.dim() != 2 or b.dim() != 2:
        return torch.matmul(a, b)
    _check_mm_2d(a, b)
    if _needs_grad(a, b) or torch.compiler.is_compiling():
        from gemmtune import torch_ops

        return torch_ops.mm(a, b)
    return matmul_forward(a, b)


def check_mm(a, b) -> None:
    """What ``torch.ops.gemmtune.mm`` (and its fake) requires: ``matmul``'s checks, and both
    operands 2-D (the op has no ``torch.matmul`` fallback for other ranks). Raises the error
    naming the argument that ``matmul`` raises."""
    for name, operand in (("a", a), ("b", b)):
        _require_tensor(name, operand)
        if operand.dim() != 2:
            raise ValueError(f"mm: {name} must be 2-D, got shape {tuple(operand.shape)} "
                             "(gemmtune.matmul takes other ranks by torch.matmul's rules)")
    _check_mm_2d(a, b)


def _check_mm_2d(a: torch.Tensor, b: torch.Tensor) -> None:
    """``matmul``'s checks of 2-D operands: K agrees, one device, one dtype."""
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: a is {tuple(a.shape)} and b is {tuple(b.shape)}; a.shape[1] must equal b.shape[0]")
    _require_same("b", b, a)


def matmul_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``matmul`` on checked 2-D operands, without autograd (the body of the custom op)."""
    m, k = a.shape
    n = b.shape[1]
    if recorder.active() is not None:
        _record("nn", a, None, m, n, k, "none")
    if _falls_back(a, n):
        return torch.mm(a, b)
    return _run("nn", a, b, None, m, n, k, "none")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None) -> torch.Tensor:
    """``act(F.linear(x, weight, bias))``: x (..., K), weight (N, K), bias (N,) or None;
    ``activation`` one of relu, gelu, gelu_tanh, silu, fused into the kernel's epilogue.
    Differentiable (through ``torch.ops.gemmtune.linear``) when an input requires a gradient."""
    # The front path: a call like one already served by a kernel (same shapes, strides, 16-byte
    # alignment, dtypes and devices of every operand, same activation and TF32 setting) skips
    # every check below, since they passed then, and goes straight to what served it, which gets
    # the operands' addresses too (launch.front_entry). One key, one dict lookup.
    front = call = None
    if not _is_compiling() and recorder.active() is None:
        try:
            # _needs_grad and _uses_tf32 (in _front_key), written out: a frame each on every call
            if not (_grad_enabled() and (x.requires_grad or weight.requires_grad
                                         or (bias is not None and bias.requires_grad))):
                px, pw = x.data_ptr(), weight.data_ptr()
                pb = 0 if bias is None else bias.data_ptr()
                front = _front_key(x, weight, bias, activation, px, pw, pb)
                call = DISPATCHER.front.get(front)
        except (AttributeError, TypeError, RuntimeError):  # not tensors, no storage, an unhashable
            front = call = None                               # activation: the checks below say which
        if call is not None:
            return call(x, weight, bias, px, pw, pb)
    act = check_linear(x, weight, bias, activation)
    if _needs_grad(x, weight, bias) or torch.compiler.is_compiling():
        from gemmtune import torch_ops

        return torch_ops.linear(x, weight, bias, act)
    n, k = weight.shape
    return _linear(x, weight, bias, act, x.shape, n, k, front)


def check_linear(x, weight, bias, activation) -> str:
    """What ``linear`` requires, and ``torch.ops.gemmtune.linear`` (and its fake) too: x (..., K),
    weight (N, K) and bias (N,) or None, tensors of one dtype on one device, and a known
    activation (None or its name). Returns the activation's name ("none" for None); raises an
    error naming the argument."""
    act = "none" if activation is None else activation
    if act not in ACTIVATIONS:
        raise ValueError(f"linear: activation={activation!r} is not supported; accepted: None, "
                         + ", ".join(ACTIVATIONS[1:]))
    _require_tensor("x", x)
    _require_tensor("weight", weight)
    shape = weight.shape
    if len(shape) != 2:
        raise ValueError(f"linear: weight must be 2-D (N, K), got shape {tuple(shape)}")
    n, k = shape
    x_shape = x.shape
    if not x_shape or x_shape[-1] != k:
        raise ValueError(f"linear: x has shape {tuple(x_shape)}; its last dimension must be weight's K={k}")
    _require_same("weight", weight, x)
    if bias is not None:
        _require_tensor("bias", bias)
        if bias.shape != (n,):
            raise ValueError(f"linear: bias must have shape ({n},), got {tuple(bias.shape)}")
        _require_same("bias", bias, x)
    return act


def _front_key(x, weight, bias, activation, px: int, pw: int, pb: int) -> tuple:
    """What linear's front path is keyed by: everything a served call's checks and its kernel's
    launch depend on (``px``, ``pw``, ``pb``: the operands' addresses, pb 0 without a bias)."""
    dtype = x.dtype
    return (x.shape, x.stride(), dtype, x.get_device(), px & 15, weight.shape, weight.stride(), weight.dtype,
            weight.get_device(), pw & 15, activation, dtype is _FLOAT32 and _tf32_allowed(),
            None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.get_device(), pb & 15))


def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str) -> torch.Tensor:
    """``linear`` on checked operands, without autograd (the body of the custom op)."""
    n, k = weight.shape
    return _linear(x, weight, bias, act, x.shape, n, k)


def _linear(x, weight, bias, act: str, x_shape, n: int, k: int, front: tuple | None = None) -> torch.Tensor:
    """``front``: the call's front-path key, under which the kernel serving ``x`` is kept."""
    if recorder.active() is not None:
        _record("linear", x, bias, x.numel() // k if k else 0, n, k, act)
    if _falls_back(x, n):
        return activations.apply(F.linear(x, weight, bias), act, inplace=False)
    # a model's (batch, tokens, K) activations are M = batch * tokens rows of one GEMM
    return _run("linear", x, weight, bias, x_shape[0] if len(x_shape) == 2 else x.numel() // k, n, k, act, front)


def _key(layout: str, a, bias, m: int, n: int, k: int, act: str) -> tuple:
    """What the dispatcher's kernels are keyed by."""
    return layout, m, n, k, a.dtype, bias is not None, _uses_tf32(a), act, a.get_device()


def _run(layout: str, a, b, bias, m: int, n: int, k: int, act: str, front: tuple | None = None) -> torch.Tensor:
    """The kernel for the key of (a, b, bias) run on them (a (..., K) in layout linear), and kept
    for linear's front path under ``front``."""
    key = _key(layout, a, bias, m, n, k, act)
    kernel = DISPATCHER.kernels.get(key)
    if kernel is None:  # the slow path: store, then tuning; never while a CUDA graph is captured
        problem_of_key = lambda: Problem(m, n, k, _DTYPE_NAMES[a.dtype], layout, bias is not None, key[6], act)  # noqa: E731
        if torch.cuda.is_current_stream_capturing():
            DISPATCHER.capture_miss(key, problem_of_key)
            out = F.linear(a, b, bias) if layout == "linear" else _torch_mm(a, b, bias)
            return activations.apply(out, act)
        kernel = DISPATCHER.kernel(key, problem_of_key)
    served = kernel if a.dim() == 2 else any_rank(kernel)
    out = served(a, b, bias)
    if front is not None:  # later calls like this one (of this rank too) take linear's front path
        DISPATCHER.front[front] = front_entry(served, a, b, bias)
    return out


def _record(layout: str, a: torch.Tensor, bias, m: int, n: int, k: int, act: str) -> None:
    recording = recorder.active()
    if recording is not None and a.dtype in _DTYPE_NAMES and m * n * k > 0:
        recording.add(m, n, k, _DTYPE_NAMES[a.dtype], layout, bias is not None, _uses_tf32(a), act)


def _tf32_allowed() -> bool:
    return torch.get_float32_matmul_precision() != "highest"


def _uses_tf32(a: torch.Tensor) -> bool:
    """Whether cuBLAS may run this float32 product in TF32 now: part of what the call is keyed by."""
    return a.dtype is _FLOAT32 and _tf32_allowed()


def _torch_mm(a, b, bias):
    return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)


def _falls_back(first: torch.Tensor, n: int) -> bool:
    """Whether torch computes this call: ``first`` (a or x; the other operands match its device
    and dtype) off the GPU, in a dtype gemmtune does not serve, or an empty product (M or K of
    ``first`` zero, or N zero)."""
    return not first.is_cuda or first.dtype not in _DTYPE_NAMES or first.numel() == 0 or n == 0


def _needs_grad(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    if not _grad_enabled():  # inference under no_grad: one call, no attribute reads
        return False
    return a.requires_grad or b.requires_grad or (bias is not None and bias.requires_grad)


def _require_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _require_same(name: str, tensor: torch.Tensor, like: torch.Tensor) -> None:
    """Same device and dtype as the first operand; a clear error where torch's would be vague.
    Two CUDA tensors are told apart by their device indices alone: building two torch.device
    objects costs more than the rest of a served call's checks. Any other pair compares its
    devices whole: a CPU and a meta tensor both have index -1."""
    if tensor.get_device() != like.get_device() \
            or not (tensor.is_cuda and like.is_cuda) and tensor.device != like.device:
        raise ValueError(f"{name} is on {tensor.device} but the first operand is on {like.device}; move both to one device")
    if tensor.dtype != like.dtype:
        raise TypeError(f"{name} has dtype {tensor.dtype} but the first operand has {like.dtype}; gemmtune does not mix dtypes")
