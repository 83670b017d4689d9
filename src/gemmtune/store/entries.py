"""The store's entries: a choice as a row and back, and the validation every entry passes on its
way in and out (a config read from a store or a shared file must not launch an invalid kernel),
shared by the SQLite store and the server store. JSON only; never pickle, eval or exec."""

from __future__ import annotations

import json
import logging
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gemmtune import atomic_file, backends, kernel_config
from gemmtune.errors import StoreError
from gemmtune.problem import Problem
from gemmtune.results import Status, Timing, Trial, TuneResult
from gemmtune.version import __version__

EXPORT_FORMAT = "gemmtune-store"
EXPORT_VERSION = 1
MAX_DEVICE_CHARS = 200
FIELDS = ("device", "problem", "backend", "config", "time_ms", "cublas_ms", "rel_err", "tune_s", "gpu_timings")
NUMBERS = {"time_ms": (False, True), "cublas_ms": (True, False), "rel_err": (True, False), "tune_s": (False, False)}

log = logging.getLogger("gemmtune.store")


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def entry_of_result(result: TuneResult) -> dict:
    return {"device": result.device, "problem": result.problem_key, "backend": result.backend,
            "config": result.config, "time_ms": result.time_ms, "cublas_ms": result.cublas_ms,
            "rel_err": result.rel_err, "tune_s": result.tune_s, "gpu_timings": result.gpu_timings}


def choice_row(entry: dict, version: str | None, now: str) -> tuple:
    return (entry["device"], entry["problem"], entry["backend"], json.dumps(entry["config"]), entry["time_ms"],
            entry["cublas_ms"], entry["rel_err"], entry["tune_s"], int(entry["gpu_timings"]), version, now)


def trial_row(device: str, problem_key: str, trial: Trial, now: str) -> tuple:
    samples = None if trial.timing is None else json.dumps(list(trial.timing.samples))
    return (device, problem_key, trial.backend, json.dumps(trial.config), Status(trial.status).value,
            trial.reason, samples, trial.rel_err, now)


def _loads(text: Any) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError, RecursionError):
        return None


def result_of_row(row: tuple) -> TuneResult | None:
    device, key, backend, config_json, time_ms, cublas_ms, rel_err, tune_s, gpu = row
    entry = {"device": device, "problem": key, "backend": backend, "config": _loads(config_json),
             "time_ms": time_ms, "cublas_ms": cublas_ms, "rel_err": rel_err, "tune_s": tune_s,
             "gpu_timings": bool(gpu) if gpu in (0, 1) else gpu}
    entry, problems = validate_entry(entry)
    if problems:
        log.warning("skipping the stored choice for %s on %s: %s", key, device, "; ".join(problems))
        return None
    return TuneResult(problem_key=key, device=device, backend=entry["backend"], config=entry["config"],
                      time_ms=entry["time_ms"], cublas_ms=entry["cublas_ms"], tune_s=entry["tune_s"],
                      rel_err=entry["rel_err"], from_store=True, gpu_timings=entry["gpu_timings"])


def trial_of_row(row: tuple) -> Trial | None:
    backend, config_json, status, reason, samples_json, rel_err = row
    try:
        samples = None if samples_json is None else tuple(float(s) for s in json.loads(samples_json))
        return Trial(backend, json.loads(config_json), Status(status),
                     None if samples is None else Timing(samples), rel_err, reason)
    except (TypeError, ValueError) as exc:
        log.warning("skipping an unreadable stored trial of %s: %s", backend, exc)
        return None


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())  # JSON only: a shared file must never be able to run code
    except (ValueError, RecursionError) as exc:
        raise StoreError(f"{path} is not a JSON file: {exc}") from None


def validated_entries(document: Any, path: Path) -> list[dict]:
    if not isinstance(document, dict) or document.get("format") != EXPORT_FORMAT:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise StoreError(f"{path}: format must be {EXPORT_FORMAT!r}, got {found!r}")
    version = document.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= EXPORT_VERSION:
        raise StoreError(f"{path}: version {version!r} is not one this gemmtune reads (1 to {EXPORT_VERSION}); "
                         "a newer file needs a newer gemmtune")
    entries = document.get("choices")
    if not isinstance(entries, list):
        raise StoreError(f"{path}: 'choices' must be a list, got {type(entries).__name__}")
    results = [validate_entry(entry) for entry in entries]
    invalid = [f"entry {i}: {'; '.join(problems)}" for i, (_, problems) in enumerate(results) if problems]
    if invalid:
        raise StoreError(f"{path}: {len(invalid)} of {len(entries)} entries are invalid; nothing imported:\n"
                         + "\n".join(invalid))
    return [entry for entry, _ in results]


def validate_entry(entry: Any) -> tuple[dict, list[str]]:
    """The entry made canonical (config as its backend writes it), and every problem found."""
    if not isinstance(entry, dict):
        return {}, [f"must be an object with keys {list(FIELDS)}, got {type(entry).__name__}"]
    problems = []
    if missing := [k for k in FIELDS if k not in entry]:
        problems.append(f"missing keys {missing}")
    if extra := sorted(str(k) for k in entry if k not in FIELDS):
        problems.append(f"unexpected keys {extra}; accepted: {list(FIELDS)}")
    clean = dict(entry)
    if "device" in entry and not is_label(entry["device"], MAX_DEVICE_CHARS):
        problems.append(f"device must be a non-empty printable str of at most {MAX_DEVICE_CHARS} chars, "
                        f"got {entry['device']!r}")
    if "problem" in entry and (issue := _problem_issue(entry["problem"])):
        problems.append(issue)
    for name in NUMBERS:
        if name in entry and (issue := _number_issue(name, entry[name])):
            problems.append(issue)
        elif name in entry and entry[name] is not None:
            clean[name] = float(entry[name])
    if "gpu_timings" in entry and not isinstance(entry["gpu_timings"], bool):
        problems.append(f"gpu_timings must be true or false, got {entry['gpu_timings']!r}")
    if "backend" in entry:
        config, issue = _parse_config(entry["backend"], entry.get("config"))
        problems += [issue] if issue else []
        clean["config"] = config
    if "problem" in entry and "backend" in entry and \
            kernel_config.is_kernel_key(entry["problem"]) != (entry["backend"] == kernel_config.BACKEND):
        problems.append(f"backend {kernel_config.BACKEND!r} goes with a kernel key ({kernel_config.KEY_PREFIX}...) "
                        f"and no other, got {entry['backend']!r} for {entry['problem']!r:.80}")
    return clean, problems


def is_label(value: Any, max_chars: int) -> bool:
    return isinstance(value, str) and 0 < len(value) <= max_chars and value.isprintable()


def _problem_issue(value: Any) -> str | None:
    if kernel_config.is_kernel_key(value):
        issue = kernel_config.key_issue(value)
        return None if issue is None else f"problem: {issue}"
    try:
        Problem.from_key(value)
    except ValueError as exc:
        return f"problem: {exc}"
    return None


def _number_issue(name: str, value: Any) -> str | None:
    nullable, positive = NUMBERS[name]
    if value is None and nullable:
        return None
    if _finite(value) and (value > 0 if positive else value >= 0):
        return None
    accepted = f"a finite number {'> 0' if positive else '>= 0'}{' or null' if nullable else ''}"
    return f"{name} must be {accepted}, got {value!r}"


def _finite(value: Any) -> bool:
    # bool is an int to Python, but true is no time: refuse it where a number belongs
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # a JSON integer too large for a float
        return False


def _parse_config(backend: Any, config: Any) -> tuple[dict | None, str | None]:
    accepted = [*backends.names(), kernel_config.BACKEND]
    if not isinstance(backend, str) or backend not in accepted:
        return None, f"backend must be one of {accepted}, got {backend!r}"
    if not isinstance(config, dict):
        return None, f"config must be an object, got {type(config).__name__}"
    try:
        if backend == kernel_config.BACKEND:
            return kernel_config.KernelConfig.from_dict(config).as_dict(), None
        return backends.get(backend).parse_config(config).as_dict(), None
    except (ValueError, TypeError) as exc:
        return None, f"config: {exc}"


def export_document(path: Path, results: list[TuneResult]) -> int:
    """Write ``results`` as an export file (JSON, written whole or not at all); how many."""
    entries = [entry_of_result(result) for result in results]
    document = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "gemmtune": __version__, "choices": entries}
    atomic_file.write(path, json.dumps(document, indent=1, allow_nan=False) + "\n")
    return len(entries)


def import_entries(path: Path) -> tuple[list[dict], str | None]:
    """The validated entries of an export file (StoreError for the whole file where one is
    invalid), and the gemmtune version that wrote it."""
    document = read_json(path)
    entries = validated_entries(document, path)
    source = document.get("gemmtune")
    return entries, source if is_label(source, 64) else None
