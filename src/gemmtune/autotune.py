"""``gemmtune.autotune``: the drop-in for ``@triton.autotune`` on a user's own Triton kernels.

It takes triton.autotune's arguments with their meaning (``configs``, ``key``,
``prune_configs_by``, ``reset_to_zero``, ``restore_value``, ``pre_hook``, ``post_hook``,
``warmup``, ``rep``, ``use_cuda_graph``, ``do_bench``, ``cache_results``), so changing the import
is the migration, and adds what triton's lacks:

- the choice is kept in gemmtune's store, keyed by the kernel's source (an edited kernel tunes
  again), its config list, the key arguments' values, the tensor arguments' dtypes and the device
  fingerprint (GPU and software versions): a second process launches the stored config without
  timing anything (``cache_results`` is accepted and always on);
- every config is checked before it may win (``gemmtune.tuning.autotuner``): against
  ``reference=``, a function of the call's arguments by name that writes the outputs with torch,
  else against the outputs most configs agree on; ``outputs=`` names the output arguments where
  the first run cannot show them;
- configs are timed side by side in interleaved rounds with L2 flushed between calls; a config
  that raises is a failed trial; with ``isolate=True`` tuning runs in a child process on copies of
  the arguments (``gemmtune.tuning.kernel_worker``), so a config that faults, kills its process or
  hangs is a failed trial too, and the program goes on;
- ``GEMMTUNE_MODE=lookup`` never tunes: a miss runs ``default=`` (a config of the list; the first
  by default), logged once and appended to ``GEMMTUNE_MISSES`` (where set) for
  ``gemmtune tune --from``; so does a miss while a CUDA graph is being captured, not kept, so the
  next call outside the capture tunes;
- one log line per tuning (as ``TRITON_PRINT_AUTOTUNING`` prints), through gemmtune's logging;
- ``strategy=`` and ``budget=`` for long config lists: ``"random"`` or ``"descent"`` (from a config
  to the neighbour one field apart that screens fastest) tries at most ``budget`` configs, each
  screened alone, and only those are checked and timed side by side; ``"exhaustive"`` (the
  default) tries every config, or the first ``budget``.

After tuning, every tensor argument holds what it held before, and the call runs once with the
chosen config.

Inside ``torch.compile`` the call is what the compiler takes from ``triton.autotune``: a Triton
kernel with its configs, launched from the generated code without a graph break. When Dynamo
traces a call, gemmtune looks its key up (in this process, then in the store) and hands the
compiler a ``triton.autotune`` of the kernel over the one config it found, so the compiled code
runs gemmtune's verified choice and times nothing. Where nothing is stored for the key it hands
over every config, and the compiler tunes them as it would triton's (logged once per key); in
lookup mode, the default config alone. A key argument that the compiler would make dynamic is
specialized: a graph per key value, each with its choice.

A store hit costs one key (the key arguments' values and the tensor arguments' dtypes) and a
dict lookup before the launch. What differs from triton.autotune: configs that
``early_config_prune`` returns must be configs of the list (a choice is stored as its place in
it); ``do_bench``, when given, replaces gemmtune's timing; later calls do not run
``reset_to_zero`` (as triton's do not).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gemmtune import settings
from gemmtune.backends import triton_key
from gemmtune.device import current
from gemmtune.kernel_config import KernelConfig, kernel_key
from gemmtune.results import Timing
from gemmtune.shapes import append_miss
from gemmtune.store import ServerStore, Store, open_store
from gemmtune.tuning import autotuner, kernel_worker

log = logging.getLogger("gemmtune")

PRUNE_KEYS = ("perf_model", "top_k", "early_config_prune")


def autotune(configs: Sequence, key: Sequence[str], prune_configs_by: dict | None = None,
             reset_to_zero: Sequence[str] | None = None, restore_value: Sequence[str] | None = None,
             pre_hook: Callable | None = None, post_hook: Callable | None = None, warmup: int | None = None,
             rep: int | None = None, use_cuda_graph: bool = False, do_bench: Callable | None = None,
             cache_results: bool = False, *, reference: Callable | None = None,
             outputs: Sequence[str] | None = None, default: Any = None, isolate: bool = False,
             strategy: str = "exhaustive", budget: int | None = None) -> Callable:
    """Decorate a ``@triton.jit`` function as ``triton.autotune`` does (see the module's docstring
    for what gemmtune adds and what differs)."""

    def decorator(fn) -> Autotuned:
        return Autotuned(fn, configs, key, prune_configs_by=prune_configs_by, reset_to_zero=reset_to_zero,
                         restore_value=restore_value, pre_hook=pre_hook, post_hook=post_hook, rep=rep,
                         use_cuda_graph=use_cuda_graph, do_bench=do_bench, reference=reference,
                         outputs=outputs, default=default, isolate=isolate, strategy=strategy, budget=budget)

    return decorator


def _traced_as_constant(method: Callable) -> Callable:
    """``method`` marked as ``torch.compiler.assume_constant_result`` marks a function: Dynamo
    calls it while tracing, with the traced values' constants, and keeps its result. Marked here
    as that function does, since calling it would import torch._dynamo (1.1 s) with gemmtune;
    tests/test_autotune.py checks that the mark is still the one it sets."""
    method._dynamo_marked_constant = True
    return method


class Autotuned:
    """A Triton kernel under ``gemmtune.autotune``: ``kernel[grid](*args, **kwargs)`` as with
    ``triton.autotune``; ``best_config`` is the config of the last call, ``cache`` the config of
    each key met in this process (triton.autotune's attributes)."""

    def __init__(self, fn, configs: Sequence, key: Sequence[str], *, prune_configs_by: dict | None,
                 reset_to_zero: Sequence[str] | None, restore_value: Sequence[str] | None,
                 pre_hook: Callable | None, post_hook: Callable | None, rep: int | None, use_cuda_graph: bool,
                 do_bench: Callable | None, reference: Callable | None, outputs: Sequence[str] | None,
                 default: Any, isolate: bool = False, strategy: str = "exhaustive",
                 budget: int | None = None) -> None:
        self.fn = fn
        self.arg_names = list(getattr(fn, "arg_names", None) or _not_a_kernel(fn))
        triton_key.install()  # a second process finds the chosen binary without hashing Triton first
        self.configs = list(configs) or [_default_config()]
        self.keys = _names("key", key, self.arg_names)
        self.reset_to_zero = _names("reset_to_zero", reset_to_zero or (), self.arg_names)
        self.restore_value = _names("restore_value", restore_value or (), self.arg_names)
        self.outputs = _names("outputs", outputs or (), self.arg_names)
        self.prune = _prune_options(prune_configs_by)
        self.prune_configs_by = prune_configs_by  # as given: what the compiler is handed (_as_triton_autotune)
        self.pre_hook, self.post_hook = pre_hook, post_hook
        self.reference, self.do_bench = reference, do_bench
        self.budget_ms = float(rep) if rep else autotuner.BUDGET_MS
        self.graphs = use_cuda_graph
        self.isolate = isolate
        if strategy not in autotuner.STRATEGIES:
            raise ValueError(f"autotune: strategy={strategy!r} is not a strategy over a config list; accepted: "
                             f"{', '.join(autotuner.STRATEGIES)} (a cost model ranks configs through "
                             "prune_configs_by={'perf_model': ..., 'top_k': ...}, as with triton.autotune)")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"autotune: budget={budget!r} must be None (no limit) or the most configs to try, "
                             "an int >= 1")
        self.strategy, self.budget = strategy, budget
        self.data = [KernelConfig.of(i, config) for i, config in enumerate(self.configs)]
        self.default = self._default(default)
        self._default_label = self.data[self._index(self.default)].label()
        base = _base_function(fn)
        self.name, self.module = getattr(base, "__qualname__", "kernel"), getattr(base, "__module__", None)
        self.configs_hash = _digest(json.dumps([d.as_dict() for d in self.data], sort_keys=True))
        self.cache: dict[tuple, Any] = {}
        self.best_config = None
        self._for_compiler: list = []  # triton.autotune over each config, then over all (_compiler_kernel)
        self._source_hash: str | None = None
        self._lock = threading.Lock()
        self._said: set[tuple] = set()

    def __getitem__(self, grid) -> Callable:
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)

    def run(self, *args, grid, warmup: bool = False, **kwargs):
        if warmup:
            return self.warmup(*args, grid=grid, **kwargs)
        named = dict(zip(self.arg_names, args))
        named.update(kwargs)
        call_key = self._call_key(named)
        if torch.compiler.is_compiling():
            index = self._compiler_kernel(_concrete(call_key))  # fills _for_compiler: read it after
            return self._for_compiler[index][grid](*args, **kwargs)
        config = self.cache.get(call_key)
        if config is None:
            config = self._resolve(call_key, args, kwargs, grid, named)
        self.best_config = config
        return self._launch(config, args, kwargs, grid, named)

    def warmup(self, *args, grid, **kwargs) -> list:
        """Compile every config the pruning keeps for these arguments, running none."""
        named = dict(zip(self.arg_names, args), **kwargs)
        return [self.fn.warmup(*args, grid=grid, **kwargs, **config.all_kwargs())
                for config in self._pruned(named, kwargs)]

    # --- one key, one choice ---------------------------------------------------------------------

    def _call_key(self, named: dict) -> tuple:
        values = tuple(_key_value(named.get(name)) for name in self.keys)
        return values + tuple(str(v.dtype) for v in named.values() if isinstance(v, torch.Tensor))

    def _store_key(self, call_key: tuple) -> str:
        if self._source_hash is None:
            self._source_hash = _source_hash(self.fn)
        arguments = ";".join(map(str, call_key))
        return kernel_key(self.name, self._source_hash, self.configs_hash, arguments)

    def _resolve(self, call_key: tuple, args: tuple, kwargs: dict, grid, named: dict):
        """The config for a key first seen in this process: the store's, else tuned now (or the
        default, in lookup mode or inside a CUDA graph capture)."""
        with self._lock:
            if call_key in self.cache:
                return self.cache[call_key]
            key = self._store_key(call_key)
            device = current()
            with open_store() as store:  # a miss's: one connection, closed after
                config = self._stored(store.get(device.fingerprint(), key))
                if config is None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    self._say_once(call_key, "gemmtune.autotune: %s has no stored config for %s inside a CUDA graph "
                                   "capture, so the graph runs %s; call it once before capturing", self.name,
                                   call_key, self._default_label)
                    return self.default  # not kept: the next call outside the capture tunes it
                if config is None:
                    config = self._missed(key, call_key, args, kwargs, grid, named, device, store)
            self.cache[call_key] = config
            return config

    @_traced_as_constant
    def _compiler_kernel(self, call_key: tuple) -> int:
        """Which kernel of ``_for_compiler`` a call traced by Dynamo launches (run while tracing,
        so nothing is timed here): a ``triton.autotune`` of the kernel over the config chosen for
        ``call_key`` (this process's, else the store's), else the last, over every config, for the
        compiler to tune; in lookup mode the default's. An index, not the kernel: Dynamo keeps a
        constant result without a source to guard, and finds the kernel by its place in
        ``_for_compiler``, which is filled once, so its guards hold."""
        with self._lock:
            config = self.cache.get(call_key)
            if config is None:
                with open_store() as store:
                    config = self._stored(store.get(current().fingerprint(), self._store_key(call_key)))
                if config is not None:
                    self.cache[call_key] = config
            if not self._for_compiler:
                self._for_compiler = [*(self._as_triton_autotune([c]) for c in self.configs),
                                      self._as_triton_autotune(self.configs)]
        if config is None and (len(self.configs) == 1 or settings.mode() == "lookup"):
            config = self.default  # the one config where there is one
        if config is None:
            self._say_once(("compile", call_key), "gemmtune.autotune: %s has no stored config for %s while "
                           "torch.compile traces it, so the compiler tunes its %d configs; a call outside "
                           "torch.compile first (or gemmtune tune --from) compiles gemmtune's choice", self.name,
                           call_key, len(self.configs))
        return len(self.configs) if config is None else self._index(config)

    def _as_triton_autotune(self, configs: list):
        """``triton.autotune`` of the kernel over ``configs``, with this decorator's other
        arguments (the compiler refuses hooks, as it refuses triton.autotune's)."""
        import triton

        return triton.autotune(configs, key=list(self.keys), prune_configs_by=self.prune_configs_by,
                               reset_to_zero=list(self.reset_to_zero) or None,
                               restore_value=list(self.restore_value) or None, pre_hook=self.pre_hook,
                               post_hook=self.post_hook)(self.fn)

    def _stored(self, result) -> Any:
        """The stored choice's config, where the config at its place in the list has its values."""
        if result is None:
            return None
        data = KernelConfig.from_dict(result.config)
        if data.index < len(self.data) and self.data[data.index] == data:
            return self.configs[data.index]
        return None

    def _missed(self, key: str, call_key: tuple, args, kwargs, grid, named: dict, device,
                store: Store | ServerStore):
        if len(self.configs) == 1:
            return self.configs[0]
        if settings.mode() == "lookup":
            self._say_once(call_key, "gemmtune.autotune: %s has no stored config for %s (lookup mode), so it runs %s",
                           self.name, call_key, self._default_label)
            self._record_miss(key, args, kwargs, grid, named)
            return self.default
        result, config = self._tune(key, args, kwargs, grid, named, device)
        if result is not None:
            store.put(result)
            timed = sum(t.timing is not None for t in result.trials)
            log.info("gemmtune.autotune: tuned %s for %s in %.1f s: %s, %.4f ms (%d configs timed, %d failed)",
                     self.name, call_key, result.tune_s, KernelConfig.from_dict(result.config).label(),
                     result.time_ms, timed, sum(not t.ok for t in result.trials))
        return config

    def _record_miss(self, key: str, args, kwargs, grid, named: dict) -> None:
        """The call appended to ``GEMMTUNE_MISSES``, for ``gemmtune tune --from``: where another
        process can rebuild it (the kernel importable by name, its arguments tensors and plain
        values), else said once."""
        path = settings.misses_file()
        if path is None:
            return
        pruned = [self._index(config) for config in self._pruned(named, kwargs)]
        call = kernel_worker.recorded_call(self, key, args, kwargs, grid, named, pruned)
        if call is None:
            self._say_once(("miss",), "gemmtune.autotune: %s cannot be recorded in GEMMTUNE_MISSES: another process "
                           "must import it by name (a kernel at a module's top level) and its arguments must be "
                           "tensors and plain values", self.name)
            return
        append_miss(path, call)

    def _tune(self, key: str, args, kwargs, grid, named: dict, device):
        pruned = [self._index(config) for config in self._pruned(named, kwargs)]
        if self.isolate:
            place, why = kernel_worker.where(self), kernel_worker.unsupported(named)
            if place is not None and why is None:
                return kernel_worker.tune(self, place, args, kwargs, grid, named, pruned, device, key)
            self._say_once(("isolate",), "gemmtune.autotune: %s is tuned in this process: %s", self.name,
                           why or "the kernel cannot be imported by name in another process (made in __main__ or "
                                  "in a function)")
        call = self.tuning_call(lambda config: self.launch_for_tuning(config, args, kwargs, grid, named), named)
        candidates = [(self.data[i], self.configs[i]) for i in pruned]
        return autotuner.tune(call, candidates, device, key, **self.tuning_options())

    def tuning_call(self, launch: Callable, named: dict) -> autotuner.Call:
        """The call to tune: ``launch(config)`` runs it with a config; ``named``, its arguments."""
        tensors = {name: value for name, value in named.items() if isinstance(value, torch.Tensor)}
        reference = None if self.reference is None else (lambda _tensors: self.reference(**named))
        return autotuner.Call(launch, tensors, outputs=self.outputs, restored=self.restore_value,
                              zeroed=self.reset_to_zero, reference=reference)

    def tuning_options(self) -> dict:
        """How ``autotuner.tune`` times the configs: gemmtune's measurement, or ``do_bench``."""
        timer = None if self.do_bench is None else self._user_timer
        return {"budget_ms": self.budget_ms, "graphs": self.graphs, "timer": timer, "strategy": self.strategy,
                "trials": self.budget}

    def _user_timer(self, runs: dict[str, Callable]) -> dict[str, Timing]:
        """``do_bench``'s median of each run, where the user gave one."""
        return {name: Timing((float(_first(self.do_bench(run, quantiles=(0.5, 0.2, 0.8)))),))
                for name, run in runs.items()}

    def _pruned(self, named: dict, kwargs: dict) -> list:
        """The configs left after ``prune_configs_by``, as triton.autotune prunes them: the
        positional arguments by name, the keyword ones as keywords."""
        configs = self.configs
        early, perf_model, top_k = self.prune
        named = {name: value for name, value in named.items() if name not in kwargs}
        if early is not None:
            configs = list(early(self.configs, named, **kwargs))
            if not configs:
                raise ValueError("gemmtune.autotune: early_config_prune returned no config; it must return at least one")
            for config in configs:
                self._index(config)
        if perf_model is not None:
            k = int(len(self.configs) * top_k) if isinstance(top_k, float) and top_k <= 1.0 else top_k
            if not isinstance(k, int):
                raise TypeError(f"gemmtune.autotune: top_k must be a float <= 1.0 or an int, got {top_k!r}")
            if len(configs) > k:
                estimate = {id(c): perf_model(**named, **kwargs, **c.all_kwargs()) for c in configs}
                configs = sorted(configs, key=lambda c: estimate[id(c)])[:max(k, 1)]
        return configs

    def _index(self, config) -> int:
        for i, mine in enumerate(self.configs):
            if config is mine:
                return i
        for i, mine in enumerate(self.configs):
            if config == mine:
                return i
        raise ValueError(f"gemmtune.autotune: early_config_prune returned a config that is not in configs= "
                         f"({config}); gemmtune stores a choice as its place in the list")

    def _default(self, default):
        if default is None:
            return self.configs[0]
        self._index(default)
        return default

    def _say_once(self, call_key: tuple, message: str, *args) -> None:
        if call_key not in self._said:
            self._said.add(call_key)
            log.warning(message, *args)

    # --- launches ----------------------------------------------------------------------------------

    def _launch(self, config, args: tuple, kwargs: dict, grid, named: dict):
        """A call with ``config``: its pre-hook, then the kernel (as triton.autotune's calls)."""
        meta = _meta(config, kwargs)
        if config.pre_hook is not None:
            config.pre_hook({**named, **meta})
        return self.fn.run(*args, grid=grid, warmup=False, **kwargs, **meta)

    def launch_for_tuning(self, config, args: tuple, kwargs: dict, grid, named: dict) -> None:
        """One tuning run, as triton.autotune's: the config's pre-hook, the decorator's pre-hook
        (else reset_to_zero), the kernel, the post-hook."""
        meta = _meta(config, kwargs)
        full = {**named, **meta}
        if config.pre_hook is not None:
            config.pre_hook(full)
        if self.pre_hook is not None:
            self.pre_hook(full)
        for name in () if self.pre_hook is not None else self.reset_to_zero:
            named[name].zero_()
        try:
            self.fn.run(*args, grid=grid, warmup=False, **kwargs, **meta)
        except Exception as error:
            if self.post_hook is not None:
                self.post_hook(full, exception=error)
            raise
        if self.post_hook is not None:
            self.post_hook(full, exception=None)


def _concrete(value: Any) -> Any:
    """A key as Dynamo traces it, its integers made constants: one that Dynamo holds as a symbol
    (a dynamic shape; it reads as an int to the traced code) specializes the graph on its value,
    as the key asks (a choice per value). The key itself outside Dynamo, and bools stay bools."""
    if type(value) is int:
        return operator.index(value)
    if type(value) is tuple:
        return tuple(_concrete(v) for v in value)
    return value


def _meta(config, kwargs: dict) -> dict:
    """The config's meta-parameters and launch settings, none of them passed by the caller too."""
    if conflicts := kwargs.keys() & config.kwargs.keys():
        raise ValueError(f"Conflicting meta-parameters: {', '.join(sorted(conflicts))}. "
                         "Make sure that you don't re-define auto-tuned symbols.")
    return config.all_kwargs()


def _default_config():
    import triton

    return triton.Config({}, num_warps=4, num_stages=3, num_ctas=1)


def _not_a_kernel(value: Any):
    raise TypeError(f"gemmtune.autotune decorates a @triton.jit function (with arg_names), got {type(value).__name__}")


def _names(argument: str, names: Sequence[str], arg_names: list[str]) -> tuple[str, ...]:
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"gemmtune.autotune({argument}=...): expected a list of argument names, got {names!r}")
    if unknown := [n for n in names if n not in arg_names]:
        raise ValueError(f"gemmtune.autotune({argument}=...): {unknown} are not arguments of the kernel; "
                         f"accepted: {arg_names}")
    return tuple(names)


def _prune_options(options: dict | None) -> tuple:
    if options is None:
        return None, None, 1.0
    if not isinstance(options, dict) or set(options) - set(PRUNE_KEYS):
        raise ValueError(f"gemmtune.autotune(prune_configs_by=...): a dict with keys among {list(PRUNE_KEYS)}, "
                         f"got {options!r:.120}")
    return options.get("early_config_prune"), options.get("perf_model"), options.get("top_k", 1.0)


def _key_value(value: Any) -> Any:
    """A key argument's value as the key holds it: a tensor by its shape (triton's key would hold
    the tensor itself), anything else as it is."""
    return tuple(value.shape) if isinstance(value, torch.Tensor) else value


def _base_function(fn) -> Callable:
    while not inspect.isfunction(fn) and hasattr(fn, "fn"):
        fn = fn.fn
    return fn


def _source_hash(fn) -> str:
    """A hash of the kernel's source: Triton's own cache key where it has one (the source of the
    functions it calls included), else the Python function's source."""
    cache_key = getattr(fn, "cache_key", None)
    if isinstance(cache_key, str):
        return _digest(cache_key)
    return _digest(inspect.getsource(_base_function(fn)))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _first(value: Any) -> float:
    return value[0] if isinstance(value, (list, tuple)) else value
