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

The hooks cost each call of the model too: a module with hooks takes torch's longer call path,
2.5-7 us of host time on an H200's host and 4-6.5 us on a CPU host, where the checks cost
0.75-0.82 and 0.47-0.49 us a layer call (``benchmarks/probes/capture_hook.py``,
``capture-hook-h200-20261129.json``). So the layers rest only where the model's call makes at
least ``REST_FROM`` calls of them; else each checks the mode itself (the seeds' two-layer MLP).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from torch import nn

from gemmtune.nn import keep

# resting layers' calls per call of the model, the least at which they rest: the hooks' cost in checks, and a margin
REST_FROM = 12


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


class Called:
    """The module calls of a run: ``roots``, the modules called where no other module's call
    contains the call, in the order first called so; ``root_calls``, how many such calls;
    ``calls``, each module's number of calls."""

    def __init__(self) -> None:
        self.roots: list[nn.Module] = []
        self.root_calls = 0
        self.calls: dict[nn.Module, int] = {}

    def per_root_call(self, modules: Sequence[nn.Module]) -> float:
        """How many calls of ``modules`` each call of a root made, on average."""
        return sum(self.calls.get(module, 0) for module in modules) / self.root_calls if self.root_calls else 0.0


def rest(forms: Sequence[keep.Form], called: Called) -> None:
    """Put each of ``forms`` whose eager calls run torch's forward in its torch form, and hook the
    run's outermost modules (``called.roots``) to put them in gemmtune's while a CUDA graph is
    captured, where the model's call makes at least ``REST_FROM`` calls of them; else (and without
    roots: a run that called no module) the layers stay as they are, each forward checking the
    mode itself."""
    resting = [form for form in forms if form.layer.torch_when_capturing is False]
    if not resting or called.per_root_call([form.layer for form in resting]) < REST_FROM:
        return
    hooks = Capture(resting)
    for form in resting:
        form.to_torch()
    for root in called.roots:
        root.register_forward_pre_hook(hooks.enter)
        root.register_forward_hook(hooks.leave, always_call=True)


@contextlib.contextmanager
def calls() -> Iterator[Called]:
    """The module calls made while the block runs (``Called``)."""
    called = Called()
    depth = [0]

    def before(module: nn.Module, args: tuple) -> None:
        if not depth[0]:
            called.root_calls += 1
            if all(module is not root for root in called.roots):
                called.roots.append(module)
        called.calls[module] = called.calls.get(module, 0) + 1
        depth[0] += 1

    def after(module: nn.Module, args: tuple, output: object) -> None:
        depth[0] -= 1

    pre = nn.modules.module.register_module_forward_pre_hook(before)
    post = nn.modules.module.register_module_forward_hook(after, always_call=True)
    try:
        yield called
    finally:
        pre.remove()
        post.remove()
