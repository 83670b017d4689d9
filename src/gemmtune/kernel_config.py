"""A user's own Triton kernel, tuned by ``gemmtune.autotune``, as the store holds it: the key of
one tuning (``kernel_key``) and the chosen config (``KernelConfig``), both plain data.

The store keeps a kernel's choice beside the GEMM choices, under a key of its own
(``kernel:<name>@<source hash>/<config list hash>/<key arguments and dtypes>``) and the backend
name ``BACKEND``. A stored config is never turned into a kernel launch by itself: it names its
place in the decorator's config list (``index``) and repeats that config's values, and the
decorator serves it only where the config at that place in its own list has the same values.
Whatever the store reads is validated here first, as a GEMM config is by its backend.
"""

from __future__ import annotations

import keyword
from dataclasses import dataclass
from typing import Any

BACKEND = "triton_config"
KEY_PREFIX = "kernel:"
MAX_KEY_CHARS = 4000
MAX_INDEX = 100_000
SCALARS = (bool, int, float, str, type(None))
LIMITS = {"num_warps": (1, 64), "num_stages": (0, 32), "num_ctas": (1, 16)}
MAXNREG = (1, 255)
FIELDS = ("index", "kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg")


def kernel_key(name: str, source_hash: str, configs_hash: str, arguments: str) -> str:
    """The store key of one tuning of a kernel: its name, the hash of its source (an edited kernel
    tunes again), the hash of its config list (an edited list tunes again) and the values of its
    key arguments with the dtypes of its tensor arguments, as text."""
    key = f"{KEY_PREFIX}{name}@{source_hash}/{configs_hash}/{arguments}"
    if issue := key_issue(key):
        raise ValueError(issue)
    return key


def is_kernel_key(key: Any) -> bool:
    return isinstance(key, str) and key.startswith(KEY_PREFIX)


def key_issue(key: Any) -> str | None:
    """What is wrong with ``key`` as a kernel's store key, or None."""
    if not is_kernel_key(key):
        return f"a kernel key starts with {KEY_PREFIX!r}, got {key!r:.80}"
    if len(key) > MAX_KEY_CHARS or not key.isprintable():
        return f"a kernel key is printable text of at most {MAX_KEY_CHARS} characters, got {len(key)} characters"
    name, _, rest = key[len(KEY_PREFIX):].partition("@")
    if not name or rest.count("/") < 2:
        return f"a kernel key reads {KEY_PREFIX}<name>@<source hash>/<configs hash>/<arguments>, got {key!r:.80}"
    return None


@dataclass(frozen=True)
class KernelConfig:
    """One ``triton.Config`` as data: its place in the decorator's list, its meta-parameters and
    its launch settings. A config's ``pre_hook`` is code and is never stored."""

    index: int
    kwargs: tuple[tuple[str, Any], ...]
    num_warps: int = 4
    num_stages: int = 3
    num_ctas: int = 1
    maxnreg: int | None = None

    def __post_init__(self) -> None:
        if issue := _issue(self):
            raise ValueError(f"config {self.index}: {issue}")

    @classmethod
    def of(cls, index: int, config: Any) -> KernelConfig:
        """The data of a ``triton.Config`` (or anything with its attributes)."""
        kwargs = getattr(config, "kwargs", None)
        if not isinstance(kwargs, dict):
            raise TypeError(f"configs[{index}]: expected a triton.Config, got {type(config).__name__}")
        return cls(index, tuple(sorted(kwargs.items())), config.num_warps, config.num_stages,
                   getattr(config, "num_ctas", 1), getattr(config, "maxnreg", None))

    @classmethod
    def from_dict(cls, data: Any) -> KernelConfig:
        """A config read from the store or an import file, validated (``ValueError`` or
        ``TypeError`` naming what is wrong)."""
        if not isinstance(data, dict) or set(data) != set(FIELDS):
            raise ValueError(f"a kernel config is an object with keys {list(FIELDS)}, got {data!r:.120}")
        if not isinstance(data["kwargs"], dict):
            raise TypeError(f"a kernel config's kwargs is an object, got {type(data['kwargs']).__name__}")
        return cls(data["index"], tuple(sorted(data["kwargs"].items())), data["num_warps"], data["num_stages"],
                   data["num_ctas"], data["maxnreg"])

    def as_dict(self) -> dict:
        return {"index": self.index, "kwargs": dict(self.kwargs), "num_warps": self.num_warps,
                "num_stages": self.num_stages, "num_ctas": self.num_ctas, "maxnreg": self.maxnreg}

    def label(self) -> str:
        parts = [f"{name}={value}" for name, value in self.kwargs]
        parts += [f"w{self.num_warps}", f"s{self.num_stages}"]
        parts += [f"ctas{self.num_ctas}"] if self.num_ctas != 1 else []
        parts += [f"maxnreg{self.maxnreg}"] if self.maxnreg is not None else []
        return ",".join(parts)


def _whole(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _issue(config: KernelConfig) -> str | None:
    if not _whole(config.index, 0, MAX_INDEX):
        return f"index must be a whole number in [0, {MAX_INDEX}], got {config.index!r}"
    for name, value in config.kwargs:
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            return f"a meta-parameter's name must be an identifier, got {name!r}"
        if not isinstance(value, SCALARS) or isinstance(value, float) and value != value:
            return f"meta-parameter {name} must be a bool, int, float, str or None, got {value!r:.60}"
    for name, (low, high) in LIMITS.items():
        if not _whole(getattr(config, name), low, high):
            return f"{name} must be a whole number in [{low}, {high}], got {getattr(config, name)!r}"
    if config.num_warps & (config.num_warps - 1):
        return f"num_warps must be a power of two, got {config.num_warps}"
    if config.maxnreg is not None and not _whole(config.maxnreg, *MAXNREG):
        return f"maxnreg must be None or a whole number in {list(MAXNREG)}, got {config.maxnreg!r}"
    return None
