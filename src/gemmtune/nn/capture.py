"""Layers at rest: a layer whose eager calls run torch's forward (``torch_when_capturing`` False:
tuned to cuBLAS and kept for the faster kernel its CUDA graphs replay, or kept where the model's
check found gemmtune's forward faster in graphs alone) waits in its torch form, the class it was
with its fused activation module in place. Its eager call is then torch's own: in gemmtune's form
the forward's mode checks cost BERT-base's layers 1.04x their ``nn.Linear`` twin's host time, 49
us of a 4.4 ms host-bound forward (docs/models.md).

One hook on each of the run's outermost modules (the model ``optimize`` was given) puts the layers
in gemmtune's form for a call made while the current stream is captured into a CUDA graph, and
back after it: the graph replays gemmtune's kernels. A capture that starts below those modules (a
graph of one block alone) captures torch's forward, as the model without gemmtune would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from torch import nn

from gemmtune.nn import keep


def at_rest(module: nn.Module) -> bool:
    """Whether ``module`` is a layer ``optimize`` took over that waits in its torch form (one
    to leave alone when a model is optimized again)."""
    return vars(module).get("torch_when_capturing") is False


class Capture:
    """The hooks of the run's outermost modules: ``forms`` in gemmtune's form while a call of one
    of those modules made during a CUDA graph capture runs (``depth``: how many such calls are
    running), in torch's form otherwise. Picklable and deep-copied with the model."""

    def __init__(self, forms: Sequence[keep.Form]) -> None:
        self.forms, self.depth = list(forms), 0

    def enter(self, module: nn.Module, args: tuple) -> None:
        if self.depth:
            self.depth += 1
        elif not keep.is_compiling() and keep.capturing():
            for form in self.forms:
                form.to_gemmtune()
            self.depth = 1

    def leave(self, module: nn.Module, args: tuple, output: object) -> None:
        if self.depth:
            self.depth -= 1
            if not self.depth:
                for form in self.forms:
                    form.to_torch()


def rest(forms: Sequence[keep.Form], roots: Sequence[nn.Module]) -> None:
    """Put each of ``forms`` whose eager calls run torch's forward in its torch form, and hook
    ``roots`` (the run's outermost modules) to put them in gemmtune's while a CUDA graph is
    captured. Without roots (a run that called no module) the layers stay as they are, each
    forward checking the mode itself."""
    resting = [form for form in forms if form.layer.torch_when_capturing is False]
    if not resting or not roots:
        return
    hooks = Capture(resting)
    for form in resting:
        form.to_torch()
    for root in roots:
        root.register_forward_pre_hook(hooks.enter)
        root.register_forward_hook(hooks.leave, always_call=True)


@contextlib.contextmanager
def outermost() -> Iterator[list[nn.Module]]:
    """The modules called while the block runs that no other module's call contains, in the order
    first called."""
    roots: list[nn.Module] = []
    depth = [0]

    def before(module: nn.Module, args: tuple) -> None:
        if not depth[0] and all(module is not root for root in roots):
            roots.append(module)
        depth[0] += 1

    def after(module: nn.Module, args: tuple, output: object) -> None:
        depth[0] -= 1

    pre = nn.modules.module.register_module_forward_pre_hook(before)
    post = nn.modules.module.register_module_forward_hook(after, always_call=True)
    try:
        yield roots
    finally:
        pre.remove()
        post.remove()
