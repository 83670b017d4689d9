"""Probe: whether triton_tiled's space holds its best tiles now that K is a constant of the binary
(docs/performance.md, open question 12: its tiles and stages were chosen with the slower kernel).

Per product, every config of a wide grid (BLOCK_M and BLOCK_N 64-256, BLOCK_K 32-128, 4 or 8
warps, 2-5 stages, each fitting the device's shared memory and 128 accumulator registers a
thread) is compiled, checked against a float64 product and timed beside cuBLAS (torch's product
of the layer without its activation) and gemmtune's tuned choice (with it), each replayed in a CUDA graph over weight copies that pass the L2 twice, in one set
of interleaved rounds (a new order each round). Recorded per config: its ratio to cuBLAS (below
1: faster), whether the current space holds it, and the cost model's prediction (its rank among
the space's configs is what the tuner's top-k screens).

    PYTHONPATH=src python3 benchmarks/probes/tiled_space.py OUT.json [--problems KEY,...] [--rounds 15]
"""
import argparse
import itertools
import logging
import sys
import tempfile
import time
from pathlib import Path

import gemmtune
from gemmtune import activation, backends
from gemmtune.backends.triton_tiled import BACKEND, MAX_ACC_REGS, TiledConfig, space
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.store import open_store
from gemmtune.tuning.compiler import compile_ahead

sys.path.insert(0, str(Path(__file__).resolve().parent))
from template_time import L2_PASSES, graphed, library_call, operands, rounds, write_result  # noqa: E402

log = logging.getLogger("tiled_space")
# Layers of models no list of this project's benchmarks names at serving batches, the Llama's
# prefill, sizes no power of two divides, half precision
DEFAULT = (Problem(4096, 3072, 768, bias=True, activation="gelu"), Problem(12608, 2304, 768, bias=True),
           Problem(1576, 384, 1536, bias=True), Problem(2048, 6144, 4096), Problem(2048, 4096, 14336),
           Problem(1024, 1024, 1024), Problem(4095, 4095, 4095, "float16"), Problem(3000, 5120, 1280, bias=True))
GRID = dict(block_m=(64, 128, 256), block_n=(64, 128, 256), block_k=(32, 64, 128), num_warps=(4, 8),
            num_stages=(2, 3, 4, 5))


def wide(problem: Problem) -> list[TiledConfig]:
    """GRID's configs that fit the device's shared memory and the accumulator registers."""
    device = current()
    configs = [TiledConfig(bm, bn, bk, 8, w, s) for bm, bn, bk, w, s in itertools.product(*GRID.values())]
    return [c for c in configs if c.smem_bytes(problem.element_size) <= device.smem_per_block
            and c.acc_regs_per_thread() <= MAX_ACC_REGS]


def largest_error(call, a, b, bias, want) -> float:
    """``call``'s largest error against ``want`` (float64), over the reference's largest value."""
    return float((call(a, b, bias).double() - want).abs().max() / want.abs().max())


def probe(problem: Problem, count: int) -> dict:
    device = current()
    store = open_store(tempfile.mkdtemp(prefix="gemmtune-probe-"))
    result = gemmtune.tune(problem, store=store, retune=True)[0]
    in_space = {c.key() for c in space(problem, device)}
    configs = wide(problem)
    configs += [c for c in space(problem, device) if c.key() not in {w.key() for w in configs}]
    copies = max(1, -(-L2_PASSES * device.l2_bytes // (problem.n * problem.k * problem.element_size)))
    a, weights, bias = operands(problem, copies)
    started = time.perf_counter()
    compile_ahead([(problem, "triton_tiled", c.as_dict(), (a, weights[0], bias)) for c in configs], device)
    compile_s = time.perf_counter() - started
    calls = {"cublas": library_call(problem),
             "choice": backends.build(problem, result.backend, result.config, device)}
    calls.update({c.key(): backends.build(problem, "triton_tiled", c.as_dict(), device) for c in configs})
    reference = library_call(problem)(a.double(), weights[0].double(), None if bias is None else bias.double())
    reference = activation.apply(reference, problem.activation)
    errors = {name: largest_error(call, a, weights[0], bias, reference) for name, call in calls.items()}
    graphs = {name: graphed(call, a, weights, bias) for name, call in calls.items()}
    timed = rounds(graphs, count)
    predicted = {c.key(): BACKEND.predict_ms(problem, device, c) for c in configs}
    ranked = sorted((k for k in predicted if k in in_space), key=predicted.get)
    rows = [{"config": c.key(), "in_space": c.key() in in_space, "rank": ranked.index(c.key()) if c.key() in in_space
             else None, "predicted_ms": predicted[c.key()], "error": errors[c.key()], **timed[c.key()]}
            for c in configs]
    rows.sort(key=lambda r: r["vs_cublas"])
    best_in_space = next((r for r in rows if r["in_space"]), None)
    return {"problem": problem.key(), "choice": result.label(), "choice_timed": timed["choice"],
            "choice_error": errors["choice"], "cublas_ms": timed["cublas"]["median_ms"], "copies": copies,
            "compile_s": compile_s, "configs": len(configs), "space": len(in_space),
            "best": rows[0], "best_in_space": best_in_space, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the JSON file to write")
    parser.add_argument("--problems", default=",".join(p.key() for p in DEFAULT),
                        help="gemmtune problem keys, comma-separated")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    found = []
    for key in args.problems.split(","):
        found.append(probe(Problem.from_key(key), args.rounds))
        row = found[-1]
        log.info("%s: choice %s %.3f; best %s %.3f; best in space %s %.3f (rank %s of %d); %d configs, compiled in "
                 "%.1f s", row["problem"], row["choice"], row["choice_timed"]["vs_cublas"], row["best"]["config"],
                 row["best"]["vs_cublas"], row["best_in_space"]["config"], row["best_in_space"]["vs_cublas"],
                 row["best_in_space"]["rank"], row["space"], row["configs"], row["compile_s"])
        write_result(args.out, "tiled-space", found, grid=GRID)


if __name__ == "__main__":
    main()
