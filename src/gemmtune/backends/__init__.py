"""The backend registry: names mapped to modules, imported only when a backend is asked for."""

from __future__ import annotations

import importlib

from gemmtune.backends.base import Backend

_MODULES = {
    "cublas": "gemmtune.backends.cublas",
    "cublas_padded": "gemmtune.backends.cublas_padded",
    "cublaslt": "gemmtune.backends.cublaslt",
    "cute": "gemmtune.backends.cute",
    "scaled_mm_fast": "gemmtune.backends.scaled_mm_fast",
    "triton_persistent": "gemmtune.backends.triton_persistent",
    "triton_scaled": "gemmtune.backends.triton_scaled",
    "triton_scaled_stream": "gemmtune.backends.triton_scaled_stream",
    "triton_splitk": "gemmtune.backends.triton_splitk",
    "triton_stream": "gemmtune.backends.triton_stream",
    "triton_tiled": "gemmtune.backends.triton_tiled",
}
REFERENCE = "cublas"  # the backend every choice must beat beyond noise
PRECOMPILED = ("cublas", "cublaslt", "scaled_mm_fast")  # library kernels: nothing to compile ahead
OWN_JIT = ("cute",)  # compiled by their own JIT (CuTe DSL), not Triton's: nothing for a fork child to take
# compiled once per dtype and config into a cache that every later process loads in a millisecond:
# the configs compiled already cost a problem nothing more than a library's algorithms, so they
# are screened whole, side by side (``compiled(problem, configs)`` names them)
CACHED_COMPILES = ("cute",)
# the backends of fp8 (scaled) products alone; the reference takes both kinds
SCALED = ("scaled_mm_fast", "triton_scaled", "triton_scaled_stream")
# backends asked for both kinds, whose kernels take scales where the problem has them
EITHER = ("cublaslt", "cute")
# Triton kernels launched from their compiled binary with bound arguments, whose call costs the
# host less than F.linear's or cuBLASLt's (docs/host-cost.md): what a host-bound model's eager
# calls may run instead of a library's choice (``tuner.lean_choice``). Not the TMA kernels: the
# persistent one builds three descriptors and goes through Triton's JIT on every call (ViT-B/16's
# eager forward 0.64x with them, 0.94x as a graph: host-lean-h200-vit-20261129.json), and the
# stream one encodes its descriptors on every call (20 us, F.linear's 13.6-17.2); nor fp8 kernels
LEAN = ("triton_splitk", "triton_tiled")
# the backends of batched products (``Problem.batch`` > 1, torch.bmm's): torch's own and the tiled
# kernel the compiler's batched template stands for; no other's kernel takes a batch
BATCHED = ("cublas", "triton_tiled")


def names() -> tuple[str, ...]:
    return tuple(_MODULES)


def takes(name: str, problem) -> bool:
    """Whether backend ``name`` is asked for ``problem``'s candidates: the BATCHED backends alone
    for a batched product; else the reference and the EITHER backends always, the SCALED backends
    for fp8 products alone, the others for the rest (their kernels' call takes no scales)."""
    if problem.batch > 1:
        return name in BATCHED
    return name == REFERENCE or name in EITHER or (name in SCALED) == problem.scaled


def get(name: str) -> Backend:
    if name not in _MODULES:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(_MODULES)}")
    return importlib.import_module(_MODULES[name]).BACKEND


def build(problem, name: str, config: dict, device):
    """The kernel of backend ``name`` with ``config`` (untrusted: parsed and checked first) for
    ``problem`` on ``device``."""
    backend = get(name)
    return backend.build(problem, backend.parse_config(config), device)
