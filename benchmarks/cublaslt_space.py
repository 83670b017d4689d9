"""How much lies beyond cuBLASLt's eight ranked algorithms? For each row, every neighbour of the
eight (one configuration attribute changed: another tile or stage count from the algorithm's
capabilities, another custom option, cluster shape or swizzle), checked by cuBLAS, verified
against float64, screened in chunks, and the best few timed beside torch's own call in the
suite's way. If the best neighbours beat the best ranked algorithm by a few percent, a search
over them belongs in the ``cublaslt`` backend.

    PYTHONPATH=src:benchmarks python3 benchmarks/cublaslt_space.py OUT.json [GROUP ...]
"""
from __future__ import annotations

import ctypes
import json
import sys
import time

import torch

from gemmtune import backends, shapes
from gemmtune.tuning import measure, verify
from gemmtune.backends import cublaslt_binding
from gemmtune.device import current
from gemmtune.cli.sidebyside import torch_call

CAP_SWIZZLING, CAP_TILE_IDS, CAP_CUSTOM_MAX, CAP_STAGES_IDS = 2, 6, 7, 13
CLUSTERS = range(0, 16)
CHUNK = 24
FINALISTS = 6


def caps(algo_id: int, types: tuple) -> dict:
    lib = cublaslt_binding.library()
    get = lib.cublasLtMatmulAlgoCapGetAttribute
    get.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    get.restype = ctypes.c_int
    algo = cublaslt_binding.Algo()
    lib.cublasLtMatmulAlgoInit(cublaslt_binding.handle(torch.cuda.current_device()), *types, algo_id, ctypes.byref(algo))

    def array(attr):
        written = ctypes.c_size_t()
        get(ctypes.byref(algo), attr, None, 0, ctypes.byref(written))
        values = (ctypes.c_uint32 * max(1, written.value // 4))()
        get(ctypes.byref(algo), attr, values, ctypes.sizeof(values), ctypes.byref(written))
        return list(values)[: written.value // 4]

    def scalar(attr):
        value, written = ctypes.c_int32(), ctypes.c_size_t()
        get(ctypes.byref(algo), attr, ctypes.byref(value), 4, ctypes.byref(written))
        return value.value

    return {"tile": array(CAP_TILE_IDS), "stages": array(CAP_STAGES_IDS), "custom": list(range(scalar(CAP_CUSTOM_MAX) + 1)),
            "swizzle": [0, 1] if scalar(CAP_SWIZZLING) else [0], "cluster": list(CLUSTERS)}


def neighbours(ranked: list[dict], types: tuple) -> list[dict]:
    seen = {tuple(c.values()) for c in ranked}
    found = []
    for base in ranked:
        for field, values in caps(base["algo"], types).items():
            for value in values:
                config = {**base, field: value}
                if tuple(config.values()) not in seen:
                    seen.add(tuple(config.values()))
                    found.append(config)
    return found


def rows_of(groups: list[str]):
    """(the row, the second its probe starts, its cuBLASLt matmul, the heuristic's eight configs)
    for each public row of ``groups`` (prefill and mid by default) that the backend serves, torch's
    float32 precision set for it."""
    for named in shapes.load():
        p = named.problem
        if named.group in (groups or ["prefill", "mid"]) and not p.bias and p.rows_aligned:
            t0 = time.perf_counter()
            torch.set_float32_matmul_precision("high" if p.tf32 else "highest")
            matmul = cublaslt_binding.Matmul(p, torch.cuda.current_device())
            yield named, t0, matmul, matmul.heuristics(8)


def verified(named, inputs, candidates: list[tuple[str, dict, dict]], device) -> tuple[dict, int, int]:
    """``{name: (record, kernel)}`` of the candidates ``(name, config, record)`` that cuBLAS
    accepts and that match float64, and how many it rejected and how many were wrong."""
    backend = backends.get("cublaslt")
    kernels, rejected, wrong = {}, 0, 0
    for name, config, record in candidates:
        try:
            kernel = backend.build(named.problem, backend.parse_config(config), device)
        except (cublaslt_binding.CublasLtError, ValueError):
            rejected += 1
            continue
        if not verify.check(kernel, named.problem, inputs).ok:
            wrong += 1
            continue
        kernels[name] = (record, kernel)
    return kernels, rejected, wrong


def timed(named, inputs, kernels: dict, names: list[str], device, budget_ms: float, min_rounds: int) -> tuple:
    """Torch's call's timing and each named kernel's time relative to it (above 1: faster), side by side."""
    fns = {n: (lambda k: lambda: k(inputs.a, inputs.b, None))(kernels[n][1]) for n in names}
    fns["torch"] = torch_call(named, inputs)
    timings = measure.measure(fns, device, budget_ms=budget_ms, min_rounds=min_rounds)
    return timings, {n: timings["torch"].median / timings[n].median for n in names}


def screen_and_final(named, inputs, kernels: dict, device) -> tuple[dict, dict, str | None, object]:
    """Every kernel screened in chunks beside torch's call, then the best few and the best
    ranked one timed in the suite's way: (screened ratios, finals, best ranked name, torch's timing)."""
    screened = {}
    names = list(kernels)
    for start in range(0, len(names), CHUNK):
        screened.update(timed(named, inputs, kernels, names[start:start + CHUNK], device, 100, 3)[1])
        torch.cuda.empty_cache()
    best = sorted(screened, key=screened.get, reverse=True)[:FINALISTS]
    best_ranked = max((n for n in screened if n.startswith("ranked")), key=screened.get, default=None)
    final_names = list(dict.fromkeys(best + ([best_ranked] if best_ranked else [])))
    timings, ratios = timed(named, inputs, kernels, final_names, device, 1000, 20)
    ref = timings["torch"]
    finals = {n: {"vs_torch": ratios[n], "noise": timings[n].spread_against(ref), **kernels[n][0]} for n in final_names}
    return screened, finals, best_ranked, ref


def report(named, t0: float, candidates: int, rejected: int, wrong: int, finals: dict, best_ranked, ref, **extra) -> dict:
    """A row of the probe's file, printed as a line."""
    p = named.problem
    top = max(finals, key=lambda n: finals[n]["vs_torch"])
    row = {"name": named.name, "group": named.group, "m": p.m, "n": p.n, "k": p.k, "dtype": p.dtype,
           "candidates": candidates, "rejected": rejected, "wrong": wrong, **extra,
           "torch_ms": ref.median, "finals": finals, "best": top, "best_vs_torch": finals[top]["vs_torch"],
           "best_ranked_vs_torch": finals[best_ranked]["vs_torch"] if best_ranked else None,
           "seconds": time.perf_counter() - t0}
    print(f"{named.name:26s} {candidates:4d} tried, {rejected:4d} rejected, {wrong} wrong; "
          f"best {top} {row['best_vs_torch']:.3f}x, best ranked {row['best_ranked_vs_torch'] or 0:.3f}x "
          f"({row['seconds']:.0f} s)", flush=True)
    return row


def write(path: str, kind: str, device, rows: list, **extra) -> None:
    with open(path, "w") as f:
        json.dump({"kind": kind, "device": device.name, "sm_count": device.sm_count, "torch": torch.__version__,
                   **extra, "rows": rows}, f, indent=1)


def main(path: str, groups: list[str]) -> None:
    device = current()
    rows = []
    for named, t0, matmul, ranked in rows_of(groups):
        candidates = [("ranked", c) for c in ranked[1:]] + [("neighbour", c) for c in neighbours(ranked, matmul._types)]
        inputs = verify.make_inputs(named.problem, "cuda")
        kernels, rejected, wrong = verified(named, inputs, [(f"{kind}{i}", c, c) for i, (kind, c) in enumerate(candidates)],
                                            device)
        screened, finals, best_ranked, ref = screen_and_final(named, inputs, kernels, device)
        rows.append(report(named, t0, len(candidates), rejected, wrong, finals, best_ranked, ref, screened=len(screened)))
        del inputs, kernels
        torch.cuda.empty_cache()
        write(path, "cublaslt-space", device, rows)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
