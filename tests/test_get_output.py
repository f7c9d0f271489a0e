"""Piece ``get_output``: the plain-decode lists of
``AsyncGPUModelRunnerOutput.get_output``.

Compiled vs twin vs vLLM's two lines (``tolist()`` and the clear loop); the
REAL vLLM 0.33.0 method against the patched one on stand-in outputs (marker
``vllm``); the patch's guard and activation check; the plugin; bad input;
leaks; the ``FASTBATCH_VERIFY`` shadow check (no false divergence, a planted
bug caught and replayed, sampled checks).
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
from id_rows import assert_plain_rows, id_tensors

import fastbatch
from fastbatch import _kernels, _reference, _verify, registry, vllm_plugin
from leaks import assert_no_leak
from verification import applied_with_verify

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


# --- FASTBATCH_VERIFY: the shadow check ------------------------------------


@pytest.fixture(scope="module")
def verified(vllm_runner):
    """The piece applied with every call checked (for hypothesis)."""
    with applied_with_verify("get_output", 1.0) as patch:
        yield patch


def assert_same_call(vllm_runner, got, live, expected, stock, sampled, invalid):
    """The live call left what vLLM's method left on a twin output object."""
    assert got is live._model_runner_output
    assert got.sampled_token_ids == expected.sampled_token_ids
    assert_plain_rows(got.sampled_token_ids)
    assert len({id(row) for row in got.sampled_token_ids}) == len(got.sampled_token_ids)
    assert_same_logprobs(got.logprobs, expected.logprobs)
    assert got.num_nans_in_logits == expected.num_nans_in_logits
    assert vars(got).keys() == vars(expected).keys()
    assert vars(live).keys() == vars(stock).keys()  # the same tensors let go
    assert torch.equal(live.sampled_token_ids_cpu, sampled) and live._invalid_req_indices == invalid


@pytest.mark.vllm
@given(decode_steps(widths=st.sampled_from([1, 1, 1, 2, 4])), st.booleans(), st.booleans())
def test_shadow_agrees_with_vllm(vllm_runner, verified, step, logprobs, nans):
    """No false divergence: the installed, checked method on the real cases;
    plain decode steps are checked, spec steps (parse_output's) are not."""
    sampled, invalid = step
    if sampled.shape[1] > 1:
        logprobs = False
    stock = real_output(vllm_runner, sampled, invalid, logprobs, nans)
    expected = verified.original()(stock)
    live = real_output(vllm_runner, sampled.clone(), list(invalid), logprobs, nans)
    checked = verified.checked
    got = vllm_runner.AsyncGPUModelRunnerOutput.get_output(live)
    assert verified.divergences == 0
    assert verified.checked == checked + (sampled.shape[1] == 1)
    assert_same_call(vllm_runner, got, live, expected, stock, sampled, invalid)


REAL_LISTS = fastbatch.sampled_token_lists
BIG_BATCH = 8  # more rows than any of the activation check's cases


def wrong_for_big_batches(sampled, invalid):
    """The real kernel, then the first row's id plus one in batches of more
    than BIG_BATCH rows (the activation check has at most 5)."""
    rows = REAL_LISTS(sampled, invalid)
    if len(rows) > BIG_BATCH and rows[0]:
        rows[0][0] += 1
    return rows


@pytest.mark.vllm
def test_shadow_catches_a_bug_the_activation_check_cannot_see(vllm_runner, monkeypatch,
                                                              tmp_path, logs):
    monkeypatch.setenv("FASTBATCH_VERIFY_DIR", str(tmp_path))
    cls = vllm_runner.AsyncGPUModelRunnerOutput
    kernel_calls = []

    def planted(sampled, invalid):
        kernel_calls.append(len(sampled))
        return wrong_for_big_batches(sampled, invalid)

    sampled = torch.arange(100, 112, dtype=torch.int32).view(12, 1)
    invalid = [3, -1]
    with applied_with_verify("get_output", 1.0) as patch:
        monkeypatch.setattr(fastbatch, "sampled_token_lists", planted)  # after the check
        small = real_output(vllm_runner, sampled[:4], [1])
        assert cls.get_output(small).sampled_token_ids == [[100], [], [102], [103]]
        assert (patch.checked, patch.divergences) == (1, 0)

        stock = real_output(vllm_runner, sampled, invalid, logprobs=True, nans=True)
        expected = patch.original()(stock)
        live = real_output(vllm_runner, sampled.clone(), list(invalid), logprobs=True, nans=True)
        got = cls.get_output(live)

        # vLLM's lists on the very runner output vLLM holds, the rest as vLLM left it.
        assert got.sampled_token_ids[0] == [100]
        assert_same_call(vllm_runner, got, live, expected, stock, sampled, invalid)
        assert (patch.checked, patch.divergences) == (2, 1)
        status = vllm_plugin.status()["verify"]
        assert status["divergences"] == {name: int(name == "get_output")
                                         for name in registry.NAMES}
        (error,) = logs.at(logging.ERROR)
        assert "'get_output'" in error and "sampled_token_ids: row 0" in error

        # The reproducer replays the divergence, and no longer once the bug is gone.
        (path,) = tmp_path.iterdir()
        assert path.name.startswith(f"get_output-{os.getpid()}-") and str(path) in error
        record = pickle.loads(path.read_bytes())
        assert record["piece"] == "get_output" and record["target"] == patch.target
        assert vllm_plugin.replay(str(path)) is not None
        monkeypatch.setattr(fastbatch, "sampled_token_lists", REAL_LISTS)
        assert vllm_plugin.replay(str(path)) is None

        # From now on the piece is vLLM's code: the kernel is not called again.
        monkeypatch.setattr(fastbatch, "sampled_token_lists", planted)
        calls = len(kernel_calls)
        again = real_output(vllm_runner, sampled.clone(), list(invalid))
        assert cls.get_output(again).sampled_token_ids == expected.sampled_token_ids
        assert len(kernel_calls) == calls
        assert (patch.checked, patch.divergences) == (2, 1)
        assert len(list(tmp_path.iterdir())) == 1


@pytest.mark.vllm
def test_shadow_puts_back_what_a_wrong_kernel_writes_into_its_inputs(vllm_runner, monkeypatch,
                                                                     tmp_path):
    """A kernel that scribbles on the sampled ids or the discarded indices
    (right lists otherwise): a divergence, and the inputs get their values back."""
    monkeypatch.setenv("FASTBATCH_VERIFY_DIR", str(tmp_path))

    def scribbles(sampled, invalid):
        rows = REAL_LISTS(sampled, invalid)
        sampled[0, 0] = -7
        invalid.append(0)
        return rows

    sampled = torch.tensor([[5], [6], [7]], dtype=torch.int64)
    with applied_with_verify("get_output", 1.0) as patch:
        monkeypatch.setattr(fastbatch, "sampled_token_lists", scribbles)
        live = real_output(vllm_runner, sampled.clone(), [1])
        got = vllm_runner.AsyncGPUModelRunnerOutput.get_output(live)
        assert got.sampled_token_ids == [[5], [], [7]]
        assert patch.divergences == 1
        assert torch.equal(live.sampled_token_ids_cpu, sampled)
        assert live._invalid_req_indices == [1]


@pytest.mark.vllm
def test_sampled_verify_checks_some_calls(vllm_runner, monkeypatch):
    """``FASTBATCH_VERIFY=0.25``: a seeded draw, so exactly the calls whose
    draw is under 0.25 are checked."""
    seed, rate, calls = 19, 0.25, 40
    monkeypatch.setattr(_verify, "random", SimpleNamespace(Random=lambda: random.Random(seed)))
    draws = random.Random(seed)
    expected = sum(draws.random() < rate for _ in range(calls))
    assert 0 < expected < calls
    sampled = torch.tensor([[5], [6]], dtype=torch.int32)
    with applied_with_verify("get_output", rate) as patch:
        for _ in range(calls):
            output = real_output(vllm_runner, sampled, [0])
            assert vllm_runner.AsyncGPUModelRunnerOutput.get_output(
                output).sampled_token_ids == [[], [6]]
        assert (patch.checked, patch.divergences) == (expected, 0)


class LateCopy:
    """A copy-ready event whose ``synchronize()`` completes the device-to-host
    copy: until then the CPU tensor holds stale values, as on a GPU."""

    def __init__(self, tensor, values):
        self.tensor, self.values = tensor, values

    def synchronize(self):
        self.tensor.copy_(self.values)


@pytest.mark.vllm
def test_shadow_copies_the_ids_once_the_copy_is_done(vllm_runner, verified):
    """The snapshot waits for the event before copying the ids (a copy taken
    earlier would hold stale ids: a false divergence)."""
    sampled = torch.tensor([[5], [6], [7]], dtype=torch.int32)
    live = real_output(vllm_runner, torch.full_like(sampled, -3), [1])
    live.async_copy_ready_event = LateCopy(live.sampled_token_ids_cpu, sampled)
    checked = verified.checked
    got = vllm_runner.AsyncGPUModelRunnerOutput.get_output(live)
    assert got.sampled_token_ids == [[5], [], [7]]
    assert (verified.checked, verified.divergences) == (checked + 1, 0)
