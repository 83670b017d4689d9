"""``gemmtune.compile``: ``torch.compile`` with gemmtune choosing the compiled graphs' GEMMs.

The backend is the compiler's own (``compile_fx``), with two changes around each graph it
compiles, the backward graph of a training step included: gemmtune's ``GemmtuneChoices``
answers the GEMM lowerings, having chosen for the graph's GEMMs first, and where one of those
choices is a Triton config the GEMM templates are switched on (``max_autotune_gemm``) so that
it can be the compiler's template, with its epilogue fused.
Nothing is benchmarked: each GEMM has one candidate. A library call's output keeps the layout
the compiler chooses for it, as in a default compile (``max_autotune_allow_flexible_layouts``),
and convolutions keep the compiler's library call (``max_autotune_conv_backends="ATEN"``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from gemmtune.inductor import epilogues, hooks
from gemmtune.serving.calls import tf32_allowed

log = logging.getLogger("gemmtune")

GATE_LOGGER, GATE_WARNING = "torch._inductor.utils", "Not enough SMs to use max_autotune_gemm mode"
MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
# the templates the compiler may offer (switched on per graph: inner_compile); a library call's
# output keeps the layout the compiler may choose, as in a default compile (templates and
# gemmtune's kernel get a fixed one); convolutions keep their library call
_PATCHES = {"max_autotune_gemm_backends": "ATEN,TRITON", "max_autotune_allow_flexible_layouts": True,
            "max_autotune_conv_backends": "ATEN"}


def compile(model, *, mode: str | None = None, fullgraph: bool = False, dynamic: bool | None = None,
            options: dict[str, Any] | None = None):
    """``torch.compile(model, mode=..., fullgraph=..., dynamic=..., options=...)`` with every
    mm and addmm of the compiled graphs run as gemmtune chose it (stored, else tuned on first
    sight). ``mode`` is torch.compile's (None: ``default``); ``options`` are the compiler's
    config entries, as torch.compile takes them. On a torch whose compiler hooks moved, this
    says so once and returns ``torch.compile``'s result."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"compile: mode={mode!r} is not a torch.compile mode; accepted: None, "
                         + ", ".join(MODES))
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"compile: options must be a dict of compiler config entries, got {type(options).__name__}")
    reason = hooks.missing()
    if reason is not None:
        log.warning("gemmtune: %s; compiling with torch.compile alone (checked on torch %s to %s)",
                    reason, *hooks.TESTED)
        return torch.compile(model, mode=mode, fullgraph=fullgraph, dynamic=dynamic, options=options)
    return torch.compile(model, backend=Backend(mode, options), fullgraph=fullgraph, dynamic=dynamic)


class Backend:
    """The compiler's backend with gemmtune's GEMM choices: a ``torch.compile`` backend."""

    def __init__(self, mode: str | None = None, options: dict[str, Any] | None = None) -> None:
        from gemmtune.inductor.choices import GemmtuneChoices

        self.patches = {**hooks.list_mode_options(mode or "default"), **(options or {}),
                        **_PATCHES, "inductor_choices_class": GemmtuneChoices}
        self.graphs = bool(self.patches.get("triton.cudagraphs"))  # reduce-overhead, max-autotune
        self.epilogues: dict = {}  # the products of the graph compiling -> the activation alone after

    def __call__(self, graph: torch.fx.GraphModule, example_inputs):
        """Dynamo's graph compiled: the activations its linear layers feed read first (the
        compiler decomposes them), then the compiler's own compile."""
        from gemmtune.inductor.choices import DEVICE_TYPES

        self.epilogues = epilogues.activations(graph, DEVICE_TYPES, tf32_allowed())
        return hooks.compile_fx(graph, example_inputs, inner_compile=self.inner_compile,
                                config_patches=self.patches)

    def inner_compile(self, graph, example_inputs, **kwargs):
        """One graph (forward or, when a backward first runs, backward) compiled with gemmtune's
        choices answering its lowerings. They are made for the whole graph first: only a graph
        with a GEMM on the compiler's Triton template is compiled with the GEMM templates
        switched on (under torch 2.11 that also makes addmm's library call a Python wrapper,
        bias_addmm); any other compiles as a default compile does, gemmtune's kernels aside."""
        from gemmtune.inductor.choices import GemmtuneChoices

        asked = hooks.gemm_templates_on()  # by the caller, through the patches compile_fx applies
        handler = GemmtuneChoices(self.graphs, self.epilogues, asked)
        templates = handler.choose_ahead(graph) or asked
        with hooks.config.patch(max_autotune_gemm=templates), hooks.V.set_choices_handler(handler), \
                _gate_warning_explained():
            return hooks.compile_fx_inner(graph, example_inputs, **kwargs)


class _GateWarning(logging.Filter):
    """Drops the compiler's "Not enough SMs to use max_autotune_gemm mode" (it asks once per
    GPU and process), saying once instead what it means under gemmtune.compile."""

    said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(GATE_WARNING):
            return True
        if not _GateWarning.said:
            _GateWarning.said = True
            log.info("gemmtune: this GPU is under the compiler's SM gate for its GEMM templates; under "
                     "gemmtune.compile a GEMM gemmtune chose a Triton config for still runs the template "
                     "with that config (`gemmtune doctor` explains the compiler's warning)")
        return False


@contextlib.contextmanager
def _gate_warning_explained() -> Iterator[None]:
    logger = logging.getLogger(GATE_LOGGER)
    gate = _GateWarning()
    logger.addFilter(gate)
    try:
        yield
    finally:
        logger.removeFilter(gate)
