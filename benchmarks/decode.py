"""Decode rows in depth: every config of the small-M spaces measured (strategy exhaustive), each
with the cost model's prediction beside it, against the device's copy and read bandwidth and
inductor max-autotune, in one process. The data the decode kernels and their cost model are
judged and fitted on.

    PYTHONPATH=src python3 benchmarks/decode.py --out decode.json [--only NAME ...] [--inductor] [--sweep]
        [--inductor-code DIR]

``--sweep`` also measures a wide grid of configs beyond the tuner's space (``sweep``: split-K
programs for decode rows, ``tile_sweep``'s tiled, persistent and split-K tiles for the small
compute-bound rows named with ``--only``): the data a change of a space is decided on.

GPU only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import triton

import gemmtune
from gemmtune import backends, shapes
from gemmtune.tuning import measure, verify
from gemmtune.backends.triton_persistent import PersistentConfig
from gemmtune.backends.triton_splitk import SplitKConfig
from gemmtune.backends.triton_stream import StreamConfig
from gemmtune.backends.triton_tiled import TiledConfig
from gemmtune.device import current
from gemmtune.tuning.tuner import TuneOptions, tune_problem
from gemmtune.tuning.worker import IsolatedRunner
from suite import ROOT, bound, copy_tbps, inductor, operands, read_tbps

BACKENDS = ("cublas", "triton_splitk", "triton_stream", "triton_tiled", "triton_persistent", "cublas_padded")


def sweep(p, device) -> list[tuple[str, dict]]:
    """(backend, config) pairs for one row beyond the tuner's space.

    M = 1: FMA programs of 1 to 16 weight rows, K steps up to 4096, 2 to 16 warps, each thread
    loading 8 to 128 elements a step, loaded straight into registers or through a 2- to 4-stage
    pipeline. M up to 64: tensor-core programs 16 to 128 columns wide on 2 or 4 warps, with and
    without a pipeline, one to four splits, that fill ``device``'s SMs and fit in its shared
    memory. Larger M (the small compute-bound rows): ``tile_sweep``."""
    configs = []
    if p.m > 64:
        return tile_sweep(p, device)
    if p.m == 1:
        for bn in (1, 2, 4, 8, 16):
            for bk in (512, 1024, 2048, 4096):
                for warps in (2, 4, 8, 16):
                    per_thread = bn * bk // (32 * warps)
                    if bk <= p.k and 8 <= per_thread <= 128:
                        configs.append(SplitKConfig(1, bn, bk, 1, False, warps, 1))
        # and through Triton's software pipeline (weights staged in shared memory)
        for stages in (2, 3, 4):
            for bn in (2, 4, 8, 16):
                for bk in (256, 512, 1024):
                    for warps in (2, 4):
                        if 8 <= bn * bk // (32 * warps) <= 128 and p.k >= stages * bk:
                            configs.append(SplitKConfig(1, bn, bk, 1, False, warps, stages))
    else:
        bm = max(16, 1 << (p.m - 1).bit_length())
        for bn in (16, 32, 64, 128):
            for bk in (128, 256, 512):
                for warps in (2, 4):
                    for stages in (1, 3, 5):
                        for split in (1, 2, 4):
                            c = SplitKConfig(bm, bn, bk, split, True, warps, stages)
                            programs = c.programs(p)
                            if (bn * bm >= 16 * 8 * warps and p.k >= split * bk * max(1, stages - 1)
                                    and c.smem_bytes(p.element_size) <= device.smem_per_block
                                    and device.sm_count <= programs and (split == 1 or programs <= 8 * device.sm_count)):
                                configs.append(c)
    return [("triton_splitk", c.as_dict()) for c in configs] + stream_sweep(p, device)


def stream_sweep(p, device) -> list[tuple[str, dict]]:
    """TMA decode programs (Hopper, aligned rows, M from 2): 64- or 128-row weight tiles on the
    warpgroup MMA's wide side, K steps of 64 to 256, 3 to 8 stages, within shared memory. (The
    first sweep, stream-sweep-h200-20261122.json, also tried 16- and 32-row tiles, the MMA in
    the other orientation and 1 to 4 programs per SM: none of those led a row.)"""
    if not (device.is_hopper and p.rows_aligned and 2 <= p.m <= 64):
        return []
    bm = max(16, 1 << (p.m - 1).bit_length())
    out = []
    for bn in (64, 128):
        for bk in (64, 128, 256):
            for stages in (3, 4, 6, 8):
                c = StreamConfig(bm, bn, bk, 4, stages)
                if c.smem_bytes(p.element_size) <= device.smem_per_block and p.k >= bk * (stages - 1):
                    out.append(("triton_stream", c.as_dict()))
    return out


def tile_sweep(p, device) -> list[tuple[str, dict]]:
    """Small compute-bound rows (odd-1k, the seeds' MLP): where a launch and a few microseconds
    of work are the whole call, how small a tile, how deep a pipeline and how many splits of K
    pay. Tiled programs 32 to 128 rows by 32 to 256 columns on 4 or 8 warps, 3 to 5 stages;
    persistent TMA programs of 64 or 128 rows (Hopper, aligned rows); tensor-core split-K
    programs of 64 rows, K cut in 1 to 4."""
    out = []
    for bm in (32, 64, 128):
        for bn in (32, 64, 128, 256):
            for bk in (32, 64, 128):
                for warps in (4, 8):
                    for stages in (3, 4, 5):
                        c = TiledConfig(bm, bn, bk, 8, warps, stages)
                        if (c.smem_bytes(p.element_size) <= device.smem_per_block and bm * bn >= 16 * 8 * warps
                                and c.acc_regs_per_thread() <= 128 and bk <= max(32, p.k)):
                            out.append(("triton_tiled", c.as_dict()))
    if device.is_hopper and p.rows_aligned:
        for bm in (64, 128):
            for bn in (64, 128, 256):
                for bk in (64, 128):
                    for warps in (4, 8):
                        for stages in (3, 4):
                            for ws in (False, True):
                                c = PersistentConfig(bm, bn, bk, 8, warps, stages, ws)
                                if (c.smem_bytes(p.element_size) <= device.smem_per_block
                                        and bm * bn // (32 * warps) <= 128 and bm * bn >= 64 * 16 * warps):
                                    out.append(("triton_persistent", c.as_dict()))
    for bn in (32, 64, 128):
        for bk in (64, 128):
            for split in (1, 2, 4):
                c = SplitKConfig(64, bn, bk, split, True, 4, 3)
                if p.k >= split * bk * 2 and c.smem_bytes(p.element_size) <= device.smem_per_block:
                    out.append(("triton_splitk", c.as_dict()))
    return out


def run_sweep(p, device, runner) -> list:
    """Every config of ``sweep`` compiled ahead in parallel, then verified and screened."""
    candidates = sweep(p, device)
    runner.start(p, int.from_bytes(os.urandom(4), "little"))
    runner.compile(candidates)
    trials = [runner.evaluate(name, c, 6.0) for name, c in candidates]
    print(f"    sweep: {len(candidates)} configs, {sum(t.ok for t in trials)} verified and timed", flush=True)
    return trials


def trial_rows(trials, problem, device) -> list[dict]:
    rows = []
    for t in trials:
        predicted = None
        if t.backend != "cublas" and t.timing:
            backend = backends.get(t.backend)
            predicted = backend.predict_ms(problem, device, backend.parse_config(t.config))
        rows.append({"backend": t.backend, "config": t.config, "status": t.status.value, "ms": t.median_ms,
                     "spread": t.timing.spread if t.timing else None, "predicted_ms": predicted,
                     "weight_tbps": problem.n * problem.k * problem.element_size / (t.median_ms * 1e9)
                     if t.timing else None})
    return rows


def run_shape(named, runner, with_inductor: bool, with_sweep: bool, code_dir: Path | None = None) -> dict:
    p, device = named.problem, current()
    options = TuneOptions(strategy="exhaustive", backends=BACKENDS)
    result = tune_problem(p, device, options=options, runner=runner)
    swept = run_sweep(p, device, runner) if with_sweep else []
    inputs = verify.make_inputs(p, "cuda")
    fns = {"cublas": operands(named, inputs)[0], "best": bound(result, p, inputs)}
    best_swept = min((t for t in swept if t.ok), key=lambda t: t.median_ms, default=None)
    if best_swept is not None:
        fns["swept"] = bound(best_swept, p, inputs)
    inductor_s = None
    if with_inductor and code_dir is not None:  # the code inductor generated, kept beside the timings
        from torch._inductor.utils import run_and_get_code

        (fns["inductor"], inductor_s), sources = run_and_get_code(inductor, fns["cublas"])
        code_dir.mkdir(parents=True, exist_ok=True)
        (code_dir / f"{named.name}.py").write_text("\n\n# ---- next module ----\n\n".join(sources))
    elif with_inductor:
        fns["inductor"], inductor_s = inductor(fns["cublas"])
    timings = measure.measure(fns, device, budget_ms=1000, min_rounds=50)
    weights = p.n * p.k * p.element_size
    return {"name": named.name, "m": p.m, "n": p.n, "k": p.k, "dtype": p.dtype,
            "best": result.label(), "swept": best_swept.label() if best_swept else None,
            "tune_s": result.tune_s, "inductor_tune_s": inductor_s,
            **{f"{name}_ms": t.median for name, t in timings.items()},
            **{f"{name}_weight_tbps": weights / (t.median * 1e9) for name, t in timings.items()},
            "trials": trial_rows(result.trials, p, device), "sweep": trial_rows(swept, p, device)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=Path, default=ROOT / "shapes" / "public.json")
    parser.add_argument("--only", nargs="*", default=None, help="names of shapes to run (default: group decode)")
    parser.add_argument("--inductor", action="store_true", help="also torch.compile(mode='max-autotune-no-cudagraphs')")
    parser.add_argument("--sweep", action="store_true", help="also measure the wide grid of split-K configs (sweep)")
    parser.add_argument("--inductor-code", type=Path, default=None, metavar="DIR",
                        help="with --inductor: write the code inductor generates for each row to DIR/NAME.py")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("decode.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = current()
    torch.set_float32_matmul_precision("high")  # fp32 rows in TF32 for every column, as the suite times them
    named = [n for n in shapes.load(args.shapes, tf32=True)
             if (n.name in args.only if args.only else n.group == "decode")]
    doc = {"kind": "decode", "device": device.name, "sm_count": device.sm_count, "torch": torch.__version__,
           "triton": triton.__version__, "gemmtune": gemmtune.__version__,
           "date": datetime.date.today().isoformat(), "copy_tbps": copy_tbps(), "read_tbps": read_tbps(),
           "float32_matmul_precision": "high", "rows": []}
    print(f"copy {doc['copy_tbps']:.2f} TB/s (read + written), read {doc['read_tbps']:.2f} TB/s", flush=True)
    with IsolatedRunner(device) as runner, torch.no_grad():
        for item in named:
            row = run_shape(item, runner, args.inductor, args.sweep, args.inductor_code)
            doc["rows"].append(row)
            args.out.write_text(json.dumps(doc, indent=1))
            ind = f" inductor {row['inductor_ms'] * 1e3:.1f} us" if "inductor_ms" in row else ""
            if "swept_ms" in row:
                ind += f" swept {row['swept_ms'] * 1e3:.1f} us ({row['swept_weight_tbps']:.2f} TB/s) {row['swept']}"
            print(f"{item.name:24s} cublas {row['cublas_ms'] * 1e3:.1f} us ({row['cublas_weight_tbps']:.2f} TB/s) "
                  f"best {row['best_ms'] * 1e3:.1f} us ({row['best_weight_tbps']:.2f} TB/s){ind} {row['best']}",
                  flush=True)
            for t in sorted((t for t in row["trials"] + row["sweep"] if t["ms"]), key=lambda t: t["ms"])[:8]:
                print(f"    {t['ms'] * 1e3:7.1f} us  predicted {t['predicted_ms'] and t['predicted_ms'] * 1e3 or 0:6.1f}"
                      f"  {t['backend']} {t['config']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
