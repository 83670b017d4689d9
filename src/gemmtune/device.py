"""What the GPU is and allows, and the fingerprint that keys every stored result."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache

from gemmtune.version import __version__

log = logging.getLogger("gemmtune")

# Inductor's own gate (torch/_inductor/utils.py, is_big_gpu): fewer SMs than this and it drops
# every Triton GEMM template. gemmtune reports it; it never gates on it.
INDUCTOR_MIN_SMS = 68
# The optional libraries whose kernels are candidates (the ``cute`` backend's): installing one,
# upgrading or removing it can change the best choice, so its version is part of the fingerprint
# where it is installed. (A store filled before gemmtune[cute] was installed kept serving its
# choices after: ViT-B's fused layers stayed on torch's GEMM, measured on the H100.)
KERNEL_LIBRARIES = ("quack-kernels", "nvidia-cutlass-dsl")


@dataclass(frozen=True)
class Device:
    """A GPU (or the CPU running Triton's interpreter) as the tuner sees it."""

    name: str
    capability: tuple[int, int]
    sm_count: int
    smem_per_block: int  # bytes a block may opt in to
    l2_bytes: int
    interpreter: bool = False
    versions: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def is_hopper(self) -> bool:
        return self.capability[0] == 9 and not self.interpreter

    def fingerprint(self) -> str:
        """Readable prefix plus a hash of everything that can invalidate a tuning result."""
        parts = [self.name, f"{self.capability[0]}.{self.capability[1]}", str(self.sm_count),
                 str(self.smem_per_block), str(self.l2_bytes), str(self.interpreter)]
        parts += [f"{k}={v}" for k, v in sorted(self.versions.items())]
        digest = hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]
        slug = re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")
        return f"{slug}-sm{self.capability[0]}{self.capability[1]}-{self.sm_count}sms-{digest}"


def _versions() -> dict[str, str]:
    import torch
    import triton

    versions = {"gemmtune": __version__, "torch": torch.__version__, "triton": triton.__version__,
                "cuda": str(torch.version.cuda)}
    driver = driver_version()
    if driver:
        versions["driver"] = driver
    return versions | kernel_library_versions()


@functools.cache
def kernel_library_versions() -> dict[str, str]:
    """The installed KERNEL_LIBRARIES' versions, by name, read once a process (each read scans
    the installed packages' metadata)."""
    versions = {}
    for name in KERNEL_LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def driver_version() -> str | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        value = pynvml.nvmlSystemGetDriverVersion()
    except pynvml.NVMLError:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


@lru_cache(maxsize=None)
def current(index: int | None = None) -> Device:
    """The device gemmtune tunes for: the current CUDA GPU, or the CPU interpreter without one."""
    import torch

    if not torch.cuda.is_available():
        # triton reads it when its own ``@jit`` helpers are defined: it must be set before triton
        # is first imported (``_versions`` imports it)
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return interpreter_device()
    index = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(index)
    return Device(
        name=props.name,
        capability=(props.major, props.minor),
        sm_count=props.multi_processor_count,
        smem_per_block=_smem_optin(props, index),
        l2_bytes=props.L2_cache_size,
        versions=_versions(),
    )


def interpreter_device() -> Device:
    """The CPU running Triton's interpreter: a small space, timings that are not GPU timings.
    A description only: ``current`` switches a process without a GPU to the interpreter, since
    once ``TRITON_INTERPRET`` is set every Triton kernel defined later in the process is
    interpreted, a GPU process's too (docs/architecture.md, without a GPU)."""
    return Device(
        name="CPU (Triton interpreter)",
        capability=(0, 0),
        sm_count=os.cpu_count() or 1,
        smem_per_block=101376,
        l2_bytes=4 << 20,
        interpreter=True,
        versions=_versions(),
    )


@lru_cache(maxsize=None)
def interpreter_in_effect() -> bool:
    """Whether Triton's interpreter runs the kernels in this process. Triton decides it for its
    own ``@jit`` helpers when first imported: a program that imported triton before gemmtune
    chose the interpreter has those helpers compiled-only, and every kernel calling one fails."""
    import triton.language.standard as standard

    if type(standard.cdiv).__name__ == "InterpretedFunction":
        return True
    log.warning("gemmtune: triton was imported before TRITON_INTERPRET=1 was set, so Triton's CPU "
                "interpreter cannot run gemmtune's Triton kernels in this process; only torch's kernels "
                "are tried. Set TRITON_INTERPRET=1 in the environment before anything imports "
                "triton.")
    return False


def _smem_optin(props, index: int) -> int:
    value = getattr(props, "shared_memory_per_block_optin", 0)
    if value:
        return int(value)
    from triton.runtime import driver

    return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])
