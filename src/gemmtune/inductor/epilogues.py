"""Which activation follows each linear layer of a model, read from Dynamo's graph: there the
activation is still one call (``gelu``), where the compiler's aten graph has it decomposed into
multiplies and an ``erf``. A layer whose product is followed by one activation alone is tuned
with it fused (``GemmtuneChoices.choice``), so that a Triton config which pays through the
saved pass runs as the compiler's template, the activation in its epilogue. Where the compiler
cannot fuse across the view a linear on more than 2-D input decomposes into
(``hooks.fuses_through_views``), such a layer counts as followed by nothing: its fused form
would be tuned for a fusion that does not happen.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from gemmtune.inductor import hooks
from gemmtune.problem import Problem
from gemmtune.serving.calls import DTYPE_NAMES

LINEAR = (torch._C._nn.linear, F.linear)
_FIXED = {torch.relu: "relu", F.relu: "relu", F.silu: "silu"}
_GELU = (torch._C._nn.gelu, F.gelu)
_GELU_FORMS = {"none": "gelu", "tanh": "gelu_tanh"}


def activations(graph: torch.fx.GraphModule, device_types: Iterable[str], tf32: bool) -> dict[Problem, str]:
    """The linear products of ``graph`` (Dynamo's) followed by one activation alone, as the
    problem the compiler will lower (no activation) -> the activation's name. A product also
    seen with another activation, or with none, is left out: one choice serves every call."""
    seen: dict[Problem, set[str]] = {}
    through_views = hooks.fuses_through_views()
    for node in graph.graph.nodes:
        if node.op == "call_function" and node.target in LINEAR:
            problem = _problem(node, tuple(device_types), tf32)
            if problem is not None:
                fusable = through_views or _example(node.args[0]).dim() <= 2
                seen.setdefault(problem, set()).add(_follower(node) if fusable else "none")
    return {problem: acts.pop() for problem, acts in seen.items() if len(acts) == 1 and "none" not in acts}


def _problem(node: torch.fx.Node, device_types: tuple[str, ...], tf32: bool) -> Problem | None:
    """The problem of a ``linear(x, weight, bias)`` node, from its operands' example values."""
    x, weight, bias = (_example(a) for a in [*node.args, None, None][:3])
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or weight.dim() != 2 \
            or x.device.type not in device_types:
        return None
    dtype = DTYPE_NAMES.get(x.dtype)
    sizes = (*x.shape, *weight.shape)
    if dtype is None or not all(isinstance(s, int) for s in sizes) or x.dim() < 1 or x.numel() == 0:
        return None
    n, k = weight.shape
    return Problem(x.numel() // k, n, k, dtype, "linear", isinstance(bias, torch.Tensor), tf32)


def _follower(node: torch.fx.Node) -> str:
    """The activation that alone takes ``node``'s output, else "none"."""
    users = list(node.users)
    if len(users) != 1 or users[0].op != "call_function" or users[0].args[:1] != (node,):
        return "none"
    user = users[0]
    if user.target in _FIXED:
        return _FIXED[user.target]
    if user.target in _GELU:
        form = user.kwargs.get("approximate", user.args[1] if len(user.args) > 1 else "none")
        return _GELU_FORMS.get(form, "none")
    return "none"


def _example(arg):
    """The example value Dynamo recorded for a node argument; None for anything else."""
    return getattr(arg, "meta", {}).get("example_value")
