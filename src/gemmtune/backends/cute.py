"""``cute``: CUTLASS's CuTe DSL GEMM for Hopper (warpgroup matrix instructions, TMA loads and
store, thread-block clusters, a persistent tile scheduler), tuned the way the seeds' CUTLASS
guidance describes. The kernels are QuACK's (``quack-kernels``, with ``nvidia-cutlass-dsl``: the
optional extra ``gemmtune[cute]``), used as a library; gemmtune's part is the method: the space
(``space``), its pruning by the device's shared memory and the problem's shape, the cost model's
ranking, verification, side-by-side timing, the choice and the store.

A problem with an activation (``relu``, ``gelu``, ``gelu_tanh``, ``silu``) runs QuACK's GEMM with
that activation in its epilogue (``gemm_act``, the pre-activation not stored): the exact-erf GELU
of timm's and transformers' MLP blocks included, which cuBLASLt's epilogues approximate with tanh.
Such a kernel runs as the product itself, never as its transpose (``swap_ab`` would turn the bias
into a column), so a fused problem with fewer than SMALL rows has no candidates here.

A config is one CuTe DSL kernel: its CTA tile (M x N; K is 128 bytes per stage, as
many stages as the shared memory holds), its cluster shape, cooperative or ping-pong warpgroups,
a static or dynamic persistent schedule, and whether A and B trade places (``swap_ab``: a
problem with few rows runs as its transpose, its rows on the tile's N side). Blackwell's family
(sm_100: 128- and 256-row tiles, 2-CTA instructions with an even cluster M) is defined and its
configs validated, but not run here: ``is_available`` offers the backend on sm_90 only.

An fp8 product scaled per tensor or per row (``SCALINGS``) runs QuACK's GEMM with precise
accumulation (each K tile's fp8 sums added into a second float32 accumulator) and an epilogue of
gemmtune's (``scaled_epilogue``: the sums times A's and B's scales, plus the bias), as itself
only, on tiles of its own (``SCALED_TILES``: the two accumulators of a larger tile spill).

CuTe DSL compiles one kernel at a time in a process: compiled from several threads at once (the
tuner compiles candidates ahead in threads, and tunes several GPUs from a thread each), every
config failed with "The compiler could not build valid IR for this code", where each alone
compiled and computed right. So a kernel's first call, which compiles it, holds a lock.

Compiling a config takes CuTe DSL about 1.3 s. QuACK keeps each compiled kernel in process under
its dtypes and config and exports it as an object file that a new process reloads in about a
millisecond; gemmtune points that cache into its own cache directory (``cute/``, unless
``QUACK_CACHE_DIR`` says otherwise), beside the store that keeps the tuning results. A kernel's
first call that compiled it also leaves a marker (``cute-compiled/``) naming its kind of problem
and config, so that the tuner knows which configs cost a problem no compiling (``compiled``): it
screens those whole, side by side, as a library's algorithms. On an H100 the roofline ranked
these kernels poorly: its first 6 held a config within 2% of the best of 44 on 3 of 8 prefill
shapes, its first 24 on 6 (``cute-h100-20261127.json``).

One compile at a time, a model's share of configs took minutes (ViT-B/16's first tuning on an
H100: 125 s). So the tuner's candidates are compiled together (``compile_together``) by QuACK's
pool of GPU-blind worker processes, side by side; each candidate's first call in this process
then loads the object file a worker exported.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from gemmtune.backends import cluster_occupancy, costmodel, quack_source_key
from gemmtune.backends.base import FieldConfig, KernelBase, config_from_mapping
from gemmtune.backends.triton_persistent import tma_ready
from gemmtune.device import Device, current, kernel_library_versions
from gemmtune.problem import Problem, torch_dtypes
from gemmtune.scaling import check_scales
from gemmtune.settings import cache_dir

NAME = "cute"
STAGE_K_BYTES = 128  # one 128-byte swizzled row of K per pipeline stage: 64 16-bit or 128 fp8 elements
MIN_STAGES = 2  # a pipeline of fewer stages cannot overlap TMA loads with the matrix instructions
BARRIER_BYTES = 1024  # the pipeline's mbarriers and the tile scheduler's state
RUNNABLE_ARCHS = (9,)  # the compute capabilities the backend is offered on (sm_100: defined only)
DTYPES = ("bfloat16", "float16")
SCALED_DTYPES = ("float8_e4m3fn", "float8_e5m2")  # fp8 products, their partial sums promoted to float32
SCALINGS = ("tensor", "row")  # the fp8 scalings its epilogue applies (``scaled_epilogue``)
SMALL = 64  # a side shorter than this runs on the tile's N side (swap_ab) or not at all
# gemmtune's activations -> the names of QuACK's epilogue activations (quack.activation.act_fn_map)
EPILOGUES = {"none": None, "relu": "relu", "gelu": "gelu_erf", "gelu_tanh": "gelu_tanh_approx", "silu": "silu"}

# (tile_m, tile_n, pingpong) per compute capability major. sm_90: two cooperative warpgroups on a
# 256-row tile (or 128 rows at the widest N), or two ping-pong warpgroups each on its own 128-row
# tile; sm_100: one MMA warp on 128 or 256 rows (256: the 2-CTA instruction), no ping-pong.
TILES = {
    9: tuple([(256, n, False) for n in (128, 160, 192, 208)] + [(128, 224, False), (128, 256, False)]
             + [(128, n, True) for n in (128, 160, 192, 208)] + [(192, 128, True)]),
    10: tuple((m, n, False) for m in (128, 256) for n in (16, 32, 64, 128, 160, 192, 224, 256)),
}
# The tiles of fp8 products. On sm_90 their partial sums are promoted: QuACK adds each K tile's
# wgmma sums into a second float32 accumulator, so each thread of the MMA warps holds two, and
# where one passes 104 registers the kernel spills them to local memory (the frame size of each
# cubin, compiled for sm_90a: every 16-bit tile spills 256-984 bytes a thread in fp8 and none in
# bf16; benchmarks/probes/cute_spills.py). Blackwell accumulates in tensor memory: its 16-bit
# tiles.
SCALED_TILES = {
    9: tuple([(128, n, False) for n in (128, 160, 192, 208)] + [(256, n, False) for n in (64, 80, 96)]
             + [(128, n, True) for n in (64, 80, 96)]),
    10: TILES[10],
}
CLUSTERS = {9: ((1, 2), (2, 1)), 10: ((1, 1), (1, 2), (2, 1), (2, 2))}
PERSISTENT = {9: (False,), 10: (True, False)}  # sm_90: a static persistent schedule only


@dataclass(frozen=True)
class CuteConfig(FieldConfig):
    FIELDS = {"arch": "arch", "tile_m": "tile_m", "tile_n": "tile_n", "cluster_m": "cluster_m",
              "cluster_n": "cluster_n", "pingpong": "pingpong", "dynamic_persistent": "dynamic_persistent",
              "swap_ab": "swap_ab"}  # persisted name -> attribute

    arch: int
    tile_m: int
    tile_n: int
    cluster_m: int
    cluster_n: int
    pingpong: bool = False
    dynamic_persistent: bool = False
    swap_ab: bool = False

    def __post_init__(self) -> None:
        """Only a config of a space (``space_of``, 16-bit or fp8): a config read from a store or a
        file is untrusted, and an invalid one would fail to compile or fault."""
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (self.arch, self.tile_m, self.tile_n,
                                                                      self.cluster_m, self.cluster_n)):
            raise ValueError(f"{NAME} config: arch, tile and cluster sizes must be ints, got {self.as_dict()}")
        if any(not isinstance(v, bool) for v in (self.pingpong, self.dynamic_persistent, self.swap_ab)):
            raise ValueError(f"{NAME} config: pingpong, dynamic_persistent and swap_ab must be true or false, "
                             f"got {self.as_dict()}")
        if self.arch not in TILES:
            raise ValueError(f"{NAME} arch={self.arch} is not one of {tuple(TILES)} (sm_90, sm_100)")
        tile, cluster = (self.tile_m, self.tile_n, self.pingpong), (self.cluster_m, self.cluster_n)
        tiles = tuple(dict.fromkeys(TILES[self.arch] + SCALED_TILES[self.arch]))
        if tile not in tiles or cluster not in CLUSTERS[self.arch] \
                or self.dynamic_persistent not in PERSISTENT[self.arch]:
            raise ValueError(f"{NAME} config {self.key()} is not in sm_{self.arch}0's space: tiles (M, N, "
                             f"pingpong) {tiles}, clusters {CLUSTERS[self.arch]}, dynamic persistent "
                             f"{PERSISTENT[self.arch]}")

    def stages(self, out_element_size: int, smem_bytes: int) -> int:
        """The pipeline stages the shared memory holds beside the epilogue's output subtile."""
        stage = (self.tile_m + self.tile_n) * STAGE_K_BYTES
        epilogue = self.tile_m * min(self.tile_n, 64) * out_element_size
        return max(0, (smem_bytes - epilogue - BARRIER_BYTES) // stage)


@functools.lru_cache(maxsize=None)
def space_of(arch: int, scaled: bool = False) -> tuple[CuteConfig, ...]:
    """Every config of compute capability ``arch``'s family, for 16-bit products or for fp8 ones
    (``scaled``: their own tiles, never as the transpose)."""
    tiles, swaps = (SCALED_TILES[arch], (False,)) if scaled else (TILES[arch], (False, True))
    return tuple(CuteConfig(arch, m, n, cm, cn, pp, dyn, swap) for m, n, pp in tiles
                 for cm, cn in CLUSTERS[arch] for dyn in PERSISTENT[arch] for swap in swaps)


def space(problem: Problem, device: Device) -> list[CuteConfig]:
    """The configs for this problem on this device: its family's, those whose pipeline fits the
    shared memory with MIN_STAGES stages or more, and by the problem's shape: a problem with
    fewer than SMALL rows only as its transpose (swap_ab), one with fewer than SMALL columns only
    as itself; none for a problem the kernels do not take (``takes``). A problem with an
    activation or scales in its epilogue runs as itself only: as its transpose the bias and a
    row's scales would lie along the other side. fp8 products have tiles of their own
    (SCALED_TILES)."""
    arch = device.capability[0]
    if arch not in TILES or not takes(problem):
        return []
    configs = []
    for config in space_of(arch, problem.scaled):
        if config.stages(problem.out_element_size, device.smem_per_block) < MIN_STAGES:
            continue
        if config.cluster_m * config.cluster_n > device.sm_count:
            continue
        if problem.m < SMALL and not config.swap_ab or problem.n < SMALL and config.swap_ab and problem.m >= SMALL:
            continue
        if config.swap_ab and problem.activation != "none":
            continue
        configs.append(config)
    return configs


def takes(problem: Problem) -> bool:
    """Whether the kernels take ``problem``: 16-bit operands with an activation QuACK's epilogue
    has (``EPILOGUES``), or an fp8 product scaled per tensor or per row without one; and TMA's
    16-byte alignment of every row (K a multiple of 16 bytes, N of 8 elements)."""
    if problem.scaled:
        kind = problem.scaling in SCALINGS and problem.activation == "none"
    else:
        kind = problem.dtype in DTYPES and problem.activation in EPILOGUES
    return (kind and problem.k * problem.element_size % 16 == 0 and problem.n % 8 == 0
            and problem.layout in ("linear", "nn"))


# CuTe DSL compiles one kernel at a time (see the module's doc); reentrant, as compile_together
# holds it across the first calls it makes
_COMPILING = threading.RLock()
POOL_POLL_S = 0.05  # how often compile_together asks again after the calls still waiting on a worker
POOL_DEADLINE_S = 600.0  # after this, the calls still waiting are left to compile in process


class CuteKernel(KernelBase):
    """One config's kernel: QuACK's GEMM with that config (with the problem's activation in its
    epilogue, where it has one), compiled on its first call (or loaded from the exported cache).
    Takes ``a`` of any rank (..., K) in layout linear, flattened to its rows.

    QuACK's eager entry points work out, on every call, what its kernel needs from the operands
    (a key of a dozen parts, then a lookup): the fused call cost the host 67-68 us against 37-41
    us for ``F.linear`` on the H100 (``eager-vit-cute-h100-20261127.json``). So each layout of
    operands (shapes, strides, device, a bias or none) is prepared once, on its first call, into
    a launch that takes only the tensors (``_prepare``); ``bind`` hands that launch to the front
    path, whose own key fixes everything the launch was prepared for."""

    serves_any_rank = True  # x (..., K) in layout linear: its rows, viewed (or copied where TMA cannot read them)

    def __init__(self, problem: Problem, config: CuteConfig) -> None:
        self._quack = _quack()
        self._activation = EPILOGUES[problem.activation]
        self._marker = marker(problem, config)
        self._linear = problem.layout == "linear"
        # a dynamic persistent schedule counts its tiles in a semaphore that sm_90 needs zeroed per call
        self._semaphore = config.dynamic_persistent and config.arch == 9
        self._config = self._quack.GemmConfig(
            tile_m=config.tile_m, tile_n=config.tile_n, pingpong=config.pingpong,
            is_dynamic_persistent=config.dynamic_persistent, cluster_m=config.cluster_m,
            cluster_n=config.cluster_n, swap_ab=config.swap_ab, device_capacity=config.arch)
        self._launches: dict[tuple, Callable] = {}  # operands' layout -> launch(a, b_kn, out, bias)

    def __call__(self, a, b, bias, out=None):
        rows = tma_ready(a.reshape(-1, a.shape[-1]))
        b, bias = tma_ready(b), vector_ready(bias)
        b_kn = b.t() if self._linear else b  # (K, N): a weight's transpose is K-major, which TMA reads as well
        result = _written(out, (rows.shape[0], b_kn.shape[1]), a.dtype, a.device)
        self._launch(_layout(rows, b_kn, result.stride(), bias), rows, b_kn, result, bias)
        if out is not None:
            return _given(out, result)
        return result if a.dim() == 2 else result.view(*a.shape[:-1], result.shape[1])

    def bind(self, a, b, bias):
        """The front path's call for operands laid out as these, which this kernel has just served:
        the prepared launch with a's rows viewed and the output made, nothing else per call. None
        where a call would copy an operand first (a view TMA cannot read, a non-contiguous ``a``
        of rank above 2, a strided bias)."""
        rows = a.reshape(-1, a.shape[-1]) if a.is_contiguous() or a.dim() == 2 else None
        if rows is None or tma_ready(rows) is not rows or tma_ready(b) is not b or vector_ready(bias) is not bias:
            return None
        b_kn = b.t() if self._linear else b
        out_rows = (rows.shape[0], b_kn.shape[1])
        launch = self._launches.get(_layout(rows, b_kn, (out_rows[1], 1), bias))  # the output it makes: contiguous
        if launch is None:
            return None
        linear, shape, out_shape = self._linear, rows.shape, (*a.shape[:-1], b_kn.shape[1])

        def call(a, b, bias, pa: int, pb: int, pbias: int):
            out = a.new_empty(out_shape)
            launch(a.view(shape), b.t() if linear else b, out.view(out_rows), bias)
            return out

        return call

    def _launch(self, key: tuple, a, *operands) -> None:
        """The launch prepared for operands laid out as these (``key``), made; prepared first
        where there is none yet."""
        launch = self._launches.get(key)
        if launch is None:
            self._first(key, a, *operands)
        else:
            launch(a, *operands)

    def _first(self, key: tuple, a, *operands) -> None:
        """The first call on operands laid out as these (``key``): prepares their launch
        (compiling the kernel, or loading it, where this process has not) and makes it."""
        with _COMPILING:
            # CuTe DSL asks CUDA's driver about the device, which needs the device's context
            # current in this thread: a runtime call makes it so in a thread that made none
            # (CUDA_ERROR_INVALID_CONTEXT there otherwise, seen on the H100)
            torch.cuda.synchronize(a.device)
            launch = self._prepare(a, *operands)
        if not self._launches:  # the kernel's first launch in this process: it is compiled
            _leave(self._marker)
        self._launches[key] = launch

    def _prepare(self, a, b_kn, out, bias) -> Callable:
        """Launch the kernel on these operands through QuACK's entry points, which compile it or
        load it, and return the launch of what they resolved, for operands laid out as these."""
        if self._activation is None:
            config, split_k, dynamic, plan = self._quack.gemm_tuned(a, b_kn, out, bias=bias, config=self._config)
            return functools.partial(_replay, self._quack.gemm_execute, plan, config, split_k, dynamic)
        mod = self._quack.linear_act_mod(self._activation, gated=False, has_c=False, has_rowvec=bias is not None,
                                         has_colvec=False)
        plan = mod.plan(a, b_kn, out={"mAuxOut": out}, config=self._config, **_epilogue_operands(bias))
        launch = functools.partial(_run, plan, self._semaphore, "mAuxOut", _epilogue_operands)
        launch(a, b_kn, out, bias)
        return launch


class CuteScaledKernel(CuteKernel):
    """An fp8 product scaled per tensor or per row, called as ``triton_scaled``'s kernels are:
    ``kernel(a, b, bias, scale_a, scale_b, out=None)`` with a (M, K) and b (N, K) fp8, bias (N,)
    in the output dtype or None, float32 scales as ``Problem.scaling`` lays them. QuACK's GEMM
    accumulates precisely (its fp8 partial sums promoted to float32, as ``_scaled_mm`` does by
    default), and its epilogue (``scaled_epilogue``) scales the sums, adds the bias and stores
    the output's dtype. Prepared once per layout of operands, as the 16-bit kernel is."""

    serves_any_rank = False  # a (M, K), as every scaled kernel

    def __init__(self, problem: Problem, config: CuteConfig) -> None:
        super().__init__(problem, config)
        self._scaling = problem.scaling
        self._out_dtype = torch_dtypes()[problem.out_dtype]

    def __call__(self, a, b, bias, scale_a, scale_b, out=None):
        (m, k), n = a.shape, b.shape[0]
        check_scales(self._scaling, m, n, k, scale_a, scale_b)
        a, b_kn, bias = tma_ready(a), tma_ready(b).t(), vector_ready(bias)
        scales = _scale_operand(scale_a), _scale_operand(scale_b)
        result = _written(out, (m, n), self._out_dtype, a.device)
        self._launch(_layout(a, b_kn, result.stride(), bias), a, b_kn, result, bias, *scales)
        return result if out is None else _given(out, result)

    def bind(self, a, b, bias):
        return None  # fp8 calls are served through serving.scaled, which binds nothing

    def _prepare(self, a, b_kn, out, bias, scale_a, scale_b) -> Callable:
        mod = self._quack.scaled_mods[self._scaling, bias is not None]
        plan = mod.plan(a, b_kn, out={"D": out}, config=self._config, **_scaled_operands(bias, scale_a, scale_b))
        launch = functools.partial(_run, plan, self._semaphore, "D", _scaled_operands)
        launch(a, b_kn, out, bias, scale_a, scale_b)
        return launch


def _written(out, shape: tuple[int, int], dtype: torch.dtype, device) -> torch.Tensor:
    """The tensor a kernel stores into: ``out`` where TMA can store into it as it is, else a new
    one of ``shape`` (copied into ``out`` after, ``_given``)."""
    return out if out is not None and tma_ready(out) is out else torch.empty(shape, dtype=dtype, device=device)


def _given(out: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """``out``, holding ``result`` (a copy where the kernel stored elsewhere)."""
    if result is not out:
        out.copy_(result)
    return out


def scaled_epilogue(acc, scale_a, scale_b):
    """An fp8 product's epilogue, in QuACK's form (a function of each float32 sum of the
    accumulator): the sum times A's scale (its row's) and B's (its column's)."""
    return {"D": acc * scale_a * scale_b}


def scaled_bias_epilogue(acc, scale_a, scale_b, bias):
    """``scaled_epilogue`` plus the bias of the sum's column."""
    return {"D": acc * scale_a * scale_b + bias}


def _scaled_mods() -> dict:
    """QuACK's epilogue kernels of ``scaled_epilogue`` by (scaling, bias): per tensor each scale
    one float32 read from its pointer, per row A's a vector along M and B's one along N."""
    from quack.epilogue.frontend import gemm_epilogue
    from quack.epilogue.ops import ColVecLoad, RowVecLoad, Scalar

    mods = {}
    for scaling, (a_op, b_op) in {"tensor": (Scalar, Scalar), "row": (ColVecLoad, RowVecLoad)}.items():
        ops = {"scale_a": a_op("scale_a"), "scale_b": b_op("scale_b")}
        mods[scaling, False] = gemm_epilogue(ops=ops)(scaled_epilogue)
        mods[scaling, True] = gemm_epilogue(ops={**ops, "bias": RowVecLoad("bias")})(scaled_bias_epilogue)
    return mods


def vector_ready(vector):
    """A bias (or a row's scales) as the epilogue's vector loads read it: ``vector`` itself where
    it is contiguous and 16-byte aligned (QuACK compiles them for aligned vectors), else a copy;
    None stays None."""
    if vector is None or vector.is_contiguous() and vector.data_ptr() % 16 == 0:
        return vector
    return vector.clone(memory_format=torch.contiguous_format)


def _scale_operand(scale: torch.Tensor) -> torch.Tensor:
    """A scale as the epilogue reads it: one float32 (per tensor), or a row's scales as one
    vector (per row, (M, 1) or (N, 1) given), ``vector_ready``."""
    return vector_ready(scale.reshape(-1) if scale.numel() > 1 else scale.reshape(()))


def _scaled_operands(bias, scale_a, scale_b) -> dict:
    operands = {"scale_a": scale_a, "scale_b": scale_b}
    return operands if bias is None else {**operands, "bias": bias}


def _run(plan, semaphore: bool, output: str, operands: Callable, a, b_kn, out, *vectors) -> None:
    """The epilogue's ``plan`` (QuACK's ``plan`` and ``run``, made for replays that decide
    nothing) launched on operands laid out as those it was made for, ``out`` its ``output``
    (an activation's "mAuxOut", the pre-activation not stored; an fp8 product's "D"), the bias
    and scales given as ``operands`` names them."""
    plan.run(a, b_kn, out={output: out}, tile_count_semaphore=_zeroed(a) if semaphore else None,
             **operands(*vectors))


def _epilogue_operands(bias) -> dict:
    return {} if bias is None else {"mRowVecBroadcast": bias}


def _layout(a, b_kn, out_stride: tuple, bias) -> tuple:
    """What a prepared launch fixes of its operands (all of them 16-byte aligned: ``tma_ready``)."""
    return (a.get_device(), a.shape, a.stride(), b_kn.shape, b_kn.stride(), out_stride, bias is None)


def _zeroed(a) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=a.device)


def _replay(gemm_execute, plan, config, split_k: int, dynamic: bool, a, b_kn, out, bias) -> None:
    """QuACK's GEMM on operands laid out as those its dispatch ``plan`` was made for, as its
    ``gemm`` does on a warm call: the operands routed, the plan launched, nothing looked up."""
    gemm_execute(a, b_kn, out, None, bias=bias, alpha=1.0, beta=1.0, cu_seqlens_m=None, cu_seqlens_k=None,
                 A_idx=None, batch_idx_permute=None, add_to_output=False, dynamic_scheduler=dynamic,
                 config=config, rounding_mode=0, sr_seed=0, concat_layout=None, SFA=None, SFB=None,
                 split_k=split_k, split_k_mode=0, dispatch_plan=plan)


@dataclass(frozen=True)
class _Quack:
    """What gemmtune calls of QuACK (quack-kernels 0.6.5, pinned by the ``cute`` extra)."""

    GemmConfig: type
    gemm_tuned: Callable  # its autotuned GEMM's undecorated function: one given config, a launch
    gemm_execute: Callable  # what its ``gemm`` replays a dispatch plan through
    linear_act_mod: Callable  # the epilogue of a GEMM with an activation, with ``plan`` and ``run``
    scaled_mods: Mapping  # (scaling, bias) -> the epilogue of an fp8 product (``_scaled_mods``)


@functools.cache
def _quack() -> _Quack:
    """QuACK's entry points, imported on the first build: importing CuTe DSL takes seconds."""
    os.environ.setdefault("QUACK_CACHE_DIR", str(cache_dir() / "cute"))
    from quack.epilogue.library import linear_act_mod
    from quack.gemm_config import GemmConfig
    from quack.gemm_interface import _gemm_execute, gemm_tuned

    cluster_occupancy.install(current)
    quack_source_key.install()
    return _Quack(GemmConfig, gemm_tuned.fn, _gemm_execute, linear_act_mod, _scaled_mods())


def compile_together(calls: Sequence[Callable[[], object]], workers: int) -> None:
    """Each of ``calls`` (a candidate's first call on its operands) made with QuACK's compile pool
    on: a config its cache lacks is compiled by one of ``workers`` GPU-blind worker processes
    (QuACK's ``QUACK_COMPILE_WORKERS`` unless set) while the others compile beside it, and the
    call is made again once the worker's object file is there, loading it. What fails here is
    left to the caller, whose own call meets it again and reports it; calls still waiting after
    POOL_DEADLINE_S are left so too. The lock keeps every other thread's first call waiting
    meanwhile: QuACK's pool is the process's, and a call made in its scope may be deferred."""
    if len(calls) < 2:
        return
    os.environ.setdefault("QUACK_COMPILE_WORKERS", str(max(1, workers)))
    _quack()
    from quack.cache.async_compile import CompilePending, pool_scope

    with _COMPILING, pool_scope():
        until_ready(calls, CompilePending, time.monotonic() + POOL_DEADLINE_S)


def until_ready(calls: Sequence[Callable[[], object]], pending: type[BaseException], deadline: float) -> None:
    """Make each call, again and again every POOL_POLL_S, while it raises ``pending``, until none
    does or ``deadline`` (``time.monotonic``) passes; a call that fails otherwise is dropped."""
    waiting = list(calls)
    while waiting and time.monotonic() < deadline:
        still = []
        for call in waiting:
            try:
                call()
            except pending:
                still.append(call)
            except Exception:  # noqa: BLE001 - the caller's own call meets it again and reports it
                pass
        waiting = still
        if waiting:
            time.sleep(POOL_POLL_S)


def marker(problem: Problem, config: CuteConfig) -> Path:
    """The file whose presence says that ``config``'s kernel for problems of ``problem``'s kind
    (dtype, layout, bias, activation; an fp8 product's output dtype and scaling) is compiled in
    QuACK's cache, for these package versions.
    (A problem without an activation names none, as markers did before activations were taken.)"""
    activation = [] if problem.activation == "none" else [problem.activation]
    scaling = [f"{problem.out_dtype}@{problem.scaling}"] if problem.scaled else []
    kind = [problem.dtype, problem.layout, str(problem.bias), *activation, *scaling, config.key(),
            *kernel_library_versions().values()]
    return cache_dir() / "cute-compiled" / hashlib.sha256("|".join(kind).encode()).hexdigest()[:24]


def _leave(path: Path) -> None:
    """Create the marker ``path``; a cache directory that cannot be written costs only the
    screening of this config as an uncompiled one next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError:
        pass


def installed() -> bool:
    """Whether QuACK and CuTe DSL are installed (checked without importing them)."""
    return all(importlib.util.find_spec(name) is not None for name in ("quack", "cutlass"))


class CuteBackend:
    name = NAME
    space_size = len(space_of(9))
    # topk's count of configs here (DEFAULT_TOPK elsewhere): the roofline ranks these kernels
    # poorly (its first 6 held a config within 2% of the best of 44 on 3 of 8 prefill shapes, its
    # first 16 on 4, its first 24 on 6: cute-h100-20261127.json), and compiled together by 15
    # worker processes, 24 configs take two compiles' wall time where 6 took one
    topk = 24

    def is_available(self, device: Device) -> bool:
        return not device.interpreter and device.capability[0] in RUNNABLE_ARCHS and installed()

    def candidates(self, problem: Problem, device: Device) -> list[CuteConfig]:
        return space(problem, device)

    def compiled(self, problem: Problem, configs: list[CuteConfig]) -> list[CuteConfig]:
        """Those of ``configs`` whose kernel for problems of ``problem``'s kind is compiled in the
        cache already (their marker is there)."""
        return [config for config in configs if marker(problem, config).exists()]

    def predict_ms(self, problem: Problem, device: Device, config: CuteConfig) -> float | None:
        """The tiled roofline (``costmodel.tile_gemm_ms``) over the tiles the kernel walks: the
        transpose's where A and B trade places."""
        shape = replace(problem, m=problem.n, n=problem.m) if config.swap_ab else problem
        stages = min(config.stages(problem.out_element_size, device.smem_per_block), 8)
        tile_k = STAGE_K_BYTES // problem.element_size
        return costmodel.tile_gemm_ms(shape, device, config.tile_m, config.tile_n, tile_k, stages)

    def parse_config(self, data: Mapping) -> CuteConfig:
        return config_from_mapping(self.name, data, CuteConfig)

    def build(self, problem: Problem, config: CuteConfig, device: Device) -> CuteKernel:
        return CuteScaledKernel(problem, config) if problem.scaled else CuteKernel(problem, config)

    def compile_together(self, calls: Sequence[Callable[[], object]], workers: int) -> None:
        compile_together(calls, workers)


BACKEND = CuteBackend()
