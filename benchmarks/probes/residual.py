"""Probe: what adding a model's residuals in the epilogue of the GEMM before them could save.

A residual add that reads a linear layer's output (``x + fc2(h)``, ``LayerNorm(dense(h) + x)``)
is a kernel of its own, in eager and in CUDA graphs: it reads the GEMM's output and the residual
and writes their sum. cuBLAS can add the residual in the GEMM's epilogue instead, for one more
read: its C operand with a beta of 1 (cuBLASLt's, with its bias epilogue where the layer has a
bias, ``cublaslt_binding``'s ``residual_ptr``; ``torch.addmm``'s where it has none).

Per zoo model (``benchmarks/models.py``'s names, its bf16 cases other than training steps): the
sites, found by running one forward under a dispatch mode (an aten add of an ``mm``/``addmm``
output, through views only, and a tensor of its shape; ``exclusive`` where nothing else reads
that output), and the forward's time replayed as a CUDA graph. Per distinct site (rows, N, K,
bias), on fresh random operands: the GEMM alone (``F.linear``), the GEMM and then the add (the
model's way), and the fused calls (cuBLASLt's, and ``torch.addmm``'s where there is no bias);
their GPU time replayed from CUDA graphs of REPS calls back to back (no L2 flush between calls,
as in a model) in interleaved rounds, the host's own time per call queued, and each output's
error against float64. Per model: the ceiling (what the adds cost the GPU, over the forward's
graph time) and what the fused calls would save on the GPU and the host, each exclusive site
taking the fused way of least GPU time.

    PYTHONPATH=src:benchmarks python3 benchmarks/probes/residual.py OUT.json [--models bert-base,llama]
"""
import json
import logging

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import models
from gemmtune.backends import cublaslt_binding
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.tuning import measure

log = logging.getLogger("gemmtune.probe")
aten = torch.ops.aten
GEMMS = (aten.mm.default, aten.addmm.default)
ADDS = (aten.add.Tensor, aten.add_.Tensor)
# ops whose output is the same memory as their input: a GEMM output passed through them is still it
VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default,
         aten.t.default, aten.transpose.int, aten.detach.default, aten.dropout.default)
REPS = 20  # calls of a way per captured graph
DEFAULT = ("vit_base_patch16_224,deit_small_patch16_224,swin_tiny_patch4_window7_224,convnext_tiny,mixer_b16_224,"
           "bert-base,t5-small,whisper-tiny-encoder,gpt2,llama")


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class Sites(TorchDispatchMode):
    """The residual sites of the ops run meanwhile: ``sites``, one dict per add of a GEMM's output
    (rows, n, k, bias, and ``exclusive``: no op other than views and that add read the output)."""

    def __init__(self) -> None:
        super().__init__()
        self.gemms: dict[int, dict] = {}  # a GEMM output's storage -> its site, until an add or a reuse
        self.added: dict[int, dict] = {}  # an added GEMM output's storage -> its site (later reads seen)
        self.sites: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in VIEWS:
            return out
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        site = self._site(func, args, kwargs, tensors)
        for t in tensors:  # any other read of a GEMM output: its add is not the output's only use
            entry = self.gemms.get(_storage(t)) or self.added.get(_storage(t))
            if entry is not None and entry is not site:
                entry["exclusive"] = False
        outputs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
        for o in outputs:  # memory given to a new tensor: what was there is gone
            if site is None or _storage(o) != site["storage"]:
                self.gemms.pop(_storage(o), None)
                self.added.pop(_storage(o), None)
        if func in GEMMS and out.dim() == 2:
            first = args[1] if func is aten.addmm.default else args[0]
            self.gemms[_storage(out)] = {"rows": out.shape[0], "n": out.shape[1], "k": first.shape[1],
                                         "bias": func is aten.addmm.default, "numel": out.numel(),
                                         "storage": _storage(out), "exclusive": True}
        return out

    def _site(self, func, args, kwargs, tensors) -> dict | None:
        """The site an add completes, moved from ``gemms`` to ``added``; None for any other op."""
        if func not in ADDS or len(tensors) < 2 or kwargs.get("alpha", 1) != 1:
            return None
        a, b = args[0], args[1]
        for product, other in ((a, b), (b, a)):
            entry = self.gemms.get(_storage(product))
            if entry is not None and product.numel() == entry["numel"] and other.shape == product.shape:
                self.sites.append(entry)
                del self.gemms[entry["storage"]]
                if not (func is aten.add_.Tensor and product is a):  # else the sum is in its memory now
                    self.added[entry["storage"]] = entry
                return entry
        return None


def _fused_lt(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, r: torch.Tensor):
    """``F.linear(x, w, b) + r`` with the add (and the bias) in cuBLASLt's epilogue, its heuristic's
    first algorithm."""
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    matmul = cublaslt_binding.Matmul(Problem(m, n, k, models.dtype_name(x.dtype), "linear", b is not None),
                                     torch.cuda.current_device())
    algo, workspace_bytes = matmul.algo(matmul.heuristics(1)[0])
    launch = matmul.launcher(algo)
    workspace = torch.empty(max(workspace_bytes, 1), dtype=torch.uint8, device="cuda")
    pw, px, pr, pws = w.data_ptr(), x.data_ptr(), r.data_ptr(), workspace.data_ptr()
    pb = 0 if b is None else b.data_ptr()

    def call():
        out = torch.empty(m, n, device="cuda", dtype=x.dtype)
        launch(pw, px, out.data_ptr(), pws, workspace_bytes, torch.cuda.current_stream().cuda_stream, pb,
               residual_ptr=pr)
        return out
    call.keep = (matmul, workspace)
    return call


def site_row(rows: int, n: int, k: int, bias: bool, dtype: torch.dtype) -> dict:
    """The three ways on one site's shape: GPU and host time per call, and their errors."""
    torch.manual_seed(rows + n + k)
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    r = torch.randn(rows, n, device="cuda", dtype=dtype)
    ways = {"gemm": lambda: F.linear(x, w, b), "gemm+add": lambda: F.linear(x, w, b) + r,
            "fused_lt": _fused_lt(x, w, b, r)}
    if b is None:
        wt = w.t()
        ways["fused_addmm"] = lambda: torch.addmm(r, x, wt)
    ref = x.double() @ w.double().t() + r.double() + (0 if b is None else b.double())
    scale = ref.abs().max().item()
    errors = {way: (ways[way]().double() - ref).abs().max().item() / scale for way in ways if way != "gemm"}
    device = current()
    many = {way: (lambda f=f: [f() for _ in range(REPS)]) for way, f in ways.items()}
    gpu = measure.loops(measure.graphed(many), device, budget_ms=600.0, rounds=15)
    host = measure.host_rounds(ways, device, rounds=7, calls=50)
    row = {"rows": rows, "n": n, "k": k, "bias": bias, "dtype": models.dtype_name(dtype),
           "gpu_us": {way: t.median * 1e3 / REPS for way, t in gpu.items()},
           "host_us": {way: host[way][1].median * 1e3 for way in ways}, "rel_err": errors}
    # the fused way a per-layer choice would take: the one of least GPU time
    row["fused"] = min((way for way in ways if way.startswith("fused")), key=lambda way: row["gpu_us"][way])
    return row


def model_row(case, model, inputs, shapes: dict) -> dict:
    kwargs = case.kwargs(model, inputs)
    step = models.step_of(case, model, model, kwargs)
    with torch.no_grad():
        step()
        finder = Sites()
        with finder:
            step()
        replay, _ = models.captured(step)
    graph_ms = measure.loops({"model": replay}, current(), budget_ms=1000.0)["model"].median
    saved = {"add_gpu_us": 0.0, "fused_gpu_us": 0.0, "fused_host_us": 0.0}
    counted = {}
    for site in finder.sites:
        key = (site["rows"], site["n"], site["k"], site["bias"], case.dtype)
        if key not in shapes:
            shapes[key] = site_row(*key)
        counted[key] = counted.get(key, 0) + 1
        timed = shapes[key]
        saved["add_gpu_us"] += timed["gpu_us"]["gemm+add"] - timed["gpu_us"]["gemm"]
        if site["exclusive"]:
            fused = timed["fused"]
            saved["fused_gpu_us"] += timed["gpu_us"]["gemm+add"] - timed["gpu_us"][fused]
            saved["fused_host_us"] += timed["host_us"]["gemm+add"] - timed["host_us"][fused]
    graph_us = graph_ms * 1e3
    return {"model": case.label(), "graph_ms": graph_ms, "sites": len(finder.sites),
            "exclusive": sum(s["exclusive"] for s in finder.sites),
            "by_shape": [{"rows": k[0], "n": k[1], "k": k[2], "bias": k[3], "count": c} for k, c in counted.items()],
            **saved, "add_share": saved["add_gpu_us"] / graph_us, "fused_share": saved["fused_gpu_us"] / graph_us}


def main() -> int:
    parser = models.probe_parser(__doc__, DEFAULT)
    args = parser.parse_args()
    shapes: dict = {}
    rows = []
    for name in args.models.split(","):
        entry = models.entry_of(name)
        for case in entry.cases(name, False):
            if case.phase == "train" or case.dtype != torch.bfloat16:
                continue
            torch.manual_seed(0)
            model = entry.build(False).to("cuda", case.dtype).eval()
            rows.append(model_row(case, model, case.inputs("cuda", case.dtype), shapes))
            log.warning("%s", {k: v for k, v in rows[-1].items() if k != "by_shape"})
            del model
            models.release("cuda")
            doc = {"kind": "probe-residual", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "reps": REPS, "models": rows, "sites": list(shapes.values())}
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    raise SystemExit(main())
