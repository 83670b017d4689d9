#!/usr/bin/env bash
# gemmtune[cute]'s packages brought to a GPU machine that reaches no package index.
#
# A device call carries at most 64 MiB with the working tree, and the packages come to about
# 63 MiB even packed (CuTe DSL's MLIR library is 185 MB of it): so they travel in parts, one a
# call, to a machine that stays warm between the calls (it keeps /tmp).
#
#   bash benchmarks/cute_wheels.sh pack .carry/cute          # here: download, trim, pack, split in parts
#   # each part in its own device call, carry=[".carry/cute/part-aa", ".carry/cute/MANIFEST",
#   # ".carry/cute/SHA256SUMS"], then the same with part-ab, ...:
#   bash benchmarks/cute_wheels.sh unpack .carry/cute /tmp/cute   # there: keeps the parts it is given;
#                                                                 # once all are there, unpacks them
#   PYTHONPATH=src:/tmp/cute/site-packages:/tmp/cute/site-packages/nvidia_cutlass_dsl/dsl_packages python3 ...
#
# The packages are unpacked into a folder named site-packages, as pip would put them: QuACK
# fingerprints an epilogue's activation function by its source and what it references, and
# stops at functions of installed packages, which it knows by a site-packages (or dist-packages)
# folder in their file's path. Unpacked elsewhere (the first runs: /tmp/cute/site), it followed
# CuTe DSL's own functions into a ContextVar it cannot fingerprint, and every activation epilogue
# failed to compile (TypeError).
#
# CuTe DSL's Python code is the libs-core wheel (libs-base holds only the MLIR bindings); its
# other needs (cuda-bindings, protobuf) are on the GPU machines already.
# Trimmed: CuTe DSL's profiler (iket) and TVM FFI's third-party sources (its core library links
# libtvm_ffi_testing.so: that stays).
set -euo pipefail
QUACK=quack-kernels==0.6.5
DSL=4.8.1
PART_BYTES=40m

pack() {
  local out=$1 work
  work=$(mktemp -d /tmp/cute-pack.XXXX)
  trap 'rm -rf "$work"' RETURN
  mkdir -p "$out"
  pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$work/wheels" "$QUACK" "nvidia-cutlass-dsl==$DSL" "nvidia-cutlass-dsl-libs-base==$DSL" \
    "nvidia-cutlass-dsl-libs-cu13==$DSL" "nvidia-cutlass-dsl-libs-core==$DSL" "apache-tvm-ffi<0.2,>=0.1.6" torch-c-dlpack-ext einops
  mkdir "$work/site"
  for wheel in "$work"/wheels/*.whl; do unzip -q -o "$wheel" -d "$work/site"; done
  rm -rf "$work/site/nvidia_cutlass_dsl/dsl_packages/iket" "$work/site/tvm_ffi/3rdparty"
  echo "packing $(du -sh "$work/site" | cut -f1) with xz -9e (a few minutes)"
  rm -f "$out"/part-*
  tar -C "$work/site" -cf - . | xz -9e -T0 | split -b "$PART_BYTES" - "$out/part-"
  (cd "$out" && ls part-* > MANIFEST && sha256sum part-* > SHA256SUMS)
  ls -la "$out"
}

unpack() {
  local from=$1 to=$2
  mkdir -p "$to/parts"
  cp "$from"/MANIFEST "$from"/SHA256SUMS "$to/parts/" 2>/dev/null || true
  for part in "$from"/part-*; do [ -f "$part" ] && cp "$part" "$to/parts/"; done
  local path="src:$to/site-packages:$to/site-packages/nvidia_cutlass_dsl/dsl_packages"  # no .pth file is read from PYTHONPATH
  if [ -d "$to/site-packages" ]; then echo "unpacked already: PYTHONPATH=$path"; return; fi
  local missing
  missing=$(cd "$to/parts" && while read -r p; do [ -f "$p" ] || echo "$p"; done < MANIFEST)
  if [ -n "$missing" ]; then echo "kept $(ls "$to/parts" | grep -c part-) part(s); still missing: $missing"; return; fi
  (cd "$to/parts" && sha256sum -c --quiet SHA256SUMS)
  mkdir -p "$to/site-packages.partial"
  cat "$to"/parts/part-* | xz -d | tar -C "$to/site-packages.partial" -xf -
  mv "$to/site-packages.partial" "$to/site-packages"
  echo "unpacked: PYTHONPATH=$path"
}

case "${1:-}" in
  pack) [ $# -eq 2 ] || { echo "usage: $0 pack DIR" >&2; exit 2; }; pack "$2" ;;
  unpack) [ $# -eq 3 ] || { echo "usage: $0 unpack DIR TARGET" >&2; exit 2; }; unpack "$2" "$3" ;;
  *) echo "usage: $0 pack DIR | unpack DIR TARGET   (see the comment at the top)" >&2; exit 2 ;;
esac
