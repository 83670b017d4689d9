"""gemmtune.autotune, the drop-in for @triton.autotune: the decorator's semantics (key, dtypes,
prune, hooks, reset/restore), every config checked (a wrong one never chosen, a failing one a
failed trial), the store round trip and lookup mode. Run through Triton's interpreter on the CPU
(on the GPU machine, on the GPU)."""

import json
import logging

import pytest
import torch

import gemmtune
from gemmtune import kernel_config
from gemmtune.autotune import Autotuned, _traced_as_constant
from gemmtune.device import current
from gemmtune.results import Status, Timing
from gemmtune.store import Store
from gemmtune.tuning import autotuner

triton = pytest.importorskip("triton")
tl = triton.language

pytestmark = pytest.mark.interpreter
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr, SKIP_LAST: tl.constexpr = False):
    """out = x + y; SKIP_LAST leaves the last element unwritten (a masking bug)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n - 1 if SKIP_LAST else offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


@triton.jit
def plain_add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out = x + y, with no defaulted parameter: torch 2.11's compiler launches a user's kernel
    that has one with too few grid arguments, triton.autotune's or gemmtune's alike."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


@triton.jit
def accumulate_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out += x, atomically: right only on a zeroed out (reset_to_zero)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.atomic_add(out_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


@triton.jit
def add_in_place_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, FAIL: tl.constexpr = False):
    """x += y; FAIL makes the config fail to compile."""
    tl.static_assert(not FAIL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


@triton.jit
def sign_kernel(x_ptr, sign_ptr, abs_ptr, n, BLOCK: tl.constexpr, OFF_BY_ONE: tl.constexpr = False):
    """Two outputs, one of them integer: sign (int32) and |x|; OFF_BY_ONE writes sign + 1."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    sign = tl.where(x > 0, 1, tl.where(x < 0, -1, 0)).to(tl.int32) + (1 if OFF_BY_ONE else 0)
    tl.store(sign_ptr + offs, sign, mask=mask)
    tl.store(abs_ptr + offs, tl.abs(x), mask=mask)


def blocks(*sizes, **extra):
    return [triton.Config({"BLOCK": b, **extra}) for b in sizes]


def grid(n):
    return lambda meta: (triton.cdiv(n, meta["BLOCK"]),)


def operands(n, dtype=torch.float32):
    g = torch.Generator().manual_seed(n)
    x, y = (torch.randn(n, generator=g).to(DEVICE, dtype) for _ in range(2))
    return x, y, torch.empty_like(x)


class Measured(list):
    """The config labels of each measurement gemmtune made; ``order``: labels fastest first."""

    order: list | None = None


@pytest.fixture
def timings(monkeypatch):
    """Records gemmtune's measurements of configs, and times config i as i + 1 ms unless a test
    sets ``order``."""
    calls = Measured()

    def measure(runs, device, **kwargs):
        calls.append(sorted(runs))
        rank = {name: calls.order.index(name) if calls.order else int(name) for name in runs}
        return {name: Timing((1.0 + rank[name],) * 5) for name in runs}

    monkeypatch.setattr(autotuner.measure, "measure", measure)
    return calls


def stored_entries():
    return [r for r in Store().choices() if kernel_config.is_kernel_key(r.problem_key)]


def test_the_decorated_kernel_computes_and_its_choice_is_stored(timings):
    kernel = gemmtune.autotune(configs=blocks(16, 32, 64), key=["n"])(add_kernel)
    x, y, out = operands(100)
    kernel[grid(100)](x, y, out, 100)
    assert torch.equal(out, x + y) and len(timings) == 1 and timings[0] == ["0", "1", "2"]
    assert kernel.best_config.kwargs == {"BLOCK": 16}  # config 0 timed fastest
    (entry,) = stored_entries()
    assert entry.backend == kernel_config.BACKEND and entry.config["index"] == 0
    assert entry.problem_key.startswith("kernel:add_kernel@") and ";torch.float32" in entry.problem_key
    assert [t.status for t in Store().trials(entry.device, entry.problem_key)] == [Status.OK] * 3


def test_a_second_process_launches_the_stored_config_timing_nothing(timings):
    gemmtune.autotune(configs=blocks(16, 32, 64), key=["n"])(add_kernel)[grid(100)](*operands(100), 100)
    timings.order = ["2", "1", "0"]
    again = gemmtune.autotune(configs=blocks(16, 32, 64), key=["n"])(add_kernel)  # a new process's decorator
    x, y, out = operands(100)
    again[grid(100)](x, y, out, 100)
    assert len(timings) == 1 and again.best_config.kwargs == {"BLOCK": 16} and torch.equal(out, x + y)


def test_a_new_key_value_or_dtype_tunes_again_and_a_known_one_does_not(timings):
    kernel = gemmtune.autotune(configs=blocks(16, 32), key=["n"])(add_kernel)
    for n, dtype in [(100, torch.float32), (100, torch.float32), (37, torch.float32), (100, torch.float16)]:
        x, y, out = operands(n, dtype)
        kernel[grid(n)](x, y, out, n)
        assert torch.equal(out, x + y)
    assert len(timings) == 3 and len(stored_entries()) == 3


def test_an_edited_config_list_or_kernel_is_a_new_key(timings):
    gemmtune.autotune(configs=blocks(16, 32), key=["n"])(add_kernel)[grid(64)](*operands(64), 64)
    gemmtune.autotune(configs=blocks(16, 64), key=["n"])(add_kernel)[grid(64)](*operands(64), 64)

    @triton.jit
    def edited(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):  # add_kernel, written another way
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + tl.load(y_ptr + offs, mask=offs < n),
                 mask=offs < n)

    gemmtune.autotune(configs=blocks(16, 32), key=["n"])(edited)[grid(64)](*operands(64), 64)
    keys = [k.split("@")[1].split("/") for k in sorted(e.problem_key for e in stored_entries())]
    assert len(timings) == 3 and len(keys) == 3
    assert len({source for source, _, _ in keys}) == 2 and len({configs for _, configs, _ in keys}) == 2


@pytest.mark.parametrize("with_reference", [True, False])
def test_a_config_that_leaves_an_element_unwritten_is_never_chosen(timings, with_reference):
    """The buggy config times fastest; it is a wrong_result trial, with a reference or against the
    outputs most configs agree on (the output buffer already holding the right values)."""
    configs = blocks(16) + blocks(32, SKIP_LAST=True) + blocks(64)
    reference = (lambda x_ptr, y_ptr, out_ptr, n: out_ptr.copy_(x_ptr + y_ptr)) if with_reference else None
    kernel = gemmtune.autotune(configs=configs, key=["n"], reference=reference)(add_kernel)
    timings.order = ["1", "2", "0"]
    x, y, _ = operands(100)
    out = x + y  # the right values already there: only poisoning finds the unwritten element
    kernel[grid(100)](x, y, out, 100)
    assert kernel.best_config.kwargs == {"BLOCK": 64} and torch.equal(out, x + y)
    (entry,) = stored_entries()
    trials = Store().trials(entry.device, entry.problem_key)
    assert [t.status for t in trials] == [Status.OK, Status.WRONG_RESULT, Status.OK]
    assert ("reference" if with_reference else "most configs agree") in trials[1].reason


def test_every_output_is_checked_an_integer_one_exactly(timings):
    configs = blocks(16) + blocks(32, OFF_BY_ONE=True) + blocks(64)
    kernel = gemmtune.autotune(configs=configs, key=["n"])(sign_kernel)
    timings.order = ["1", "0", "2"]
    x, _, magnitude = operands(77)
    sign = torch.zeros(77, dtype=torch.int32, device=DEVICE)
    kernel[grid(77)](x, sign, magnitude, 77)
    assert kernel.best_config.kwargs == {"BLOCK": 16}
    assert torch.equal(sign, torch.sign(x).to(torch.int32)) and torch.equal(magnitude, x.abs())
    (entry,) = stored_entries()
    assert [t.status for t in Store().trials(entry.device, entry.problem_key)] == [
        Status.OK, Status.WRONG_RESULT, Status.OK]


def test_threads_that_meet_a_new_key_together_tune_it_once(timings):
    import threading

    class OneLaunchAtATime:
        """Triton's interpreter is not thread-safe: launches take turns, the key's resolution does not."""

        def __init__(self, fn):
            self.fn, self.lock = fn, threading.Lock()

        def run(self, *args, **kwargs):
            with self.lock:
                return self.fn.run(*args, **kwargs)

    kernel = gemmtune.autotune(configs=blocks(16, 32), key=["n"])(add_kernel)
    kernel.fn = OneLaunchAtATime(kernel.fn)
    results = []

    def call():
        x, y, out = operands(64)
        kernel[grid(64)](x, y, out, 64)
        results.append(torch.equal(out, x + y))

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 4 and len(timings) == 1


def test_configs_that_disagree_with_no_majority_and_no_reference_store_nothing(timings, caplog):
    kernel = gemmtune.autotune(configs=blocks(16) + blocks(32, SKIP_LAST=True), key=["n"])(add_kernel)
    x, y, out = operands(50)
    with caplog.at_level(logging.WARNING, logger="gemmtune"):
        kernel[grid(50)](x, y, out, 50)
    assert "no config passed its check" in caplog.text and stored_entries() == []
    assert kernel.best_config is kernel.configs[0] and torch.equal(out, x + y)


def test_a_config_that_fails_is_a_failed_trial_and_the_call_goes_on(timings):
    configs = blocks(16, FAIL=True) + blocks(32)
    kernel = gemmtune.autotune(configs=configs, key=["n"])(add_in_place_kernel)
    x, y, _ = operands(40)
    expected = x + y
    kernel[grid(40)](x, y, 40)
    assert torch.equal(x, expected) and kernel.best_config.kwargs == {"BLOCK": 32}
    (entry,) = stored_entries()
    failed, ok = Store().trials(entry.device, entry.problem_key)
    assert failed.status is not Status.OK and not failed.ok and failed.reason and ok.ok


@pytest.mark.parametrize("restore", [True, False])
def test_an_in_place_kernel_runs_once_as_far_as_the_caller_sees(timings, restore):
    """With restore_value as triton.autotune asks, and without it too: gemmtune puts every tensor
    argument back after tuning, then the call runs once."""
    kernel = gemmtune.autotune(configs=blocks(16, 32, 64), key=["n"],
                               restore_value=["x_ptr"] if restore else None)(add_in_place_kernel)
    x, y, _ = operands(70)
    expected = x + y
    kernel[grid(70)](x, y, 70)
    assert torch.equal(x, expected)
    kernel[grid(70)](x, y, 70)  # a stored choice: the plain call
    assert torch.equal(x, expected + y)


def test_reset_to_zero_zeroes_before_each_tuning_run(timings):
    kernel = gemmtune.autotune(configs=blocks(16, 32), key=["n"], reset_to_zero=["out_ptr"])(accumulate_kernel)
    x, _, _ = operands(33)
    out = torch.zeros_like(x)
    kernel[grid(33)](x, out, 33)
    assert torch.equal(out, x)
    (entry,) = stored_entries()
    assert all(t.ok for t in Store().trials(entry.device, entry.problem_key))


def test_hooks_run_as_triton_autotune_runs_them(timings):
    seen = []
    configs = [triton.Config({"BLOCK": 16}, pre_hook=lambda args: seen.append(("config", args["BLOCK"]))),
               triton.Config({"BLOCK": 32})]
    kernel = gemmtune.autotune(configs=configs, key=["n"], pre_hook=lambda args: seen.append(("pre", args["BLOCK"])),
                               post_hook=lambda args, exception: seen.append(("post", exception)))(add_kernel)
    kernel[grid(20)](*operands(20), 20)
    assert ("pre", 16) in seen and ("pre", 32) in seen and ("config", 16) in seen and ("post", None) in seen
    seen.clear()
    kernel[grid(20)](*operands(20), 20)  # a known key: the chosen config's pre-hook alone, as triton's
    assert seen == [("config", 16)]


def test_prune_configs_by_as_triton_autotune(timings):
    def early(configs, named, **kwargs):
        return [c for c in configs if c.kwargs["BLOCK"] <= named["n"]]

    kernel = gemmtune.autotune(configs=blocks(16, 32, 64, 128), key=["n"],
                               prune_configs_by={"early_config_prune": early,
                                                 "perf_model": lambda **kw: -kw["BLOCK"], "top_k": 1})(add_kernel)
    x, y, out = operands(40)
    kernel[grid(40)](x, y, out, 40)
    assert timings == [["0"]] and torch.equal(out, x + y)  # 16 and 32 left, 32 ranked first by the model
    (entry,) = stored_entries()
    assert [t.config["kwargs"]["BLOCK"] for t in Store().trials(entry.device, entry.problem_key)] == [32]


def test_pruning_sees_keyword_arguments_apart_as_triton_autotune_does(timings):
    """triton.autotune hands ``early_config_prune`` the positional arguments by name and the
    keyword ones as keywords; perf_model gets both once (a name in both would be a TypeError)."""
    seen = []

    def early(configs, named, **kwargs):
        seen.append((sorted(named), sorted(kwargs)))
        return [c for c in configs if c.kwargs["BLOCK"] <= kwargs["n"]]

    kernel = gemmtune.autotune(configs=blocks(16, 32, 64), key=["n"],
                               prune_configs_by={"early_config_prune": early,
                                                 "perf_model": lambda **kw: kw["n"] - kw["BLOCK"], "top_k": 1})(add_kernel)
    x, y, out = operands(40)
    kernel[grid(40)](x, y, out, n=40)
    assert seen == [(["out_ptr", "x_ptr", "y_ptr"], ["n"])] and torch.equal(out, x + y)


def test_a_pruning_that_returns_another_config_is_refused(timings):
    kernel = gemmtune.autotune(configs=blocks(16, 32), key=["n"],
                               prune_configs_by={"early_config_prune": lambda c, named: blocks(8)})(add_kernel)
    with pytest.raises(ValueError, match="not in configs="):
        kernel[grid(8)](*operands(8), 8)


def test_lookup_mode_runs_the_default_and_tunes_nothing(timings, monkeypatch, caplog):
    monkeypatch.setenv("GEMMTUNE_MODE", "lookup")
    configs = blocks(16, 32, 64)
    kernel = gemmtune.autotune(configs=configs, key=["n"], default=configs[2])(add_kernel)
    with caplog.at_level(logging.WARNING, logger="gemmtune"):
        for _ in range(2):
            x, y, out = operands(90)
            kernel[grid(90)](x, y, out, 90)
            assert torch.equal(out, x + y)
    assert timings == [] and kernel.best_config is configs[2] and stored_entries() == []
    assert caplog.text.count("lookup mode") == 1


def test_a_stored_choice_that_no_longer_matches_its_config_is_a_miss(timings):
    gemmtune.autotune(configs=blocks(16, 32), key=["n"])(add_kernel)[grid(64)](*operands(64), 64)
    (entry,) = stored_entries()
    kernel = gemmtune.autotune(configs=blocks(16, 32), key=["n"])(add_kernel)
    tampered = kernel_config.KernelConfig(0, (("BLOCK", 32),)).as_dict()
    assert kernel._stored(entry) is kernel.configs[0]
    assert kernel._stored(type(entry)(**{**vars(entry), "config": tampered})) is None


def test_conflicting_meta_parameters_are_an_error(timings):
    kernel = gemmtune.autotune(configs=blocks(16, 32), key=["n"])(add_kernel)
    with pytest.raises(ValueError, match="Conflicting meta-parameters: BLOCK"):
        kernel[grid(16)](*operands(16), 16, BLOCK=16)


def test_arguments_are_checked_with_errors_that_name_them():
    with pytest.raises(ValueError, match=r"key=.*\['m'\] are not arguments of the kernel"):
        gemmtune.autotune(configs=blocks(16), key=["m"])(add_kernel)
    with pytest.raises(ValueError, match="reset_to_zero"):
        gemmtune.autotune(configs=blocks(16), key=["n"], reset_to_zero=["nope"])(add_kernel)
    with pytest.raises(TypeError, match="key=.*list of argument names"):
        gemmtune.autotune(configs=blocks(16), key="n")(add_kernel)
    with pytest.raises(TypeError, match=r"configs\[1\]: expected a triton.Config"):
        gemmtune.autotune(configs=[triton.Config({"BLOCK": 16}), {"BLOCK": 32}], key=["n"])(add_kernel)
    with pytest.raises(ValueError, match="prune_configs_by"):
        gemmtune.autotune(configs=blocks(16), key=["n"], prune_configs_by={"topk": 1})(add_kernel)
    with pytest.raises(TypeError, match="decorates a @triton.jit function"):
        gemmtune.autotune(configs=blocks(16), key=["n"])(lambda x: x)


def test_the_decorator_with_no_configs_runs_triton_s_default():
    kernel = gemmtune.autotune(configs=[], key=[])(accumulate_kernel)
    assert isinstance(kernel, Autotuned) and kernel.configs[0].num_warps == 4


def test_measured_for_real_the_fastest_passing_config_is_chosen():
    """No fake timer: gemmtune's measurement on this device picks a config that passed."""
    kernel = gemmtune.autotune(configs=blocks(32, 64), key=["n"])(add_kernel)
    x, y, out = operands(200)
    kernel[grid(200)](x, y, out, 200)
    (entry,) = stored_entries()
    trials = Store().trials(entry.device, entry.problem_key)
    best = min((t for t in trials if t.ok), key=lambda t: t.median_ms)
    assert entry.config == best.config and entry.gpu_timings == (not current().interpreter)
    assert torch.equal(out, x + y)


def test_do_bench_replaces_gemmtune_s_timing(timings):
    seen = []

    def do_bench(fn, quantiles):
        seen.append(fn)
        return [float(3 - len(seen)), 0.0, 0.0]  # the later config reads faster

    kernel = gemmtune.autotune(configs=blocks(16, 32), key=["n"], do_bench=do_bench)(add_kernel)
    x, y, out = operands(48)
    kernel[grid(48)](x, y, out, 48)
    assert len(seen) == 2 and timings == [] and kernel.best_config.kwargs == {"BLOCK": 32}
    assert torch.equal(out, x + y)


def isolated(name):
    import autotuned_kernels

    return getattr(autotuned_kernels, name)


def test_isolated_a_config_that_ends_its_process_is_a_failed_trial_and_the_program_goes_on():
    kernel = isolated("add_with_a_crash")
    x, y, out = operands(100)
    before = x.clone(), y.clone()
    kernel[grid(100)](x, y, out, 100)
    assert torch.equal(out, x + y) and torch.equal(x, before[0]) and torch.equal(y, before[1])
    assert kernel.best_config.kwargs["BLOCK"] in (16, 64)
    (entry,) = stored_entries()
    trials = {t.config["index"]: t for t in Store().trials(entry.device, entry.problem_key)}
    assert trials[1].status is Status.LAUNCH_ERROR and "exit code 9" in trials[1].reason
    assert trials[0].ok and trials[2].ok


def test_isolated_a_config_that_hangs_is_a_timeout_trial(monkeypatch):
    from gemmtune.tuning import kernel_worker

    monkeypatch.setattr(kernel_worker, "TIMEOUT_S", 20.0)
    kernel = isolated("add_with_a_hang")
    x, y, out = operands(40)
    kernel[grid(40)](x, y, out, 40)
    assert torch.equal(out, x + y) and kernel.best_config.kwargs == {"BLOCK": 32}
    (entry,) = stored_entries()
    hung, ok = Store().trials(entry.device, entry.problem_key)
    assert hung.status is Status.TIMEOUT and ok.ok


def test_isolated_tuning_finds_what_tuning_in_process_finds():
    kernel = isolated("add_isolated")
    x, y, out = operands(64)
    kernel[grid(64)](x, y, out, 64)
    (entry,) = stored_entries()
    assert torch.equal(out, x + y) and [t.ok for t in Store().trials(entry.device, entry.problem_key)] == [True, True]


def test_a_random_search_tries_at_most_its_budget_and_checks_and_times_those(timings):
    kernel = gemmtune.autotune(configs=blocks(16, 32, 64, 128), key=["n"], strategy="random", budget=2)(add_kernel)
    x, y, out = operands(100)
    kernel[grid(100)](x, y, out, 100)
    assert torch.equal(out, x + y)
    (entry,) = stored_entries()
    tried = Store().trials(entry.device, entry.problem_key)
    assert len(tried) == 2 and all(t.ok for t in tried) and entry.config["index"] in {t.config["index"] for t in tried}
    assert len(timings) == 3  # two screenings, then the two side by side
    assert timings[-1] == ["0", "1"]


def test_a_descent_stops_where_no_neighbour_screens_faster(timings):
    """Configs one field apart are neighbours; config i screens as i + 1 ms, so from config 0 its
    neighbours (BLOCK 32 and 64 at 1 warp, BLOCK 16 at 2) are slower and the search stops."""
    configs = [triton.Config({"BLOCK": b}, num_warps=w) for w in (1, 2) for b in (16, 32, 64)]
    kernel = gemmtune.autotune(configs=configs, key=["n"], strategy="descent")(add_kernel)
    x, y, out = operands(100)
    kernel[grid(100)](x, y, out, 100)
    assert torch.equal(out, x + y) and kernel.best_config is configs[0]
    (entry,) = stored_entries()
    assert sorted(t.config["index"] for t in Store().trials(entry.device, entry.problem_key)) == [0, 1, 2, 3]


@pytest.mark.parametrize("arguments,message", [({"strategy": "topk"}, "perf_model"),
                                               ({"strategy": "bogus"}, "accepted: exhaustive, random, descent"),
                                               ({"budget": 0}, "budget=0"), ({"budget": True}, "budget=True")])
def test_a_strategy_or_budget_it_cannot_take_is_an_error_naming_it(arguments, message):
    with pytest.raises(ValueError, match=message):
        gemmtune.autotune(configs=blocks(16, 32), key=["n"], **arguments)(add_kernel)


def lookup_mode(monkeypatch, tmp_path):
    """Lookup mode, its misses appended to the file returned."""
    misses = tmp_path / "misses.jsonl"
    monkeypatch.setenv("GEMMTUNE_MODE", "lookup")
    monkeypatch.setenv("GEMMTUNE_MISSES", str(misses))
    return misses


def called_fresh(kernel, n):
    """``kernel`` called on n elements as in a new process (nothing chosen yet), its sum checked."""
    kernel.cache.clear()
    x, y, out = operands(n)
    kernel[grid(n)](x, y, out, n)
    assert torch.equal(out, x + y)


def test_a_lookup_miss_is_recorded_and_tune_from_stores_the_choice_it_serves_next(timings, monkeypatch, tmp_path):
    """Lookup mode appends the call to GEMMTUNE_MISSES; `gemmtune tune --from` rebuilds it on fresh
    tensors, tunes it and stores the choice under the key the serving process looked up, where
    the next lookup finds it."""
    from gemmtune.cli import main

    misses = lookup_mode(monkeypatch, tmp_path)
    misses.write_text(json.dumps({"name": "decode", "m": 1, "n": 64, "k": 32, "dtype": "float32"}) + "\n")
    kernel = isolated("add_isolated")
    called_fresh(kernel, 90)
    assert timings == [] and stored_entries() == []
    gemm, call = (json.loads(line) for line in misses.read_text().splitlines())
    assert call["kind"] == "kernel" and (call["module"], call["qualname"]) == ("autotuned_kernels", "add_isolated")
    assert call["scalars"] == {"n": 90} and call["tensors"]["x_ptr"]["shape"] == [90]
    assert call["grids"] == {"0": [6, 1, 1], "1": [3, 1, 1]}  # each config's grid, computed where it was called
    assert call["candidates"] == [0, 1]

    monkeypatch.setenv("GEMMTUNE_MODE", "tune")
    timings.order = ["1", "0"]
    assert main(["tune", "--from", str(misses), "--json"]) == 0  # the GEMM line and the kernel call
    (entry,) = stored_entries()
    assert entry.problem_key == call["key"] and entry.config["index"] == 1

    monkeypatch.setenv("GEMMTUNE_MODE", "lookup")
    called_fresh(kernel, 90)
    assert kernel.best_config.kwargs == {"BLOCK": 32}
    assert len(misses.read_text().splitlines()) == 2  # a hit is no miss


def test_tune_from_tunes_only_what_is_a_gemmtune_kernel(timings, tmp_path, capsys):
    from gemmtune.cli import main

    misses = tmp_path / "misses.jsonl"
    misses.write_text(json.dumps({"kind": "kernel", "module": "json", "qualname": "dumps", "key": "kernel:x@1/2/3",
                                  "positional": [], "keywords": [], "scalars": {}, "tensors": {}, "grids": {},
                                  "candidates": [0]}) + "\n")
    assert main(["tune", "--from", str(misses)]) == 0
    assert "json.dumps: not tuned: TypeError" in capsys.readouterr().out and stored_entries() == []


def test_a_recorded_miss_keeps_the_configs_its_pruning_left(timings, monkeypatch, tmp_path):
    misses = lookup_mode(monkeypatch, tmp_path)
    called_fresh(isolated("add_pruned"), 50)
    (call,) = (json.loads(line) for line in misses.read_text().splitlines())
    assert call["candidates"] == [1, 2] and set(call["grids"]) == {"1", "2"}


def test_a_lookup_miss_no_other_process_could_rebuild_is_said_once_and_not_recorded(timings, monkeypatch, tmp_path,
                                                                                       caplog):
    misses = lookup_mode(monkeypatch, tmp_path)
    kernel = gemmtune.autotune(configs=blocks(16, 32), key=["n"])(add_kernel)  # held by no module's name
    with caplog.at_level(logging.WARNING, logger="gemmtune"):
        for n in (40, 41):
            x, y, out = operands(n)
            kernel[grid(n)](x, y, out, n)
            assert torch.equal(out, x + y)
    assert not misses.exists() and caplog.text.count("cannot be recorded in GEMMTUNE_MISSES") == 1


def test_a_kernel_no_other_process_can_import_is_tuned_in_this_one(timings, caplog):
    kernel = gemmtune.autotune(configs=blocks(16, 32), key=["n"], isolate=True)(add_kernel)  # not at a module's top
    x, y, out = operands(30)
    with caplog.at_level(logging.WARNING, logger="gemmtune"):
        kernel[grid(30)](x, y, out, 30)
    assert torch.equal(out, x + y) and len(timings) == 1 and "tuned in this process" in caplog.text


@pytest.mark.gpu
def test_on_the_gpu_a_miss_inside_graph_capture_runs_the_default_and_tunes_after(timings):
    configs = blocks(64, 128)
    kernel = gemmtune.autotune(configs=configs, key=["n"], default=configs[1])(add_kernel)
    x, y, out = operands(1000)
    kernel[grid(1000)](x, y, out, 1000)  # warm: compiles outside the capture
    x2, y2, out2 = operands(3000)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel[grid(3000)](x2, y2, out2, 3000)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out2, x2 + y2) and kernel.best_config is configs[1] and len(timings) == 1
    kernel[grid(3000)](x2, y2, out2, 3000)  # outside the capture: tuned now
    assert len(timings) == 2


class _Launch:
    """What Dynamo is handed in place of triton.autotune's kernel where it cannot launch Triton
    (the CPU): an add, run with torch."""

    def __init__(self, configs):
        self.configs = list(configs)

    def __getitem__(self, grid):
        return lambda x, y, out, n: out.copy_(x + y)


@pytest.fixture
def handed(monkeypatch):
    """The configs of each kernel gemmtune hands the compiler for a traced call; Triton's part
    played by torch where there is no GPU."""
    seen = []
    real = Autotuned._compiler_kernel

    def _compiler_kernel(self, call_key):  # Dynamo calls a method so marked by its name
        index = real(self, call_key)
        seen.append(list(self._for_compiler[index].configs))
        return index

    monkeypatch.setattr(Autotuned, "_compiler_kernel", _traced_as_constant(_compiler_kernel))
    if not torch.cuda.is_available():
        monkeypatch.setattr(Autotuned, "_as_triton_autotune", lambda self, configs: _Launch(configs))
    return seen


def compiled_add(kernel, **options):
    """torch.compile of a step that adds with ``kernel``, in one graph (no break allowed): Dynamo
    alone on the CPU, the whole compiler on the GPU."""
    def step(x, y, out):
        n = x.numel()
        kernel[grid(n)](x, y, out, n)
        return out * 2

    backend = "inductor" if torch.cuda.is_available() else "eager"
    return torch.compile(step, backend=backend, fullgraph=True, **options)


def test_under_torch_compile_the_stored_choice_is_the_one_config_the_compiler_gets(timings, handed):
    kernel = gemmtune.autotune(configs=blocks(16, 32, 64), key=["n"])(plain_add_kernel)
    timings.order = ["1", "0", "2"]
    x, y, out = operands(40)
    kernel[grid(40)](x, y, out, 40)  # tuned: config 1
    kernel.cache.clear()  # as in a new process: the store's choice
    out.zero_()
    assert torch.equal(compiled_add(kernel)(x, y, out), (x + y) * 2)
    assert handed == [[kernel.configs[1]]] and len(timings) == 1  # nothing timed while compiling


def test_under_torch_compile_a_miss_hands_every_config_and_says_so_once(timings, handed, caplog):
    kernel = gemmtune.autotune(configs=blocks(16, 32), key=["n"])(plain_add_kernel)
    x, y, out = operands(50)
    with caplog.at_level(logging.WARNING, logger="gemmtune"):
        assert torch.equal(compiled_add(kernel)(x, y, out), (x + y) * 2)
    assert handed == [kernel.configs] and not timings and kernel.cache == {}
    assert caplog.text.count("the compiler tunes its 2 configs") == 1


def test_under_torch_compile_lookup_mode_hands_the_default(timings, handed, monkeypatch):
    monkeypatch.setenv("GEMMTUNE_MODE", "lookup")
    configs = blocks(16, 32)
    kernel = gemmtune.autotune(configs=configs, key=["n"], default=configs[1])(plain_add_kernel)
    x, y, out = operands(60)
    assert torch.equal(compiled_add(kernel)(x, y, out), (x + y) * 2)
    assert handed == [[configs[1]]] and not timings


def test_under_torch_compile_a_dynamic_key_is_specialized_each_value_with_its_choice(timings, handed):
    kernel = gemmtune.autotune(configs=blocks(16, 32), key=["n"])(plain_add_kernel)
    timings.order = ["1", "0"]
    x, y, out = operands(70)
    kernel[grid(70)](x, y, out, 70)  # tuned: config 1; 90 is not
    step = compiled_add(kernel, dynamic=True)
    for n in (70, 90, 70):
        x, y, out = operands(n)
        assert torch.equal(step(x, y, out), (x + y) * 2)
    assert handed == [[kernel.configs[1]], kernel.configs] and len(timings) == 1


def test_the_choice_s_lookup_is_marked_as_torch_marks_a_constant_result():
    """Dynamo runs a function so marked while tracing; gemmtune marks it without importing
    torch._dynamo: this fails where torch's mark moves."""
    marked = torch.compiler.assume_constant_result(lambda: None)
    assert vars(marked) == {"_dynamo_marked_constant": True}
    assert Autotuned._compiler_kernel._dynamo_marked_constant is True
