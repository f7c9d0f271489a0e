"""FASTBATCH_VERIFY, the shadow check, on the real vLLM 0.33.0 code (tox -e vllm).

Each replaced call also runs vLLM's original on a copy of its inputs; a
divergence keeps vLLM's result (in the very list objects vLLM holds), writes a
reproducer, counts it, and switches that piece to vLLM's code.  The planted
bugs below are ones the activation check cannot see (they only show on token
ids or lengths its small synthetic inputs do not have); the real kernels must
give no divergence on generated batches.
"""

import logging
import os
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, note, settings
from vllm.v1.sample.ops import penalties
from vllm.v1.worker.gpu_input_batch import InputBatch

import fastbatch
from batches import Batch, vllm_batches
from batches import real_input_batch as _real_input_batch
from fastbatch import _verify, registry, vllm_plugin
from fastbatch.patches import async_output_token_ids as patch
from fastbatch.patches import async_spec_token_ids as spec_patch
from fastbatch.patches import penalty_output_tokens as penalty_patch
from token_lists import SpecBatch, spec_batches
from token_lists import real_spec_batch as _real_spec_batch

pytestmark = pytest.mark.vllm
# Every piece (by FASTBATCH_DISABLE name), and those with a shadow check: with
# FASTBATCH_VERIFY on, the others stay stock.
PIECES = {piece.name: piece for piece in registry.pieces()}
SHADOWED = tuple(piece.name for piece in PIECES.values()
                 if all(patch.shadow for patch in piece.patches if patch.requires is None))
REAL_OUTPUT_KERNEL = fastbatch.update_async_output_token_ids
REAL_SPEC_KERNEL = fastbatch.update_async_spec_token_ids
REAL_TENSOR_KERNEL = fastbatch.output_tokens_tensor
BIG_ID = 1000  # above every id of the activation checks' synthetic inputs


def test_every_piece_has_a_shadow_on_every_patch():
    """With FASTBATCH_VERIFY on, no piece is left stock (the penalties' masking
    is not a check of its own: under verify it stays vLLM's)."""
    assert SHADOWED == registry.NAMES


def output_kernel_wrong_for_big_ids(req_ids, prev, outputs, sampled, copy_ready=None):
    """The real kernel, then every list ending in an id >= BIG_ID gets it plus one."""
    REAL_OUTPUT_KERNEL(req_ids, prev, outputs, sampled, copy_ready)
    for ids in outputs:
        if ids and ids[-1] >= BIG_ID:
            ids[-1] += 1


def spec_kernel_wrong_for_big_ids(req_ids, prev, spec_token_ids, draft_token_ids):
    REAL_SPEC_KERNEL(req_ids, prev, spec_token_ids, draft_token_ids)
    for ids in spec_token_ids:
        if ids and ids[0] >= BIG_ID:
            ids[0] = 0


def tensor_kernel_wrong_for_long_rows(rows, vocab_size, pin_memory=False):
    """Right for rows of up to 64 ids (all the activation check has)."""
    tokens = REAL_TENSOR_KERNEL(rows, vocab_size, pin_memory)
    if tokens.shape[1] > 64:
        tokens[0, 0] += 1
    return tokens



@pytest.fixture
def verify(monkeypatch, tmp_path):
    """``verify(value)``: FASTBATCH=1 with FASTBATCH_VERIFY=value, registered as
    vLLM registers it; reproducers go to tmp_path.  Stock again afterwards."""
    monkeypatch.setattr(penalties, "PIN_MEMORY", False)  # no accelerator to pin with
    monkeypatch.setenv("FASTBATCH_VERIFY_DIR", str(tmp_path))
    monkeypatch.delenv("FASTBATCH_DISABLE", raising=False)
    for piece in PIECES.values():
        piece.revert()

    def register(value="1"):
        monkeypatch.setenv("FASTBATCH", "1")
        monkeypatch.setenv("FASTBATCH_VERIFY", value)
        vllm_plugin.register()
        return tmp_path

    yield register
    for piece in PIECES.values():
        piece.revert()


@pytest.mark.parametrize(("value", "rate"), [
    (None, 0.0), ("", 0.0), ("0", 0.0), ("off", 0.0), ("1", 1.0), ("TRUE", 1.0),
    (" on ", 1.0), ("1.0", 1.0), ("0.01", 0.01), ("0.5", 0.5), ("0.0", 0.0)])
def test_verify_values(monkeypatch, logs, value, rate):
    if value is None:
        monkeypatch.delenv("FASTBATCH_VERIFY", raising=False)
    else:
        monkeypatch.setenv("FASTBATCH_VERIFY", value)
    assert vllm_plugin.verify_rate() == rate
    assert logs.records == []


@pytest.mark.parametrize("value", ["2", "-0.1", "nan", "inf", "sometimes", "1%", "force"])
def test_bad_verify_value_warns_and_is_off(verify, logs, value):
    verify(value)
    assert vllm_plugin.status()["verify"]["rate"] == 0.0
    assert InputBatch.update_async_output_token_ids is patch.update_async_output_token_ids
    (warning,) = logs.at(logging.WARNING)
    assert repr(value) in warning and "FASTBATCH_VERIFY" in warning


def test_verify_installs_a_checked_replacement(verify, logs):
    verify("1")
    installed = InputBatch.update_async_output_token_ids
    assert installed is not patch.update_async_output_token_ids
    assert getattr(installed, "__fastbatch__", False)
    assert patch.PATCH.original() is not None
    assert all("every call checked against vLLM's" in info for info in logs.at(logging.INFO))
    assert vllm_plugin.status()["verify"] == {
        "rate": 1.0, "checked": dict.fromkeys(PIECES, 0),
        "divergences": dict.fromkeys(PIECES, 0)}


# --- the output-token update -------------------------------------------------

def _batch_with_big_ids():
    """Three requests with placeholders (one of two), one without, a hole;
    sampled ids above BIG_ID."""
    return Batch(
        req_ids=["a", "b", None, "c", "d"],
        prev_req_id_to_index={"a": 1, "b": 0, "c": 2, "d": 3},
        output_token_ids=[[5, -1], [6, 7, -1, -1], None, [8, 9], [-1]],
        sampled=np.array([[1500, 1501], [1200, -1], [3, 3], [4000, 4001]]))


def test_output_without_divergence_keeps_fastbatch_result(verify):
    verify("1")
    batch = _batch_with_big_ids()
    stock, _ = _real_input_batch(batch)
    ours, _ = _real_input_batch(batch)
    patch.PATCH.original()(stock)
    InputBatch.update_async_output_token_ids(ours)
    assert ours.req_output_token_ids == stock.req_output_token_ids
    assert fastbatch.stats()["async_output_token_ids"]["calls"] == 1  # fastbatch did the call
    # vLLM's copy ran too, with the same event: both synchronised it.
    assert ours.async_copy_ready_event.count == 2
    checked = vllm_plugin.status()["verify"]
    assert checked["checked"]["async_output_token_ids"] == 1
    assert checked["divergences"]["async_output_token_ids"] == 0


def test_output_divergence_keeps_vllm_result_in_the_same_lists(verify, monkeypatch, logs):
    monkeypatch.setattr(fastbatch, "update_async_output_token_ids",
                        output_kernel_wrong_for_big_ids)
    folder = verify("1")
    assert patch.PATCH.is_applied()  # the activation check did not see the bug
    batch = _batch_with_big_ids()
    stock, _ = _real_input_batch(batch)
    ours, states = _real_input_batch(batch)
    lists = list(ours.req_output_token_ids)
    patch.PATCH.original()(stock)

    InputBatch.update_async_output_token_ids(ours)

    assert ours.req_output_token_ids == stock.req_output_token_ids == [
        [5, 1200], [6, 7, 1500, 1501], None, [8, 9], [4000]]
    # vLLM's result went into the very lists the requests hold.
    assert all(now is before for now, before in zip(ours.req_output_token_ids, lists,
                                                    strict=True))
    for req_id, index in ours.req_id_to_index.items():
        assert ours.req_output_token_ids[index] is states[req_id].output_token_ids
    status = vllm_plugin.status()["verify"]
    assert status["divergences"] == {name: int(name == "async_output_token_ids") for name in PIECES}
    (error,) = logs.at(logging.ERROR)
    assert "'async_output_token_ids'" in error and patch.PATCH.target in error
    assert "vLLM's result was kept" in error

    # The reproducer replays the divergence, and no longer once the bug is gone.
    (path,) = folder.iterdir()
    assert str(path) in error and path.name.startswith(f"async_output_token_ids-{os.getpid()}-")
    record = pickle.loads(path.read_bytes())
    assert record["piece"] == "async_output_token_ids" and record["vllm_version"] == "0.33.0"
    assert record["fastbatch_outcome"] != record["stock_outcome"]
    assert vllm_plugin.replay(str(path)) is not None
    monkeypatch.setattr(fastbatch, "update_async_output_token_ids", REAL_OUTPUT_KERNEL)
    assert vllm_plugin.replay(str(path)) is None

    # From now on the piece is vLLM's code: the kernel is not called again.
    monkeypatch.setattr(fastbatch, "update_async_output_token_ids",
                        output_kernel_wrong_for_big_ids)
    calls = fastbatch.stats()["async_output_token_ids"]["calls"]
    again, _ = _real_input_batch(batch)
    InputBatch.update_async_output_token_ids(again)
    assert again.req_output_token_ids == stock.req_output_token_ids
    assert fastbatch.stats()["async_output_token_ids"]["calls"] == calls
    assert vllm_plugin.status()["verify"]["divergences"]["async_output_token_ids"] == 1
    assert len(list(folder.iterdir())) == 1


def test_a_kernel_that_raises_where_vllm_does_not_is_a_divergence(verify, monkeypatch):
    def raises_on_big_ids(req_ids, prev, outputs, sampled, copy_ready=None):
        if int(sampled.max()) >= BIG_ID:
            raise ValueError("planted")
        REAL_OUTPUT_KERNEL(req_ids, prev, outputs, sampled, copy_ready)

    monkeypatch.setattr(fastbatch, "update_async_output_token_ids", raises_on_big_ids)
    verify("1")
    batch = _batch_with_big_ids()
    stock, _ = _real_input_batch(batch)
    ours, _ = _real_input_batch(batch)
    patch.PATCH.original()(stock)
    InputBatch.update_async_output_token_ids(ours)  # no exception: vLLM's result
    assert ours.req_output_token_ids == stock.req_output_token_ids
    assert vllm_plugin.status()["verify"]["divergences"]["async_output_token_ids"] == 1


def test_input_that_vllm_rejects_too_raises_without_divergence(verify):
    verify("1")
    batch = _batch_with_big_ids()
    batch.prev_req_id_to_index["a"] = 99  # no such row of sampled ids
    ours, _ = _real_input_batch(batch)
    with pytest.raises(IndexError):
        InputBatch.update_async_output_token_ids(ours)
    status = vllm_plugin.status()["verify"]
    assert status["checked"]["async_output_token_ids"] == 1
    assert status["divergences"]["async_output_token_ids"] == 0


def test_vllm_raising_where_fastbatch_does_not_raises_as_vllm(verify, logs):
    """Stock's exception is what the caller gets (as without fastbatch)."""
    def vllm_fails(self):
        raise RuntimeError("vLLM's own failure")

    verify("0")
    checked = _verify.checked_replacement(patch.PATCH, vllm_fails, 1.0)
    ours, _ = _real_input_batch(_batch_with_big_ids())
    with pytest.raises(RuntimeError, match="vLLM's own failure"):
        checked(ours)
    assert patch.PATCH.divergences == 1
    (error,) = logs.at(logging.ERROR)
    assert "raised RuntimeError" in error


def test_nothing_to_check_on_the_early_return(verify):
    verify("1")
    ours, _ = _real_input_batch(_batch_with_big_ids())
    ours.sampled_token_ids_cpu = None
    InputBatch.update_async_output_token_ids(ours)
    assert vllm_plugin.status()["verify"]["checked"]["async_output_token_ids"] == 0


@pytest.fixture(scope="module")
def verified_output():
    """The output piece applied with every call checked (for hypothesis)."""
    patch.PATCH.revert()
    assert patch.PATCH.apply(verify=1.0)
    yield InputBatch.update_async_output_token_ids
    patch.PATCH.revert()


@settings(max_examples=int(os.environ.get("FASTBATCH_VLLM_EXAMPLES", 1000)) // 2)
@given(batch=vllm_batches)
def test_no_false_divergence_on_generated_batches(verified_output, batch):
    note(repr(batch))
    stock, _ = _real_input_batch(batch)
    ours, states = _real_input_batch(batch)
    patch.PATCH.original()(stock)
    checked = patch.PATCH.checked
    verified_output(ours)
    assert patch.PATCH.divergences == 0
    assert ours.req_output_token_ids == stock.req_output_token_ids
    for req_id, index in ours.req_id_to_index.items():
        assert ours.req_output_token_ids[index] is states[req_id].output_token_ids
    needed = stock.sampled_token_ids_cpu is not None and stock.sampling_metadata.output_token_ids
    assert patch.PATCH.checked == checked + bool(needed)


# --- the spec-token update ---------------------------------------------------

def _spec_batch():
    return SpecBatch(req_ids=["a", "b", "c"], prev_req_id_to_index={"a": 0, "b": 1, "c": 2},
                     spec_token_ids=[[-1, -1], [-1], [-1, -1, -1]],
                     draft_token_ids=[[1100, 1101, 1102], [7, 8], [2000]])


def test_spec_divergence_keeps_vllm_result_in_the_same_lists(verify, monkeypatch, logs):
    monkeypatch.setattr(fastbatch, "update_async_spec_token_ids", spec_kernel_wrong_for_big_ids)
    verify("1")
    assert spec_patch.PATCH.is_applied()
    batch = _spec_batch()
    stock, ours = _real_spec_batch(batch), _real_spec_batch(batch)
    stock_drafts, our_drafts = batch.clone().draft_token_ids, batch.clone().draft_token_ids
    spec_lists, draft_rows = list(ours.spec_token_ids), list(our_drafts)
    spec_patch.PATCH.original()(stock, stock_drafts)

    InputBatch.update_async_spec_token_ids(ours, our_drafts)

    assert ours.spec_token_ids == stock.spec_token_ids
    assert ours.spec_token_ids[:3] == [[1100, 1101], [7], [2000]]
    assert our_drafts == stock_drafts
    assert all(a is b for a, b in zip(ours.spec_token_ids, spec_lists, strict=True))
    assert all(a is b for a, b in zip(our_drafts, draft_rows, strict=True))
    assert vllm_plugin.status()["verify"]["divergences"] == {
        name: int(name == "async_spec_token_ids") for name in PIECES}
    (error,) = logs.at(logging.ERROR)
    assert "'async_spec_token_ids'" in error


@settings(max_examples=int(os.environ.get("FASTBATCH_VLLM_EXAMPLES", 1000)) // 4)
@given(batch=spec_batches(max_reqs=10))
def test_spec_no_false_divergence_on_generated_batches(batch):
    note(repr(batch))
    spec_patch.PATCH.revert()  # no counters left from another test
    original = spec_patch.PATCH.original() or InputBatch.update_async_spec_token_ids
    checked = _verify.checked_replacement(spec_patch.PATCH, original, 1.0)
    stock, ours = _real_spec_batch(batch), _real_spec_batch(batch)
    stock_drafts, our_drafts = batch.clone().draft_token_ids, batch.clone().draft_token_ids
    original(stock, stock_drafts)
    checked(ours, our_drafts)
    assert spec_patch.PATCH.divergences == 0
    assert ours.spec_token_ids == stock.spec_token_ids
    assert our_drafts == stock_drafts


# --- the penalties' tensor ---------------------------------------------------

def test_penalties_divergence_returns_vllm_tensor(verify, monkeypatch, logs):
    monkeypatch.setattr(fastbatch, "output_tokens_tensor", tensor_kernel_wrong_for_long_rows)
    verify("1")
    assert penalty_patch.PATCH.is_applied()
    short = [[1, 2, -1], [3]]
    assert torch.equal(penalties._convert_to_tensors(short, 10, "cpu"),
                       torch.tensor([[1, 2, 10], [3, 10, 10]]))
    rows = [list(range(100)), [5, -1]]
    got = penalties._convert_to_tensors(rows, 200, "cpu")
    expected = penalty_patch.PATCH.original()(rows, 200, "cpu")
    assert expected[1, 1] == -1
    # vLLM's tensor, masked as apply_all_penalties masks it next.
    assert torch.equal(got, expected.masked_fill(expected == -1, 200))
    status = vllm_plugin.status()["verify"]
    assert status["checked"]["penalty_output_tokens"] == 2
    assert status["divergences"]["penalty_output_tokens"] == 1
    (error,) = logs.at(logging.ERROR)
    assert "'penalty_output_tokens'" in error and "at (0, 0) fastbatch gave 1, vLLM 0" in error


def test_sampled_rate_checks_some_calls(verify):
    verify("0")
    original = penalty_patch.PATCH.original() or penalties._convert_to_tensors
    assert not getattr(original, "__fastbatch__", False)
    for rate, low, high in ((0.5, 1, 199), (1.0, 200, 200), (0.0, 0, 0)):
        penalty_patch.PATCH.checked = 0
        checked = _verify.checked_replacement(penalty_patch.PATCH, original, rate)
        for _ in range(200):
            checked([[1, -1]], 10, "cpu")
        assert low <= penalty_patch.PATCH.checked <= high


def test_a_piece_without_shadow_stays_stock_under_verify(verify, monkeypatch, logs):
    monkeypatch.setattr(spec_patch.PATCH, "shadow", None)
    verify("1")
    assert vllm_plugin.status()["patches"] == {
        name: name in SHADOWED and name != "async_spec_token_ids" for name in PIECES}
    (warning,) = [line for line in logs.at(logging.WARNING) if spec_patch.PATCH.target in line]
    assert spec_patch.PATCH.target in warning and "no shadow check" in warning


def test_a_divergence_in_one_patch_sends_the_whole_piece_to_vllm():
    """The checked calls of every patch of a piece read one flag: set by a
    divergence in any of them, cleared when none has one again (a revert
    and a new apply reset a patch's count)."""
    from fastbatch.patches._patch import Patch, Shadow

    def check(method, replacement):
        return None

    unchecked = Shadow(snapshot=lambda: None, run=None, outcome=None, restore=None)
    first, second = (Patch(f"fastbatch.patches._patch:Patch.{name}", lambda: "fastbatch",
                           fingerprints={}, activation_check=check, shadow=unchecked)
                     for name in ("apply", "revert"))
    first.siblings = second.siblings = (first, second)
    checked = _verify.checked_replacement(second, lambda: "vLLM", 0.0)
    assert checked() == "fastbatch" and not second.piece_diverged
    first.divergences += 1
    assert first.piece_diverged and second.piece_diverged and checked() == "vLLM"
    first.divergences = 0
    assert not second.piece_diverged and checked() == "fastbatch"
    second.divergences = 2
    assert first.piece_diverged and checked() == "vLLM"


def test_a_checked_call_with_keywords_reaches_the_shadow_as_vllm_binds_it():
    """vLLM's callers (and its own tests) may pass any argument by keyword;
    the shadow's functions take the call's arguments positionally, as vLLM's
    signature binds them, and a call vLLM's signature refuses raises as it."""
    from fastbatch.patches._patch import Patch, Shadow

    seen = []

    def stock(self, running_reqs, resumed_reqs, scale=1):
        return [scale * len(running_reqs), len(resumed_reqs)]

    def ours(self, running_reqs, resumed_reqs, scale=1):
        return stock(self, running_reqs, resumed_reqs, scale)

    def outcome(inputs, result, self, running_reqs, resumed_reqs, scale=1):
        seen.append((running_reqs, resumed_reqs, scale))
        return result

    shadow = Shadow(snapshot=lambda self, running_reqs, resumed_reqs, scale=1: (
                        running_reqs, resumed_reqs, scale),
                    run=lambda function, inputs: function(None, *inputs),
                    outcome=outcome, restore=lambda inputs, stock, result, *args: stock)
    patch = Patch("fastbatch.patches._patch:Patch.apply", ours, fingerprints={},
                  activation_check=lambda method, replacement: None, shadow=shadow)
    checked = _verify.checked_replacement(patch, stock, 1.0)
    assert checked(None, running_reqs=[1, 2], resumed_reqs=[3], scale=3) == [6, 1]
    assert checked(None, [1], resumed_reqs=[]) == [1, 0]
    assert seen == [([1, 2], [3], 3), ([1], [], 1)]
    assert patch.checked == 2 and patch.divergences == 0
    with pytest.raises(TypeError, match="running_reqs"):
        checked(None, resumed_reqs=[])
    assert patch.checked == 2
