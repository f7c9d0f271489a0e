"""Hypothesis strategies and checks shared by the rows-to-lists pieces' tests
(get_output, parse_output, drafts): 2-D int tensors as vLLM hands them over."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

VOCAB_SIZE = 512
# Ids as the rows hold them: real tokens, the -1 of rejected slots, ids at and
# past the vocabulary (parse_output drops them), other negatives, int32 edges.
ID_VALUES = st.one_of(
    st.integers(0, VOCAB_SIZE - 1), st.just(-1), st.sampled_from([VOCAB_SIZE, VOCAB_SIZE + 1]),
    st.integers(-5, -2), st.sampled_from([2**31 - 1, -2**31, 2**18 - 1, 2**18]),
)


ANY_WIDTH = st.integers(0, 6)


@st.composite
def id_tensors(draw, widths=ANY_WIDTH, max_rows=40, rows=None):
    """A 2-D int32 or int64 CPU tensor, sometimes a strided view (a slice of
    a bigger buffer, or a transpose) as vLLM's sliced buffers are."""
    num_rows = draw(rows if rows is not None else st.integers(0, max_rows))
    width = draw(widths)
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    values = draw(st.lists(ID_VALUES, min_size=num_rows * width, max_size=num_rows * width))
    tensor = torch.tensor(values, dtype=dtype).view(num_rows, width)
    layout = draw(st.sampled_from(["contiguous", "padded", "transposed"]))
    if layout == "padded":  # rows of a wider buffer: row stride > width
        buffer = torch.full((num_rows, width + 3), 7, dtype=dtype)
        buffer[:, :width] = tensor
        tensor = buffer[:, :width]
    elif layout == "transposed":
        tensor = tensor.t().contiguous().t()
    return tensor


def assert_plain_rows(rows: object) -> None:
    """A plain list of plain lists of plain ints (no subclasses, no numpy ints)."""
    assert type(rows) is list
    for row in rows:
        assert type(row) is list
        for token in row:
            assert type(token) is int
