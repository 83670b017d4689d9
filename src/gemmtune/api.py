"""The public functions: ``tune``, ``matmul`` and ``linear``.

What falls back to torch (documented, never a wrong result): tensors not on a CUDA device,
dtypes other than float16/bfloat16/float32, a zero-size dimension, a store miss during
CUDA-graph capture (no tuning while capturing), and for ``matmul`` operands that are not both
2-D (``torch.matmul``'s broadcasting rules apply). Everything else that is malformed raises an
error naming the argument. Inputs that require a gradient, and calls that torch.compile traces,
go through gemmtune's custom ops (``gemmtune.serving.torch_ops``): autograd differentiates them (their
backward GEMMs are gemmtune's too) and the compiler keeps them whole instead of tracing into
the dispatcher.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.results import Trial, TuneResult
from gemmtune.serving import recording as recorder
from gemmtune.serving.calls import check_linear, check_mm_2d, front_key, matmul_forward, require_tensor, serve_linear
from gemmtune.serving.dispatch import DISPATCHER
from gemmtune.store import Store
from gemmtune.tuning.tuner import TuneOptions, compile_batch, follower_plan, labels, shortlist, tune_problem
from gemmtune.tuning.worker import IsolatedRunner

# looked up once: linear's front path calls them on every call
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


def tune(problems: Problem | Iterable[Problem], *, store: Store | str | Path | None = None,
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
    require_tensor("a", a)
    require_tensor("b", b)
    if a.dim() != 2 or b.dim() != 2:
        return torch.matmul(a, b)
    check_mm_2d(a, b)
    if _needs_grad(a, b) or torch.compiler.is_compiling():
        from gemmtune.serving import torch_ops

        return torch_ops.mm(a, b)
    return matmul_forward(a, b)


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
            # _needs_grad and uses_tf32 (in front_key), written out: a frame each on every call
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
    if _needs_grad(x, weight, bias) or torch.compiler.is_compiling():
        from gemmtune.serving import torch_ops

        return torch_ops.linear(x, weight, bias, act)
    n, k = weight.shape
    return serve_linear(x, weight, bias, act, x.shape, n, k, front)


def _needs_grad(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    if not _grad_enabled():  # inference under no_grad: one call, no attribute reads
        return False
    return a.requires_grad or b.requires_grad or (bias is not None and bias.requires_grad)


