"""Where gemmtune's setup time goes: ``gemmtune.optimize`` on the seeds' MLP (batch 256, bf16 or fp32),
from an empty store and an empty Triton cache, in a fresh process per variant (with and without
compiling ahead, on several thread counts), each phase's seconds from gemmtune's debug log. The
setup column of ``gemmtune compare``, taken apart.

    PYTHONPATH=src python3 benchmarks/setup_cost.py --out setup.json [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import logging, time, torch
t0 = time.perf_counter()
import gemmtune
from gemmtune.cli import compare
t_import = time.perf_counter() - t0
logging.basicConfig(level=logging.DEBUG, format="%(relativeCreated)7.0f ms %(name)s %(message)s")
for name in ("torch", "triton", "urllib3", "matplotlib"):
    logging.getLogger(name).setLevel(logging.WARNING)
dtype = getattr(torch, "{dtype}")
model = compare.seed_mlp().to("cuda", dtype)
x = torch.randn(256, 1024, device="cuda", dtype=dtype)
model(x); torch.cuda.synchronize()  # eager first, as compare does: CUDA is up before setup starts
t0 = time.perf_counter()
gemmtune.optimize(model, (x,))
torch.cuda.synchronize()
print("RESULT", t_import, time.perf_counter() - t0, flush=True)
"""


def run(workers: str | None, dtype: str) -> dict:
    env = dict(os.environ, GEMMTUNE_CACHE_DIR=tempfile.mkdtemp(), TRITON_CACHE_DIR=tempfile.mkdtemp(),
               GEMMTUNE_LOG_LEVEL="debug")
    if workers is not None:
        env["GEMMTUNE_COMPILE_WORKERS"] = workers
    done = subprocess.run([sys.executable, "-c", CHILD.replace("{dtype}", dtype)], env=env, capture_output=True,
                          text=True, timeout=300)
    lines = (done.stdout + done.stderr).splitlines()
    result = next((line.split() for line in lines if line.startswith("RESULT")), None)
    log = [line for line in lines if " ms gemmtune" in line]
    return {"compile_workers": workers or "default", "dtype": dtype, "import_s": float(result[1]) if result else None,
            "setup_s": float(result[2]) if result else None, "returncode": done.returncode, "log": log[-60:],
            "stderr_tail": done.stderr[-1500:] if done.returncode else ""}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workers", nargs="*", default=["default", "0", "4"],
                        help="compile thread counts to try, each in its own fresh process ('default': unset)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per thread count, interleaved")
    args = parser.parse_args()
    rows = [run(None if w == "default" else w, args.dtype) for _ in range(args.repeats) for w in args.workers]
    args.out.write_text(json.dumps({"kind": "setup", "rows": rows}, indent=1))
    for row in rows:
        print(f"compile workers {row['compile_workers']:>8s}: setup {row['setup_s']:.2f} s; "
              f"{' '.join(line.split(' in ')[-1] for line in row['log'] if 'compiled' in line)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
