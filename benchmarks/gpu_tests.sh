#!/usr/bin/env bash
# The whole test suite on the GPU machine, one pytest process per test file running side by side
# (most GPU tests are Triton compiles, which are CPU-bound), so it fits a device call.
# Failures and errors are listed at the end; each file's full report is in $OUT/tests/.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=${OUT:-gpu-out}/tests
mkdir -p "$out"
# The split-K file alone compiles ~140 kernels (4.7 minutes in one process): its tests, which
# only check results, are spread over several processes where pytest-xdist is installed.
spread=""
if python3 -c "import xdist" 2>/dev/null; then spread="-n 6"; fi
# Test files sit in folders that mirror src/gemmtune/: each report is named after the file's path
# under tests/ (tests/backends/test_launch.py -> backends_test_launch.txt).
mapfile -t files < <(find tests -name 'test_*.py' -not -path '*/__pycache__/*' | sort)
for f in "${files[@]}"; do
  name=${f#tests/}
  name=${name%.py}
  name=${name//\//_}
  extra=""
  case "$f" in */test_triton_splitk.py) extra=$spread ;; esac
  # shellcheck disable=SC2086
  timeout "${GPU_TESTS_TIMEOUT_S:-520}" python3 -m pytest -q -rfE --tb=short -p no:cacheprovider $extra "$f" \
    > "$out/$name.txt" 2>&1 &
done
wait
# Each file's last line in summary.txt; printed, only the files that did not pass cleanly (a
# device call returns the last 12,000 characters of its output and a limited number of files).
for f in "$out"/*.txt; do
  [ "$(basename "$f")" = summary.txt ] && continue
  printf '%-36s %s\n' "$(basename "$f" .txt)" "$(tail -1 "$f")"
done > "$out/summary.txt"
# "[0-9]+ failed", not "failed": an expected failure reads "1 xfailed"
echo "$(wc -l < "$out/summary.txt") test files, $(grep -cE "[0-9]+ (failed|errors?)\b" "$out/summary.txt") with failures or errors"
grep -h "^FAILED\|^ERROR" "$out"/*.txt
# a file whose pytest never said how long it took was killed by the timeout, or crashed
for f in "$out"/*.txt; do
  [ "$(basename "$f")" = summary.txt ] && continue
  tail -1 "$f" | grep -q " in [0-9.]*s" || echo "UNFINISHED $(basename "$f" .txt)"
done
