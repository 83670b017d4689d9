"""One problem measured side by side: torch's own call (cuBLAS on a GPU), the kernel gemmtune
chose for it, and optionally inductor's (torch.compile max-autotune, without CUDA graphs),
on the same fresh random operands, in one process, in interleaved rounds with the L2 flushed
(``timing.measure``: CUDA-graph replays, so GPU time alone). The chosen kernel's output is checked
against float64 first. A row of the suite file that ``gemmtune report`` renders; ``gemmtune
bench`` writes one per shape.

Without a GPU the chosen kernel runs in Triton's interpreter and torch's call on the CPU: the
row says so (``gpu_timings``), and its times are not GPU times.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gemmtune import activation, backends
from gemmtune.device import Device
from gemmtune.results import TuneResult
from gemmtune.shapes import NamedProblem
from gemmtune.tuning import measure as timing
from gemmtune.tuning import verify


def torch_call(named: NamedProblem, inputs: verify.Inputs) -> Callable[[], torch.Tensor]:
    """torch's own call of the problem on ``inputs``, its epilogue included (what cuBLAS alone costs
    a user; for an fp8 product, ``torch._scaled_mm``)."""
    p, a, b, bias = named.problem, inputs.a, inputs.b, inputs.bias
    if p.scaled:
        kernel = backends.build(p, backends.REFERENCE, {}, None)
        return lambda: kernel(*inputs.operands)
    if p.layout == "linear":
        return lambda: activation.apply(F.linear(a, b, bias), p.activation, inplace=False)
    return lambda: activation.apply(torch.mm(a, b) if bias is None else torch.addmm(bias, a, b), p.activation,
                                    inplace=False)


def refusal(fn: Callable[[], torch.Tensor]) -> str | None:
    """Why torch's call raises on this problem, or None where it runs: torch's ``_scaled_mm``
    refuses some fp8 products (block scaling at M = 1, two e5m2 operands, a bias with a float32
    output, on an H100 with torch 2.11). Such a row has no cuBLAS time, and gemmtune's kernel is
    the only GPU kernel for it."""
    try:
        fn()
    except (RuntimeError, ValueError) as exc:
        return str(exc).splitlines()[0][:200]
    return None


def unscaled_call(p, inputs: verify.Inputs) -> Callable[[], torch.Tensor]:
    """cuBLAS's ``F.linear`` on the fp8 product's dequantized operands in its output dtype (bf16,
    say): the call an fp8 kernel replaces."""
    dtype = verify.TORCH_DTYPES[p.out_dtype]
    a, b = inputs.a.to(dtype), inputs.b.to(dtype)
    return lambda: activation.apply(F.linear(a, b, inputs.bias), p.activation, inplace=False)


def compiled(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], torch.Tensor], float]:
    """``fn`` under torch.compile max-autotune (no CUDA graphs: timing.measure captures its own),
    from scratch, and the seconds its first call took (inductor's tuning and compiling)."""
    torch._dynamo.reset()  # from scratch for every shape, and clear of dynamo's recompile limit
    fast = torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=False)
    t0 = time.perf_counter()
    fast()
    torch.cuda.synchronize()
    return fast, time.perf_counter() - t0


def measure(named: NamedProblem, result: TuneResult, device: Device, *, inductor: bool = False,
            rounds: int = 30, budget_ms: float = 1000.0) -> dict:
    """The suite row of ``named``: torch's call and ``result``'s kernel timed in the same rounds
    (their ratio's noise from the paired samples), and inductor's in rounds of its own beside
    torch's (``inductor``; a GPU only): a compiled wrapper in the same rounds slows the other two
    by tens of microseconds on small shapes."""
    if result.problem_key != named.problem.key():
        raise ValueError(f"measure: the result is for {result.problem_key}, not {named.problem.key()}")
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if named.problem.tf32 else "highest")  # torch's call as the problem's
    try:
        return _measure(named, result, device, inductor=inductor, rounds=rounds, budget_ms=budget_ms)
    finally:
        torch.set_float32_matmul_precision(before)


def _measure(named: NamedProblem, result: TuneResult, device: Device, *, inductor: bool, rounds: int,
             budget_ms: float) -> dict:
    p = named.problem
    inputs = verify.make_inputs(p, "cpu" if device.interpreter else "cuda")
    kernel = backends.build(p, result.backend, result.config, device)
    verdict = verify.judge(kernel(*inputs.operands), p, inputs)
    theirs = torch_call(named, inputs)
    refused = refusal(theirs)
    fns = {"gemmtune": lambda: kernel(*inputs.operands)} | ({} if refused else {"cublas": theirs})
    if p.scaled:  # what the fp8 product is measured against besides: the same GEMM in its output dtype
        fns["unscaled"] = unscaled_call(p, inputs)
    timings = timing.measure(fns, device, budget_ms=budget_ms, min_rounds=rounds)
    mine, ref = timings["gemmtune"], timings.get("cublas")
    row = {
        "name": named.name, "group": named.group, "m": p.m, "n": p.n, "k": p.k, "dtype": p.dtype, "tf32": p.tf32,
        "layout": p.layout, "bias": p.bias, "activation": p.activation, "cublas_refused": refused,
        "cublas_ms": ref and ref.median, "gemmtune_ms": mine.median, "speedup": ref and ref.median / mine.median,
        "noise": ref and mine.spread_against(ref), "cublas_spread": ref and ref.spread, "gemmtune_spread": mine.spread,
        "choice": result.label(), "rel_err": verdict.rel_err, "verified": verdict.ok,
        "tflops": p.flops / (mine.median * 1e-3) / 1e12, "tbps": p.min_bytes / (mine.median * 1e-3) / 1e12,
        "inductor_ms": None, "inductor_tune_s": None, "inductor_cublas_ms": None,
    }
    if p.scaled:
        row |= {"scaling": p.scaling, "out_dtype": p.out_dtype, "unscaled_ms": timings["unscaled"].median}
    if inductor and not device.interpreter and not refused:
        fast, seconds = compiled(theirs)
        paired = timing.measure({"cublas": theirs, "inductor": fast}, device, budget_ms=budget_ms / 2,
                               min_rounds=max(rounds // 2, 1))
        row |= {"inductor_ms": paired["inductor"].median, "inductor_tune_s": seconds,
                "inductor_cublas_ms": paired["cublas"].median}
    return row


def document(rows: list[dict], device: Device) -> dict:
    """A suite file of ``rows`` measured on ``device`` (what ``gemmtune report`` reads)."""
    import datetime

    import triton

    from gemmtune.version import __version__

    return {"kind": "suite", "device": device.name, "sm_count": device.sm_count, "torch": torch.__version__,
            "triton": triton.__version__, "gemmtune": __version__, "date": datetime.date.today().isoformat(),
            "gpu_timings": not device.interpreter, "rows": rows}
