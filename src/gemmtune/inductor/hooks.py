"""The compiler's extension points gemmtune uses, imported here and nowhere else in gemmtune.

torch 2.11 to 2.13 give what gemmtune needs to choose the compiler's GEMMs:

- ``InductorChoices._finalize_template_configs``, which every GEMM lowering (mm, addmm, bmm)
  calls with its candidates before any is generated, documented as the method to override to
  change them; ``V.set_choices_handler`` makes an instance the one the lowerings ask;
- ``KernelTemplateChoice`` and ``DictKernelTemplateParams``, to hand back one candidate with
  gemmtune's config (as the compiler's own lookup table does);
- ``ExternKernelChoice``, the compiler's way to call a Python function from its generated code;
- ``compile_fx`` and ``compile_fx_inner``, the ``inductor`` backend and the per-graph compile;
- ``unset_fake_temporarily``: real tensors inside a lowering, for a GEMM tuned on first sight.

They are private to torch, so ``missing()`` checks every one, and the signatures gemmtune
calls, before anything is compiled: where one moved, ``gemmtune.compile`` says so once and
compiles as ``torch.compile`` does. A test of ``tests/inductor/test_compile.py`` fails on a
torch where one moved. What the compiler does differently between releases is read here too
(``gemm_templates_on``, ``fuses_through_views``).
"""

from __future__ import annotations

import inspect

import torch

TESTED = ("2.11", "2.13")  # the torch releases these hooks were checked on, oldest and newest

# name -> the parameters gemmtune passes, in order
_SIGNATURES = {
    "InductorChoices._finalize_template_configs":
        ("self", "template_choices", "kernel_inputs", "templates", "op_name", "kwarg_overrides"),
    "InductorChoices.get_ktc": ("self", "kernel_inputs", "template", "op_name", "kwarg_overrides"),
    "KernelTemplateChoice.__init__": ("self", "template", "params", "extra_kwargs", "layout", "inputs"),
    "compile_fx": ("model_", "example_inputs_", "inner_compile", "config_patches"),
}
_ATTRIBUTES = ("MMKernelInputs.shapes_symbolic", "MMKernelInputs.strides_symbolic", "MMKernelInputs.dtypes",
               "MMKernelInputs.out_dtype", "MMKernelInputs.output_layout", "MMKernelInputs.device",
               "MMKernelInputs.get_scalar", "ExternKernelChoice.uid", "V.set_choices_handler")

try:
    from torch._inductor import config, list_mode_options
    from torch._inductor.choices import InductorChoices
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.kernel.bmm import bmm_template
    from torch._inductor.kernel.mm import mm_template
    from torch._inductor.kernel_inputs import MMKernelInputs
    from torch._inductor.kernel_template_choice import KernelTemplateChoice
    from torch._inductor.select_algorithm import ExternKernelChoice
    from torch._inductor.template_heuristics.params import DictKernelTemplateParams
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    _IMPORT_ERROR = None
except ImportError as exc:  # a torch without them: missing() says which
    _IMPORT_ERROR = exc


def missing() -> str | None:
    """Why gemmtune cannot choose the compiler's GEMMs on this torch, or None where it can."""
    if _IMPORT_ERROR is not None:
        return f"torch {torch.__version__} lacks a compiler hook gemmtune uses ({_IMPORT_ERROR})"
    names = globals()
    for dotted, expected in _SIGNATURES.items():
        owner, _, attr = dotted.partition(".")
        fn = getattr(names[owner], attr) if attr else names[owner]
        got = tuple(inspect.signature(fn).parameters)[:len(expected)]
        if got != expected:
            return f"torch {torch.__version__}'s {dotted} takes {got}, not {expected}"
    for dotted in _ATTRIBUTES:
        owner, _, attr = dotted.partition(".")
        if not hasattr(names[owner], attr):
            return f"torch {torch.__version__} has no {dotted}"
    return None


def gemm_templates_on() -> bool:
    """Whether the compiler's GEMM templates are switched on where it compiles now: by
    ``max_autotune_gemm``, or by ``max_autotune`` (a max-autotune mode, the caller's options, or
    the compiler's config as the process set it)."""
    return bool(config.max_autotune or config.max_autotune_gemm)


def fuses_through_views() -> bool:
    """Whether the compiler can fuse a GEMM template's output into the activation that reads it
    through a view (a linear on more than 2-D input decomposes into addmm and a view). torch
    2.11 cannot: the two nodes' memory score reads 0 and the fusion is refused, measured
    (docs/compile.md, the activation after fc1). torch 2.13 matches a template's buffers by name
    across the view, read in its source; 2.12 is taken as 2.11."""
    return torch.torch_version.TorchVersion(torch.__version__) >= "2.13"


def extern_choice(fn, name: str):
    """``fn`` as a candidate the compiler's generated code calls by ``name``, returning its
    output (no ``out=``). One per name and process: the compiler keeps a table of them."""
    return ExternKernelChoice(fn, None, name=name, has_out_variant=False)
