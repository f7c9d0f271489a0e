"""Piece ``draft_token_ids``: the draft-token lists of
``GPUModelRunner._get_draft_token_ids_cpu``.

Compiled vs twin vs vLLM's slice and ``tolist()``; the REAL vLLM 0.33.0
method against the patched one on stand-in runners (marker ``vllm``); the
guard and activation check; the plugin; bad input; leaks.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from id_rows import assert_plain_rows, id_tensors

from fastbatch import _kernels, _reference, registry, vllm_plugin
from leaks import assert_no_leak

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

    import fastbatch
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


@pytest.mark.vllm
def test_plugin_disable_by_the_deprecated_name_drafts(monkeypatch, logs):
    """fastbatch 0.1's ``FASTBATCH_DISABLE=drafts`` still leaves this piece
    stock, and says that the name is deprecated."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stock = GPUModelRunner._get_draft_token_ids_cpu
    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setenv("FASTBATCH_DISABLE", "drafts")
    try:
        vllm_plugin.register()
        assert GPUModelRunner._get_draft_token_ids_cpu is stock
        assert not registry.piece("draft_token_ids").is_applied()
        assert registry.piece("get_output").is_applied()  # the others are on
    finally:
        vllm_plugin.revert()
    assert any("FASTBATCH_DISABLE=drafts is deprecated" in line
               and "'draft_token_ids'" in line for line in logs.at(logging.WARNING))
