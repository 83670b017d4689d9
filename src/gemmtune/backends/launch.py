"""Launching a Triton kernel straight through its compiled binary.

A JIT launch binds the arguments, computes their specialization (dtypes, 16-byte alignment,
integers equal to 1 or divisible by 16), looks the binary up and only then launches: on the
H200's host that path took 17.5 us per call against 12.6 us for ``F.linear``, while the
binary's own launcher took 5.6 us (``benchmarks/dispatch.py``). So each kernel wrapper passes
a *guard* with its arguments: a tuple that fixes everything the JIT would specialize on (it
may fix more: exact strides rather than their divisibility). The first call with a guard goes
through the JIT, which compiles or loads the binary; later calls with the same guard call the
binary's launcher directly. Launch hooks (a profiler's) send every call through the JIT.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from gemmtune.backends import triton_key

if TYPE_CHECKING:
    from gemmtune.backends.base import BoundCall, Kernel


LAUNCH_OPTIONS = {"num_warps", "num_stages"}  # Triton's compile options among a launch's constexprs


class Launcher:
    """One ``@triton.jit`` function, launched by guard. Its constexpr parameters must come after
    every runtime parameter, as in all of gemmtune's kernels."""

    def __init__(self, fn, specialize: Callable[[Sequence], Mapping] | None = None) -> None:
        """``specialize(scalars)``, if given, adds constexprs that the scalar arguments
        determine (``gemm_hints``); it runs only when a guard is first seen."""
        from triton import knobs

        triton_key.install()  # a new process finds its binaries in Triton's cache without hashing Triton
        self._fn = fn
        self._accepted = frozenset(fn.arg_names) | LAUNCH_OPTIONS  # the names a launch's constexprs may have
        self._specialize = specialize
        self._hooks = knobs.runtime
        self._stream = None  # the driver's current-stream query, once there is a GPU binary
        self._binaries: dict[tuple, tuple] = {}

    def __call__(self, grid: tuple[int, int, int], guard: tuple, tensors: Sequence, pointers: Sequence[int],
                 scalars: Sequence, constexprs: Mapping) -> None:
        """Launch on the current stream of the operands' CUDA device, ``guard[0]`` (as
        ``gemm_guard`` puts it there). The runtime arguments are ``tensors`` then ``scalars``;
        ``pointers`` are the tensors' device addresses, which the binary's launcher takes as
        integers (no ``data_ptr`` call and driver check per tensor: 1.6 of its 9.8 us on the
        H200's host). ``guard`` with the sizes must determine ``constexprs``, every
        specialization of the arguments, and the device of every tensor."""
        binary = self._binaries.get(guard)
        if binary is None or self.hooked():
            if self._specialize is not None:
                constexprs = {**constexprs, **self._specialize(scalars)}
            self._jit(grid, guard, (*tensors, *scalars), constexprs)
            return
        run, function, prefix, tail = binary
        run(grid[0], grid[1], grid[2], self._stream(guard[0]), function, *prefix, *pointers, *scalars, *tail)

    def _jit(self, grid, guard, args, constexprs) -> None:
        unknown = constexprs.keys() - self._accepted
        if unknown:  # Triton's interpreter would drop them silently, its compiler refuse them
            raise TypeError(f"{self._fn.__name__} has no parameter {', '.join(sorted(unknown))}")
        compiled = self._fn[grid](*args, **constexprs)
        if compiled is None:  # Triton's interpreter: nothing compiled, nothing to keep
            return
        # A binary is loaded into the current device's context: kept only when that is the
        # operands' device, so the direct path never launches it on another device's stream.
        if guard not in self._binaries and torch.cuda.current_device() == guard[0]:
            names = self._fn.arg_names
            if len(args) + sum(name in constexprs for name in names) != len(names) \
                    or any(name in constexprs for name in names[:len(args)]):
                raise TypeError(f"{self._fn.__name__}: pass every runtime argument, in order, before the constexprs")
            tail = tuple(constexprs[name] for name in names[len(args):])
            if self._stream is None:
                from triton.runtime import driver

                self._stream = driver.active.get_current_stream
            self._binaries[guard] = (*_raw_launch(compiled), tail)

    def direct(self, guard: tuple, grid: tuple[int, int, int], scalars: Sequence) -> tuple | None:
        """What launching the binary of ``guard`` with ``grid`` and ``scalars`` takes besides the
        tensors' addresses, for ``bound_call``: (its launcher, the grid, the current-stream
        query and the device to ask it for, the function, what the launch takes before the
        addresses (``_raw_launch``), the arguments after them, Triton's runtime knobs where
        launch hooks are set). None while the guard has no binary (before its first call; the
        interpreter)."""
        binary = self._binaries.get(guard)
        if binary is None:
            return None
        run, function, prefix, tail = binary
        return run, grid, self._stream, guard[0], function, prefix, (*scalars, *tail), self._hooks

    def hooked(self) -> bool:
        """Whether a launch hook (a profiler's) is set: launches then go through the JIT."""
        return _hooked(self._hooks.launch_enter_hook) or _hooked(self._hooks.launch_exit_hook)

    def binaries(self) -> int:
        """How many guards launch directly (for tests and diagnostics)."""
        return len(self._binaries)


def _raw_launch(compiled) -> tuple:
    """(launch, the function, what the launch takes between the stream and the function's own
    arguments) for a compiled kernel: Triton's C launcher itself where the kernel needs no
    scratch memory, skipping the Python ``CudaLauncher.__call__`` in front of it (it builds
    scratch allocators on every call: about a microsecond of host time), else that ``run``. The
    ``None``s are the launch metadata and the enter and exit hooks (see ``Launcher.hooked``)."""
    run = compiled.run
    head = (compiled.packed_metadata, None, None, None)
    raw = getattr(run, "launch", None)
    if raw is None or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return run, compiled.function, head
    return raw, compiled.function, (run.launch_cooperative_grid, run.launch_pdl, None, None, *head)


def gemm_call(a, b, bias, out, linear: bool) -> tuple:
    """What a GEMM wrapper needs for its launch, from a (M, K), b ((N, K) if ``linear``, else
    (K, N)), bias or None and the caller's ``out`` (allocated here if None): m, n, k, the output,
    the guard, the leading tensor arguments (a, b, out, bias or out; a bias of another stride
    copied by ``unit_stride_bias``), their addresses, and the strides of a, of b as (K, N), and
    of the output. With no ``out``, a may have any rank (..., K): its M = a.numel() // K rows
    make an output (..., N)."""
    n = b.shape[0] if linear else b.shape[1]
    out_shape = a.shape
    if len(out_shape) != 2:  # a model's (batch, tokens, K): no views made where it is contiguous
        if out is not None:
            raise ValueError(f"out= takes a 2-D a, got a of shape {tuple(out_shape)}")
        k = out_shape[-1]
        out_shape = (*out_shape[:-1], n)
        if a.is_contiguous():
            sa = (k, 1)
        else:
            a = a.reshape(-1, k)
            sa = a.stride()
        m = a.numel() // k if k else 0
    else:
        m, k = out_shape
        out_shape = (m, n)
        sa = a.stride()
    sb = b.stride()
    bias = unit_stride_bias(bias)
    has_bias = bias is not None
    pa, pb, pbias = a.data_ptr(), b.data_ptr(), bias.data_ptr() if has_bias else 0
    guard = gemm_guard(a, b, bias, out, sa, sb, pa, pb, pbias)
    if out is None:
        out = a.new_empty(out_shape)  # 0.6 us less than torch.empty with dtype and device
        so = (n, 1)
    else:
        so = out.stride()
    po = out.data_ptr()
    strides = (sa[0], sa[1], sb[1], sb[0], so[0], so[1]) if linear else (sa[0], sa[1], sb[0], sb[1], so[0], so[1])
    return (m, n, k, out, guard, (a, b, out, bias if has_bias else out), (pa, pb, po, pbias if has_bias else po),
            strides)


def reads_bias_in_place(bias) -> bool:
    """Whether a kernel can read ``bias`` (N,) where it lies: every kernel reads element ``i`` at
    ``bias_ptr + i``, so its stride must be 1 (or N at most 1). A strided view (``t[::2]``) or
    an expanded one (``t[:1].expand(N)``, stride 0) would be misread, the latter past its
    allocation."""
    return bias is None or bias.stride(0) == 1 or bias.shape[0] <= 1


def unit_stride_bias(bias):
    """``bias`` itself where a kernel reads it in place, else a contiguous copy (one small copy
    per call, for views that a model's layers never pass)."""
    return bias if reads_bias_in_place(bias) else bias.contiguous()


def any_rank(kernel: Kernel) -> Callable:
    """``kernel`` for x (..., K): itself where it serves any rank (``serves_any_rank``: cuBLAS
    through F.linear, the kernels launched through ``launch.gemm_call``), else a wrapper that
    flattens x to (M, K) and shapes the result back (two views: a microsecond or two each). The
    wrapper is made per call, and is no ``Kernel``: ``front_entry`` takes the kernel itself."""
    if kernel.serves_any_rank:
        return kernel

    def flattening(x, weight, bias):
        return kernel(x.reshape(-1, x.shape[-1]), weight, bias).reshape(*x.shape[:-1], weight.shape[0])

    return flattening


def front_entry(kernel: Kernel, x, weight, bias) -> BoundCall:
    """What ``api.linear``'s front path calls, as ``call(x, weight, bias, px, pw, pbias)`` with
    the operands' addresses (pbias 0 without a bias), for calls like this one, which ``kernel``
    (through ``any_rank`` where x's rank is not 2) has just served: the front path's key fixes
    shapes, strides, dtypes, devices and 16-byte alignment, everything a launch depends on. Where
    the kernel can ``bind`` its launch to these operands, that bound launch (nothing recomputed
    per call but the output; cuBLASLt binds a contiguous x's rows though it serves 2-D calls
    only; a non-contiguous x of rank above 2 by its rows, ``_rows_launch``); else the kernel's
    ``front`` (itself, or cuBLAS's cheaper F.linear), flattening x where the kernel serves 2-D x
    only. The tuner times candidates' host cost through this same call."""
    if x.dim() > 2 and not x.is_contiguous():
        launch = _rows_launch(kernel, x, weight, bias)
    else:
        launch = kernel.bind(x, weight, bias)
    if launch is not None:
        return launch
    call = kernel.front if x.dim() == 2 or kernel.serves_any_rank else any_rank(kernel)

    def unbound(x, weight, bias, px: int, pw: int, pbias: int):
        return call(x, weight, bias)

    return unbound


def _rows_launch(kernel: Kernel, x, weight, bias) -> BoundCall | None:
    """For x (..., K) of rank above 2 that is not contiguous (a transposed activation: an
    MLP-Mixer's token mixing): the launch ``kernel`` binds to x's rows as one (M, K) matrix, which
    each call makes (``reshape``: a view where x's strides allow, else a contiguous copy; the front
    path's key fixes which, and a copy is 16-byte aligned as every new allocation is), its result
    shaped (..., N). None where the kernel binds nothing. Where it went through the kernel's
    wrapper, such a call cost the host 1.7-1.8x torch's (``eager-layers-h200-mixer_b16_224-20261129.json``)."""
    k = x.shape[-1]
    launch = kernel.bind(x.reshape(-1, k), weight, bias)
    if launch is None:
        return None
    out_shape = (*x.shape[:-1], weight.shape[0])

    def rows_call(x, weight, bias, px: int, pw: int, pbias: int):
        rows = x.reshape(-1, k)
        return launch(rows, weight, bias, rows.data_ptr(), pw, pbias).reshape(out_shape)

    return rows_call


def bind_gemm(kernel, launcher: Launcher, a, b, bias, linear: bool) -> Callable | None:
    """``kernel.bind(a, b, bias)`` for a wrapper launched by ``launcher`` through ``gemm_call``
    that has ``launch_args(a, m, n, k, strides) -> (grid, scalars, scratch addresses)``: a call
    ``call(a, b, bias, pa, pb, pbias)`` for operands like these in all their guard holds (pbias
    0 without bias), launching the binary from the addresses with nothing recomputed. None until
    a call with these operands made the binary, for a non-contiguous a of rank above 2 (its rows
    are copied per call) and for a bias the kernel cannot read in place (copied per call: the
    bound launch would get the caller's address)."""
    if (a.dim() != 2 and not a.is_contiguous()) or not reads_bias_in_place(bias):
        return None
    m, n, k, out, guard, _, _, strides = gemm_call(a, b, bias, None, linear)
    grid, scalars, scratch = kernel.launch_args(a, m, n, k, strides)
    direct = launcher.direct(guard, grid, scalars)
    return None if direct is None else bound_call(kernel, direct, out.shape, bias is not None, *scratch)


def bound_call(kernel, direct: tuple, out_shape: tuple, has_bias: bool, *scratch: int) -> Callable:
    """The call a GEMM wrapper's ``bind`` returns, from its launcher's ``direct``: allocates the
    output, launches the binary with the operands' addresses (the output's in the bias slot
    without one), then ``scratch`` (the addresses of the kernel's own buffers), and goes through
    ``kernel`` itself while a launch hook is set. One Python frame per call: every hit pays it."""
    run, (gx, gy, gz), stream, device, function, prefix, rest, hooks = direct
    rest = (*scratch, *rest)

    def call(a, b, bias, pa: int, pb: int, pbias: int):
        if _hooked(hooks.launch_enter_hook) or _hooked(hooks.launch_exit_hook):
            return kernel(a, b, bias)
        out = a.new_empty(out_shape)
        po = out.data_ptr()
        run(gx, gy, gz, stream(device), function, *prefix, pa, pb, po, pbias if has_bias else po, *rest)
        return out

    return call


def gemm_hints(scalars: Sequence[int]) -> dict:
    """``HINTS`` for a GEMM kernel whose scalars are m, n, k, ... and its strides: for each
    scalar after m, the largest power of two up to 8 that divides it where Triton cannot see
    one (it marks integers divisible by 16 and nothing less), else 1. Rows of 1000 bf16 elements
    start on 16-byte boundaries, but unmarked, every load of them was a 2-byte load and the
    pipeline was dropped: 1000-cubed ran 5.5x slower than cuBLAS on the H200."""
    return {"HINTS": tuple(v & -v if v % 16 else 1 for v in scalars[1:])}


def gemm_guard(a, b, bias, out, a_strides: tuple, b_strides: tuple, a_ptr: int, b_ptr: int, bias_ptr: int) -> tuple:
    """The guard of a GEMM kernel's call on a (M, K), b and bias, before its output is made:
    a's device first, then every operand's device (the direct launch passes raw addresses, which
    no one checks then), dtypes, shapes, exact strides and each address's offset from 16 bytes.
    ``out`` is the caller's output, or None for one the wrapper allocates (contiguous, aligned,
    of a's dtype and device: fixed by the rest). Buffers a kernel owns need no place in it."""
    return (a.get_device(), b.get_device(), a.dtype, b.dtype, a.shape, b.shape, a_strides, b_strides,
            a_ptr & 15, b_ptr & 15,
            None if out is None else (out.get_device(), out.dtype, out.stride(), out.data_ptr() & 15),
            None if bias is None else (bias.get_device(), bias.dtype, bias.stride(), bias_ptr & 15))


def _hooked(hook) -> bool:
    """Whether a launch hook is set: Triton keeps each as a chain of callables, empty by default
    (a plain callable or None where it was assigned directly)."""
    return hook is not None and bool(getattr(hook, "calls", True))
