"""gemmtune as the compiler's GEMM chooser: each mm, addmm and bmm the compiler lowers gets one
candidate, gemmtune's choice for it, so nothing is benchmarked while compiling. Before a graph
is lowered its GEMMs are chosen together (stored, else tuned in one batch) and how each runs is
planned over the whole graph (``plan``):

- cuBLAS: the compiler's own call of it (``aten``), the plain op of a default compile;
- a ``triton_tiled`` config: the compiler's Triton GEMM template with that config's tiles,
  warps and stages, so the compiler fuses what follows (bias, activation, residual) into it;
- any other gemmtune kernel: ``runtime.linear`` or ``runtime.mm`` called from the generated code
  (never a bmm's: its choices are cuBLAS's and ``triton_tiled``'s, the compiler's batched template).

Every other GEMM (baddbmm, a dynamic size, an operand layout or dtype gemmtune does not serve) gets
what a default ``torch.compile`` gives it: the compiler's first library call, nothing tuned.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from dataclasses import replace

import sympy
import torch

from gemmtune import backends
from gemmtune.backends import REFERENCE
from gemmtune.device import current
from gemmtune.inductor import hooks, plan, rest, runtime
from gemmtune.inductor.plan import CALLED, LIBRARY, TEMPLATE, Gemm, Rest, Way
from gemmtune.inductor.problems import Operands, problem_of
from gemmtune.problem import Problem
from gemmtune.results import Trial
from gemmtune.serving.calls import DTYPE_NAMES, tf32_allowed
from gemmtune.serving.dispatch import DISPATCHER, Choice
from gemmtune.tuning.measure import host_times, replay_ms
from gemmtune.tuning.runner import matmul_precision
from gemmtune.tuning.tuner import graph_choice
from gemmtune.tuning.verify import TORCH_DTYPES, make_operands, out_shape
from gemmtune.version import __version__

log = logging.getLogger("gemmtune")

TEMPLATE_FIELDS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
# by the product's layout: read once, when the graph is compiled
GEMMTUNE_KERNELS = {"linear": hooks.extern_choice(runtime.linear, "gemmtune_linear"),
                    "nn": hooks.extern_choice(runtime.mm, "gemmtune_mm")}
# the lowerings whose candidates gemmtune gives (mm, addmm and bmm its choice; the others, which
# it does not serve, their library call, as a default compile); any other is the compiler's
LOWERINGS = ("mm", "addmm", "bmm", "baddbmm", "mm-ah")
GRAPH_OPS = {torch.ops.aten.mm.default: "mm", torch.ops.aten.addmm.default: "addmm",
             torch.ops.aten.bmm.default: "bmm"}
BIAS_ADDMM = "aten::bias_addmm"
DEVICE_TYPES = ("cuda",)  # whose GEMMs gemmtune chooses (elsewhere it serves none)
WARM_CALLS = 16  # the fewest library calls a warm measure replays
MAX_COPIES = 64  # the most copies of a weight a warm measure reads in turn


def choose(problem: Problem, device_index: int) -> Choice:
    """gemmtune's choice for ``problem``: stored, else tuned now and stored."""
    return DISPATCHER.choice(problem, current(device_index))


def tune_ahead(problems: list[Problem], device_index: int) -> None:
    """The graph's products not stored yet tuned in one batch (``Dispatcher.prepare``)."""
    DISPATCHER.prepare(problems, current(device_index))


def kernel_times(problem: Problem, device_index: int) -> dict[str, Trial]:
    """The verified trials stored with ``problem``'s choice, by label (a retune's latest): each
    candidate's kernel time as its tuning measured it."""
    latest = {}
    for trial in DISPATCHER.trials(problem, current(device_index)):
        if trial.ok and trial.median_ms is not None:
            latest[trial.label()] = trial
    return latest


@functools.cache
def host_library_ms(device_index: int) -> float:
    """The host time this process takes to queue one library call (a small addmm on GPU
    ``device_index``), measured once: the fastest of five loops, as other processes only add."""
    with hooks.unset_fake_temporarily():  # real tensors: the compiler's fake ones queue nothing
        a, b, bias = (torch.randn(*shape, device=f"cuda:{device_index}") for shape in ((16, 64), (64, 64), (64,)))
        return host_times(lambda: torch.addmm(bias, a, b), current(device_index), calls=50, repeats=5)[1]


def host_scale(device_index: int) -> float | None:
    """How much slower than ``plan.HOST_MS``'s nominal host this one queues (``host_library_ms``),
    the speed the plan weighs hosts about; None where it is not measured: under Triton's
    interpreter (no GPU to queue on) and while a CUDA graph is being captured (the measure
    synchronizes)."""
    if not _measurable(device_index):
        return None
    return host_library_ms(device_index) / plan.HOST_MS[LIBRARY]


def _measurable(device_index: int) -> bool:
    """Whether this host and GPU can be timed now: not under Triton's interpreter (no GPU), nor
    while a CUDA graph is being captured (a measure synchronizes)."""
    return not current(device_index).interpreter and not torch.cuda.is_current_stream_capturing()


def warm_library_ms(problem: Problem, device_index: int) -> float | None:
    """The library call's kernel time for ``problem`` as a model runs it, where the trials' are
    L2-flushed: its input warm from the kernel before it (``a``), its weight read from memory
    (``b``, one of enough copies to pass through the L2 twice; a batched product's ``b`` is an
    activation, warm too), calls replayed back to back (``measure.replay_ms``). None under
    Triton's interpreter, for an fp8 product, and while a CUDA graph is being captured."""
    if problem.scaled or not _measurable(device_index):
        return None
    device, where = current(device_index), f"cuda:{device_index}"
    with hooks.unset_fake_temporarily(), matmul_precision(problem):  # real tensors, as the problem is keyed
        a, b, bias = make_operands(problem, where)
        copies = 1 if problem.batch > 1 else min(MAX_COPIES, -(-2 * device.l2_bytes // (b.numel() * b.element_size())))
        weights = [b] + [b.clone() for _ in range(copies - 1)]
        out = torch.empty(out_shape(problem), dtype=TORCH_DTYPES[problem.out_dtype], device=where)
        kernel = backends.build(problem, REFERENCE, {}, device)
        return replay_ms([functools.partial(kernel, a, weights[i % copies], bias, out=out)
                          for i in range(max(WARM_CALLS, copies))])


def graph_rest(graph, weighed: set, device_index: int) -> Rest:
    """What ``graph`` costs besides its ``weighed`` GEMMs (``rest.estimate``)."""
    return rest.estimate(graph, weighed, current(device_index), tf32_allowed())


class GemmtuneChoices(hooks.InductorChoices):
    """The compiler's heuristics, except that its GEMM candidates are gemmtune's one choice, run
    the way that costs the graph least (``plan``). ``graphs``: the compiled graphs are replayed as
    CUDA graphs (no host cost per call); ``templates_on``: the caller switched the compiler's GEMM
    templates on; ``epilogues``: a product -> the activation that alone follows it."""

    def __init__(self, graphs: bool = False, epilogues: dict[Problem, str] | None = None,
                 templates_on: bool = False) -> None:
        super().__init__()
        self.graphs, self.templates_on = graphs, templates_on
        self.epilogues = epilogues or {}
        self.decided: dict[tuple[Problem, int], Way] = {}  # (problem, GPU) -> how the graph's plan runs it
        self.asked: dict[tuple[Problem, int], tuple[Choice, dict]] = {}  # (problem, GPU) -> choose's answer, trials

    def choice(self, problem: Problem, device_index: int) -> Choice:
        """gemmtune's choice for ``problem`` on GPU ``device_index``, as the compiled code runs it."""
        return self.decision(problem, device_index)[0]

    def decision(self, problem: Problem, device_index: int) -> tuple[Choice, str]:
        """The choice the compiled code runs for ``problem`` and how (TEMPLATE, CALLED or LIBRARY):
        the graph's plan (``choose_ahead``), else the product's first way (``plan.ways``)."""
        key = (problem, device_index)
        way = self.decided.get(key) or self.ways(problem, device_index)[0]
        return way.choice, way.kind

    def ways(self, problem: Problem, device_index: int) -> tuple[Way, ...]:
        """How compiled code may run ``problem`` (``plan.ways``), with the activation that alone
        follows it in the template's epilogue where that form was tuned."""
        activation = self.epilogues.get(problem)
        fused = self._asked(replace(problem, activation=activation), device_index) if activation else None
        return plan.ways(*self._asked(problem, device_index), self.graphs, fused)

    def _warm_ways(self, problem: Problem, device_index: int) -> tuple[Way, ...]:
        """``ways``, their kernel times as a model runs them where the host's time counts: the
        library call's measured warm (``warm_library_ms``) over its stored trial's, the same for
        every way of the product (``plan.warmed``). Replayed as CUDA graphs, only the ways' order
        counts, which that keeps."""
        found = self.ways(problem, device_index)
        if self.graphs:
            return found
        flushed = self._asked(problem, device_index)[1].get(REFERENCE)
        return plan.warmed(found, warm_library_ms(problem, device_index), flushed.median_ms if flushed else None)

    def _asked(self, problem: Problem, device_index: int) -> tuple[Choice, dict[str, Trial]]:
        """gemmtune's choice for ``problem`` and its tuning's trials, asked once per compile. A
        graph replayed as a CUDA graph pays the kernel alone: there the choice is the kernel its
        tuning found faster for graphs, where it found one (``tuner.graph_choice``)."""
        key = (problem, device_index)
        if key not in self.asked:
            with hooks.unset_fake_temporarily():  # real tensors: a GEMM tuned now runs on the GPU
                chosen = choose(problem, device_index)
                trials = kernel_times(problem, device_index)
            pick = graph_choice(list(trials.values()), chosen.label()) if self.graphs else None
            if pick is not None:
                chosen = Choice(pick.backend, pick.config, pick.median_ms, chosen.cublas_ms)
            self.asked[key] = chosen, trials
        return self.asked[key]

    def choose_ahead(self, graph) -> bool:
        """Choose for every mm, addmm and bmm of ``graph`` (the compiler's aten graph) before it is
        lowered, those not stored tuned together first; plan how each runs over the whole graph
        and say so; whether any runs on the compiler's Triton template (which needs the GEMM
        templates switched on)."""
        found = graph_problems(graph)
        for index in dict.fromkeys(i for _, _, i in found):  # the products first: each leads its fused form
            plain = list(dict.fromkeys(p for _, p, i in found if i == index))
            fused = [replace(p, activation=self.epilogues[p]) for p in plain if p in self.epilogues]
            with hooks.unset_fake_temporarily():  # real tensors: the GEMMs tuned now run on the GPU
                tune_ahead(plain + fused, index)
        if not found:
            return False
        counts = Counter((p, i) for _, p, i in found)
        gemms = [Gemm(n, p.bias, self._warm_ways(p, i)) for (p, i), n in counts.items()]
        others = graph_rest(graph, {node for node, _, _ in found}, found[0][2])
        scale = None if self.graphs else host_scale(found[0][2])
        picks = plan.plan(gemms, others, self.graphs, self.templates_on, scale)
        self.decided = dict(zip(counts, picks))
        self._say(counts, gemms, picks, others, scale)
        return any(way.kind == TEMPLATE for way in picks)

    def _say(self, counts: Counter, gemms: list[Gemm], picks: list[Way], others: Rest, scale: float | None) -> None:
        """One log line for a planned graph: how its GEMMs run, the plan's estimate (of the host
        time at the nominal host's speed) and the host's speed it weighed; at debug level, one
        line per product with its ways' kernel times."""
        kinds = Counter()
        for gemm, way in zip(gemms, picks):
            kinds[way.kind] += gemm.count
        chosen = {key: self._asked(*key)[0] for key in counts}
        unchecked = sum(n for key, n in counts.items() if chosen[key].cublas_ms is None
                        and chosen[key].backend != REFERENCE)
        host, gpu = plan.times(gemms, picks, others, self.templates_on)
        speed = "" if scale is None else f"; this host queues a library call in " \
            f"{scale * plan.HOST_MS[LIBRARY] * 1e3:.1f} us ({scale:.1f}x the nominal)"
        log.info("gemmtune: a compiled graph's %d GEMMs (%d shapes): %s%s; estimated %.2f ms of host (%.2f of it "
                 "besides the GEMMs) and %.2f ms of GPU time (%.2f) per run%s%s", sum(counts.values()), len(counts),
                 ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())),
                 f" ({unchecked} where cuBLAS failed gemmtune's check)" if unchecked else "",
                 host, others.host_ms, gpu, others.gpu_ms, " (replayed as a CUDA graph)" if self.graphs else "", speed)
        for ((problem, index), n), gemm, way in zip(counts.items(), gemms, picks):
            untried = REFERENCE not in self._asked(problem, index)[1]  # the library way timed otherwise
            log.debug("gemmtune: planned %d x %s %s: %s%s", n, problem.describe(), way.kind,
                      ", ".join(f"{w.kind} {w.kernel_ms * 1e3:.1f} us" for w in gemm.ways),
                      " (no stored trial of cuBLAS)" if untried else "")

    def uuid(self) -> str:
        """Part of the compiler's cache key: a graph compiled with gemmtune's choices is not one
        compiled without them."""
        return f"gemmtune-{__version__}"

    def _finalize_template_configs(self, template_choices, kernel_inputs, templates, op_name,
                                   kwarg_overrides=None):
        """One candidate per GEMM. A lowering may ask in several calls (torch 2.13's addmm asks
        for its library calls, then for its templates): the candidate goes with the call that
        offers the library call, and the others get none."""
        if op_name not in LOWERINGS:  # an op gemmtune does not know: the compiler chooses as it would
            return super()._finalize_template_configs(template_choices, kernel_inputs, templates, op_name,
                                                      kwarg_overrides)
        library = _library_call(template_choices, templates)
        if library is None:
            return []
        return [self._gemmtune_choice(kernel_inputs, templates, op_name, library) or library]

    def _gemmtune_choice(self, kernel_inputs, templates, op_name, library):
        problem = _problem(kernel_inputs, op_name)
        if problem is None:
            return None
        index = kernel_inputs.device().index or 0
        choice, kind = self.decision(problem, index)
        chosen = None
        if kind == TEMPLATE:
            chosen = self._template(kernel_inputs, templates, op_name, choice.config)
            if chosen is None:  # where the template cannot be: the library call, else gemmtune's kernel
                kind = LIBRARY if any(way.kind == LIBRARY for way in self.ways(problem, index)) else CALLED
        if kind == CALLED and (hooks.config.cpp_wrapper or problem.batch > 1):
            kind = LIBRARY  # generated C++ cannot call Python; gemmtune calls no kernel of a batch
        if chosen is None:
            chosen = _extern(kernel_inputs, problem.layout) if kind == CALLED else library
        log.debug("gemmtune: compiled %s %s %s (%s)", op_name, problem.describe(), kind,
                  _label(choice.backend, choice.config))
        return chosen

    def _template(self, kernel_inputs, templates, op_name, config: dict):
        """The compiler's Triton GEMM template with ``config``'s tiles, or None where it cannot
        take them. Below 68 SMs the compiler offers no template of its own; gemmtune's config
        stands for its own benchmark there."""
        if not hooks.gemm_templates_on() or kernel_inputs.device().type != "cuda":
            return None  # a GEMM not chosen ahead, in a graph compiled without templates; not a GPU
        own = hooks.bmm_template if op_name == "bmm" else hooks.mm_template
        template = next((t for t in templates if t.uid == own.uid), own)
        base = next(iter(self.get_ktc(kernel_inputs, template, op_name)), None)
        if base is None:
            return None
        k = kernel_inputs.shapes_symbolic()[-1][-2]  # b's K: (K, N), or (batch, K, N)
        params = {**base.params.to_kwargs(), **{f: config[f] for f in TEMPLATE_FIELDS},
                  "EVEN_K": int(k) % config["BLOCK_K"] == 0}
        # a fixed output layout, as the compiler gives any template: its code is generated now
        chosen = hooks.KernelTemplateChoice(template=base.template, params=hooks.DictKernelTemplateParams(params),
                                            extra_kwargs=base.extra_kwargs, inputs=base.inputs,
                                            layout=kernel_inputs.output_layout(flexible=False))
        return chosen if chosen.choice is not None else None


def graph_problems(graph) -> list[tuple[torch.fx.Node, Problem, int]]:
    """The mm, addmm and bmm nodes of ``graph`` (the compiler's aten graph, each node's operands
    described by their fake tensors) that gemmtune serves, with their problems and GPUs' indices."""
    found = []
    for node in graph.graph.nodes:
        op = GRAPH_OPS.get(node.target) if node.op == "call_function" else None
        values = [getattr(arg, "meta", {}).get("val") for arg in node.args] if op else []
        out = node.meta.get("val") if op else None
        if not values or not all(isinstance(v, torch.Tensor) for v in (*values, out)) \
                or out.device.type not in DEVICE_TYPES:
            continue
        shapes, strides, static = _hinted(values)
        scalars = {name: node.kwargs[name] for name in ("alpha", "beta") if name in node.kwargs}
        operands = Operands(op, shapes, strides, tuple(dtype_name(v.dtype) for v in values), dtype_name(out.dtype),
                            static, scalars)
        problem = problem_of(operands, tf32_allowed()) if static else None
        if problem is not None:
            found.append((node, problem, out.device.index or 0))
    return found


def _hinted(values: list[torch.Tensor]) -> tuple[tuple, tuple, bool]:
    """The operands' shapes and strides as numbers, and whether they are static: where the rows
    are a dynamic size and nothing else is, their hint stands for them (as ``operands`` reads a
    lowering's)."""
    rows = values[-2].shape[0] if values[-2].dim() == 2 else None
    dims = [d for v in values for d in (*v.shape, *v.stride())]
    symbols = {str(d) for d in dims if not isinstance(d, int)}
    static = not symbols or (rows is not None and not isinstance(rows, int) and symbols == {str(rows)})
    number = (lambda d: d if isinstance(d, int) else d.node.hint) if static else (lambda d: d)
    shapes = tuple(tuple(number(d) for d in v.shape) for v in values)
    strides = tuple(tuple(number(d) for d in v.stride()) for v in values)
    return shapes, strides, static and None not in (d for dims in (*shapes, *strides) for d in dims)


def operands(kernel_inputs, op_name: str) -> Operands:
    """The sizes, strides and dtypes the compiler lowers for ``op_name``, as numbers. Where the
    rows are a dynamic size (a batch that varies) and nothing else is, their hint stands for
    them: gemmtune's kernel, called from the generated code, is chosen again per call's rows."""
    shapes, strides = kernel_inputs.shapes_symbolic(), kernel_inputs.strides_symbolic()
    rows = shapes[-2][0] if len(shapes[-2]) == 2 else None  # a's M
    symbols = {v for dims in shapes for v in dims if not _number(v)}
    static = all(_number(v) for dims in strides for v in dims) and symbols <= {rows}
    if static:
        shapes, strides = kernel_inputs.shapes_hinted(), tuple(tuple(int(v) for v in dims) for dims in strides)
    scalars = {}
    if op_name == "addmm":
        scalars = {name: kernel_inputs.get_scalar(name) for name in ("alpha", "beta")}
    names = tuple(dtype_name(d) for d in kernel_inputs.dtypes())
    return Operands(op_name, tuple(tuple(dims) for dims in shapes), tuple(tuple(dims) for dims in strides), names,
                    dtype_name(kernel_inputs.out_dtype()), static, scalars)


def dtype_name(dtype) -> str:
    """A dtype by gemmtune's name for it (``calls.DTYPE_NAMES``), torch's for one it does not serve."""
    return DTYPE_NAMES.get(dtype) or str(dtype)


def _number(value) -> bool:
    return isinstance(value, (int, sympy.Integer))


def _problem(kernel_inputs, op_name: str) -> Problem | None:
    if not isinstance(kernel_inputs, hooks.MMKernelInputs) or kernel_inputs.device().type not in DEVICE_TYPES:
        return None
    try:
        return problem_of(operands(kernel_inputs, op_name), tf32_allowed())
    except (TypeError, ValueError):  # a symbol where a number was expected, a scalar not there
        return None


def _library_call(template_choices, templates):
    """The compiler's library call among the candidates (torch.mm, addmm...), or None where
    this call offers none: addmm's with a bias row (cuBLASLt's bias epilogue, as F.linear
    runs it) where offered, else the first, as a default compile, which tunes nothing, runs."""
    offered = [t.uid for t in templates if isinstance(t, hooks.ExternKernelChoice) and t.uid in template_choices]
    for uid in sorted(offered, key=lambda uid: uid != BIAS_ADDMM):
        chosen = next(iter(template_choices[uid]), None)
        if chosen is not None:
            return chosen
    return None


def _extern(kernel_inputs, layout: str):
    return hooks.KernelTemplateChoice(template=GEMMTUNE_KERNELS[layout], params=hooks.DictKernelTemplateParams({}),
                                      extra_kwargs={}, layout=kernel_inputs.output_layout(flexible=False),
                                      inputs=kernel_inputs)


def _label(name: str, config: dict) -> str:
    return name + "".join(f" {k}={v}" for k, v in sorted(config.items()))
