"""Misaligned nn.Linear layers, side by side: torch's layer (cuBLAS on the raw operands),
gemmtune's layer with its weight as given (``align=False``), and gemmtune's layer with the weight
stored padded (``gemmtune.nn.padded``) three ways: as the layer calls it (``layer``: the way its
first call of that many rows measured faster), always through the padded GEMM (only x copied),
and always as a plain layer on the padded parameter (its rows 16-byte aligned, K and N as they are). Each gemmtune layer is
tuned from an example first; each output is checked against float64.

    PYTHONPATH=src python3 benchmarks/aligned_layers.py OUT.json
"""
from __future__ import annotations

import copy
import json
import sys

import torch
from torch import nn

import gemmtune
from gemmtune.tuning import measure, verify
from gemmtune.device import current
from gemmtune import nn as gnn
from gemmtune.nn import tune_calls

LAYERS = {  # name: (in_features, out_features)
    "k-odd 4100->4096": (4100, 4096),
    "n-odd 4096->4100": (4096, 4100),
    "gpt2-head 768->50257": (768, 50257),
}
ROWS = (1, 16, 2048)


def main() -> None:
    dev = current()
    rows_out = []
    for name, (k, n) in LAYERS.items():
        torch.manual_seed(0)
        plain = nn.Linear(k, n, bias=False).to("cuda", torch.bfloat16)
        as_given = gemmtune.optimize(copy.deepcopy(plain), align=False)
        padded = gemmtune.optimize(copy.deepcopy(plain))
        reference = copy.deepcopy(plain).double()
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                tune_calls(lambda: (as_given(x), padded.aligned.padded(padded, x), gnn.Linear.forward(padded, x)))
                expected = reference(x.double())
                fns = {"torch": lambda: plain(x), "gemmtune_as_given": lambda: as_given(x),
                       "gemmtune_layer": lambda: padded(x),
                       "gemmtune_padded": lambda: padded.aligned.padded(padded, x),
                       "gemmtune_view": lambda: gnn.Linear.forward(padded, x)}
                errs = {label: verify.rel_err(fn(), expected) for label, fn in fns.items()}
                t = measure.measure(fns, dev, budget_ms=1200, min_rounds=30)
            ms = {label: v.median for label, v in t.items()}
            row = {"layer": name, "m": m, "ms": ms, "spread": {label: v.spread for label, v in t.items()},
                   "rel_err": errs, "padded_vs_torch": ms["torch"] / ms["gemmtune_padded"],
                   "padded_vs_as_given": ms["gemmtune_as_given"] / ms["gemmtune_padded"],
                   "layer_vs_as_given": ms["gemmtune_as_given"] / ms["gemmtune_layer"]}
            rows_out.append(row)
            print(f"{name:22s} m={m:5d}", {label: round(v * 1e3, 1) for label, v in ms.items()},
                  f"padded/as-given {row['padded_vs_as_given']:.2f}x, layer/as-given {row['layer_vs_as_given']:.2f}x",
                  {label: f"{e:.1e}" for label, e in errs.items()}, flush=True)
    json.dump({"kind": "aligned-layers", "device": torch.cuda.get_device_name(), "sm_count": dev.sm_count,
               "torch": torch.__version__, "note": "ms per call: medians of CUDA-event timings", "rows": rows_out},
              open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
