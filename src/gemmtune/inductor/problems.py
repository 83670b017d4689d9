"""Which of the compiler's GEMMs gemmtune serves, and as what ``Problem``: read from the sizes,
strides and dtypes the compiler lowers, with no import of the compiler (tested on any torch)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gemmtune.problem import DTYPES, Problem

OPS = ("mm", "addmm", "bmm")  # the compiler's names of the ops gemmtune serves


@dataclass(frozen=True)
class Operands:
    """What the compiler lowers for one GEMM op: its name (``mm``, ``addmm``, ``bmm``...), its
    operands' sizes and strides in its order (addmm: the bias first, (N,) or expanded to (M, N)), their
    dtypes and the output's by torch's name (``bfloat16``), its scalars, and whether every size
    and stride is a number (not a symbol of a dynamic shape)."""

    op: str
    shapes: tuple[tuple[int, ...], ...]
    strides: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    out_dtype: str
    static: bool = True
    scalars: Mapping[str, float] = field(default_factory=dict)


def problem_of(operands: Operands, tf32: bool) -> Problem | None:
    """The gemmtune problem ``operands`` are, or None where gemmtune leaves the GEMM to the
    compiler: another op, a dynamic size, a dtype it does not serve, a mixed-dtype or scaled
    product, an operand not row-major (``a``) or neither row- nor column-major (``b``; for a bmm,
    each matrix of the batch, whatever the batch's strides), or an addmm whose added term is not
    one row repeated. ``tf32``: float32 may use TF32 now."""
    o = operands
    if o.op not in OPS or not o.static or len(set(o.dtypes)) != 1 or o.dtypes[0] not in DTYPES \
            or o.out_dtype != o.dtypes[0]:
        return None
    bias, batched = o.op == "addmm", o.op == "bmm"
    if len(o.shapes) != 2 + bias or bias and not _adds_one_row(o) \
            or any(len(shape) != 2 + batched for shape in o.shapes[-2:]):
        return None
    batch = 1
    if batched:
        (batch, *a_dims), (batch_b, *b_dims) = o.shapes
        if batch_b != batch or batch < 1:
            return None
        shapes, strides = (tuple(a_dims), tuple(b_dims)), tuple(s[1:] for s in o.strides)
    else:
        shapes, strides = o.shapes[-2:], o.strides[-2:]
    (m, k), (k2, n) = shapes
    if k2 != k or min(m, n, k) < 1 or not _row_major(strides[0], m, k):
        return None
    layout = layout_of(strides[1], k, n)
    if layout is None:
        return None
    return Problem(m, n, k, o.dtypes[0], layout, bias, tf32, batch=batch)


def _adds_one_row(o: Operands) -> bool:
    """An addmm that is ``bias + a @ b`` for a bias of N values: alpha and beta 1, the added
    term the bias itself (N,), or (M, N) one contiguous row repeated (row stride 0, or one row)."""
    shape, strides = o.shapes[0], o.strides[0]
    (m, _), (_, n) = o.shapes[1], o.shapes[2]
    if o.scalars.get("alpha", 1) != 1 or o.scalars.get("beta", 1) != 1:
        return False
    if len(shape) == 1:
        return shape[0] == n and (strides[0] == 1 or n == 1)
    return len(shape) == 2 and shape == (m, n) and strides[1] == 1 and (strides[0] == 0 or m == 1)


def _row_major(strides: tuple[int, ...], rows: int, cols: int) -> bool:
    """(rows, cols) stored row by row, rows packed (a one-row matrix may have any row stride)."""
    return strides[1] == 1 and (strides[0] == cols or rows == 1)


def layout_of(b_strides: tuple[int, ...], k: int, n: int) -> str | None:
    """``nn`` where b (K, N) is row-major, ``linear`` where it is a weight (N, K) transposed."""
    if _row_major(b_strides, k, n):
        return "nn"
    if _row_major(b_strides[::-1], n, k):
        return "linear"
    return None
