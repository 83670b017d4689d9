"""Decode rows in depth: every config of the small-M spaces measured (strategy exhaustive), each
with the cost model's prediction beside it, against the device's copy and read bandwidth and
inductor max-autotune, in one process. The data the decode kernels and their cost model are
judged and fitted on.

    PYTHONPATH=src python3 benchmarks/decode.py --out decode.json [--only NAME ...] [--inductor]

GPU only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton

import gemmtune
from gemmtune import backends, bench, shapes, verify
from gemmtune.device import current
from gemmtune.tuner import TuneOptions, tune_problem
from gemmtune.worker import IsolatedRunner
from suite import ROOT, bound, copy_tbps, inductor, operands, read_tbps

BACKENDS = ("cublas", "triton_splitk", "triton_tiled")


def trial_rows(result, problem, device) -> list[dict]:
    rows = []
    for t in result.trials:
        predicted = None
        if t.backend != "cublas" and t.timing:
            backend = backends.get(t.backend)
            predicted = backend.predict_ms(problem, device, backend.parse_config(t.config))
        rows.append({"backend": t.backend, "config": t.config, "status": t.status.value, "ms": t.median_ms,
                     "spread": t.timing.spread if t.timing else None, "predicted_ms": predicted,
                     "weight_tbps": problem.n * problem.k * problem.element_size / (t.median_ms * 1e9)
                     if t.timing else None})
    return rows


def run_shape(named, runner, with_inductor: bool) -> dict:
    p, device = named.problem, current()
    options = TuneOptions(strategy="exhaustive", backends=BACKENDS)
    result = tune_problem(p, device, options=options, runner=runner)
    inputs = verify.make_inputs(p, "cuda")
    fns = {"cublas": operands(named, inputs)[0], "best": bound(result, p, inputs)}
    inductor_s = None
    if with_inductor:
        fns["inductor"], inductor_s = inductor(fns["cublas"])
    timings = bench.measure(fns, device, budget_ms=1000, min_rounds=50)
    weights = p.n * p.k * p.element_size
    return {"name": named.name, "m": p.m, "n": p.n, "k": p.k, "dtype": p.dtype,
            "best": result.label(), "tune_s": result.tune_s, "inductor_tune_s": inductor_s,
            **{f"{name}_ms": t.median for name, t in timings.items()},
            **{f"{name}_weight_tbps": weights / (t.median * 1e9) for name, t in timings.items()},
            "trials": trial_rows(result, p, device)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=Path, default=ROOT / "shapes" / "public.json")
    parser.add_argument("--only", nargs="*", default=None, help="names of shapes to run (default: group decode)")
    parser.add_argument("--inductor", action="store_true", help="also torch.compile(mode='max-autotune-no-cudagraphs')")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("decode.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = current()
    named = [n for n in shapes.load(args.shapes, tf32=True)
             if (n.name in args.only if args.only else n.group == "decode")]
    doc = {"kind": "decode", "device": device.name, "sm_count": device.sm_count, "torch": torch.__version__,
           "triton": triton.__version__, "gemmtune": gemmtune.__version__,
           "date": datetime.date.today().isoformat(), "copy_tbps": copy_tbps(), "read_tbps": read_tbps(), "rows": []}
    print(f"copy {doc['copy_tbps']:.2f} TB/s (read + written), read {doc['read_tbps']:.2f} TB/s", flush=True)
    with IsolatedRunner(device) as runner, torch.no_grad():
        for item in named:
            row = run_shape(item, runner, args.inductor)
            doc["rows"].append(row)
            args.out.write_text(json.dumps(doc, indent=1))
            ind = f" inductor {row['inductor_ms'] * 1e3:.1f} us" if "inductor_ms" in row else ""
            print(f"{item.name:24s} cublas {row['cublas_ms'] * 1e3:.1f} us ({row['cublas_weight_tbps']:.2f} TB/s) "
                  f"best {row['best_ms'] * 1e3:.1f} us ({row['best_weight_tbps']:.2f} TB/s){ind} {row['best']}",
                  flush=True)
            for t in sorted((t for t in row["trials"] if t["ms"]), key=lambda t: t["ms"])[:5]:
                print(f"    {t['ms'] * 1e3:7.1f} us  predicted {t['predicted_ms'] and t['predicted_ms'] * 1e3 or 0:6.1f}"
                      f"  {t['backend']} {t['config']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
