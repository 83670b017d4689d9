"""QuACK's source fingerprint, kept across processes.

QuACK files its compiled CuTe DSL kernels under a fingerprint of its own sources: once a process,
before it can load any kernel from its cache, it reads and hashes every Python file of its package
(and of the folders ``quack.cache.EXTRA_SOURCE_DIRS`` adds) with the Python, CuTe DSL and TVM FFI
versions. That was 21 ms of the 28 ms first call of a stored CuTe DSL choice in a second process
on an H200 (``cute-h200-20261128.json``), most of it pathlib's work per file rather than hashing.

``install`` makes QuACK take the fingerprint from a small file in gemmtune's cache directory,
stamped with the path, size and modification time of every file QuACK hashes, with those
versions and QuACK's own (``memo_file.stamp``, as for Triton's key): a new process stats the
files and takes the stored fingerprint where the stamp matches; anywhere else QuACK computes it
and the file keeps it. The file holds one string; nothing read from it is executed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from gemmtune.backends import memo_file
from gemmtune.settings import cache_dir

MEMO_FILENAME = "quack-source-key.json"
MODULE, FUNCTION = "quack.cache.jit", "_compute_source_fingerprint"  # quack-kernels 0.6.5


def install() -> None:
    """QuACK's cache lookups take the fingerprint kept across processes. Once a process; a QuACK
    that does not compute it from what this module stamps (the function, the extra folders'
    setting, the versions, where quack-kernels 0.6.5 has them) is left as it is."""
    try:
        import quack
        import quack.cache as state
        import quack.cache.jit as jit
    except ImportError:
        return
    original = getattr(jit, FUNCTION, None)
    versions = {name: getattr(getattr(jit, name, None), "__version__", None) for name in ("cutlass", "tvm_ffi")}
    if original is None or getattr(original, "gemmtune_memo", False) or None in versions.values() \
            or not hasattr(state, "EXTRA_SOURCE_DIRS"):
        return

    def sources() -> list[Path]:  # read when first asked, as QuACK reads its extra folders
        return [Path(quack.__file__).resolve().parent, *(Path(d).resolve() for d in state.EXTRA_SOURCE_DIRS)]

    stamped = (f"py{sys.version_info.major}.{sys.version_info.minor}", f"quack={getattr(quack, '__version__', '')}",
               *(f"{name}={version}" for name, version in versions.items()))
    setattr(jit, FUNCTION, memoized(original, sources, stamped, cache_dir() / MEMO_FILENAME))


def memoized(compute: Callable[[], str], sources: Callable[[], Sequence[Path]], versions: Sequence[str],
             memo: Path) -> Callable[[], str]:
    """``compute`` (QuACK's fingerprint) answered from ``memo`` where the Python files under the
    ``sources`` folders and the ``versions`` are as they were when it was stored."""

    def stamp() -> str:
        roots = list(sources())
        return memo_file.stamp(python_files(roots), *versions, *map(str, roots))

    return memo_file.remembered(memo, stamp, compute)


def python_files(roots: Sequence[Path]) -> list[Path]:
    """Every Python file under each of ``roots``, in a fixed order: those QuACK hashes."""
    files = []
    for root in roots:
        for folder, _, names in sorted(os.walk(root, followlinks=True)):
            files += [Path(folder) / name for name in sorted(names) if name.endswith(".py")]
    return files
