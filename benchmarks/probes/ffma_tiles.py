"""Probe: which ``triton_tiled`` configs run float32 products fastest without TF32 (``ieee``: FMAs
on the CUDA cores, no tensor cores), where the cost model ranks as for the tensor cores.

For each problem, a grid of tiles (BLOCK_M and BLOCK_N of 32-128, BLOCK_K of 16-64, 4 or 8
warps, 2-4 stages; those the device's shared memory and the registers take), with the
backend's own space besides, is compiled ahead, verified, and screened beside cuBLAS (the
screening's ratio to cuBLAS in the same rounds); the fastest screened are then timed again side
by side with cuBLAS. Each config's row says the cost model's prediction and whether the tuner's
plan (its first ``DEFAULT_TOPK``) holds it. Written as JSON, one line per problem logged.

    PYTHONPATH=src python3 benchmarks/probes/ffma_tiles.py OUT.json [--quick]
"""
import argparse
import itertools
import json
import logging
import time

import torch

from gemmtune import backends
from gemmtune.backends import triton_tiled
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.tuning.runner import LocalRunner
from gemmtune.tuning.tuner import TuneOptions, _planned

PROBLEMS = (
    Problem(128, 128, 64, "float32", "nn", batch=384),  # BERT-base's attention scores, 32 x 12 heads
    Problem(128, 64, 128, "float32", "nn", batch=384),  # and its weighted values
    Problem(197, 197, 64, "float32", "nn", batch=96),  # a ViT-B's scores at batch 8
    Problem(4096, 768, 768, "float32", "linear", bias=True),
    Problem(4096, 3072, 768, "float32", "linear", bias=True),
    Problem(256, 1024, 1024, "float32", "linear", bias=True),
    Problem(2048, 2048, 2048, "float32", "nn"),
)
FINALISTS = 12
log = logging.getLogger("ffma_tiles")


def grid(problem: Problem, device) -> list[triton_tiled.TiledConfig]:
    """The probe's tiles, with the backend's own space, that the device and problem take."""
    own = triton_tiled.space(problem, device)
    configs = list(own)
    for bm, bn, bk, warps, stages in itertools.product((32, 64, 128), (32, 64, 128), (16, 32, 64), (4, 8), (2, 3, 4)):
        config = triton_tiled.TiledConfig(bm, bn, bk, 8, warps, stages)
        if config in configs or config.smem_bytes(problem.element_size) > device.smem_per_block:
            continue
        if config.acc_regs_per_thread() > triton_tiled.MAX_ACC_REGS or bk > max(16, triton_tiled.next_pow2(problem.k)):
            continue
        configs.append(config)
    return configs


def probe(problem: Problem, device) -> dict:
    started = time.perf_counter()
    configs = grid(problem, device)
    planned = set(_planned("triton_tiled", triton_tiled.space(problem, device), problem, device, TuneOptions()))
    runner = LocalRunner(device)
    runner.start(problem, seed=1)
    compiled = runner.compile([("triton_tiled", c.as_dict()) for c in configs])
    compile_s = time.perf_counter() - started
    rows = {}
    for config in configs:
        trial = runner.evaluate("triton_tiled", config.as_dict(), TuneOptions().screen_budget_ms)
        rows[trial.label()] = {"config": config.as_dict(), "ok": trial.ok, "reason": trial.reason,
                               "screen_vs_cublas": trial.vs_reference, "screen_ms": trial.median_ms,
                               "predicted_ms": backends.get("triton_tiled").predict_ms(problem, device, config),
                               "in_space": config in triton_tiled.space(problem, device),
                               "planned": config in planned}
    ranked = sorted((r for r in rows.values() if r["ok"] and r["screen_vs_cublas"] is not None),
                    key=lambda r: r["screen_vs_cublas"])[:FINALISTS]
    final = runner.final([("cublas", {})] + [("triton_tiled", r["config"]) for r in ranked],
                         TuneOptions().final_budget_ms * 2, 15)
    cublas = final.get("cublas")
    for label, (timing, *_rest, reason) in final.items():
        if label in rows:
            rows[label]["final_ms"] = timing.median
            rows[label]["final_vs_cublas"] = timing.median / cublas[0].median if cublas else None
    best = min((r for r in rows.values() if "final_vs_cublas" in r), key=lambda r: r["final_vs_cublas"], default=None)
    best_planned = min((r for r in rows.values() if r["planned"] and r.get("screen_vs_cublas") is not None),
                       key=lambda r: r["screen_vs_cublas"], default=None)
    return {"problem": problem.describe(), "key": problem.key(), "configs": len(configs), "compiled": len(compiled),
            "compile_s": compile_s, "probe_s": time.perf_counter() - started,
            "cublas_ms": cublas[0].median if cublas else None, "best": best, "best_planned": best_planned,
            "rows": list(rows.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--quick", action="store_true", help="the first two problems only")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.backends.cuda.matmul.allow_tf32 = False
    device = current(0)
    results = []
    for problem in PROBLEMS[:2] if args.quick else PROBLEMS:
        result = probe(problem, device)
        results.append(result)
        best, planned = result["best"], result["best_planned"]
        log.info("%s: %d configs in %.1f s; best %s at %.3f of cuBLAS; best planned %s at %.3f (screened)",
                 result["problem"], result["configs"], result["probe_s"], best and best["config"],
                 best["final_vs_cublas"] if best else float("nan"), planned and planned["config"],
                 planned["screen_vs_cublas"] if planned else float("nan"))
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
