"""How many thread-block clusters of a size fit the GPU at once, kept across processes.

QuACK's persistent kernels launch that many clusters. QuACK asks CuTe DSL for it once a process
for each cluster size (twice where its two entry points ask with different arguments), and CuTe
DSL compiles a small kernel to ask the driver: 65-132 ms of the 91-169 ms first call of a stored
CuTe DSL choice in a second process, on an H100 and an H200 (docs/performance.md), where the
kernel's own first call, loaded from its object file, is 25-42 ms.

The answer depends only on the GPU as the process sees it (its SM count under MPS too), the
driver and the libraries, all of which gemmtune's device fingerprint holds. ``install`` makes
QuACK's entry points take it from a small file in gemmtune's cache directory, keyed by the
fingerprint of the device asked about, the cluster size and the compute capability asked for;
where the file lacks it, QuACK's own query answers and the file keeps the answer. A stored count
that is not a whole number from 1 to the device's SM count is asked again. Two processes adding
an answer at once may keep only one of them: the other is asked again by a later process.
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable
from pathlib import Path

from gemmtune.backends import memo_file
from gemmtune.device import Device
from gemmtune.settings import cache_dir

MEMO_FILENAME = "cluster-occupancy.json"
# the modules of QuACK (0.6.5) that bind its query by name, the defining one first
QUACK_MODULES = ("quack.cute_dsl_utils", "quack.gemm", "quack.gemm_runtime.host")
QUERY = "get_max_active_clusters"


def install(describe: Callable[[int], Device]) -> None:
    """QuACK's entry points answer the query from the file where it was asked before
    (``describe``: the device of a CUDA index). Once a process; where QuACK is missing or does not
    define the query, nothing changes."""
    try:
        modules = [importlib.import_module(name) for name in QUACK_MODULES]
    except ImportError:
        return
    original = getattr(modules[0], QUERY, None)
    if original is None or getattr(original, "gemmtune_memo", False):
        return
    kept = kept_query(original, cache_dir() / MEMO_FILENAME, describe)
    for module in modules:
        if getattr(module, QUERY, None) is original:
            setattr(module, QUERY, kept)


def kept_query(query: Callable[..., int], memo: Path, describe: Callable[[int], Device]) -> Callable[..., int]:
    """``query`` (QuACK's, with its arguments) answered from ``memo`` where it holds a valid count
    for the device; its answer stored there otherwise. A call that omits the capability asks
    for the device's own, so both of QuACK's ways of asking share one answer."""
    writing = threading.Lock()

    @functools.lru_cache(maxsize=None)
    def get_max_active_clusters(cluster_size: int, device_capacity: tuple[int, int] | None = None,
                                device_id: int = 0) -> int:
        device = describe(device_id)
        capability = tuple(device_capacity) if device_capacity is not None else device.capability
        key = f"{device.fingerprint()}/{cluster_size}/{capability[0]}.{capability[1]}"
        stored = (memo_file.read(memo) or {}).get(key)
        if valid(stored, device.sm_count):
            return stored
        count = query(cluster_size, device_capacity=capability, device_id=device_id)
        with writing:
            memo_file.write(memo, (memo_file.read(memo) or {}) | {key: count})
        return count

    get_max_active_clusters.gemmtune_memo = True
    return get_max_active_clusters


def valid(count: object, sm_count: int) -> bool:
    """Whether a stored count can be a device's: a whole number from 1 to its SM count."""
    return type(count) is int and 1 <= count <= sm_count
