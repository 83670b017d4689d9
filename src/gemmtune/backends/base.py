"""The contract every backend meets; the registry in ``gemmtune.backends`` is the only place
that knows which backends exist."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

from gemmtune.device import Device, interpreter_in_effect

if TYPE_CHECKING:
    import torch

    from gemmtune.problem import Problem


class Config(Protocol):
    def key(self) -> str: ...

    def as_dict(self) -> dict: ...


# linear's front path's call on operands like those a kernel was bound to: call(a, b, bias, pa, pb,
# pbias) with their addresses (pbias 0 without a bias), returning the output
BoundCall = Callable[..., "torch.Tensor"]


class Kernel(Protocol):
    """A built candidate. ``a`` is (M, K); ``b`` is (N, K) for layout ``linear`` and (K, N) for
    ``nn``; ``bias`` is (N,) or None. Writes into ``out`` (M, N) when given, else a new tensor,
    and returns it.

    Its capabilities, which every backend's kernels declare (``KernelBase`` gives a kernel class
    the defaults, ``function_kernel`` a kernel function) and ``backends.launch`` reads when a
    served call's kernel is wrapped for x (..., K) (``any_rank``) or a front-path entry is made
    (``front_entry``):

    - ``serves_any_rank`` (default False): takes ``a`` of any rank (..., K) in layout linear and
      returns (..., N): no flattening wrapper around it.
    - ``bind(a, b, bias)`` (default: None): a ``BoundCall`` for operands laid out as these, which
      the front path calls instead of the kernel, or None (nothing to bind, or not yet). ``a``
      may be of any rank, whatever the kernel serves when called: a kernel of 2-D calls binds a
      contiguous ``a``'s rows where it can (cuBLASLt's), its call returning (..., N).
    - ``front`` (default: the kernel itself): what the front path calls as ``front(a, b, bias)``
      where nothing is bound (cuBLAS's ``F.linear``: the same result, one Python frame less).
    """

    serves_any_rank: bool

    def __call__(self, a: "torch.Tensor", b: "torch.Tensor", bias: "torch.Tensor | None",
                 out: "torch.Tensor | None" = None) -> "torch.Tensor": ...

    def bind(self, a: "torch.Tensor", b: "torch.Tensor", bias: "torch.Tensor | None") -> BoundCall | None: ...

    @property
    def front(self) -> Callable[..., "torch.Tensor"]: ...


class KernelBase:
    """``Kernel``'s defaults for a kernel class: 2-D ``a`` only, nothing to bind, its own front.
    A class overrides what it does otherwise."""

    serves_any_rank: ClassVar[bool] = False

    def bind(self, a, b, bias) -> BoundCall | None:
        return None

    @property
    def front(self) -> Callable[..., "torch.Tensor"]:
        return self  # type: ignore[return-value]  # a subclass defines __call__


def function_kernel(fn: Callable[..., "torch.Tensor"], *, serves_any_rank: bool = False,
                    front: Callable[..., "torch.Tensor"] | None = None) -> Kernel:
    """``fn`` declared as a ``Kernel``: each capability set on it, ``Kernel``'s default where
    not given (``front`` None: ``fn`` itself). cuBLAS's kernels stay functions: an object's
    ``__call__`` took 148 ns where a function took 50 on the H100's host (timeit, Python 3.12),
    on every served call (docs/architecture.md)."""
    fn.serves_any_rank = serves_any_rank  # type: ignore[attr-defined]
    fn.bind = _binds_nothing  # type: ignore[attr-defined]
    fn.front = fn if front is None else front  # type: ignore[attr-defined]
    return fn  # type: ignore[return-value]


def _binds_nothing(a, b, bias) -> None:
    return None


class Backend(Protocol):
    """What every backend module's ``BACKEND`` is. Some have more, as their kind asks
    (``backends/__init__.py``): a CACHED_COMPILES backend ``compiled(problem, configs)``, an
    OWN_JIT backend ``compile_together(calls, workers)``, and a backend whose cost model ranks
    poorly its own ``topk`` count (the tuner's ``_budget``)."""

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
