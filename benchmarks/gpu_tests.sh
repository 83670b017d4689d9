#!/usr/bin/env bash
# The whole test suite on the GPU machine, one pytest process per test file running side by side
# (most GPU tests are Triton compiles, which are CPU-bound), so it fits a device call.
# Failures and errors are listed at the end; each file's full report is in $OUT/tests/.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=${OUT:-gpu-out}/tests
mkdir -p "$out"
for f in tests/test_*.py; do
  name=$(basename "$f" .py)
  timeout "${GPU_TESTS_TIMEOUT_S:-480}" python3 -m pytest -q -rfE --tb=short -p no:cacheprovider "$f" \
    > "$out/$name.txt" 2>&1 &
done
wait
for f in "$out"/*.txt; do
  printf '%-22s %s\n' "$(basename "$f" .txt)" "$(tail -1 "$f")"
done
grep -h "^FAILED\|^ERROR" "$out"/*.txt
