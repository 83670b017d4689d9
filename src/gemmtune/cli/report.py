"""Rendering results for people (rich tables) and programs (JSON-ready dicts)."""

from __future__ import annotations

from collections.abc import Sequence
from statistics import geometric_mean

from rich.table import Table

from gemmtune import kernel_config
from gemmtune.problem import Problem, element_size
from gemmtune.results import Trial, TuneResult


def result_dict(result: TuneResult, name: str | None = None) -> dict:
    if kernel_config.is_kernel_key(result.problem_key):
        return {"name": name or result.problem_key, "kernel": result.problem_key, "backend": result.backend,
                "config": result.config, "choice": result.label(), "time_ms": result.time_ms,
                "rel_err": result.rel_err, "tune_s": result.tune_s, "from_store": result.from_store,
                "gpu_timings": result.gpu_timings, "device": result.device}
    problem = Problem.from_key(result.problem_key)
    return {
        "name": name or problem.describe(), "m": problem.m, "n": problem.n, "k": problem.k,
        "dtype": problem.dtype, "tf32": problem.tf32, "layout": problem.layout, "bias": problem.bias,
        "activation": problem.activation, "scaling": problem.scaling, "out_dtype": problem.out_dtype,
        "batch": problem.batch, "backend": result.backend, "config": result.config, "choice": result.label(),
        "time_ms": result.time_ms, "cublas_ms": result.cublas_ms, "speedup": result.speedup,
        "rel_err": result.rel_err, "tune_s": result.tune_s, "from_store": result.from_store,
        "gpu_timings": result.gpu_timings, "device": result.device,
    }


def results_table(results: Sequence[TuneResult], names: Sequence[str] | None = None) -> Table:
    gpu = all(r.gpu_timings for r in results)
    table = Table(title="gemmtune tune" + ("" if gpu else " (CPU interpreter: NOT GPU timings)"))
    numeric = ("ms", "cuBLAS ms", "speedup", "tune s", "verified")
    for column in ("shape", "dtype", "layout", "choice") + numeric:
        table.add_column(column, justify="right" if column in numeric else "left")
    for i, result in enumerate(results):
        name, dtype, layout = _described(result.problem_key)
        name = names[i] if names else name
        speedup = f"{result.speedup:.2f}x" if result.speedup else "-"
        tune_s = "stored" if result.from_store else f"{result.tune_s:.1f}"
        cublas = f"{result.cublas_ms:.4f}" if result.cublas_ms else "-"
        verified = f"{sum(t.ok for t in result.trials)}/{len(result.trials)}" if result.trials else "-"
        table.add_row(name, dtype, layout, result.label(), f"{result.time_ms:.4f}", cublas, speedup, tune_s, verified)
    return table


def _described(key: str) -> tuple[str, str, str]:
    """A stored key's shape, dtype and layout columns; a kernel's key reads as its name and
    arguments, with "kernel" for its layout."""
    if kernel_config.is_kernel_key(key):
        name, _, rest = key[len(kernel_config.KEY_PREFIX):].partition("@")
        return f"{name}({rest.split('/', 2)[-1]})", "-", "kernel"
    problem = Problem.from_key(key)
    layout = problem.layout + ("+bias" if problem.bias else "")
    layout += "" if problem.activation == "none" else f"+{problem.activation}"
    batch = f"{problem.batch} x " if problem.batch > 1 else ""
    shape = f"{batch}{problem.m}x{problem.n}x{problem.k}"
    return shape, problem.dtype + ("+tf32" if problem.tf32 else ""), layout


def trials_table(trials: Sequence[Trial]) -> Table:
    table = Table(title="trials")
    for column in ("candidate", "status", "median ms", "spread", "rel_err", "reason"):
        table.add_column(column)
    for t in sorted(trials, key=lambda t: (not t.ok, t.median_ms or 0.0)):
        table.add_row(t.label(), t.status.value, f"{t.median_ms:.4f}" if t.timing else "-",
                      f"{t.timing.spread:.1%}" if t.timing else "-",
                      f"{t.rel_err:.2e}" if t.rel_err is not None else "-", t.reason)
    return table


def graph_line(choice: TuneResult, trials: Sequence[Trial]) -> str:
    """What CUDA graphs replay for a stored choice: its own kernel, or the finalist whose kernel
    its tuning found faster (``tuner.graph_choice``), which served calls captured in a graph run."""
    from gemmtune.tuning.tuner import graph_choice

    pick = graph_choice(trials, choice.label())
    if pick is None:
        return "in CUDA graphs: the choice's own kernel"
    mine = next((t for t in trials if t.label() == choice.label() and t.ok and t.timing), None)
    against = f" against the choice's {mine.median_ms:.4f} ms" if mine is not None else ""
    return f"in CUDA graphs: {pick.label()}, its kernel {pick.median_ms:.4f} ms{against} in the final rounds"


# --- suite files (benchmarks/results/suite-*.json) ---------------------------------------------

# Dense 16-bit tensor-core peaks (TFLOP/s) for the roofline's compute roof, by a name fragment of
# the device; float32 with TF32 runs at half, IEEE float32 far lower (not drawn).
PEAK_TFLOPS_16BIT = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "RTX 4090": 165.0}


KINDS = ("suite", "models")  # the result files `gemmtune report` renders


def read_results(path) -> dict:
    """A suite or models file, checked enough that a wrong file fails here with its name, not in
    a plot."""
    import json
    from pathlib import Path

    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"report: cannot read {path}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("kind") not in KINDS or not isinstance(doc.get("rows"), list):
        raise ValueError(f"report: {path} is not a suite or models file (expected kind 'suite' or 'models' "
                         "and a list of rows)")
    return doc


def suite_markdown(doc: dict) -> str:
    """The suite as a Markdown table, one row per shape, with its geometric means by group."""
    lines = [f"gemmtune suite on {doc.get('device', '?')} ({doc.get('sm_count', '?')} SMs), "
             f"torch {doc.get('torch', '?')}, triton {doc.get('triton', '?')}, {doc.get('date', '?')}", "",
             "| shape | group | M x N x K | dtype | cuBLAS ms | gemmtune ms | speedup | inductor ms | choice | tune s |",
             "|---|---|---|---|---:|---:|---:|---:|---|---:|"]
    for r in doc["rows"]:
        lines.append(f"| {r['name']} | {r.get('group', '')} | {r['m']}x{r['n']}x{r['k']} | {r['dtype']} | "
                     f"{_num(r.get('cublas_ms'))} | {_num(r.get('gemmtune_ms'))} | {_num(r.get('speedup'), 2)}x | "
                     f"{_num(r.get('inductor_ms'))} | `{r.get('choice', '')}` | {_num(r.get('tune_s'), 1)} |")
    lines += ["", "| group | shapes | geomean speedup | min speedup |", "|---|---:|---:|---:|"]
    for group, speedups in _by_group(doc["rows"]).items():
        lines.append(f"| {group} | {len(speedups)} | {geometric_mean(speedups):.3f}x | {min(speedups):.3f}x |")
    return "\n".join(lines + ["", *fp8_summary(doc["rows"]), *decode_bandwidth(doc), *tuning_summary(doc["rows"])]) + "\n"


def fp8_summary(rows) -> list[str]:
    """fp8 (scaled) rows by group and scaling: gemmtune against torch._scaled_mm (cuBLASLt; rows
    where it refuses the shape are counted apart) and against the bf16 (unscaled) cuBLAS GEMM it
    replaces, each a ratio of times from the same rounds."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("scaling", "none") != "none" and r.get("gemmtune_ms"):
            groups.setdefault((r.get("group") or "-", r["scaling"]), []).append(r)
    if not groups:
        return []
    lines = ["| fp8 group | scaling | shapes | vs _scaled_mm geomean | min | _scaled_mm refused | "
             "vs unscaled cuBLAS geomean | min |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for (group, scaling), members in groups.items():
        scaled = [r["speedup"] for r in members if r.get("speedup")]
        unscaled = [r["unscaled_ms"] / r["gemmtune_ms"] for r in members if r.get("unscaled_ms")]
        refused = sum(bool(r.get("cublas_refused")) for r in members)
        lines.append(f"| {group} | {scaling} | {len(members)} | {_stat(scaled, geometric_mean)} | {_stat(scaled, min)} | "
                     f"{refused} | {_stat(unscaled, geometric_mean)} | {_stat(unscaled, min)} |")
    return lines + [""]


def _stat(values, how) -> str:
    return f"{how(values):.3f}x" if values else "-"


def decode_bandwidth(doc: dict) -> list[str]:
    """Each decode row's weight-read rate (N x K elements once, at gemmtune's time) against the
    device's copy bandwidth (bytes read + written) and, where measured, its read-only one."""
    rows = [r for r in doc["rows"] if r.get("group") == "decode" and r.get("gemmtune_ms")]
    if not rows:
        return []
    bases = [(name, doc[key]) for name, key in (("copy", "copy_tbps"), ("read", "read_tbps")) if doc.get(key)]
    lines = ["| decode shape | weights TB/s | " + " | ".join(f"of {n} {v:.2f} TB/s" for n, v in bases) + " |",
             "|---|---:|" + "---:|" * len(bases)]
    for r in rows:
        tbps = r["n"] * r["k"] * element_size(r["dtype"]) / (r["gemmtune_ms"] * 1e9)
        lines.append(f"| {r['name']} | {tbps:.2f} | " + " | ".join(f"{100 * tbps / v:.0f}%" for _, v in bases) + " |")
    return lines + [""]


def tuning_summary(rows) -> list[str]:
    """What tuning cost and how close it came to exhaustive search, where the suite measured it."""
    import statistics

    lines = []
    cold = [r["tune_s"] for r in rows if r.get("tune_s") is not None]
    warm = [r["tune_s_warm"] for r in rows if r.get("tune_s_warm") is not None]
    if cold:
        lines.append(f"- tuning from cold: median {statistics.median(cold):.2f} s, max {max(cold):.1f} s per shape"
                     + (f"; warm: median {statistics.median(warm):.2f} s" if warm else ""))
    inductor = [r["inductor_tune_s"] for r in rows if r.get("inductor_tune_s") is not None]
    if inductor:
        lines.append(f"- inductor max-autotune tuning: median {statistics.median(inductor):.2f} s per shape")
    checked = [r for r in rows if r.get("exhaustive_ms")]
    if checked:
        within = sum(r["gemmtune_ms"] <= 1.02 * r["exhaustive_ms"] for r in checked)
        held = sum(bool(r.get("exhaustive_in_topk")) for r in checked)
        lines.append(f"- the choice within 2% of exhaustive search on {within} of {len(checked)} shapes; "
                     f"the default strategy measured the exhaustive winner on {held} of {len(checked)}")
    return lines


def suite_png(doc: dict, path) -> None:
    """Two panels: speedup over cuBLAS per shape (gemmtune and inductor), and a roofline of the
    achieved TFLOP/s against arithmetic intensity under the device's copy bandwidth."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("report: the PNG needs matplotlib (pip install matplotlib); "
                           "the Markdown table does not") from None
    rows = doc["rows"]
    fig, (bars, roof) = plt.subplots(1, 2, figsize=(16, 6), gridspec_kw={"width_ratios": [3, 2]})
    x = range(len(rows))
    bars.bar(x, [r["speedup"] for r in rows], color="tab:blue", label="gemmtune")
    inductor = [(i, r["cublas_ms"] / r["inductor_ms"]) for i, r in enumerate(rows) if r.get("inductor_ms")]
    if inductor:
        bars.scatter(*zip(*inductor), color="tab:orange", marker="D", zorder=3, label="inductor max-autotune")
    bars.axhline(1.0, color="black", linewidth=0.8)
    bars.set_xticks(list(x), [r["name"] for r in rows], rotation=75, fontsize=7)
    bars.set_ylabel("speedup over cuBLAS (1 = cuBLAS)")
    bars.legend()
    bars.set_title(f"{doc.get('device', '')}: gemmtune vs cuBLAS, same process")
    _roofline(roof, doc)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _roofline(ax, doc: dict) -> None:
    intensity, tflops = [], []
    for r in doc["rows"]:
        bytes_moved = (r["m"] * r["k"] + r["n"] * r["k"] + r["m"] * r["n"]) * (4 if r["dtype"] == "float32" else 2)
        flops = 2.0 * r["m"] * r["n"] * r["k"]
        intensity.append(flops / bytes_moved)
        tflops.append(flops / (r["gemmtune_ms"] * 1e-3) / 1e12)
    ax.scatter(intensity, tflops, color="tab:blue", zorder=3)
    lo, hi = min(intensity) / 2, max(intensity) * 2
    if doc.get("copy_tbps"):
        ax.plot([lo, hi], [lo * doc["copy_tbps"], hi * doc["copy_tbps"]], "k--", linewidth=0.8,
                label=f"copy bandwidth {doc['copy_tbps']:.2f} TB/s")
    peak = next((v for name, v in PEAK_TFLOPS_16BIT.items() if name in doc.get("device", "")), None)
    if peak:
        ax.axhline(peak, color="gray", linewidth=0.8, label=f"16-bit dense peak {peak:.0f} TFLOP/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte, each operand read once)")
    ax.set_ylabel("achieved TFLOP/s (gemmtune)")
    ax.set_title("roofline")
    ax.legend(fontsize=8)


def _by_group(rows) -> dict[str, list[float]]:
    groups: dict[str, list[float]] = {}
    for r in rows:
        if r.get("speedup"):
            groups.setdefault(r.get("group") or "-", []).append(r["speedup"])
    return groups


def _num(value, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
