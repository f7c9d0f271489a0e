"""Piece ``get_output``: the plain-decode lists of
``AsyncGPUModelRunnerOutput.get_output``.

Compiled vs twin vs vLLM's two lines (``tolist()`` and the clear loop); the
REAL vLLM 0.33.0 method against the patched one on stand-in outputs (marker
``vllm``); the patch's guard and activation check; the plugin; bad input;
leaks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from id_rows import assert_plain_rows, id_tensors

import fastbatch
from fastbatch import _kernels, _reference, registry, vllm_plugin
from leaks import assert_no_leak

IMPLEMENTATIONS = [_kernels.sampled_token_lists, _reference.sampled_token_lists]


def vllm_lines(sampled, invalid):
    """vLLM 0.33.0's lines in ``get_output`` (max_gen_len == 1)."""
    valid_sampled_token_ids = sampled.tolist()
    for i in invalid:
        valid_sampled_token_ids[i].clear()
    return valid_sampled_token_ids


DECODE_WIDTH = st.just(1)


@st.composite
def decode_steps(draw, widths=DECODE_WIDTH):
    """A sampled-ids tensor and the rows vLLM discards (any order, repeats,
    negative indices)."""
    sampled = draw(id_tensors(widths=widths))
    num_rows = sampled.shape[0]
    invalid = draw(st.lists(st.integers(-num_rows, num_rows - 1), max_size=6)
                   if num_rows else st.just([]))
    return sampled, invalid


@given(decode_steps(widths=st.integers(0, 5)))
def test_compiled_twin_and_vllm_agree(step):
    sampled, invalid = step
    expected = vllm_lines(sampled, invalid)
    for implementation in IMPLEMENTATIONS:
        rows = implementation(sampled, list(invalid))
        assert rows == expected
        assert_plain_rows(rows)


@given(decode_steps())
def test_numpy_buffers_read_like_tensors(step):
    sampled, invalid = step
    array = sampled.numpy()
    for implementation in IMPLEMENTATIONS:
        assert implementation(array, tuple(invalid)) == vllm_lines(sampled, invalid)


def test_rows_are_fresh_lists_sharing_token_objects():
    sampled = torch.tensor([[300], [300], [5]], dtype=torch.int32)
    rows = _kernels.sampled_token_lists(sampled, [2])
    assert rows == [[300], [300], []]
    assert rows[0] is not rows[1] and rows[0][0] is rows[1][0]  # one shared 300


def test_counters():
    _kernels.reset_stats()
    _reference.reset_stats()
    _kernels.sampled_token_lists(torch.zeros((4, 1), dtype=torch.int32), [0])
    _reference.sampled_token_lists(torch.zeros((4, 1), dtype=torch.int32), [0])
    assert _kernels.stats()["get_output"]["calls"] == 1
    assert _kernels.stats()["get_output"]["rows"] == 4
    assert _reference.stats()["get_output"]["rows"] == 4
    for stats in (_kernels.get_output.stats(), _reference.get_output.stats()):
        assert stats == {"calls": 1, "rows": 4}


@pytest.mark.parametrize(("sampled", "invalid", "error"), [
    ("not a tensor", [], TypeError),
    (torch.zeros(3, dtype=torch.int32), [], TypeError),
    (torch.zeros((2, 1, 1), dtype=torch.int32), [], TypeError),
    (torch.zeros((2, 1), dtype=torch.float32), [], TypeError),
    (torch.zeros((2, 1), dtype=torch.int16), [], TypeError),
    (torch.zeros((2, 1), dtype=torch.int32, device="meta"), [], TypeError),
    (torch.zeros((2, 1), dtype=torch.int32).to_sparse(), [], TypeError),
    (np.zeros((2, 1), dtype=np.float64), [], TypeError),
    (torch.zeros((2, 1), dtype=torch.int32), [2], IndexError),
    (torch.zeros((2, 1), dtype=torch.int32), [-3], IndexError),
    (torch.zeros((2, 1), dtype=torch.int32), [2**70], IndexError),
    (torch.zeros((2, 1), dtype=torch.int32), ["0"], TypeError),
    (torch.zeros((2, 1), dtype=torch.int32), [1.0], TypeError),
    (torch.zeros((2, 1), dtype=torch.int32), 5, TypeError),
])
def test_bad_input_raises_clearly(sampled, invalid, error):
    for implementation in IMPLEMENTATIONS:
        with pytest.raises(error, match=r"sampled_token_ids|invalid_req_indices|'int'"):
            implementation(sampled, invalid)


def test_no_leaks():
    sampled = torch.randint(0, 2**20, (256, 1), dtype=torch.int32)
    invalid = [3, 7, -1]
    for _ in range(3):
        _kernels.sampled_token_lists(sampled, invalid)
    assert_no_leak(lambda: _kernels.sampled_token_lists(sampled, invalid),
                   [sampled, invalid], 300)


# --- against the real vLLM 0.33.0 method, and the patch -------------------


@pytest.fixture(scope="module")
def vllm_runner():
    from vllm.v1.worker import gpu_model_runner

    return gpu_model_runner


def real_output(runner, sampled, invalid, logprobs=False, nans=False):
    """A real ``AsyncGPUModelRunnerOutput`` (``__init__`` skipped: it records a
    CUDA event) with the attributes ``__init__`` leaves, on CPU tensors, and
    a real ``ModelRunnerOutput``."""
    from vllm.v1.outputs import LogprobsTensors, ModelRunnerOutput

    num_rows = sampled.shape[0]
    output = object.__new__(runner.AsyncGPUModelRunnerOutput)
    req_ids = [f"req-{i}" for i in range(num_rows)]
    output._model_runner_output = ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)})
    output._invalid_req_indices = list(invalid)
    output.async_copy_ready_event = torch.Event()
    output._sampled_token_ids = output.sampled_token_ids_cpu = sampled
    output.vocab_size = 512
    output._logprobs_tensors = output._logprobs_tensors_cpu = LogprobsTensors(
        logprob_token_ids=torch.arange(num_rows * 2, dtype=torch.int32).view(num_rows, 2),
        logprobs=torch.linspace(-3, 0, num_rows * 2).view(num_rows, 2),
        selected_token_ranks=torch.arange(num_rows, dtype=torch.int32),
    ) if logprobs else None
    output._num_nans = output._num_nans_cpu = (
        torch.arange(num_rows, dtype=torch.int32) % 2 if nans else None)
    output._has_fault = None
    return output


def assert_same_logprobs(got, expected):
    """vLLM's ``LogprobsLists`` hold numpy arrays: compared field by field."""
    assert type(got) is type(expected)
    if expected is not None:
        for got_field, expected_field in zip(got, expected, strict=True):
            assert type(got_field) is type(expected_field)
            assert np.array_equal(np.asarray(got_field), np.asarray(expected_field))


@pytest.mark.vllm
@given(decode_steps(widths=st.sampled_from([1, 1, 1, 2, 4])), st.booleans(), st.booleans())
def test_patched_get_output_is_vllms(vllm_runner, step, logprobs, nans):
    from fastbatch.patches import get_output as patch

    sampled, invalid = step
    if sampled.shape[1] > 1:  # spec rows go to parse_output: no logprobs there
        logprobs = False
    expected = vllm_runner.AsyncGPUModelRunnerOutput.get_output(
        real_output(vllm_runner, sampled, invalid, logprobs, nans))
    got = patch.get_output(real_output(vllm_runner, sampled, invalid, logprobs, nans))
    assert got.sampled_token_ids == expected.sampled_token_ids
    assert_plain_rows(got.sampled_token_ids)
    assert_same_logprobs(got.logprobs, expected.logprobs)
    assert got.num_nans_in_logits == expected.num_nans_in_logits
    assert vars(got).keys() == vars(expected).keys()
    for name, value in vars(expected).items():
        assert type(getattr(got, name)) is type(value), name


@pytest.mark.vllm
def test_patched_get_output_falls_back_to_vllms_lines(vllm_runner):
    """Input the compiled call refuses (int16 ids, a bool index) runs vLLM's
    own lines: the same lists, or the same error."""
    from fastbatch.patches import get_output as patch

    for sampled, invalid in [(torch.tensor([[3], [4]], dtype=torch.int16), [0]),
                             (torch.tensor([[3], [4]], dtype=torch.int32), [True])]:
        expected = vllm_runner.AsyncGPUModelRunnerOutput.get_output(
            real_output(vllm_runner, sampled, invalid))
        got = patch.get_output(real_output(vllm_runner, sampled, invalid))
        assert got.sampled_token_ids == expected.sampled_token_ids
    with pytest.raises(IndexError):
        patch.get_output(real_output(vllm_runner, torch.zeros((2, 1), dtype=torch.int32), [5]))


@pytest.mark.vllm
def test_guard_and_activation_check(vllm_runner, monkeypatch):
    import vllm

    from fastbatch.patches import get_output as patch

    stock = vllm_runner.AsyncGPUModelRunnerOutput.get_output
    assert patch.PATCH.check_target(vllm.__version__, stock) is None
    assert patch.PATCH.check_target("0.30.0", stock) is not None
    assert "not a verified variant" in patch.PATCH.check_target(vllm.__version__, vllm_lines)
    assert patch.activation_check(stock, patch.get_output) is None
    monkeypatch.setattr(fastbatch, "sampled_token_lists",
                        lambda sampled, invalid: sampled.tolist())  # forgets the clears
    assert patch.activation_check(stock, patch.get_output) is not None


def only(name):
    """``FASTBATCH_DISABLE`` for every piece but ``name``."""
    return " ".join(other for other in registry.NAMES if other != name)


@pytest.mark.vllm
def test_plugin_applies_and_reverts(vllm_runner, monkeypatch):
    from fastbatch.patches import get_output as patch

    cls = vllm_runner.AsyncGPUModelRunnerOutput
    stock = cls.get_output
    piece = registry.piece("get_output")
    assert piece.patches == (patch.PATCH,) and patch.PATCH.needs_async_scheduling
    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setenv("FASTBATCH_DISABLE", only("get_output"))
    try:
        vllm_plugin.register()
        assert cls.get_output is patch.get_output and patch.PATCH.original() is stock
        assert vllm_plugin.status()["patches"] == {name: name == "get_output"
                                                   for name in registry.NAMES}
        _kernels.reset_stats()
        sampled = torch.tensor([[3], [4], [5]], dtype=torch.int32)
        assert real_output(vllm_runner, sampled, [1]).get_output().sampled_token_ids == [
            [3], [], [5]]
        assert _kernels.get_output.stats() == {"calls": 1, "rows": 3}  # the compiled call
    finally:
        vllm_plugin.revert()
    assert cls.get_output is stock and not piece.is_applied()
    monkeypatch.setenv("FASTBATCH_DISABLE", "get_output")
    try:
        vllm_plugin.register()
        assert cls.get_output is stock
        assert vllm_plugin.status()["patches"]["get_output"] is False
    finally:
        vllm_plugin.revert()
