"""A models file (``benchmarks/models.py``: real models with and without gemmtune, per mode) for
people: a Markdown table, one line per case and a column per mode, with each mode's geometric mean
and lowest ratio; and a PNG of the same ratios with their spreads, the line at 1.0 and the 0.99
floor the models issue asks every row to stay above."""

from __future__ import annotations

from statistics import geometric_mean

FLOOR = 0.99  # the ratio under which a row is gemmtune making a model slower (beyond rounding)


def cases(doc: dict) -> dict[tuple, dict[str, dict]]:
    """The file's rows by case (model, dtype, phase, batch, seq), each case's rows by mode, in the
    order the file has them; rows that failed (``error``) or have no ratio are left out."""
    out: dict[tuple, dict[str, dict]] = {}
    for row in doc["rows"]:
        if row.get("speedup") is None:
            continue
        key = (row["model"], row["dtype"], row["phase"], row.get("batch"), row.get("seq"))
        out.setdefault(key, {})[_mode(row)] = row
    return out


def markdown(doc: dict) -> str:
    """The table and, per mode, the geometric mean over the inference cases, the lowest ratio and
    the cases under FLOOR (train steps apart: they are timed in eager only)."""
    by_case = cases(doc)
    modes = list(dict.fromkeys(mode for rows in by_case.values() for mode in rows))
    lines = [f"gemmtune models on {doc.get('device', '?')} ({doc.get('sm_count', '?')} SMs), torch "
             f"{doc.get('torch', '?')}, {doc.get('date', '?')}: the model's time without gemmtune over its "
             "time with it (above 1: gemmtune faster), median of alternated rounds +- half their "
             "inter-quartile range; A/A: an untouched copy timed as a third side", "",
             "| model | dtype | phase | batch | GEMM calls kept / seen (layers) | " + " | ".join(modes) + " |",
             "|---|---|---|---|---|" + "---:|" * len(modes)]
    for (model, dtype, phase, batch, seq), rows in by_case.items():
        first = next(iter(rows.values()))
        size = f"{batch}" + ("" if seq is None else f" x {seq}")
        notes = [f"{first[key]} {words}" for key, words in (("fused_kept", "fused"), ("graph_only", "graph only"),
                                                             ("eager_only", "eager only")) if first.get(key)]
        kept = f"{first.get('gemms_kept', '-')} / {first.get('gemms', '-')}" + (f" ({', '.join(notes)})" if notes else "")
        cells = [_cell(rows[mode]) if mode in rows else "" for mode in modes]
        lines.append(f"| {model} | {dtype} | {phase} | {size} | {kept} | " + " | ".join(cells) + " |")
    lines += ["", "| mode | inference cases | geomean | lowest | under " + f"{FLOOR} |", "|---|---:|---:|---:|---|"]
    for mode in modes:
        rows = [(case, r[mode]) for case, r in by_case.items() if mode in r and case[2] != "train"]
        if not rows:
            continue
        ratios = [row["speedup"] for _, row in rows]
        under = ", ".join(f"{case[0]} {case[1]} {row['speedup']:.3f}" for case, row in rows if row["speedup"] < FLOOR)
        lines.append(f"| {mode} | {len(rows)} | {geometric_mean(ratios):.3f}x | {min(ratios):.3f}x | {under or '-'} |")
    skipped = doc.get("skipped") or []
    if skipped:
        lines += ["", f"Skipped (time budget): {len(skipped)}."]
    return "\n".join(lines) + "\n"


def png(doc: dict, path) -> None:
    """One horizontal bar per case and mode (the ratio, its spread as an error bar), the cases
    top to bottom in the file's order, with the lines at 1.0 and FLOOR."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("report: the PNG needs matplotlib (pip install matplotlib); "
                           "the Markdown table does not") from None
    by_case = cases(doc)
    modes = list(dict.fromkeys(mode for rows in by_case.values() for mode in rows))
    height = 0.8 / max(1, len(modes))
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(by_case) * max(1, len(modes)) ** 0.5 + 2))
    for j, mode in enumerate(modes):
        ys, ratios, spreads = [], [], []
        for i, rows in enumerate(by_case.values()):
            if mode in rows:
                ys.append(-i - j * height)
                ratios.append(rows[mode]["speedup"])
                spreads.append(rows[mode]["speedup"] * (rows[mode].get("spread") or 0.0))
        ax.barh(ys, [r - 1.0 for r in ratios], left=1.0, height=height, xerr=spreads, label=mode, capsize=2)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.axvline(FLOOR, color="tab:red", linewidth=0.8, linestyle="--", label=f"{FLOOR}")
    ax.set_yticks([-i - (len(modes) - 1) * height / 2 for i in range(len(by_case))],
                  [_label(case) for case in by_case], fontsize=8)
    ax.set_xlabel("time without gemmtune / with it (above 1: gemmtune faster)")
    ax.set_title(f"{doc.get('device', '')}, {doc.get('date', '')}: each mode against the model without gemmtune",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _mode(row: dict) -> str:
    """A row's mode as the table names it: the gemmtune side's way, and the baseline's where it
    differs (gemmtune.compile against max-autotune, say)."""
    mode, baseline = row["mode"], row.get("baseline", row["mode"])
    return mode if baseline == mode else f"{mode} vs {baseline}"


def _cell(row: dict) -> str:
    cell = f"{row['speedup']:.3f} +-{row.get('spread') or 0.0:.3f}"
    if row.get("control") is not None:
        cell += f" (A/A {row['control']:.2f})"
    return f"**{cell}**" if row["speedup"] < FLOOR else cell


def _label(case: tuple) -> str:
    model, dtype, phase, batch, seq = case
    return f"{model} {dtype} {phase} {batch}" + ("" if seq is None else f"x{seq}")
