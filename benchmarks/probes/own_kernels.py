"""Probe: what gemmtune's own Triton kernels read against cuBLAS when each product is tuned, and
what the tuner then chooses, over products of models no benchmark list names and the Llama's
prefill and decode rows (docs/performance.md, a compile-time K). Each product is tuned once from
an empty store; recorded are the choice, its time against cuBLAS's, the tuning's seconds and,
per Triton backend, its fastest trial's ratio to cuBLAS in the same rounds (below 1: faster than
cuBLAS). Run it on two versions of the code, each with an empty Triton cache, and compare the
two files row by row: the ratios, not the times, are comparable across the two processes.

    TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=src python3 benchmarks/probes/own_kernels.py OUT.json [--only N]
"""
import argparse
import json
import logging
import tempfile
import time

import torch

import gemmtune
from gemmtune.problem import Problem
from gemmtune.store import open_store

log = logging.getLogger("own_kernels")

# BERT/ViT/T5/GPT-style layers at a serving batch, decode rows, sizes no power of two divides,
# half precision, float32 with and without TF32, attention's batched products
PRODUCTS = (
    Problem(4096, 768, 768, bias=True), Problem(4096, 3072, 768, bias=True, activation="gelu"),
    Problem(4096, 768, 3072, bias=True), Problem(12608, 2304, 768, bias=True), Problem(1576, 384, 1536, bias=True),
    Problem(1024, 1024, 1024), Problem(256, 4096, 4096), Problem(16, 4096, 4096), Problem(1, 4096, 4096),
    Problem(33, 1536, 384, bias=True), Problem(1000, 1000, 1000), Problem(4095, 4095, 4095, "float16"),
    Problem(2048, 2048, 2048, "float16", "nn"), Problem(512, 512, 512, "float32", tf32=True),
    Problem(256, 1024, 1024, "float32", tf32=False), Problem(128, 128, 64, "bfloat16", "nn", batch=384),
    Problem(128, 64, 128, "bfloat16", "nn", batch=384),
    # the Llama-3-8B's layers: prefill, then decode at 16 rows
    Problem(2048, 6144, 4096), Problem(2048, 28672, 4096), Problem(2048, 4096, 14336), Problem(8192, 6144, 4096),
    Problem(16, 6144, 4096), Problem(16, 4096, 14336), Problem(64, 28672, 4096),
)
OWN = ("triton_tiled", "triton_persistent", "triton_stream", "triton_splitk")


def tuned(problem: Problem) -> dict:
    store = open_store(tempfile.mkdtemp(prefix="gemmtune-probe-"))
    result = gemmtune.tune(problem, store=store, retune=True)[0]
    best = {}
    for backend in OWN:
        trials = [t for t in result.trials if t.backend == backend and t.vs_reference]
        if trials:
            fastest = min(trials, key=lambda t: t.vs_reference)
            best[backend] = {"config": fastest.config, "vs_cublas": fastest.vs_reference, "final": fastest.final,
                             "trials": len(trials)}
    return {"problem": problem.key(), "choice": result.label(), "vs_cublas": result.time_ms / result.cublas_ms,
            "tune_s": result.tune_s, "best": best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the JSON file to write")
    parser.add_argument("--only", type=int, default=len(PRODUCTS), help="the first N products alone")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    rows = []
    for problem in PRODUCTS[:args.only]:
        rows.append(tuned(problem))
        log.info("%s", json.dumps(rows[-1]))
    with open(args.out, "w") as f:
        json.dump({"kind": "own-kernels", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
