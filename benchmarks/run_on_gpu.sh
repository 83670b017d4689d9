#!/usr/bin/env bash
# Everything the GPU machine should check and time, in one go, from the working tree:
# the whole test suite on the GPU (one process per file, about 5 minutes; run serially it takes
# over 10, mostly Triton compiles), the dispatch benchmark, the suite (cold caches), then the
# bucket validation report (pow2, decode and prefill shapes).
# Results land in $OUT (the device tool's folder) or ./gpu-out.
#
# A device call is capped at 10 minutes and tests + suite take about 15, so
# start it detached and collect in a second call:
#   call 1: setsid nohup bash benchmarks/run_on_gpu.sh --inductor --warm --exhaustive > /tmp/gpu.log 2>&1 < /dev/null &
#           sleep 570; cat /tmp/gpu.log
#   call 2: while pgrep -f "[r]un_on_gpu" >/dev/null; do sleep 5; done; cp /tmp/gemmtune-gpu/*.* $OUT/
# (a pattern that cannot match the calling shell's own command line)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=/tmp/gemmtune-gpu
rm -rf "$out" && mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$out/gpu.txt"
OUT=$out bash benchmarks/gpu_tests.sh 2>&1 | tee "$out/tests.txt"
python3 benchmarks/dispatch.py --out "$out/dispatch.json" 2>&1 | grep -v "^gemmtune: tuned"
python3 benchmarks/suite.py "$@" --out "$out/suite.json" 2>&1 \
  | grep -E "^(llama|blog|odd|square|lm_head|skinny|deadline)|Error" | tee "$out/suite.log"
python3 benchmarks/buckets.py --out "$out/buckets.json" 2>&1 | grep -v "^gemmtune: tuned" | tee "$out/buckets.log"
if [ -n "${OUT:-}" ]; then cp "$out"/*.* "$OUT"/; fi
