"""``cublas_padded``: cuBLAS on aligned copies of misaligned operands.

When a row of an operand or of the output is not a multiple of 16 bytes (K or N not a multiple
of 8 in 16-bit types), cuBLAS leaves its fast path: a 4095x4097x4095 bf16 GEMM runs at a fifth
of the aligned rate. Copying the operands into zero-padded buffers whose rows are aligned,
running cuBLAS there and copying the wanted columns out costs a few passes over memory and
wins that back. The copies are inside the kernel, so they are verified and timed with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gemmtune import activation
from gemmtune.backends.base import FieldConfig, KernelBase, check_bounds, config_from_mapping, triton_importable
from gemmtune.device import Device
from gemmtune.problem import Problem

ALIGNS = (8, 64)  # elements a padded size is rounded up to


@dataclass(frozen=True)
class PaddedConfig(FieldConfig):
    FIELDS = {"align": "align"}  # persisted name -> attribute

    align: int

    def __post_init__(self) -> None:
        check_bounds("cublas_padded", (("align", self.align, ALIGNS),))




def padded_size(size: int, step: int, align: int) -> int:
    """``size`` if already aligned to ``step``, else rounded up to a multiple of ``align``."""
    return size if size % step == 0 else -(-size // align) * align


BLOCK_R, BLOCK_C = 16, 256
FLAT_BLOCK, FLAT_WARPS = 4096, 8
INDEX_LIMIT = 2**31 - 1  # the copy kernels compute element offsets in int32


def copy_padded(src: torch.Tensor, rows: int, cols: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``src`` copied into a contiguous (rows, cols) tensor: cut where smaller, zeros where larger.

    Where both sides' rows start every 4 elements (K = 4100 padded to 4160), the flat copy with
    its sizes as constants; on the H200 it took 25.6 us against 47.3 at 38 SMs and 21.8 against
    24.8 at 132 for a 4096x4100 bf16 weight (`pad-flat-h200-*.json`). Rows of odd length (4095,
    4097) on either side gain nothing from it, and cutting a result out into them took longer
    (61 against 46 us at 38 SMs): those keep the 2-D copy. Past int32 element offsets, torch's
    own copies (slower, and correct). Both kernels launch through their compiled binaries
    (``launch.Launcher``) under a guard of everything a launch specializes on, and what a guard's
    copy needs is decided on its first call (``_plan``): a decode step's copies cost the host
    little more than the launch."""
    if out is None:
        dst = src.new_empty((rows, cols))
    elif out.shape != (rows, cols):
        raise ValueError(f"copy_padded: out has shape {tuple(out.shape)}, not ({rows}, {cols})")
    else:
        dst = out
    ps, pd = src.data_ptr(), dst.data_ptr()
    guard = (src.get_device(), dst.get_device(), src.dtype, dst.dtype, src.shape, src.stride(), dst.shape,
             dst.stride(), ps & 15, pd & 15)
    plan = _PLANS.get(guard)
    if plan is None:
        plan = _PLANS[guard] = _plan(src, dst)
    if plan is _BY_TORCH:
        r, c = min(rows, src.shape[0]), min(cols, src.shape[1])
        dst.zero_()
        dst[:r, :c].copy_(src[:r, :c])
        return dst
    launcher, grid, scalars, constexprs = plan
    launcher(grid, guard, (src, dst), (ps, pd), scalars, constexprs)
    return dst


_PLANS: dict = {}  # copy_padded's guard -> _plan's answer
_BY_TORCH = "torch"
_LAUNCHERS: list = []  # the flat and the 2-D copy's launchers, made on first use (they import triton)


def _plan(src: torch.Tensor, dst: torch.Tensor):
    """How ``copy_padded`` copies ``src`` into ``dst`` and all like them: ``_BY_TORCH`` past
    int32 element offsets, else (launcher, grid, scalars, constexprs) of the flat or the 2-D copy."""
    from gemmtune.backends.kernels.pad import pad_copy, pad_copy_flat
    from gemmtune.backends.launch import Launcher

    rows, cols = dst.shape
    if dst.stride(1) != 1:  # checked once per guard, which holds the strides
        raise ValueError(f"copy_padded: out's rows must be contiguous, its strides are {dst.stride()}")
    if max(src.shape[0] * src.stride(0), src.shape[1] * src.stride(1), rows * dst.stride(0)) > INDEX_LIMIT:
        return _BY_TORCH
    if not _LAUNCHERS:
        _LAUNCHERS.extend((Launcher(pad_copy_flat), Launcher(pad_copy)))
    flat, two_d = _LAUNCHERS
    if _rows_aligned_to(src, 4) and _rows_aligned_to(dst, 4):
        total = rows * cols
        return (flat, (-(-total // FLAT_BLOCK), 1, 1), (src.shape[0], total),
                {"SRC_COLS": src.shape[1], "DST_COLS": cols, "SRC_STRIDE": src.stride(0), "DST_STRIDE": dst.stride(0),
                 "BLOCK": FLAT_BLOCK, "num_warps": FLAT_WARPS})
    return (two_d, (-(-rows // BLOCK_R), -(-cols // BLOCK_C), 1),
            (src.shape[0], src.shape[1], rows, cols, src.stride(0), src.stride(1), dst.stride(0)),
            {"BLOCK_R": BLOCK_R, "BLOCK_C": BLOCK_C, "num_warps": 4})


def _rows_aligned_to(src: torch.Tensor, elements: int) -> bool:
    """Whether ``src``'s columns are contiguous and its row starts and column count are multiples
    of ``elements`` (so are its rows' ends)."""
    return src.stride(1) == 1 and src.stride(0) % elements == 0 and src.shape[1] % elements == 0


class PaddedKernel(KernelBase):
    """2-D ``a`` only, nothing to bind (``KernelBase``'s defaults)."""

    def __init__(self, problem: Problem, config: PaddedConfig) -> None:
        step = 16 // problem.element_size
        self._linear = problem.layout == "linear"
        self._m, self._n = problem.m, problem.n
        self._kp = padded_size(problem.k, step, config.align)
        self._np = padded_size(problem.n, step, config.align)
        self._activation = problem.activation

    def __call__(self, a, b, bias, out=None):
        m, n, kp, np_ = self._m, self._n, self._kp, self._np
        a_p = copy_padded(a, m, kp)
        bias_p = None if bias is None else F.pad(bias, (0, np_ - n))
        if self._linear:
            full = F.linear(a_p, copy_padded(b, np_, kp), bias_p)
        else:
            b_p = copy_padded(b, kp, np_)
            full = torch.mm(a_p, b_p) if bias_p is None else torch.addmm(bias_p, a_p, b_p)
        full = activation.apply(full, self._activation)  # element-wise: the padded columns don't matter
        if np_ == n:
            return full if out is None else out.copy_(full)
        return copy_padded(full, m, n, out)


class CublasPaddedBackend:
    name = "cublas_padded"
    space_size = len(ALIGNS)

    def is_available(self, device: Device) -> bool:
        return triton_importable()  # the copies are a Triton kernel

    def candidates(self, problem: Problem, device: Device) -> list[PaddedConfig]:
        return [] if problem.rows_aligned else [PaddedConfig(align) for align in ALIGNS]

    def predict_ms(self, problem: Problem, device: Device, config) -> float | None:
        return None

    def parse_config(self, data: Mapping) -> PaddedConfig:
        return config_from_mapping(self.name, data, PaddedConfig)

    def build(self, problem: Problem, config: PaddedConfig, device: Device) -> PaddedKernel:
        return PaddedKernel(problem, config)


BACKEND = CublasPaddedBackend()
