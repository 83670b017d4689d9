"""The dispatcher (``gemmtune.serving.dispatch``) on its own: a served call's key, and what a key
resolves to (the store's choice, the reference in lookup mode or while deferring, a tuning
otherwise), kept in a dict until forgotten. Against a store in tmp_path, with the tuner faked
where a test says so; kernels are built, not run, except the reference (torch's own call)."""

import logging
import threading

import pytest
import torch

from gemmtune import backends, shapes
from gemmtune.device import Device, current
from gemmtune.problem import Problem, bucket
from gemmtune.results import TuneResult
from gemmtune.serving import dispatch
from gemmtune.serving.dispatch import Dispatcher, DispatchKey
from gemmtune.store import Store

TILED = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8, "num_warps": 1, "num_stages": 1}
PROBLEM = Problem(7, 40, 33, "float32", "nn")


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "store") as opened:
        yield opened


@pytest.fixture
def built(monkeypatch):
    """Every build the dispatcher asks for, as (problem, backend, config); the real kernel returned."""
    calls = []
    real = backends.build

    def build(problem, name, config, device):
        calls.append((problem, name, config))
        return real(problem, name, config, device)

    monkeypatch.setattr(backends, "build", build)
    return calls


@pytest.fixture
def no_tuning(monkeypatch):
    monkeypatch.setattr(dispatch, "tune_problem", lambda *a, **k: pytest.fail("tuned"))


def stored(problem: Problem, backend: str, config: dict) -> TuneResult:
    return TuneResult(problem_key=problem.key(), device=current().fingerprint(), backend=backend,
                      config=dict(config), time_ms=0.01, cublas_ms=0.02, tune_s=0.1, rel_err=0.0)


# ----- the key ---------------------------------------------------------------------------------

@pytest.mark.parametrize("problem", [
    PROBLEM,
    Problem(1, 64, 32, "float16", "linear", bias=True),
    Problem(16, 4096, 4096, "bfloat16", "linear", activation="gelu_tanh"),
    Problem(5, 3, 8, "float32", "linear", bias=True, tf32=True, activation="relu"),
])
def test_a_key_names_its_problem_and_device(problem):
    key = DispatchKey.of(problem)
    assert key.problem() == problem and key.device is None
    assert (key.m, key.n, key.k, key.dtype, key.layout, key.bias, key.tf32, key.activation) == (
        problem.m, problem.n, problem.k, problem.dtype, problem.layout, problem.bias, problem.tf32, problem.activation)
    on_one = DispatchKey.of(problem, 1)
    assert on_one.problem() == problem and on_one.device == 1
    assert len({key, on_one, DispatchKey.of(problem, 0), DispatchKey.of(Problem(**vars(problem)))}) == 3


def test_the_default_store_is_opened_on_first_use_in_the_cache_dir(tmp_path):
    dispatcher = Dispatcher()
    assert dispatcher._store is None
    assert dispatcher.store.path.is_relative_to(tmp_path / "gemmtune-cache")  # conftest's GEMMTUNE_CACHE_DIR
    assert dispatcher.store is dispatcher.store


# ----- the store's choice --------------------------------------------------------------------

def test_a_stored_choice_is_built_once_then_served_from_the_table(store, built, no_tuning):
    store.put(stored(PROBLEM, "triton_tiled", TILED))
    dispatcher = Dispatcher(store)
    key = DispatchKey.of(PROBLEM)
    kernel = dispatcher.kernel(key)
    assert built == [(PROBLEM, "triton_tiled", TILED)]
    assert dispatcher.kernel(key) is kernel and dispatcher.kernels == {key: kernel}
    assert len(built) == 1  # the second call was a lookup


def test_the_exact_shape_is_looked_up_before_its_bucket(store, built, no_tuning, monkeypatch):
    """In pow2 buckets a shape's own entry serves it where there is one, else its bucket's: built
    for the shape itself."""
    monkeypatch.setenv("GEMMTUNE_BUCKET", "pow2")
    problem = Problem(24, 48, 48, "float32", "nn")
    representative = bucket(problem, "pow2")
    assert representative != problem
    store.put(stored(representative, "cublas", {}))
    Dispatcher(store).kernel(DispatchKey.of(problem))
    assert built == [(problem, "cublas", {})]
    store.put(stored(problem, "triton_tiled", TILED))
    Dispatcher(store).kernel(DispatchKey.of(problem))
    assert built[-1] == (problem, "triton_tiled", TILED)


def test_a_stored_choice_that_cannot_be_built_here_is_passed_over(store, monkeypatch, caplog, no_tuning):
    monkeypatch.setenv("GEMMTUNE_MODE", "lookup")
    store.put(stored(PROBLEM, "triton_tiled", TILED))
    real = backends.build

    def build(problem, name, config, device):
        if name == "triton_tiled":
            raise RuntimeError("not on this machine")
        return real(problem, name, config, device)

    monkeypatch.setattr(backends, "build", build)
    with caplog.at_level(logging.WARNING, logger="gemmtune"):
        kernel = Dispatcher(store).kernel(DispatchKey.of(PROBLEM))
    assert kernel is real(PROBLEM, backends.REFERENCE, {}, current())
    assert "cannot be built here (not on this machine); passing it over" in caplog.text


def test_a_bucket_result_serves_only_shapes_its_backend_can_run():
    h100 = Device("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448, 50 << 20)
    from gemmtune.serving.dispatch import _serves

    assert _serves("triton_persistent", Problem(4096, 4096, 4096), h100)
    assert not _serves("triton_persistent", Problem(4095, 4097, 4095), h100)  # TMA needs aligned rows
    assert _serves("cublas", Problem(4095, 4097, 4095), h100)


# ----- a miss ------------------------------------------------------------------------------------

def test_a_miss_in_lookup_mode_is_served_by_the_reference_and_appended(tmp_path, store, built, no_tuning,
                                                                       monkeypatch):
    misses = tmp_path / "misses.jsonl"
    monkeypatch.setenv("GEMMTUNE_MODE", "lookup")
    monkeypatch.setenv("GEMMTUNE_MISSES", str(misses))
    dispatcher = Dispatcher(store)
    key = DispatchKey.of(PROBLEM)
    kernel = dispatcher.kernel(key)
    assert built == [(PROBLEM, backends.REFERENCE, {})]
    a, b = torch.randn(7, 33), torch.randn(33, 40)
    torch.testing.assert_close(kernel(a, b, None), a @ b)
    assert dispatcher.kernel(key) is kernel and len(built) == 1  # cached like any kernel
    assert [named.problem for named in shapes.load(misses)] == [PROBLEM]
    assert store.choices() == []  # lookup mode stores nothing


def test_lookup_mode_appends_each_miss_once(tmp_path, monkeypatch, caplog):
    misses = tmp_path / "misses.jsonl"
    monkeypatch.setenv("GEMMTUNE_MODE", "lookup")
    monkeypatch.setenv("GEMMTUNE_MISSES", str(misses))
    dispatcher = Dispatcher(Store(tmp_path / "store"))
    problems = [Problem(7, 40, 33, "float32", "nn"), Problem(1, 64, 32, "float16", "linear", bias=True)]
    with caplog.at_level(logging.INFO, logger="gemmtune"):
        for _ in range(3):
            for i, problem in enumerate(problems):
                kernel = dispatcher.kernel(DispatchKey.of(problem))
                assert kernel is not None
    assert caplog.text.count("no tuned kernel") == 2  # once per shape, not per call
    assert [named.problem for named in shapes.load(misses)] == problems


def test_a_miss_that_cannot_be_appended_is_still_served(tmp_path, store, monkeypatch, caplog):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("GEMMTUNE_MODE", "lookup")
    monkeypatch.setenv("GEMMTUNE_MISSES", str(tmp_path / "a-file" / "misses.jsonl"))
    with caplog.at_level(logging.WARNING, logger="gemmtune"):
        kernel = Dispatcher(store).kernel(DispatchKey.of(PROBLEM))
    assert kernel is backends.build(PROBLEM, backends.REFERENCE, {}, current())
    assert "cannot append the miss to" in caplog.text


def test_a_miss_in_tune_mode_tunes_the_bucket_stores_it_and_builds_it_for_the_shape(store, built, monkeypatch):
    monkeypatch.setenv("GEMMTUNE_BUCKET", "pow2")
    problem = Problem(24, 48, 48, "float32", "nn")
    representative = bucket(problem, "pow2")
    tuned = []

    def tune(target, device, options):
        tuned.append(target)
        return stored(target, "triton_tiled", TILED)

    monkeypatch.setattr(dispatch, "tune_problem", tune)
    dispatcher = Dispatcher(store)
    dispatcher.kernel(DispatchKey.of(problem))
    assert tuned == [representative] and built == [(problem, "triton_tiled", TILED)]
    assert store.get(current().fingerprint(), representative.key()).backend == "triton_tiled"
    Dispatcher(store).kernel(DispatchKey.of(problem))  # another process finds it stored
    assert tuned == [representative]


def test_a_failed_tuning_is_served_by_the_reference_and_said(store, built, monkeypatch, caplog):
    def tune(*args, **kwargs):
        raise RuntimeError("no candidate compiled")

    monkeypatch.setattr(dispatch, "tune_problem", tune)
    with caplog.at_level(logging.WARNING, logger="gemmtune"):
        Dispatcher(store).kernel(DispatchKey.of(PROBLEM))
    assert built == [(PROBLEM, backends.REFERENCE, {})] and store.choices() == []
    assert f"tuning {PROBLEM.describe()} failed; using cuBLAS" in caplog.text


# ----- deferring, forgetting ------------------------------------------------------------------

def test_a_deferred_miss_is_served_by_cublas_untuned_and_dropped_after(tmp_path, monkeypatch):
    from gemmtune.serving import dispatch

    monkeypatch.setattr(dispatch, "tune_problem", lambda *a, **k: pytest.fail("tuned while deferring"))
    dispatcher = Dispatcher(Store(tmp_path / "store"))
    problem = Problem(7, 40, 33, "float32", "nn")
    with dispatcher.deferring():
        kernel = dispatcher.kernel(DispatchKey.of(problem))
        a, b = torch.randn(7, 33), torch.randn(33, 40)
        assert torch.allclose(kernel(a, b, None), a @ b)
        assert dispatcher.kernels  # served again from the dict within the block
    assert dispatcher.kernels == {} and dispatcher.front == {}
    tuned = []

    def tune(problem, *args, **kwargs):
        tuned.append(problem)
        raise RuntimeError("not here")  # the dispatcher falls back to cuBLAS and says so

    monkeypatch.setattr(dispatch, "tune_problem", tune)
    dispatcher.kernel(DispatchKey.of(problem))
    assert tuned == [problem]  # after the block a miss is tuned again


def test_deferring_holds_back_tuning_in_its_own_thread_only(tmp_path, monkeypatch):
    """A server thread's miss is tuned as usual while another thread runs optimize's example."""
    import threading

    from gemmtune.serving import dispatch

    tuned = []

    def tune(problem, *args, **kwargs):
        tuned.append(problem)
        raise RuntimeError("not here")  # the dispatcher falls back to cuBLAS

    monkeypatch.setattr(dispatch, "tune_problem", tune)
    dispatcher = Dispatcher(Store(tmp_path / "store"))
    mine, theirs = Problem(7, 40, 33, "float32", "nn"), Problem(9, 40, 33, "float32", "nn")
    with dispatcher.deferring():
        dispatcher.kernel(DispatchKey.of(mine))
        other = threading.Thread(target=lambda: dispatcher.kernel(DispatchKey.of(theirs)))
        other.start()
        other.join()
    assert tuned == [theirs]


def test_while_deferring_a_stored_choice_is_still_served_and_the_flag_is_this_threads(store, built, no_tuning):
    store.put(stored(PROBLEM, "triton_tiled", TILED))
    dispatcher = Dispatcher(store)
    elsewhere = []
    assert not dispatcher.is_deferring()
    with dispatcher.deferring():
        assert dispatcher.is_deferring()
        other = threading.Thread(target=lambda: elsewhere.append(dispatcher.is_deferring()))
        other.start()
        other.join()
        dispatcher.kernel(DispatchKey.of(PROBLEM))
        assert built == [(PROBLEM, "triton_tiled", TILED)]  # the store's, not the reference
    assert elsewhere == [False] and not dispatcher.is_deferring() and dispatcher.kernels == {}


def test_deferring_ends_and_forgets_when_its_block_raises(store, no_tuning):
    dispatcher = Dispatcher(store)
    with pytest.raises(KeyError):
        with dispatcher.deferring():
            dispatcher.kernel(DispatchKey.of(PROBLEM))
            raise KeyError("the example failed")
    assert not dispatcher.is_deferring() and dispatcher.kernels == {}


def test_forget_drops_the_kernels_and_the_front_path(store):
    dispatcher = Dispatcher(store)
    key = DispatchKey.of(PROBLEM)
    dispatcher.kernels[key] = kernel = object()
    dispatcher.front[("x", "w")] = kernel
    assert dispatcher.kernel(key) is kernel  # a hit: neither the store nor a tuning asked
    dispatcher.forget()
    assert dispatcher.kernels == {} and dispatcher.front == {}


# ----- CUDA graph capture ---------------------------------------------------------------------

def test_a_miss_inside_graph_capture_is_said_once_and_appended(tmp_path, monkeypatch, caplog):
    misses = tmp_path / "misses.jsonl"
    monkeypatch.setenv("GEMMTUNE_MISSES", str(misses))
    dispatcher = Dispatcher(Store(tmp_path / "store"))
    problem = Problem(16, 4096, 4096, "bfloat16", "linear")
    key = DispatchKey.of(problem, 0)
    with caplog.at_level(logging.WARNING, logger="gemmtune"):
        for _ in range(3):
            dispatcher.capture_miss(key)
    assert caplog.text.count("inside CUDA graph capture") == 1
    assert [named.problem for named in shapes.load(misses)] == [problem]
    assert dispatcher.kernels == {}  # nothing was built for it


def test_capture_misses_are_said_once_per_key(tmp_path, monkeypatch, caplog):
    """The key holds the device: the same shape on another GPU is another miss; another shape too."""
    misses = tmp_path / "misses.jsonl"
    monkeypatch.setenv("GEMMTUNE_MISSES", str(misses))
    dispatcher = Dispatcher(Store(tmp_path / "store"))
    other = Problem(16, 4096, 4096, "bfloat16", "linear", bias=True)
    keys = [DispatchKey.of(PROBLEM, 0), DispatchKey.of(PROBLEM, 1), DispatchKey.of(other, 0)]
    with caplog.at_level(logging.WARNING, logger="gemmtune"):
        for key in keys + keys:
            dispatcher.capture_miss(key)
    assert caplog.text.count("inside CUDA graph capture") == 3
    assert [named.problem for named in shapes.load(misses)] == [PROBLEM, PROBLEM, other]


# ----- a kernel for CUDA graphs --------------------------------------------------------------

def final_rounds(median, seed):
    import random

    from gemmtune.results import Timing

    rng = random.Random(seed)
    return Timing(tuple(median * (1 + rng.uniform(-0.01, 0.01)) for _ in range(24)))


def with_trials(result: TuneResult, tiled_ms: float) -> TuneResult:
    """``result`` with final rounds on record: cuBLAS at 0.03 ms, the tiled kernel at ``tiled_ms``."""
    from dataclasses import replace

    from gemmtune.results import Status, Trial

    trials = (Trial("cublas", {}, Status.OK, timing=final_rounds(0.03, 1), rel_err=0.0),
              Trial("triton_tiled", dict(TILED), Status.OK, timing=final_rounds(tiled_ms, 2), rel_err=0.0))
    return replace(result, trials=trials)


def test_where_a_kernel_is_faster_for_graphs_the_choice_and_it_are_served_by_mode(store, built, no_tuning):
    """cuBLAS chosen on a call's cost; the tiled kernel 10% faster in the final rounds: eager
    calls run cuBLAS, a CUDA graph captures the tiled kernel."""
    from gemmtune.serving.modes import ByMode

    store.put(with_trials(stored(PROBLEM, "cublas", {}), 0.027))
    kernel = Dispatcher(store).kernel(DispatchKey.of(PROBLEM))
    assert isinstance(kernel, ByMode)
    assert built == [(PROBLEM, "cublas", {}), (PROBLEM, "triton_tiled", TILED)]


def test_the_graph_pick_is_the_faster_kernel_its_tuning_stored_or_none(store):
    """What ``optimize`` asks of a layer tuned to cuBLAS: the kernel its graphs would capture."""
    dispatcher = Dispatcher(store)
    assert dispatcher.graph_pick(PROBLEM, current(), "cublas") is None  # nothing stored
    store.put(with_trials(stored(PROBLEM, "cublas", {}), 0.0299))
    assert dispatcher.graph_pick(PROBLEM, current(), "cublas") is None  # level with cuBLAS
    store.put(with_trials(stored(PROBLEM, "cublas", {}), 0.027))
    pick = dispatcher.graph_pick(PROBLEM, current(), "cublas")
    assert (pick.backend, pick.config) == ("triton_tiled", TILED)


def test_where_no_kernel_is_faster_for_graphs_the_choice_alone_is_served(store, built, no_tuning):
    from gemmtune.serving.modes import ByMode

    store.put(with_trials(stored(PROBLEM, "cublas", {}), 0.0299))
    kernel = Dispatcher(store).kernel(DispatchKey.of(PROBLEM))
    assert not isinstance(kernel, ByMode) and built == [(PROBLEM, "cublas", {})]


# ----- eager calls on a lean kernel -------------------------------------------------------------

def test_served_lean_eager_calls_run_the_picked_kernel_and_graphs_what_they_ran_before(store, built, no_tuning):
    """A host-bound model measured faster with the tiled kernel in eager calls: they run it, a CUDA
    graph captures the choice's kernel (cuBLAS), the pick survives dropping built kernels, and
    dropping the pick serves the choice alone again."""
    from gemmtune.serving.modes import ByMode

    store.put(with_trials(stored(PROBLEM, "cublas", {}), 0.0299))
    dispatcher = Dispatcher(store)
    key = DispatchKey.of(PROBLEM, None)
    plain = dispatcher.kernel(key)
    pick = dispatcher.lean_pick(PROBLEM, current(), "cublas")
    assert (pick.backend, pick.config) == ("triton_tiled", TILED)
    dispatcher.front[("a front key",)] = plain
    dispatcher.serve_lean({PROBLEM: pick}, None)
    assert dispatcher.front == {} and key not in dispatcher.kernels
    kernel = dispatcher.kernel(key)
    assert isinstance(kernel, ByMode) and built[-1] == (PROBLEM, "triton_tiled", TILED)
    assert type(kernel.graph) is type(plain)
    dispatcher.forget()
    assert isinstance(dispatcher.kernel(key), ByMode)
    dispatcher.drop_lean([PROBLEM], None)
    assert not isinstance(dispatcher.kernel(key), ByMode) and dispatcher.lean == {}


def test_a_lean_kernel_s_graph_side_is_the_graph_kernel_of_a_pair(store, built, no_tuning):
    """Where cuBLAS is paired with a faster kernel for graphs, the lean pick takes the eager side
    and the graphs keep that faster kernel: no pair inside a pair."""
    from gemmtune.serving.modes import ByMode

    store.put(with_trials(stored(PROBLEM, "cublas", {}), 0.027))
    dispatcher = Dispatcher(store)
    key = DispatchKey.of(PROBLEM, None)
    paired = dispatcher.kernel(key)
    assert isinstance(paired, ByMode)
    dispatcher.serve_lean({PROBLEM: dispatcher.lean_pick(PROBLEM, current(), "cublas")}, None)
    kernel = dispatcher.kernel(key)
    assert isinstance(kernel, ByMode) and not isinstance(kernel.graph, ByMode)
    assert type(kernel.graph) is type(paired.graph)
