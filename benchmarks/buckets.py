"""Bucket validation report: for each shape of a shapes file, the config tuned for its bucket's
representative measured on shapes sampled from the bucket beside each sample's own tuned config
(``gemmtune.tuning.buckets.validate``). Writes a JSON report with the device and a loss summary.

    PYTHONPATH=src python3 benchmarks/buckets.py --out buckets.json [--policy pow2] [--samples 2]

GPU only, like the suite: the losses are GPU timings.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

import gemmtune
from gemmtune import shapes
from gemmtune.tuning import buckets
from gemmtune.device import current
from gemmtune.problem import BUCKETS
from gemmtune.tuning.tuner import TuneOptions
from gemmtune.tuning.worker import IsolatedRunner

ROOT = Path(__file__).resolve().parent


def summary(rows: list[dict]) -> dict:
    losses = [r["loss"] for r in rows if r["loss"] is not None]
    return {"checks": len(rows), "cannot_run": len(rows) - len(losses),
            "median_loss": statistics.median(losses) if losses else None,
            "max_loss": max(losses) if losses else None,
            "within_2pct": sum(loss <= 0.02 for loss in losses)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=Path, default=ROOT / "shapes" / "public.json")
    parser.add_argument("--groups", nargs="*", default=["decode", "prefill"], help="shape groups to validate")
    parser.add_argument("--policy", default="pow2", choices=[b for b in BUCKETS if b != "exact"])
    parser.add_argument("--samples", type=int, default=2, help="shapes sampled per bucket")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("buckets.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.set_float32_matmul_precision("high")
    device = current()
    named = [n for n in shapes.load(args.shapes, tf32=True) if n.group in args.groups]
    doc = {"kind": "bucket_validation", "device": device.name, "torch": torch.__version__,
           "triton": triton.__version__, "gemmtune": gemmtune.__version__,
           "date": datetime.date.today().isoformat(), "policy": args.policy, "samples": args.samples, "rows": []}
    with IsolatedRunner(device) as runner:
        for item in named:
            t0 = time.perf_counter()
            for check in buckets.validate(item.problem, args.policy, args.samples, device, options=TuneOptions(),
                                          runner=runner):
                doc["rows"].append(check.as_dict(item.name))
                loss = "cannot run" if check.loss is None else f"{check.loss:+.1%}"
                print(f"{item.name:24s} {check.sample.describe():28s} loss {loss}", flush=True)
            print(f"{item.name:24s} done in {time.perf_counter() - t0:.1f} s", flush=True)
            doc["summary"] = summary(doc["rows"])
            args.out.write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc.get("summary", {})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
