"""The public functions: ``tune``, ``matmul``, ``linear``, ``scaled_mm`` and ``compile``.

What falls back to torch (documented, never a wrong result): tensors not on a CUDA device,
dtypes other than float16/bfloat16/float32, a zero-size dimension, a store miss during
CUDA-graph capture (no tuning while capturing), calls while ``torch.autocast`` is on (torch's
op, which autocast casts as it would without gemmtune; under torch.compile, gemmtune's op takes
operands of one dtype only), and for ``matmul`` operands that are not both 2-D
(``torch.matmul``'s broadcasting rules apply). Everything else that is malformed raises an
error naming the argument. Inputs that require a gradient go through autograd functions whose
backward GEMMs are gemmtune's too (``gemmtune.serving.autograd``; an activation then runs as
torch's own op after the GEMM), and calls that torch.compile traces through gemmtune's custom ops
(``gemmtune.serving.torch_ops``), which the compiler keeps whole instead of tracing into the
dispatcher.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.results import Trial, TuneResult
from gemmtune.serving import autograd
from gemmtune.serving import recording as recorder
from gemmtune.serving.calls import (any_autocast, autocast_linear, check_linear, check_mm_2d, front_key,
                                    matmul_forward, require_tensor, serve_linear)
from gemmtune.serving.dispatch import DISPATCHER
from gemmtune.store import ServerStore, Store, open_store
from gemmtune.tuning.tuner import TuneOptions, tune_many
from gemmtune.tuning.worker import IsolatedRunner

# looked up once: linear's front path calls them on every call
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


def tune(problems: Problem | Iterable[Problem], *, store: Store | ServerStore | str | Path | None = None,
         options: TuneOptions | None = None, retune: bool = False, isolate: bool = False,
         on_result: Callable[[TuneResult], None] | None = None,
         on_trial: Callable[[Trial], None] | None = None) -> list[TuneResult]:
    """Tune each problem on the current device (the CPU interpreter without a GPU) and store
    the choice. A problem already in the store is returned from it unless ``retune``.

    ``isolate`` runs the candidates in a worker process (``gemmtune.tuning.worker``): a candidate that
    crashes or hangs becomes a failed trial instead of taking this process with it.
    """
    problems = [problems] if isinstance(problems, Problem) else list(problems)
    for i, problem in enumerate(problems):
        if not isinstance(problem, Problem):
            raise TypeError(f"tune(problems=...): item {i} is a {type(problem).__name__}, expected gemmtune.Problem")
    store = store if isinstance(store, (Store, ServerStore)) else open_store(store)
    device = current()
    runner = IsolatedRunner(device, device_index=torch.cuda.current_device() if not device.interpreter else 0) \
        if isolate else None
    try:
        results = tune_many(problems, device, store, options or TuneOptions(), retune=retune, runner=runner,
                            on_result=on_result, on_trial=on_trial)
    finally:
        if runner is not None:
            runner.close()
    DISPATCHER.forget()
    return results


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-D ``a`` (M, K) and ``b`` (K, N) through the tuned kernel; differentiable
    when an operand requires a gradient."""
    require_tensor("a", a)
    require_tensor("b", b)
    if a.dim() != 2 or b.dim() != 2 or not _is_compiling() and any_autocast():
        return torch.matmul(a, b)
    check_mm_2d(a, b)
    if torch.compiler.is_compiling():
        from gemmtune.serving import torch_ops

        return torch_ops.mm(a, b)
    if autograd.needs_grad(a, b):
        return autograd.mm(a, b)
    return matmul_forward(a, b)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None) -> torch.Tensor:
    """``act(F.linear(x, weight, bias))``: x (..., K), weight (N, K), bias (N,) or None;
    ``activation`` one of relu, gelu, gelu_tanh, silu, fused into the kernel's epilogue.
    Differentiable when an input requires a gradient (the activation then runs unfused, as
    torch's own op: ``gemmtune.serving.autograd``)."""
    # The front path: a call like one already served by a kernel (same shapes, strides, 16-byte
    # alignment, dtypes and devices of every operand, same activation and TF32 setting) skips
    # every check below, since they passed then, and goes straight to what served it, which gets
    # the operands' addresses too (launch.front_entry). One key, one dict lookup.
    front = call = None
    if not _is_compiling():
        if any_autocast():  # torch's op, whose operands autocast casts: those casts are not gemmtune's to make
            return autocast_linear(x, weight, bias, activation)
        if recorder.active() is None:
            try:
                # autograd.needs_grad and uses_tf32 (in front_key), written out: a frame each on every call
                if not (_grad_enabled() and (x.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad))):
                    px, pw = x.data_ptr(), weight.data_ptr()
                    pb = 0 if bias is None else bias.data_ptr()
                    front = front_key(x, weight, bias, activation, px, pw, pb)
                    call = DISPATCHER.front.get(front)
            except (AttributeError, TypeError, RuntimeError):  # not tensors, no storage, an unhashable
                front = call = None                               # activation: the checks below say which
            if call is not None:
                return call(x, weight, bias, px, pw, pb)
    act = check_linear(x, weight, bias, activation)
    if torch.compiler.is_compiling():
        from gemmtune.serving import torch_ops

        return torch_ops.linear(x, weight, bias, act)
    if autograd.needs_grad(x, weight, bias):
        return autograd.linear(x, weight, bias, act)
    n, k = weight.shape
    return serve_linear(x, weight, bias, act, x.shape, n, k, front)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
              activation: str | None = None) -> torch.Tensor:
    """``torch._scaled_mm`` through the tuned kernel, with its arguments: a (M, K) and b (K, N)
    in one fp8 format (float8_e4m3fn or float8_e5m2; b is the transpose of an (N, K) weight,
    ``w.t()``), float32 scales per tensor (one element each), per row ((M, 1) and (1, N)) or per
    block ((M, K/128) and (K/128, N/128): 1 x 128 blocks of a, 128 x 128 of b), an optional bias
    (N,) of ``out_dtype``; ``activation`` one of relu, gelu, gelu_tanh, silu, fused into the
    kernel's epilogue. gemmtune quantizes nothing: the operands and scales are the caller's.
    Inference only (no autograd); tensors not on a CUDA device, empty products and calls that
    torch.compile traces (the compiler chooses their GEMM) run ``torch._scaled_mm`` (or, where
    torch has no kernel for the scaling, the dequantized product in float32: ``serving.scaled``)."""
    from gemmtune.serving import scaled

    scaling, act = scaled.check(a, b, scale_a, scale_b, bias, out_dtype, activation)
    if torch.compiler.is_compiling():
        return scaled.by_torch(a, b, scale_a, scale_b, bias, out_dtype, scaling, act)
    return scaled.forward(a, b, scale_a, scale_b, bias, out_dtype, scaling, act)


def compile(model, *, mode: str | None = None, fullgraph: bool = False, dynamic: bool | None = None,
            options: dict | None = None):
    """``torch.compile`` with gemmtune choosing every mm and addmm of the compiled graphs: the
    compiler's cuBLAS call, its Triton template with gemmtune's config (its epilogue fusions
    kept), or a gemmtune kernel called from the generated code. Each GEMM is stored or tuned on
    first sight, and nothing is benchmarked by the compiler. Arguments as torch.compile's
    (``gemmtune.inductor.backend``)."""
    from gemmtune.inductor import backend

    return backend.compile(model, mode=mode, fullgraph=fullgraph, dynamic=dynamic, options=options)


