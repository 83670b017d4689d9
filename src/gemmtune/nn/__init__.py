"""Models: ``gemmtune.optimize(model)`` makes a model's ``nn.Linear`` layers run gemmtune's
kernels, fuses the activation that follows a layer where the model's structure says so, and with
example inputs tunes every GEMM the model performs before it returns.

A replaced layer keeps its identity: the module object, its parameters, hooks and state_dict keys
stay; only its class becomes ``gemmtune.nn.Linear`` (an ``nn.Linear`` whose forward calls
``gemmtune.linear``). A fused activation module is replaced by ``nn.Identity``. With
``siblings=True`` layers called one after another on one input share one GEMM
(``gemmtune.nn.joined``): their class becomes ``JoinedLinear``, and their parameters stay, as views
of the joined weight. A layer whose K or N leaves cuBLAS's fast path (``gemmtune.nn.padded``) keeps
its weight zero-padded to aligned sizes: its class becomes ``AlignedLinear``, and its parameters
stay, as views of the padded buffers. Layers kept for CUDA graphs alone wait in the class they
were where the model calls enough of them, and the model's hooks put them in gemmtune's while a
graph is captured (``gemmtune.nn.capture``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gemmtune import activation as activations
from gemmtune import api
from gemmtune.device import current
from gemmtune.nn import attention
from gemmtune.nn import capture
from gemmtune.nn import conv1d as conv1d_layers
from gemmtune.nn import fusion
from gemmtune.nn import joined as sibling_layers
from gemmtune.nn import keep
from gemmtune.nn import lean as lean_kernels
from gemmtune.nn import padded as aligned_layers
from gemmtune.nn import refused
from gemmtune.nn import residual as residual_sites
from gemmtune.nn.scaled import ScaledLinear  # noqa: F401 - gemmtune.nn.ScaledLinear
from gemmtune.serving import recording
from gemmtune.serving.dispatch import DISPATCHER
from gemmtune.tuning.tuner import TuneOptions

log = logging.getLogger("gemmtune")
_is_compiling, _capturing, _autocast = keep.is_compiling, keep.capturing, keep.any_autocast


class Linear(keep.TakenOver, nn.Linear):
    """``nn.Linear`` through gemmtune, with an optional fused activation. While torch.compile
    traces it, it is the ``nn.Linear`` and activation it stands for: the compiler chooses its GEMM
    (a gemmtune custom op would cost ~60-80 us of host time per call in the compiled graph,
    docs/host-cost.md)."""

    torch_class = nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _is_compiling() or self.torch_when_capturing is not None and self.torch_when_capturing == _capturing():
            out = F.linear(x, self.weight, self.bias)  # torch_forward's, without its frame: a layer kept for
            # one mode pays nothing over nn.Linear's call in the other (two frames cost ~0.5 us a call)
            return out if self.activation == "none" else activations.apply(out, self.activation, inplace=False)
        return api.linear(x, self.weight, self.bias, None if self.activation == "none" else self.activation)

    def torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        return activations.apply(F.linear(x, self.weight, self.bias), self.activation, inplace=False)

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.activation == "none" else f", activation={self.activation}")


class JoinedLinear(Linear):
    """A ``Linear`` joined with its siblings (``gemmtune.nn.joined``): served from their one GEMM
    where it can be, else as a ``Linear``. A class of its own, so that the other layers' calls
    check nothing more."""

    judged_alone = False
    siblings: sibling_layers.Siblings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _is_compiling() or _autocast() or self.torch_when_capturing is not None \
                and self.torch_when_capturing == _capturing():
            return self.torch_forward(x)
        out = self.siblings.output(self, x)
        return super().forward(x) if out is None else out


class AlignedLinear(Linear):
    """A ``Linear`` whose weight is stored zero-padded to aligned sizes (``gemmtune.nn.padded``):
    served by the aligned GEMM where it can be, else as a ``Linear``."""

    judged_alone = False
    aligned: aligned_layers.Aligned

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _is_compiling() or _autocast() or self.torch_when_capturing is not None \
                and self.torch_when_capturing == _capturing():
            return self.torch_forward(x)
        out = self.aligned.output(self, x)
        return super().forward(x) if out is None else out

    def extra_repr(self) -> str:
        rows, cols = self.aligned.weight.shape
        return super().extra_repr() + f", stored padded to ({rows}, {cols})"


TransposedLinear = conv1d_layers.TransposedLinear  # a transformers Conv1D taken over (gemmtune.nn.conv1d)
FUSABLE = (Linear, TransposedLinear)  # the layers an activation that follows can be fused into
LAYERS = FUSABLE + (attention.MultiheadAttention,)  # the layers optimize takes over


def optimize(model: nn.Module, example_inputs: Sequence | None = None, *,
             filter: Callable[[str, nn.Module], bool] | None = None, fuse: bool = True,
             siblings: bool = False, align: bool = True, check: bool = True, residual: bool = False,
             options: TuneOptions | None = None) -> nn.Module:
    """Run ``model``'s ``nn.Linear`` layers and transformers' ``Conv1D`` layers (GPT-2's; those
    ``filter(name, layer)`` accepts; all by default) through gemmtune, in place, and return the
    model. A Conv1D keeps its class's behaviour and parameters, its weight stored as the transposed
    view of an (N, K) buffer (``gemmtune.nn.conv1d`` says which layers, and how). A layer gemmtune
    cannot take (a parameter shared with another module, meta weights, a dtype it does not serve,
    a non-contiguous weight, a forward set on the instance) is left untouched, and one log line
    names it and why; a model whose
    parameters all lie on the CPU while a GPU is present is left unchanged, with one log line
    (``gemmtune.nn.refused``).

    ``fuse`` folds an activation module (ReLU, GELU exact or tanh, SiLU; transformers' and timm's
    GELU and SiLU classes are checked for what they compute) into the layer before it where the
    layer's output goes to it and nowhere else: next to each other in an ``nn.Sequential``, or as a
    parent module's forward calls them (timm's ``Mlp``, BERT's intermediate layer, GPT-2's MLP),
    read by tracing that forward with torch.fx; a forward fx cannot trace fuses nothing
    (``gemmtune.nn.fusion`` says what counts). With ``example_inputs`` the model runs
    once on them (without gradients, its GEMMs served by cuBLAS), then every GEMM it performed is
    tuned, their candidates compiled together, and stored, so the next calls find their kernels;
    without them, each GEMM is tuned when first seen (or served
    by cuBLAS in ``GEMMTUNE_MODE=lookup``).

    ``siblings`` (off by default; needs ``example_inputs``): layers that the example run calls
    one after another on the same input (a Llama's q, k and v projections; its gate and up)
    are joined, and one GEMM over their weights serves them (``gemmtune.nn.joined`` says when a
    call runs alone instead, and what torch.compile cannot check). Each returns a view of the
    joined output, whose rows are the joined width apart.

    ``align`` (on by default): a CUDA layer whose in_features or out_features is not a multiple
    of 16 bytes keeps its weight and bias zero-padded to aligned sizes, the parameters becoming
    views of the padded buffers (only the padding is added), so that a call of enough rows copies
    its input, not the weight, and runs the aligned GEMM (``gemmtune.nn.padded`` says when).

    ``residual`` (off by default): where a module's forward adds a layer's output to another tensor
    of its shape (a transformer block's residual: ``x + mlp(norm(x))``, BERT's
    ``LayerNorm(dense(h) + x)``), the module's eval-mode calls run a traced forward in which
    cuBLASLt adds it in the GEMM's epilogue, where the first call of each row count measures that
    faster than the GEMM and the add (``gemmtune.nn.residual`` says which forwards and calls).

    The example's runs (one to record, more in the check) leave the running statistics of the
    model's normalization layers and the random generators as they were, so that optimizing a
    model in training mode does not pull its BatchNorm statistics toward the example batch.

    ``check`` (on by default): with ``example_inputs``, optimize keeps only what pays
    (``gemmtune.nn.keep``): a layer whose GEMMs were all tuned to cuBLAS goes back to the
    ``nn.Linear`` it was (its activation module too), and the layers left stay only if the model
    measures at least as fast with them; without a CUDA GPU nothing is tuned, and every layer goes
    back. One log line says what was kept. ``check=False`` keeps every layer gemmtune's.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize(model=...): expected a torch.nn.Module, got {type(model).__name__}")
    if siblings and example_inputs is None:
        raise ValueError("optimize(siblings=True) needs example_inputs: siblings are found in the example run")
    if refused.on_the_cpu(model):
        log.warning("gemmtune.optimize: the model's parameters are on the CPU, where its calls would run torch's "
                    "kernels: nothing changed (optimize after model.cuda())")
        return model
    _take_over(model, filter)
    if fuse:
        _fuse_activations(model)
    if align:
        for module in model.modules():
            if type(module) is Linear and aligned_layers.misaligned(module):
                module.aligned = aligned_layers.Aligned(module)
                module.__class__ = AlignedLinear
    if residual:
        sites = residual_sites.rewrite(model, lambda module: isinstance(module, Linear))
        log.info("gemmtune.optimize: %d residual adds found after layers, each fused into its GEMM where it "
                 "measures faster", sites)
    if example_inputs is not None:
        tune_model(model, example_inputs, options=options, siblings=siblings, check=check)
    return model


def _take_over(model: nn.Module, filter: Callable[[str, nn.Module], bool] | None) -> None:
    """Make each ``nn.Linear`` and Conv1D layer ``filter`` accepts gemmtune's, except those
    gemmtune cannot take (``gemmtune.nn.refused``: one log line names them and why)."""
    held, refusals = refused.holders(model), {}
    for name, module in list(model.named_modules()):
        if capture.at_rest(module):
            continue  # taken over already: it waits in its torch form for CUDA graph captures
        if type(module) is nn.MultiheadAttention and (filter is None or filter(name, module)):
            why = attention.reason(module, held)
            if why is None:
                attention.take_over(module)
            else:
                refusals[name] = why
            continue
        conv1d = type(module) is not nn.Linear and conv1d_layers.is_conv1d(module)
        if not (type(module) is nn.Linear or conv1d) or filter is not None and not filter(name, module):
            continue
        why = refused.reason(module, held, restored=conv1d)
        if why is None and conv1d and not conv1d_layers.computes_linear(module):
            why = "a Conv1D whose forward does not compute x @ weight + bias"
        if why is not None:
            refusals[name] = why
        elif conv1d:
            conv1d_layers.take_over(module)
        else:
            module.__class__ = Linear
    if refusals:
        log.warning(refused.summary(refusals))


def _fuse_activations(model: nn.Module) -> None:
    """Fold each activation module that a layer's output goes to alone into the layer
    (``gemmtune.nn.fusion.pairs``): the module becomes ``nn.Identity`` in its parent, and the
    layer keeps it in ``fused`` to put it back."""

    def unfused_layer(module: nn.Module) -> bool:
        return isinstance(module, FUSABLE) and module.activation == "none"

    for pair in fusion.pairs(model, unfused_layer):
        layer, act = pair.parent._modules[pair.layer], pair.parent._modules[pair.activation]
        if layer.activation != "none" or isinstance(act, nn.Identity):
            continue  # fused already by an earlier pair
        layer.activation = pair.epilogue
        layer.fused = (pair.parent, pair.activation, act)
        pair.parent._modules[pair.activation] = nn.Identity()


def tune_model(model: nn.Module, example_inputs: Sequence, *, options: TuneOptions | None = None,
               siblings: bool = False, check: bool = True) -> list:
    """Run ``model(*example_inputs)`` once without gradients, recording its GEMMs, then tune
    and store each, keeping what pays (``tune_calls``); the TuneResults. The model's running
    statistics and the random generators are left as they were (``_state_kept``)."""
    if not isinstance(example_inputs, (tuple, list)):
        raise TypeError("optimize(example_inputs=...): expected a tuple or list of the model's positional inputs, "
                        f"got {type(example_inputs).__name__}")
    step = _train_step(model, example_inputs) if check and _training(model) else None
    with _state_kept(model), _grads_kept(model) if step is not None else contextlib.nullcontext():
        return tune_calls(lambda: model(*example_inputs), options=options, siblings=siblings, check=check,
                          step=step)


def _training(model: nn.Module) -> bool:
    """Whether ``model`` is being trained: in training mode, gradients on, a parameter needing one."""
    return model.training and torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())


def _train_step(model: nn.Module, example_inputs: Sequence) -> Callable[[], bool]:
    """A training step on the example: the forward, and the backward of the sum of its floating
    outputs (a loss of the model's own is not known here); False where no output needs a gradient."""

    def step() -> bool:
        outputs = [t for t in _tensors(model(*example_inputs)) if t.is_floating_point() and t.requires_grad]
        if not outputs:
            return False
        sum(t.float().sum() for t in outputs).backward()
        return True

    return step


def _tensors(out) -> list[torch.Tensor]:
    """The tensors of a model's output: itself, or those of a tuple, list or mapping (transformers'
    outputs are mappings), one level down."""
    if isinstance(out, torch.Tensor):
        return [out]
    values = out.values() if isinstance(out, Mapping) else out if isinstance(out, (tuple, list)) else ()
    return [value for value in values if isinstance(value, torch.Tensor)]


@contextlib.contextmanager
def _grads_kept(model: nn.Module):
    """The parameters' gradients set aside while optimize's train steps run (their backward writes
    fresh ones), and put back on exit: a user's accumulated gradients are neither added to nor lost."""
    params = list(model.parameters())
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in zip(params, saved):
            p.grad = grad


@contextlib.contextmanager
def _state_kept(model: nn.Module):
    """The running statistics of ``model``'s normalization layers (those that track them, as
    BatchNorm and InstanceNorm do: their means, variances and batch counts) and the CPU's and
    GPUs' random generators restored on exit:
    optimize runs the example once to record its GEMMs and dozens of times in its check, which in
    a model in training mode would pull those statistics toward the example's batch and move the
    random streams (dropout) a user's run goes on from."""
    saved = [(buffer, buffer.detach().clone()) for module in model.modules() if getattr(module, "track_running_stats", False)
             for name in ("running_mean", "running_var", "num_batches_tracked")
             if isinstance(buffer := getattr(module, name, None), torch.Tensor)]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def tune_calls(run: Callable[[], object], *, options: TuneOptions | None = None, siblings: bool = False,
               check: bool = True, step: Callable[[], bool] | None = None) -> list:
    """Call ``run()`` once without gradients, its GEMMs served by cuBLAS and recorded, then tune
    and store every one of them, their candidates compiled together; the TuneResults. For runs
    that one example call does not cover (a model's prefill and its decode steps at each batch).
    ``siblings``: join the sibling layers the run shows (see ``optimize``), then run it once more
    so that what is recorded and tuned is the joined GEMMs. ``check``: keep only what pays
    (``optimize`` says how), timing ``run()`` with and without gemmtune's layers; then the residual
    sites of the modules it calls choose their ways again (``residual.settle``). ``step``: a
    training step of the run (forward and backward; False where nothing needed a gradient): with
    ``check``, its GEMMs are tuned too and the layers stay only if it pays as well."""
    started = time.perf_counter()
    watch = sibling_layers.watching(Linear) if siblings else contextlib.nullcontext([])
    with recording.record() as seen, DISPATCHER.deferring(), torch.no_grad(), watch as calls, \
            keep.problems_per_layer(LAYERS) as per_layer, capture.calls() as called:
        run()
    joined = sibling_layers.groups(calls)
    for group in joined:
        sibling_layers.Siblings(group)
        for layer in group:
            layer.__class__ = JoinedLinear
    if joined:
        log.info("gemmtune.optimize: %d groups of sibling layers joined (%d layers)", len(joined),
                 sum(map(len, joined)))
        with recording.record() as seen, DISPATCHER.deferring(), torch.no_grad(), \
                keep.problems_per_layer(LAYERS) as per_layer:
            run()
    problems = [problem for problem, _ in seen.problems()]
    if current().interpreter:  # CPU layers fall back to torch: nothing to gain from tuning them
        log.warning("gemmtune.optimize: no CUDA GPU, so the %d GEMMs seen are not tuned%s", len(problems),
                    " and the layers go back to torch" if check else "")
        if check:
            for layer in per_layer:
                keep.Form(layer).release()
        return []
    results = api.tune(problems, options=options)  # which drops the kernels built before it
    if check:
        _keep_what_pays(run, per_layer, results, calls={problem.key(): n for problem, n in seen.problems()},
                        started=started, step=step, called=called)
        said = residual_sites.settle(called.roots, run)
        if said:
            log.info("gemmtune.optimize: %s", said)
    return results


def _train_speedup(step: Callable[[], bool], kept: list) -> keep.Speedup | None:
    """The training step timed in both forms (``keep.speedup``), after its GEMMs (the backward's
    among them) are recorded and tuned; None where no output of the step needs a gradient, or
    where the step fails (a backward of the example that does not fit in memory, say: the forward's
    verdict stands, and a warning says so)."""
    try:
        with recording.record() as seen, DISPATCHER.deferring():
            trained = step()
        if not trained:
            return None
        api.tune([problem for problem, _ in seen.problems()])
        return keep.speedup(step, kept)
    except Exception as error:  # noqa: BLE001 - a check that cannot run leaves the forward's verdict
        log.warning("gemmtune.optimize: the model is in training mode, but a train step on the example failed "
                    "(%s: %s): the layers are judged on the forward alone", type(error).__name__, str(error)[:200])
        return None


def _keep_what_pays(run: Callable[[], object], per_layer: dict, results: list, *, calls: dict[str, int],
                    started: float, called: capture.Called, step: Callable[[], bool] | None = None) -> None:
    """The layers the run called that were tuned to cuBLAS alone go back to torch, but for those
    whose CUDA graphs would replay a faster kernel, kept for graphs alone (``keep.served``); the
    rest are timed with the run in eager and captured as a CUDA graph (``gemmtune.nn.keep``) and
    kept where either measures faster with them: where both do, in both; where only one does,
    torch's forward serves the other mode (``torch_when_capturing``); where neither does, every
    layer goes back to torch (``keep.settle``). A layer whose eager calls run torch's forward
    waits in its torch form, and hooks on the run's outermost modules (``called.roots``) put it
    in gemmtune's while a CUDA graph is captured, where that saves more than the hooks cost
    (``gemmtune.nn.capture``). An eager verdict times host work, whose noise on
    a busy host hid graph gains measured to 0.1% (the seeds' float32 MLP, 1.07x as a graph, was
    handed back whole). With a
    training ``step`` (optimize of a model in training mode), layers kept so stay only if the step
    pays too: a call that needs a gradient runs gemmtune's forward through autograd and its
    activation unfused, which cost a ViT-B/16 train step with every layer gemmtune's 1.09x torch's
    time on an H100 (docs/python.md, training). Before all this, where the run is paced by its host,
    its GEMMs' eager calls are tried on the kernels whose launches cost the host least, where the
    GPU has room for their extra time (``calls``: each GEMM's calls in the run), and where the run
    measures faster so, they serve them, and the layers whose calls they serve count as
    served (``gemmtune.nn.lean``). One log line."""
    forms = [keep.Form(layer) for layer in per_layer]
    by_key = {r.problem_key: r for r in results}
    with torch.no_grad():
        lean, paced = lean_kernels.tried(run, forms, per_layer, by_key, calls)
    kept = keep.served(forms, per_layer, by_key, () if lean is None else lean.keys())
    verdict = "nothing to time"
    if kept and keep.on_a_gpu(kept):
        with torch.no_grad():
            eager = keep.speedup(run, kept) if lean is None else lean.eager
            graph = keep.graph_speedup(run, kept)
        verdict, kept_any, torch_when_capturing = keep.decide(eager, graph)
        if kept_any and step is not None:
            train = _train_speedup(step, kept)
            if train is not None:
                verdict, kept_any = keep.decide_training(verdict, train)
        if lean is not None and not kept_any:
            lean.drop()
        kept = keep.settle(kept, kept_any, torch_when_capturing)
        capture.rest(kept, called)
    if paced:
        verdict = f"{paced}; {verdict}"
    log.info("gemmtune.optimize: %d GEMM calls seen in %d layers, %d layers served by gemmtune, %d left to torch; "
             "%s; setup %.1f s", sum(calls.values()), len(forms), len(kept), len(forms) - len(kept), verdict,
             time.perf_counter() - started)
