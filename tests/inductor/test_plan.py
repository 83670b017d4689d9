"""How compiled code runs the GEMMs gemmtune chose for: each GEMM's ways, and the mix planned
over the whole graph, against host and GPU times given here."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gemmtune.inductor import plan
from gemmtune.inductor.plan import CALLED, LIBRARY, TEMPLATE, Gemm, Rest, Way
from gemmtune.results import Status, Timing, Trial
from gemmtune.serving.dispatch import Choice

TILES = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
STREAM = Choice("triton_stream", {"BLOCK_N": 64}, 0.012, 0.025)  # costs, as the tuner's final round measured them
CUBLAS = Choice("cublas", {}, 0.013, 0.013)


def trials(**kernel_ms):
    """Stored trials by label, as ``kernel_times`` answers: cublas=..., tiled=... (TILES),
    tiled_wide=... (BLOCK_N 64), stream=... (BLOCK_N 64)."""
    configs = {"cublas": ("cublas", {}), "tiled": ("triton_tiled", TILES),
               "tiled_wide": ("triton_tiled", {**TILES, "BLOCK_N": 64}), "stream": ("triton_stream", {"BLOCK_N": 64})}
    made = [Trial(*configs[name], Status.OK, Timing((ms,))) for name, ms in kernel_ms.items()]
    return {t.label(): t for t in made}


def offered(found):
    return [(way.kind, way.choice.backend, way.kernel_ms) for way in found]


@pytest.mark.parametrize("choice,stored,graphs,expected", [
    # the tuner's Triton config: the library call first, then the template
    (Choice("triton_tiled", TILES, 0.02, 0.03), {}, False,
     [(LIBRARY, "cublas", 0.03), (TEMPLATE, "triton_tiled", 0.02)]),
    # ... by its stored kernel time, not its call's cost (host time included: 36 against 18 us)
    (Choice("triton_tiled", TILES, 0.036, 0.076), trials(cublas=0.020, tiled=0.018), False,
     [(LIBRARY, "cublas", 0.020), (TEMPLATE, "triton_tiled", 0.018)]),
    # cuBLAS within TEMPLATE_SLOWDOWN of the fastest Triton config tried, from the stored trials
    (CUBLAS, trials(cublas=0.006, tiled=0.007, tiled_wide=0.0065), False,
     [(LIBRARY, "cublas", 0.006), (TEMPLATE, "triton_tiled", 0.0065)]),
    (CUBLAS, trials(cublas=0.006, tiled=0.013), False, [(LIBRARY, "cublas", 0.006)]),
    # a Triton config the tuner did not choose: its stored time, never below the library call's
    # stored one (the tuner timed it beside cuBLAS and found it no faster; its stored rounds are
    # not cuBLAS's); where no kernel time of the library call is stored, its own
    (CUBLAS, trials(tiled=0.004), False, [(LIBRARY, "cublas", 0.013), (TEMPLATE, "triton_tiled", 0.004)]),
    (CUBLAS, trials(cublas=0.0451, tiled=0.0441), False,
     [(LIBRARY, "cublas", 0.0451), (TEMPLATE, "triton_tiled", 0.0451)]),
    (STREAM, trials(cublas=0.015, stream=0.011, tiled=0.012), False,
     [(LIBRARY, "cublas", 0.015), (CALLED, "triton_stream", 0.011), (TEMPLATE, "triton_tiled", 0.015)]),
    (CUBLAS, {}, False, [(LIBRARY, "cublas", 0.013)]),
    (Choice("cublas", {}), trials(tiled=0.004), False, [(LIBRARY, "cublas", 0.0)]),  # a fallback: nothing measured
    # gemmtune's kernel, by its stored trial's time, else the choice's own
    (STREAM, trials(cublas=0.015, stream=0.011), False, [(LIBRARY, "cublas", 0.015), (CALLED, "triton_stream", 0.011)]),
    (Choice("triton_stream", {"BLOCK_N": 64}, 0.010, 0.050), {}, False,
     [(LIBRARY, "cublas", 0.05), (CALLED, "triton_stream", 0.010)]),
    # where cuBLAS failed its check (no cublas_ms) its library call is never offered
    (Choice("triton_stream", {"BLOCK_N": 64}, 0.012, None), trials(stream=0.012), False,
     [(CALLED, "triton_stream", 0.012)]),
    (Choice("triton_tiled", TILES, 0.02, None), {}, False, [(TEMPLATE, "triton_tiled", 0.02)]),
    (Choice("triton_tiled", TILES), {}, False, [(TEMPLATE, "triton_tiled", 0.0)]),  # no time at all: as chosen
    # cuBLASLt's algorithms are called only replayed as CUDA graphs, or where cuBLAS failed
    (Choice("cublaslt", {"algo": 0}, 0.010, 0.050), {}, False, [(LIBRARY, "cublas", 0.05)]),
    (Choice("cublaslt", {"algo": 0}, 0.010, 0.050), {}, True, [(LIBRARY, "cublas", 0.05), (CALLED, "cublaslt", 0.01)]),
    (Choice("cublaslt", {"algo": 0}, 0.012, None), {}, False, [(CALLED, "cublaslt", 0.012)]),
])
def test_the_ways_a_choice_may_run(choice, stored, graphs, expected):
    found = plan.ways(choice, stored, graphs)
    assert offered(found) == [(kind, backend, pytest.approx(ms)) for kind, backend, ms in expected]
    assert all(way.host_ms == (0.0 if graphs else plan.HOST_MS[way.kind]) for way in found)
    template = [way for way in found if way.kind == TEMPLATE and choice.backend != "triton_tiled"]
    if template:  # the fastest Triton config tried
        fastest = min((t for t in stored.values() if t.backend == "triton_tiled"), key=lambda t: t.median_ms)
        assert template[0].choice.config == fastest.config


def test_the_template_with_the_activation_fused_launches_no_kernel_for_it():
    fused = (Choice("triton_tiled", {**TILES, "BLOCK_N": 64}, 0.0063, 0.008), trials(cublas=0.008, tiled_wide=0.0062))
    found = plan.ways(CUBLAS, trials(cublas=0.006, tiled=0.0061), False, fused)
    assert offered(found)[1:] == [(TEMPLATE, "triton_tiled", 0.0061), (TEMPLATE, "triton_tiled", 0.0062)]
    assert found[2].choice.config["BLOCK_N"] == 64
    assert found[2].host_ms == pytest.approx(plan.HOST_MS[TEMPLATE] - plan.LAUNCH_MS)


def way(kind, kernel_ms, graphs=False):
    backend = {LIBRARY: "cublas", CALLED: "triton_stream", TEMPLATE: "triton_tiled"}[kind]
    return Way(Choice(backend, {}, kernel_ms, 0.01), kind, kernel_ms, 0.0 if graphs else plan.HOST_MS[kind])


HOST_PACED = Rest(host_ms=2.0, gpu_ms=0.1)  # a decode step: many short kernels
GPU_PACED = Rest(host_ms=0.5, gpu_ms=5.0)  # a large batch


@pytest.mark.parametrize("rest,expected", [(HOST_PACED, LIBRARY), (GPU_PACED, CALLED)])
def test_gemmtunes_faster_kernel_is_called_only_where_the_gpu_sets_the_pace(rest, expected):
    """Its call costs the host more than the library call's: in a graph the host paces that is
    time lost, whatever the kernel saves."""
    gemms = [Gemm(24, False, (way(LIBRARY, 0.025), way(CALLED, 0.010)))]
    assert [w.kind for w in plan.plan(gemms, rest, graphs=False)] == [expected]


@pytest.mark.parametrize("rest,expected", [(HOST_PACED, TEMPLATE), (GPU_PACED, LIBRARY)])
def test_a_slower_template_is_taken_for_its_launch_only_where_the_host_sets_the_pace(rest, expected):
    gemms = [Gemm(16, False, (way(LIBRARY, 0.006), way(TEMPLATE, 0.007)))]
    assert [w.kind for w in plan.plan(gemms, rest, graphs=False)] == [expected]


def test_a_graph_neither_clearly_paces_keeps_the_library_call_where_a_way_trades_host_for_gpu():
    """Paced by the GPU on a fast host and by the host on a slow one: a trade that pays on one
    loses on the other."""
    balanced = Rest(host_ms=0.6, gpu_ms=0.6)
    gemms = [Gemm(24, False, (way(LIBRARY, 0.020), way(CALLED, 0.015))),
             Gemm(24, False, (way(LIBRARY, 0.006), way(TEMPLATE, 0.007)))]
    assert [w.kind for w in plan.plan(gemms, balanced, graphs=False)] == [LIBRARY, LIBRARY]
    faster = [Gemm(24, False, (way(LIBRARY, 0.020), way(TEMPLATE, 0.015)))]  # less host and less GPU time
    assert [w.kind for w in plan.plan(faster, balanced, graphs=False)] == [TEMPLATE]


@pytest.mark.parametrize("launched,wrapped,kept", [(2, 0, True), (12, 36, False), (17, 41, False), (30, 20, True)])
def test_templates_for_their_launch_must_save_more_than_the_graphs_other_addmm_pay(launched, wrapped, kept):
    """Switching the templates on makes a graph's other addmm calls dearer (torch 2.11's
    bias_addmm): ``launched`` short GEMMs that would take the template for its launch, beside
    ``wrapped`` ones with a bias that stay on cuBLAS (GPT-2: 12 and 36; the seeds' MLP: 2 and 0)."""
    gemms = [Gemm(launched, True, (way(LIBRARY, 0.006), way(TEMPLATE, 0.0065))),
             Gemm(wrapped, True, (way(LIBRARY, 0.008),))]
    picks = plan.plan(gemms, HOST_PACED, graphs=False)
    assert picks[0].kind == (TEMPLATE if kept else LIBRARY)
    assert plan.plan(gemms, HOST_PACED, graphs=False, templates_on=True)[0].kind == TEMPLATE  # the caller's


def test_templates_that_pay_only_all_together_are_taken_together():
    """Three products with a bias, each paying less for its own template launch than the other
    two pay for switching the templates on: one at a time none pays, all at once they do."""
    gemms = [Gemm(12, True, (way(LIBRARY, 0.006), way(TEMPLATE, 0.0061), way(TEMPLATE, 0.0062)))
             for _ in range(3)]
    alone = [gemms[0].ways[1]] + [g.ways[0] for g in gemms[1:]]
    first = [g.ways[0] for g in gemms]
    assert plan.graph_ms(gemms, alone, HOST_PACED, 1.0, False) > plan.graph_ms(gemms, first, HOST_PACED, 1.0, False)
    assert [(w.kind, w.kernel_ms) for w in plan.plan(gemms, HOST_PACED, graphs=False)] == [(TEMPLATE, 0.0061)] * 3


def test_the_products_faster_on_the_template_are_taken_together_without_the_slower_ones():
    """MLP-Mixer-B's compiled forward on an H200 (the plan's own estimate, a host 1.9x the
    nominal): its token-mixing products faster on the template, its channel-mixing ones slower.
    Each alone on the template pays less than the others' addmm calls then cost the host (on a
    host twice as slow the graph is the host's), all together take the slow ones too: together,
    the faster ones alone."""
    gemms = [Gemm(12, False, (way(LIBRARY, 0.0400), way(TEMPLATE, 0.0339))),
             Gemm(12, True, (way(LIBRARY, 0.0323), way(TEMPLATE, 0.0244))),
             Gemm(12, True, (way(LIBRARY, 0.0475), way(TEMPLATE, 0.0630))),
             Gemm(12, True, (way(LIBRARY, 0.0417), way(TEMPLATE, 0.0662))),
             Gemm(1, True, (way(LIBRARY, 0.0043), way(TEMPLATE, 0.0014)))]
    rest, first = Rest(host_ms=0.44, gpu_ms=1.17), [g.ways[0] for g in gemms]
    picks = plan.plan(gemms, rest, graphs=False, host_scale=1.9)
    assert [w.kind for w in picks] == [TEMPLATE, TEMPLATE, LIBRARY, LIBRARY, TEMPLATE]
    for scale in plan.host_scales(1.9):
        assert plan.graph_ms(gemms, picks, rest, scale, False) < plan.graph_ms(gemms, first, rest, scale, False)


def test_replayed_as_a_cuda_graph_only_kernel_time_counts():
    gemms = [Gemm(24, False, (way(LIBRARY, 0.025, True), way(CALLED, 0.010, True))),
             Gemm(24, False, (way(LIBRARY, 0.006, True), way(TEMPLATE, 0.007, True))),
             Gemm(24, False, (way(LIBRARY, 0.010, True), way(CALLED, 0.0099, True)))]  # within MIN_GAIN
    assert [w.kind for w in plan.plan(gemms, HOST_PACED, graphs=True)] == [CALLED, LIBRARY, LIBRARY]


KINDS = st.sampled_from([LIBRARY, CALLED, TEMPLATE])
WAYS = st.lists(st.tuples(KINDS, st.floats(0.0, 0.3)), min_size=1, max_size=4)
GEMMS = st.lists(st.tuples(st.integers(1, 50), st.booleans(), WAYS), min_size=1, max_size=6)


@pytest.mark.parametrize("library_ms,expected", [(0.010, [0.010, 0.012]), (0.030, [0.020, 0.024]),
                                                 (None, [0.020, 0.024])])
def test_warm_kernel_times_scale_every_way_of_a_product_by_the_library_calls(library_ms, expected):
    """The library call's warm time over its flushed trial's, never above 1 (a warm kernel is no
    slower: a ratio above is noise); unmeasured, the trials' times as they are."""
    found = (way(LIBRARY, 0.020), way(TEMPLATE, 0.024))
    warm = plan.warmed(found, library_ms, 0.020)
    assert [w.kernel_ms for w in warm] == pytest.approx(expected)
    assert [(w.kind, w.choice, w.host_ms) for w in warm] == [(w.kind, w.choice, w.host_ms) for w in found]


def test_a_library_way_timed_by_a_calls_cost_is_not_a_kernel_time_to_scale_by():
    """Where no trial of the library call was stored, its way's time is the call's cost (``ways``:
    ``choice.cublas_ms``, host time included: 107 us for a 31 us kernel on a slow host); scaling
    the template's kernel time by warm over that cost made a 45 us kernel read 11 us. The warm
    time stands for the library call; the others stay as tuned."""
    found = plan.ways(Choice("cublas", {}, 0.107, 0.107), trials(tiled=0.045), graphs=False)
    assert [(w.kind, w.kernel_ms) for w in found] == [(LIBRARY, 0.107), (TEMPLATE, 0.045)]
    warm = plan.warmed(found, 0.027, None)
    assert [(w.kind, w.kernel_ms) for w in warm] == [(LIBRARY, 0.027), (TEMPLATE, 0.045)]


def test_without_a_library_call_there_is_nothing_to_scale_warm_times_by():
    found = (way(CALLED, 0.020),)
    assert plan.warmed(found, 0.005, 0.010) == found


@pytest.mark.parametrize("measured,expected", [(None, [1.0, 0.5, 2.0, 4.0]), (2.0, [2.0, 4.0])])
def test_the_host_speeds_weighed_are_about_the_measured_one_else_the_nominal(measured, expected):
    assert list(plan.host_scales(measured)) == pytest.approx(expected)


@pytest.mark.parametrize("measured,expected", [(None, LIBRARY), (0.5, CALLED), (3.0, LIBRARY)])
def test_a_faster_kernel_that_costs_the_host_more_is_called_where_the_measured_host_keeps_the_gpu_the_pace(
        measured, expected):
    """A graph the GPU paces on the nominal host, and the host on one twice as slow."""
    paced = Rest(host_ms=0.5, gpu_ms=1.0)
    gemms = [Gemm(24, False, (way(LIBRARY, 0.025), way(CALLED, 0.020)))]
    assert [w.kind for w in plan.plan(gemms, paced, graphs=False, host_scale=measured)] == [expected]


@given(gemms=GEMMS, host=st.floats(0.0, 5.0), gpu=st.floats(0.0, 5.0), graphs=st.booleans(),
       templates_on=st.booleans(), measured=st.none() | st.floats(0.1, 10.0))
@settings(max_examples=300, deadline=None)
def test_a_plan_never_costs_more_than_each_gemms_first_way_at_any_host_speed(gemms, host, gpu, graphs,
                                                                          templates_on, measured):
    made = [Gemm(count, bias, tuple(way(kind, ms, graphs) for kind, ms in found)) for count, bias, found in gemms]
    rest = Rest(host, gpu)
    picks = plan.plan(made, rest, graphs, templates_on, measured)
    assert all(pick in gemm.ways for pick, gemm in zip(picks, made))
    first = [gemm.ways[0] for gemm in made]
    for scale in plan.host_scales(measured):
        assert plan.graph_ms(made, picks, rest, scale, graphs, templates_on) <= \
            plan.graph_ms(made, first, rest, scale, graphs, templates_on) + 1e-12
