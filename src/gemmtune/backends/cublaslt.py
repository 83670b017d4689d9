"""``cublaslt``: cuBLAS's own kernels beyond the one its heuristic picks (``gemmtune.backends.cublaslt_binding``).

The candidates are the second to eighth algorithms cuBLASLt's heuristic ranks for the problem
(its first is what torch's call runs), each stored as the integers of its configuration. A GPU
only, problems whose rows are 16-byte aligned. cuBLAS applies the bias and, for ReLU and GELU's
tanh approximation, the activation in its epilogue (``cublaslt_binding.epilogue``; then the
first algorithm too is a candidate, since torch's call may apply them apart); an exact
GELU or a SiLU is torch's, after the product, as for ``cublas``. A call whose operands the
algorithm was not checked for (other strides, dtypes or devices, pointers off the 256-byte
alignment every algorithm may assume, a bias where the problem has none or none where it has
one) goes to torch's own call: never a wrong result. Another M, or another GPU, is checked by
cuBLAS on first use and kept.

fp8 products scaled per tensor are served too (``LtScaledKernel``: called as ``triton_scaled``'s
kernels are, its scales read from their pointers): the heuristic's algorithms after the first,
which is ``torch._scaled_mm``'s; where torch 2.11 raised for a product on an H100 (two e5m2
operands, a bias with a float32 output) none are offered (``serves_scaled``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from gemmtune import activation
from gemmtune.backends import cublas, cublaslt_binding
from gemmtune.backends.base import BoundCall, FieldConfig, KernelBase, check_bounds, config_from_mapping
from gemmtune.device import Device
from gemmtune.errors import CublasLtError
from gemmtune.problem import Problem

log = logging.getLogger("gemmtune.backends.cublaslt_binding")

# Algorithms asked of the heuristic per problem (torch 2.11's cuBLAS answers 8 on the H200). Its first is
# the one torch's call runs, measured already as cuBLAS: the candidates are the others.
HEURISTICS = 8
MAX_SHAPES = 64  # (GPU, row count) pairs a kernel keeps checked algorithms for; others go to torch's call


@dataclass(frozen=True)
class LtConfig(FieldConfig):
    """cuBLASLt's cublasLtMatmulAlgoConfigAttributes_t, as cuBLAS numbers them."""

    FIELDS = {name: name for name, _ in cublaslt_binding.ATTRIBUTES}  # persisted name -> attribute

    algo: int
    tile: int
    splitk: int
    reduction: int
    swizzle: int
    custom: int
    stages: int
    inner: int
    cluster: int

    def __post_init__(self) -> None:
        where = " (its C type's range; cuBLAS checks the value itself when the kernel is built)"
        check_bounds("cublaslt", [(name, getattr(self, name), _range(ctype), where)
                                  for name, ctype in cublaslt_binding.ATTRIBUTES])


def _range(ctype) -> range:
    bits = 8 * ctypes.sizeof(ctype)
    signed = ctype(-1).value < 0
    return range(-(2 ** (bits - 1)), 2 ** (bits - 1)) if signed else range(2**bits)


@functools.lru_cache(maxsize=256)
def _ranked(problem: Problem, device_index: int) -> tuple[LtConfig, ...]:
    ranked = cublaslt_binding.Matmul(problem, device_index).heuristics(HEURISTICS)
    # the first is torch's call, unless cuBLAS's epilogue does more (torch may add the bias apart;
    # torch's _scaled_mm hands cuBLAS its bias, never an activation)
    if problem.scaled:
        first = 0 if cublaslt_binding.fused_activation(problem) else 1
    else:
        first = 0 if cublaslt_binding.epilogue(problem) != cublaslt_binding.EPILOGUE_DEFAULT else 1
    return tuple(LtConfig(**config) for config in ranked[first:])


class LtKernel(KernelBase):
    """2-D ``a`` only (``KernelBase``'s default); binds its launch for the front path."""

    def __init__(self, problem: Problem, config: LtConfig, device: Device) -> None:
        self._problem = problem
        self._config = config.as_dict()
        self._dtype, self._out_dtype = getattr(torch, problem.dtype), getattr(torch, problem.out_dtype)
        self._activation = "none" if cublaslt_binding.fused_activation(problem) else problem.activation
        linear = problem.layout == "linear"
        self._b_shape = (problem.n, problem.k) if linear else (problem.k, problem.n)
        self._b_stride = (problem.k, 1) if linear else (problem.n, 1)
        self._fallback = cublas.BACKEND.build(problem, cublas.CublasConfig(), device)
        self._plans: dict[tuple[int, int], tuple | None] = {}  # (GPU index, M) -> plan
        if self._plan(torch.cuda.current_device(), problem.m) is None:
            raise CublasLtError(f"cuBLASLt rejects {self._config} for {problem.describe()}")

    def _plan(self, index: int, m: int) -> tuple | None:
        """(launch, workspace bytes, the descriptors) of the algorithm for ``m`` rows on GPU
        ``index``; None where cuBLAS rejects it there."""
        if (index, m) in self._plans:
            return self._plans[index, m]
        if len(self._plans) >= MAX_SHAPES:
            return None
        p = dataclasses.replace(self._problem, m=m)
        try:
            matmul = cublaslt_binding.Matmul(p, index)
            algo, workspace = matmul.algo(self._config)
        except CublasLtError as exc:
            log.debug("%s at M=%d: %s", self._config, m, exc)
            plan = None
        else:
            plan = (matmul.launcher(algo), workspace, matmul)  # the descriptors live as long as the plan
        self._plans[index, m] = plan
        return plan

    def _usable(self, a, b, bias) -> tuple | None:
        """The plan for these operands, or None where they are not what it was checked for."""
        k = self._problem.k
        if a.dim() != 2 or a.shape[0] < 1 or a.shape[1] != k or tuple(b.shape) != self._b_shape \
                or a.dtype != self._dtype or b.dtype != self._dtype or not a.is_cuda or b.device != a.device \
                or a.stride() != (k, 1) or b.stride() != self._b_stride \
                or (a.data_ptr() | b.data_ptr()) % cublaslt_binding.ALIGNMENT or not self._bias_usable(bias, a):
            return None
        return self._plan(a.device.index, a.shape[0])

    def _bias_usable(self, bias, a) -> bool:
        """Whether ``bias`` is what the epilogue was checked for: none where the problem has none,
        else (N,) of unit stride, of a's dtype and device, 256-byte aligned."""
        if bias is None or not self._problem.bias:
            return (bias is None) == (not self._problem.bias)
        return (tuple(bias.shape) == (self._problem.n,) and bias.stride() == (1,) and bias.dtype == self._out_dtype
                and bias.device == a.device and bias.data_ptr() % cublaslt_binding.ALIGNMENT == 0)

    def __call__(self, a, b, bias, out=None):
        plan = self._usable(a, b, bias)
        if plan is None:
            return self._fallback(a, b, bias, out)
        return self._run(plan, a, b, bias, out)

    def _run(self, plan: tuple, a, b, bias, out, *scales: int):
        """The product by ``plan``'s algorithm into ``out`` (through a buffer of its own where
        ``out`` is not one it can write), ``scales`` the fp8 scales' pointers (weight, then a)."""
        launch, workspace_bytes, _ = plan
        m, n = a.shape[0], self._problem.n
        result = out
        if out is None or out.shape != (m, n) or out.stride() != (n, 1) or out.dtype != self._out_dtype \
                or out.device != a.device or out.data_ptr() % cublaslt_binding.ALIGNMENT:
            result = torch.empty((m, n), dtype=self._out_dtype, device=a.device)
        # the workspace from the caching allocator, on this stream: safe beside other streams and in graphs
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=a.device) if workspace_bytes else None
        launch(b.data_ptr(), a.data_ptr(), result.data_ptr(), 0 if workspace is None else workspace.data_ptr(),
               workspace_bytes, torch._C._cuda_getCurrentRawStream(a.device.index), 0 if bias is None else bias.data_ptr(),
               *scales)
        result = activation.apply(result, self._activation)
        if out is not None and result is not out:
            return out.copy_(result)
        return result

    def bind(self, a, b, bias) -> BoundCall | None:
        """``api.linear``'s front path for operands like these (its key fixes their shapes,
        strides, dtypes and devices): ``call(a, b, bias, pa, pb, pbias)`` allocating the output
        and launching, with only the 256-byte alignment checked per call. A contiguous ``a`` of
        rank above 2 (a model's (batch, tokens, K) activation) is bound by its rows, its output
        allocated (..., N): no flattening views per call. None where these operands go to
        torch's call."""
        rows = a.view(-1, a.shape[-1]) if a.dim() > 2 and a.is_contiguous() else a
        plan = self._usable(rows, b, bias)
        if plan is None:
            return None
        launch, workspace_bytes, _ = plan
        out_shape, index = (*a.shape[:-1], self._problem.n), a.device.index
        act, fallback = self._activation, self._fallback
        stream = torch._C._cuda_getCurrentRawStream

        def call(a, b, bias, pa: int, pb: int, pbias: int):
            if (pa | pb | pbias) % cublaslt_binding.ALIGNMENT:
                return fallback(a, b, bias)
            out = a.new_empty(out_shape)
            on = stream(index)
            if workspace_bytes:
                workspace = stream_workspace(a, workspace_bytes, index, on)  # held until the launch is queued
                launch(pb, pa, out.data_ptr(), workspace.data_ptr(), workspace_bytes, on, pbias)
            else:
                launch(pb, pa, out.data_ptr(), 0, 0, on, pbias)
            return out if act == "none" else activation.apply(out, act)

        return call


# (GPU index, stream) -> the workspace every bound launch on that stream shares, grown to the most
# any asked for. Launches on one stream run in its order, so one buffer serves them all, as torch
# keeps one per stream for its own cuBLAS calls; allocating a 4-byte workspace per call cost 4.5
# us of a 47 us call (lt-call-h200-20261129.json). A call being captured into a CUDA graph gets
# one of its own: a replay may run on another stream than the one it was captured on.
_WORKSPACES: dict[tuple[int, int], torch.Tensor] = {}


def stream_workspace(a: torch.Tensor, nbytes: int, index: int, stream: int) -> torch.Tensor:
    """A workspace of ``nbytes`` at least for a launch on ``stream`` of GPU ``index``; the caller
    holds it until the launch is queued (a grown one frees the one it replaces, in stream order)."""
    if torch._C._cuda_isCurrentStreamCapturing():
        return a.new_empty(nbytes, dtype=torch.uint8)
    held = _WORKSPACES.get((index, stream))
    if held is None or held.numel() < nbytes:
        held = _WORKSPACES[index, stream] = a.new_empty(nbytes, dtype=torch.uint8)
    return held


class LtScaledKernel(LtKernel):
    """An fp8 product scaled per tensor: ``kernel(a, b, bias, scale_a, scale_b, out=None)`` as
    ``triton_scaled``'s kernels are called, each scale a float32 of one element on a's GPU. Other
    operands (or scales) than the algorithm was checked for go to ``torch._scaled_mm``."""

    def __call__(self, a, b, bias, scale_a, scale_b, out=None):
        plan = self._usable(a, b, bias)
        if plan is None or not all(_one_scale(s, a) for s in (scale_a, scale_b)):
            return self._fallback(a, b, bias, scale_a, scale_b, out)
        return self._run(plan, a, b, bias, out, scale_b.data_ptr(), scale_a.data_ptr())

    def bind(self, a, b, bias) -> BoundCall | None:
        return None  # fp8 calls are served through serving.scaled, which binds nothing


def _one_scale(scale, a) -> bool:
    """A per-tensor scale cuBLAS reads from its pointer: one float32 on a's GPU."""
    return isinstance(scale, torch.Tensor) and scale.numel() == 1 and scale.dtype == torch.float32 \
        and scale.device == a.device


def serves_scaled(problem: Problem) -> bool:
    """The fp8 products cuBLASLt's per-tensor kernels take: scaled per tensor, and what torch's
    ``_scaled_mm`` (cuBLASLt's first algorithm) takes (``cublas.scaled_mm_takes``)."""
    return problem.scaling == "tensor" and cublas.scaled_mm_takes(problem)


class CublasLtBackend:
    name = "cublaslt"
    space_size = HEURISTICS - 1

    def is_available(self, device: Device) -> bool:
        if device.interpreter or not torch.cuda.is_available():
            return False
        try:
            cublaslt_binding.library()
        except (CublasLtError, OSError) as exc:
            log.debug("cuBLASLt cannot be called directly: %s", exc)
            return False
        return True

    def candidates(self, problem: Problem, device: Device) -> list[LtConfig]:
        if device.interpreter or not problem.rows_aligned or (problem.scaled and not serves_scaled(problem)):
            return []
        try:
            return list(_ranked(problem, torch.cuda.current_device()))
        except (CublasLtError, ValueError) as exc:  # tuning goes on without them
            log.warning("gemmtune: no cuBLASLt algorithms for %s: %s", problem.describe(), exc)
            return []

    def predict_ms(self, problem: Problem, device: Device, config) -> float | None:
        return None

    def parse_config(self, data: Mapping) -> LtConfig:
        return config_from_mapping(self.name, data, LtConfig)

    def build(self, problem: Problem, config: LtConfig, device: Device) -> LtKernel:
        if problem.scaled:
            if not serves_scaled(problem):
                raise ValueError(f"cublaslt serves fp8 products scaled per tensor with 16-byte rows, one e4m3 "
                                 f"operand at least and no bias with a float32 output; got {problem.describe()}")
            return LtScaledKernel(problem, config, device)
        return LtKernel(problem, config, device)


BACKEND = CublasLtBackend()
