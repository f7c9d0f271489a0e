"""Piece ``draft_token_ids``: the draft-token lists of
``GPUModelRunner._get_draft_token_ids_cpu``.

Compiled vs twin vs vLLM's slice and ``tolist()``; the REAL vLLM 0.33.0
method against the patched one on stand-in runners (marker ``vllm``); the
guard and activation check; the plugin; bad input; leaks; the
``FASTBATCH_VERIFY`` shadow check (no false divergence, a planted bug caught
and replayed, sampled checks).
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

IMPLEMENTATIONS = [_kernels.draft_token_lists, _reference.draft_token_lists]


@st.composite
def draft_buffers(draw):
    """vLLM's ``draft_token_ids_cpu`` buffer (``[max_num_reqs, num_spec_tokens]``)
    and the counts it is sliced with, within and beyond its size."""
    buffer = draw(id_tensors(widths=st.integers(0, 6), max_rows=48))
    num_reqs = draw(st.integers(0, buffer.shape[0] + 2))
    num_spec_tokens = draw(st.integers(0, buffer.shape[1] + 2))
    return buffer, num_reqs, num_spec_tokens


@given(draft_buffers())
def test_compiled_twin_and_vllm_agree(case):
    buffer, num_reqs, num_spec_tokens = case
    expected = buffer[:num_reqs, :num_spec_tokens].tolist()
    for implementation in IMPLEMENTATIONS:
        rows = implementation(buffer, num_reqs, num_spec_tokens)
        assert rows == expected
        assert_plain_rows(rows)
        assert implementation(buffer.numpy(), num_reqs, num_spec_tokens) == expected


def test_counters():
    _kernels.reset_stats()
    _reference.reset_stats()
    for implementation in IMPLEMENTATIONS:
        implementation(torch.zeros((8, 3), dtype=torch.int64), 5, 3)
    for stats in (_kernels.stats()["draft_token_ids"], _reference.stats()["draft_token_ids"],
                  _kernels.draft_token_ids.stats(), _reference.draft_token_ids.stats()):
        assert stats == {"calls": 1, "rows": 5}


@pytest.mark.parametrize(("buffer", "num_reqs", "num_spec_tokens", "error"), [
    ("not a tensor", 1, 1, TypeError),
    (torch.zeros(3, dtype=torch.int64), 1, 1, TypeError),
    (torch.zeros((2, 3), dtype=torch.float64), 1, 1, TypeError),
    (torch.zeros((2, 3), dtype=torch.int64, device="meta"), 1, 1, TypeError),
    (np.zeros((2, 3), dtype=np.uint64), 1, 1, TypeError),
    (torch.zeros((2, 3), dtype=torch.int64), -1, 1, ValueError),
    (torch.zeros((2, 3), dtype=torch.int64), 1, -1, ValueError),
    (torch.zeros((2, 3), dtype=torch.int64), 1.0, 1, TypeError),
    (torch.zeros((2, 3), dtype=torch.int64), None, 1, TypeError),
])
def test_bad_input_raises_clearly(buffer, num_reqs, num_spec_tokens, error):
    for implementation in IMPLEMENTATIONS:
        with pytest.raises(error):
            implementation(buffer, num_reqs, num_spec_tokens)


def test_no_leaks():
    buffer = torch.randint(0, 2**20, (1024, 4), dtype=torch.int64)
    for _ in range(3):
        _kernels.draft_token_lists(buffer, 256, 3)
    assert_no_leak(lambda: _kernels.draft_token_lists(buffer, 256, 3), [buffer], 300)


# --- against the real vLLM 0.33.0 method, and the patch -------------------


def real_runner(drafts, buffer, req_ids):
    """A real ``GPUModelRunner`` (``__init__`` skipped: it needs a model
    config and a device) with the attributes the method reads."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = object.__new__(GPUModelRunner)
    runner._draft_token_ids = drafts
    runner._draft_token_req_ids = req_ids
    runner.draft_token_ids_cpu = buffer
    runner.draft_token_ids_event = torch.Event()
    runner.input_batch = SimpleNamespace(req_ids=["from-the-batch"])
    return runner


@st.composite
def runner_states(draw):
    buffer = draw(id_tensors(widths=st.integers(1, 5), max_rows=48))
    kind = draw(st.sampled_from(["tensor", "tensor", "tensor", "list", "none"]))
    num_reqs = draw(st.integers(0, buffer.shape[0]))
    req_ids = [f"req-{i}" for i in range(num_reqs)]
    if kind == "list":
        return [[1, 2]] * num_reqs, buffer, req_ids
    if kind == "none":
        return None, buffer, None
    drafts = torch.zeros((num_reqs, draw(st.integers(0, buffer.shape[1]))), dtype=torch.int64)
    return drafts, buffer, req_ids


@pytest.mark.vllm
@given(runner_states())
def test_patched_method_is_vllms(state):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from fastbatch.patches import draft_token_ids as patch

    stock = patch.PATCH.original() or GPUModelRunner._get_draft_token_ids_cpu
    expected = stock(real_runner(*state))
    got = patch._get_draft_token_ids_cpu(real_runner(*state))
    assert type(got) is tuple and got == expected
    assert type(got[1]) is type(expected[1])
    if state[0] is None or isinstance(state[0], torch.Tensor):
        assert_plain_rows(got[0])
    else:
        assert got[0] is state[0]  # vLLM hands its own list back


@pytest.mark.vllm
def test_patched_method_falls_back_to_vllms_expression():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from fastbatch.patches import draft_token_ids as patch

    stock = patch.PATCH.original() or GPUModelRunner._get_draft_token_ids_cpu
    state = (torch.zeros((2, 2)), torch.arange(8, dtype=torch.int16).view(4, 2), ["a", "b"])
    assert patch._get_draft_token_ids_cpu(real_runner(*state)) == stock(real_runner(*state))


@pytest.mark.vllm
def test_guard_and_activation_check(monkeypatch):
    import vllm
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from fastbatch.patches import draft_token_ids as patch

    stock = patch.PATCH.original() or GPUModelRunner._get_draft_token_ids_cpu
    assert patch.PATCH.check_target(vllm.__version__, stock) is None
    assert patch.PATCH.check_target("0.23.0", stock) is not None
    assert "not a verified variant" in patch.PATCH.check_target(vllm.__version__, real_runner)
    assert patch.activation_check(stock, patch._get_draft_token_ids_cpu) is None
    monkeypatch.setattr(fastbatch, "draft_token_lists",  # forgets the width
                        lambda buffer, num_reqs, width: buffer[:num_reqs].tolist())
    assert patch.activation_check(stock, patch._get_draft_token_ids_cpu) is not None


def only(name):
    """``FASTBATCH_DISABLE`` for every piece but ``name``."""
    return " ".join(other for other in registry.NAMES if other != name)


@pytest.mark.vllm
def test_plugin_applies_and_reverts(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from fastbatch.patches import draft_token_ids as patch

    stock = GPUModelRunner._get_draft_token_ids_cpu
    piece = registry.piece("draft_token_ids")
    assert piece.patches == (patch.PATCH,)
    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setenv("FASTBATCH_DISABLE", only("draft_token_ids"))
    try:
        vllm_plugin.register()
        assert GPUModelRunner._get_draft_token_ids_cpu is patch._get_draft_token_ids_cpu
        assert patch.PATCH.original() is stock
        assert vllm_plugin.status()["patches"] == {name: name == "draft_token_ids"
                                                   for name in registry.NAMES}
        _kernels.reset_stats()
        buffer = torch.arange(12, dtype=torch.int64).view(4, 3)
        runner = real_runner(torch.zeros((2, 2), dtype=torch.int64), buffer, ["a", "b"])
        assert runner._get_draft_token_ids_cpu() == ([[0, 1], [3, 4]], ["a", "b"])
        assert _kernels.draft_token_ids.stats() == {"calls": 1, "rows": 2}  # the compiled call
    finally:
        vllm_plugin.revert()
    assert GPUModelRunner._get_draft_token_ids_cpu is stock and not piece.is_applied()
    monkeypatch.setenv("FASTBATCH_DISABLE", "draft_token_ids")
    try:
        vllm_plugin.register()
        assert GPUModelRunner._get_draft_token_ids_cpu is stock
        assert vllm_plugin.status()["patches"]["draft_token_ids"] is False
    finally:
        vllm_plugin.revert()



# --- FASTBATCH_VERIFY: the shadow check ------------------------------------


REAL_LISTS = fastbatch.draft_token_lists


@pytest.fixture(scope="module")
def verified():
    """The piece applied with every call checked (for hypothesis)."""
    with applied_with_verify("draft_token_ids", 1.0) as patch:
        yield patch


def assert_same_call(got, runner, expected, buffer):
    """vLLM's result exactly: a tuple, distinct plain rows, the runner's own
    request-id list; the buffer untouched."""
    assert type(got) is tuple and got == expected
    assert_plain_rows(got[0])
    assert len({id(row) for row in got[0]}) == len(got[0])
    assert got[1] is runner._draft_token_req_ids
    assert torch.equal(runner.draft_token_ids_cpu, buffer)


@pytest.mark.vllm
@given(runner_states())
def test_shadow_agrees_with_vllm(verified, state):
    """No false divergence: the installed, checked method on the real cases;
    the calls that build lists (drafts in a tensor) are checked."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    drafts, buffer, req_ids = state
    expected = verified.original()(real_runner(*state))
    runner = real_runner(drafts, buffer.clone(), req_ids)
    checked = verified.checked
    got = GPUModelRunner._get_draft_token_ids_cpu(runner)
    assert verified.divergences == 0
    assert verified.checked == checked + isinstance(drafts, torch.Tensor)
    if isinstance(drafts, list):
        assert got[0] is drafts and got[1] is runner.input_batch.req_ids
    elif drafts is None:
        assert got == ([], [])
    else:
        assert_same_call(got, runner, expected, buffer)


BIG_BATCH = 6  # more requests than any of the activation check's cases


def wrong_for_big_batches(buffer, num_reqs, num_spec_tokens):
    """The real kernel, then the first draft id plus one for more than
    BIG_BATCH requests."""
    rows = REAL_LISTS(buffer, num_reqs, num_spec_tokens)
    if num_reqs > BIG_BATCH and rows and rows[0]:
        rows[0][0] += 1
    return rows


@pytest.mark.vllm
def test_shadow_catches_a_bug_the_activation_check_cannot_see(monkeypatch, tmp_path, logs):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.setenv("FASTBATCH_VERIFY_DIR", str(tmp_path))
    kernel_calls = []

    def planted(buffer, num_reqs, num_spec_tokens):
        kernel_calls.append(num_reqs)
        return wrong_for_big_batches(buffer, num_reqs, num_spec_tokens)

    buffer = torch.arange(100, 140, dtype=torch.int64).view(10, 4)
    req_ids = [f"req-{i}" for i in range(8)]
    drafts = torch.zeros((8, 3), dtype=torch.int64)
    with applied_with_verify("draft_token_ids", 1.0) as patch:
        monkeypatch.setattr(fastbatch, "draft_token_lists", planted)  # after the check
        small = real_runner(drafts[:2], buffer.clone(), req_ids[:2])
        assert small._get_draft_token_ids_cpu() == ([[100, 101, 102], [104, 105, 106]],
                                                    req_ids[:2])
        assert (patch.checked, patch.divergences) == (1, 0)

        expected = patch.original()(real_runner(drafts, buffer.clone(), req_ids))
        runner = real_runner(drafts, buffer.clone(), req_ids)
        got = GPUModelRunner._get_draft_token_ids_cpu(runner)
        assert got[0][0] == [100, 101, 102]  # vLLM's lists
        assert_same_call(got, runner, expected, buffer)
        assert (patch.checked, patch.divergences) == (2, 1)
        status = vllm_plugin.status()["verify"]
        assert status["divergences"] == {name: int(name == "draft_token_ids")
                                         for name in registry.NAMES}
        (error,) = logs.at(logging.ERROR)
        assert "'draft_token_ids'" in error and "row 0: fastbatch gave [101, 101, 102]" in error

        # The reproducer replays the divergence, and no longer once the bug is gone.
        (path,) = tmp_path.iterdir()
        assert path.name.startswith(f"draft_token_ids-{os.getpid()}-") and str(path) in error
        record = pickle.loads(path.read_bytes())
        assert record["piece"] == "draft_token_ids" and record["target"] == patch.target
        assert vllm_plugin.replay(str(path)) is not None
        monkeypatch.setattr(fastbatch, "draft_token_lists", REAL_LISTS)
        assert vllm_plugin.replay(str(path)) is None

        # From now on the piece is vLLM's code: the kernel is not called again.
        monkeypatch.setattr(fastbatch, "draft_token_lists", planted)
        calls = len(kernel_calls)
        again = real_runner(drafts, buffer.clone(), req_ids)
        assert_same_call(again._get_draft_token_ids_cpu(), again, expected, buffer)
        assert len(kernel_calls) == calls
        assert (patch.checked, patch.divergences) == (2, 1)
        assert len(list(tmp_path.iterdir())) == 1


@pytest.mark.vllm
def test_shadow_puts_back_what_a_wrong_kernel_writes_into_the_buffer(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTBATCH_VERIFY_DIR", str(tmp_path))

    def scribbles(buffer, num_reqs, num_spec_tokens):
        rows = REAL_LISTS(buffer, num_reqs, num_spec_tokens)
        buffer[0, 0] = -5
        return rows

    buffer = torch.arange(12, dtype=torch.int64).view(4, 3)
    with applied_with_verify("draft_token_ids", 1.0) as patch:
        monkeypatch.setattr(fastbatch, "draft_token_lists", scribbles)
        runner = real_runner(torch.zeros((2, 2), dtype=torch.int64), buffer.clone(), ["a", "b"])
        got = runner._get_draft_token_ids_cpu()
        assert got == ([[0, 1], [3, 4]], ["a", "b"]) and patch.divergences == 1
        assert torch.equal(runner.draft_token_ids_cpu, buffer)


@pytest.mark.vllm
def test_sampled_verify_checks_some_calls(monkeypatch):
    """``FASTBATCH_VERIFY=0.25``: a seeded draw, so exactly the calls whose
    draw is under 0.25 are checked."""
    seed, rate, calls = 19, 0.25, 40
    monkeypatch.setattr(_verify, "random", SimpleNamespace(Random=lambda: random.Random(seed)))
    draws = random.Random(seed)
    expected = sum(draws.random() < rate for _ in range(calls))
    assert 0 < expected < calls
    buffer = torch.arange(12, dtype=torch.int64).view(4, 3)
    with applied_with_verify("draft_token_ids", rate) as patch:
        for _ in range(calls):
            runner = real_runner(torch.zeros((2, 2), dtype=torch.int64), buffer, ["a", "b"])
            assert runner._get_draft_token_ids_cpu() == ([[0, 1], [3, 4]], ["a", "b"])
        assert (patch.checked, patch.divergences) == (expected, 0)


class LateCopy:
    """A draft event whose ``synchronize()`` completes the device-to-host copy:
    until then the buffer holds stale values, as on a GPU."""

    def __init__(self, tensor, values):
        self.tensor, self.values = tensor, values

    def synchronize(self):
        self.tensor.copy_(self.values)


@pytest.mark.vllm
def test_shadow_copies_the_drafts_once_the_copy_is_done(verified):
    """The snapshot waits for the event before copying the buffer's rows (a
    copy taken earlier would hold stale drafts: a false divergence)."""
    buffer = torch.arange(12, dtype=torch.int64).view(4, 3)
    runner = real_runner(torch.zeros((2, 2), dtype=torch.int64), torch.full_like(buffer, -3),
                         ["a", "b"])
    runner.draft_token_ids_event = LateCopy(runner.draft_token_ids_cpu, buffer)
    checked = verified.checked
    assert runner._get_draft_token_ids_cpu() == ([[0, 1], [3, 4]], ["a", "b"])
    assert (verified.checked, verified.divergences) == (checked + 1, 0)
