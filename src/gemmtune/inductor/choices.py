"""gemmtune as the compiler's GEMM chooser: each mm and addmm the compiler lowers gets one
candidate, gemmtune's choice for it, so nothing is benchmarked while compiling.

- cuBLAS: the compiler's own call of it (``aten``), the plain op of a default compile;
- a ``triton_tiled`` config: the compiler's Triton GEMM template with that config's tiles,
  warps and stages, so the compiler fuses what follows (bias, activation, residual) into it;
- any other gemmtune kernel: ``runtime.linear`` or ``runtime.mm`` called from the generated code, where that pays
  for its host time (``GemmtuneChoices.kind``), else the compiler's cuBLAS call.

Every other GEMM (bmm, a dynamic size, an operand layout or dtype gemmtune does not serve) gets
what a default ``torch.compile`` gives it: the compiler's first library call, nothing tuned.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace

import sympy
import torch

from gemmtune.backends import REFERENCE
from gemmtune.device import current
from gemmtune.inductor import hooks, runtime
from gemmtune.inductor.problems import Operands, problem_of
from gemmtune.problem import Problem
from gemmtune.results import Status, Trial
from gemmtune.serving.calls import DTYPE_NAMES, tf32_allowed
from gemmtune.serving.dispatch import DISPATCHER, Choice
from gemmtune.version import __version__

log = logging.getLogger("gemmtune")

TEMPLATE_BACKEND = "triton_tiled"  # the gemmtune backend whose configs the compiler's template takes
# the gemmtune kernels compiled code may call (runtime); cuBLASLt's only where it is replayed as a
# CUDA graph: with the weights warm in L2, as in a model, the algorithms seen ran cuBLAS's own
# kernel (compiled BERT-base, the seeds' MLP: 0.64-0.72 of torch.compile, docs/compile.md)
CALLED_BACKENDS = ("triton_splitk", "triton_stream", "triton_persistent", "cublas_padded", "triton_tiled")
GRAPHED_ONLY = ("cublaslt",)
TEMPLATE, CALLED, LIBRARY = "on the compiler's Triton template", "on gemmtune's kernels", "on cuBLAS"
# Host time per call of compiled code that is not replayed as a CUDA graph, queued, on an H100:
# the compiler's library call (torch.addmm, 13.1 us), gemmtune's kernel called from the generated
# code (22.3 us) and a launch of the compiler's Triton template (about 4.5 us: compiled BERT-base
# ran 96 GEMMs as templates in 0.8-1.3 ms less per forward at the same GPU time; to be measured
# by benchmarks/compiled_host.py, as the called kernel's and the wrapped addmm's). Where the host
# sets the pace a call costs the longer of its kernel and its host time (``queued_ms``), and a way
# other than the library call is taken only where it costs MIN_GAIN less so. The template is
# weighed only for a GEMM whose cuBLAS kernel is shorter than its own library call's host time,
# and only where its kernel is at most TEMPLATE_SLOWDOWN slower (what a GPU-bound graph loses).
HOST_MS = {LIBRARY: 0.0131, CALLED: 0.0223, TEMPLATE: 0.0045}
# A graph with a template is compiled with the GEMM templates on, and under torch 2.11 its other
# addmm's library calls then go through a Python wrapper (bias_addmm) that costs about 3 us more
# each (compiled BERT-base: 73 calls of about 3 us): templates taken for their launch alone must
# save more than that (``GemmtuneChoices.choose_ahead``).
WRAPPED_ADDMM_MS = 0.003
TEMPLATE_SLOWDOWN = 1.25
MIN_GAIN = 0.02
TEMPLATE_FIELDS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
# by the product's layout: read once, when the graph is compiled
GEMMTUNE_KERNELS = {"linear": hooks.extern_choice(runtime.linear, "gemmtune_linear"),
                    "nn": hooks.extern_choice(runtime.mm, "gemmtune_mm")}
# the lowerings whose candidates gemmtune gives (mm and addmm its choice; the others, which
# it does not serve, their library call, as a default compile); any other is the compiler's
LOWERINGS = ("mm", "addmm", "bmm", "baddbmm", "mm-ah")
GRAPH_OPS = {torch.ops.aten.mm.default: "mm", torch.ops.aten.addmm.default: "addmm"}
BIAS_ADDMM = "aten::bias_addmm"
DEVICE_TYPES = ("cuda",)  # whose GEMMs gemmtune chooses (elsewhere it serves none)


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


def queued_ms(kernel_ms: float, kind: str) -> float:
    """What one call costs compiled code whose host sets the pace: its kernel or its host time."""
    return max(kernel_ms, HOST_MS[kind])


def cheaper(kernel_ms: float, kind: str, library_ms: float) -> bool:
    """Whether running ``kind`` costs MIN_GAIN less queued than the library call."""
    return queued_ms(kernel_ms, kind) < (1.0 - MIN_GAIN) * queued_ms(library_ms, LIBRARY)


def decide(choice: Choice, trials: dict[str, Trial], graphs: bool, launch: bool = True) -> tuple[Choice, str]:
    """How compiled code runs a GEMM gemmtune chose ``choice`` for, ``trials`` being its tuning's
    (``kernel_times``): the choice it runs and TEMPLATE, CALLED or LIBRARY. A Triton config is the
    compiler's template; under CUDA graphs every other kernel of gemmtune's is called; where cuBLAS
    failed its check (no ``cublas_ms``) its library call is never taken. Otherwise the way that
    costs least queued (``queued_ms``): the library call, gemmtune's kernel, or (where ``launch``)
    the fastest Triton config tried where the library call's launch sets the pace."""
    backend = choice.backend
    if backend == TEMPLATE_BACKEND:
        return choice, TEMPLATE
    own = backend in CALLED_BACKENDS + GRAPHED_ONLY
    if own and (graphs or choice.cublas_ms is None):
        return choice, CALLED
    reference = trials.get(REFERENCE)
    library_ms = reference.median_ms if reference is not None else choice.cublas_ms
    if library_ms is None:  # nothing was measured (a fallback to cuBLAS)
        return choice, LIBRARY
    ways = []
    if own and backend not in GRAPHED_ONLY:
        mine = trials.get(Trial(backend, choice.config, Status.OK).label())
        ways.append((choice, CALLED, mine.median_ms if mine is not None else choice.time_ms))
    tiled = min((t for t in trials.values() if t.backend == TEMPLATE_BACKEND), key=lambda t: t.median_ms, default=None)
    if launch and not graphs and tiled is not None and reference is not None and library_ms < HOST_MS[LIBRARY] \
            and tiled.median_ms <= TEMPLATE_SLOWDOWN * library_ms:
        ways.append((Choice(TEMPLATE_BACKEND, tiled.config, tiled.median_ms, library_ms), TEMPLATE, tiled.median_ms))
    ways = [(c, kind, ms) for c, kind, ms in ways if ms is not None]
    if ways:
        best, kind, ms = min(ways, key=lambda way: queued_ms(way[2], way[1]))
        if cheaper(ms, kind, library_ms):
            return best, kind
    return choice, LIBRARY


class GemmtuneChoices(hooks.InductorChoices):
    """The compiler's heuristics, except that its GEMM candidates are gemmtune's one choice.
    ``graphs``: the compiled graphs are replayed as CUDA graphs (no host cost per call)."""

    def __init__(self, graphs: bool = False, epilogues: dict[Problem, str] | None = None) -> None:
        super().__init__()
        self.graphs = graphs
        self.epilogues = epilogues or {}  # a product -> the activation that alone follows it
        self.decided: dict[tuple[Problem, int], tuple[Choice, str]] = {}  # (problem, GPU) -> decide's answer
        self.asked: dict[tuple[Problem, int], tuple[Choice, dict]] = {}  # (problem, GPU) -> choose's answer, trials
        self.launch = True  # whether a template may be taken for its cheaper launch alone

    def choice(self, problem: Problem, device_index: int) -> Choice:
        """gemmtune's choice for ``problem`` on GPU ``device_index``, as the compiled code runs it."""
        return self.decision(problem, device_index)[0]

    def decision(self, problem: Problem, device_index: int) -> tuple[Choice, str]:
        """The choice the compiled code runs for ``problem`` and how (``decide``): for a product
        an activation alone follows, the two fused where that runs as the compiler's template
        (which then fuses the activation too), else the product's own."""
        activation = self.epilogues.get(problem)
        if activation is not None:
            fused = self._decided(replace(problem, activation=activation), device_index)
            if fused[1] == TEMPLATE:
                return fused
        return self._decided(problem, device_index)

    def _decided(self, problem: Problem, device_index: int) -> tuple[Choice, str]:
        """``decide`` on ``choose``'s answer, asked once per compile."""
        key = (problem, device_index)
        if key not in self.asked:
            with hooks.unset_fake_temporarily():  # real tensors: a GEMM tuned now runs on the GPU
                chosen = choose(problem, device_index)
                trials = kernel_times(problem, device_index) if chosen.backend != TEMPLATE_BACKEND else {}
                self.asked[key] = chosen, trials
        if key not in self.decided:
            self.decided[key] = decide(*self.asked[key], self.graphs, self.launch)
        return self.decided[key]

    def choose_ahead(self, graph) -> bool:
        """Choose for every mm and addmm of ``graph`` (the compiler's aten graph) before it is
        lowered, those not stored tuned together first, and say what was chosen; whether any
        choice is the compiler's Triton template (which needs its GEMM templates switched on)."""
        found = graph_problems(graph)
        for index in dict.fromkeys(i for _, i in found):  # the products first: each leads its fused form
            plain = list(dict.fromkeys(p for p, i in found if i == index))
            fused = [replace(p, activation=self.epilogues[p]) for p in plain if p in self.epilogues]
            with hooks.unset_fake_temporarily():  # real tensors: the GEMMs tuned now run on the GPU
                tune_ahead(plain + fused, index)
        decided = [(p, *self.decision(p, index)) for p, index in found]
        if any(kind == TEMPLATE for *_, kind in decided) and not self._launch_pays(decided):
            self.launch = False  # the graph compiles as if no template had been weighed for its launch
            self.decided.clear()
            decided = [(p, *self.decision(p, index)) for p, index in found]
        kinds = Counter(kind for *_, kind in decided)
        unchecked = sum(1 for _, choice, _ in decided if choice.cublas_ms is None and choice.backend != REFERENCE)
        if found:
            log.info("gemmtune: a compiled graph's %d GEMMs (%d shapes): %s%s", len(found), len(set(found)),
                     ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())),
                     f" ({unchecked} where cuBLAS failed gemmtune's check)" if unchecked else "")
        return kinds[TEMPLATE] > 0

    def _launch_pays(self, decided: list[tuple[Problem, Choice, str]]) -> bool:
        """Whether the templates the graph's GEMMs (``decided``: each with its choice and how it
        runs) take for their launch alone save the host more than switching the templates on
        costs the graph's other addmm calls; true where any template is the tuner's own choice
        (the templates are on anyway)."""
        if any(chosen.backend == TEMPLATE_BACKEND for chosen, _ in self.asked.values()):
            return True
        launched = sum(1 for *_, kind in decided if kind == TEMPLATE)
        wrapped = sum(1 for p, _, kind in decided if kind == LIBRARY and p.bias)
        return launched * (HOST_MS[LIBRARY] - HOST_MS[TEMPLATE]) > wrapped * WRAPPED_ADDMM_MS

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
        choice, kind = self.decision(problem, kernel_inputs.device().index or 0)
        chosen = None
        if kind == TEMPLATE:
            chosen = self._template(kernel_inputs, templates, op_name, choice.config)
            if chosen is None:  # gemmtune's own Triton kernel where the template cannot be, if that pays
                kind = CALLED if choice.cublas_ms is None or choice.time_ms is not None and cheaper(
                    choice.time_ms, CALLED, choice.cublas_ms) else LIBRARY
        if kind == CALLED and hooks.config.cpp_wrapper:  # generated C++ cannot call Python
            kind = LIBRARY
        if chosen is None:
            chosen = _extern(kernel_inputs, problem.layout) if kind == CALLED else library
        log.debug("gemmtune: compiled %s %s %s (%s)", op_name, problem.describe(), kind,
                  _label(choice.backend, choice.config))
        return chosen

    def _template(self, kernel_inputs, templates, op_name, config: dict):
        """The compiler's Triton GEMM template with ``config``'s tiles, or None where it cannot
        take them. Below 68 SMs the compiler offers no template of its own; gemmtune's config
        stands for its own benchmark there."""
        if not (hooks.config.max_autotune or hooks.config.max_autotune_gemm) or kernel_inputs.device().type != "cuda":
            return None  # a GEMM not chosen ahead, in a graph compiled without templates; not a GPU
        template = next((t for t in templates if t.uid == hooks.mm_template.uid), hooks.mm_template)
        base = next(iter(self.get_ktc(kernel_inputs, template, op_name)), None)
        if base is None:
            return None
        k = kernel_inputs.shapes_symbolic()[-1][0]
        params = {**base.params.to_kwargs(), **{f: config[f] for f in TEMPLATE_FIELDS},
                  "EVEN_K": int(k) % config["BLOCK_K"] == 0}
        # a fixed output layout, as the compiler gives any template: its code is generated now
        chosen = hooks.KernelTemplateChoice(template=base.template, params=hooks.DictKernelTemplateParams(params),
                                            extra_kwargs=base.extra_kwargs, inputs=base.inputs,
                                            layout=kernel_inputs.output_layout(flexible=False))
        return chosen if chosen.choice is not None else None


def graph_problems(graph) -> list[tuple[Problem, int]]:
    """The gemmtune problems of ``graph``'s mm and addmm nodes (the compiler's aten graph, each
    node's operands described by their fake tensors), with their GPUs' indices."""
    found = []
    for node in graph.graph.nodes:
        op = GRAPH_OPS.get(node.target) if node.op == "call_function" else None
        values = [getattr(arg, "meta", {}).get("val") for arg in node.args] if op else []
        out = node.meta.get("val") if op else None
        if not values or not all(isinstance(v, torch.Tensor) for v in (*values, out)) \
                or out.device.type not in DEVICE_TYPES:
            continue
        shapes, strides = tuple(tuple(v.shape) for v in values), tuple(v.stride() for v in values)
        static = all(isinstance(d, int) for dims in (*shapes, *strides) for d in dims)
        scalars = {name: node.kwargs[name] for name in ("alpha", "beta") if name in node.kwargs}
        operands = Operands(op, shapes, strides, tuple(dtype_name(v.dtype) for v in values), dtype_name(out.dtype),
                            static, scalars)
        problem = problem_of(operands, tf32_allowed()) if static else None
        if problem is not None:
            found.append((problem, out.device.index or 0))
    return found


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
