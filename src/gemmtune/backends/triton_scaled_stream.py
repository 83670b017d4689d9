"""``triton_scaled_stream``: the fp8 (scaled) twin of ``triton_stream``, the Hopper decode GEMM
whose weights arrive by TMA (kernels/scaled_stream.py).

Decode products (M <= 64) are bound by the weight bytes, and fp8 weights are half of bf16's; the
tiled fp8 kernel (``triton_scaled``, pointer loads) reached about 1.5x bf16 cuBLAS at M = 16 on
an H100. This one streams the weights as ``triton_stream`` does: persistent programs, their K
loops flattened into one pipeline, the weight tile on the warpgroup MMA's wide side. It serves
``Problem.scaled`` problems whose rows are 16-byte aligned (K % 16 == 0; N may be anything) and
is called as ``triton_scaled``'s kernels are: ``kernel(a, b, bias, scale_a, scale_b, out=None)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from gemmtune.backends import costmodel
from gemmtune.backends.base import KernelBase, check_bounds, config_from_mapping, triton_runs
from gemmtune.backends.launch import Launcher
from gemmtune.backends.triton_persistent import tma_ready
from gemmtune.backends.triton_scaled import (INTERPRETER_SPLITS, K_BLOCK_SIZES, SPLITS, SplitReduce,
                                             scale_strides, splits)
from gemmtune.backends.triton_stream import BLOCK_M, BLOCK_N, MAX_M, STAGES, WARPS, StreamConfig, narrow_block
from gemmtune.device import Device
from gemmtune.problem import SCALE_BLOCK, Problem, torch_dtypes
from gemmtune.scaling import check_scales

# (BLOCK_N, BLOCK_K, num_warps, num_stages), not yet measured: triton_stream's winners on the
# H200 (64x256 on 4 stages, 128x128 on 3) as the same bytes in flight of 1-byte weights (K twice
# as deep, or twice the stages), and 128-deep K tiles, the only ones block scaling takes.
TILES = ((64, 256, 4, 8), (128, 256, 4, 3), (64, 128, 4, 8), (128, 128, 4, 6))
INTERPRETER_TILES = ((16, 32, 1, 1), (16, 64, 1, 1))
ROW_ALIGN = 16  # fp8 values in 16 bytes: a TMA descriptor's rows start on 16-byte boundaries


@dataclass(frozen=True)
class ScaledStreamConfig(StreamConfig):
    """``StreamConfig`` with K tiles of 32 and more (an fp8 tensor-core product takes K in steps of
    32) and SPLIT_K (kernels/scaled_stream.py)."""

    FIELDS = {"BLOCK_M": "block_m", "BLOCK_N": "block_n", "BLOCK_K": "block_k", "SPLIT_K": "split_k",
              "num_warps": "num_warps", "num_stages": "num_stages"}  # persisted name -> attribute

    split_k: int = 1

    def __post_init__(self) -> None:
        check_bounds("triton_scaled_stream", (
            ("BLOCK_M", self.block_m, BLOCK_M), ("BLOCK_N", self.block_n, BLOCK_N),
            ("BLOCK_K", self.block_k, K_BLOCK_SIZES), ("SPLIT_K", self.split_k, SPLITS),
            ("num_warps", self.num_warps, WARPS), ("num_stages", self.num_stages, STAGES)))


def _served(problem: Problem) -> bool:
    """An fp8 product of at most MAX_M rows whose rows a descriptor can address."""
    return problem.scaled and problem.m <= MAX_M and problem.k % ROW_ALIGN == 0


def space(problem: Problem, device: Device) -> list[ScaledStreamConfig]:
    """The tiles for this problem on this device: Hopper (or the interpreter), served problems
    only, K tiles inside one scale block under block scaling, pipelines no deeper than K has
    steps and cut to what shared memory holds, each with the K splits ``triton_scaled.splits``
    allows its tiles (more than one where they leave SMs idle)."""
    if not _served(problem):
        return []
    block_m = narrow_block(problem.m)
    if device.interpreter:
        return [ScaledStreamConfig(block_m, bn, bk, warps, stages, split) for bn, bk, warps, stages in INTERPRETER_TILES
                for split in INTERPRETER_SPLITS]
    if not device.is_hopper:
        return []
    configs = []
    for bn, bk, warps, stages in TILES:
        if problem.scaling == "block" and SCALE_BLOCK % bk:
            continue
        fit = device.smem_per_block // ((block_m + bn) * bk * problem.element_size)
        stages = min(stages, max(2, -(-problem.k // bk)), fit)
        if stages >= 2:
            tiles = -(-problem.n // bn) * -(-problem.m // block_m)
            configs += [ScaledStreamConfig(block_m, bn, bk, warps, stages, split)
                        for split in splits(problem, device, tiles, bk)]
    return configs


class ScaledStreamKernel(KernelBase):
    """``kernel(a, b, bias, scale_a, scale_b, out=None)`` as ``ScaledKernel``'s: a (M, K) and b
    (N, K) fp8 (copied where a descriptor cannot address them: ``tma_ready``), float32 scales as
    ``Problem.scaling`` lays them, any strides, bias (N,) and out (M, N) of the output dtype.
    Launched through ``launch.Launcher``; each call builds its two descriptors."""

    def __init__(self, problem: Problem, config: ScaledStreamConfig, device: Device) -> None:
        from triton.tools.tensor_descriptor import TensorDescriptor

        from gemmtune.backends.kernels.scaled_stream import scaled_stream_matmul  # imports triton

        self._launch = Launcher(scaled_stream_matmul)
        self._descriptor = TensorDescriptor
        self._config = config
        self._scaling = problem.scaling
        self._out_dtype = torch_dtypes()[problem.out_dtype]
        self._slots = config.slots(problem.element_size, device)
        self._reduce = SplitReduce(problem, config.split_k, config.block_m) if config.split_k > 1 else None
        base = dict(SCALING=problem.scaling, ACTIVATION=problem.activation, SPLIT_K=config.split_k,
                    BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                    num_warps=config.num_warps, num_stages=config.num_stages)
        self._constexprs = {bias: dict(base, HAS_BIAS=bias) for bias in (False, True)}

    def __call__(self, a, b, bias, scale_a, scale_b, out=None):
        c = self._config
        (m, k), n = a.shape, b.shape[0]
        check_scales(self._scaling, m, n, k, scale_a, scale_b)
        a, b = tma_ready(a), tma_ready(b)
        if out is None:
            out = a.new_empty((m, n), dtype=self._out_dtype)
        bias_arg, stride_bias = (bias, bias.stride(0)) if bias is not None else (out, 0)
        ws = out if c.split_k == 1 else a.new_empty((c.split_k, m, n), dtype=torch.float32)
        tensors = (a, b, out, bias_arg, scale_a, scale_b, ws)
        pointers = tuple(t.data_ptr() for t in tensors)
        # everything Triton specializes on: devices, dtypes, shapes and exact strides of every
        # tensor (the descriptors' shapes, strides and the sizes follow), 16-byte offsets
        guard = (a.get_device(), *((t.get_device(), t.dtype, t.shape, t.stride()) for t in tensors),
                 tuple(p & 15 for p in pointers), bias is not None)
        a_desc = self._descriptor(a, [m, k], [a.stride(0), 1], [c.block_m, c.block_k])
        b_desc = self._descriptor(b, [n, k], [b.stride(0), 1], [c.block_n, c.block_k])
        units = -(-n // c.block_n) * -(-m // c.block_m) * c.split_k
        programs = min(self._slots, units)  # persistent: no more than work units
        k_tiles = -(-(-(-k // c.block_k)) // c.split_k)  # K tiles per slice
        (sam, sak), (sbn, sbk) = scale_strides(scale_a), scale_strides(scale_b)
        scalars = (m, n, k, k_tiles, out.stride(0), out.stride(1), stride_bias, sam, sak, sbn, sbk, programs)
        self._launch((programs, 1, 1), guard, (a_desc, b_desc, *tensors[2:]), (a_desc, b_desc, *pointers[2:]),
                     scalars, self._constexprs[bias is not None])
        if self._reduce is not None:
            self._reduce(guard, ws, out, bias, scale_a, scale_b)
        return out


class TritonScaledStreamBackend:
    name = "triton_scaled_stream"
    space_size = len(TILES) * len(SPLITS)

    def is_available(self, device: Device) -> bool:
        return triton_runs(device) and (device.interpreter or device.is_hopper)

    def candidates(self, problem: Problem, device: Device) -> list[ScaledStreamConfig]:
        return space(problem, device)

    def predict_ms(self, problem: Problem, device: Device, config: ScaledStreamConfig) -> float | None:
        """The weights streamed once (``costmodel.splitk_ms``), a split's reduction launch added."""
        c = config
        ms = costmodel.splitk_ms(problem, device, c.block_m, c.block_n, c.split_k, c.block_k, c.num_stages,
                                 use_dot=True, num_warps=c.num_warps)
        return ms + (costmodel.LAUNCH_MS if c.split_k > 1 else 0.0)

    def parse_config(self, data: Mapping) -> ScaledStreamConfig:
        return config_from_mapping(self.name, data, ScaledStreamConfig)

    def build(self, problem: Problem, config: ScaledStreamConfig, device: Device) -> ScaledStreamKernel:
        if not problem.scaled:
            raise ValueError(f"triton_scaled_stream serves fp8 (scaled) problems only, got {problem.describe()}")
        if problem.k % ROW_ALIGN:
            raise ValueError(f"triton_scaled_stream reads 16-byte rows by TMA: K={problem.k}; accepted: "
                             f"K % {ROW_ALIGN} == 0")
        if problem.scaling == "block" and SCALE_BLOCK % config.block_k:
            raise ValueError(f"triton_scaled_stream BLOCK_K={config.block_k} does not divide the scale block "
                             f"({SCALE_BLOCK}) of block scaling; accepted: 32, 64, 128")
        return ScaledStreamKernel(problem, config, device)


BACKEND = TritonScaledStreamBackend()
