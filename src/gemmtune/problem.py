"""What one GEMM is: its sizes, dtype, layout and epilogue, with a stable key for the store."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import cache

LAYOUTS = ("linear", "nn")
# The one dtype table: the names gemmtune serves, as torch names them (torch.<name>).
DTYPES = ("float16", "bfloat16", "float32")
# fp8 inputs, served as scaled products only (``Problem.scaling``), with an output of DTYPES
SCALED_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# How an fp8 product's inputs carry their scales (float32): one per tensor; one per row of A and
# one per row of B (a token's and an output channel's); or one per 1 x 128 block of A and per
# 128 x 128 block of B (along K, and N for B). "none" for the unscaled dtypes.
SCALINGS = ("none", "tensor", "row", "block")
SCALE_BLOCK = 128
# Applied to every output element after the bias, in float32, before the cast to the output dtype.
ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")
KEY_VERSION = "v2"

_KEY_RE = re.compile(
    rf"^v2/(?P<layout>linear|nn)/(?P<dtype>{'|'.join(DTYPES + SCALED_DTYPES)})(?P<tf32>\+tf32)?"
    rf"(?:>(?P<out>{'|'.join(DTYPES)})@(?P<scaling>{'|'.join(SCALINGS[1:])}))?"
    r"/(?P<m>[1-9]\d*)x(?P<n>[1-9]\d*)x(?P<k>[1-9]\d*)/bias=(?P<bias>[01])"
    r"/act=(?P<act>none|relu|gelu|gelu_tanh|silu)"
    r"(?:/batch=(?P<batch>[2-9]|[1-9]\d+))?$"  # written only for a batched product (bmm)
)


@cache
def torch_dtypes() -> dict:
    """``DTYPES`` as torch's dtypes, name -> torch.dtype (torch imported on first use: this
    module is imported by code that needs no torch)."""
    import torch

    return {name: getattr(torch, name) for name in DTYPES}


@cache
def scaled_torch_dtypes() -> dict:
    """``SCALED_DTYPES`` as torch's dtypes, name -> torch.dtype."""
    import torch

    return {name: getattr(torch, name) for name in SCALED_DTYPES}


@dataclass(frozen=True)
class Problem:
    """One GEMM.

    ``layout="linear"`` is ``x @ w.T`` with ``x`` (M, K) and ``w`` (N, K), as ``nn.Linear``;
    ``layout="nn"`` is ``a @ b`` with ``a`` (M, K) and ``b`` (K, N). ``bias`` adds a vector of
    N values to every row; ``activation`` is then applied element-wise. ``tf32`` says float32
    inputs may use TF32 matrix units; it is part of the key because it changes both the speed and
    the numbers.

    ``batch`` > 1 is a batched product (``torch.bmm``): that many independent products of these
    sizes, ``a`` (batch, M, K) and ``b`` (batch, K, N), or (batch, N, K) for layout linear; no
    bias, activation or scaling. Its key gains a ``/batch=`` field; an unbatched key is unchanged.

    An fp8 product (``dtype`` one of SCALED_DTYPES) is scaled: ``scaling`` says how its float32
    scales are laid (SCALINGS), and ``out_dtype`` is its output's dtype (bfloat16 unless given;
    a bias is in that dtype); layout linear only, as ``torch._scaled_mm`` takes it. Unscaled
    problems have ``scaling`` "none" and ``out_dtype`` their ``dtype``.
    """

    m: int
    n: int
    k: int
    dtype: str = "bfloat16"
    layout: str = "linear"
    bias: bool = False
    tf32: bool = False
    activation: str = "none"
    scaling: str = "none"
    out_dtype: str = ""
    batch: int = 1

    def __post_init__(self) -> None:
        for name in ("m", "n", "k", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Problem.{name} must be an int >= 1, got {value!r}")
        if self.dtype not in DTYPES + SCALED_DTYPES:
            accepted = ", ".join(DTYPES + SCALED_DTYPES)
            raise ValueError(f"Problem.dtype {self.dtype!r} is not supported; accepted: {accepted}")
        self._check_scaling()
        if self.layout not in LAYOUTS:
            raise ValueError(f"Problem.layout {self.layout!r} is not a layout; accepted: {', '.join(LAYOUTS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"Problem.activation {self.activation!r} is not supported; accepted: {', '.join(ACTIVATIONS)}")
        if self.tf32 and self.dtype != "float32":
            object.__setattr__(self, "tf32", False)
        if self.batch > 1 and (self.bias or self.activation != "none" or self.scaled):
            raise ValueError(f"Problem.batch {self.batch}: a batched product takes no bias, activation or "
                             f"scaling (got bias={self.bias}, activation={self.activation!r}, dtype={self.dtype!r})")

    def _check_scaling(self) -> None:
        if self.scaling not in SCALINGS:
            raise ValueError(f"Problem.scaling {self.scaling!r} is not a scaling; accepted: {', '.join(SCALINGS)}")
        if self.scaled != (self.scaling != "none"):
            raise ValueError(f"Problem.scaling {self.scaling!r} does not go with dtype {self.dtype!r}: fp8 products "
                             f"({', '.join(SCALED_DTYPES)}) take one of {', '.join(SCALINGS[1:])}, the others 'none'")
        out = self.out_dtype or ("bfloat16" if self.scaled else self.dtype)
        if out not in DTYPES or not self.scaled and out != self.dtype:
            accepted = ", ".join(DTYPES) if self.scaled else self.dtype
            raise ValueError(f"Problem.out_dtype {self.out_dtype!r} is not accepted with dtype {self.dtype!r}; "
                             f"accepted: {accepted}")
        object.__setattr__(self, "out_dtype", out)
        if self.scaled and self.layout != "linear":
            raise ValueError(f"Problem.layout {self.layout!r}: fp8 products take layout 'linear' (x @ w.T) only")

    @property
    def scaled(self) -> bool:
        """An fp8 product, whose inputs carry scales."""
        return self.dtype in SCALED_DTYPES

    def without_epilogue(self) -> "Problem":
        """The same product with no bias and no activation."""
        return replace(self, bias=False, activation="none")

    def key(self) -> str:
        """The persisted identity of this problem; a golden test pins its format."""
        precision = "+tf32" if self.tf32 else ""
        scaled = f">{self.out_dtype}@{self.scaling}" if self.scaled else ""
        return (
            f"{KEY_VERSION}/{self.layout}/{self.dtype}{precision}{scaled}"
            f"/{self.m}x{self.n}x{self.k}/bias={int(self.bias)}/act={self.activation}"
            + (f"/batch={self.batch}" if self.batch > 1 else "")
        )

    @classmethod
    def from_key(cls, key: str) -> "Problem":
        match = _KEY_RE.match(key) if isinstance(key, str) else None
        if match is None:
            raise ValueError(f"not a gemmtune problem key: {key!r}")
        return cls(
            m=int(match["m"]), n=int(match["n"]), k=int(match["k"]), dtype=match["dtype"],
            layout=match["layout"], bias=match["bias"] == "1", tf32=match["tf32"] is not None,
            activation=match["act"], scaling=match["scaling"] or "none", out_dtype=match["out"] or "",
            batch=int(match["batch"] or 1),
        )

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k

    @property
    def element_size(self) -> int:
        """Bytes per input element."""
        return element_size(self.dtype)

    @property
    def out_element_size(self) -> int:
        return 4 if self.out_dtype == "float32" else 2

    @property
    def rows_aligned(self) -> bool:
        """Every operand's and the output's rows are whole multiples of 16 bytes (K and N are),
        as cuBLAS's fast path and TMA descriptors need."""
        step = 16 // self.element_size
        return self.k % step == 0 and self.n % step == 0

    @property
    def poolable(self) -> bool:
        """N and K whole multiples of 16 elements: every row stride then carries Triton's
        divisibility-by-16 specialization, as a power-of-two representative's do."""
        return self.n % 16 == 0 and self.k % 16 == 0

    @property
    def min_bytes(self) -> int:
        """Bytes a perfect kernel moves: each operand read once, the output written once."""
        matrix = self.element_size * (self.m * self.k + self.k * self.n) + self.out_element_size * self.m * self.n
        return self.batch * matrix

    def describe(self) -> str:
        extra = ("+bias" if self.bias else "") + ("" if self.activation == "none" else f"+{self.activation}")
        precision = "+tf32" if self.tf32 else ""
        scaled = f"->{self.out_dtype} scaled by {self.scaling}" if self.scaled else ""
        batch = f"{self.batch} x " if self.batch > 1 else ""
        return f"{batch}{self.m}x{self.n}x{self.k} {self.dtype}{precision}{scaled} {self.layout}{extra}"


def element_size(dtype: str) -> int:
    """Bytes per element of one of DTYPES or SCALED_DTYPES."""
    return 1 if dtype in SCALED_DTYPES else 4 if dtype == "float32" else 2


BUCKETS = ("exact", "pow2", "log2m")


def bucket(problem: Problem, policy: str) -> Problem:
    """The problem that stands for ``problem``'s bucket: itself (``exact``), every size rounded
    up to a power of two (``pow2``: sizes in (2^(i-1), 2^i] share 2^i), or only M rounded up
    (``log2m``: batch sizes vary, weights do not).

    ``pow2`` pools only shapes whose N and K are multiples of 16 elements, as its
    representative's are: any other shape is a bucket of its own. Rows of 16-byte multiples
    that are not 16-element multiples lose Triton's divisibility hint on their strides, so its
    loads are no longer vectorized: on the H200, Triton configs tuned for the representative
    ran such samples up to 35x slower than their own choice, and unaligned rows 1.1-5x
    (buckets-h200-20261122*.json)."""
    if not pooled(problem, policy):
        return problem
    if policy == "pow2":
        return replace(problem, m=_next_pow2(problem.m), n=_next_pow2(problem.n), k=_next_pow2(problem.k))
    return replace(problem, m=_next_pow2(problem.m))  # log2m


def pooled(problem: Problem, policy: str) -> bool:
    """Whether ``policy`` puts ``problem`` in a bucket with other shapes (see ``bucket``)."""
    if policy not in BUCKETS:
        raise ValueError(f"bucket policy {policy!r} is not known; accepted: {', '.join(BUCKETS)}")
    return policy == "log2m" or (policy == "pow2" and problem.poolable)


def _next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"MxNxK"`` -> (m, n, k), with an error that says what is accepted."""
    parts = text.lower().replace("*", "x").split("x")
    try:
        m, n, k = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"shape {text!r} is not of the form MxNxK (e.g. 4096x4096x4096)") from None
    if min(m, n, k) < 1:
        raise ValueError(f"shape {text!r}: every size must be >= 1")
    return m, n, k
