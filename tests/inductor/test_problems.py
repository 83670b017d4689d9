"""Which compiler GEMMs gemmtune serves, and as what problem: from sizes, strides and dtypes."""

import pytest

from gemmtune.inductor.problems import Operands, layout_of, problem_of
from gemmtune.problem import Problem


def mm(m, n, k, a_strides=None, b_strides=None, dtype="bfloat16", **kw):
    return Operands("mm", ((m, k), (k, n)), (a_strides or (k, 1), b_strides or (n, 1)), (dtype, dtype),
                    kw.pop("out_dtype", dtype), **kw)


def addmm(m, n, k, bias_shape=None, bias_strides=None, b_strides=None, scalars=None, dtype="float16"):
    bias_shape = bias_shape or (m, n)
    bias_strides = bias_strides or ((0, 1) if len(bias_shape) == 2 else (1,))
    return Operands("addmm", (bias_shape, (m, k), (k, n)), (bias_strides, (k, 1), b_strides or (1, k)),
                    (dtype,) * 3, dtype, True, scalars or {"alpha": 1, "beta": 1})


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (7, 33, 4095), (4096, 768, 3072), (33, 1, 7)])
def test_a_row_major_product_is_an_nn_problem(m, n, k):
    assert problem_of(mm(m, n, k), tf32=False) == Problem(m, n, k, "bfloat16", "nn")


@pytest.mark.parametrize("m,n,k", [(1, 64, 33), (7, 33, 4095), (256, 3072, 768)])
def test_a_transposed_weight_is_a_linear_problem(m, n, k):
    assert problem_of(mm(m, n, k, b_strides=(1, k)), tf32=False) == Problem(m, n, k, "bfloat16", "linear")


def test_a_bias_row_repeated_or_given_alone_is_the_problems_bias():
    expanded = problem_of(addmm(64, 768, 3072), tf32=False)
    alone = problem_of(addmm(64, 768, 3072, bias_shape=(768,)), tf32=False)
    assert expanded == alone == Problem(64, 768, 3072, "float16", "linear", bias=True)
    one_row = problem_of(addmm(1, 768, 3072, bias_strides=(768, 1)), tf32=False)
    assert one_row == Problem(1, 768, 3072, "float16", "linear", bias=True)


def bmm(batch, m, n, k, a_strides=None, b_strides=None, dtype="float32", batch_b=None):
    return Operands("bmm", ((batch, m, k), (batch_b or batch, k, n)),
                    (a_strides or (m * k, k, 1), b_strides or (k * n, n, 1)), (dtype, dtype), dtype)


@pytest.mark.parametrize("batch,m,n,k", [(2, 1, 1, 1), (384, 128, 128, 64), (384, 128, 64, 128), (3, 7, 33, 4095)])
def test_a_bmm_is_a_batched_problem_in_either_layout(batch, m, n, k):
    assert problem_of(bmm(batch, m, n, k), tf32=False) == Problem(m, n, k, "float32", "nn", batch=batch)
    keys = bmm(batch, m, n, k, b_strides=(k * n, 1, k))  # attention's q @ k.T: each b a transposed (N, K)
    layout = "nn" if n == k == 1 else "linear"  # a 1x1 b is both; either layout computes it
    assert problem_of(keys, tf32=False) == Problem(m, n, k, "float32", layout, batch=batch)


def test_a_bmm_of_one_product_is_a_plain_problem():
    assert problem_of(bmm(1, 8, 16, 32), tf32=False) == Problem(8, 16, 32, "float32", "nn")


def test_a_bmm_whose_batch_is_laid_out_otherwise_is_still_served():
    # the matrices' own layout is what the tuned kernel depends on; the batch may stride anyhow
    heads = bmm(12, 128, 64, 128, a_strides=(0, 128, 1), b_strides=(3 * 128 * 64, 64, 1))
    assert problem_of(heads, tf32=False) == Problem(128, 64, 128, "float32", "nn", batch=12)


def test_tf32_is_kept_for_float32_only():
    assert problem_of(mm(8, 16, 32, dtype="float32"), tf32=True).tf32
    assert not problem_of(mm(8, 16, 32), tf32=True).tf32


@pytest.mark.parametrize("operands,why", [
    (mm(8, 16, 32, a_strides=(1, 8)), "a transposed"),
    (mm(8, 16, 32, a_strides=(64, 1)), "a's rows padded"),
    (mm(8, 16, 32, b_strides=(32, 2)), "b strided both ways"),
    (mm(8, 16, 32, dtype="float64"), "a dtype gemmtune does not serve"),
    (mm(8, 16, 32, out_dtype="float32"), "a wider output"),
    (mm(8, 16, 32, static=False), "a dynamic size"),
    (Operands("mm", ((8, 32), (32, 16)), ((32, 1), (16, 1)), ("bfloat16", "float16"), "bfloat16"), "mixed dtypes"),
    (bmm(2, 8, 16, 32, a_strides=(256, 1, 8)), "a batched a transposed"),
    (bmm(2, 8, 16, 32, b_strides=(512, 32, 2)), "a batched b strided both ways"),
    (bmm(2, 8, 16, 32, batch_b=3), "batches that differ"),
    (Operands("baddbmm", ((2, 8, 16), (2, 8, 32), (2, 32, 16)), ((128, 16, 1), (256, 32, 1), (512, 16, 1)),
              ("float32",) * 3, "float32"), "a batched product with a term added"),
    (addmm(64, 768, 3072, bias_strides=(768, 1)), "a full matrix added (a residual)"),
    (addmm(64, 768, 3072, scalars={"alpha": 1, "beta": 0.5}), "a scaled bias"),
    (addmm(64, 768, 3072, scalars={"alpha": 2, "beta": 1}), "a scaled product"),
    (addmm(64, 768, 3072, bias_shape=(64, 1), bias_strides=(1, 0)), "a bias per row"),
])
def test_what_gemmtune_leaves_to_the_compiler(operands, why):
    assert problem_of(operands, tf32=False) is None, why


def test_the_runtime_reads_the_layout_the_compiler_was_given():
    assert layout_of((16, 1), 32, 16) == "nn"
    assert layout_of((1, 32), 32, 16) == "linear"
    assert layout_of((1, 1), 1, 1) == "nn"  # a 1x1 b is both; either layout computes it
    assert layout_of((3, 5), 32, 16) is None
