"""Host time of the padded paths' copies: what a decode-sized call through ``copy_padded``, the
``cublas_padded`` kernel and a misaligned ``AlignedLinear`` layer costs the host, against
``F.linear`` on the same operands (calls queued back to back, timed to the last launch:
``measure.host_times``), and the GPU time of each beside it.

    PYTHONPATH=src python3 benchmarks/padded_host.py OUT.json
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from torch import nn

import gemmtune
from gemmtune.tuning import measure
from gemmtune.backends.cublas_padded import CublasPaddedBackend, PaddedConfig, copy_padded
from gemmtune.device import current
from gemmtune.problem import Problem

CASES = {  # name: (m, n, k)
    "K odd, 1 row": (1, 4096, 4100),
    "N odd, 1 row": (1, 4100, 4096),
    "GPT-2 head, 1 row": (1, 50257, 768),
    "K odd, 16 rows": (16, 4096, 4100),
}


def host_us(fn, dev) -> float:
    """The host's own time per call, up to its last launch (the fastest of five loops)."""
    return 1e3 * measure.host_times(fn, dev, calls=200, repeats=5)[1]


def main() -> None:
    dev = current()
    rows = []
    for name, (m, n, k) in CASES.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        padded = CublasPaddedBackend().build(Problem(m, n, k), PaddedConfig(8), dev)
        layer = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            layer.weight.copy_(w)
        gemmtune.optimize(layer)  # an AlignedLinear: its weight kept padded
        ways = {"F.linear": lambda: F.linear(x, w),
                "copy_padded (x to aligned K)": lambda: copy_padded(x, m, -(-k // 8) * 8),
                "cublas_padded kernel": lambda: padded(x, w, None),
                "AlignedLinear, padded path": lambda: layer.aligned.padded(layer, x)}
        with torch.no_grad():
            ref = F.linear(x.double(), w.double())
            errs = {label: float((fn().double() - ref).norm() / ref.norm()) for label, fn in ways.items()
                    if label.startswith(("cublas", "Aligned"))}
            host = {label: host_us(fn, dev) for label, fn in ways.items()}
            gpu = measure.measure(ways, dev, budget_ms=300, min_rounds=20)
        for label in ways:
            rows.append({"case": name, "m": m, "n": n, "k": k, "way": label, "host_us": host[label],
                         "gpu_us": gpu[label].median * 1e3, "rel_err": errs.get(label)})
            print(f"{name:18s} {label:30s} host {host[label]:6.1f} us  GPU {gpu[label].median * 1e3:7.2f} us"
                  + (f"  err {errs[label]:.1e}" if label in errs else ""), flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
