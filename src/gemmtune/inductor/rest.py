"""What a compiled graph costs besides the GEMMs gemmtune weighs (``plan.Rest``), estimated from
the compiler's aten graph before it is lowered, with the devices' rooflines.

- A library call (an mm or addmm not weighed, bmm, baddbmm, a convolution, attention): the library
  call's host time, and its flops at the device's matrix rate;
- a reduction (a norm's mean, a softmax's max and sum): one Triton kernel, reading its input;
- any other op that computes (pointwise, copies, gathers): the compiler fuses a chain of them into
  one kernel, so only an op none of whose inputs comes from another such op starts a kernel,
  which reads and writes about its output;
- views, placeholders and the graph's output: nothing;
- and a run of the graph its guards' and wrapper's host time (``plan.GRAPH_MS``).

The estimate only has to tell a graph the host paces (decode, small batches) from one the GPU
paces (large batches), with the plan's margin on the host's speed (``plan.host_scales``): it
counts kernels as the compiler would make them, roughly, and their bytes and flops at
attainable rates.
"""

from __future__ import annotations

import math
import operator

import torch

from gemmtune.backends.costmodel import dram_bytes_per_s, peak_flops
from gemmtune.device import Device
from gemmtune.inductor.plan import GRAPH_MS, HOST_MS, LAUNCH_MS, LIBRARY, Rest
from gemmtune.serving.calls import DTYPE_NAMES

FLOPS_EFFICIENCY = 0.6  # of the matrix peak a library GEMM or attention kernel attains
BYTES_EFFICIENCY = 0.7  # of the DRAM bandwidth a compiled pointwise or reduction kernel attains
_aten = torch.ops.aten
_ATTENTION = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward")
_REDUCTION = getattr(torch.Tag, "reduction", None)
_REDUCTIONS = ("sum", "mean", "amax", "amin", "max", "min", "var", "var_mean", "std", "prod", "argmax", "argmin",
               "_softmax", "_log_softmax", "native_layer_norm", "logsumexp", "cumsum", "any", "all")


def estimate(graph: torch.fx.GraphModule, weighed: set, device: Device, tf32: bool) -> Rest:
    """The host and GPU time of ``graph``'s kernels other than the ``weighed`` nodes (the GEMMs
    ``plan`` weighs), per run."""
    host, gpu = GRAPH_MS, 0.0
    fused = set()  # nodes whose output a fused kernel computes (through views)
    for node in graph.graph.nodes:
        if node.op != "call_function" or node in weighed:
            continue
        kind = _kind(node)
        if kind == "view":
            if any(arg in fused for arg in node.all_input_nodes):
                fused.add(node)
        elif kind == "library":
            host += HOST_MS[LIBRARY]
            gpu += _library_ms(node, device, tf32)
        elif kind == "reduction":
            host += LAUNCH_MS
            gpu += sum(_bytes(arg) for arg in node.all_input_nodes) / _bandwidth(device)
        else:
            if not any(arg in fused for arg in node.all_input_nodes):
                host += LAUNCH_MS
                gpu += 2 * _bytes(node) / _bandwidth(device)
            fused.add(node)
    return Rest(host, gpu)


def _kind(node) -> str:
    target = node.target
    if target is operator.getitem or not isinstance(target, torch._ops.OpOverload) or target.is_view:
        return "view"
    name = target.overloadpacket.__name__
    if target.overloadpacket in (_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.convolution) \
            or name in _ATTENTION:
        return "library"
    if (_REDUCTION is not None and _REDUCTION in target.tags) or name in _REDUCTIONS:
        return "reduction"
    return "pointwise"


def _library_ms(node, device: Device, tf32: bool) -> float:
    """A library call's kernel time at the device's attainable matrix rate."""
    values = [getattr(arg, "meta", {}).get("val") for arg in node.args]
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    out = node.meta.get("val")
    if not tensors or not isinstance(out, (torch.Tensor, tuple, list)):
        return 0.0
    packet, first = node.target.overloadpacket, tensors[0]
    if packet in (_aten.addmm, _aten.baddbmm):
        tensors = tensors[1:]
    if packet is _aten.convolution:
        weight = tensors[1]
        flops = 2 * _numel(out) * _numel(weight) / _size(weight.shape[0])
    elif packet.__name__ in _ATTENTION:  # q (..., L, E), k (..., S, E), v (..., S, Ev)
        q, k, v = tensors[:3]
        flops = 2 * _numel(q) / _size(q.shape[-1]) * _size(k.shape[-2]) * (_size(q.shape[-1]) + _size(v.shape[-1]))
    else:  # a (..., M, K) @ b (..., K, N)
        a, b = tensors[:2]
        flops = 2 * _numel(a) * _size(b.shape[-1])
    dtype = DTYPE_NAMES.get(first.dtype, "bfloat16")
    return flops / (FLOPS_EFFICIENCY * peak_flops(dtype, tf32, device)) * 1e3


def _bandwidth(device: Device) -> float:
    """Bytes per ms a compiled kernel streams."""
    return BYTES_EFFICIENCY * dram_bytes_per_s(device) / 1e3


def _bytes(node) -> float:
    value = node.meta.get("val")
    values = value if isinstance(value, (tuple, list)) else (value,)
    return sum(_numel(v) * v.element_size() for v in values if isinstance(v, torch.Tensor))


def _numel(value) -> float:
    if isinstance(value, (tuple, list)):
        return sum(_numel(v) for v in value if isinstance(v, torch.Tensor))
    return math.prod(_size(d) for d in value.shape)


def _size(dim) -> int:
    """A dimension's size; a dynamic one's hint (1 where it has none)."""
    if isinstance(dim, int):
        return dim
    hint = getattr(getattr(dim, "node", None), "hint", None)
    return int(hint) if hint is not None else 1
