"""Shapes files: every problem written as an entry reads back as the same problem."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gemmtune import shapes
from gemmtune.cli.report import result_dict, results_table
from gemmtune.problem import ACTIVATIONS, DTYPES, LAYOUTS, Problem
from gemmtune.results import TuneResult

SIZES = st.integers(1, 5000)
PLAIN = st.builds(Problem, SIZES, SIZES, SIZES, st.sampled_from(DTYPES), st.sampled_from(LAYOUTS), st.booleans(),
                  st.booleans(), st.sampled_from(ACTIVATIONS))
BATCHED = st.builds(lambda m, n, k, dtype, layout, batch: Problem(m, n, k, dtype, layout, batch=batch),
                    SIZES, SIZES, SIZES, st.sampled_from(DTYPES), st.sampled_from(LAYOUTS), st.integers(2, 65536))
SCALED = st.builds(lambda m, n, k, scaling: Problem(m, n, k, "float8_e4m3fn", scaling=scaling), SIZES, SIZES, SIZES,
                   st.sampled_from(("tensor", "row", "block")))


@given(problems=st.lists(st.one_of(PLAIN, BATCHED, SCALED), min_size=1, max_size=5))
@settings(max_examples=100, deadline=None)
def test_an_entry_reads_back_as_its_problem(tmp_path_factory, problems):
    path = tmp_path_factory.mktemp("shapes") / "gemms.json"
    path.write_text(json.dumps({"shapes": [shapes.entry(p) for p in problems]}))
    assert [named.problem for named in shapes.load(path)] == problems


def test_a_batched_entry_names_its_batch_and_an_unbatched_one_does_not():
    assert shapes.entry(Problem(128, 128, 64, "float32", "nn", batch=384))["batch"] == 384
    assert "batch" not in shapes.entry(Problem(128, 128, 64, "float32", "nn"))


def test_a_batched_entry_with_a_bias_is_refused_by_name(tmp_path):
    path = tmp_path / "gemms.json"
    path.write_text(json.dumps({"shapes": [{"m": 8, "n": 8, "k": 8, "bias": True, "batch": 2}]}))
    with pytest.raises(ValueError, match="shape #0 .* Problem.batch 2: a batched product takes no bias"):
        shapes.load(path)


def test_a_batched_result_reports_its_batch():
    problem = Problem(128, 64, 128, "float32", "nn", batch=384)
    result = TuneResult(problem.key(), "cpu", "cublas", {}, 0.05, 0.05, 1.0, 0.0)
    assert result_dict(result)["batch"] == 384
    [row] = results_table([result]).columns[0].cells
    assert row == "384 x 128x64x128"
