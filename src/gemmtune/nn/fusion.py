"""Activations fused into the layer before them: which activation modules gemmtune can fuse
(``epilogue``), and where a model's structure says a layer's output goes to one and nowhere else
(``pairs``).

An activation module is fusable when it computes one of gemmtune's epilogues (relu, gelu,
gelu_tanh, silu). ``nn.ReLU``, ``nn.SiLU`` and ``nn.GELU`` are taken by their type; the
activation classes of transformers (``GELUActivation``, ``NewGELUActivation``, ``GELUTanh`` /
``PytorchGELUTanh``, ``FastGELUActivation``, ``SiLUActivation``, BLOOM's ``BloomGelu``...) and timm
(``GELU``, ``GELUTanh``, ``Swish``) by a class name that names one (GELU, SiLU, Swish or ReLU, in
any case) and what they compute: a module of such a name, with
no parameters or buffers, is run on a fixed CPU tensor (negative, small and large values) and
must agree with the epilogue's torch function to within float32 rounding (gelu and gelu_tanh
differ by 5e-4, well outside it). transformers is never imported.

Where a layer's output goes is read from its parent's forward: an ``nn.Sequential`` (its own
forward) calls its children one after another, so a layer followed by an activation module is a
pair. Any other parent holding a layer and an activation module among its children (timm's
``Mlp``, BERT's ``BertIntermediate``, GPT-2's ``GPT2MLP``) has its forward traced with torch.fx,
every child module a leaf, in each training mode (a forward may branch on ``self.training``) and
with every tensor's ``dtype`` reading as each of float16, bfloat16 and float32 (transformers'
layers clamp float16 outputs); a pair must show in all six traces. A pair there is a call of the
layer whose output has one user, a call of the activation on it alone, where the layer and the
activation are each called once in the graph and each registered in the model once, under that
parent. Neither, there or in an ``nn.Sequential``, may have a hook that would see the fusion:
the layer's forward and backward hooks (they would get the activation's output or its
gradient), the activation's hooks of any kind or a forward set on its instance (it would no
longer be called); hooks registered after ``optimize`` on a fused layer do see its activation's
output. A module between them (a dropout, a no-op in eval mode) makes them no pair. A forward
wrapped by a decorator that keeps ``__wrapped__`` (transformers' checkpointing layers) is read
as the function it wraps; a ``**kwargs`` parameter is traced as empty, and a forward that reads
it (rather than passing it on) is not traced. A forward that fx
cannot trace (control flow on tensor values or shapes, calls of modules not registered) gets no
fusion (a debug log line). The trace runs the forward's Python code on fx proxies. A forward
that changes the state of its module or of its children while traced (an attribute set, a list
or dict attribute changed: an output stored aside, which the graph would not show as a use) gets
no fusion either, and that state is put back as it was before the trace. Side effects elsewhere
(a global list) are not seen.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils import _pytree as pytree

log = logging.getLogger("gemmtune")

# the classes that may be activations gemmtune fuses, by a name that says so; what they compute decides
NAMED = re.compile(r"gelu|silu|swish|relu", re.IGNORECASE)
FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
}
RTOL, ATOL = 1e-4, 1e-5  # agreement asked of an activation checked by what it computes
TRACED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what a traced tensor's dtype reads as


def epilogue(module: nn.Module) -> str | None:
    """The epilogue name of an activation module gemmtune can fuse, or None."""
    cls = type(module)
    if cls is nn.ReLU:
        return "relu"
    if cls is nn.SiLU:
        return "silu"
    if cls is nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(module.approximate)
    if not (NAMED.search(cls.__name__) or isinstance(module, (nn.ReLU, nn.SiLU, nn.GELU))):
        return None
    return _computed(module)


@functools.lru_cache(maxsize=1)
def _probe() -> torch.Tensor:
    """The CPU tensor an activation is checked on: a grid over [-8, 8], tails, tiny values, and
    random ones (a generator of its own: the caller's random state is left alone)."""
    rng = torch.Generator().manual_seed(0)
    return torch.cat([torch.linspace(-8.0, 8.0, 161),
                      torch.tensor([-1e4, -100.0, -30.0, -1e-6, -0.0, 0.0, 1e-6, 30.0, 100.0, 1e4]),
                      torch.randn(64, generator=rng) * 3.0])


def _computed(module: nn.Module) -> str | None:
    """The epilogue ``module`` computes on the probe, or None (parameters or buffers, an error,
    or no epilogue agrees)."""
    if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        return None
    x = _probe()
    try:
        with torch.no_grad():
            got = module.forward(x.clone())  # a clone: the module may work in place
    except Exception as error:  # noqa: BLE001 - any failure means: not an activation we know
        log.debug("gemmtune.optimize: %s not fused (its check raised %r)", type(module).__name__, error)
        return None
    if not isinstance(got, torch.Tensor) or got.shape != x.shape or got.dtype != x.dtype:
        return None
    for name, function in FUNCTIONS.items():
        if torch.allclose(got, function(x), rtol=RTOL, atol=ATOL):
            return name
    return None


class Pair(NamedTuple):
    """A layer and the activation module its output goes to alone: both children of ``parent``."""

    parent: nn.Module
    layer: str  # the children's names in parent
    activation: str
    epilogue: str


def pairs(model: nn.Module, is_layer: Callable[[nn.Module], bool]) -> list[Pair]:
    """Every layer (a module ``is_layer`` accepts) whose output goes to a fusable activation
    module and nowhere else, as the model's structure says (see the module's docstring)."""
    registered: dict[int, set] = {}  # a module -> each (parent, name) it is registered under
    for parent in model.modules():
        for name, child in parent._modules.items():
            if child is not None:
                registered.setdefault(id(child), set()).add((id(parent), name))
    found: list[Pair] = []
    for parent in model.modules():
        children = parent._modules
        if isinstance(parent, nn.Sequential) and type(parent).forward is nn.Sequential.forward:
            found += _in_sequence(parent, is_layer, registered)
        elif any(child is not None and is_layer(child) for child in children.values()) and \
                any(child is not None and not is_layer(child) and epilogue(child) for child in children.values()):
            found += _traced(parent, is_layer, registered)
    return found


def _in_sequence(parent: nn.Sequential, is_layer: Callable, registered: dict) -> Iterable[Pair]:
    """The pairs of an ``nn.Sequential``: a layer and the activation module after it. Each slot is
    called once, so an activation module in two slots can be fused in both."""
    names = list(parent._modules)
    for first, second in zip(names, names[1:]):
        layer, act = parent._modules[first], parent._modules[second]
        if layer is None or act is None or not is_layer(layer) or len(registered[id(layer)]) != 1:
            continue
        name = epilogue(act)
        if name is not None and not _hooked(layer, act):
            yield Pair(parent, first, second, name)


def _hooked(layer: nn.Module, act: nn.Module) -> bool:
    """Whether a hook would see the pair's fusion: a forward or backward hook of the layer (it
    would get the activation's output, or its gradient, in place of the layer's) or any hook of
    the activation, or a forward set on the activation module itself (a wrapper: its module would
    no longer be called)."""
    return bool(layer._forward_hooks or layer._backward_hooks or layer._backward_pre_hooks
                or act._forward_hooks or act._forward_pre_hooks or act._backward_hooks or act._backward_pre_hooks
                or "forward" in vars(act))


class _Proxy(fx.Proxy):
    """An fx proxy whose ``dtype`` is a concrete dtype (the tracer's): a forward that branches on
    a tensor's dtype (transformers' float16 clamps) is traced along the branch that dtype takes."""

    def __getattr__(self, name: str):
        if name == "dtype":
            return self.tracer.dtype
        return super().__getattr__(name)


class _ChildrenAsLeaves(fx.Tracer):
    """A tracer of a module's own forward: every module it calls is a leaf (one node) but those
    in ``inline`` (ids), whose forwards are traced through, and every tensor reads as of ``dtype``."""

    def __init__(self, dtype: torch.dtype, inline: frozenset = frozenset()) -> None:
        super().__init__()
        self.dtype, self.inline = dtype, inline

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return id(m) not in self.inline

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)


class _NoKeywords(dict):
    """What a forward's ``**kwargs`` holds while traced: nothing, and reading it ends the trace
    (a forward that branches on its keywords cannot be read for one structure). Passing it on as
    ``**kwargs`` passes nothing."""

    def _read(self, *args, **kwargs):
        raise fx.proxy.TraceError("the forward reads its **kwargs")

    get = __getitem__ = __contains__ = _read


# fx hands concrete arguments through pytree: one with no leaves is passed as it is
pytree.register_pytree_node(_NoKeywords, lambda keywords: ([], None), lambda leaves, context: _NoKeywords())


@functools.lru_cache(maxsize=None)
def _unwrapped_class(cls: type) -> type:
    """A subclass of ``cls`` whose forward is the function ``cls.forward`` wraps (set after the
    class is made: a base's ``__init_subclass__`` may wrap it again, as transformers' layers do)."""
    stand_in = type(cls.__name__, (cls,), {"__module__": __name__})
    stand_in.forward = inspect.unwrap(cls.forward)
    return stand_in


def _traceable(parent: nn.Module) -> tuple[nn.Module, dict | None]:
    """What fx traces for ``parent``, and its concrete arguments: where the class's forward is a
    decorator's wrapper (one that sets ``__wrapped__``, as transformers' checkpointing layers do),
    a stand-in sharing ``parent``'s state whose forward is the function wrapped: the wrapper's
    ``*args, **kwargs`` hide the parameters fx reads. A ``**kwargs`` parameter holds nothing."""
    cls = type(parent)
    traced = parent
    if inspect.unwrap(cls.forward) is not cls.forward:
        traced = object.__new__(_unwrapped_class(cls))
        object.__setattr__(traced, "__dict__", parent.__dict__)  # the same children, flags and hooks
    keywords = [p.name for p in inspect.signature(type(traced).forward).parameters.values()
                if p.kind is inspect.Parameter.VAR_KEYWORD]
    return traced, {f"**{keywords[0]}": _NoKeywords()} if keywords else None


def _traced(parent: nn.Module, is_layer: Callable, registered: dict) -> list[Pair]:
    """The pairs that ``parent``'s forward shows in every trace (both training modes, each
    floating dtype gemmtune serves); none where it cannot be traced, or where tracing it changed
    the state of ``parent`` or its children (put back)."""
    graphs = _traces(parent, (parent.training, not parent.training), TRACED_DTYPES)
    if graphs is None:
        return []
    found = set.intersection(*(set(_in_graph(graph, parent, is_layer, registered)) for graph in graphs))
    return sorted(found, key=lambda pair: list(parent._modules).index(pair.layer))


def eval_trace(parent: nn.Module, dtype: torch.dtype, inline: set[int], defaults: dict) -> fx.Graph | None:
    """``parent``'s forward traced as a call in eval mode runs it: every module it calls a leaf but
    its children in ``inline`` (ids), traced through (they and ``parent`` read as in eval mode);
    the parameters in ``defaults`` at those values, baked in; every tensor's dtype reading
    ``dtype``. None where fx cannot trace it, or where the trace changed the state of ``parent``
    or its children (put back)."""
    graphs = _traces(parent, (False,), (dtype,), frozenset(inline), defaults)
    return None if graphs is None else graphs[0]


def _traces(parent: nn.Module, modes: Iterable[bool], dtypes: Iterable[torch.dtype], inline: frozenset = frozenset(),
            defaults: dict | None = None) -> list[fx.Graph] | None:
    """``parent``'s forward traced in each training mode and with every tensor's dtype reading each
    of ``dtypes``: the modules it calls leaves but its children in ``inline`` (ids), traced through,
    whose training flags follow ``parent``'s; the parameters in ``defaults`` baked in. None where fx
    cannot trace it, or where a trace changed the state of ``parent`` or its children (put back)."""
    modules = [parent, *(child for child in parent.children() if id(child) in inline)]
    flags = [module.training for module in modules]
    before = _State(parent)
    graphs = []
    try:
        traced, concrete = _traceable(parent)
        concrete = {**(defaults or {}), **(concrete or {})} or None
        for mode in modes:
            for module in modules:
                module.training = mode  # the flag alone: the leaves are not traced
            graphs += [_ChildrenAsLeaves(dtype, inline).trace(traced, concrete_args=concrete) for dtype in dtypes]
    except Exception as error:  # noqa: BLE001 - fx fails in many ways: any of them means no trace
        log.debug("gemmtune.optimize: %s's forward not traced, so nothing in it is fused: %r",
                  type(parent).__name__, error)
        return None
    finally:
        for module, flag in zip(modules, flags):
            module.training = flag
        changed = before.restore()
    if changed:
        log.debug("gemmtune.optimize: %s's forward changes its module's state when called (%s), so nothing in "
                  "it is fused", type(parent).__name__, changed)
        return None
    return graphs


class _State:
    """The attributes of a module and of its children, and the items of those that are lists or
    dicts, as they were when taken; ``restore`` puts back what a traced forward changed."""

    def __init__(self, module: nn.Module) -> None:
        self.modules = [module, *module.children()]
        self.attributes = [dict(vars(m)) for m in self.modules]
        self.items = [{name: _items(value) for name, value in attributes.items()} for attributes in self.attributes]

    def restore(self) -> str:
        """Each attribute set, added or changed in place since, put back; their names."""
        changed = []
        for module, attributes, items in zip(self.modules, self.attributes, self.items):
            now = vars(module)
            for name in [name for name in now if name not in attributes]:
                changed.append(name)
                del now[name]
            for name, value in attributes.items():
                if now.get(name) is not value:
                    changed.append(name)
                    now[name] = value
                elif items[name] is not None and not _same(value, items[name]):
                    changed.append(name)
                    _put_back(value, items[name])
        return ", ".join(changed)


def _items(value: object) -> list | None:
    """A list's items or a dict's (key, item) pairs; None for anything else."""
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, list):
        return list(value)
    return None


def _same(value: list | dict, taken: list) -> bool:
    """Whether a list or dict holds the very items it held when taken (``_items``)."""
    now = _items(value)
    if len(now) != len(taken):
        return False
    if isinstance(value, dict):
        return all(key == was_key and item is was for (key, item), (was_key, was) in zip(now, taken))
    return all(item is was for item, was in zip(now, taken))


def _put_back(value: list | dict, items: list) -> None:
    """A list or dict given back the items it held (``_items``)."""
    if isinstance(value, list):
        value[:] = items
    else:
        value.clear()
        value.update(items)


def _in_graph(graph: fx.Graph, parent: nn.Module, is_layer: Callable, registered: dict) -> Iterable[Pair]:
    children = parent._modules
    calls = Counter(node.target for node in graph.nodes if node.op == "call_module")

    def child(node: fx.Node) -> nn.Module | None:
        """The child module a node calls, if it calls one (a call of a grandchild has a dotted
        target) that is called once in the graph and registered once in the model, here."""
        if node.op != "call_module" or node.target not in children or calls[node.target] != 1:
            return None
        module = children[node.target]
        if module is None or registered.get(id(module)) != {(id(parent), node.target)}:
            return None
        return module

    for node in graph.nodes:
        layer = child(node)
        if layer is None or not is_layer(layer) or len(node.users) != 1:
            continue
        (user,) = node.users
        act = child(user)
        if act is None or is_layer(act) or user.args != (node,) or user.kwargs or _hooked(layer, act):
            continue
        name = epilogue(act)
        if name is not None:
            yield Pair(parent, node.target, user.target, name)
