"""The contract every backend meets; the registry in ``gemmtune.backends`` is the only place
that knows which backends exist."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

from gemmtune.device import Device, interpreter_in_effect

if TYPE_CHECKING:
    import torch

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
    space_size: int  # configs in the backend's full table, before a device and problem prune it

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
    """Whether Triton is installed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_runs(device: Device) -> bool:
    """Whether gemmtune's Triton kernels can run on ``device``: Triton installed, and on the CPU
    its interpreter in effect (``gemmtune.device.interpreter_in_effect``)."""
    return triton_importable() and (not device.interpreter or interpreter_in_effect())


C = TypeVar("C")


def check_bounds(backend: str, checks: Iterable[tuple]) -> None:
    """Each ``(name, value, accepted[, where])``: an int (never a bool) among ``accepted``, else a
    ValueError naming the backend, the field and what is accepted. Configs read from a store are
    untrusted: this is what keeps them from launching an invalid kernel."""
    for name, value, accepted, *where in checks:
        if isinstance(value, bool) or not isinstance(value, int) or value not in accepted:
            raise ValueError(f"{backend} {name}={value!r} is out of bounds{''.join(where)}; accepted: {accepted}")


class FieldConfig:
    """``as_dict``, ``key`` and parsing for a frozen config dataclass, all from ``FIELDS``: its
    persisted names -> attribute names, in the order they are written."""

    FIELDS: ClassVar[Mapping[str, str]]

    def as_dict(self) -> dict:
        return {name: getattr(self, attr) for name, attr in self.FIELDS.items()}

    def key(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.as_dict().items())


def config_from_mapping(backend: str, data: Mapping, make: type[C]) -> C:
    """A ``FieldConfig`` from untrusted data whose keys must be exactly ``make.FIELDS``; the
    constructor validates the values."""
    fields = make.FIELDS
    if not isinstance(data, Mapping) or set(data) != set(fields):
        raise ValueError(f"{backend} config needs exactly the keys {sorted(fields)}, got {data!r}")
    return make(**{fields[k]: v for k, v in data.items()})
