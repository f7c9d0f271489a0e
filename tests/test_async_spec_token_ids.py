"""async_spec_token_ids: ``InputBatch.update_async_spec_token_ids``.

Compiled kernel == pure-Python twin == vLLM 0.33's loop (no vLLM needed: the
oracle is ``token_lists.vllm_0_33_spec_loop``, vLLM's loop transcribed); the
same against the REAL vLLM 0.33.0 method (``vllm``-marked: on real
``InputBatch``es, ``token_lists.real_spec_batch``, and on stand-ins holding
shared and ``None`` lists), the kernel and the patched method; bad input; leaks.

vLLM is imported only inside the ``vllm``-marked tests, so that the others
run where vLLM is not installed.
"""

import gc
import os
from types import SimpleNamespace

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

import fastbatch
from batches import VLLM_MAX_REQS
from fastbatch import _reference, registry
from leaks import assert_no_leak
from token_lists import SpecBatch, real_spec_batch, spec_batches, vllm_0_33_spec_loop

NAME = "async_spec_token_ids"
PIECE = registry.piece(NAME)
EXAMPLES = int(os.environ.get("FASTBATCH_VLLM_EXAMPLES", 1000))


def _run(update, batch: SpecBatch) -> int:
    return update(batch.req_ids, batch.prev_req_id_to_index, batch.spec_token_ids,
                  batch.draft_token_ids)


def _identities(batch: SpecBatch) -> list[int]:
    return [id(ids) for ids in batch.spec_token_ids + batch.draft_token_ids]


@given(batch=spec_batches())
def test_matches_vllm_loop(implementation, batch):
    note(repr(batch))
    expected = batch.clone()
    expected_updated = vllm_0_33_spec_loop(*vars(expected).values())
    got = batch.clone()
    identities = _identities(got)

    assert _run(implementation.update_async_spec_token_ids, got) == expected_updated
    assert got.lists() == expected.lists()
    assert _identities(got) == identities  # every list changed in place
    # Shared lists are still shared exactly as vLLM left them.
    assert [[a is b for b in got.spec_token_ids + got.draft_token_ids]
            for a in got.spec_token_ids] == \
        [[a is b for b in expected.spec_token_ids + expected.draft_token_ids]
         for a in expected.spec_token_ids]
    assert got.req_ids == batch.req_ids
    assert got.prev_req_id_to_index == batch.prev_req_id_to_index


@given(batch=spec_batches())
def test_compiled_and_reference_agree_on_results_and_stats(batch):
    results, stats = [], []
    for module in (fastbatch._kernels, _reference):
        module.reset_stats()
        state = batch.clone()
        results.append((_run(module.update_async_spec_token_ids, state), state.lists()))
        stats.append(module.stats())
    assert results[0] == results[1]
    assert stats[0] == stats[1]
    assert stats[0][NAME]["calls"] == 1
    assert stats[0][NAME]["requests_updated"] == results[0][0]


def test_worked_example(implementation):
    """Equal, shorter and longer draft rows; a new request; a hole; no spec tokens."""
    drafts = [[11, 12, 13], [21], [31, 32], []]
    spec = [[-1, -1], [-1, -1], [-1], [-1, -1], [], [-1]]
    prev = {"longer": 0, "shorter": 1, "equal": 2, "empty-draft": 3, "none": 0}
    updated = implementation.update_async_spec_token_ids(
        ["longer", "shorter", "equal", "empty-draft", "none", "new"], prev, spec, drafts)
    assert updated == 3
    assert spec == [[11, 12], [21], [31], [-1, -1], [], [-1]]
    # vLLM cuts the draft rows it uses to the request's length.
    assert drafts == [[11, 12], [21], [31], []]


def test_rows_shared_by_two_requests_are_cut_in_order(implementation):
    drafts = [[1, 2, 3]]
    spec = [[-1, -1], [-1, -1, -1]]
    implementation.update_async_spec_token_ids(["a", "b"], {"a": 0, "b": 0}, spec, drafts)
    assert spec == [[1, 2], [1, 2]] and drafts == [[1, 2]]


def test_a_spec_list_that_is_its_own_draft_row_ends_empty(implementation):
    """``spec.clear(); spec.extend(draft)`` with spec is draft: vLLM empties it,
    and a later request mapped to that (now empty) row is skipped."""
    shared = [-1, -1]
    spec, drafts = [shared, [-1]], [shared, [5]]
    assert implementation.update_async_spec_token_ids(
        ["a", "b"], {"a": 0, "b": 0}, spec, drafts) == 1
    assert spec == [[], [-1]] and drafts == [[], [5]]


@pytest.mark.parametrize("size", [1, 16, 17, 40])
def test_long_spec_lists(implementation, size):
    """Past the in-place limit (16 items) the general path takes over."""
    spec = [[-1] * size, [-1] * size]
    shorter = list(range(100, 100 + max(size - 1, 1)))
    drafts = [list(range(size + 3)), list(shorter)]
    implementation.update_async_spec_token_ids(["a", "b"], {"a": 0, "b": 1}, spec, drafts)
    assert spec == [list(range(size)), shorter]


def test_item_whose_release_runs_python(implementation):
    """Releasing a replaced item may run Python code: no crash, the right
    result, and the item really is released (no leaked reference)."""
    seen = []

    class Noisy(int):
        def __del__(self):
            seen.append([list(s) for s in spec])

    spec = [[Noisy(-1), -1], [-1]]
    drafts = [[1, 2], [3]]
    implementation.update_async_spec_token_ids(["a", "b"], {"a": 0, "b": 1}, spec, drafts)
    gc.collect()
    assert spec == [[1, 2], [3]]
    assert len(seen) == 1


# --- against the real vLLM 0.33.0 method --------------------------------------

@pytest.fixture(scope="module")
def stock_spec_method():
    """vLLM's own ``update_async_spec_token_ids``, whatever is installed now."""
    from vllm.v1.worker.gpu_input_batch import InputBatch

    method = PIECE.main.original() or InputBatch.update_async_spec_token_ids
    assert not getattr(method, "__fastbatch__", False)
    return method


@pytest.mark.vllm
@settings(max_examples=EXAMPLES)
@given(batch=spec_batches(max_reqs=VLLM_MAX_REQS))
def test_spec_update_matches_real_input_batch(stock_spec_method, implementation, batch):
    note(repr(batch))
    stock, ours = real_spec_batch(batch), real_spec_batch(batch)
    stock_drafts, our_drafts = batch.clone().draft_token_ids, batch.clone().draft_token_ids
    stock_spec_method(stock, stock_drafts)
    if our_drafts and ours.prev_req_id_to_index:  # the method's early returns
        implementation.update_async_spec_token_ids(
            ours.req_ids, ours.prev_req_id_to_index, ours.sampling_metadata.spec_token_ids,
            our_drafts)
    assert ours.spec_token_ids == stock.spec_token_ids
    assert our_drafts == stock_drafts


@pytest.mark.vllm
@settings(max_examples=EXAMPLES)
@given(batch=spec_batches())
def test_spec_kernel_matches_vllm_method_with_shared_lists(stock_spec_method,
                                                          implementation, batch):
    """vLLM's own method, run on a stand-in holding shared and ``None`` lists."""
    note(repr(batch))
    stock, ours = batch.clone(), batch.clone()
    stock_spec_method(SimpleNamespace(
        req_ids=stock.req_ids, prev_req_id_to_index=stock.prev_req_id_to_index,
        sampling_metadata=SimpleNamespace(spec_token_ids=stock.spec_token_ids)),
        stock.draft_token_ids)
    if ours.draft_token_ids and ours.prev_req_id_to_index:
        implementation.update_async_spec_token_ids(*vars(ours).values())
    assert ours.lists() == stock.lists()


@pytest.mark.vllm
@settings(max_examples=EXAMPLES // 4)
@given(batch=spec_batches(max_reqs=VLLM_MAX_REQS))
def test_patched_spec_method_matches_real_input_batch(stock_spec_method, batch):
    from vllm.v1.worker.gpu_input_batch import InputBatch

    stock, ours = real_spec_batch(batch), real_spec_batch(batch)
    stock_drafts, our_drafts = batch.clone().draft_token_ids, batch.clone().draft_token_ids
    stock_spec_method(stock, stock_drafts)
    assert PIECE.apply()
    try:
        InputBatch.update_async_spec_token_ids(ours, our_drafts)
    finally:
        PIECE.revert()
    assert ours.spec_token_ids == stock.spec_token_ids
    assert our_drafts == stock_drafts


# --- bad input: a clear exception, and nothing changed ----------------------

def _good():
    return (["a", "b", "c"], {"a": 2, "b": 0, "c": 1}, [[-1], [-1, -1], [-1]],
            [[1], [2, 3], [4]])


def _bad_cases():
    """(name, mutate(args), exception, message) for each kind of bad input."""
    def at(position, value):
        def mutate(args):
            args[position] = value
        return mutate

    def item(position, index, value):
        def mutate(args):
            args[position][index] = value
        return mutate

    def mapping(req_id, value):
        def mutate(args):
            args[1][req_id] = value
        return mutate

    return [
        ("req_ids not a list", at(0, ("a", "b", "c")), TypeError, "req_ids"),
        ("map not a dict", at(1, [("a", 0)]), TypeError, "prev_req_id_to_index"),
        ("spec not a list", at(2, None), TypeError, "spec_token_ids"),
        ("drafts not a list", at(3, ((1,), (2, 3), (4,))), TypeError, "draft_token_ids"),
        ("spec entry a tuple", item(2, 2, (-1,)), TypeError, r"spec_token_ids\[2\]"),
        ("draft row a tuple", item(3, 1, (2, 3)), TypeError, r"draft_token_ids\[1\]"),
        ("negative row", mapping("c", -1), IndexError, "negative"),
        ("row out of range", mapping("c", 3), IndexError, "out of range"),
        ("huge row", mapping("c", 10**30), IndexError, "out of range"),
        ("row not an int", mapping("c", "1"), TypeError, "must be an int"),
        ("row a float", mapping("c", 1.0), TypeError, "must be an int"),
        ("unhashable id", item(0, 2, ["c"]), TypeError, "unhashable"),
    ]


@pytest.mark.parametrize(("name", "mutate", "exception", "message"), _bad_cases(),
                         ids=[case[0] for case in _bad_cases()])
def test_bad_input_raises_before_any_change(implementation, name, mutate, exception,
                                            message):
    args = list(_good())
    mutate(args)
    before = repr(args)
    with pytest.raises(exception, match=message):
        implementation.update_async_spec_token_ids(*args)
    assert repr(args) == before


@given(position=st.integers(0, 5))
def test_a_bad_request_anywhere_changes_nothing(implementation, position):
    """The bad request may come after good ones: they stay untouched too."""
    req_ids = [f"r{i}" for i in range(6)]
    prev = {req_id: i for i, req_id in enumerate(req_ids)}
    prev[req_ids[position]] = -5
    spec = [[-1, -1] for _ in req_ids]
    drafts = [[i, i] for i in range(6)]
    with pytest.raises(IndexError, match=f"'{req_ids[position]}'"):
        implementation.update_async_spec_token_ids(req_ids, prev, spec, drafts)
    assert spec == [[-1, -1]] * 6 and drafts == [[i, i] for i in range(6)]


def test_none_entries_are_skipped_as_vllm_skips_them(implementation):
    spec, drafts = [None, [-1]], [None, [7]]
    implementation.update_async_spec_token_ids(["a", "b"], {"a": 1, "b": 0}, spec, drafts)
    assert spec == [None, [-1]] and drafts == [None, [7]]


# --- references and memory ---------------------------------------------------

def test_no_leak_on_success_or_error():
    kernel = fastbatch._kernels
    req_ids = [f"r{i}" for i in range(64)]
    prev = {req_id: 63 - i for i, req_id in enumerate(req_ids)}
    spec = [[] for _ in req_ids]
    bad_prev = {**prev, "r9": -1}

    def step():
        for ids in spec:
            ids.clear()
            ids.extend([-1, -1, -1])
        drafts = [[300_000 + i, 300_001 + i, 300_002 + i, 7] for i in range(64)]
        kernel.update_async_spec_token_ids(req_ids, prev, spec, drafts)
        with pytest.raises(IndexError):
            kernel.update_async_spec_token_ids(req_ids, bad_prev, spec, drafts)

    for _ in range(200):
        step()
    assert_no_leak(step, [req_ids, prev, bad_prev, spec, *spec, *req_ids], 2000)
    assert spec[0] == [300_063, 300_064, 300_065]  # it really copied the drafts
