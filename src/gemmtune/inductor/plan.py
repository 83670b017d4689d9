"""How a compiled graph runs the GEMMs gemmtune chose for: the ways each one may run (``ways``)
and the mix of them that costs the whole graph least (``plan``).

A GEMM of compiled code runs one of three ways:

- LIBRARY: the compiler's own library call (cuBLAS), as a default ``torch.compile`` runs it;
- TEMPLATE: the compiler's Triton GEMM template with a config gemmtune tried, which costs the
  host least (one Triton launch) and takes the activation that follows into its epilogue;
- CALLED: gemmtune's own kernel called from the generated code, which costs the host most.

Compiled code that is not replayed as a CUDA graph costs the longer of its host time (the
launches queued) and its GPU time. A way that saves GPU time but costs host time pays only in a
graph the GPU paces (a large batch); one that saves host time but costs GPU time only in a graph
the host paces (decode, a small batch). So the ways are weighed over the whole graph: the host
time of its GEMMs' calls and of the rest of its kernels, against their GPU time (``Rest``, from
``rest.estimate``). How fast a host queues varies from machine to machine (twice as fast on one
H100 host as on another), so a mix is taken only where it costs no more than the one it
replaces at every host speed the plan weighs (``host_scales``): from this host's, measured when
compiling, to twice as slow, else from half to four times the nominal one. Under CUDA graphs
only the GPU time counts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gemmtune.backends import REFERENCE
from gemmtune.results import Trial
from gemmtune.serving.dispatch import Choice

TEMPLATE, CALLED, LIBRARY = "on the compiler's Triton template", "on gemmtune's kernels", "on cuBLAS"
TEMPLATE_BACKEND = "triton_tiled"  # the gemmtune backend whose configs the compiler's template takes
# the gemmtune kernels compiled code may call (runtime); cuBLASLt's only where it is replayed as a
# CUDA graph: with the weights warm in L2, as in a model, the algorithms seen ran cuBLAS's own
# kernel (compiled BERT-base, the seeds' MLP: 0.64-0.72 of torch.compile, docs/compile.md)
CALLED_BACKENDS = ("triton_splitk", "triton_stream", "triton_persistent", "cublas_padded")
GRAPHED_ONLY = ("cublaslt",)
# Host time per call of compiled code, queued, in ms. The library call is torch.addmm's on a fast
# H100 host; the others keep the ratios benchmarks/compiled_host.py measured side by side on one
# host (docs/compile.md, host time per call): gemmtune's kernel called costs the library call's
# and 0.21 of an F.linear more, the template's launch 0.60 of one less; a graph compiled with the
# GEMM templates on runs its other addmm's library calls through a Python wrapper (torch 2.11's
# bias_addmm) that costs 0.40 of one more (WRAPPED); any other Triton kernel of the compiler's
# costs the host as the template's launch (LAUNCH).
# A run of a compiled graph costs the host GRAPH_MS besides its kernels (its guards and wrapper:
# a graph of one Triton kernel took 46.6 us per call where F.linear took 23.3).
HOST_MS = {LIBRARY: 0.0131, CALLED: 0.0158, TEMPLATE: 0.0053}
WRAPPED_MS = 0.0052
LAUNCH_MS = 0.0053
GRAPH_MS = 0.021
# the host speeds a mix must not lose at where this host's is not measured (x HOST_MS: above 1,
# slower hosts), the nominal one first: a move's gain is weighed there
HOST_SCALES = (1.0, 0.5, 2.0, 4.0)
# Where this host's speed was measured, the speeds weighed are from it to SLOWER_BY slower, none
# faster. The measure is the fastest of five loops, and a graph runs under more load than it was
# compiled under: on every host measured the compiled forward's host work ran slower than the
# measured speed's estimate (BERT-base: 1.14x, 1.28x and more; docs/compile.md).
SLOWER_BY = 2.0
# The most a template's kernel may take over cuBLAS's to be weighed at all: beyond it, the graph
# estimate's errors (the rest's GPU time, the host's pace at run time) outweigh any launch saved.
# (It was 1.25: T5-small's 1024x512x2048 products then stayed on the library call in a graph the
# host paces three times over, 0.950 of max-autotune, which runs every product on its template.)
TEMPLATE_SLOWDOWN = 2.0
MIN_GAIN = 0.02  # a kernel time of gemmtune's weighs this much more than the library call's (noise)


@dataclass(frozen=True)
class Way:
    """One way to run a GEMM: the choice run, TEMPLATE, CALLED or LIBRARY, its kernel time as its
    tuning measured it, and the host time a call costs."""

    choice: Choice
    kind: str
    kernel_ms: float
    host_ms: float


@dataclass(frozen=True)
class Gemm:
    """One product of a graph: how many times the graph runs it, whether it adds a bias, and
    its ways, the first the one it runs where nothing is weighed."""

    count: int
    bias: bool
    ways: tuple[Way, ...]


@dataclass(frozen=True)
class Rest:
    """What a graph costs besides the GEMMs weighed: host and GPU time per run, in ms."""

    host_ms: float = 0.0
    gpu_ms: float = 0.0


def ways(choice: Choice, trials: dict[str, Trial], graphs: bool,
         fused: tuple[Choice, dict[str, Trial]] | None = None) -> tuple[Way, ...]:
    """The ways compiled code may run a GEMM gemmtune chose ``choice`` for, ``trials`` being its
    tuning's (by label): the library call first where cuBLAS passed gemmtune's check, gemmtune's
    kernel, the compiler's template with the fastest Triton config tried (for the product alone,
    and with the activation that follows it: ``fused``, that form's choice and trials). Where
    cuBLAS failed its check the library call is left out, and so is a way whose kernel time is
    unknown (where none is known, the choice runs as it is)."""
    reference = trials.get(REFERENCE)
    library_ms = reference.median_ms if reference is not None else choice.cublas_ms
    found = []
    if choice.backend == REFERENCE or choice.cublas_ms is not None:
        found.append(_way(Choice("cublas", {}, library_ms, library_ms), LIBRARY, library_ms, graphs))
    if choice.backend in CALLED_BACKENDS or choice.backend in GRAPHED_ONLY and (graphs or choice.cublas_ms is None):
        mine = trials.get(choice.label())
        found.append(_way(choice, CALLED, mine.median_ms if mine is not None else choice.time_ms, graphs))
    # the form with the activation fused into the template's epilogue launches no kernel for it
    forms = [(choice, trials, 0.0)] + ([(*fused, LAUNCH_MS)] if fused else [])
    for chosen, tried, saved_ms in forms:
        reference = tried.get(REFERENCE)  # the library call's kernel time (its cost holds the host's)
        tiled = _fastest_tiled(chosen, tried, reference.median_ms if reference is not None else None)
        if tiled is not None and (library_ms is None or tiled.time_ms <= TEMPLATE_SLOWDOWN * library_ms):
            found.append(Way(tiled, TEMPLATE, tiled.time_ms, 0.0 if graphs else HOST_MS[TEMPLATE] - saved_ms))
    known = tuple(way for way in found if way.kernel_ms is not None)
    if not known or library_ms is None and found[0].kind == LIBRARY:
        # no time known, or cuBLAS unmeasured (a fallback): the choice as it is, nothing weighed
        first = found[0] if found else _way(choice, _kind(choice.backend), 0.0, graphs)
        return (replace(first, kernel_ms=0.0),)
    return known


def host_scales(measured: float | None) -> tuple[float, ...]:
    """The host speeds (x HOST_MS: above 1, slower hosts) a mix must not lose at, the one its
    gain is weighed at first: this host's ``measured`` one and up to SLOWER_BY slower, where it
    was measured, else HOST_SCALES about the nominal one."""
    if measured is None:
        return HOST_SCALES
    return measured, measured * SLOWER_BY


def warmed(found: tuple[Way, ...], library_ms: float | None, flushed_ms: float | None) -> tuple[Way, ...]:
    """A product's ways (``ways``) with their kernel times as a model runs them: each times the
    library call's warm kernel time ``library_ms`` over its L2-flushed trial's ``flushed_ms`` (at
    most 1: a warm kernel is no slower). Where the tuning stored no trial of the library call,
    its way's time is a call's cost, host time included, which no kernel time divides: the warm
    time stands for the library call alone. The ways as they are where nothing was measured warm."""
    if library_ms is None or not any(way.kind == LIBRARY for way in found):
        return found
    if not flushed_ms:
        return tuple(replace(way, kernel_ms=library_ms) if way.kind == LIBRARY else way for way in found)
    ratio = min(1.0, library_ms / flushed_ms)
    return tuple(replace(way, kernel_ms=way.kernel_ms * ratio) for way in found)


def plan(gemms: list[Gemm], rest: Rest, graphs: bool, templates_on: bool = False,
         host_scale: float | None = None) -> list[Way]:
    """The way each of ``gemms`` runs: from each one's first way, moves of one product at a
    time, or of every product that can take the template at once (``_moves``), the one that saves
    the graph most at this host's speed (``host_scale``, x HOST_MS; the nominal one where not
    measured) first, each taken only where it costs no more at any host speed of ``host_scales``
    (``graph_ms``). ``templates_on``: the caller switched the GEMM templates on, so taking one
    makes no other call dearer."""
    scales = host_scales(host_scale)
    picks = [gemm.ways[0] for gemm in gemms]
    while True:
        current = [graph_ms(gemms, picks, rest, scale, graphs, templates_on) for scale in scales]
        best, saved = None, 0.0
        for trial in _moves(gemms, picks):
            costs = [graph_ms(gemms, trial, rest, scale, graphs, templates_on) for scale in scales]
            gain = current[0] - costs[0]
            if gain > saved and all(new <= old for new, old in zip(costs, current)):
                best, saved = trial, gain
        if best is None:
            return picks
        picks = best


def _moves(gemms: list[Gemm], picks: list[Way]):
    """The mixes one move from ``picks``: one product run another way; every product that has a
    template way run on its fastest; and those alone whose fastest template way is faster than
    their pick. The last two are one move each because the first template taken makes every
    other addmm's library call dearer (WRAPPED_MS): one at a time, the first would not pay where
    several together do, and all together would take templates slower than the library call too
    (MLP-Mixer-B on an H200: its 24 token-mixing products 15-25% faster on the template, its 24
    channel-mixing ones 33-59% slower; docs/compile.md)."""
    for index, gemm in enumerate(gemms):
        for way in gemm.ways:
            yield picks[:index] + [way] + picks[index + 1:]
    templated = [min((w for w in gemm.ways if w.kind == TEMPLATE), key=lambda w: w.kernel_ms, default=pick)
                 for gemm, pick in zip(gemms, picks)]
    if templated != picks:
        yield templated
    faster = [way if way.kernel_ms < pick.kernel_ms else pick for way, pick in zip(templated, picks)]
    if faster not in (picks, templated):
        yield faster


def graph_ms(gemms: list[Gemm], picks: list[Way], rest: Rest, scale: float, graphs: bool,
             templates_on: bool = False) -> float:
    """A run of the graph whose ``gemms`` run as ``picks`` say, on a host ``scale`` times slower
    than HOST_MS's: the longer of its host and GPU times (``times``; under CUDA graphs, its GPU
    time)."""
    host, gpu = times(gemms, picks, rest, templates_on)
    return gpu if graphs else max(scale * host, gpu)


def times(gemms: list[Gemm], picks: list[Way], rest: Rest, templates_on: bool = False) -> tuple[float, float]:
    """The host and GPU time of a run of the graph whose ``gemms`` run as ``picks`` say, in ms; a
    kernel time of gemmtune's weighs MIN_GAIN more than the library call's."""
    wrapped = templates_on or any(way.kind == TEMPLATE for way in picks)
    host, gpu = rest.host_ms, rest.gpu_ms
    for gemm, way in zip(gemms, picks):
        host += gemm.count * (way.host_ms + (WRAPPED_MS if wrapped and way.kind == LIBRARY and gemm.bias else 0.0))
        gpu += gemm.count * way.kernel_ms * (1.0 if way.kind == LIBRARY else 1.0 + MIN_GAIN)
    return host, gpu


def _way(choice: Choice, kind: str, kernel_ms: float | None, graphs: bool) -> Way:
    return Way(choice, kind, kernel_ms, 0.0 if graphs else HOST_MS[kind])


def _kind(backend: str) -> str:
    if backend == TEMPLATE_BACKEND:
        return TEMPLATE
    return CALLED if backend in CALLED_BACKENDS + GRAPHED_ONLY else LIBRARY


def _fastest_tiled(choice: Choice, trials: dict[str, Trial], library_ms: float | None) -> Choice | None:
    """The fastest Triton config tried for a product, as a choice with its kernel time: the
    tuner's own where it chose one (its stored trial's kernel time, else the choice's cost: a
    call's cost holds the host's time, which on a slow host made a template look slower than
    the library call it beat), else the fastest verified trial of one, at no less than the
    library call's stored kernel time ``library_ms`` where one is stored: the tuner, which timed
    it beside cuBLAS, did not find it faster, and its stored time is from other rounds than
    cuBLAS's, which drift apart by up to 15% (such a reading, 44.1 against 45.1 us where later
    tunings read 1.2x, moved 48 of ALBERT's products in a compiled forward 4% slower than
    torch.compile's; docs/compile.md)."""
    if choice.backend == TEMPLATE_BACKEND and choice.time_ms is not None:
        mine = trials.get(choice.label())
        kernel_ms = mine.median_ms if mine is not None and mine.median_ms is not None else choice.time_ms
        return Choice(TEMPLATE_BACKEND, choice.config, kernel_ms, choice.cublas_ms)
    tiled = min((t for t in trials.values() if t.backend == TEMPLATE_BACKEND and t.median_ms is not None),
                key=lambda t: t.median_ms, default=None)
    if tiled is None:
        return None
    return Choice(TEMPLATE_BACKEND, tiled.config, max(tiled.median_ms, library_ms or 0.0), choice.cublas_ms)
