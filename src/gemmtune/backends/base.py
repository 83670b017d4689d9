"""The contract every backend meets; the registry in ``gemmtune.backends`` is the only place
that knows which backends exist."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from gemmtune.device import Device
    from gemmtune.problem import Problem


class Config(Protocol):
    def key(self) -> str: ...

    def as_dict(self) -> dict: ...


class Kernel(Protocol):
    """A built candidate. ``a`` is (M, K); ``b`` is (N, K) for layout ``linear`` and (K, N) for
    ``nn``; ``bias`` is (N,) or None. Writes into ``out`` (M, N) when given, else a new tensor,
    and returns it."""

    def __call__(self, a: "torch.Tensor", b: "torch.Tensor", bias: "torch.Tensor | None",
                 out: "torch.Tensor | None" = None) -> "torch.Tensor": ...


class Backend(Protocol):
    name: str

    def is_available(self, device: "Device") -> bool: ...

    def candidates(self, problem: "Problem", device: "Device") -> list[Config]:
        """The configs worth trying for this problem on this device, already pruned."""
        ...

    def predict_ms(self, problem: "Problem", device: "Device", config: Config) -> float | None:
        """The cost model's guess of this config's time, to rank configs before compiling; None
        for a backend whose few configs are always measured."""
        ...

    def parse_config(self, data: Mapping) -> Config:
        """A config from untrusted data (the store, an import): raises ValueError unless valid."""
        ...

    def build(self, problem: "Problem", config: Config, device: "Device") -> Kernel: ...


def triton_importable() -> bool:
    """Whether the Triton backends can run at all (checked without importing triton)."""
    return importlib.util.find_spec("triton") is not None
