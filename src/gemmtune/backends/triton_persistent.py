"""``triton_persistent``: the Hopper persistent TMA GEMM, one program per SM walking the tiles,
optionally warp-specialized (producer warps issuing TMA, consumer warps the matrix ops). Offered
on Hopper (and the interpreter, for tests) for half-precision problems whose rows are 16-byte
aligned, whose M fills at least one 64-row tile and whose output's tiles keep the GPU's SMs busy
(see ``space``); misaligned shapes go to ``cublas_padded`` instead."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from gemmtune.backends import costmodel
from gemmtune.backends.base import FieldConfig, KernelBase, check_bounds, config_from_mapping, triton_runs
from gemmtune.backends.launch import unit_stride_bias
from gemmtune.device import Device
from gemmtune.problem import Problem

BLOCK_SIZES = (16, 32, 64, 128, 256)
GROUP_SIZES = (1, 2, 4, 8, 16)
WARPS = (1, 4, 8)
STAGES = (1, 2, 3, 4, 5, 6)
MAX_ACC_REGS = 128
MIN_M = 64  # a warpgroup's matrix instruction covers 64 rows; decode shapes belong to split-K
MIN_WAVE_FILL = 0.9  # the share of the programs that the last round of tiles must keep busy

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps), each tried with the stages below. Without warp
# specialization: Triton 3.6 compiles WARP_SPECIALIZE=True on this loop to the same PTX for Hopper
# (a CPU test compares them), so offering both timed every kernel twice. A stored config that
# has it still builds, and runs that same kernel.
TILES = ((128, 256, 64, 8), (256, 128, 64, 8), (128, 128, 64, 8), (128, 128, 64, 4),
         (128, 128, 128, 8), (64, 256, 64, 4), (128, 64, 64, 4), (64, 128, 64, 4))
STAGE_CHOICES = (3, 4)
INTERPRETER_TILES = ((16, 16, 16, 1), (32, 16, 32, 1))


@dataclass(frozen=True)
class PersistentConfig(FieldConfig):
    FIELDS = {"BLOCK_M": "block_m", "BLOCK_N": "block_n", "BLOCK_K": "block_k", "GROUP_M": "group_m",
              "num_warps": "num_warps", "num_stages": "num_stages", "WARP_SPECIALIZE": "warp_specialize"}  # persisted name -> attribute

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    warp_specialize: bool = False

    def __post_init__(self) -> None:
        checks = (("BLOCK_M", self.block_m, BLOCK_SIZES), ("BLOCK_N", self.block_n, BLOCK_SIZES),
                  ("BLOCK_K", self.block_k, BLOCK_SIZES), ("GROUP_M", self.group_m, GROUP_SIZES),
                  ("num_warps", self.num_warps, WARPS), ("num_stages", self.num_stages, STAGES))
        check_bounds("triton_persistent", checks)
        if not isinstance(self.warp_specialize, bool):
            raise ValueError(f"triton_persistent WARP_SPECIALIZE={self.warp_specialize!r} must be true or false")

    def smem_bytes(self, element_size: int) -> int:
        """The operand pipeline plus the output tile staged for the TMA store."""
        pipeline = self.num_stages * (self.block_m + self.block_n) * self.block_k
        return (pipeline + self.block_m * self.block_n) * element_size




def space(problem: Problem, device: Device) -> list[PersistentConfig]:
    """Configs for this problem on this device, pruned by shared memory and registers, and to
    tiles of which the persistent programs get more than one each and fill their last round to
    at least MIN_WAVE_FILL. With one tile a program it computes as the tiled kernel does; on the
    H200 suite's rows with so few tiles (the seeds' MLP, odd-1k, the m=128 rows) it never beat
    cuBLAS (0.99x at best). With a last round half empty it ran at about the fill's share of
    cuBLAS's speed (the m=128 rows at 38 SMs: 48 tiles of 128x128 on 38 programs, 0.63x). And none
    for float32: on the suite's one TF32 row (square-4k.tf32, five runs at 38 to 132 SMs) it ran
    at 0.28-0.29x of cuBLAS. Compiling it there only lengthened tuning."""
    if device.interpreter:
        return [PersistentConfig(bm, bn, bk, 8, w, 1) for bm, bn, bk, w in INTERPRETER_TILES]
    if not device.is_hopper or problem.m < MIN_M or problem.dtype == "float32":
        return []
    configs = []
    for bm, bn, bk, warps in TILES:
        tiles = -(-problem.m // bm) * -(-problem.n // bn)
        rounds = -(-tiles // device.sm_count)
        if tiles <= device.sm_count or tiles < MIN_WAVE_FILL * rounds * device.sm_count:
            continue
        for stages in STAGE_CHOICES:
            config = PersistentConfig(bm, bn, bk, 8, warps, stages)
            fits = config.smem_bytes(problem.element_size) <= device.smem_per_block
            if fits and bm * bn // (32 * warps) <= MAX_ACC_REGS:
                configs.append(config)
    return configs


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` if a descriptor can address it (unit column stride, 16-byte aligned rows and base),
    else a contiguous copy: right answers for any view, the copy's cost only for odd ones."""
    if t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0:
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


class PersistentKernel(KernelBase):
    """2-D ``a`` only, nothing to bind (``KernelBase``'s defaults): each call builds its
    descriptors and launches through the JIT."""

    def __init__(self, problem: Problem, config: PersistentConfig, device: Device) -> None:
        from triton.tools.tensor_descriptor import TensorDescriptor

        from gemmtune.backends.kernels.persistent import persistent_matmul

        self._kernel = persistent_matmul
        self._descriptor = TensorDescriptor
        self._linear = problem.layout == "linear"
        self._config = config
        self._sm_count = device.sm_count
        self._constexprs = dict(
            B_IS_NK=self._linear, ACTIVATION=problem.activation, PRECISION="tf32" if problem.tf32 else "ieee",
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
            WARP_SPECIALIZE=config.warp_specialize, num_warps=config.num_warps, num_stages=config.num_stages,
        )

    def __call__(self, a, b, bias, out=None):
        c = self._config
        a, b, bias = tma_ready(a), tma_ready(b), unit_stride_bias(bias)
        m, k = a.shape
        n = b.shape[0] if self._linear else b.shape[1]
        result = torch.empty((m, n), dtype=a.dtype, device=a.device)
        if out is not None and tma_ready(out) is out:
            result = out
        a_desc = self._descriptor(a, [m, k], [a.stride(0), 1], [c.block_m, c.block_k])
        if self._linear:
            b_desc = self._descriptor(b, [n, k], [b.stride(0), 1], [c.block_n, c.block_k])
        else:
            b_desc = self._descriptor(b, [k, n], [b.stride(0), 1], [c.block_k, c.block_n])
        c_desc = self._descriptor(result, [m, n], [result.stride(0), 1], [c.block_m, c.block_n])
        tiles = -(-m // c.block_m) * -(-n // c.block_n)
        programs = min(self._sm_count, tiles)
        # The compiled kernel is kept for inspection: its SASS, registers and spills.
        self.compiled = self._kernel[(programs,)](a_desc, b_desc, c_desc, result if bias is None else bias,
                                                  m, n, k, programs, HAS_BIAS=bias is not None, **self._constexprs)
        if out is not None and result is not out:
            out.copy_(result)
            return out
        return result


class TritonPersistentBackend:
    name = "triton_persistent"
    space_size = len(TILES) * len(STAGE_CHOICES)

    def is_available(self, device: Device) -> bool:
        return triton_runs(device) and (device.interpreter or device.is_hopper)

    def candidates(self, problem: Problem, device: Device) -> list[PersistentConfig]:
        return space(problem, device) if problem.rows_aligned else []

    def predict_ms(self, problem: Problem, device: Device, config) -> float | None:
        return costmodel.tile_gemm_ms(problem, device, config.block_m, config.block_n, config.block_k,
                                      config.num_stages)

    def parse_config(self, data: Mapping) -> PersistentConfig:
        return config_from_mapping(self.name, data, PersistentConfig)

    def build(self, problem: Problem, config: PersistentConfig, device: Device) -> PersistentKernel:
        return PersistentKernel(problem, config, device)


BACKEND = TritonPersistentBackend()
