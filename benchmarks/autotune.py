"""gemmtune.autotune against triton.autotune on kernels nobody on this project wrote (liger-kernel's
RMSNorm and SwiGLU forward kernels, where liger_kernel is importable) and a vector add, each
wrapped by both decorators over the same config list:

- ``speedup``: the GPU time of triton.autotune's choice over gemmtune's, the two decorated
  kernels called side by side in interleaved rounds (L2 flushed before each call);
- ``first_call_s_*``: a fresh process's first call, cold (empty Triton cache and store) and warm
  (the Triton compile cache and gemmtune's store filled by an earlier process; triton.autotune
  keeps no timings between processes by default, so it tunes again);
- ``host_us_*``: host time per call of each decorated kernel on a small input (a loop of calls);
- with ``--compiled``, ``compiled``: each decorated kernel called inside ``torch.compile``
  (fullgraph) after an eager call tuned it: Dynamo's graph breaks, the configs the compiler was
  handed, the compile time, the output against the eager call's, and the two compiled calls (and
  gemmtune's eager one) timed side by side.

    PYTHONPATH=src python3 benchmarks/autotune.py --out autotune.json [--kernels add,rms_norm,swiglu] [--compiled]

liger-kernel is not installed on the GPU machines: carry its wheel (pure Python) and put it on the
path, or the liger rows are skipped and say so. Without a GPU the kernels run through Triton's
interpreter and the timings are NOT GPU timings (the add alone: liger's kernels call ``.to`` on
scalar arguments, which the interpreter does not support; triton.autotune's own timer needs a GPU
driver, so a plain clock stands in for it there).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch  # noqa: E402

KERNELS = ("add", "rms_norm", "swiglu")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


class Case:
    """One kernel at one size: its jit function, config list, key, pruning, and a call."""

    def __init__(self, name: str, fn, configs: list, key: list[str], call: Callable, small: Callable,
                 output: torch.Tensor, prune: dict | None = None) -> None:
        self.name, self.fn, self.configs, self.key, self.call, self.small, self.prune = (
            name, fn, configs, key, call, small, prune)
        self.output = output  # what ``call`` writes


def _rows_block_prune(configs, named, **kwargs):
    """Keep the blocks that hold a row, up to twice the smallest that does (``n_cols`` is passed
    by name or by keyword)."""
    n = kwargs["n_cols"] if "n_cols" in kwargs else named["n_cols"]
    least = triton.next_power_of_2(n)
    return [c for c in configs if least <= c.kwargs["BLOCK_SIZE"] <= 2 * least]


def row_configs(sizes=(1024, 2048, 4096, 8192, 16384, 32768), warps=(2, 4, 8, 16, 32), stages=(1, 2)):
    return [triton.Config({"BLOCK_SIZE": b}, num_warps=w, num_stages=s) for b in sizes for w in warps for s in stages]


def add_case(tiny: bool) -> Case:
    n = 1 << (12 if tiny else 24)
    x, y = (torch.randn(n, device=DEVICE) for _ in range(2))
    out = torch.empty_like(x)
    sx, sy, so = (torch.randn(256, device=DEVICE) for _ in range(3))
    configs = [triton.Config({"BLOCK": b}, num_warps=w) for b in (256, 1024, 4096) for w in (2, 4, 8)]

    def call(kernel):
        kernel[lambda m: (triton.cdiv(n, m["BLOCK"]),)](x, y, out, n)

    def small(kernel):
        kernel[lambda m: (triton.cdiv(256, m["BLOCK"]),)](sx, sy, so, 256)

    return Case("add", add_kernel, configs[:3] if tiny else configs, ["n"], call, small, out)


def rms_norm_case(tiny: bool) -> Case | str:
    try:
        from liger_kernel.ops.rms_norm import _rms_norm_forward_kernel
    except ImportError as error:
        return f"liger_kernel not importable ({error})"
    rows, cols = (8, 64) if tiny else (8192, 4096)
    x = torch.randn(rows, cols, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(cols, device=DEVICE, dtype=torch.bfloat16)
    y, rstd = torch.empty_like(x), torch.empty(rows, device=DEVICE, dtype=torch.float32)
    sx, sy, srstd = x[:4].clone(), y[:4].clone(), rstd[:4].clone()

    def launch(kernel, xx, yy, rr):
        kernel[(xx.shape[0],)](yy, yy.stride(0), xx, xx.stride(0), w, w.stride(0), rr, rr.stride(0), cols, 1e-6,
                               0.0, 1, elementwise_affine=True)  # casting mode 1: Llama's

    configs = row_configs(sizes=(64, 128) if tiny else (4096, 8192), stages=(1,) if tiny else (1, 2))
    return Case("rms_norm", _rms_norm_forward_kernel, configs, ["n_cols"], lambda k: launch(k, x, y, rstd),
                lambda k: launch(k, sx, sy, srstd), y, {"early_config_prune": _rows_block_prune})


def swiglu_case(tiny: bool) -> Case | str:
    try:
        from liger_kernel.ops.swiglu import _swiglu_forward_kernel
    except ImportError as error:
        return f"liger_kernel not importable ({error})"
    rows, cols = (8, 64) if tiny else (4096, 14336)
    a, b = (torch.randn(rows, cols, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    sa, sb, sc = a[:4].clone(), b[:4].clone(), c[:4].clone()

    def launch(kernel, aa, bb, cc):
        kernel[(aa.shape[0],)](aa, bb, cc, cc.stride(-2), 1.0, n_cols=cols)

    configs = row_configs(sizes=(64, 128) if tiny else (16384, 32768), stages=(1,) if tiny else (1, 2))
    return Case("swiglu", _swiglu_forward_kernel, configs, ["n_cols"], lambda k: launch(k, a, b, c),
                lambda k: launch(k, sa, sb, sc), c, {"early_config_prune": _rows_block_prune})


CASES = {"add": add_case, "rms_norm": rms_norm_case, "swiglu": swiglu_case}


def wrapped(case: Case, which: str):
    import gemmtune

    if which == "gemmtune":
        return gemmtune.autotune(configs=case.configs, key=case.key, prune_configs_by=case.prune)(case.fn)
    # triton's benchmarker needs a GPU driver: on the CPU (a smoke run) a plain clock stands in
    bench = None if DEVICE == "cuda" else _cpu_bench
    return triton.autotune(configs=case.configs, key=case.key, prune_configs_by=case.prune, do_bench=bench)(case.fn)


def _cpu_bench(fn: Callable, quantiles) -> list[float]:
    started = time.perf_counter()
    fn()
    return [(time.perf_counter() - started) * 1e3] * len(quantiles)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def first_call(case: Case, which: str) -> float:
    kernel = wrapped(case, which)
    sync()
    started = time.perf_counter()
    case.call(kernel)
    sync()
    return time.perf_counter() - started


def side_by_side(case: Case, rounds_ms: float) -> dict:
    """Both decorators tuned in this process, then their calls timed in interleaved rounds."""
    from gemmtune.device import current
    from gemmtune.tuning import measure

    kernels = {which: wrapped(case, which) for which in ("triton", "gemmtune")}
    for kernel in kernels.values():
        case.call(kernel)
    timings = measure.measure({which: (lambda k=k: case.call(k)) for which, k in kernels.items()}, current(),
                              budget_ms=rounds_ms, graphs=False)
    host = {which: measure.host_loop_ms(lambda k=k: case.small(k), current(), calls=200) * 1e3
            for which, k in kernels.items()}
    return {"triton_choice": str(kernels["triton"].best_config), "gemmtune_choice": str(kernels["gemmtune"].best_config),
            "triton_ms": timings["triton"].median, "gemmtune_ms": timings["gemmtune"].median,
            "speedup": timings["triton"].ratio_to(timings["gemmtune"]),
            "spread": timings["gemmtune"].spread_against(timings["triton"]),
            "host_us_triton": host["triton"], "host_us_gemmtune": host["gemmtune"],
            "host_ratio": host["gemmtune"] / host["triton"]}


def compiled(case: Case, rounds_ms: float) -> dict:
    """Each decorator's kernel inside ``torch.compile`` (fullgraph, the default mode), gemmtune's
    tuned by an eager call first: graph breaks, what the compiler was handed, compile time, the
    output against gemmtune's eager call's, and the compiled calls timed side by side (the
    configs handed to the compiler are checked by tests/test_autotune.py)."""
    from gemmtune.device import current
    from gemmtune.tuning import measure

    kernels = {which: wrapped(case, which) for which in ("triton", "gemmtune")}
    case.call(kernels["gemmtune"])  # tuned and stored, as a first eager call or an earlier process would
    sync()
    eager_out = case.output.clone()
    row: dict = {}
    steps = {}
    for which, kernel in kernels.items():
        torch._dynamo.reset()
        explained = torch._dynamo.explain(lambda k=kernel: case.call(k))()
        row[f"graph_breaks_{which}"] = explained.graph_break_count
        step = torch.compile(lambda k=kernel: case.call(k), fullgraph=True)
        case.output.zero_()
        sync()
        started = time.perf_counter()
        step()  # compiles; triton.autotune's configs are tuned by the compiler here
        sync()
        row[f"compile_s_{which}"] = time.perf_counter() - started
        row[f"max_abs_diff_{which}"] = (case.output.float() - eager_out.float()).abs().max().item()
        steps[which] = step
    row["gemmtune_choice"] = str(kernels["gemmtune"].best_config)
    fns = {"triton": steps["triton"], "gemmtune": steps["gemmtune"], "gemmtune_eager": lambda: case.call(kernels["gemmtune"])}
    timings = measure.measure(fns, current(), budget_ms=rounds_ms, graphs=False)
    row |= {f"{name}_ms": t.median for name, t in timings.items()}
    row["speedup"] = timings["triton"].ratio_to(timings["gemmtune"])
    row["spread"] = timings["gemmtune"].spread_against(timings["triton"])
    row["compiled_over_eager"] = timings["gemmtune_eager"].ratio_to(timings["gemmtune"])
    return row


def child(args) -> int:
    """One fresh process's first call of one decorator (``--first which``): prints seconds."""
    built = CASES[args.kernel](args.tiny)
    print(json.dumps({"seconds": first_call(built, args.first)}))
    return 0


def first_calls(name: str, tiny: bool) -> dict:
    """Cold and warm first calls of each decorator, each in a fresh process: cold with empty
    caches of its own, warm after a process that tuned with the same caches."""
    def run(which: str, cache: Path) -> float:
        env = {**os.environ, "TRITON_CACHE_DIR": str(cache / "triton"), "GEMMTUNE_CACHE_DIR": str(cache / "store")}
        argv = [sys.executable, __file__, "--kernel", name, "--first", which] + (["--tiny"] if tiny else [])
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
        if done.returncode:
            raise RuntimeError(done.stderr[-2000:])
        return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]

    out = {}
    for which in ("triton", "gemmtune"):
        with tempfile.TemporaryDirectory() as tmp:
            out[f"first_call_s_{which}_cold"] = run(which, Path(tmp))
            out[f"first_call_s_{which}_warm"] = run(which, Path(tmp))
    out["first_call_speedup_warm"] = out["first_call_s_triton_warm"] / out["first_call_s_gemmtune_warm"]
    return out


def header(args) -> dict:
    from gemmtune.version import __version__

    gpu = torch.cuda.get_device_properties(0) if DEVICE == "cuda" else None
    return {"kind": "autotune", "device": gpu.name if gpu else "cpu", "sm_count": gpu.multi_processor_count if gpu else None,
            "torch": torch.__version__, "triton": triton.__version__, "gemmtune": __version__,
            "date": datetime.date.today().isoformat(),
            "timings": "GPU" if gpu else "CPU: Triton's interpreter, NOT GPU timings", "tiny": args.tiny}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="the JSON file to write")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"among {', '.join(KERNELS)}")
    parser.add_argument("--tiny", action="store_true", help="small sizes and config lists: a smoke run, CPU too")
    parser.add_argument("--round-ms", type=float, default=400.0, help="timing budget of the side-by-side rounds")
    parser.add_argument("--compiled", action="store_true", help="also each kernel inside torch.compile (GPU only)")
    parser.add_argument("--kernel", choices=KERNELS, help=argparse.SUPPRESS)
    parser.add_argument("--first", choices=("triton", "gemmtune"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.first:
        return child(args)
    names = [k.strip() for k in args.kernels.split(",") if k.strip()]
    if unknown := [k for k in names if k not in CASES]:
        parser.error(f"--kernels: unknown {unknown}; accepted: {', '.join(KERNELS)}")
    doc = header(args) | {"rows": [], "skipped": []}
    with tempfile.TemporaryDirectory() as store:
        os.environ["GEMMTUNE_CACHE_DIR"] = store
        for name in names:
            built = CASES[name](args.tiny)
            if isinstance(built, str):
                doc["skipped"].append(f"{name}: {built}")
                print(f"{name}: skipped, {built}", file=sys.stderr)
                continue
            row = {"kernel": name, "configs": len(built.configs)} | side_by_side(built, args.round_ms)
            row |= first_calls(name, args.tiny)
            if args.compiled and DEVICE == "cuda":
                row["compiled"] = compiled(CASES[name](args.tiny), args.round_ms)
            doc["rows"].append(row)
            print(f"{name:10s} x{row['speedup']:.3f} (triton {row['triton_ms']:.4f} / gemmtune {row['gemmtune_ms']:.4f} ms)"
                  f"  first call warm x{row['first_call_speedup_warm']:.1f}  host x{row['host_ratio']:.2f}",
                  file=sys.stderr)
            if args.out:
                args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(doc['rows'])} kernels, {doc['timings']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
