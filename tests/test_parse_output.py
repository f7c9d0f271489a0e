"""Piece ``parse_output``: the token lists of ``RejectionSampler.parse_output``.

Compiled vs twin vs a transcription of vLLM's numpy code; the REAL vLLM
0.33.0 static method against the installed patch (marker ``vllm``),
fallbacks and logprobs included; the guard and activation check; the plugin;
bad input; leaks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from id_rows import VOCAB_SIZE, assert_plain_rows, id_tensors

from fastbatch import _kernels, _reference, registry, vllm_plugin
from leaks import assert_no_leak

IMPLEMENTATIONS = [_kernels.rejection_output_lists, _reference.rejection_output_lists]
VOCAB_SIZES = st.one_of(st.just(VOCAB_SIZE), st.integers(-3, VOCAB_SIZE + 2),
                        st.sampled_from([2**31, 2**63, 2**70, -2**70]))


def vllm_lists(output_token_ids, vocab_size, discard_req_indices=()):
    """vLLM 0.33.0's ``parse_output`` without logprobs, transcribed."""
    output_token_ids_np = output_token_ids.cpu().numpy()
    valid_mask = (output_token_ids_np != -1) & (output_token_ids_np < vocab_size)
    if len(discard_req_indices) > 0:
        valid_mask[discard_req_indices] = False
    return [row[valid_mask[i]].tolist() for i, row in enumerate(output_token_ids_np)]


@st.composite
def spec_steps(draw):
    """Rejection-sampler output: rows of accepted ids then -1 padding, mixed
    with arbitrary rows; the discarded rows as a list or an index array."""
    ids = draw(id_tensors(widths=st.integers(0, 6)))
    num_rows, width = ids.shape
    for row in range(num_rows):
        if width and draw(st.booleans()):  # accepted prefix, rejected tail
            ids[row, draw(st.integers(1, width)):] = -1
    indices = draw(st.lists(st.integers(-num_rows, num_rows - 1), max_size=5)
                   if num_rows else st.just([]))
    kind = draw(st.sampled_from(["list", "int64 array", "int32 array", "uint8 array"]))
    if kind == "int64 array":
        indices = np.array(indices, dtype=np.int64)
    elif kind == "int32 array":
        indices = np.array(indices, dtype=np.int32)
    elif kind == "uint8 array":
        indices = np.array([i % num_rows for i in indices] if num_rows else [], dtype=np.uint8)
    return ids, draw(VOCAB_SIZES), indices


@given(spec_steps())
def test_compiled_twin_and_vllm_agree(step):
    ids, vocab_size, discard = step
    expected = vllm_lists(ids, vocab_size, discard)
    for implementation in IMPLEMENTATIONS:
        rows = implementation(ids, vocab_size, discard)
        assert rows == expected
        assert_plain_rows(rows)


def test_defaults_and_shared_token_objects():
    ids = torch.tensor([[300, -1], [300, 600]], dtype=torch.int32)
    rows = _kernels.rejection_output_lists(ids, 512)
    assert rows == [[300], [300]] and rows[0][0] is rows[1][0]
    assert _kernels.rejection_output_lists(ids, 512, ()) == rows


def test_counters():
    _kernels.reset_stats()
    _reference.reset_stats()
    ids = torch.tensor([[1, -1], [2, 3], [4, 5]], dtype=torch.int32)
    for implementation in IMPLEMENTATIONS:
        implementation(ids, 512, [2])
    for stats in (_kernels.stats()["parse_output"], _reference.stats()["parse_output"],
                  _kernels.parse_output.stats(), _reference.parse_output.stats()):
        assert stats == {"calls": 1, "rows": 3, "tokens": 3}


IDS = torch.zeros((2, 3), dtype=torch.int32)


@pytest.mark.parametrize(("ids", "vocab_size", "discard", "error"), [
    ("not a tensor", 512, [], TypeError),
    (torch.zeros(3, dtype=torch.int32), 512, [], TypeError),
    (torch.zeros((2, 3), dtype=torch.float32), 512, [], TypeError),
    (torch.zeros((2, 3), dtype=torch.int32, device="meta"), 512, [], TypeError),
    (IDS, 512.0, [], TypeError),
    (IDS, "512", [], TypeError),
    (IDS, 512, [2], IndexError),
    (IDS, 512, [-3], IndexError),
    (IDS, 512, [2**70], IndexError),
    (IDS, 512, np.array([5]), IndexError),
    (IDS, 512, np.array([2**64 - 1], dtype=np.uint64), IndexError),
    (IDS, 512, [True], TypeError),      # numpy reads bools as a mask
    (IDS, 512, [np.int64(0)], TypeError),
    (IDS, 512, (0, 1), TypeError),      # numpy reads a tuple as one element
    (IDS, 512, np.array([True, False]), TypeError),
    (IDS, 512, np.array([[0]]), TypeError),
    (IDS, 512, np.array([0.0]), TypeError),
    (IDS, 512, {0}, TypeError),
])
def test_bad_input_raises_clearly(ids, vocab_size, discard, error):
    for implementation in IMPLEMENTATIONS:
        with pytest.raises(error, match=r"output_token_ids|vocab_size|discard_req_indices"):
            implementation(ids, vocab_size, discard)


def test_no_leaks():
    ids = torch.randint(-1, 2**20, (256, 4), dtype=torch.int32)
    for discard in ([3, -1], np.array([5, 6])):
        def step(discard=discard):
            return _kernels.rejection_output_lists(ids, 2**19, discard)
        for _ in range(3):
            step()
        assert_no_leak(step, [ids, discard], 300)


# --- against the real vLLM 0.33.0 method, and the patch -------------------


@pytest.fixture(scope="module")
def installed():
    """The patch installed; yields vLLM's own static method."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    from fastbatch.patches import parse_output as patch

    stock = RejectionSampler.parse_output
    assert patch.PATCH.apply()
    assert RejectionSampler.parse_output is not stock
    yield stock
    patch.PATCH.revert()
    assert RejectionSampler.parse_output is stock


@pytest.mark.vllm
@given(spec_steps())
def test_patched_parse_output_is_vllms(installed, step):
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    ids, vocab_size, discard = step
    expected = installed(ids, vocab_size, discard)
    got = RejectionSampler.parse_output(ids, vocab_size, discard)
    assert type(got) is tuple and got == expected
    assert_plain_rows(got[0])
    # called on an instance too, as a static method must be
    assert object.__new__(RejectionSampler).parse_output(ids, vocab_size, discard) == expected


@pytest.mark.vllm
@pytest.mark.parametrize(("ids", "vocab_size", "discard"), [
    (torch.tensor([[1, 2], [3, -1], [5, 6]], dtype=torch.int32), 512, [True, False, True]),
    (torch.tensor([[1, 2], [3, -1], [5, 6]], dtype=torch.int32), 512, (1, 0)),
    (torch.tensor([[1, 2], [3, -1], [5, 6]], dtype=torch.int16), 512, [1]),
    (torch.tensor([[1, 2], [3, -1], [5, 6]], dtype=torch.int32), 3.5, [1]),
    (torch.tensor([[1, 2], [3, -1], [5, 6]], dtype=torch.int32), 512,
     np.array([True, False, False])),
])
def test_patched_parse_output_falls_back_to_vllms(installed, ids, vocab_size, discard):
    """Input the compiled call refuses runs vLLM's own method, with numpy's
    own reading of the indices."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    assert RejectionSampler.parse_output(ids, vocab_size, discard) == installed(
        ids, vocab_size, discard)


@pytest.mark.vllm
def test_patched_parse_output_raises_vllms_errors(installed):
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    with pytest.raises(IndexError) as stock_error:
        installed(IDS, 512, [7])
    with pytest.raises(IndexError) as patched_error:
        RejectionSampler.parse_output(IDS, 512, [7])
    assert str(patched_error.value) == str(stock_error.value)


@pytest.mark.vllm
@given(spec_steps())
def test_patched_parse_output_with_logprobs_is_vllms(installed, step):
    from vllm.v1.outputs import LogprobsTensors
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    ids, vocab_size, discard = step
    num_tokens = ids.numel()
    logprobs = LogprobsTensors(
        logprob_token_ids=torch.arange(num_tokens * 2, dtype=torch.int32).view(num_tokens, 2),
        logprobs=torch.linspace(-3, 0, num_tokens * 2).view(num_tokens, 2),
        selected_token_ranks=torch.arange(num_tokens, dtype=torch.int32))
    expected = installed(ids, vocab_size, discard, logprobs_tensors=logprobs)
    got = RejectionSampler.parse_output(ids, vocab_size, discard, logprobs_tensors=logprobs)
    assert got[0] == expected[0]
    for got_field, expected_field in zip(got[1], expected[1], strict=True):
        assert np.array_equal(np.asarray(got_field), np.asarray(expected_field))


@pytest.mark.vllm
def test_guard_and_activation_check(monkeypatch):
    import vllm
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    import fastbatch
    from fastbatch.patches import parse_output as patch

    stock = patch.PATCH.original() or RejectionSampler.parse_output  # (installed by a fixture?)
    assert patch.PATCH.check_target(vllm.__version__, stock) is None
    assert patch.PATCH.check_target("0.34.0", stock) is not None
    assert "not a verified variant" in patch.PATCH.check_target(vllm.__version__, vllm_lists)
    assert patch.activation_check(stock, patch.PATCH.replacement) is None
    monkeypatch.setattr(fastbatch, "rejection_output_lists",  # forgets the vocabulary
                        lambda ids, vocab_size, discard: vllm_lists(ids, 2**40, discard))
    assert patch.activation_check(stock, patch.PATCH.replacement) is not None


def only(name):
    """``FASTBATCH_DISABLE`` for every piece but ``name``."""
    return " ".join(other for other in registry.NAMES if other != name)


@pytest.mark.vllm
def test_plugin_applies_and_reverts(monkeypatch):
    import inspect

    from vllm.v1.sample.rejection_sampler import RejectionSampler

    from fastbatch.patches import parse_output as patch

    piece = registry.piece("parse_output")
    installed_here = piece.is_applied()  # by the ``installed`` fixture, if it ran first
    piece.revert()
    stock = RejectionSampler.parse_output
    assert piece.patches == (patch.PATCH,)
    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setenv("FASTBATCH_DISABLE", only("parse_output"))
    try:
        vllm_plugin.register()
        assert RejectionSampler.parse_output is patch.parse_output
        assert type(inspect.getattr_static(RejectionSampler, "parse_output")) is staticmethod
        assert patch.PATCH.original() is stock
        assert vllm_plugin.status()["patches"] == {name: name == "parse_output"
                                                   for name in registry.NAMES}
        _kernels.reset_stats()
        ids = torch.tensor([[1, -1], [2, 3]], dtype=torch.int32)
        assert RejectionSampler.parse_output(ids, 512, []) == ([[1], [2, 3]], None)
        assert _kernels.parse_output.stats() == {"calls": 1, "rows": 2, "tokens": 3}
    finally:
        vllm_plugin.revert()
    assert RejectionSampler.parse_output is stock and not piece.is_applied()
    assert type(inspect.getattr_static(RejectionSampler, "parse_output")) is staticmethod
    monkeypatch.setenv("FASTBATCH_DISABLE", "parse_output")
    try:
        vllm_plugin.register()
        assert RejectionSampler.parse_output is stock
        assert vllm_plugin.status()["patches"]["parse_output"] is False
    finally:
        vllm_plugin.revert()
        if installed_here:
            assert piece.apply()
