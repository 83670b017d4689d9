"""The model benchmark compiles each model as a user's first compile in a new process: the
compiler's automatic dynamic shapes, which key a frame's input sizes by source line, must not
carry one model's sizes into the next one's compile."""

import torch

from test_models_report import models


def graphs_of_two_sizes(between) -> list[list]:
    """The example inputs of two compiles of one source line's function, on inputs of 8 and 32
    rows, with ``between`` called in between."""
    seen = []

    def backend(graph, example_inputs):
        seen.append([tuple(x.shape) if isinstance(x, torch.Tensor) else x for x in example_inputs])
        return graph

    for rows in (8, 32):
        def forward(x):
            return x @ x.t()

        forward.__code__ = forward.__code__.replace()  # a code object of its own, as ``compiled`` makes
        torch.compile(forward, backend=backend)(torch.randn(rows, 16))
        between()
    return seen


def test_a_model_compiled_after_another_sees_its_own_sizes_as_static():
    models().fresh_compiler()
    first, second = graphs_of_two_sizes(models().fresh_compiler)
    assert first == [(8, 16)] and second == [(32, 16)]


def test_without_it_the_second_compile_is_dynamic():
    """What the reset is for: the second model's rows become a symbol."""
    models().fresh_compiler()
    _, second = graphs_of_two_sizes(lambda: None)
    models().fresh_compiler()
    assert len(second) == 2 and not isinstance(second[0], tuple)
