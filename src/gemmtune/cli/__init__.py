"""``gemmtune``: a thin shell over the library. Each subcommand parses and calls one function."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from gemmtune import settings
from gemmtune.problem import ACTIVATIONS, BUCKETS, DTYPES, SCALED_DTYPES, SCALINGS
from gemmtune.search import STRATEGIES, Budget

# The interpreter runs a 64^3 GEMM in about a second per candidate; far larger is hours.
INTERPRETER_MAX_MACS = 1 << 21


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _configure_logging(args.verbose)
    console = _console()
    from gemmtune.errors import StoreError

    try:
        return args.run(args, console)
    except (ValueError, TypeError, OSError, StoreError) as exc:
        # Text, not markup: messages hold user paths; soft_wrap: a one-line message stays one line
        _console(stderr=True).print(Text(f"gemmtune {args.command}: {exc}", style="red"), soft_wrap=True)
        return 2


def _console(stderr: bool = False) -> Console:
    """A terminal's own width; piped (make, CI, a log file) wide enough that tables stay whole."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else 160)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gemmtune", description="Find, verify and remember the fastest GEMM kernel for each shape.",
        epilog="Environment: " + "; ".join(f"{k.env}: {k.help}" for k in settings.KNOBS))
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v logs every candidate; -vv more")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    doctor = sub.add_parser("doctor", help="what this GPU is, what limits it, and what gemmtune will do here")
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    _store_argument(doctor)
    doctor.set_defaults(run=_doctor)

    tune = sub.add_parser("tune", help="tune shapes and print the choices beside cuBLAS",
                          description="Tune GEMM shapes: every candidate is verified, then timed beside cuBLAS; "
                                      "cuBLAS stays unless beaten beyond noise. Without a GPU, small shapes run "
                                      "through Triton's interpreter and the timings are not GPU timings.")
    _shape_arguments(tune, "tune")
    tune.add_argument("--retune", action="store_true", help="tune again even where the store has an answer")
    tune.add_argument("--strategy", default="topk", choices=STRATEGIES,
                      help="how each backend's configs are searched: topk measures the cost model's best "
                           "(default), exhaustive all of them, random a sample, descent walks neighbours")
    tune.add_argument("--budget", default=None, metavar="N|Ts",
                      help="per backend: N candidates, or T seconds with an s suffix (e.g. 8, 2.5s)")
    tune.add_argument("--bucket", default="exact", choices=BUCKETS,
                      help="with --validate: the bucket policy to validate (exact, pow2, log2m)")
    tune.add_argument("--validate", type=int, default=0, metavar="N",
                      help="tune each shape's bucket, then measure its config on N shapes sampled from the "
                           "bucket beside their own tuned configs, and report the loss")
    tune.add_argument("--in-process", action="store_true",
                      help="run candidates in this process (default: a worker process, so a crashing or "
                           "hanging candidate becomes a failed trial)")
    tune.add_argument("--gpus", metavar="all|N|I,J",
                      help="spread the shapes over GPUs, the costliest first, into one store: all of this "
                           "host's, the first N, or those listed; each GPU runs its candidates in a process of its "
                           "own, and a shape whose tuning fails is tuned again on the next free GPU (without a GPU: "
                           "N lanes on Triton's interpreter)")
    tune.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                      help="tune across a Ray cluster, an actor per GPU of it handed a shape (and its epilogue "
                           "variants) at a time: --ray auto joins the cluster this host is part of, --ray ADDRESS "
                           "another, --ray alone starts a local instance; set --store to a server's URL so that "
                           "every host's choices meet (pip install ray)")
    tune.add_argument("--json", action="store_true", help="print results as JSON instead of a table")
    _store_argument(tune)
    tune.set_defaults(run=_tune)

    bench = sub.add_parser("bench", help="time each shape's stored choice beside cuBLAS (and inductor), now",
                           description="For each shape, the kernel gemmtune stored for it (tuned first where the "
                                       "store has none), torch's own call (cuBLAS) and, with --inductor, "
                                       "torch.compile max-autotune, timed side by side in one process: interleaved "
                                       "rounds, L2 flushed, CUDA-graph replays (GPU time). The stored kernel's "
                                       "output is checked against float64 first; a wrong one makes the exit status 1. "
                                       "--out writes a suite file that `gemmtune report` renders. Without a GPU the "
                                       "kernels run in Triton's interpreter and the timings are NOT GPU timings.")
    _shape_arguments(bench, "time")
    bench.add_argument("--inductor", action="store_true",
                       help="also time torch.compile(mode='max-autotune-no-cudagraphs'), tuned from scratch per shape")
    bench.add_argument("--rounds", type=int, default=30, metavar="N", help="interleaved rounds at least (default 30)")
    bench.add_argument("--budget-ms", type=float, default=1000.0, metavar="MS",
                       help="wall time of each shape's rounds, past which no more start once N ran (default 1000)")
    bench.add_argument("--out", type=Path, metavar="FILE", help="write the rows as a suite file (JSON)")
    bench.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    _store_argument(bench)
    bench.set_defaults(run=_bench)

    cache = sub.add_parser("cache", help="inspect, export, import, merge or clear the tuning store")
    _store_argument(cache)
    cache_sub = cache.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = cache_sub.add_parser("list", help="every stored choice")
    listing.add_argument("--device", help="only this device fingerprint")
    show = cache_sub.add_parser("show", help="one problem's choice and every trial behind it")
    show.add_argument("problem", help="a problem key, e.g. v2/linear/bfloat16/1x6144x4096/bias=0/act=none")
    show.add_argument("--device", help="device fingerprint (default: this machine's)")
    export = cache_sub.add_parser("export", help="write the choices to a JSON file")
    export.add_argument("path", type=Path)
    export.add_argument("--device", help="only this device fingerprint")
    imp = cache_sub.add_parser("import", help="validate and load a JSON export (all or nothing)")
    imp.add_argument("path", type=Path)
    clear = cache_sub.add_parser("clear", help="delete stored choices and their trials")
    clear.add_argument("--device", help="only this device fingerprint")
    merge = cache_sub.add_parser("merge", help="copy other stores' choices and trials into this one, newest first",
                                 description="Copy every choice of each SOURCE store (a SQLite file or directory, "
                                             "or a postgresql:// URL) with its trials into the store of --store, "
                                             "where that store does not hold the choice as new or newer. Merging "
                                             "again copies nothing; sync a local store with a server by merging "
                                             "each way.")
    merge.add_argument("sources", nargs="+", metavar="SOURCE", help="a store to copy from")
    cache.set_defaults(run=_cache)

    cmp = sub.add_parser("compare", help="a model in eager, each torch.compile mode and gemmtune, side by side",
                         description="Run one model in eager mode, under each torch.compile mode and through "
                                     "gemmtune (with and without a CUDA graph) in one process: setup time from cold, "
                                     "GPU time, host time per call (and its ratio to eager's, timed in alternating "
                                     "rounds) and the error against float64. Writes the "
                                     "'compare' results file and a PNG chart. Without a GPU only eager and gemmtune "
                                     "run, and their timings are CPU timings.")
    cmp.add_argument("--model", default="seed-mlp",
                     help="seed-mlp (Linear 1024->1024, ReLU, Linear; default) or package.module:factory")
    cmp.add_argument("--input-shape", default="256,1024", metavar="B,F",
                     help="the input's shape, comma-separated (default 256,1024)")
    cmp.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    cmp.add_argument("--modes", nargs="+", default=None, metavar="MODE",
                     help="modes to run (default all): eager, default, reduce-overhead, max-autotune, "
                          "max-autotune-no-cudagraphs, gemmtune, gemmtune+cudagraph, gemmtune.compile")
    cmp.add_argument("--out", type=Path, default=Path("compare.json"), help="results file (default compare.json)")
    cmp.add_argument("--no-png", action="store_true", help="skip the chart (written beside --out otherwise)")
    cmp.set_defaults(run=_compare)

    rep = sub.add_parser("report", help="a suite or models file as a Markdown table and a PNG",
                         description="Render a results file as a Markdown table and a PNG, written beside the "
                                     "file unless --out says where. A suite file (benchmarks/results/suite-*.json): "
                                     "per-group geometric means, the speedup per shape and a roofline. A models "
                                     "file (models-*.json): each model case's ratio per mode with its spread, and "
                                     "each mode's geometric mean and lowest row.")
    rep.add_argument("results", type=Path, help="a suite or models JSON file")
    rep.add_argument("--out", type=Path, help="directory for the .md and .png (default: beside RESULTS)")
    rep.add_argument("--no-png", action="store_true", help="only the Markdown table (no matplotlib needed)")
    rep.set_defaults(run=_report)
    return parser


def _shape_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    """The arguments that say which GEMMs ``tune`` and ``bench`` work on (``_named_problems``)."""
    parser.add_argument("--shape", action="append", default=[], metavar="MxNxK", help=f"a shape to {verb} (repeatable)")
    parser.add_argument("--shapes", "--from", dest="shapes", type=Path, metavar="FILE",
                        help="a shapes file (the format of benchmarks/shapes/public.json), a file written by "
                             "gemmtune.record, or the misses GEMMTUNE_MISSES collected (JSON Lines; the "
                             "gemmtune.autotune kernel calls it records are tuned too, on fresh tensors)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES + SCALED_DTYPES,
                        help="dtype for --shape (default bfloat16; an fp8 dtype needs --scaling)")
    parser.add_argument("--scaling", default="none", choices=SCALINGS,
                        help="for an fp8 --dtype: its scales per tensor, per row, or per 1x128 / 128x128 block")
    parser.add_argument("--out-dtype", default="", choices=("",) + DTYPES, metavar="DTYPE",
                        help=f"for an fp8 --dtype: the output's dtype, one of {', '.join(DTYPES)} (default bfloat16)")
    parser.add_argument("--layout", default="linear", choices=("linear", "nn"),
                        help="linear: x @ w.T as nn.Linear; nn: a @ b (default linear)")
    parser.add_argument("--bias", action="store_true", help="add a bias vector (fused where the kernel can)")
    parser.add_argument("--activation", default="none", choices=ACTIVATIONS,
                        help="element-wise activation after the bias, fused into Triton kernels (default none)")
    parser.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=None,
                        help="allow TF32 for float32 (default: torch's float32 matmul precision)")


def _named_problems(args, device) -> list:
    """The shapes ``_shape_arguments`` named (the public shapes, or the interpreter's demo shapes
    without a GPU, where none is named); without a GPU, a warning and a refusal of large ones."""
    import torch

    from gemmtune import shapes
    from gemmtune.problem import Problem, parse_shape

    tf32 = args.tf32 if args.tf32 is not None else torch.get_float32_matmul_precision() != "highest"
    if args.shape and (args.dtype in SCALED_DTYPES) != (args.scaling != "none"):
        raise ValueError(f"--dtype {args.dtype} with --scaling {args.scaling}: an fp8 --dtype ({', '.join(SCALED_DTYPES)}) "
                         f"takes --scaling tensor, row or block, the others none")
    named = [shapes.NamedProblem(text, "", Problem(*parse_shape(text), args.dtype, args.layout, args.bias, tf32,
                                                   args.activation, args.scaling, args.out_dtype))
             for text in args.shape]
    if args.shapes:
        try:
            named += shapes.load(args.shapes, tf32=tf32)
        except OSError as exc:
            raise ValueError(f"--shapes {args.shapes}: cannot read it ({exc.strerror or exc})") from None
    if not named and not args.shapes:  # a file naming no GEMM may name kernel calls (_tune_kernel_calls)
        named = list(shapes.INTERPRETER_DEMO) if device.interpreter else shapes.load(tf32=tf32)
    if device.interpreter:
        _console(stderr=True).print("[yellow]No CUDA GPU: running gemmtune's pipeline through Triton's interpreter on the CPU. "
                      "Its timings are NOT GPU timings; they only show the pipeline works.[/yellow]")
        too_big = [n.name for n in named if n.problem.flops // 2 > INTERPRETER_MAX_MACS]  # a batch counts whole
        if too_big:
            raise ValueError(f"shapes too large for the CPU interpreter (over {INTERPRETER_MAX_MACS} MACs): "
                             f"{', '.join(too_big)}; use a GPU")
    return named


def _configure_logging(verbose: int) -> None:
    level = {0: settings.LOG_LEVEL.raw().upper(), 1: "DEBUG"}.get(verbose, "DEBUG")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("gemmtune").setLevel(level)


def _doctor(args, console: Console) -> int:
    from gemmtune.cli import doctor

    checks = [_store_problem(args.cache) or check if check.name == "store" else check
              for check in doctor.collect(store_path=args.cache)]
    if args.json:
        console.print_json(json.dumps(doctor.as_dict(checks)))
    else:
        doctor.render(checks, console)
    return 0


def _store_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", "--cache", dest="cache", metavar="STORE",
                        help="the tuning store: a SQLite file or directory, or a postgresql:// URL shared by a fleet "
                             "(default: $GEMMTUNE_STORE, else the SQLite file in $GEMMTUNE_CACHE_DIR or the user "
                             "cache dir)")


def _store_problem(cache: str | None):
    """The doctor's store line as a warning where the store that ``tune`` and ``cache`` would use
    cannot be used (the doctor's own line says only where it is and how large), or None."""
    from gemmtune.cli.doctor import Check
    from gemmtune.errors import StoreError
    from gemmtune.store import open_store

    try:
        with open_store(cache) as store:
            store.check()
    except StoreError as exc:
        return Check("store", str(exc), "warn")
    return None


def _tune(args, console: Console) -> int:
    from gemmtune.tuning import worker

    # the candidates' processes boot while this one makes its CUDA context and reads the shapes
    worker.start_early(_early_indices(args))
    try:
        return _tune_started(args, console)
    finally:
        worker.discard_early()


def _early_indices(args) -> list[int]:
    """The device indices whose candidates' processes ``tune`` will start: the current GPU's
    (0 in a fresh process, or the interpreter's lane), or those of ``--gpus`` (``gpus_of``); none
    for ``--in-process``, ``--ray`` (Ray's actors start their own) or a ``--gpus`` the command will
    refuse. ``--gpus`` counts through NVML alone (``torch.cuda.device_count``, not ``gpus_of``'s
    ``is_available``), which leaves CUDA uninitialised, so forking stays safe (where NVML fails,
    torch starts the CUDA driver to ask, and then nothing is forked)."""
    import torch

    if args.in_process or args.ray:
        return []
    if not args.gpus:
        return [0]
    try:
        gpus = gpus_of(args.gpus, count=torch.cuda.device_count())
    except ValueError:
        return []
    return sorted({0 if gpu is None else gpu for gpu in gpus})


def _tune_started(args, console: Console) -> int:
    from gemmtune import api
    from gemmtune.cli import report
    from gemmtune.device import current
    from gemmtune.store import open_store

    named = _named_problems(args, current())
    if args.validate:
        return _validate_buckets(named, args, console)
    store = open_store(args.cache)
    store.check()  # a store that cannot keep the choices is said before tuning, not after
    if args.shapes:
        _tune_kernel_calls(args.shapes, store, console)
        if not named:
            return 1 if store.failure else 0
    if args.gpus or args.ray:
        return _tune_spread(named, args, console, store)
    results = _tune_with_progress(api, named, args, console, store)
    if args.json:
        console.print_json(json.dumps([report.result_dict(r, n.name) for r, n in zip(results, named)]))
    else:
        console.print(report.results_table(results, [n.name for n in named]))
    return 1 if store.failure else 0  # it failed while tuning (a full disk, say): its warning said so


def _tune_kernel_calls(path: Path, store, console: Console) -> None:
    """Tune the ``gemmtune.autotune`` kernel calls a misses file records, each on fresh tensors of
    its arguments' layouts, into ``store`` under the key its serving process looked up."""
    from gemmtune import shapes
    from gemmtune.device import current
    from gemmtune.kernel_config import KernelConfig
    from gemmtune.tuning import kernel_worker

    device = current()
    for call in shapes.kernel_calls(path):
        try:
            result, name = kernel_worker.tune_recorded(call, device)
        except Exception as exc:  # noqa: BLE001 - one call that cannot be rebuilt must not stop the others
            name = f"{call.get('module')}.{call.get('qualname')}"
            console.print(f"[red]{name}: not tuned: {type(exc).__name__}: {exc}[/red]")
            continue
        if result is None:
            console.print(f"[red]{name}: every config failed; nothing stored[/red]")
            continue
        store.put(result)
        console.print(f"{name}: {KernelConfig.from_dict(result.config).label()} {result.time_ms:.4f} ms "
                      f"({sum(t.timing is not None for t in result.trials)} configs timed, "
                      f"{sum(not t.ok for t in result.trials)} failed) in {result.tune_s:.1f} s")


def gpus_of(value: str, count: int | None = None) -> list[int | None]:
    """``--gpus``: every GPU of this host ("all"), the first N, or the listed indices; without a
    GPU, N workers on the interpreter (None each). ``count``: this host's GPUs (None: asked of torch)."""
    import torch

    if count is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    text = value.strip().lower()
    if text == "all":
        return list(range(count)) or [None]
    if text.isdigit() and int(text) > 0:
        wanted = int(text)
        if count and wanted > count:
            raise ValueError(f"--gpus {value}: this host has {count} GPUs")
        return list(range(wanted)) if count else [None] * wanted
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > 1 and all(p.isdigit() for p in parts) and count:
        indices = [int(p) for p in parts]
        if bad := [i for i in indices if i >= count] or len(set(indices)) != len(indices):
            raise ValueError(f"--gpus {value}: {bad or 'a GPU listed twice'}; this host's GPUs are 0 to {count - 1}")
        return indices
    raise ValueError(f"--gpus {value!r}: accepted: all, a count (2), or GPU indices (0,1)"
                     + ("" if count else "; this host has no GPU, so a count of interpreter workers"))


def _tune_spread(named, args, console: Console, store) -> int:
    """``tune --gpus`` (a thread and a candidates' process per GPU of this host) or ``--ray`` (an actor
    per GPU of a cluster)."""
    from gemmtune.cli import report
    from gemmtune.tuning import cluster, spread
    from gemmtune.tuning.tuner import TuneOptions

    if args.gpus and args.ray:
        raise ValueError("--gpus and --ray: choose one (Ray gives each task a GPU of its own)")
    if args.gpus and args.in_process:
        raise ValueError("--gpus and --in-process: choose one (--gpus runs each GPU's candidates in a process "
                         "of its own)")
    options = TuneOptions(strategy=args.strategy, budget=parse_budget(args.budget))
    common = {"location": args.cache, "options": options, "retune": args.retune}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn())
    problems = [n.problem for n in named]
    with Progress(*columns, console=_console(stderr=True), transient=True) as progress:
        if args.ray:
            task = progress.add_task("tuning on Ray", total=len(named))
            done = cluster.tune(problems, address=None if args.ray == "local" else args.ray, **common,
                                isolate=not args.in_process, on_result=lambda _: progress.advance(task))
        else:
            gpus = gpus_of(args.gpus)
            task = progress.add_task(f"tuning on {len(gpus)} {'GPUs' if gpus[0] is not None else 'lanes'}",
                                     total=len(named))
            done = spread.tune(problems, gpus, **common, on_result=lambda _: progress.advance(task))
    tuned = [(n, done.results[n.problem.key()]) for n in named if n.problem.key() in done.results]
    if args.json:
        console.print_json(json.dumps([report.result_dict(r, n.name) for n, r in tuned]))
    elif tuned:
        console.print(report.results_table([r for _, r in tuned], [n.name for n, _ in tuned]))
    for problem in done.given_up:
        console.print(f"[red]given up: {problem.describe()} (its tuning failed each time it was tried; "
                      "the warnings above say why)[/red]")
    return 1 if done.given_up or store.failure else 0


def _bench(args, console: Console) -> int:
    from gemmtune.tuning import worker

    worker.start_early([0])  # tuning a shape missing from the store needs it; it boots meanwhile
    try:
        return _bench_started(args, console)
    finally:
        worker.discard_early()


def _bench_started(args, console: Console) -> int:
    from gemmtune import api
    from gemmtune.cli import bench
    from gemmtune.device import current
    from gemmtune.tuning import worker

    device = current()
    if args.rounds < 1 or args.budget_ms <= 0:
        raise ValueError(f"--rounds {args.rounds} --budget-ms {args.budget_ms}: expected a positive count and time")
    if args.inductor and device.interpreter:
        _console(stderr=True).print("[yellow]--inductor needs a CUDA GPU: inductor is left out.[/yellow]")
    named = _named_problems(args, device)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn())
    rows = []
    with Progress(*columns, console=_console(stderr=True), transient=True) as progress:
        task = progress.add_task("the stored choices (tuning any missing)", total=len(named))
        results = api.tune([n.problem for n in named], store=args.cache, isolate=True,
                           on_result=lambda _: progress.advance(task))
        worker.discard_early()  # a child no tuning needed (every shape stored) ends before the timing
        progress.reset(task)
        for item, result in zip(named, results):
            progress.update(task, description=f"timing {item.name}")
            rows.append(bench.measure(item, result, device, inductor=args.inductor, rounds=args.rounds,
                                      budget_ms=args.budget_ms))
            progress.advance(task)
    doc = bench.document(rows, device)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    if args.json:
        console.print_json(json.dumps(rows))
    else:
        console.print(_bench_table(rows, device, args.inductor and not device.interpreter))
    if args.out:
        console.print(f"wrote {args.out} (render it with: gemmtune report {args.out})")
    wrong = [r["name"] for r in rows if not r["verified"]]
    if wrong:
        _console(stderr=True).print(f"[red]gemmtune bench: the stored choice was wrong on {', '.join(wrong)}: "
                                    "tune again with `gemmtune tune --retune`[/red]")
        return 1
    return 0


def _bench_table(rows: list[dict], device, inductor: bool):
    from rich.table import Table

    where = f"{device.name}, {device.sm_count} SMs" if not device.interpreter else "the CPU interpreter: NOT GPU timings"
    table = Table(title=f"gemmtune bench on {where}")
    numeric = ("cuBLAS ms", "gemmtune ms", "speedup", "noise", "TFLOP/s", "rel err") + (
        ("inductor ms", "vs inductor") if inductor else ())
    for column in ("shape", "dtype", "choice") + numeric:
        table.add_column(column, justify="right" if column in numeric else "left")
    for r in rows:
        cells = [f"{r['cublas_ms']:.4f}", f"{r['gemmtune_ms']:.4f}", f"{r['speedup']:.3f}x", f"±{r['noise']:.1%}",
                 f"{r['tflops']:.1f}", f"{r['rel_err']:.1e}" + ("" if r["verified"] else " WRONG")]
        if r["inductor_ms"] is not None:
            cells += [f"{r['inductor_ms']:.4f}", f"{r['inductor_ms'] / r['gemmtune_ms']:.3f}x"]
        table.add_row(r["name"], r["dtype"] + ("+tf32" if r["tf32"] else ""), r["choice"], *cells)
    return table


def _tune_with_progress(api, named, args, console: Console, store):
    from gemmtune.tuning.tuner import TuneOptions

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=_console(stderr=True), transient=True) as progress:
        shapes_task = progress.add_task(f"tuning {named[0].name}", total=len(named))
        trials_task = progress.add_task("candidates", total=None)

        def on_result(result):
            progress.advance(shapes_task)
            done = int(progress.tasks[shapes_task].completed)
            if done < len(named):
                progress.update(shapes_task, description=f"tuning {named[done].name}")
            progress.reset(trials_task)

        options = TuneOptions(strategy=args.strategy, budget=parse_budget(args.budget))
        return api.tune([n.problem for n in named], store=store, retune=args.retune, options=options,
                        isolate=not args.in_process, on_result=on_result,
                        on_trial=lambda trial: progress.advance(trials_task))


def _validate_buckets(named, args, console: Console) -> int:
    from rich.table import Table

    from gemmtune.device import current
    from gemmtune.tuning import buckets
    from gemmtune.tuning.tuner import TuneOptions
    from gemmtune.tuning.worker import IsolatedRunner

    if args.bucket == "exact":
        raise ValueError("--validate needs --bucket pow2 or --bucket log2m")
    options = TuneOptions(strategy=args.strategy, budget=parse_budget(args.budget))
    rows = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn())
    with IsolatedRunner(current()) if not args.in_process else contextlib.nullcontext() as runner, \
            Progress(*columns, console=_console(stderr=True), transient=True) as progress:
        task = progress.add_task("validating buckets", total=len(named))
        for item in named:
            progress.update(task, description=f"validating {item.name}'s {args.bucket} bucket "
                                              f"({args.validate} samples)")
            checks = buckets.validate(item.problem, args.bucket, args.validate, current(), options=options,
                                      runner=runner)
            if not checks:
                _console(stderr=True).print(f"{item.name}: a {args.bucket} bucket of its own (N and K not multiples "
                                            "of 16): it is tuned exactly, so nothing to validate")
            rows += [check.as_dict(item.name) for check in checks]
            progress.advance(task)
    if args.json:
        console.print_json(json.dumps(rows))
        return 0
    table = Table(title=f"bucket {args.bucket}: the bucket's config on sampled shapes vs each shape's own")
    for column in ("shape", "sample", "bucket choice", "exact choice", "loss"):
        table.add_column(column)
    for row in rows:
        loss = "cannot run" if row["loss"] is None else f"{row['loss']:+.1%}"
        table.add_row(row["shape"], row["sample"], row["bucket_choice"], row["exact_choice"], loss)
    console.print(table)
    return 0


def parse_budget(text: str | None) -> Budget:
    """``--budget``: "8" is eight candidates per backend, "2.5s" two and a half seconds."""
    if text is None:
        return Budget()
    try:
        if text.endswith("s"):
            return Budget(seconds=float(text[:-1]))
        return Budget(trials=int(text))
    except ValueError as exc:
        raise ValueError(f"--budget {text!r}: expected a count (8) or seconds (2.5s); {exc}") from None


def _compare(args, console: Console) -> int:
    import torch
    from rich.table import Table

    from gemmtune.cli import compare

    try:
        shape = tuple(int(v) for v in args.input_shape.split(","))
    except ValueError:
        raise ValueError(f"--input-shape {args.input_shape!r}: expected sizes separated by commas, e.g. 256,1024") from None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        console.print("[yellow]No CUDA GPU: only eager and gemmtune run, and their timings are CPU timings, "
                      "NOT GPU timings.[/yellow]")
    model = compare.load_model(args.model, features=shape[-1])
    x = torch.randn(shape, device=device, dtype=compare.DTYPES[args.dtype])
    table = Table(title=f"gemmtune compare: {args.model}, {args.dtype}, input {list(shape)}")
    for column in ("mode", "setup s", "GPU ms", "host µs/call", "host ×eager", "rel err"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    before = torch.get_float32_matmul_precision()
    if args.dtype == "float32":
        torch.set_float32_matmul_precision("high")  # the seeds' advice, for every mode alike
    try:
        rows = compare.run(model, x, tuple(args.modes or compare.MODES),
                           on_row=lambda r: console.print(f"{r.mode}: {r.host_us_per_call:.1f} µs/call", style="dim"))
    finally:
        torch.set_float32_matmul_precision(before)
    for r in rows:
        table.add_row(r.mode, f"{r.setup_s:.2f}", "-" if r.gpu_ms is None else f"{r.gpu_ms:.4f}",
                      f"{r.host_us_per_call:.1f}", f"{r.host_vs_eager:.2f}", f"{r.max_rel_err:.1e}")
    console.print(table)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    doc = compare.document(rows, model=args.model, dtype=args.dtype, input_shape=shape, device=name)
    args.out.write_text(json.dumps(doc, indent=1))
    console.print(f"wrote {args.out}")
    if not args.no_png:
        png = args.out.with_suffix(".png")
        compare.chart(doc, png)
        console.print(f"wrote {png}")
    return 0


def _report(args, console: Console) -> int:
    from gemmtune.cli import report, zoo_report

    doc = report.read_results(args.results)
    to_markdown, to_png = (zoo_report.markdown, zoo_report.png) if doc["kind"] == "models" else \
        (report.suite_markdown, report.suite_png)
    out = args.out or args.results.parent
    out.mkdir(parents=True, exist_ok=True)
    markdown = out / (args.results.stem + ".md")
    markdown.write_text(to_markdown(doc))
    written = [markdown]
    if not args.no_png:
        png = out / (args.results.stem + ".png")
        to_png(doc, png)
        written.append(png)
    console.print("\n".join(f"wrote {path}" for path in written))
    return 0


def _cache(args, console: Console) -> int:
    from gemmtune.cli import report
    from gemmtune.store import open_store

    store = open_store(args.cache, strict=True)  # a store that cannot be used is this command's error
    if args.action == "list":
        choices = store.choices(args.device)
        console.print(f"store: {store.path} ({store.size_bytes() / 1024:.0f} KiB), {len(choices)} choices")
        if choices:
            console.print(report.results_table(choices, [r.problem_key for r in choices]))
    elif args.action == "show":
        from gemmtune.device import current

        device = args.device or current().fingerprint()
        choice = store.get(device, args.problem)
        if choice is None:
            raise ValueError(f"no stored choice for {args.problem!r} on device {device}")
        trials = store.trials(device, args.problem)
        console.print(report.results_table([choice], [args.problem]))
        console.print(report.trials_table(trials))
        console.print(report.graph_line(choice, trials))
    elif args.action == "export":
        count = store.export_json(args.path, args.device)
        console.print(f"exported {count} choices to {args.path}")
    elif args.action == "import":
        count = store.import_json(args.path)
        console.print(f"imported {count} choices into {store.path}")
    elif args.action == "clear":
        count = store.clear(args.device)
        console.print(f"removed {count} choices from {store.path}")
    elif args.action == "merge":
        from gemmtune.store import merge

        for source in args.sources:
            with open_store(source, strict=True) as opened:
                copied, kept = merge([opened], store)
            console.print(f"merged {opened.path} into {store.path}: {copied} choices copied, "
                          f"{kept} already there as new or newer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
