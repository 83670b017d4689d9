"""``triton_stream``: the Hopper decode GEMM whose weights arrive by TMA (kernels/stream.py).

For 2 <= M <= 64 with 16-byte aligned rows. Persistent programs, their K loops flattened into
one pipeline, the weight tile on the warpgroup MMA's wide side. On the H200's m=16 decode rows
it read the weights 1-5% faster than the best split-K tile and cuBLAS (docs/performance.md, the TMA stream kernel); at M = 1
the split-K backend's GEMV programs read faster still, so M = 1 is left to them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gemmtune.backends import costmodel
from gemmtune.backends.base import BoundCall, FieldConfig, KernelBase, check_bounds, config_from_mapping, triton_runs
from gemmtune.backends.launch import Launcher, gemm_guard, reads_bias_in_place, unit_stride_bias
from gemmtune.backends.triton_persistent import tma_ready
from gemmtune.device import Device
from gemmtune.problem import Problem

BLOCK_M = (16, 32, 64)  # the rows of A: the MMA's narrow side, M rounded up to a power of two
BLOCK_N = (16, 64, 128)  # weight rows per tile: the warpgroup MMA's wide side (16 under the interpreter)
BLOCK_K = (16, 32, 64, 128, 256)
WARPS = (1, 4)
STAGES = (1, 2, 3, 4, 5, 6, 7, 8)
MIN_M, MAX_M = 2, 64
# (BLOCK_N, BLOCK_K, num_warps, num_stages): the two best of a sweep of 40 tiles on the H200's
# m=16 and m=32 rows (stream-sweep-h200-20261122.json): 64x256 on 4 stages won qkv, o and down,
# 128x128 on 3 stages gate_up. 64x256 on a fifth stage (205 KB: M <= 16 only) read down and kv
# 3% and 7% faster in a model's chain of layers, qkv 3% slower (chain-stream-tiles-h200-20261123.json).
TILES = ((64, 256, 4, 4), (64, 256, 4, 5), (128, 128, 4, 3))
INTERPRETER_TILES = ((16, 16, 1, 1), (16, 32, 1, 1))
MAX_RESIDENT = 2  # programs per SM, where shared memory holds two pipelines
MAX_WEIGHT_MAPS = 8  # weights' TMA maps a bound launch keeps: a model's layers of one shape share it


@dataclass(frozen=True)
class StreamConfig(FieldConfig):
    FIELDS = {"BLOCK_M": "block_m", "BLOCK_N": "block_n", "BLOCK_K": "block_k",
              "num_warps": "num_warps", "num_stages": "num_stages"}  # persisted name -> attribute

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        check_bounds("triton_stream", (
            ("BLOCK_M", self.block_m, BLOCK_M), ("BLOCK_N", self.block_n, BLOCK_N),
            ("BLOCK_K", self.block_k, BLOCK_K), ("num_warps", self.num_warps, WARPS),
            ("num_stages", self.num_stages, STAGES)))

    def smem_bytes(self, element_size: int) -> int:
        """The operand pipeline: a tile of weights and one of A per stage."""
        return self.num_stages * (self.block_m + self.block_n) * self.block_k * element_size

    def slots(self, element_size: int, device: Device) -> int:
        """How many programs fit on the device's SMs at once: the most a persistent grid holds."""
        resident = max(1, min(MAX_RESIDENT, device.smem_per_block // max(1, self.smem_bytes(element_size))))
        return resident * device.sm_count


def narrow_block(m: int) -> int:
    """The A rows a tile takes as the warpgroup MMA's narrow side: M up to a power of two, 16 at
    least."""
    return max(16, 1 << max(0, (m - 1).bit_length()))


def space(problem: Problem, device: Device) -> list[StreamConfig]:
    """The tiles for this problem on this device: Hopper (or the interpreter), 2 <= M <= 64,
    pipelines no deeper than K has steps, within shared memory."""
    if not MIN_M <= problem.m <= MAX_M:
        return []
    if device.interpreter:
        return [StreamConfig(narrow_block(problem.m), bn, bk, warps, stages) for bn, bk, warps, stages in INTERPRETER_TILES]
    if not device.is_hopper:
        return []
    configs = []
    for bn, bk, warps, stages in TILES:
        stages = max(2, min(stages, -(-problem.k // bk)))
        config = StreamConfig(narrow_block(problem.m), bn, bk, warps, stages)
        if config.smem_bytes(problem.element_size) <= device.smem_per_block and config not in configs:
            configs.append(config)
    return configs


class StreamKernel(KernelBase):
    """Launched through ``launch.Launcher``: after a guard's first call, Triton's launcher is
    called directly with the descriptors (it encodes their TMA maps), skipping the JIT's
    dispatch. ``bind`` goes further for linear's front path (see ``_bound``)."""

    serves_any_rank = True  # x (..., K) in layout linear: its rows are one (M, K) operand

    def __init__(self, problem: Problem, config: StreamConfig, device: Device) -> None:
        from triton.tools.tensor_descriptor import TensorDescriptor

        from gemmtune.backends.kernels.stream import stream_matmul

        self._launch = Launcher(stream_matmul)
        self._descriptor = TensorDescriptor
        self._linear = problem.layout == "linear"
        self._config = config
        self._slots = config.slots(problem.element_size, device)
        base = dict(
            B_IS_NK=self._linear, ACTIVATION=problem.activation, PRECISION="tf32" if problem.tf32 else "ieee",
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        self._constexprs = {bias: dict(base, HAS_BIAS=bias) for bias in (False, True)}

    def __call__(self, a, b, bias, out=None):
        if a.dim() != 2:
            if out is not None:
                raise ValueError(f"out= takes a 2-D a, got a of shape {tuple(a.shape)}")
            n = b.shape[0] if self._linear else b.shape[1]
            return self(a.reshape(-1, a.shape[-1]), b, bias).view(*a.shape[:-1], n)
        c = self._config
        a, b, bias = tma_ready(a), tma_ready(b), unit_stride_bias(bias)
        m, k = a.shape
        n = b.shape[0] if self._linear else b.shape[1]
        pa, pb, pbias = a.data_ptr(), b.data_ptr(), bias.data_ptr() if bias is not None else 0
        guard = gemm_guard(a, b, bias, out, a.stride(), b.stride(), pa, pb, pbias)
        if out is None:
            out = a.new_empty((m, n))
        po = out.data_ptr()
        a_desc = self._descriptor(a, [m, k], [a.stride(0), 1], [c.block_m, c.block_k])
        b_desc = self._descriptor(b, *self._weight_box(b, n, k))
        grid, scalars = self._grid_and_scalars(m, n, k, out.stride())
        self._launch(grid, guard, (a_desc, b_desc, out, out if bias is None else bias),
                     (a_desc, b_desc, po, po if bias is None else pbias), scalars, self._constexprs[bias is not None])
        return out

    def _grid_and_scalars(self, m: int, n: int, k: int, out_strides: tuple) -> tuple[tuple[int, int, int], tuple]:
        """The persistent grid (no more programs than tiles) and the scalar arguments."""
        c = self._config
        programs = min(self._slots, -(-n // c.block_n) * -(-m // c.block_m))
        return (programs, 1, 1), (m, n, k, out_strides[0], out_strides[1], programs)

    def _weight_box(self, b, n: int, k: int) -> tuple[list, list, list]:
        """The weights' shape, strides and block as their descriptor takes them."""
        c = self._config
        if self._linear:
            return [n, k], [b.stride(0), 1], [c.block_n, c.block_k]
        return [k, n], [b.stride(0), 1], [c.block_k, c.block_n]

    def bind(self, a, b, bias) -> BoundCall | None:
        """For linear's front path: a call ``call(x, w, bias, px, pw, pbias)`` for operands laid
        out as these (contiguous x of any rank, a bias read in place), once a call like this one
        has made the binary; else None. It encodes x's TMA map from its address and calls
        Triton's C launcher itself, skipping the descriptor objects and the launcher's Python
        wrapper that the plain call pays: the weights' maps are encoded once per weight address
        (the front path's key fixes their shape, not which tensor they are)."""
        k = a.shape[-1]
        if not a.is_contiguous() or tma_ready(b) is not b or a.data_ptr() % 16 or (k * a.element_size()) % 16 \
                or not reads_bias_in_place(bias):
            return None
        a2 = a.reshape(-1, k)
        m, n = a2.shape[0], (b.shape[0] if self._linear else b.shape[1])
        out_shape = (*a.shape[:-1], n)
        pbias = bias.data_ptr() if bias is not None else 0
        guard = gemm_guard(a2, b, bias, None, (k, 1), b.stride(), a2.data_ptr(), b.data_ptr(), pbias)
        direct = self._launch.direct(guard, *self._grid_and_scalars(m, n, k, (n, 1)))
        encoders = None if direct is None else _tma_encoders(direct[0])
        if encoders is None:
            return None
        return self._bound(direct, encoders, (m, k), self._weight_box(b, n, k), out_shape, bias is not None)

    def _bound(self, direct: tuple, encoders: tuple, a_shape: tuple, w_box: tuple, out_shape: tuple,
               has_bias: bool):
        _, (gx, gy, gz), stream, device, function, prefix, rest, _ = direct
        launch, encode_a, encode_w = encoders
        a_box = ([a_shape[0], a_shape[1]], [a_shape[1], 1])
        a_dims = (*a_box[0], *a_box[1])
        weights: dict[int, list] = {}  # weight address -> its encoded map, shape and strides
        kernel, hooked = self, self._launch.hooked

        def call(a, b, bias, pa: int, pb: int, pbias: int):
            if hooked():
                return kernel(a, b, bias)
            w_args = weights.get(pb)
            if w_args is None:
                if len(weights) >= MAX_WEIGHT_MAPS:
                    weights.clear()
                w_args = weights[pb] = encode_w(pb, *w_box[:2])
            out = a.new_empty(out_shape)
            po = out.data_ptr()
            launch(gx, gy, gz, stream(device), function, *prefix, encode_a(pa, *a_box), *a_dims, *w_args,
                   po, pbias if has_bias else po, *rest)
            return out

        return call


def _tma_encoders(launch) -> tuple | None:
    """(launch, encode for A, encode for B) behind Triton's descriptor wrapper ``launch`` (the
    binary's launcher as ``launch.Launcher`` keeps it), or None where it is not the wrapper this
    was written against (triton 3.6: a closure holding the C launcher and each descriptor's
    metadata). Each encode(address, shape, strides) returns a TMA map and is what the wrapper
    does per descriptor, per call."""
    cells = getattr(launch, "__closure__", None)
    names = getattr(getattr(launch, "__code__", None), "co_freevars", ())
    if not cells or len(cells) != len(names):
        return None
    env = dict(zip(names, (cell.cell_contents for cell in cells)))
    metas = env.get("tensordesc_meta")
    if "launcher" not in env or not metas or len(metas) != 2 or any(m is None or m.get("fp4_padded") for m in metas):
        return None
    import triton
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    fill = triton.runtime.driver.active.utils.fill_tma_descriptor

    def encoder(meta):
        args = (meta["swizzle"], meta["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], meta["block_size"])
        return lambda address, shape, strides: fill(address, *args, shape, strides, 0)

    encode_a, encode_w_map = encoder(metas[0]), encoder(metas[1])
    return env["launcher"], encode_a, lambda address, shape, strides: [encode_w_map(address, shape, strides),
                                                                      *shape, *strides]


class TritonStreamBackend:
    name = "triton_stream"
    space_size = len(TILES)

    def is_available(self, device: Device) -> bool:
        return triton_runs(device) and (device.interpreter or device.is_hopper)

    def candidates(self, problem: Problem, device: Device) -> list[StreamConfig]:
        return space(problem, device) if problem.rows_aligned else []

    def predict_ms(self, problem: Problem, device: Device, config) -> float | None:
        return costmodel.splitk_ms(problem, device, config.block_m, config.block_n, 1, config.block_k,
                                   config.num_stages, use_dot=True, num_warps=config.num_warps)

    def parse_config(self, data: Mapping) -> StreamConfig:
        return config_from_mapping(self.name, data, StreamConfig)

    def build(self, problem: Problem, config: StreamConfig, device: Device) -> StreamKernel:
        return StreamKernel(problem, config, device)


BACKEND = TritonStreamBackend()
