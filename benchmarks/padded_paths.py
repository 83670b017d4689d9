"""Which copies does a misaligned GEMM really need? Times, side by side with the path
``cublas_padded`` takes today (copy every operand into zero-padded buffers, cut the result out):

- K odd, N aligned (odd-k.linear, 2048x4096x4100): cuBLAS on operands whose rows are only
  re-strided to 16-byte multiples, K left as it is (no zeros), with the weight stored that way
  once (a parameter) and only x copied per call;
- N odd, K aligned (a GPT-2-sized head, 50257 outputs of 768): the weight's rows are aligned
  already; cuBLAS writing into the first N columns of a padded output (``out=`` a view), then
  the cut, against copying the weight every call;
- odd-4k (nn): both operands re-strided without zero padding.

Each path's result is checked against the float64 reference.

    PYTHONPATH=src python3 benchmarks/padded_paths.py OUT.json
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from gemmtune.tuning import measure, verify
from gemmtune.backends.cublas_padded import PaddedConfig, PaddedKernel, copy_padded
from gemmtune.device import current
from gemmtune.problem import Problem


def restrided(t: torch.Tensor, step: int = 8) -> torch.Tensor:
    """``t``'s values in a buffer whose rows start every multiple of ``step`` elements; K kept."""
    rows, cols = t.shape
    buf = torch.empty(rows, -(-cols // step) * step, dtype=t.dtype, device=t.device)
    view = buf[:, :cols]
    view.copy_(t)
    return view


def into_padded(rows: int, cols: int, like: torch.Tensor, step: int = 8) -> torch.Tensor:
    return torch.empty(rows, -(-cols // step) * step, dtype=like.dtype, device=like.device)[:, :cols]


def k_odd_linear(m: int, n: int, k: int) -> dict:
    p = Problem(m, n, k, "bfloat16", "linear")
    inp = verify.make_inputs(p, "cuda")
    x, w = inp.a, inp.b
    w_param = restrided(w)  # stored once, as a re-strided parameter would be
    xbuf = into_padded(m, k, x)
    now8, now64 = PaddedKernel(p, PaddedConfig(8)), PaddedKernel(p, PaddedConfig(64))

    def x_copied_w_param():
        copy_padded(x, m, xbuf.stride(0), out=xbuf.as_strided((m, xbuf.stride(0)), (xbuf.stride(0), 1)))
        return F.linear(xbuf, w_param)

    fns = {
        "cublas_raw": lambda: F.linear(x, w),
        "padded_now_8": lambda: now8(x, w, None),
        "padded_now_64": lambda: now64(x, w, None),
        "gemm_restrided_only": lambda: F.linear(xbuf, w_param),
        "x_copied_w_param": x_copied_w_param,
    }
    return _time(p, inp, fns)


def n_odd_linear(m: int, n: int, k: int) -> dict:
    p = Problem(m, n, k, "bfloat16", "linear")
    inp = verify.make_inputs(p, "cuda")
    x, w = inp.a, inp.b
    now8 = PaddedKernel(p, PaddedConfig(8))
    full = torch.empty(m, -(-n // 8) * 8, dtype=x.dtype, device="cuda")

    def out_view_then_cut():
        torch.mm(x, w.t(), out=full[:, :n])
        return copy_padded(full, m, n)

    def out_view_only():
        return torch.mm(x, w.t(), out=full[:, :n])

    fns = {
        "cublas_raw": lambda: F.linear(x, w),
        "padded_now_8": lambda: now8(x, w, None),
        "out_view_only": out_view_only,
        "out_view_then_cut": out_view_then_cut,
    }
    return _time(p, inp, fns)


def odd_nn(m: int, n: int, k: int) -> dict:
    p = Problem(m, n, k, "bfloat16", "nn")
    inp = verify.make_inputs(p, "cuda")
    a, b = inp.a, inp.b
    now64 = PaddedKernel(p, PaddedConfig(64))
    abuf, bbuf = into_padded(m, k, a), into_padded(k, n, b)
    full = torch.empty(m, -(-n // 8) * 8, dtype=a.dtype, device="cuda")

    def restrided_all():
        copy_padded(a, m, abuf.stride(0), out=abuf.as_strided((m, abuf.stride(0)), (abuf.stride(0), 1)))
        copy_padded(b, k, bbuf.stride(0), out=bbuf.as_strided((k, bbuf.stride(0)), (bbuf.stride(0), 1)))
        torch.mm(abuf, bbuf, out=full[:, :n])
        return copy_padded(full, m, n)

    fns = {
        "cublas_raw": lambda: torch.mm(a, b),
        "padded_now_64": lambda: now64(a, b, None),
        "restrided_all": restrided_all,
    }
    return _time(p, inp, fns)


def _time(p: Problem, inp, fns) -> dict:
    errs = {}
    for label, fn in fns.items():
        got = fn()
        errs[label] = verify.rel_err(got, inp.reference)
    t = measure.measure(fns, current(), budget_ms=1500, min_rounds=30)
    row = {"shape": p.describe(), "ms": {k: v.median for k, v in t.items()},
           "spread": {k: v.spread for k, v in t.items()}, "rel_err": errs}
    print(row["shape"], {k: round(v * 1e3, 1) for k, v in row["ms"].items()},
          {k: f"{v:.1e}" for k, v in errs.items()}, flush=True)
    return row


def main() -> None:
    dev = current()
    res = {"device": torch.cuda.get_device_name(), "sm_count": dev.sm_count, "rows": [
        k_odd_linear(2048, 4096, 4100),
        k_odd_linear(16, 4096, 4100),
        n_odd_linear(2048, 50257, 768),
        n_odd_linear(16, 50257, 768),
        odd_nn(4095, 4097, 4095),
    ]}
    json.dump(res, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
