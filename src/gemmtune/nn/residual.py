"""Residual adds in the epilogue of the GEMM before them (``optimize(residual=True)``).

A block's forward often adds a linear layer's output to its input: ``x + drop_path(mlp(norm(x)))``
in timm's blocks (the MLP's output is its fc2's), ``LayerNorm(dropout(dense(h)) + x)`` in BERT's
output layers, ``h + dropout(DenseReluDense(norm(h)))`` in T5's. That add is a kernel of its own,
which reads the GEMM's output and the residual and writes their sum; cuBLASLt adds the residual
in the GEMM's epilogue instead (its C operand with a beta of 1, one rounding) for one more read.
On an H200 that saved 0.9-3.8% of the zoo's transformers' GPU time and one launch per add
(``residual-h200-20261129.json``, docs/models.md). ``torch.addmm`` with the residual as its input
saves nothing: torch copies it into the output first.

**Where.** A module's forward is traced with torch.fx, in eval mode, its children leaves except
those that hold a linear layer as a child of their own (timm's ``Mlp`` and ``Attention``, T5's
``DenseReluDense``), which are traced through. A site is an add (``+``, ``torch.add`` without
``alpha``) of a linear layer's call and another value, where the layer's output reaches the add
alone, through modules that return their input in eval mode (``nn.Identity``, dropouts, timm's
``DropPath``: checked on a probe tensor) or ``F.dropout`` with ``training`` off. The layer has no
activation fused and no hooks, and is called once there and registered once in the model. A
forward fx cannot trace, or that changes module state while traced, gets no site. Modules are
read from the innermost out; a layer is a site once.

**How.** A module with sites gets a forward of its own (an instance attribute, ``Rewritten``): the
traced graph with each site's layer call, identities and add replaced by one call of the site
(``Site``), which computes ``layer(x) + residual`` as before or, where measured faster, the fused
product. The graph reads the module's children where they are at each call (it shares their
dict), so ``optimize``'s forms (a layer put back in torch's class, its activation module back in
its place) are seen. The traced forward serves a call only as it was traced: in eval mode
(the module and every module traced through or skipped), its required parameters given
positionally as tensors of the dtype traced (the model's), nothing more, and not while
torch.compile traces (the compiler fuses the add itself); any other call runs the class's
forward, as does a call where a module traced through or skipped has a forward hook or is in
training mode. Other attributes the forward reads (a flag, a head count) are read once, when
traced. A forward that branches on ``isinstance(x, torch.Tensor)`` would be traced along the
wrong branch: such forwards are not known among timm's and transformers' blocks, and are not
detected.

**Which way.** The fused product is cuBLASLt's (its heuristic's first algorithm, the bias in its
epilogue), for an output of the residual's shape and dtype, 16-bit operands with aligned rows
and 256-byte aligned addresses, no gradient wanted, outside CUDA graph capture and recording.
The first call of each row count checks it against float32 (no worse than twice the two steps'
error) and times both ways as the site serves them (its per-call checks included), their GPU
time and their host's own time per call; the fused product serves only where the longer of the
two is shorter beyond the noise, as ``gemmtune.nn.padded`` chooses (where N leaves cuBLAS's fast
path the fused product was 1.5x slower on the H200). A row count that chose the layer and the add
then costs a dict lookup more than they do.

**Eager calls, where the host paces them.** cuBLASLt's launch costs the host about 20 us, more
than a layer whose eager calls run a bound Triton launch and a torch add: on an H200, BERT-base's
eager forward, which its host paces, ran 5-6% slower with its sites fused while its CUDA graph
ran 1.7% faster (``residual-sides-h200-20261129c.json``). A site's choice, made one call at a
time, cannot see what paces the model; so once ``optimize``'s check has settled the layers'
forms, ``settle`` has the sites choose again against those forms (one run of the example), then
times the run in eager with the fused sites serving eager calls and with those calls taking the
layer and the add: eager calls stay fused only where the run reads faster so beyond its noise (on
an H200: DeiT-S 1.04x +-0.00, Mixer-B 1.07x +-0.00; BERT-base 0.94x +-0.06 and 0.96x +-0.02,
``residual-sides-h200-20261129d.json``). CUDA graph captures take the fused product either way.
"""

from __future__ import annotations

import inspect
import logging
import operator
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import fx, nn

from gemmtune.backends import cublaslt_binding
from gemmtune.backends.cublaslt import stream_workspace
from gemmtune.device import current
from gemmtune.errors import CublasLtError
from gemmtune.nn import fusion
from gemmtune.problem import Problem
from gemmtune.serving import recording
from gemmtune.serving.dispatch import DISPATCHER
from gemmtune.tuning import measure

log = logging.getLogger("gemmtune")

DTYPES = (torch.float16, torch.bfloat16)
ADDS = (operator.add, torch.add)
DROPOUTS = (F.dropout, torch.dropout)
MAX_ROWS = 64  # row counts a site keeps a choice for; calls of others take the unfused way
CHECK_BUDGET_MS = 1000.0  # the wall time ``settle``'s eager timing may take
_UNMEASURED = object()  # a row count a site has not chosen its way for


def rewrite(model: nn.Module, is_layer) -> int:
    """Give each module of ``model`` with residual sites its rewritten forward; the number of sites."""
    registered: dict[int, int] = {}
    for parent in model.modules():
        for child in parent._modules.values():
            if child is not None:
                registered[id(child)] = registered.get(id(child), 0) + 1
    claimed: set[int] = set()
    found = 0
    for parent in reversed(list(model.modules())):  # innermost first: a layer is a site once
        if "forward" in vars(parent) or not _holds_layers(parent, is_layer):
            continue
        rewritten = Rewritten.of(parent, is_layer, registered, claimed)
        if rewritten is not None:
            parent.forward = rewritten
            found += len(rewritten.paths)
    return found


def settle(roots: list[nn.Module], run: Callable[[], object]) -> str:
    """Once ``optimize``'s check has settled the layers' forms, which its runs switched between (a
    way chosen against a layer's torch form, or before its eager calls went to a kernel whose
    launch costs the host less, is not the way its settled form calls for): the sites of ``roots``
    (the modules ``run`` calls) choose again in one ``run`` (without gradients), and where some
    chose the fused product, the run is timed in eager with their eager calls fused and with those
    calls taking the layer and the add, in alternated rounds; eager calls stay fused only where that
    reads faster beyond its noise (the module's docstring). What was found, for optimize's log line
    ("" where no site chose)."""
    sites = list({id(site): site for root in roots for site in _sites(root)}.values())
    _forget(sites)
    if not sites:
        return ""
    with torch.no_grad():
        run()
    fused_sites = [site for site in sites if any(plan is not None for plan in site.fused_for.values())]
    if not fused_sites:
        chose = any(site.fused_for for site in sites)  # none did in a run their forward does not serve
        return f"none of the {len(sites)} residual adds measured faster fused" if chose else ""

    def eager(plain: bool) -> Callable[[], None]:
        def enter() -> None:
            for site in fused_sites:
                site.eager_plain = plain
        return enter

    with torch.no_grad():
        times = measure.loops({"fused": run, "plain": run}, current(), budget_ms=CHECK_BUDGET_MS,
                              enter={"fused": eager(False), "plain": eager(True)})
    speedup, noise = times["plain"].ratio_to(times["fused"]), times["plain"].spread_against(times["fused"])
    pays = speedup > 1.0 + noise
    eager(not pays)()
    calls = "fused too" if pays else "take the layer and the add"
    return (f"{len(fused_sites)} of {len(sites)} residual adds fused in CUDA graphs; their eager calls {calls} "
            f"(the eager run read {speedup:.2f}x +-{noise:.2f} with them fused)")


def _forget(sites: list[Site]) -> None:
    for site in sites:
        site.fused_for.clear()
        site.eager_plain = False


def fused(model: nn.Module) -> tuple[int, int]:
    """How many of ``model``'s residual sites take the fused product for some row count, of how many."""
    sites = _sites(model)
    return sum(any(plan is not None for plan in site.fused_for.values()) for site in sites), len(sites)


def _sites(model: nn.Module) -> list[Site]:
    return [site for module in model.modules() if isinstance(vars(module).get("forward"), Rewritten)
            for site in vars(module)["forward"].sites]


def _holds_layers(parent: nn.Module, is_layer) -> bool:
    """Whether a layer is a child of ``parent`` or of one of its children."""
    return any(child is not None and (is_layer(child) or any(g is not None and is_layer(g)
                                                             for g in child._modules.values()))
               for child in parent._modules.values())


def _inlined(parent: nn.Module, is_layer) -> list[str]:
    """The children of ``parent`` traced through: those holding a layer as a child, with no hooks
    and no forward of their own set on the instance."""
    return [name for name, child in parent._modules.items()
            if child is not None and not is_layer(child) and "forward" not in vars(child) and not _hooked(child)
            and any(g is not None and is_layer(g) for g in child._modules.values())]


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def _identity_in_eval(module: nn.Module) -> bool:
    """Whether ``module`` returns its input in eval mode: ``nn.Identity``, a dropout, or a module
    named DropPath without parameters that returns the very tensor it is given, tried on a fixed
    probe (no random numbers drawn) with its own training flag off."""
    if _hooked(module) or "forward" in vars(module):
        return False
    if isinstance(module, (nn.Identity, nn.modules.dropout._DropoutNd)):
        return True
    if type(module).__name__ != "DropPath" or any(True for _ in module.parameters()):
        return False
    was, module.training = module.training, False
    probe = torch.linspace(-1.0, 1.0, 32).reshape(4, 8)
    try:
        with torch.no_grad():
            return module(probe) is probe
    except Exception:  # noqa: BLE001 - any failure: not an identity we know
        return False
    finally:
        module.training = was


class Site:
    """One layer's call and the add after it: ``serve(layer, x, residual)`` is
    ``layer(x) + residual``, through cuBLASLt's fused product where it was measured faster (in eager
    calls, unless ``eager_plain``: then only while a CUDA graph is captured, ``settle``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fused_for: dict[int, tuple | None] = {}  # rows -> (launch, workspace bytes, descriptors) or None
        self.eager_plain = False

    def serve(self, layer: nn.Module, x: torch.Tensor, residual) -> torch.Tensor:
        rows = _rows(x)
        plan = self.fused_for.get(rows, _UNMEASURED)
        if plan is None or self.eager_plain and plan is not _UNMEASURED \
                and not torch.cuda.is_current_stream_capturing():
            return layer(x) + residual  # a row count that chose it, or an eager call the host paces
        return self._way(layer, x, residual, rows, plan)

    def __getstate__(self) -> dict:
        # a copy measures again (the plans hold cuBLASLt's handles)
        return {"path": self.path, "fused_for": {}, "eager_plain": self.eager_plain}

    def _way(self, layer, x, residual, rows: int | None, plan) -> torch.Tensor:
        """The call with ``plan`` for its ``rows`` (``serve`` read them): the fused product, or the
        layer and the add where the call cannot take it; _UNMEASURED: chosen at this call."""
        out = None if plan is None else self._fused(layer, x, residual, rows, plan)
        return layer(x) + residual if out is None else out

    def _fused(self, layer, x, residual, rows: int | None, plan) -> torch.Tensor | None:
        """The fused product where this call can take it and ``plan`` has it, else None."""
        if rows is None or not isinstance(residual, torch.Tensor) or not x.is_cuda:
            return None
        w, b = layer.weight, layer.bias
        if x.dtype not in DTYPES or not _linear(layer) or _hooked(layer) \
                or getattr(layer, "activation", "none") != "none" or not _plain_operands(x, w, b, residual):
            return None
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or b is not None and b.requires_grad
                                        or residual.requires_grad):
            return None
        if plan is _UNMEASURED:
            if torch.cuda.is_current_stream_capturing() or recording.active() is not None \
                    or DISPATCHER.is_deferring() or len(self.fused_for) >= MAX_ROWS:
                return None
            plan = self.fused_for[rows] = self._choose(layer, x, residual, rows)
        return None if plan is None else _launch(plan, x, w, b, residual)

    def plan(self, layer, x, rows: int) -> tuple | None:
        """cuBLASLt's fused product for ``rows`` rows of ``x`` through ``layer`` (its heuristic's first
        algorithm): (launch, workspace bytes, descriptors), or None where cuBLASLt has none."""
        w, b = layer.weight, layer.bias
        n, k = w.shape
        problem = Problem(rows, n, k, str(x.dtype).removeprefix("torch."), "linear", b is not None)
        try:
            matmul = cublaslt_binding.Matmul(problem, x.device.index)
            algo, workspace = matmul.algo(matmul.heuristics(1)[0])
        except (CublasLtError, IndexError) as error:
            log.debug("gemmtune.optimize: %s keeps its residual add (cuBLASLt: %r)", self.path, error)
            return None
        return matmul.launcher(algo), workspace, matmul

    def _choose(self, layer, x, residual, rows: int) -> tuple | None:
        """The fused product's plan where it checks right and measures faster, else None."""
        w, b = layer.weight, layer.bias
        plan = self.plan(layer, x, rows)
        if plan is None:
            return None
        ways = {"plain": self._served(layer, x, residual, rows, None),
                "fused": self._served(layer, x, residual, rows, plan)}
        reference = F.linear(x.float(), w.float(), None if b is None else b.float()) + residual.float()
        errors = {way: (call().float() - reference).abs().max().item() for way, call in ways.items()}
        if not errors["fused"] <= 2.0 * errors["plain"] + 1e-6 * reference.abs().max().item():
            log.warning("gemmtune.optimize: %s keeps its residual add: cuBLASLt's fused product was off by %.3g "
                        "where the two steps were off by %.3g", self.path, errors["fused"], errors["plain"])
            return None
        return plan if measure.beats(ways, "fused", current()) else None

    def _served(self, layer, x, residual, rows: int, plan: tuple | None):
        """A call of this site as it would serve with ``plan`` chosen for ``rows`` rows (None: the
        layer then the add), its per-call checks included: a way's host time is that of its path."""
        return lambda: self._way(layer, x, residual, rows, plan)


def _rows(x) -> int | None:
    """The rows of ``x`` as a GEMM's operand (all but its last dimension), None where it is none."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-1] == 0:
        return None
    return x.numel() // x.shape[-1]


def _linear(layer: nn.Module) -> bool:
    """Whether ``layer`` computes ``F.linear(x, weight, bias)`` (then its activation): an
    ``nn.Linear`` whose forward is torch's or one of gemmtune's layer classes'."""
    return isinstance(layer, nn.Linear) and (type(layer).forward is nn.Linear.forward
                                             or type(layer).__module__ == "gemmtune.nn")


def _plain_operands(x, w, b, residual) -> bool:
    """Operands the fused product takes: x (..., K) with rows of unit stride, a contiguous (N, K)
    weight and (N,) bias of x's dtype, a contiguous residual of the output's shape and dtype, rows
    of 16-byte multiples and every address 256-byte aligned."""
    n, k = w.shape
    step = 16 // x.element_size()
    if x.shape[-1] != k or n % step or k % step or x.dim() < 2 or not x.is_contiguous() or not w.is_contiguous() \
            or w.dtype != x.dtype or residual.dtype != x.dtype or residual.shape != (*x.shape[:-1], n) \
            or not residual.is_contiguous() or w.device != x.device or residual.device != x.device:
        return False
    if b is not None and (b.dtype != x.dtype or not b.is_contiguous() or b.device != x.device):
        return False
    pointers = x.data_ptr() | w.data_ptr() | residual.data_ptr() | (0 if b is None else b.data_ptr())
    return pointers % cublaslt_binding.ALIGNMENT == 0


def _launch(plan: tuple, x, w, b, residual) -> torch.Tensor:
    launch, workspace_bytes, _ = plan
    out = torch.empty_like(residual)
    index = x.device.index
    stream = torch._C._cuda_getCurrentRawStream(index)
    workspace = stream_workspace(x, workspace_bytes, index, stream) if workspace_bytes else None
    launch(w.data_ptr(), x.data_ptr(), out.data_ptr(), 0 if workspace is None else workspace.data_ptr(),
           workspace_bytes, stream, 0 if b is None else b.data_ptr(), residual_ptr=residual.data_ptr())
    return out


class Rewritten:
    """A module's forward with its residual sites (the module's docstring): callable as the
    module's ``forward``; the class's forward serves any call the trace does not. A copy (deepcopy,
    pickle) traces the module again on first use, and measures its sites' ways again."""

    def __init__(self, parent: nn.Module, dtype: torch.dtype, inline: list[str], defaults: dict, arity: int) -> None:
        self.parent, self.dtype, self.inline, self.defaults, self.arity = parent, dtype, inline, defaults, arity
        self.paths: list[str] | None = None  # its sites' layers, found by the first trace
        # made by ``_make``: the traced code, its sites, the modules it traced through or skipped
        self._code, self.sites, self._watched = None, [], None

    @classmethod
    def of(cls, parent: nn.Module, is_layer, registered: dict, claimed: set) -> "Rewritten | None":
        """``parent``'s rewritten forward, or None where it has no site."""
        params = list(inspect.signature(type(parent).forward).parameters.values())[1:]
        if any(p.kind == p.VAR_POSITIONAL or p.kind == p.KEYWORD_ONLY and p.default is p.empty for p in params):
            return None
        arity = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)
        weights = [m.weight for m in parent.modules() if is_layer(m)]
        if not weights or not arity:
            return None
        dtype, inline = weights[0].dtype, _inlined(parent, is_layer)
        defaults = {p.name: p.default for p in params if p.default is not p.empty and p.kind != p.VAR_KEYWORD}
        rewritten = cls(parent, dtype, inline, defaults, arity)
        if not rewritten._make(lambda layer: _may_serve(layer, is_layer, registered, claimed)):
            return None
        claimed.update(id(parent.get_submodule(path)) for path in rewritten.paths)
        log.debug("gemmtune.optimize: %s adds %d residuals in its layers' epilogues (%s)", type(parent).__name__,
                  len(rewritten.paths), ", ".join(rewritten.paths))
        return rewritten

    def __call__(self, *args, **kwargs):
        parent = self.parent
        if kwargs or len(args) != self.arity or parent.training or torch.compiler.is_compiling():
            return type(parent).forward(parent, *args, **kwargs)
        for a in args:  # loops, not any(): this runs on every call of a host-paced model
            if not isinstance(a, torch.Tensor) or a.dtype != self.dtype:
                return type(parent).forward(parent, *args, **kwargs)
        if self._code is None and not self._make():
            return type(parent).forward(parent, *args, **kwargs)
        for m in self._watched:
            if m.training or m._forward_hooks or m._forward_pre_hooks:
                return type(parent).forward(parent, *args, **kwargs)  # a hook the traced code would not call
        return self._code.forward(*args)

    def _make(self, may_serve=None) -> bool:
        """The traced code: its sites those whose layers ``may_serve`` accepts (the first trace),
        else those of ``paths`` again (a copy's); False (and the class's forward from then on)
        where the trace finds none, or not the sites it found."""
        if may_serve is None:
            may_serve = lambda layer: any(layer is self.parent.get_submodule(p) for p in self.paths)  # noqa: E731
        built = _build(self.parent, self.dtype, self.inline, self.defaults, may_serve)
        if built is None or self.paths is not None and sorted(site.path for site in built[1]) != sorted(self.paths):
            self.arity = -1  # no call matches
            return False
        self._code, self.sites, skipped = built
        self.paths = [site.path for site in self.sites]
        self._watched = [self.parent.get_submodule(name) for name in sorted(set(skipped + self.inline))]
        return True

    def __getstate__(self) -> dict:
        state = dict(vars(self))
        state["_code"] = state["_watched"] = None  # traced again where used: the code shares its module's children
        state["sites"] = []
        return state


def _may_serve(layer: nn.Module, is_layer, registered: dict, claimed: set) -> bool:
    """Whether a layer may be a site: one ``is_layer`` accepts, registered once in the model, not a
    site already, without hooks or an activation fused."""
    return is_layer(layer) and registered.get(id(layer)) == 1 and id(layer) not in claimed and not _hooked(layer) \
        and getattr(layer, "activation", "none") == "none"


def _build(parent: nn.Module, dtype: torch.dtype, inline: list[str], defaults: dict,
           may_serve) -> tuple[fx.GraphModule, list[Site], list[str]] | None:
    """``parent``'s forward traced in eval mode with its sites replaced: its code (reading the
    module's children, parameters and buffers as they are at each call), the sites, and the
    modules skipped as identities; None where it cannot be traced or has no site."""
    graph = fusion.eval_trace(parent, dtype, {id(parent._modules[name]) for name in inline}, defaults)
    if graph is None:
        return None
    sites, skipped = _replace_sites(graph, parent, may_serve)
    if not sites:
        return None
    code = fx.GraphModule(parent, graph)
    code._modules, code._parameters, code._buffers = parent._modules, parent._parameters, parent._buffers
    return code, sites, skipped


def _replace_sites(graph: fx.Graph, parent: nn.Module, may_serve) -> tuple[list[Site], list[str]]:
    """Each site of the graph replaced by a call of its ``Site``; the sites, and the modules skipped
    as identities (their training flag decides whether the graph may serve)."""
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    sites, skipped = [], []
    for node in list(graph.nodes):
        if node.op != "call_module" or calls[node.target] != 1:
            continue
        if not may_serve(parent.get_submodule(node.target)) or len(node.args) != 1 or node.kwargs:
            continue
        chain, last = _to_add(node, parent)
        if chain is None:
            continue
        add = next(iter(last.users))
        residual = add.args[1] if add.args[0] is last else add.args[0]
        site = Site(node.target)
        with graph.inserting_before(add):
            module = graph.get_attr(node.target)
            fused = graph.call_function(site.serve, (module, node.args[0], residual))
        add.replace_all_uses_with(fused)
        for dead in [add, *reversed(chain), node]:
            graph.erase_node(dead)
        skipped += [n.target for n in chain if n.op == "call_module"]
        sites.append(site)
    graph.lint()
    return sites, skipped


def _to_add(node: fx.Node, parent: nn.Module) -> tuple[list | None, fx.Node]:
    """The identity nodes from a layer's call to the add of its output, and the last node before
    the add; (None, node) where the output goes elsewhere."""
    chain, last = [], node
    while len(last.users) == 1:
        (user,) = last.users
        if _is_add(user, last):
            return chain, last
        if user.op == "call_module" and user.args == (last,) and not user.kwargs \
                and _identity_in_eval(parent.get_submodule(user.target)):  # called elsewhere too (Mixer's drop_path)
            chain.append(user)
        elif user.op == "call_function" and user.target in DROPOUTS and user.args[:1] == (last,) \
                and _dropout_off(user):
            chain.append(user)
        else:
            return None, node
        last = user
    return None, node


def _is_add(node: fx.Node, operand: fx.Node) -> bool:
    """``operand + other`` or ``other + operand`` (no alpha), ``operand`` once among the two."""
    if node.kwargs or len(node.args) != 2 or (node.args[0] is operand) == (node.args[1] is operand):
        return False
    return node.op == "call_function" and node.target in ADDS or node.op == "call_method" and node.target == "add" \
        and node.args[0] is operand


def _dropout_off(node: fx.Node) -> bool:
    """Whether a traced dropout call has ``training`` off (a constant in an eval-mode trace)."""
    training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
    return training is False
