"""cuBLASLt through ctypes, on the library torch already loaded: the algorithms cuBLAS's own
heuristic ranks for a problem, each written as the nine integers of its configuration, rebuilt
from them (cuBLAS checks each against the problem) and launched on the current stream.

torch's call runs the heuristic's first algorithm. On the H200 later ones ran 4-5% faster on
several prefill and mid rows, and up to 9% at 38 SMs (docs/performance.md, prefill): tuning among them is
what cuBLAS's heuristic cannot do, since it never times anything.

Row-major operands are cuBLAS's column-major transposes, so the product is computed as
C^T = op(B^T) A^T: cuBLAS's first operand is gemmtune's B (the weight), its second gemmtune's A.

fp8 products scaled per tensor are cuBLASLt's too (``torch._scaled_mm`` runs the heuristic's
first): fp8 operands, an output of the problem's ``out_dtype``, the two scales read from device
pointers set per launch (cuBLAS's A scale is the weight's), and precise accumulation (fast
accumulation failed gemmtune's fp8 tolerance on an H100: docs/performance.md, fp8 products).
"""

from __future__ import annotations

import ctypes
import functools
import threading
import weakref
from collections.abc import Mapping

from gemmtune.errors import CublasLtError
from gemmtune.problem import Problem

CUDA_TYPES = {"float16": 2, "bfloat16": 14, "float32": 0, "float8_e4m3fn": 28, "float8_e5m2": 29}  # cudaDataType_t
COMPUTE_32F, COMPUTE_32F_FAST_TF32 = 68, 77  # cublasComputeType_t
SCALE_32F = 0
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 3, 4, 7, 8  # cublasLtMatmulDescAttributes_t
DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER, DESC_FAST_ACCUM = 17, 18, 25  # the fp8 ones (per-tensor scales)
# cublasLtEpilogue_t: what cuBLAS itself applies to the product (its GELU is the tanh approximation,
# so an exact GELU is torch's, after the product). BIAS is a value of its own, not a flag over
# DEFAULT: DEFAULT | BIAS (5) is no epilogue cuBLAS knows, and its algorithms wrote wrong outputs
# with it (an H100, 2026-11-26); the activations combine with BIAS (RELU_BIAS 6, GELU_BIAS 36).
EPILOGUE_DEFAULT, EPILOGUE_RELU, EPILOGUE_BIAS, EPILOGUE_GELU = 1, 2, 4, 32
EPILOGUE_ACTIVATIONS = {"relu": EPILOGUE_RELU, "gelu_tanh": EPILOGUE_GELU}
PREF_MAX_WORKSPACE = 1  # cublasLtMatmulPreferenceAttributes_t
OP_N, OP_T = 0, 1
MAX_WORKSPACE = 32 << 20  # what an algorithm may ask for (torch gives cuBLAS as much on Hopper)
# A pointer alignment every algorithm works with: the heuristic's default assumption, since
# gemmtune leaves its alignment preferences unset. Operands less aligned go to torch's call.
ALIGNMENT = 256
MAX_BIAS_DESCS = 64  # bias addresses a launcher keeps a descriptor for (a model's layers of one shape)
# cublasLtMatmulAlgoConfigAttributes_t 0-8, in order: the name a config stores and the C type
# of the attribute (the size cuBLAS insists on; the algorithm's id and split-K are signed)
ATTRIBUTES = (("algo", ctypes.c_int32), ("tile", ctypes.c_uint32), ("splitk", ctypes.c_int32),
              ("reduction", ctypes.c_uint32), ("swizzle", ctypes.c_uint32), ("custom", ctypes.c_uint32),
              ("stages", ctypes.c_uint32), ("inner", ctypes.c_uint16), ("cluster", ctypes.c_uint16))


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]  # cublasLtMatmulAlgo_t: opaque


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]  # cublasLtMatmulHeuristicResult_t


def epilogue(problem: Problem) -> int:
    """The cublasLtEpilogue_t cuBLAS applies for ``problem``: its bias and, where cuBLAS has it,
    its activation (``fused_activation``)."""
    value = EPILOGUE_ACTIVATIONS.get(problem.activation, 0) | (EPILOGUE_BIAS if problem.bias else 0)
    return value or EPILOGUE_DEFAULT


def fused_activation(problem: Problem) -> bool:
    """Whether cuBLAS applies ``problem``'s activation in its epilogue (else torch does, after)."""
    return problem.activation in EPILOGUE_ACTIVATIONS


def _check(status: int, call: str) -> None:
    if status != 0:
        raise CublasLtError(f"cuBLASLt {call} failed with cublasStatus_t {status}")


@functools.cache
def library() -> ctypes.CDLL:
    """The libcublasLt of this process's torch (found in the process's memory map, so the same
    library and version that torch's own calls use), with the signatures gemmtune calls."""
    import torch

    path = _loaded_path()
    if path is None:  # torch loads cuBLAS lazily on some builds: one product loads it
        torch.mm(torch.ones(1, 1, device="cuda"), torch.ones(1, 1, device="cuda"))
        path = _loaded_path()
    if path is None:
        raise CublasLtError("libcublasLt is not loaded in this process")
    lib = ctypes.CDLL(path)
    lib.cublasLtGetVersion.argtypes, lib.cublasLtGetVersion.restype = [], ctypes.c_size_t
    p, i32, u64, i64, size = ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    for name, args in {
        "cublasLtCreate": [p],
        "cublasLtMatmulDescCreate": [p, i32, i32],
        "cublasLtMatmulDescDestroy": [p],
        "cublasLtMatmulDescSetAttribute": [p, i32, p, size],
        "cublasLtMatrixLayoutCreate": [p, i32, u64, u64, i64],
        "cublasLtMatrixLayoutDestroy": [p],
        "cublasLtMatmulPreferenceCreate": [p],
        "cublasLtMatmulPreferenceDestroy": [p],
        "cublasLtMatmulPreferenceSetAttribute": [p, i32, p, size],
        "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, i32, p, p],
        "cublasLtMatmulAlgoInit": [p, i32, i32, i32, i32, i32, i32, i32, p],
        "cublasLtMatmulAlgoConfigSetAttribute": [p, i32, p, size],
        "cublasLtMatmulAlgoConfigGetAttribute": [p, i32, p, size, p],
        "cublasLtMatmulAlgoCheck": [p, p, p, p, p, p, p, p],
        "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, p, p, size, p],
    }.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = args, ctypes.c_int
    return lib


def _loaded_path() -> str | None:
    """The libcublasLt mapped into this process; torch's (its ``nvidia`` or ``torch`` package
    directory) first where several are."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcublasLt.so" in line}
    except OSError:
        return None
    ranked = sorted(paths, key=lambda path: ("/nvidia/" not in path and "/torch/" not in path, path))
    return ranked[0] if ranked else None


@functools.cache
def handle(device_index: int) -> ctypes.c_void_p:
    """This process's cuBLASLt handle for one GPU (kept for the process's life)."""
    import torch

    with torch.cuda.device(device_index):
        h = ctypes.c_void_p()
        _check(library().cublasLtCreate(ctypes.byref(h)), "Create")
    return h


class Matmul:
    """One problem's cuBLASLt descriptors, for contiguous row-major operands on one GPU: its
    ranked algorithms, an algorithm rebuilt from its config, and launches."""

    def __init__(self, problem: Problem, device_index: int) -> None:
        lib = self._lib = library()
        self._handle = handle(device_index)
        linear = problem.layout == "linear"
        m, n, k = problem.m, problem.n, problem.k
        dtype, out = CUDA_TYPES[problem.dtype], CUDA_TYPES[problem.out_dtype]
        self._types = (COMPUTE_32F_FAST_TF32 if problem.tf32 else COMPUTE_32F, SCALE_32F, dtype, dtype, out, out)
        self._problem = problem
        # every descriptor made, destroyed with the layouts by the finalizer: the first, then one
        # per bias address (``launcher``)
        self._descs: list[ctypes.c_void_p] = []
        self.desc = self._new_desc()
        # column-major: the weight (k x n, or n x k for nn), the activations (k x m), the output (n x m)
        shapes = ((k, n, k, dtype) if linear else (n, k, n, dtype), (k, m, k, dtype), (n, m, n, out))
        self.layouts = []
        for rows, cols, ld, kind in shapes:
            layout = ctypes.c_void_p()
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), kind, rows, cols, ld), "MatrixLayoutCreate")
            self.layouts.append(layout)
        weakref.finalize(self, _destroy, lib, self._descs, tuple(self.layouts))

    def _new_desc(self, bias_ptr: int = 0) -> ctypes.c_void_p:
        """A descriptor of this problem's product (its operations, epilogue, fp8 accumulation),
        reading its bias at ``bias_ptr`` where given; kept in ``_descs``."""
        lib, problem = self._lib, self._problem
        desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), self._types[0], SCALE_32F), "MatmulDescCreate")
        self._descs.append(desc)
        for attribute, op in ((DESC_TRANSA, OP_T if problem.layout == "linear" else OP_N), (DESC_TRANSB, OP_N),
                              (DESC_EPILOGUE, epilogue(problem))):
            value = ctypes.c_int32(op)
            _check(lib.cublasLtMatmulDescSetAttribute(desc, attribute, ctypes.byref(value), 4), "DescSetAttribute")
        if problem.scaled:
            precise = ctypes.c_int8(0)
            _check(lib.cublasLtMatmulDescSetAttribute(desc, DESC_FAST_ACCUM, ctypes.byref(precise), 1),
                   "DescSetAttribute(FAST_ACCUM)")
        if bias_ptr:
            address = ctypes.c_void_p(bias_ptr)
            _check(lib.cublasLtMatmulDescSetAttribute(desc, DESC_BIAS_POINTER, ctypes.byref(address),
                                                      ctypes.sizeof(address)), "DescSetAttribute(BIAS_POINTER)")
        return desc

    def heuristics(self, count: int) -> list[dict]:
        """The configs of up to ``count`` algorithms, in the heuristic's order (its first is
        what torch's call runs)."""
        lib = self._lib
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        try:
            limit = ctypes.c_uint64(MAX_WORKSPACE)
            _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(limit), 8),
                   "PreferenceSetAttribute")
            results, returned = (Heuristic * count)(), ctypes.c_int(0)
            a, b, c = self.layouts
            _check(lib.cublasLtMatmulAlgoGetHeuristic(self._handle, self.desc, a, b, c, c, pref, count, results,
                                                      ctypes.byref(returned)), "AlgoGetHeuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        return [self._config(results[i].algo) for i in range(returned.value) if results[i].state == 0]

    def algo(self, config: Mapping[str, int]) -> tuple[Algo, int]:
        """The algorithm ``config`` describes and the workspace bytes it needs; CublasLtError
        where cuBLAS rejects it for this problem (an unknown or unsupported value)."""
        lib, algo = self._lib, Algo()
        _check(lib.cublasLtMatmulAlgoInit(self._handle, *self._types, config["algo"], ctypes.byref(algo)), "AlgoInit")
        for attribute, (name, ctype) in enumerate(ATTRIBUTES[1:], start=1):
            value = ctype(config[name])
            _check(lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attribute, ctypes.byref(value),
                                                            ctypes.sizeof(ctype)), f"AlgoConfigSetAttribute({name})")
        result = Heuristic()
        a, b, c = self.layouts
        _check(lib.cublasLtMatmulAlgoCheck(self._handle, self.desc, a, b, c, c, ctypes.byref(algo),
                                           ctypes.byref(result)), "AlgoCheck")
        if result.workspace > MAX_WORKSPACE:
            raise CublasLtError(f"cuBLASLt algorithm {dict(config)} needs {result.workspace} bytes of workspace, "
                                f"more than {MAX_WORKSPACE}")
        return algo, result.workspace

    def _config(self, algo: Algo) -> dict:
        config = {}
        for attribute, (name, ctype) in enumerate(ATTRIBUTES):
            value, written = ctype(), ctypes.c_size_t()
            _check(self._lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attribute, ctypes.byref(value),
                                                                  ctypes.sizeof(ctype), ctypes.byref(written)),
                   f"AlgoConfigGetAttribute({name})")
            config[name] = value.value
        return config

    def launcher(self, algo: Algo):
        """``launch(weight_ptr, activation_ptr, out_ptr, workspace_ptr, workspace_bytes, stream,
        bias_ptr)`` of ``algo``: the product (and its epilogue, reading the bias at ``bias_ptr``
        where the problem has one) into ``out_ptr``; raises CublasLtError on a failed status.
        An fp8 product's launch takes its scales' pointers next: ``weight_scale_ptr,
        activation_scale_ptr``. ``residual_ptr``, where given, is an (M, N) tensor laid as the
        output (contiguous rows) that is added to the product and its bias: cuBLASLt's C with a
        beta of 1, one rounding to the output's dtype. cuBLASLt applies the epilogue's
        activation to that sum, so a residual is refused (ValueError) with an activation or
        with an fp8 product."""
        lib, handle_, desc = self._lib, self._handle, self.desc
        matmul, set_attribute = lib.cublasLtMatmul, lib.cublasLtMatmulDescSetAttribute
        a, b, c = self.layouts
        alpha, beta, one = ctypes.c_float(1.0), ctypes.c_float(0.0), ctypes.c_float(1.0)
        algo_ref, alpha_ref, beta_ref, one_ref = ctypes.byref(algo), ctypes.byref(alpha), ctypes.byref(beta), \
            ctypes.byref(one)
        takes_residual = self._problem.activation == "none" and not self._problem.scaled
        bias, scale_w, scale_x = ctypes.c_void_p(0), ctypes.c_void_p(0), ctypes.c_void_p(0)
        size = ctypes.sizeof(bias)
        bias_ref, scale_w_ref, scale_x_ref = ctypes.byref(bias), ctypes.byref(scale_w), ctypes.byref(scale_x)
        # A bias address gets a descriptor of its own that reads it (a model's layers keep their
        # biases where they are): setting the shared descriptor's attribute per call, under a
        # lock, cost about 3 us of a 21 us launch (lt-call-h200-20261129.json). Past
        # MAX_BIAS_DESCS addresses (biases made per call), and for the fp8 scales, the pointers
        # are attributes of the shared descriptor, set and read under one lock, so that a
        # thread's launch reads its own.
        by_bias: dict[int, ctypes.c_void_p] = {}
        lock = threading.Lock()
        # The launch reads these by address, and this object's descriptors, which its finalizer
        # destroys: a launch kept after its Matmul (a bound call outliving its kernel) keeps it too.
        keep = (algo, alpha, beta, one, bias, scale_w, scale_x, self)

        def launch(weight: int, activations: int, out: int, workspace: int, workspace_bytes: int, stream: int,
                   bias_ptr: int = 0, weight_scale_ptr: int = 0, activation_scale_ptr: int = 0,
                   residual_ptr: int = 0) -> None:
            c_ptr, c_beta = out, beta_ref
            if residual_ptr:
                if not takes_residual:
                    raise ValueError(f"cuBLASLt launch: residual_ptr is not accepted for {self._problem.describe()} "
                                     "(an activation would apply to the sum; fp8 products take none)")
                c_ptr, c_beta = residual_ptr, one_ref
            own = None  # the descriptor reading this bias, where it has one
            if bias_ptr and not weight_scale_ptr:
                own = by_bias.get(bias_ptr)
                if own is None and len(by_bias) < MAX_BIAS_DESCS:
                    with lock:  # another thread may have made it meanwhile
                        own = by_bias.get(bias_ptr)
                        if own is None:
                            own = by_bias[bias_ptr] = self._new_desc(bias_ptr)
            if own is not None or not (bias_ptr or weight_scale_ptr):
                status = matmul(handle_, desc if own is None else own, alpha_ref, weight, a, activations, b, c_beta,
                                c_ptr, c, out, c, algo_ref, workspace, workspace_bytes, stream)
            else:
                with lock:
                    bias.value, scale_w.value, scale_x.value = bias_ptr, weight_scale_ptr, activation_scale_ptr
                    status = (bias_ptr and set_attribute(desc, DESC_BIAS_POINTER, bias_ref, size)) or (
                        weight_scale_ptr and (set_attribute(desc, DESC_A_SCALE_POINTER, scale_w_ref, size)
                                              or set_attribute(desc, DESC_B_SCALE_POINTER, scale_x_ref, size))
                    ) or matmul(handle_, desc, alpha_ref, weight, a, activations, b, c_beta, c_ptr, c, out, c,
                                algo_ref, workspace, workspace_bytes, stream)
            if status != 0:
                raise CublasLtError(f"cuBLASLt Matmul failed with cublasStatus_t {status}")

        launch.keep = keep
        return launch


def _destroy(lib, descs, layouts) -> None:
    for desc in descs:
        lib.cublasLtMatmulDescDestroy(desc)
    for layout in layouts:
        lib.cublasLtMatrixLayoutDestroy(layout)
