"""A model zoo with and without gemmtune, in every way a model runs: the ``models`` file of
RESULTS.md.

Every model is built from its config with random weights (timm ``create_model(pretrained=False)``,
transformers ``XConfig`` + ``XModel``, plain torch): nothing is downloaded. A *case* is a model at
one batch, dtype and phase (inference, prefill, decode or train). Per case one deep copy runs as it
is (the baseline) and another through ``gemmtune.optimize`` (tuned on the case's own inputs from an
empty store unless ``--store``: ``setup_s``), and each mode times both sides back to back in
alternating rounds:

    eager                       N calls queued between two CUDA events, no sync between calls
    graph                       replays of a torch.cuda.CUDAGraph of the forward (static inputs)
    compile                     torch.compile (default mode) of each side
    reduce-overhead             torch.compile(mode="reduce-overhead") of each side
    max-autotune-no-cudagraphs  the baseline compiled in that mode against gemmtune's side
                                compiled by default (the row's mode is "compile")
    gemmtune-compile            torch.compile (default) of the model against gemmtune.compile of
                                it (no optimize: the compiler's GEMMs are gemmtune's choices;
                                setup_s is that compile, first-sight tuning included)
    gemmtune-vs-max-autotune    max-autotune-no-cudagraphs of the model against gemmtune.compile
    gemmtune-reduce-overhead    torch.compile(mode="reduce-overhead") against gemmtune.compile in
                                that mode (CUDA graphs: every choice of gemmtune's is called)
    gemmtune-max-autotune       max-autotune-no-cudagraphs against gemmtune.compile in that mode:
                                the user's swap, the compiler's pointwise and reduction tuning
                                (and coordinate descent) on both sides, the GEMMs gemmtune's

Each side is compiled once per way, and every mode that times it reuses it. So a
gemmtune.compile side timed against both a default compile and max-autotune's was planned
before max-autotune compiled in the process, and one such run slowed after it: the same
gemmtune graph ran 3.53 ms per forward beside the default compile, then 4.38 ms beside
max-autotune's (docs/compile.md). Time the modes whose baseline is max-autotune's in their own
invocation; a run that mixes them says so.

With ``--profile`` each row also says where both sides' GPU time goes (``kernels``: ms per call
by kind of kernel, from torch.profiler over a few calls, and the costliest kernels).

A gemmtune.compile row also says what its graphs' GEMMs became (``compile_choices``: gemmtune's
log line per compiled graph, then its debug line per product: the way planned and each way's
kernel time), and how fast the host queued a library call just before its rounds
(``host_scale_at_rounds``, in the plan's units: the log line gives the speed it planned at).
A side compiled in a max-autotune mode also says what the compiler's own autotuning chose
(``autotuned``, by side: per GEMM it benchmarked, the op and its sizes, the chosen kernel, its
time and config, and the fastest library call it listed beside it, read from the report the
compiler writes to stderr).
With ``--caches DIR`` the gemmtune store and the compiler's caches live in DIR and stay on: run
twice, the second run's ``setup_s`` and ``baseline_setup_s`` are both sides' warm starts (a new
process, every cache filled).

``speedup = baseline_ms / gemmtune_ms`` is the median of the per-round ratios (a GPU machine's
host speed drifts by tens of percent within a run: only ratios timed side by side compare),
``spread`` half their interquartile range. In eager mode an untouched copy of the baseline is timed
as a third side in the same rounds: ``control`` (with ``control_spread``) is baseline / copy, the
ratio the method reads where nothing differs, so an eager speedup within it of 1.0 is noise (the
host-bound models' eager rounds time Python, whose speed varies with where objects lie); the
gemmtune-compile mode times such a copy too, compiled by default. ``rel_err`` = max|gemmtune - baseline| / max|baseline|
of the case's output (logits, last_hidden_state) in float32, in the same mode; ``ref_err`` and
``baseline_ref_err`` each side's against the case computed eagerly in float64 from the same
weights and inputs (inference cases; ``reference_error`` where a model cannot run so), and
``eager_ref_err`` the model's own uncompiled; with ``--check-products``, ``products``: the eager
step's GEMMs each checked against float64 from its own inputs (wrong ones, worst first). Per case, on the
eager step: ``gemms``, the GEMM calls gemmtune saw (every nn.Linear's and Conv1D's);
``gemms_kept``, those still going through gemmtune after ``optimize`` (whose check hands layers
that do not pay back to torch); ``gemms_served``, those of them a kernel other than cuBLAS serves
in eager calls (``served_by``: calls per backend, of a pair for eager calls and CUDA graphs the
eager kernel's); ``graph_only`` and ``eager_only``, the layers optimize's
check kept for one mode (torch's forward in the other: such a layer's calls are not in the
eager counts above when it is graph-only); ``optimize_said``, optimize's own log lines (what its
check read in each mode, with its noise, and what it kept); ``fused_kept``, the layers left
running an activation fused into their GEMM; ``gemm_flops_seen``, the seen GEMMs' FLOPs over those of every aten mm, addmm, bmm
and baddbmm of the same step (``GemmFlops``; attention inside SDPA and convolutions not counted).
Train cases (forward + backward of ``out.float().sum()``, the model in eval mode so that dropout
leaves the outputs comparable) run eager only. A failed mode is a row with ``error``; the JSON is
written after every case, and once ``--time-budget-s`` is spent the models and modes left are
listed under ``skipped``.

Cost on an H100: the default modes (eager, graph) take about 2.5 minutes for the whole zoo. Each
torch.compile mode adds both sides' cold compiles, 10-30 s per case (no FX graph cache: each side
pays its own); max-autotune-no-cudagraphs 100-150 s per case: run those on a few models per call.

    PYTHONPATH=src python3 benchmarks/models.py --out $OUT/models.json
    PYTHONPATH=src python3 benchmarks/models.py --models bert-base,llama --modes compile,reduce-overhead --out m.json
    PYTHONPATH=src python3 benchmarks/models.py --models seed-mlp,vit_base_patch16_224 --modes max-autotune-no-cudagraphs --out m.json
    PYTHONPATH=src python3 benchmarks/models.py --models timm:cait_xxs24_224@64,hf:albert@8x128 --out m.json  # outside the zoo
    PYTHONPATH=src python3 benchmarks/models.py --tiny --out /tmp/models-tiny.json   # smoke run, CPU too
    PYTHONPATH=src python3 benchmarks/models.py --list
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import gc
import importlib.metadata
import json
import logging
import math
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

# --modes name -> (how the baseline runs, how gemmtune's side runs)
MODES = {
    "eager": ("eager", "eager"),
    "graph": ("graph", "graph"),
    "compile": ("compile", "compile"),
    "reduce-overhead": ("reduce-overhead", "reduce-overhead"),
    "max-autotune-no-cudagraphs": ("max-autotune-no-cudagraphs", "compile"),
    "gemmtune-compile": ("compile", "gemmtune-compile"),
    "gemmtune-vs-max-autotune": ("max-autotune-no-cudagraphs", "gemmtune-compile"),
    "gemmtune-reduce-overhead": ("reduce-overhead", "gemmtune-reduce-overhead"),
    "gemmtune-max-autotune": ("max-autotune-no-cudagraphs", "gemmtune-max-autotune"),
}
COMPILE_MODE = {"compile": None, "reduce-overhead": "reduce-overhead",
                "max-autotune-no-cudagraphs": "max-autotune-no-cudagraphs",
                "gemmtune-compile": None, "gemmtune-reduce-overhead": "reduce-overhead",
                "gemmtune-max-autotune": "max-autotune-no-cudagraphs"}
DEFAULT_MODES = ("eager", "graph")
# the seconds a mode is left to start with: torch.compile's modes compile both sides first
RESERVE_S = {"eager": 10, "graph": 10, "compile": 60, "reduce-overhead": 60, "max-autotune-no-cudagraphs": 120,
             "gemmtune-compile": 60, "gemmtune-vs-max-autotune": 120, "gemmtune-reduce-overhead": 60,
             "gemmtune-max-autotune": 150}
# gemmtune.compile's ways: the model as it is, compiled by gemmtune
GEMMTUNE_COMPILE = ("gemmtune-compile", "gemmtune-reduce-overhead", "gemmtune-max-autotune")
# the modes whose rounds also time an untouched copy of the baseline (run the baseline's way):
# their host time varies with where objects lie, and the copy's ratio shows by how much
CONTROLLED = ("eager", "gemmtune-compile")  # max-autotune's mode not: its copy would tune 100-150 s more
MODEL_RESERVE_S = 20
ADDED_GEMMS = (torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default)  # (input, a, b): a product added
GEMMS = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, *ADDED_GEMMS)
WARMUP_CALLS = 3
SIDES = {"base": "the model without gemmtune", "control": "the model's untouched copy",
         "tuned": "the model through gemmtune.optimize", "plain": "the model through gemmtune.compile"}


# --------------------------------------------------------------------------------------------
# The zoo


@dataclass
class Case:
    """One model at one batch, dtype and phase. ``inputs(device, dtype)``: the keyword inputs both
    sides share; ``prepare(model, inputs)``: a copy's own keyword inputs (a filled KV cache),
    made before gemmtune touches the copy; ``positional``: the shared inputs in order are the
    model's positional arguments (``optimize(model, example_inputs)`` takes them); ``before(kwargs)``:
    what each step does first (rewinds the KV cache)."""

    model: str
    source: str
    batch: int
    seq: int | None  # tokens per sequence (decode: those already in the cache; Whisper: mel frames)
    dtype: torch.dtype
    phase: str
    inputs: Callable[[str, torch.dtype], dict]
    prepare: Callable[[nn.Module, dict], dict] | None = None
    positional: bool = True
    before: Callable[[dict], None] | None = None

    def kwargs(self, model: nn.Module, shared: dict) -> dict:
        return shared if self.prepare is None else self.prepare(model, shared)

    def label(self) -> str:
        seq = "" if self.seq is None else f"x{self.seq}"
        return f"{self.model} {self.phase} {self.batch}{seq} {dtype_name(self.dtype)}"


@dataclass
class Entry:
    """A model of the zoo: ``build(tiny)`` makes it (float32, on the current default device),
    ``cases(tiny)`` what is run on it."""

    source: str
    build: Callable[[bool], nn.Module]
    cases: Callable[[str, bool], list[Case]]
    about: str


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def images(batch: int, size: int) -> Callable[[str, torch.dtype], dict]:
    return lambda device, dtype: {"x": _randn((batch, 3, size, size), device, dtype)}


def tokens(batch: int, seq: int, vocab: int, *names: str) -> Callable[[str, torch.dtype], dict]:
    def make(device, dtype):
        gen = torch.Generator(device).manual_seed(0)
        return {name: torch.randint(0, vocab, (batch, seq), device=device, generator=gen) for name in names}

    return make


def _randn(shape, device, dtype) -> torch.Tensor:
    return torch.randn(shape, device=device, generator=torch.Generator(device).manual_seed(0)).to(dtype)


def timm_entry(name: str, batch: int, tiny: dict | Callable[[], nn.Module], train: bool = False) -> Entry:
    """``tiny``: the keyword arguments that make the model tiny, or where the model's own sizes
    cannot be overridden, a function that builds a tiny one of its class."""

    def build(is_tiny: bool) -> nn.Module:
        import timm

        if is_tiny and callable(tiny):
            return tiny()
        return timm.create_model(name, pretrained=False, **(tiny if is_tiny else {}))

    def cases(key: str, tiny: bool) -> list[Case]:
        b, size = (2, 32) if tiny else (batch, 224)
        phases = ("inference", "train") if train else ("inference",)
        return [Case(key, "timm", b, None, BF16, phase, images(b, size)) for phase in phases]

    return Entry("timm", build, cases, f"timm {name}, random weights, batch {batch} at 224x224"
                 + (" (+ a train step)" if train else ""))


def torchvision_vit_entry() -> Entry:
    """torchvision's ViT-B/16: its attention is ``nn.MultiheadAttention``, called for
    self-attention without attention weights (``gemmtune.nn.attention`` serves it)."""

    def build(tiny: bool) -> nn.Module:
        from torchvision.models.vision_transformer import VisionTransformer

        if tiny:
            return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=64,
                                     mlp_dim=128, num_classes=10)
        return VisionTransformer(image_size=224, patch_size=16, num_layers=12, num_heads=12, hidden_dim=768,
                                 mlp_dim=3072)

    def cases(key: str, tiny: bool) -> list[Case]:
        b, size = (2, 32) if tiny else (64, 224)
        return [Case(key, "torchvision", b, None, BF16, "inference", images(b, size))]

    return Entry("torchvision", build, cases, "torchvision ViT-B/16 (nn.MultiheadAttention), random weights, "
                 "batch 64 at 224x224")


def bert_entry() -> Entry:
    def build(tiny: bool) -> nn.Module:
        from transformers import BertConfig, BertModel

        config = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                            vocab_size=256, max_position_embeddings=64) if tiny else BertConfig()
        return BertModel(config)

    def cases(key: str, tiny: bool) -> list[Case]:
        b, s = (2, 16) if tiny else (32, 128)
        vocab = 256 if tiny else 30522
        return [Case(key, "transformers", b, s, dtype, phase, tokens(b, s, vocab, "input_ids"))
                for dtype, phase in ((BF16, "inference"), (FP16, "inference"), (BF16, "train"))]

    return Entry("transformers", build, cases, "BertModel, base config (12 x 768), 32 x 128 tokens: "
                 "bf16, fp16, and a bf16 train step")


def t5_entry() -> Entry:
    def build(tiny: bool) -> nn.Module:
        from transformers import T5Config, T5Model

        sizes = dict(d_model=64, d_ff=128, d_kv=32, num_layers=2, num_heads=2, vocab_size=256) if tiny else \
            dict(d_model=512, d_ff=2048, d_kv=64, num_layers=6, num_heads=8, vocab_size=32128)
        return T5Model(T5Config(**sizes, feed_forward_proj="relu"))

    def cases(key: str, tiny: bool) -> list[Case]:
        b, s = (2, 16) if tiny else (8, 128)
        vocab = 256 if tiny else 32128
        return [Case(key, "transformers", b, s, BF16, "inference",
                     tokens(b, s, vocab, "input_ids", "decoder_input_ids"), positional=False)]

    return Entry("transformers", build, cases, "T5Model, t5-small config: encoder and decoder, 8 x 128 tokens each")


def whisper_entry() -> Entry:
    def build(tiny: bool) -> nn.Module:
        from transformers import WhisperConfig, WhisperModel

        width, layers, heads, ffn, positions = (64, 2, 2, 128, 100) if tiny else (384, 4, 6, 1536, 1500)
        config = WhisperConfig(d_model=width, encoder_layers=layers, encoder_attention_heads=heads,
                               encoder_ffn_dim=ffn, decoder_layers=layers, decoder_attention_heads=heads,
                               decoder_ffn_dim=ffn, num_mel_bins=80, max_source_positions=positions,
                               vocab_size=51865)  # its special tokens' ids need the real vocabulary
        return WhisperModel(config).get_encoder()

    def cases(key: str, tiny: bool) -> list[Case]:
        b, frames = (2, 200) if tiny else (8, 3000)
        features = lambda device, dtype: {"input_features": _randn((b, 80, frames), device, dtype)}  # noqa: E731
        return [Case(key, "transformers", b, frames, BF16, "inference", features)]

    return Entry("transformers", build, cases, "WhisperModel's encoder, whisper-tiny sizes, 8 x 80 mel bins x 3000 frames")


def gpt2_entry() -> Entry:
    def build(tiny: bool) -> nn.Module:
        from transformers import GPT2Config, GPT2Model

        return GPT2Model(GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=64) if tiny else GPT2Config())

    def cases(key: str, tiny: bool) -> list[Case]:
        b, s = (2, 16) if tiny else (8, 256)
        return [Case(key, "transformers", b, s, BF16, "inference",
                     tokens(b, s, 50257, "input_ids"))]

    return Entry("transformers", build, cases, "GPT2Model, gpt2 (small) config, 8 x 256 tokens: "
                 "its projections are transformers' Conv1D (addmm), not nn.Linear")


def llama_entry() -> Entry:
    def build(tiny: bool) -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        if tiny:
            config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
        else:
            config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=8,
                                 num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                 max_position_embeddings=4096)
        return LlamaForCausalLM(config)

    def cases(key: str, tiny: bool) -> list[Case]:
        prompt = 16 if tiny else 512
        vocab = 256 if tiny else 32000
        prefill = Case(key, "transformers", 1, prompt, BF16, "prefill",
                       lambda device, dtype: tokens(1, prompt, vocab, "input_ids")(device, dtype) | {"use_cache": False},
                       positional=False)
        decode = [Case(key, "transformers", b, prompt, BF16, "decode", tokens(b, prompt, vocab, "prompt"),
                       prepare=filled_cache, positional=False, before=rewind) for b in ((1, 2) if tiny else (1, 16))]
        return [prefill, *decode]

    return Entry("transformers", build, cases, "LlamaForCausalLM, hidden 2048, 8 layers, 32 heads (8 KV), "
                 "vocab 32000: prefill 1 x 512, decode of one token at batch 1 and 16 on a 512-token static cache")


def filled_cache(model: nn.Module, shared: dict) -> dict:
    """The decode step's inputs for ``model``: its own static KV cache filled with the prompt,
    and one more token per sequence at the next position. Repeated, the step writes the same
    cache slot again: every call does the same work."""
    from transformers import StaticCache

    prompt = shared["prompt"]
    batch, length = prompt.shape
    cache = StaticCache(config=model.config, max_cache_len=length + 8)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, cache_position=torch.arange(length, device=prompt.device),
              use_cache=True)
    return {"input_ids": prompt[:, -1:].flip(0).contiguous(), "past_key_values": cache,
            "cache_position": torch.tensor([length], device=prompt.device), "use_cache": True}


def tiny_mixer() -> nn.Module:
    from timm.models.mlp_mixer import MlpMixer  # mixer_b16_224 fixes its sizes: the class itself

    return MlpMixer(img_size=32, patch_size=8, num_blocks=2, embed_dim=64, num_classes=10)


def rewind(kwargs: dict) -> None:
    """The static cache's length set back to the decode step's position, on the device (no sync,
    so a CUDA graph captures it): transformers releases whose StaticCache counts its length
    (``cumulative_length``) write each step at that count, not at ``cache_position``, and a
    repeated step would run off the cache's end."""
    for layer in getattr(kwargs["past_key_values"], "layers", ()):
        length = getattr(layer, "cumulative_length", None)
        if isinstance(length, torch.Tensor):
            length.copy_(kwargs["cache_position"][0])


def mlp_entry() -> Entry:
    def build(tiny: bool) -> nn.Module:
        width = 64 if tiny else 1024
        return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))

    def cases(key: str, tiny: bool) -> list[Case]:
        b, width = (8, 64) if tiny else (256, 1024)
        make = lambda device, dtype: {"input": _randn((b, width), device, dtype)}  # noqa: E731
        return [Case(key, "torch", b, None, dtype, "inference", make) for dtype in (BF16, FP32)]

    return Entry("torch", build, cases, "the seeds' MLP: Linear 1024->1024, ReLU, Linear 1024->1024 on 256 rows; "
                 "bf16 and fp32")


MODELS: dict[str, Entry] = {
    "seed-mlp": mlp_entry(),
    "vit_base_patch16_224": timm_entry("vit_base_patch16_224", 64, dict(
        img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=10), train=True),
    "deit_small_patch16_224": timm_entry("deit_small_patch16_224", 128, dict(
        img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=10)),
    "swin_tiny_patch4_window7_224": timm_entry("swin_tiny_patch4_window7_224", 64, dict(
        img_size=32, patch_size=4, window_size=4, embed_dim=32, depths=(1, 1), num_heads=(2, 4), num_classes=10)),
    "vit_b_16-torchvision": torchvision_vit_entry(),
    "convnext_tiny": timm_entry("convnext_tiny", 64, dict(depths=(1, 1, 1, 1), dims=(16, 32, 64, 128),
                                                          num_classes=10)),
    "mixer_b16_224": timm_entry("mixer_b16_224", 32, tiny_mixer),
    "bert-base": bert_entry(),
    "t5-small": t5_entry(),
    "whisper-tiny-encoder": whisper_entry(),
    "gpt2": gpt2_entry(),
    "llama": llama_entry(),
}


def named_entry(name: str) -> Entry:
    """A model outside the zoo, named as ``timm:NAME[@BATCH]`` (timm's model of that name, random
    weights, BATCH images at 224 x 224, default 32) or ``hf:MODEL_TYPE[@BATCHxSEQ]`` (transformers'
    base model of that type at its default configuration, random weights, BATCH x SEQ tokens,
    default 8 x 128): models no issue names, to check gemmtune where it was not built for. Their
    sizes are the libraries' own, tiny run or not. ValueError names what cannot be read."""
    source, _, rest = name.partition(":")
    key, _, size = rest.partition("@")
    if source not in ("timm", "hf") or not key:
        raise ValueError(f"{name!r}: a zoo model, timm:NAME[@BATCH] or hf:MODEL_TYPE[@BATCHxSEQ]")
    numbers = re.fullmatch(r"(\d+)" if source == "timm" else r"(\d+)x(\d+)", size) if size else None
    if size and (numbers is None or 0 in map(int, numbers.groups())):
        raise ValueError(f"{name!r}: the size after @ must be " + ("BATCH" if source == "timm" else "BATCHxSEQ")
                         + f" (positive integers), not {size!r}")
    if source == "timm":
        batch = int(numbers.group(1)) if numbers else 32
        return timm_entry(key, batch, {})
    batch, seq = map(int, numbers.groups()) if numbers else (8, 128)
    return hf_entry(key, batch, seq)


def hf_entry(model_type: str, batch: int, seq: int) -> Entry:
    @functools.cache
    def config():
        from transformers import AutoConfig

        return AutoConfig.for_model(model_type)

    def build(tiny: bool) -> nn.Module:
        from transformers import AutoModel

        return AutoModel.from_config(config())

    def cases(key: str, tiny: bool) -> list[Case]:
        vocab = config().vocab_size
        return [Case(key, "transformers", batch, seq, BF16, "inference", tokens(batch, seq, vocab, "input_ids"),
                     positional=False)]

    return Entry("transformers", build, cases, f"transformers {model_type}, default config, random weights, "
                 f"{batch} x {seq} tokens")


def entry_of(name: str) -> Entry:
    return MODELS[name] if name in MODELS else named_entry(name)


def built(entry: Entry, tiny: bool) -> nn.Module:
    """``entry``'s model, every ``nn.Linear`` whose weight is all zeros given random weights:
    timm zero-initialises some heads (Mixer-B's), whose logits are then zero on every side, and
    every error check reads 0 whatever the layers before computed."""
    model = entry.build(tiny)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, nn.Linear) and not layer.weight.detach().any():
                layer.weight.normal_(0.0, 0.02)
    return model


def probe_parser(doc: str, default: str) -> argparse.ArgumentParser:
    """A probe's command line: OUT.json, and ``--models`` (``default`` where not given)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--models", default=default)
    return parser


def probe_rows(out: str, names: str, probe: Callable[[Case, nn.Module, dict], dict]) -> None:
    """A probe's rows: ``probe(case, model, inputs)`` of each inference case of the
    comma-separated model ``names`` (the model built on the GPU in the case's dtype from seed 0,
    in eval mode; its inputs, the keyword inputs the case shares), written to ``out`` (JSON, with
    the device) after each, so that a run cut short keeps what it measured."""
    rows = []
    for name in names.split(","):
        for case, model, inputs in inference_models(name):
            rows.append(probe(case, model, inputs))
            with open(out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


def inference_models(name: str) -> Iterator[tuple[Case, nn.Module, dict]]:
    """Each inference case of zoo model ``name``: the case, its model built on the GPU in the
    case's dtype from seed 0 (eval mode), and the keyword inputs the case shares."""
    entry = entry_of(name)
    for case in entry.cases(name, False):
        if case.phase == "inference":
            torch.manual_seed(0)
            model = built(entry, False).to("cuda", case.dtype).eval()
            yield case, model, case.inputs("cuda", case.dtype)


# --------------------------------------------------------------------------------------------
# Running one side one way


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def first_tensor(out) -> torch.Tensor:
    """The tensor a model's output stands for: itself, a ModelOutput's logits or
    last_hidden_state, or a tuple's first."""
    if isinstance(out, torch.Tensor):
        return out
    for name in ("logits", "last_hidden_state"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(out, (tuple, list)) and out:
        return first_tensor(out[0])
    raise TypeError(f"cannot find the output tensor of a {type(out).__name__}")


def train_step(model: nn.Module, kwargs: dict) -> torch.Tensor:
    """One forward and backward of ``out.float().sum()``, the gradients set anew; the output."""
    for p in model.parameters():
        p.grad = None
    out = first_tensor(model(**kwargs))
    out.float().sum().backward()
    return out.detach()


def step_of(case: Case, forward: Callable, model: nn.Module, kwargs: dict) -> Callable[[], object]:
    if case.phase == "train":
        return lambda: train_step(model, kwargs)
    if case.before is not None:
        return lambda: (case.before(kwargs), forward(**kwargs))[1]
    return lambda: forward(**kwargs)


@dataclass
class Runner:
    """One side run one way: ``call`` for the timed loop, what its run computed (float32), and
    the seconds before its first timed call (warm-up, capture or compile)."""

    call: Callable[[], object]
    output: torch.Tensor
    setup_s: float
    said: list[str]  # what gemmtune's logger said meanwhile (INFO and up)
    autotuned: list[dict]  # what the compiler's own autotuning chose meanwhile (``autotune_report``)


def compiled(model: nn.Module, mode: str | None, gemmtune_compile: bool = False) -> Callable:
    """``torch.compile`` of a function of this side's own that calls ``model``. Dynamo keeps
    compiled code per code object, and both sides' forwards are one class's: the side compiled
    second would reuse the first one's code wherever their graphs agree (every layer handed back
    to torch) and its setup would read zero."""

    def forward(**kwargs):
        return model(**kwargs)

    forward.__code__ = forward.__code__.replace()  # a code object of its own
    if gemmtune_compile:
        import gemmtune

        return gemmtune.compile(forward, mode=mode)
    return torch.compile(forward, mode=mode)


def make_runner(way: str, case: Case, model: nn.Module, kwargs: dict, device: str) -> Runner:
    forward = model if way in ("eager", "graph") else compiled(model, COMPILE_MODE.get(way), way in GEMMTUNE_COMPILE)
    step = step_of(case, forward, model, kwargs)
    sync(device)
    t0 = time.perf_counter()
    with listening() as said, autotune_report() as autotuned:
        if way == "graph":
            call, out = captured(step)
        else:
            call = step
            for _ in range(WARMUP_CALLS):
                out = step()
        output = first_tensor(out).float().clone()  # before any other call: a graph's outputs are overwritten
        sync(device)
    return Runner(call, output, time.perf_counter() - t0, said, autotuned)


@contextlib.contextmanager
def listening() -> Iterator[list[str]]:
    """What the ``gemmtune`` logger says meanwhile, debug lines included (compiled graphs'
    choices and plans)."""
    said: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("gemmtune")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield said
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class _Tee:
    """A stream that writes through to ``stream`` and keeps what it was given."""

    def __init__(self, stream) -> None:
        self.stream, self.kept = stream, []

    def write(self, text: str) -> int:
        self.kept.append(text)
        return self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


@contextlib.contextmanager
def autotune_report() -> Iterator[list[dict]]:
    """What the compiler's own GEMM autotuning chose meanwhile, from the report it writes to
    stderr (still written there): ``autotuned_choices`` of it, filled when the block exits."""
    found: list[dict] = []
    tee = _Tee(sys.stderr)
    with contextlib.redirect_stderr(tee):
        try:
            yield found
        finally:
            found.extend(autotuned_choices("".join(tee.kept)))


AUTOTUNE_CANDIDATE = re.compile(r"^\s+(\S+) ([0-9.]+) ms ([0-9.]+)%\s*(.*)$")


def autotuned_choices(report: str) -> list[dict]:
    """Per ``AUTOTUNE op(sizes)`` block of the compiler's report: the op, the candidate it lists
    first (the chosen one: the list is fastest first) with its time and config, and the fastest
    library call listed (a candidate not named ``triton_*``), where one is."""
    found, block = [], None
    for line in report.splitlines():
        if line.startswith("AUTOTUNE ") and "(" in line:
            block = {"op": line[len("AUTOTUNE "):].strip(), "choice": None, "ms": None, "config": "",
                     "library": None, "library_ms": None}
            found.append(block)
            continue
        candidate = AUTOTUNE_CANDIDATE.match(line)
        if block is None or candidate is None:
            continue
        name, ms, _, config = candidate.groups()
        if block["choice"] is None:
            block.update(choice=name, ms=float(ms), config=config.strip())
        if block["library"] is None and not name.startswith("triton_"):
            block.update(library=name, library_ms=float(ms))
    return found


def captured(step: Callable[[], object]) -> tuple[Callable[[], object], object]:
    """``step`` as a CUDA graph (after warm-up calls on a side stream): its replay, and the
    static output the replay writes, already computed once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_CALLS):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    return graph.replay, out


def float64_output(case: Case, base: nn.Module, shared: dict) -> tuple[torch.Tensor | None, str | None]:
    """The case's output computed eagerly in float64 from the same weights and inputs (as
    float32, which every side's output is compared in), or None and why it could not be."""
    if case.phase == "train":
        return None, None
    try:
        with torch.no_grad():
            model = copy.deepcopy(base).double()
            inputs = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                      for k, v in shared.items()}
            out = first_tensor(step_of(case, model, model, case.kwargs(model, inputs))())
            return out.double().float(), None
    except Exception as exc:  # noqa: BLE001 - a model that does not run in float64 has no such check
        return None, f"{type(exc).__name__}: {exc}"[:300]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item()
    return float((out - ref).abs().max().item() / scale) if scale else float((out - ref).abs().max().item())


def grad_rel_err(tuned: nn.Module, base: nn.Module) -> float | None:
    """The largest rel_err of a parameter's gradient (after both sides' last train step)."""
    ref = {name: p.grad for name, p in base.named_parameters() if p.grad is not None}
    errors = [rel_err(p.grad.float(), ref[name].float()) for name, p in tuned.named_parameters()
              if p.grad is not None and name in ref and p.grad.shape == ref[name].shape]
    return max(errors) if errors else None


# --------------------------------------------------------------------------------------------
# Timing


def loop_ms(call: Callable[[], object], calls: int, device: str) -> float:
    """Milliseconds per call of ``calls`` calls queued back to back (no sync between them),
    started on an idle device: CUDA events around the loop on the GPU, the wall clock on the CPU."""
    sync(device)
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - t0) * 1e3 / calls


def paired_rounds(base: Callable, tuned: Callable, rounds: int, round_ms: float, device: str,
                  control: Callable | None = None) -> dict:
    """Both sides timed in ``rounds`` interleaved rounds (each round starts with the next side in
    turn), each a loop of the same number of calls filling about ``round_ms``. ``control``: an
    untouched copy of the baseline timed as a third side, whose ratio (``control``, 1.0 ideally)
    is what the method reads where nothing differs: the floor under which a speedup is noise."""
    per_call = max(min(loop_ms(base, 1, device) for _ in range(3)), 1e-3)
    calls = max(1, min(2000, round(round_ms / per_call)))
    sides = [("base", base), ("tuned", tuned)] + ([("control", control)] if control is not None else [])
    times: dict[str, list[float]] = {name: [] for name, _ in sides}
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for i in range(rounds):
            for side, call in sides[i % len(sides):] + sides[:i % len(sides)]:
                times[side].append(loop_ms(call, calls, device))
    finally:
        if gc_was:
            gc.enable()
    result = {"baseline_ms": statistics.median(times["base"]), "gemmtune_ms": statistics.median(times["tuned"]),
              "rounds": rounds, "calls_per_round": calls}
    result["speedup"], result["spread"] = ratio_of(times["base"], times["tuned"])
    if control is not None:
        result["control"], result["control_spread"] = ratio_of(times["base"], times["control"])
    return result


# kinds of GPU kernel, by name: the first whose marks a kernel's name holds (lowercase). The
# compiler names a kernel after the ops fused into it (a layer norm's reduction that reads a
# convolution's output holds "convolution"), and cuDNN names its convolutions' implicit GEMMs
# ("xmma_fprop_implicit_gemm"), so its pointwise kernels and convolutions are told first
KERNEL_KINDS = (("convolution template", ("triton_tem_fused_convolution",)),
                ("gemm template", ("triton_tem",)),
                ("compiled pointwise/reduction", ("triton_poi", "triton_red", "triton_per")),
                ("gemmtune", ("tiled_matmul", "splitk_matmul", "stream_matmul", "persistent_matmul", "pad_copy")),
                ("attention", ("flash", "fmha", "attention", "sdpa")),
                ("convolution", ("conv", "fprop", "dgrad", "wgrad")),
                ("library gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "gemv", "sm90_", "sm80_",
                                  "splitkreduce")),
                ("compiled pointwise/reduction", ("triton_",)),
                ("other", ("",)))


def kernel_kind(name: str) -> str:
    """The kind of the GPU kernel called ``name`` (KERNEL_KINDS)."""
    return next(kind for kind, marks in KERNEL_KINDS if any(m in name.lower() for m in marks))


def profiled(call: Callable[[], object], calls: int = 5) -> tuple[Counter, Counter]:
    """GPU ms and launches per call of each kernel name ``call`` runs, from torch.profiler over
    ``calls`` calls after one unprofiled."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    per_kernel: Counter = Counter()
    launches: Counter = Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.time_range.elapsed_us() / 1e3 / calls
            launches[event.name] += 1 / calls
    return per_kernel, launches


def kernel_times(call: Callable[[], object], calls: int = 5, top: int = 8) -> dict:
    """Where ``call``'s GPU time goes: ms and kernels per call by kind of kernel (KERNEL_KINDS)
    and its ``top`` costliest kernels (what a host model of a compiled graph needs: its launches
    and their GPU time)."""
    per_kernel, launches = profiled(call, calls)
    kinds: Counter = Counter()
    for name, ms in per_kernel.items():
        kinds[kernel_kind(name)] += ms
    counts: Counter = Counter()
    for name, n in launches.items():
        counts[kernel_kind(name)] += n
    return {"total_ms": sum(per_kernel.values()), "by_kind_ms": dict(kinds.most_common()),
            "kernels_per_call": sum(launches.values()), "by_kind_kernels": dict(counts.most_common()),
            "top": [[name[:120], ms] for name, ms in per_kernel.most_common(top)]}


def ratio_of(base: list[float], other: list[float]) -> tuple[float, float]:
    """The median of the per-round ratios base / other, and half their interquartile range."""
    ratios = [b / o for b, o in zip(base, other)]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return statistics.median(ratios), (q3 - q1) / 2


# --------------------------------------------------------------------------------------------
# gemmtune's side: setup, and what it saw and serves


def grad_mode(case: Case):
    return torch.enable_grad() if case.phase == "train" else torch.no_grad()


def tune_side(case: Case, base: nn.Module, shared: dict, residual: bool = False) -> tuple[nn.Module, dict, float,
                                                                                        list[str]]:
    """A copy of ``base`` through ``gemmtune.optimize`` on this case's inputs (``residual``: its
    option of that name), every GEMM of a train step's backward tuned too; the copy, its inputs, the
    seconds it took, and what optimize said of its check (its log lines: the verdict per mode, with
    each ratio and its noise)."""
    import gemmtune
    from gemmtune.nn import tune_calls

    tuned = copy.deepcopy(base)
    kwargs = case.kwargs(tuned, shared)
    device = next(tuned.parameters()).device.type
    sync(device)
    t0 = time.perf_counter()
    with optimize_said() as said:
        if case.phase == "train":  # optimize sees a model being trained (its check times a train step too),
            tuned.train()            # timed after in eval mode as the baseline is (dropout off)
        if case.positional:
            gemmtune.optimize(tuned, tuple(kwargs.values()), residual=residual)
        else:
            gemmtune.optimize(tuned, residual=residual)
            tune_calls(step_of(case, tuned, tuned, kwargs))
    tuned.eval()
    if case.phase == "train":  # optimize runs the example without gradients: the backward's GEMMs
        tune_recorded(lambda: train_step(tuned, kwargs))
    sync(device)
    return tuned, kwargs, time.perf_counter() - t0, said


@contextlib.contextmanager
def optimize_said() -> Iterator[list[str]]:
    """The messages of the ``gemmtune`` logger that ``optimize`` logs as ``gemmtune.optimize: ...``
    while the block runs, whatever the logger's level."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("gemmtune.optimize:"):
                said.append(message)

    logger, handler = logging.getLogger("gemmtune"), Keep(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    if not logger.isEnabledFor(logging.INFO):
        logger.setLevel(logging.INFO)
    try:
        yield said
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def tune_recorded(run: Callable[[], object]) -> None:
    """Record the GEMMs ``run()`` performs (served by cuBLAS meanwhile) and tune those not stored
    yet, as ``optimize`` does with its example; nothing is tuned without a GPU."""
    import gemmtune
    from gemmtune.device import current
    from gemmtune.serving import recording
    from gemmtune.serving.dispatch import DISPATCHER

    with recording.record() as seen, DISPATCHER.deferring():
        run()
    if not current().interpreter:
        gemmtune.tune([problem for problem, _ in seen.problems()])


def recorded(case: Case, model: nn.Module, kwargs: dict, deferring: bool) -> list:
    """(problem, calls) of each GEMM gemmtune performs in one step of ``model``; ``deferring``:
    served by cuBLAS, nothing tuned or kept."""
    import contextlib

    from gemmtune.serving import recording
    from gemmtune.serving.dispatch import DISPATCHER

    with recording.record() as seen, DISPATCHER.deferring() if deferring else contextlib.nullcontext(), \
            grad_mode(case):
        step_of(case, model, model, kwargs)()
    return seen.problems()


def seen_gemms(case: Case, base: nn.Module, shared: dict) -> tuple[int, float]:
    """The GEMM calls per step, and their FLOPs, that gemmtune sees in this case: every
    ``nn.Linear``'s, recorded on a copy whose layers are all gemmtune's (``optimize`` without
    an example: nothing tuned, nothing handed back; no layer padded, so that the FLOPs are the
    model's own)."""
    import gemmtune

    probe = copy.deepcopy(base)
    kwargs = case.kwargs(probe, shared)
    gemmtune.optimize(probe, align=False)
    problems = recorded(case, probe, kwargs, deferring=True)
    del probe, kwargs
    return sum(c for _, c in problems), float(sum(2 * p.m * p.n * p.k * c for p, c in problems))


def served_by(case: Case, tuned: nn.Module, kwargs: dict) -> Counter:
    """GEMM calls per step of the optimized model by the backend of the kernel serving them:
    ``torch`` for a layer ``optimize`` handed back to torch or a call gemmtune does not serve
    (CPU tensors); a backend's name (``cublas``: gemmtune's cuBLAS path) otherwise."""
    from gemmtune.serving.dispatch import DISPATCHER, DispatchKey

    calls = recorded(case, tuned, kwargs, deferring=False)
    index = torch.cuda.current_device() if torch.cuda.is_available() else None
    by = Counter()
    for problem, count in calls:
        by[backend_of(DISPATCHER.kernels.get(DispatchKey.of(problem, index)))] += count
    return by


def residual_fused(tuned: nn.Module) -> list[int]:
    """How many of the model's residual adds (``optimize(residual=True)``) cuBLASLt fuses into the
    GEMM before them for some row count, and of how many found."""
    from gemmtune.nn import residual

    return list(residual.fused(tuned))


def fused_kept(tuned: nn.Module) -> int:
    """The layers of the optimized model that still run an activation fused into their GEMM."""
    return sum(1 for m in tuned.modules() if getattr(m, "fused", None) is not None and m.activation != "none")


def one_mode(tuned: nn.Module, torch_when_capturing: bool) -> int:
    """The layers of the optimized model that run torch's forward while a CUDA graph is captured
    (True: gemmtune's in eager only) or outside captures (False: gemmtune's in graphs only)."""
    return sum(1 for m in tuned.modules() if getattr(m, "torch_when_capturing", None) is torch_when_capturing)


def backend_of(kernel) -> str:
    """The backend a built kernel comes from: the module of its class or function
    (``gemmtune.backends.<name>``); cuBLAS's kernels are functions of ``gemmtune.backends.cublas``.
    Of a pair serving eager calls and CUDA graphs apart (``ByMode``), the eager kernel's: what an
    eager call runs."""
    from gemmtune.serving.modes import ByMode

    if kernel is None:
        return "torch"
    if isinstance(kernel, ByMode):
        return backend_of(kernel.eager)
    module = getattr(kernel, "__module__", None) or type(kernel).__module__
    return module.rsplit(".", 1)[-1] if module.startswith("gemmtune.backends.") else module


class GemmFlops(TorchDispatchMode):
    """The FLOPs of every mm, addmm, bmm and baddbmm run meanwhile: twice each product's
    multiply-adds (its first factor's elements times the output's columns). torch's
    FlopCounterMode counts them too, but the module tracking it always does fails on some
    forwards (timm's CaiT under no_grad: a hook finds no gradient function)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in GEMMS:
            first = args[1] if func in ADDED_GEMMS else args[0]
            self.flops += 2.0 * first.numel() * out.shape[-1]
        return out


def all_gemm_flops(case: Case, base: nn.Module, kwargs: dict) -> float:
    """The FLOPs of every aten mm, addmm, bmm and baddbmm in one step of the baseline."""
    # nn.MultiheadAttention's fast path (eval, no grad) runs its projections inside one fused op
    # that the count does not see: torchvision's ViT-B read 1.5 of its GEMM FLOPs seen with it
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with GemmFlops() as counter, grad_mode(case):
            step_of(case, base, base, kwargs)()
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    return counter.flops


class ProductCheck(TorchDispatchMode):
    """Every mm, addmm, bmm and baddbmm run meanwhile recomputed in float64 from its own inputs:
    ``wrong`` lists those whose result is off by more than ``bound`` (a right bf16 product of
    these sizes is off by about 2e-3), worst first, with their sizes."""

    def __init__(self, bound: float = 0.05) -> None:
        super().__init__()
        self.bound, self.checked, self.wrong = bound, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in GEMMS and out.is_floating_point():
            wide = [a.double() if isinstance(a, torch.Tensor) else a for a in args]
            expected = func(*wide, **(kwargs or {}))
            self.checked += 1
            err = rel_err(out.double(), expected)
            if not err <= self.bound:  # NaN too
                self.wrong.append({"op": str(func.overloadpacket.__name__), "err": err,
                                   "sizes": [list(a.shape) for a in args if isinstance(a, torch.Tensor)]})
        return out


def checked_products(case: Case, base: nn.Module, kwargs: dict) -> dict:
    """One eager step of the baseline with every product checked against float64
    (``ProductCheck``): how many were checked, how many were wrong, the five worst."""
    with torch.no_grad(), ProductCheck() as check:
        step_of(case, base, base, kwargs)()
    worst = sorted(check.wrong, key=lambda w: -w["err"] if w["err"] == w["err"] else -math.inf)
    return {"checked": check.checked, "wrong": len(check.wrong), "worst": worst[:5]}


# --------------------------------------------------------------------------------------------
# One case


class Budget:
    def __init__(self, seconds: float) -> None:
        self.seconds, self.start = seconds, time.perf_counter()

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)


def identity(case: Case) -> dict:
    return {"model": case.model, "source": case.source, "batch": case.batch, "seq": case.seq,
            "dtype": dtype_name(case.dtype), "phase": case.phase}


def case_modes(case: Case, modes: list[str]) -> list[str]:
    return ["eager"] if case.phase == "train" and "eager" in modes else [] if case.phase == "train" else modes


def fresh_compiler() -> None:
    """The compiler's in-process state dropped, as in a new process. Its automatic dynamic shapes
    key a frame's input sizes by source line, not by code object: without this, every model
    compiled after the first whose input of the same name has other sizes was compiled with a
    symbolic size there, on both sides (``compiled``'s functions all come from one line)."""
    import torch._dynamo

    torch._dynamo.reset()


def run_case(case: Case, master: nn.Module, modes: list[str], args, budget: Budget, skipped: list,
             emit: Callable[[dict], None]) -> None:
    device = next(master.parameters()).device.type
    modes = case_modes(case, modes)
    if not modes:
        return
    fresh_compiler()  # each case's sides compiled as a user's first compile of the model
    with grad_mode(case):
        base = copy.deepcopy(master).to(case.dtype).eval()
        shared = case.inputs(device, case.dtype)
        base_kwargs = case.kwargs(base, shared)
    try:  # the model's own step first: where it fails, the row says so
        flops_all = all_gemm_flops(case, base, base_kwargs)
    except Exception as exc:
        raise RuntimeError(f"{SIDES['base']}, eager: {type(exc).__name__}: {exc}") from exc
    gemms, flops_seen = seen_gemms(case, base, shared)
    common = identity(case) | {"gemms": gemms, "gemm_gflop": flops_all / 1e9,
                               "gemm_flops_seen": flops_seen / flops_all if flops_all else None}
    sides = {"base": (base, base_kwargs)}
    tune_s = 0.0
    if any(MODES[m][1] not in GEMMTUNE_COMPILE for m in modes):  # a mode times optimize's side
        tuned, tuned_kwargs, tune_s, said = tune_side(case, base, shared, args.residual)
        by = served_by(case, tuned, tuned_kwargs)
        common |= {"tune_s": tune_s, "optimize_said": said, "served_by": dict(by), "fused_kept": fused_kept(tuned),
                   "graph_only": one_mode(tuned, False), "eager_only": one_mode(tuned, True),
                   "residual_fused": residual_fused(tuned),
                   "gemms_served": sum(c for b, c in by.items() if b not in ("torch", "cublas")),
                   "gemms_kept": sum(c for b, c in by.items() if b != "torch")}
        sides["tuned"] = (tuned, tuned_kwargs)
    if any(MODES[m][1] in GEMMTUNE_COMPILE for m in modes):  # gemmtune.compile's side: the model as it is
        with grad_mode(case):
            plain = copy.deepcopy(base)
            sides["plain"] = (plain, case.kwargs(plain, shared))
    reference, reference_error = float64_output(case, base, shared)
    if reference_error is not None:
        common["reference_error"] = reference_error
    if reference is not None:  # the model uncompiled: is eager right, and which products are not
        with torch.no_grad():
            common["eager_ref_err"] = rel_err(first_tensor(step_of(case, base, base, base_kwargs)()).float(), reference)
        if args.check_products:
            common["products"] = checked_products(case, base, base_kwargs)
    runners: dict[tuple[str, str], Runner] = {}
    if any(m in CONTROLLED for m in modes):  # the control side: host-bound rounds only
        with grad_mode(case):
            control = copy.deepcopy(base)
            sides["control"] = (control, case.kwargs(control, shared))

    def runner(side: str, way: str) -> Runner:
        if (side, way) not in runners:
            try:
                runners[side, way] = make_runner(way, case, *sides[side], device)
            except Exception as exc:  # the row says which side failed: the model without gemmtune, or with it
                raise RuntimeError(f"{SIDES[side]}, {way}: {type(exc).__name__}: {exc}") from exc
        return runners[side, way]

    for mode in modes:
        base_way, tuned_way = MODES[mode]
        row = common | {"mode": tuned_way, "baseline": base_way}
        if budget.left() < RESERVE_S[mode]:
            skipped.append(f"{case.label()} {mode} (time budget)")
            continue
        if device != "cuda" and mode != "eager":
            emit(row | {"error": "needs CUDA"})
            continue
        try:
            with grad_mode(case):
                b = runner("base", base_way)
                t = runner("plain" if tuned_way in GEMMTUNE_COMPILE else "tuned", tuned_way)
                c = runner("control", base_way).call if mode in CONTROLLED else None  # graphs: no host noise
                if tuned_way in GEMMTUNE_COMPILE and device == "cuda":  # beside the plan's own measure
                    from gemmtune.inductor.choices import host_scale

                    row["host_scale_at_rounds"] = host_scale(torch.cuda.current_device())
                timing = paired_rounds(b.call, t.call, args.rounds, args.round_ms, device, control=c)
            row |= timing | {"setup_s": t.setup_s + (0 if tuned_way in GEMMTUNE_COMPILE else tune_s),
                             "baseline_setup_s": b.setup_s,
                             "rel_err": rel_err(t.output, b.output)}
            if reference is not None:  # each side against float64: which one is wrong, where they differ
                row["ref_err"], row["baseline_ref_err"] = rel_err(t.output, reference), rel_err(b.output, reference)
            if tuned_way in GEMMTUNE_COMPILE:
                row["compile_choices"] = [line for line in t.said if "compiled graph" in line
                                          or line.startswith("gemmtune: planned")]
            autotuned = {side: r.autotuned for side, r in (("baseline", b), ("gemmtune", t)) if r.autotuned}
            if autotuned:
                row["autotuned"] = autotuned
            if args.profile and device == "cuda":
                row["kernels"] = {"baseline": kernel_times(b.call), "gemmtune": kernel_times(t.call)}
            if case.phase == "train":
                row["grad_rel_err"] = grad_rel_err(sides["tuned"][0], base)
        except Exception as exc:  # noqa: BLE001 - a mode that fails is a row saying why
            traceback.print_exc(file=sys.stderr)
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        emit(row)


# --------------------------------------------------------------------------------------------
# The run


def print_row(row: dict) -> None:
    what = f"{row['model']} {row['phase']} b={row['batch']} {row['dtype']}"
    head = f"{what:44s} {row['mode']:16s} vs {row['baseline']:27s}"
    if "error" in row:
        print(f"{head} ERROR {row['error'][:200]}", file=sys.stderr, flush=True)
        return
    seen = row["gemm_flops_seen"]
    print(f"{head} {row['baseline_ms']:9.3f} / {row['gemmtune_ms']:9.3f} ms  x{row['speedup']:.3f} "
          f"+-{row['spread']:.3f}  setup {row['setup_s']:.1f}/{row['baseline_setup_s']:.1f} s  "
          f"err {row['rel_err']:.1e}"
          + (f" (vs fp64 {row['baseline_ref_err']:.1e}/{row['ref_err']:.1e})" if "ref_err" in row else "") + "  "
          f"gemms {row.get('gemms_served', '-')}/{row.get('gemms_kept', '-')}/{row['gemms']}  "
          + (f"layers graph-only {row['graph_only']} eager-only {row['eager_only']}  "
             if row.get("graph_only") or row.get("eager_only") else "")
          +           f"flops seen {'-' if seen is None else f'{seen:.3f}'}"
          + (f"  A/A x{row['control']:.3f} +-{row['control_spread']:.3f}" if "control" in row else ""),
          file=sys.stderr, flush=True)


def header(device: str, args) -> dict:
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    import gemmtune

    gpu = torch.cuda.get_device_properties(0) if device == "cuda" else None
    return {"kind": "models", "device": gpu.name if gpu else "cpu", "sm_count": gpu.multi_processor_count if gpu else None,
            "torch": torch.__version__, "triton": version("triton"), "gemmtune": gemmtune.__version__,
            "timm": version("timm"), "transformers": version("transformers"),
            "quack": version("quack-kernels"), "cutlass_dsl": version("nvidia-cutlass-dsl"),  # the cute backend's
            "date": datetime.date.today().isoformat(),
            "timings": "GPU" if device == "cuda" else
            "CPU: no CUDA GPU, so these are CPU timings of a smoke run, NOT GPU timings",
            "tiny": args.tiny, "residual": args.residual, "rounds": args.rounds, "round_ms": args.round_ms,
            "time_budget_s": args.time_budget_s,
            "store": os.environ["GEMMTUNE_CACHE_DIR"], "fresh_store": args.store is None,
            "caches": None if args.caches is None else str(args.caches), "dtypes": args.dtypes or None,
            "models": args.models, "modes": args.modes, "skipped": [], "rows": []}


def throwaway_compile(device: str) -> float:
    """Inductor's start-up (its compile workers, Triton's driver build) paid before any mode, so
    it lands on no baseline's setup."""
    t0 = time.perf_counter()
    torch.compile(lambda x: torch.relu(x) * 2)(torch.randn(64, device=device))
    sync(device)
    return time.perf_counter() - t0


def cold_compiles() -> None:
    """Each torch.compile pays its own compile: no FX graph or AOT autograd cache hit on the
    other side's identical graph (Triton's kernel cache stays shared within the run)."""
    import torch._functorch.config
    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = False
    if hasattr(torch._functorch.config, "enable_autograd_cache"):
        torch._functorch.config.enable_autograd_cache = False


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog="models: " + ", ".join(MODELS) + ". modes: " + ", ".join(MODES) + ".",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="the JSON file to write (after every case)")
    parser.add_argument("--models", default=",".join(MODELS),
                        help="comma-separated models to run, in this order (default: the zoo; --list shows it); "
                             "also timm:NAME[@BATCH] or hf:MODEL_TYPE[@BATCHxSEQ], models outside the zoo")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help=f"comma-separated modes (default: {','.join(DEFAULT_MODES)}; any of {', '.join(MODES)}; "
                             "'all' for every one). Each torch.compile mode costs about a minute per model")
    parser.add_argument("--dtypes", default="",
                        help="comma-separated dtypes whose cases run (bfloat16, float16, float32; default: "
                             "every case's)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds per mode (default 15)")
    parser.add_argument("--round-ms", type=float, default=None,
                        help="time each side's loop fills per round (default 100 ms; 20 with --tiny)")
    parser.add_argument("--time-budget-s", type=float, default=480.0,
                        help="after this many seconds the models and modes left are skipped and listed (default 480)")
    parser.add_argument("--tiny", action="store_true", help="tiny configs of every model: a smoke run, CPU too")
    parser.add_argument("--residual", action="store_true",
                        help="optimize(residual=True): residual adds in the epilogue of the GEMM before them")
    parser.add_argument("--store", help="use this gemmtune store directory (GEMMTUNE_CACHE_DIR) instead of a "
                                        "fresh one: setup_s is then warm")
    parser.add_argument("--caches", type=Path,
                        help="keep the gemmtune store and the compiler's caches (FX graph, AOT autograd, Triton) in "
                             "this directory, caches on: a second run's setup_s and baseline_setup_s are warm starts")
    parser.add_argument("--check-products", action="store_true",
                        help="also run each case's eager step with every mm, addmm, bmm and baddbmm checked against "
                             "float64 from its own inputs: the wrong products, worst first")
    parser.add_argument("--profile", action="store_true",
                        help="also profile both sides of every row: their GPU time by kind of kernel (GPU only)")
    parser.add_argument("--list", action="store_true", help="print the models and their cases, then exit")
    args = parser.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = [d for d in args.dtypes if d not in ("bfloat16", "float16", "float32")]
    if unknown:
        parser.error(f"--dtypes: unknown {', '.join(unknown)}; accepted: bfloat16, float16, float32")
    if args.caches is not None and args.store is not None:
        parser.error("--caches holds the store too: give --caches or --store, not both")
    args.models = [m for m in args.models.split(",") if m]
    args.modes = list(MODES) if args.modes == "all" else [m for m in args.modes.split(",") if m]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}; accepted: {', '.join(MODES)}")
    for name in args.models:
        if name not in MODELS:
            try:
                named_entry(name)
            except ValueError as exc:
                parser.error(f"--models: {exc}; the zoo: {', '.join(MODELS)}")
    if args.round_ms is None:
        args.round_ms = 20.0 if args.tiny else 100.0
    if args.out is None and not args.list:
        parser.error("--out is required (unless --list)")
    return args


def list_models() -> None:
    for name, entry in MODELS.items():
        print(f"{name}: {entry.about}")
        for case in entry.cases(name, False):
            print(f"    {case.label()}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        list_models()
        return 0
    scratch = tempfile.mkdtemp(prefix="gemmtune-models-")
    if args.caches is not None:  # warm starts on a second run: every cache kept, and on
        args.store = str(args.caches / "store")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(args.caches / "inductor")
        os.environ["TRITON_CACHE_DIR"] = str(args.caches / "triton")
    os.environ["GEMMTUNE_CACHE_DIR"] = args.store or os.path.join(scratch, "store")  # before gemmtune is imported
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(scratch, "inductor"))  # both sides cold
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # several models' forwards compiled in several modes: room for every one under dynamo
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 64))
    if args.caches is None:
        cold_compiles()
    doc = header(device, args)
    if device != "cuda":
        print("no CUDA GPU: eager rows only, CPU timings (NOT GPU timings)", file=sys.stderr)
    elif any(m not in ("eager", "graph") for m in args.modes):
        doc["compile_warmup_s"] = throwaway_compile(device)
    baselines = {way: {MODES[m][0] for m in args.modes if MODES[m][1] == way} for way in GEMMTUNE_COMPILE}
    if any(len(b) > 1 and "max-autotune-no-cudagraphs" in b for b in baselines.values()):
        logging.getLogger(__name__).warning(
            "gemmtune.compile's side is timed against max-autotune and another baseline in one process: "
            "it is planned once, before max-autotune's compile, and times after it may not compare "
            "(see this file's docstring)")
    budget = Budget(args.time_budget_s)
    started = time.perf_counter()

    def emit(row: dict) -> None:
        doc["rows"].append(row)
        print_row(row)

    def save() -> None:
        doc["wall_s"] = time.perf_counter() - started
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")

    for name in args.models:
        if budget.left() < MODEL_RESERVE_S:
            doc["skipped"].append(f"{name} (time budget)")
            continue
        run_model(name, args, device, budget, doc["skipped"], emit, save)
    save()
    print(f"wrote {args.out}: {len(doc['rows'])} rows in {doc['wall_s']:.0f} s"
          + (f"; skipped: {', '.join(doc['skipped'])}" if doc["skipped"] else ""), file=sys.stderr)
    return 0


def run_model(name: str, args, device: str, budget: Budget, skipped: list, emit, save) -> None:
    """Every case of one model, then the file written; a failure outside a mode is a row for
    each mode of the case it struck."""
    entry = entry_of(name)
    t0 = time.perf_counter()
    cases = [c for c in entry.cases(name, args.tiny) if not args.dtypes or dtype_name(c.dtype) in args.dtypes]
    master = None
    for case in cases:
        try:
            if master is None:
                torch.manual_seed(0)
                with torch.device(device):
                    master = built(entry, args.tiny).eval()
            run_case(case, master, args.modes, args, budget, skipped, emit)
        except Exception as exc:  # noqa: BLE001 - one model's failure must not end the run
            traceback.print_exc(file=sys.stderr)
            for mode in case_modes(case, args.modes):
                emit(identity(case) | {"mode": MODES[mode][1], "baseline": MODES[mode][0],
                                       "error": f"{type(exc).__name__}: {exc}"[:500]})
        finally:
            release(device)
        save()
    print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def release(device: str) -> None:
    """Drop a case's compiled code and graphs before the next one."""
    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
