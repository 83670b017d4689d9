"""odd-4k and odd-2k: does cuBLAS stay fast with aligned (padded) operands when only the output's
rows are odd (ldc 4097)? If it did, ``cublas_padded`` could write its result in place and skip the
copy that cuts it out of the padded product. Times cuBLAS on the raw operands, on the padded ones,
on the padded ones into the odd-strided output, and both whole paths, each result verified.

    PYTHONPATH=src python3 benchmarks/padded_ldc.py OUT.json
"""
from __future__ import annotations

import json
import sys

import torch

from gemmtune.tuning import measure, verify
from gemmtune.backends.cublas_padded import copy_padded
from gemmtune.device import current
from gemmtune.problem import Problem

def main() -> None:
    dev = current()
    res = {"device": torch.cuda.get_device_name(), "sm_count": dev.sm_count, "rows": []}
    for name, (m, n, k) in {"odd-4k": (4095, 4097, 4095), "odd-2k": (2047, 2049, 2047)}.items():
        p = Problem(m, n, k, "bfloat16", "nn")
        inputs = verify.make_inputs(p, "cuda")
        a, b = inputs.a, inputs.b
        kp = (k + 7) // 8 * 8
        for npad in (n + 7) // 8 * 8, (n + 63) // 64 * 64:
            a_p = copy_padded(a, m, kp)
            b_p = copy_padded(b, kp, npad)
            c = torch.empty(m, n, dtype=a.dtype, device="cuda")
            full = torch.empty(m, npad, dtype=a.dtype, device="cuda")
            fns = {
                "cublas_raw": lambda: torch.mm(a, b),
                "mm_padded_only": lambda: torch.mm(a_p, b_p, out=full),
                "mm_odd_ldc_only": lambda: torch.mm(a_p, b_p[:, :n], out=c),
                "path_now": lambda: copy_padded(torch.mm(copy_padded(a, m, kp), copy_padded(b, kp, npad)), m, n),
                "path_odd_ldc": lambda: torch.mm(copy_padded(a, m, kp), copy_padded(b, kp, npad)[:, :n]),
            }
            errs = {}
            for lab in ("mm_odd_ldc_only", "path_now", "path_odd_ldc"):
                got = fns[lab]()
                errs[lab] = verify.rel_err(got, inputs.reference)
                if lab == "path_odd_ldc":
                    errs["path_odd_ldc_contiguous"] = got.is_contiguous()
            t = measure.measure(fns, dev, budget_ms=1500, min_rounds=30)
            row = {"name": name, "n_padded": npad, "ms": {k2: v.median for k2, v in t.items()}, "errs": errs}
            res["rows"].append(row)
            print(name, npad, {k2: round(v.median * 1e3, 1) for k2, v in t.items()}, errs, flush=True)
    json.dump(res, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
