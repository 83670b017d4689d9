"""Does cuBLAS hold a faster kernel than the one torch's call gets? cuBLASLt's heuristic ranks
algorithms for a problem; torch takes its first. This probe takes the others it ranks (through
``gemmtune.backends.cublaslt_binding``, as the ``cublaslt`` backend does), checks each one's product against
float64, and times every one beside torch's own call in the suite's way (interleaved rounds, L2
flushed, CUDA-graph replays).

    PYTHONPATH=src:benchmarks python3 benchmarks/cublaslt_algos.py OUT.json [GROUP ...]
"""
from __future__ import annotations

import json
import sys
import time

import torch

from gemmtune import backends, shapes
from gemmtune.tuning import measure, verify
from gemmtune.device import current
from gemmtune.cli.sidebyside import torch_call


def main(path: str, groups: list[str]) -> None:
    device = current()
    backend = backends.get("cublaslt")
    rows = []
    for named in shapes.load():
        if groups and named.group not in groups:
            continue
        p = named.problem
        configs = backend.candidates(p, device)
        if not configs:
            continue
        torch.set_float32_matmul_precision("high" if p.tf32 else "highest")
        inputs = verify.make_inputs(p, "cuda")
        fns = {"torch": torch_call(named, inputs)}
        algos = {}
        for i, config in enumerate(configs):
            kernel = backend.build(p, config, device)
            verdict = verify.check(kernel, p, inputs)
            algos[f"lt{i + 1}"] = {"rel_err": verdict.rel_err, "verified": verdict.ok, **config.as_dict()}
            if verdict.ok:
                fns[f"lt{i + 1}"] = (lambda k: lambda: k(inputs.a, inputs.b, None))(kernel)
        t0 = time.perf_counter()
        timings = measure.measure(fns, device, budget_ms=600, min_rounds=15)
        ref = timings["torch"]
        for name, info in algos.items():
            if name in timings:
                info["ms"] = timings[name].median
                info["vs_torch"] = ref.median / timings[name].median
                info["noise"] = timings[name].spread_against(ref)
        best = max((n for n in algos if "vs_torch" in algos[n]), key=lambda n: algos[n]["vs_torch"], default=None)
        row = {"name": named.name, "group": named.group, "m": p.m, "n": p.n, "k": p.k, "dtype": p.dtype,
               "torch_ms": ref.median, "torch_spread": ref.spread, "algos": algos, "best": best,
               "best_vs_torch": algos[best]["vs_torch"] if best else None, "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(f"{named.name:28s} torch {ref.median*1e3:8.1f} us  algos {len(configs):2d}  best {best} "
              f"{row['best_vs_torch'] or 0:.3f}x", flush=True)
        del inputs, fns
        torch.cuda.empty_cache()
    with open(path, "w") as f:
        json.dump({"kind": "cublaslt-algos", "device": device.name, "sm_count": device.sm_count,
                   "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
