"""Property-based differential tests: compiled kernel == reference == vLLM 0.33.

No vLLM needed: the oracle is ``batches.vllm_0_33_loop``, vLLM's loop body
transcribed; ``test_vllm_differential.py`` repeats this against the real class.
"""

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import fastbatch
from batches import Batch, CountingEvent, batches, vllm_0_33_loop
from fastbatch import _reference


def _run(update, batch: Batch, copy_ready_kind: str = "event"):
    event = CountingEvent()
    copy_ready = {"event": event, "callable": event.synchronize}[copy_ready_kind]
    result = update(batch.req_ids, batch.prev_req_id_to_index,
                    batch.output_token_ids, batch.sampled_as_given(), copy_ready)
    return result, event.count


@given(batch=batches(), copy_ready_kind=st.sampled_from(["event", "callable"]))
def test_matches_vllm_loop(implementation, batch, copy_ready_kind):
    note(repr(batch))
    expected = batch.clone()
    event = CountingEvent()
    vllm_0_33_loop(expected.req_ids, expected.prev_req_id_to_index,
                   expected.output_token_ids, expected.sampled, event)

    got = batch.clone()
    lists_before = [id(ids) for ids in got.output_token_ids]
    _, syncs = _run(implementation.update_async_output_token_ids, got, copy_ready_kind)

    assert got.output_token_ids == expected.output_token_ids
    assert syncs == event.count == int(batch.needs_ids())
    # Mutated in place: each request's list is still the same object.
    assert [id(ids) for ids in got.output_token_ids] == lists_before
    assert got.req_ids == batch.req_ids
    assert got.prev_req_id_to_index == batch.prev_req_id_to_index


@given(batch=batches())
def test_compiled_and_reference_agree_on_results_and_stats(batch):
    results, stats = [], []
    for module in (fastbatch._kernels, _reference):
        module.reset_stats()
        state = batch.clone()
        result, syncs = _run(module.update_async_output_token_ids, state)
        results.append((result, syncs, state.output_token_ids))
        stats.append(module.stats())
    assert results[0] == results[1]
    assert stats[0] == stats[1]
    assert stats[0]["calls"] == 1
    assert stats[0]["syncs"] == results[0][1]


def test_worked_example(implementation):
    """One batch with every case side by side, spelled out."""
    req_ids = ["decode", "spec", None, "discarded", "empty", "new", "zero", "short"]
    prev = {"decode": 2, "spec": 0, "discarded": 1, "empty": 1, "zero": 3,
            "short": 4, "finished": 1}
    outputs = [
        [5, -1],              # one placeholder, one id
        [1, -1, 2, -1, -1, -1],  # spec decode: 3 placeholders, 2 accepted
        None,                 # hole left by remove_request
        [8, 9],               # last item not -1: tokens were discarded
        [],                   # empty list
        [4, -1],              # not in the map: new this step
        [3, -1, -1],          # row says nothing was sampled
        [6, -1],              # more ids sampled than placeholders
    ]
    sampled = [
        [10, 11, -1],
        [20, 21, 22],
        [30, -1, -1],
        [-1, -1, -1],
        [40, 41, 42],
    ]
    event = CountingEvent()
    updated = implementation.update_async_output_token_ids(
        req_ids, prev, outputs, np.array(sampled, dtype=np.int32), event)
    assert outputs == [
        [5, 30],
        [1, -1, 2, 10, 11],
        None,
        [8, 9],
        [],
        [4, -1],
        [3],
        [6, 40],
    ]
    assert updated == 4
    assert event.count == 1


def test_nothing_needed_neither_syncs_nor_reads_sampled(implementation):
    """Like vLLM: no placeholder to fill, so the sampled ids are never touched."""
    event = CountingEvent()
    outputs = [[1, 2], [], None]
    result = implementation.update_async_output_token_ids(
        ["a", "b", None], {"a": 0, "b": 1}, outputs, object(), event)
    assert (result, event.count, outputs) == (0, 0, [[1, 2], [], None])


def test_zero_width_rows_sync_but_change_nothing(implementation):
    event = CountingEvent()
    outputs = [[1, -1]]
    result = implementation.update_async_output_token_ids(
        ["a"], {"a": 0}, outputs, np.zeros((1, 0), np.int64), event)
    assert (result, event.count, outputs) == (0, 1, [[1, -1]])


def test_copy_ready_none_means_already_copied(implementation):
    outputs = [[1, -1]]
    implementation.update_async_output_token_ids(
        ["a"], {"a": 0}, outputs, np.array([[9]]), None)
    assert outputs == [[1, 9]]


def test_large_batch_long_outputs(implementation):
    """A realistic step: 512 requests x 3000 tokens, spec decode with 4 drafts."""
    rng = np.random.default_rng(0)
    num_reqs, drafts = 512, 4
    req_ids = [f"r{i}" for i in range(num_reqs)]
    rows = rng.permutation(num_reqs)
    prev = {r: int(row) for r, row in zip(req_ids, rows, strict=True)}
    outputs = [list(rng.integers(0, 32_000, 3000)) + [-1] * (drafts + 1)
               for _ in range(num_reqs)]
    outputs = [[int(t) for t in ids] for ids in outputs]
    accepted = rng.integers(1, drafts + 2, num_reqs)
    sampled = np.full((num_reqs, drafts + 1), -1, np.int32)
    for row in range(num_reqs):
        sampled[row, :accepted[row]] = rng.integers(0, 32_000, accepted[row])
    expected = [list(ids) for ids in outputs]
    vllm_0_33_loop(req_ids, prev, expected, sampled, CountingEvent())
    implementation.update_async_output_token_ids(req_ids, prev, outputs, sampled)
    assert outputs == expected


def test_reentrant_call_from_synchronize(implementation):
    """A synchronize callback that runs another update (its own working memory)."""
    inner_outputs = [[9, -1, -1]]

    def synchronize():
        implementation.update_async_output_token_ids(
            ["x"], {"x": 0}, inner_outputs, np.array([[70, 71]], np.int64))

    outputs = [[1, -1], [2, -1]]
    implementation.update_async_output_token_ids(
        ["a", "b"], {"a": 1, "b": 0}, outputs, np.array([[10], [20]], np.int32), synchronize)
    assert outputs == [[1, 20], [2, 10]]
    assert inner_outputs == [[9, 70, 71]]


@pytest.mark.parametrize("placeholders", [2, 16, 17, 40])
def test_dropping_many_placeholders(implementation, placeholders):
    """Short tails are cut in place, long ones (> 16) through PyList_SetSlice."""
    outputs = [[1] + [-1] * placeholders, [2] + [-1] * placeholders]
    expected = [list(ids) for ids in outputs]
    sampled = np.array([[5, 6, -1], [7, -1, -1]], np.int64)
    vllm_0_33_loop(["a", "b"], {"a": 0, "b": 1}, expected, sampled, CountingEvent())
    implementation.update_async_output_token_ids(["a", "b"], {"a": 0, "b": 1}, outputs,
                                                 sampled)
    assert outputs == expected == [[1, 5, 6], [2, 7]]


def test_placeholder_whose_release_runs_python(implementation):
    """A -1 whose __del__ appends to the list: the list stays whole, as in vLLM."""

    def batch():
        token_ids = [1]

        class Placeholder(int):
            def __del__(self):
                token_ids.append(99)

        token_ids.extend(Placeholder(-1) for _ in range(3))
        return token_ids

    expected, got = [batch()], [batch()]
    sampled = np.array([[5]], np.int64)
    vllm_0_33_loop(["a"], {"a": 0}, expected, sampled, CountingEvent())
    implementation.update_async_output_token_ids(["a"], {"a": 0}, got, sampled)
    assert got == expected == [[1, 5, 99, 99, 99]]


def test_sampled_array_read_only_after_synchronize(implementation):
    """numpy too: the values written while synchronising are the ones used."""
    sampled = np.array([[1], [2]], np.int64)
    outputs = [[-1], [-1]]

    def synchronize():  # the async copy "lands" only now
        sampled[:, 0] = 41, 42

    implementation.update_async_output_token_ids(["a", "b"], {"a": 1, "b": 0}, outputs,
                                                 sampled, synchronize)
    assert outputs == [[42], [41]]
