"""Probe: where a model's first tuning through ``gemmtune.optimize`` spends its seconds.

A timm model (bf16, random weights, inference) optimized on its example from an empty store and
compile caches, with gemmtune's debug log on (each problem's tuning, each batch compiled ahead,
each backend's candidates compiled together) written with timestamps to OUT.

    PYTHONPATH=src python3 benchmarks/probes/tune_log.py OUT.log [--model NAME] [--batch N]
"""
import argparse
import logging
import os
import tempfile
import time

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("out", help="the log file to write")
parser.add_argument("--model", default="vit_base_patch16_224", help="a timm model name")
parser.add_argument("--batch", type=int, default=64)
args = parser.parse_args()
os.environ.setdefault("GEMMTUNE_CACHE_DIR", tempfile.mkdtemp(prefix="gemmtune-probe-"))

import timm  # noqa: E402
import torch  # noqa: E402

import gemmtune  # noqa: E402

logging.basicConfig(filename=args.out, level=logging.DEBUG, format="%(relativeCreated)9.0f ms %(name)s %(message)s")
model = timm.create_model(args.model, pretrained=False).cuda().to(torch.bfloat16).eval()
example = torch.randn(args.batch, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
started = time.perf_counter()
gemmtune.optimize(model, (example,))
logging.getLogger("probe").info("optimize took %.1f s", time.perf_counter() - started)
