import pytest

from gemmtune.problem import Problem, parse_shape


def test_key_format_is_pinned():
    # Persisted keys: changing this format orphans every stored result. Bump KEY_VERSION instead.
    assert Problem(1, 6144, 4096).key() == "v2/linear/bfloat16/1x6144x4096/bias=0/act=none"
    assert Problem(4095, 4097, 4095, "float32", "nn", bias=True, tf32=True).key() == "v2/nn/float32+tf32/4095x4097x4095/bias=1/act=none"
    assert Problem(256, 1024, 1024, bias=True, activation="gelu_tanh").key() == "v2/linear/bfloat16/256x1024x1024/bias=1/act=gelu_tanh"
    assert Problem(16, 4096, 14336, "float8_e4m3fn", scaling="row").key() \
        == "v2/linear/float8_e4m3fn>bfloat16@row/16x4096x14336/bias=0/act=none"
    assert Problem(128, 128, 64, "float32", "linear", batch=384).key() \
        == "v2/linear/float32/128x128x64/bias=0/act=none/batch=384"


@pytest.mark.parametrize("problem", [
    Problem(1, 1, 1), Problem(7, 33, 4095, "float16", "nn", True), Problem(256, 1024, 1024, "float32", tf32=True),
    Problem(256, 1024, 1024, "float32", tf32=False), Problem(3, 5, 7, bias=True, activation="silu"),
    Problem(1, 4096, 4096, "float8_e4m3fn", scaling="tensor"),
    Problem(33, 130, 200, "float8_e5m2", bias=True, activation="gelu", scaling="block", out_dtype="float32"),
    Problem(7, 33, 1, "float16", "nn", batch=2), Problem(128, 64, 128, "float32", tf32=True, batch=65536),
])
def test_key_round_trips(problem):
    assert Problem.from_key(problem.key()) == problem


def test_an_fp8_product_is_scaled_with_a_wider_output():
    p = Problem(16, 4096, 4096, "float8_e4m3fn", scaling="row")
    assert p.scaled and p.out_dtype == "bfloat16" and p.element_size == 1
    assert p.min_bytes == 16 * 4096 + 4096 * 4096 + 2 * 16 * 4096
    unscaled = Problem(16, 4096, 4096, "float16")
    assert not unscaled.scaled and unscaled.out_dtype == "float16" and unscaled.scaling == "none"


@pytest.mark.parametrize("kwargs, message", [
    (dict(dtype="float8_e4m3fn"), "fp8 products .* take one of tensor, row, block"),
    (dict(dtype="bfloat16", scaling="row"), "does not go with dtype 'bfloat16'"),
    (dict(dtype="float8_e5m2", scaling="rows"), "Problem.scaling 'rows' is not a scaling"),
    (dict(dtype="float8_e5m2", scaling="row", out_dtype="float8_e5m2"), "accepted: float16, bfloat16, float32"),
    (dict(dtype="bfloat16", out_dtype="float32"), "Problem.out_dtype 'float32' is not accepted"),
    (dict(dtype="float8_e4m3fn", scaling="tensor", layout="nn"), "layout 'linear'"),
])
def test_scaled_problems_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Problem(8, 8, 8, **kwargs)


def test_a_batched_product_counts_every_matrix():
    p = Problem(3, 5, 7, "float16", "nn", batch=4)
    assert p.flops == 4 * 2 * 3 * 5 * 7
    assert p.min_bytes == 4 * 2 * (3 * 7 + 7 * 5 + 3 * 5)
    assert p.describe() == "4 x 3x5x7 float16 nn"
    assert Problem(3, 5, 7, batch=1) == Problem(3, 5, 7)


@pytest.mark.parametrize("kwargs", [dict(bias=True), dict(activation="gelu"),
                                    dict(dtype="float8_e4m3fn", scaling="tensor")])
def test_a_batched_product_takes_no_epilogue_or_scaling(kwargs):
    with pytest.raises(ValueError, match="Problem.batch 2: a batched product takes no bias, activation or scaling"):
        Problem(8, 8, 8, batch=2, **kwargs)


def test_tf32_only_means_something_for_float32():
    assert Problem(8, 8, 8, "bfloat16", tf32=True).tf32 is False
    assert Problem(8, 8, 8, "bfloat16", tf32=True).key() == Problem(8, 8, 8, "bfloat16").key()


@pytest.mark.parametrize("kwargs, message", [
    (dict(m=0, n=1, k=1), "Problem.m must be an int >= 1"),
    (dict(m=1, n=-3, k=1), "Problem.n"),
    (dict(m=1, n=1, k=2.0), "Problem.k"),
    (dict(m=True, n=1, k=1), "Problem.m"),
    (dict(m=1, n=1, k=1, batch=0), "Problem.batch must be an int >= 1"),
    (dict(m=1, n=1, k=1, dtype="float64"), "accepted: float16, bfloat16, float32"),
    (dict(m=1, n=1, k=1, layout="tn"), "accepted: linear, nn"),
    (dict(m=1, n=1, k=1, activation="tanh"), "accepted: none, relu, gelu, gelu_tanh, silu"),
])
def test_invalid_problems_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Problem(**kwargs)


@pytest.mark.parametrize("key", [
    "", "v1/linear/bfloat16/1x1x1/bias=0", "v2/linear/bfloat16/1x1x1/bias=0", "v2/linear/bfloat16/0x1x1/bias=0/act=none",
    "v2/linear/int8/1x1x1/bias=0/act=none", "v2/linear/bfloat16/1x1x1/bias=0/act=tanh",
    "v2/linear/bfloat16/1x1x1/bias=0/act=none; DROP TABLE", None,
    "v2/linear/bfloat16/1x1x1/bias=0/act=none/batch=1", "v2/linear/bfloat16/1x1x1/bias=0/act=none/batch=02",
])
def test_from_key_rejects_malformed(key):
    with pytest.raises(ValueError, match="not a gemmtune problem key"):
        Problem.from_key(key)


def test_parse_shape():
    assert parse_shape("4095x4097x4095") == (4095, 4097, 4095)
    with pytest.raises(ValueError, match="MxNxK"):
        parse_shape("4096x4096")
    with pytest.raises(ValueError, match=">= 1"):
        parse_shape("0x1x1")


def test_sizes():
    p = Problem(2, 3, 4, "float32")
    assert p.flops == 48 and p.min_bytes == 4 * (8 + 12 + 6)
