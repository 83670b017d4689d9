"""Shape sets: the public benchmark shapes shipped with the package, and the loader for files
of the same format (``{"shapes": [{"name", "m", "n", "k", "dtype", "layout", "group"}]}``, with
optional ``bias``, ``activation``, ``tf32`` and ``count``, for fp8 products ``scaling`` and
``out_dtype``, and for a batched product (torch.bmm) ``batch``), or JSON Lines of such entries (the misses that
``GEMMTUNE_MISSES`` collects in lookup mode). A misses file also holds the calls of
``gemmtune.autotune`` kernels that missed (``"kind": "kernel"``, ``kernel_calls``), which ``load``
passes over."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from gemmtune.problem import Problem

log = logging.getLogger("gemmtune")

KERNEL_CALL = "kernel"  # the "kind" of a misses file's line that records a kernel's call


@dataclass(frozen=True)
class NamedProblem:
    name: str
    group: str
    problem: Problem


def load(path: str | Path | None = None, *, tf32: bool = True) -> list[NamedProblem]:
    """Read a shapes file; ``None`` reads the public shapes. fp32 entries use TF32 if ``tf32``,
    unless the entry says itself (recorded files do)."""
    if path is None:
        text = resources.files(__package__).joinpath("public.json").read_text()
        source = "public.json"
    else:
        text = Path(path).read_text()
        source = str(path)
    try:
        entries = _entries(text)
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{source}: not a shapes file (expected {{\"shapes\": [...]}} or one JSON "
                         f"object per line): {exc}") from None
    out = []
    for i, entry in enumerate(entries):
        if isinstance(entry, dict) and entry.get("kind") == KERNEL_CALL:
            continue  # a kernel's call (kernel_calls), not a GEMM
        try:
            problem = Problem(entry["m"], entry["n"], entry["k"], entry.get("dtype", "bfloat16"),
                              entry.get("layout", "linear"), bool(entry.get("bias", False)),
                              bool(entry.get("tf32", tf32)), entry.get("activation", "none"),
                              entry.get("scaling", "none"), entry.get("out_dtype", ""), entry.get("batch", 1))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}: shape #{i} ({entry!r}) is invalid: {exc}") from None
        out.append(NamedProblem(entry.get("name", problem.describe()), entry.get("group", ""), problem))
    return out


def entry(problem: Problem) -> dict:
    """``problem`` as one entry of a shapes file: what ``load`` reads back as the same Problem."""
    line = {"name": problem.describe(), "m": problem.m, "n": problem.n, "k": problem.k, "dtype": problem.dtype,
            "layout": problem.layout, "bias": problem.bias, "tf32": problem.tf32, "activation": problem.activation}
    line |= {"scaling": problem.scaling, "out_dtype": problem.out_dtype} if problem.scaled else {}
    return line | ({"batch": problem.batch} if problem.batch > 1 else {})


def kernel_calls(path: str | Path) -> list[dict]:
    """The kernel calls a misses file records (``gemmtune.autotune`` in lookup mode): plain data
    that ``gemmtune.tuning.kernel_worker.tune_recorded`` rebuilds the call from."""
    try:
        entries = _entries(Path(path).read_text())
    except (json.JSONDecodeError, KeyError, TypeError):
        return []  # not a misses file: load says why
    return [e for e in entries if isinstance(e, dict) and e.get("kind") == KERNEL_CALL]


def append_miss(path: Path, line: dict) -> None:
    """One JSON line in the misses file ``path``, in one write in append mode, so processes
    serving side by side do not interleave their lines."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
    except OSError as exc:  # serving goes on; the miss is still in its log line
        log.warning("gemmtune: cannot append the miss to %s: %s", path, exc)


def _entries(text: str) -> list:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:  # JSON Lines: one entry per line
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(doc, dict) and "shapes" not in doc and ("m" in doc or doc.get("kind") == KERNEL_CALL):
        return [doc]  # JSON Lines holding a single entry
    return doc["shapes"]


# Small shapes for a machine without a GPU: Triton's interpreter runs them in seconds, at the
# awkward sizes (1, 7, 33, odd K) where masking bugs show.
INTERPRETER_DEMO = (
    NamedProblem("demo.square", "small", Problem(64, 64, 64, "float16", "nn")),
    NamedProblem("demo.decode", "decode", Problem(1, 96, 128, "bfloat16", "linear")),
    NamedProblem("demo.odd", "misaligned", Problem(33, 47, 65, "float32", "linear", bias=True, activation="gelu")),
    NamedProblem("demo.thin", "small", Problem(7, 40, 100, "float32", "nn")),
)
