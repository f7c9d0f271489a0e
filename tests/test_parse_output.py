"""Piece ``parse_output``: the token lists of ``RejectionSampler.parse_output``.

Compiled vs twin vs a transcription of vLLM's numpy code; the REAL vLLM
0.33.0 static method against the installed patch (marker ``vllm``),
fallbacks and logprobs included; the guard and activation check; the plugin;
bad input; leaks; the ``FASTBATCH_VERIFY`` shadow check (no false divergence,
a planted bug caught and replayed, sampled checks).
"""

from __future__ import annotations

import logging
import os
import pickle
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from id_rows import VOCAB_SIZE, assert_plain_rows, id_tensors

import fastbatch
from fastbatch import _kernels, _reference, _verify, registry, vllm_plugin
from leaks import assert_no_leak
from verification import applied_with_verify

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


# --- FASTBATCH_VERIFY: the shadow check ------------------------------------


@pytest.fixture(scope="module")
def verified():
    """The piece applied with every call checked (for hypothesis)."""
    with applied_with_verify("parse_output", 1.0) as patch:
        yield patch


def assert_exactly(got, expected):
    """vLLM's result exactly: a (lists, None) tuple, distinct plain rows."""
    assert type(got) is tuple and got == expected
    assert_plain_rows(got[0])
    assert len({id(row) for row in got[0]}) == len(got[0])


@pytest.mark.vllm
@given(spec_steps())
def test_shadow_agrees_with_vllm(verified, step):
    """No false divergence: the installed, checked static method (through the
    class and through an instance) on the real cases, every call checked."""
    import inspect

    from vllm.v1.sample.rejection_sampler import RejectionSampler

    assert type(inspect.getattr_static(RejectionSampler, "parse_output")) is staticmethod
    ids, vocab_size, discard = step
    saved = ids.clone()
    expected = verified.original()(ids, vocab_size, discard)
    checked = verified.checked
    assert_exactly(RejectionSampler.parse_output(ids, vocab_size, discard), expected)
    assert_exactly(object.__new__(RejectionSampler).parse_output(
        ids, vocab_size, discard_req_indices=discard), expected)
    assert (verified.checked, verified.divergences) == (checked + 2, 0)
    assert torch.equal(ids, saved)


@pytest.mark.vllm
def test_shadow_leaves_calls_with_logprobs_and_vllms_errors_to_vllm(verified):
    """With logprobs, or ids on a device, the replacement is vLLM's method:
    not checked.  Input vLLM refuses too raises vLLM's error, checked,
    without a divergence."""
    from vllm.v1.outputs import LogprobsTensors
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    ids = torch.tensor([[1, -1], [2, 3]], dtype=torch.int32)
    logprobs = LogprobsTensors(
        logprob_token_ids=torch.arange(8, dtype=torch.int32).view(4, 2),
        logprobs=torch.linspace(-3, 0, 8).view(4, 2),
        selected_token_ranks=torch.arange(4, dtype=torch.int32))
    checked = verified.checked
    rows, lists = RejectionSampler.parse_output(ids, 512, [0], logprobs_tensors=logprobs)
    assert rows == [[], [2, 3]] and lists is not None
    assert verified.checked == checked
    with pytest.raises(IndexError):
        RejectionSampler.parse_output(IDS, 512, [7])
    assert (verified.checked, verified.divergences) == (checked + 1, 0)
    # Ids on a device: vLLM's method (here its error), not checked.
    with pytest.raises(NotImplementedError):
        RejectionSampler.parse_output(torch.zeros((2, 3), dtype=torch.int32, device="meta"), 512)
    assert (verified.checked, verified.divergences) == (checked + 1, 0)


REAL_LISTS = fastbatch.rejection_output_lists
BIG_BATCH = 6  # more rows than any of the activation check's cases (4)


def wrong_for_big_batches(ids, vocab_size, discard=()):
    """The real kernel, then in batches of more than BIG_BATCH rows the last
    id of the first non-empty row dropped (as if rejected)."""
    rows = REAL_LISTS(ids, vocab_size, discard)
    if len(rows) > BIG_BATCH:
        for row in rows:
            if row:
                row.pop()
                break
    return rows


@pytest.mark.vllm
def test_shadow_catches_a_bug_the_activation_check_cannot_see(monkeypatch, tmp_path, logs):
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    monkeypatch.setenv("FASTBATCH_VERIFY_DIR", str(tmp_path))
    kernel_calls = []

    def planted(ids, vocab_size, discard=()):
        kernel_calls.append(len(ids))
        return wrong_for_big_batches(ids, vocab_size, discard)

    ids = torch.tensor([[10 * row + col for col in range(3)] for row in range(8)],
                       dtype=torch.int64)
    ids[2, 1:] = -1
    discard = [5]
    with applied_with_verify("parse_output", 1.0) as patch:
        monkeypatch.setattr(fastbatch, "rejection_output_lists", planted)  # after the check
        assert RejectionSampler.parse_output(ids[:4], 512, []) == (
            [[0, 1, 2], [10, 11, 12], [20], [30, 31, 32]], None)
        assert (patch.checked, patch.divergences) == (1, 0)

        expected = patch.original()(ids, 512, discard)
        got = RejectionSampler.parse_output(ids, 512, discard)
        assert_exactly(got, expected)  # vLLM's lists
        assert got[0][0] == [0, 1, 2]
        assert (patch.checked, patch.divergences) == (2, 1)
        status = vllm_plugin.status()["verify"]
        assert status["divergences"] == {name: int(name == "parse_output")
                                         for name in registry.NAMES}
        (error,) = logs.at(logging.ERROR)
        assert "'parse_output'" in error and "row 0: fastbatch gave [0, 1]" in error

        # The reproducer replays the divergence, and no longer once the bug is gone.
        (path,) = tmp_path.iterdir()
        assert path.name.startswith(f"parse_output-{os.getpid()}-") and str(path) in error
        record = pickle.loads(path.read_bytes())
        assert record["piece"] == "parse_output" and record["target"] == patch.target
        assert vllm_plugin.replay(str(path)) is not None
        monkeypatch.setattr(fastbatch, "rejection_output_lists", REAL_LISTS)
        assert vllm_plugin.replay(str(path)) is None

        # From now on the piece is vLLM's code: the kernel is not called again.
        monkeypatch.setattr(fastbatch, "rejection_output_lists", planted)
        calls = len(kernel_calls)
        assert_exactly(object.__new__(RejectionSampler).parse_output(ids, 512, discard),
                       expected)
        assert len(kernel_calls) == calls
        assert (patch.checked, patch.divergences) == (2, 1)
        assert len(list(tmp_path.iterdir())) == 1


@pytest.mark.vllm
def test_shadow_puts_back_what_a_wrong_kernel_writes_into_the_ids(monkeypatch, tmp_path):
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    monkeypatch.setenv("FASTBATCH_VERIFY_DIR", str(tmp_path))

    def scribbles(ids, vocab_size, discard=()):
        rows = REAL_LISTS(ids, vocab_size, discard)
        ids[0, 0] = 99
        return rows

    ids = torch.tensor([[1, 2], [3, -1]], dtype=torch.int32)
    with applied_with_verify("parse_output", 1.0) as patch:
        monkeypatch.setattr(fastbatch, "rejection_output_lists", scribbles)
        live = ids.clone()
        assert_exactly(RejectionSampler.parse_output(live, 512, []), ([[1, 2], [3]], None))
        assert patch.divergences == 1
        assert torch.equal(live, ids)


@pytest.mark.vllm
def test_sampled_verify_checks_some_calls(monkeypatch):
    """``FASTBATCH_VERIFY=0.25``: a seeded draw, so exactly the calls whose
    draw is under 0.25 are checked."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    seed, rate, calls = 19, 0.25, 40
    monkeypatch.setattr(_verify, "random", SimpleNamespace(Random=lambda: random.Random(seed)))
    draws = random.Random(seed)
    expected = sum(draws.random() < rate for _ in range(calls))
    assert 0 < expected < calls
    ids = torch.tensor([[1, 2], [3, -1]], dtype=torch.int32)
    with applied_with_verify("parse_output", rate) as patch:
        for _ in range(calls):
            assert RejectionSampler.parse_output(ids, 512, [0]) == ([[], [3]], None)
        assert (patch.checked, patch.divergences) == (expected, 0)
