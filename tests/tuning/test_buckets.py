"""Bucket policies, their use on a store miss, and the validation that measures their cost."""

import pytest

from gemmtune.device import current
from gemmtune.problem import Problem, bucket
from gemmtune.tuning.buckets import samples, validate
from gemmtune.tuning.tuner import TuneOptions


def test_policies():
    p = Problem(1000, 4112, 48)
    assert bucket(p, "exact") == p
    assert bucket(p, "pow2") == Problem(1024, 8192, 64)
    assert bucket(p, "log2m") == Problem(1024, 4112, 48)
    assert bucket(Problem(1, 16, 16), "pow2") == Problem(1, 16, 16)


@pytest.mark.parametrize("n, k", [(4097, 33), (4104, 2216), (4096, 2216)])
def test_a_shape_off_the_16_element_grid_is_a_pow2_bucket_of_its_own(n, k):
    """Representatives choose Triton kernels that ran such rows up to 35x slower on the H200:
    misaligned rows, and 16-byte rows whose strides lose Triton's divisibility-by-16 hint."""
    odd = Problem(1000, n, k)
    assert bucket(odd, "pow2") == odd
    assert bucket(odd, "log2m") == Problem(1024, n, k)  # N and K kept: their strides unchanged
    assert samples(odd, "pow2", 3) == []
    with pytest.raises(ValueError, match="accepted: exact, pow2, log2m"):
        bucket(odd, "pow3")


@pytest.mark.parametrize("policy", ["pow2", "log2m"])
def test_samples_stay_in_the_bucket(policy):
    p = Problem(100, 304, 80)
    drawn = samples(p, policy, 20, seed=3)
    assert len(drawn) == 20 and len(set(drawn)) > 1
    assert all(bucket(s, policy) == bucket(p, policy) for s in drawn)
    assert all(s.poolable for s in drawn)  # model widths: multiples of 16
    assert samples(p, policy, 5, seed=3) == drawn[:5]


@pytest.mark.interpreter
def test_validation_measures_the_bucket_config_on_each_sample():
    options = TuneOptions(strategy="exhaustive", seed=7, backends=("cublas", "triton_tiled"))
    checks = validate(Problem(24, 48, 48, "float32", "nn"), "pow2", 2, current(), options=options)
    assert len(checks) == 2
    for check in checks:
        assert check.representative == Problem(32, 64, 64, "float32", "nn")
        assert check.loss is not None and check.loss > -0.5  # a ratio of two measured costs
        assert check.bucket_choice and check.exact_choice


def test_bucket_setting_is_validated(monkeypatch):
    from gemmtune import settings

    monkeypatch.setenv("GEMMTUNE_BUCKET", "pow2")
    assert settings.bucket_policy() == "pow2"
    monkeypatch.setenv("GEMMTUNE_BUCKET", "nearest")
    with pytest.raises(ValueError, match="GEMMTUNE_BUCKET='nearest'"):
        settings.bucket_policy()
