"""What ``optimize`` keeps: after tuning a model's GEMMs, each layer stays gemmtune's only where
that can pay, and the model as a whole only where it measured faster.

A layer whose every GEMM seen in the example run was tuned to cuBLAS gains nothing on the GPU
and would pay gemmtune's host path on every call (docs/host-cost.md): it goes back to the
``nn.Linear`` it was, its fused activation module put back, so in eager its call is torch's own
and under ``torch.compile`` the graph holds the plain aten ops. The layers left are timed with the
model: the example run with them, against the same run with every layer in its torch form, in
alternated rounds of calls queued as a user's loop queues them (host time the GPU waits for is in
the samples); unless gemmtune's side is at least as fast (the median of the per-round ratios),
every layer goes back to torch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import NamedTuple

import torch
from torch import nn

from gemmtune import backends
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.results import Trial, TuneResult
from gemmtune.serving import calls, modes, recording
from gemmtune.serving.dispatch import DISPATCHER
from gemmtune.tuning import measure
from gemmtune.tuning.tuner import final_rounds

log = logging.getLogger("gemmtune")

CHECK_BUDGET_MS = 2000.0  # the wall time the model's self-check may take (several rounds at least)


# what optimize puts on a layer
GEMMTUNE_ATTRIBUTES = ("activation", "fused", "siblings", "aligned", "torch_when_capturing")

# what a taken-over layer's forward asks on every call, looked up once
is_compiling = torch.compiler.is_compiling
capturing = modes.capturing  # torch's check without its Python frame
any_autocast = calls.any_autocast  # where on, torch's forward: autocast casts its operands


class TakenOver:
    """What every layer class ``optimize`` takes a module over with declares (a first base, before
    the torch class): the class it goes back to (``torch_class``), and the defaults of what
    optimize puts on a layer. Its forward runs torch's while torch.compile traces it (the compiler
    chooses its GEMMs) and, where ``torch_when_capturing`` is set, in the mode it names:
    ``is_compiling() or self.torch_when_capturing is not None and self.torch_when_capturing ==
    capturing()``, written out in each forward (a method call would cost every layer call a
    frame; a layer with nothing set pays one attribute test)."""

    torch_class: type  # the class the layer was, whose forward is torch's
    judged_alone = True  # tuned to cuBLAS alone, it goes back to torch without the model's check
    activation: str = "none"  # the activation fused into its GEMM's epilogue
    fused: tuple[nn.Module, str, nn.Module] | None = None  # the activation module fused: parent, name, module
    # None: gemmtune's forward always; True: torch's while a CUDA graph is captured, False: torch's
    # outside captures (optimize's check found torch's faster in that mode, gemmtune's in the other)
    torch_when_capturing: bool | None = None

    def eager_host_us(self) -> float:
        """The host time (us) a served eager call costs over torch's call of the layer beyond
        what its GEMMs' own calls cost (which tuning judged): none where gemmtune's forward adds
        only those."""
        return 0.0


class Form:
    """A layer taken over by ``optimize``, in either of its two forms: its gemmtune class, or
    the class it was (its gemmtune class's ``torch_class``: ``nn.Linear``, or a transformers
    ``Conv1D``) with its fused activation module (``layer.fused``: the parent, the name, the
    module) back in its place."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer, self.cls, self.fused = layer, type(layer), layer.fused
        self.graph_only = False  # tuned to cuBLAS, kept for the faster kernel its CUDA graphs replay (``served``)
        self.identity = None if self.fused is None else self.fused[0]._modules[self.fused[1]]

    def to_torch(self) -> None:
        self.layer.__class__ = self.cls.torch_class
        if self.fused is not None:
            parent, name, module = self.fused
            parent._modules[name] = module

    def to_gemmtune(self) -> None:
        self.layer.__class__ = self.cls
        if self.fused is not None:
            parent, name, _ = self.fused
            parent._modules[name] = self.identity

    def to_eager(self) -> None:
        """The form its eager calls take once settled: torch's for a layer kept for graphs alone
        (``gemmtune.nn.capture``: it rests in torch's form), else gemmtune's."""
        if self.graph_only:
            self.to_torch()
        else:
            self.to_gemmtune()

    def release(self) -> None:
        """Back to torch for good: the layer is the ``nn.Linear`` it was, its fused activation in
        its place, nothing of gemmtune's left on it."""
        self.to_torch()
        for name in GEMMTUNE_ATTRIBUTES:
            self.layer.__dict__.pop(name, None)


@contextlib.contextmanager
def problems_per_layer(layer_type: type | tuple[type, ...]) -> Iterator[dict]:
    """While the block runs under ``gemmtune.record``, each layer (an instance of
    ``layer_type``, or of one of them) -> the keys of the problems its calls performed (a set)."""
    seen: dict[nn.Module, set] = {}
    starts: list[int] = []
    trace: list[tuple] = []
    active = recording.active()
    if active is None:
        raise RuntimeError("problems_per_layer needs an active gemmtune.record")
    active.trace = trace

    def before(module: nn.Module, args: tuple) -> None:
        if isinstance(module, layer_type):
            starts.append(len(trace))

    def after(module: nn.Module, args: tuple, out) -> None:
        if isinstance(module, layer_type) and starts:
            seen.setdefault(module, set()).update(Problem(*call).key() for call in trace[starts.pop():])

    pre = nn.modules.module.register_module_forward_pre_hook(before)
    post = nn.modules.module.register_module_forward_hook(after)
    try:
        yield seen
    finally:
        pre.remove()
        post.remove()
        active.trace = None


def on_torch(layer_problems: set, results: dict[str, TuneResult]) -> bool:
    """Whether a layer called in the run (``layer_problems``: the ``Problem.key()`` values of the
    GEMMs its calls performed) gains nothing from gemmtune: every problem was tuned to cuBLAS, or
    there was none (each call fell back to torch: a CPU tensor, a dtype gemmtune does not serve,
    an empty product)."""
    found = [results.get(key) for key in layer_problems]
    return all(r is not None and r.backend == backends.REFERENCE for r in found)


def graph_gains(layer_problems: set, results: dict[str, TuneResult]) -> bool:
    """Whether CUDA graphs of a layer whose calls were tuned to cuBLAS (``on_torch``) would replay
    a faster kernel: the dispatcher pairs cuBLAS with one for graphs where a problem's stored
    tuning found one (``Dispatcher.graph_pick``)."""
    device = current()
    return any(DISPATCHER.graph_pick(Problem.from_key(key), device, results[key].label()) is not None
               for key in layer_problems if key in results)


def final_pair(problem: Problem, chosen: str) -> tuple[Trial, Trial] | None:
    """cuBLAS's trial and that of ``problem``'s choice ``chosen`` (a trial's label) from the final
    rounds of its stored tuning on this GPU, where both were timed side by side; None where those
    rounds or the choice are not on record there."""
    found = final_rounds(DISPATCHER.trials(problem, current()))
    pick = None if found is None else found[1].get(chosen)
    return None if pick is None else (found[0], pick)


def eager_gain_us(layer_problems: set, results: dict[str, TuneResult]) -> float:
    """What a layer's eager call saves on the GPU (us) with its GEMMs' choices over cuBLAS
    (``final_pair``); a GEMM whose final rounds are not on record saves nothing."""
    saved = 0.0
    for key in layer_problems & results.keys():
        pair = final_pair(Problem.from_key(key), results[key].label())
        if pair is not None:
            saved += (pair[0].timing.median - pair[1].timing.median) * 1e3
    return saved


def served(forms: Iterable[Form], layer_problems: dict, results: dict[str, TuneResult],
           leaned: Collection[str] = ()) -> list[Form]:
    """The layers still gemmtune's after those that gain nothing from it went back to torch
    (released for good), where their class is judged alone (``judged_alone``: a plain layer); a
    layer the run never called stays, and a joined or padded layer is judged with the model. A
    layer tuned to cuBLAS (``on_torch``) gains nothing in eager calls, which cuBLAS serves either
    way: it goes back unless its CUDA graphs would replay a faster kernel (``graph_gains``), and
    then stays for graphs alone (``Form.graph_only``: its eager calls torch's forward). So does a
    layer whose served eager call costs the host more than its GEMMs save on the GPU
    (``TakenOver.eager_host_us`` against ``eager_gain_us``: attention that torch runs as one fused
    op). A GEMM whose eager calls run a lean kernel (``leaned``: their ``Problem.key()`` values)
    counts as served."""
    leaned = set(leaned)
    kept = []
    for form in forms:
        problems = layer_problems.get(form.layer)
        if form.cls.judged_alone and problems is not None and not problems & leaned:
            cublas = on_torch(problems, results)
            if cublas and not graph_gains(problems, results):
                form.release()
                continue
            extra_us = form.layer.eager_host_us()  # none for most layers: their GEMMs' gain is not read
            if cublas or extra_us and extra_us > eager_gain_us(problems, results):
                form.graph_only = True
                form.layer.torch_when_capturing = False
        kept.append(form)
    return kept


def device_index(forms: list[Form]) -> int:
    """The GPU the layers' parameters lie on (the first one found)."""
    return next(p.get_device() for form in forms for p in form.layer.parameters() if p.is_cuda)


def settle(kept: list[Form], kept_any: bool, torch_when_capturing: bool | None) -> list[Form]:
    """The layers the model's check keeps, from its conclusion (``decide``): every one back to
    torch where none stays; else each takes the mode ``torch_when_capturing`` names, but a layer
    kept for graphs alone (``Form.graph_only``) stays so, or goes back where graphs are to capture
    torch's forward."""
    settled = []
    for form in kept:
        if not kept_any or form.graph_only and torch_when_capturing is True:
            form.release()
            continue
        if torch_when_capturing is not None and not form.graph_only:
            form.layer.torch_when_capturing = torch_when_capturing
        settled.append(form)
    return settled


def decide(eager: Speedup, graph: Speedup | None) -> tuple[str, bool, bool | None]:
    """What the model's check concludes from its ``eager`` and ``graph`` speedups (graph None:
    the run cannot be captured): the verdict in words, whether the layers stay gemmtune's, and
    their ``torch_when_capturing``. A mode pays where its ratio is at least 1.0 beyond its noise
    (on a busy host eager rounds time Python: an eager verdict of 1.01 +-0.08 kept layers that
    then read 0.90 in the benchmark's own rounds, while graph replays time the GPU to 0.1%)."""
    words = f"eager {eager}" + ("" if graph is None else f", graph {graph}")
    eager_pays = eager.pays()
    graph_pays = graph is not None and graph.ratio > 1.0 + graph.noise
    if eager_pays and (graph is None or graph.ratio >= 1.0):
        return words, True, None
    if eager_pays:
        return words + ", so CUDA graphs capture torch's forward", True, True
    if graph_pays:
        return words + ", so eager calls run torch's forward and CUDA graphs capture gemmtune's", True, False
    return words + ", so every layer goes back to torch", False, None


def decide_training(words: str, train: Speedup) -> tuple[str, bool]:
    """``decide``'s verdict (``words``, the layers kept) with a training step's ``train`` speedup
    added: the layers stay only where the step pays too, at least 1.0 beyond its noise."""
    words += f", train step {train}"
    if train.pays():
        return words, True
    return words + ", so every layer goes back to torch", False


def on_a_gpu(forms: list[Form]) -> bool:
    """Whether any of the layers' parameters lie on a GPU, where the model's check can time them."""
    return any(p.is_cuda for form in forms for p in form.layer.parameters())


class Speedup(NamedTuple):
    """The run's time in torch's form over gemmtune's (above 1: gemmtune faster), the median of
    the per-round ratios, and ``noise``, their spread (half the inter-quartile range, relative);
    ``retimed`` where it is a second reading, the first having been undecided."""

    ratio: float
    noise: float
    retimed: bool = False

    def pays(self) -> bool:
        """Faster by at least its noise."""
        return self.ratio >= 1.0 + self.noise

    def undecided(self) -> bool:
        """Not faster by its noise, and within twice its noise of level."""
        return not self.pays() and abs(self.ratio - 1.0) <= 2 * self.noise

    @classmethod
    def of(cls, timings: dict) -> Speedup:
        gemmtune, torch_form = timings["gemmtune"], timings["torch"]
        return cls(1.0 / gemmtune.ratio_to(torch_form), gemmtune.spread_against(torch_form))

    def __str__(self) -> str:
        return f"{self.ratio:.2f}x +-{self.noise:.2f}" + (" (timed twice)" if self.retimed else "")


def speedup(run: Callable[[], object], forms: list[Form], *, budget_ms: float = CHECK_BUDGET_MS) -> Speedup:
    """The run with every layer in its torch form against the layers in the form their eager
    calls take (``Form.to_eager``), timed in alternated rounds of queued calls; the layers are
    left in gemmtune's form. A reading that neither pays nor lies beyond twice its noise below
    level (``Speedup.undecided``) is timed once more, and the second decides: a busy host's
    moment of noise read a Llama decode that runs 1.13x as fast with gemmtune
    (models-h200-resting-20261129.json) as 1.05x +-0.09, and its eager calls went back to torch
    (models-h200-lean-20261129.json); another read Mixer-B, 1.16x, as 0.86x +-0.14
    (models-h200-retimed-20261129.json)."""
    found = _speedup_once(run, forms, budget_ms)
    if found.undecided():
        found = _speedup_once(run, forms, budget_ms)._replace(retimed=True)
    return found


def _speedup_once(run: Callable[[], object], forms: list[Form], budget_ms: float) -> Speedup:
    def to_torch() -> None:
        for form in forms:
            form.to_torch()

    def to_eager() -> None:
        for form in forms:
            form.to_eager()

    try:
        timings = measure.loops({"gemmtune": run, "torch": run}, current(), budget_ms=budget_ms,
                                enter={"gemmtune": to_eager, "torch": to_torch})
    finally:
        for form in forms:
            form.to_gemmtune()
    return Speedup.of(timings)


def graph_speedup(run: Callable[[], object], forms: list[Form], *,
                  budget_ms: float = CHECK_BUDGET_MS) -> Speedup | None:
    """``speedup`` of the run captured as a CUDA graph in each form and replayed (host time
    gone, the GPU's alone), or None where the run cannot be captured (a host sync inside it, say).
    The layers are left in gemmtune's form."""
    replays = {}
    try:
        for side, form_of in (("torch", Form.to_torch), ("gemmtune", Form.to_gemmtune)):
            for form in forms:
                form_of(form)
            graph = measure.captured({side: run})
            if graph is None:
                log.debug("gemmtune.optimize: the run cannot be captured as a CUDA graph: judged in eager alone")
                return None
            replays.update(graph)
    finally:
        for form in forms:
            form.to_gemmtune()
    return Speedup.of(measure.loops(replays, current(), budget_ms=budget_ms))
