"""The input-ids index rows: compiled == reference == vLLM 0.33's loop; bad input; leaks.

No vLLM needed: the oracle is ``vllm_loop``, the loop of vLLM 0.31-0.33's
``GPUModelRunner._prepare_input_ids`` transcribed;
``test_vllm_prepare_input_ids.py`` runs the real method against the patched one.
"""

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import fastbatch
from fastbatch import _reference
from leaks import assert_no_leak

NAMES = [f"r{i}" for i in range(10)]


def vllm_loop(req_ids, prev_positions_np, cu_num_tokens, scheduled_spec_tokens,
              prev_num_spec_tokens, num_reqs):
    """vLLM 0.31.0-0.33.0's loop, word for word; returns its lists and flags."""
    prev_positions = prev_positions_np[:num_reqs]
    sample_flattened_indices: list[int] = []
    spec_flattened_indices: list[int] = []
    prev_draft_token_indices: list[int] = []
    prev_indices: list[int] = []
    common_indices_match = True
    max_flattened_index = -1
    total_num_spec_tokens = 0

    for cur_index in range(num_reqs):
        prev_index = prev_positions[cur_index]
        if prev_index < 0:
            continue
        prev_indices.append(prev_index)
        req_id = req_ids[cur_index]
        draft_len = len(scheduled_spec_tokens.get(req_id, ()))
        total_num_spec_tokens += draft_len
        flattened_index = cu_num_tokens[cur_index].item() - 1
        sample_flattened_indices.append(flattened_index - draft_len)
        spec_flattened_indices.extend(
            range(flattened_index - draft_len + 1, flattened_index + 1)
        )
        start = prev_index * prev_num_spec_tokens
        prev_draft_token_indices.extend(range(start, start + draft_len))
        common_indices_match &= prev_index == flattened_index
        max_flattened_index = max(max_flattened_index, flattened_index)
    return (sample_flattened_indices, prev_indices, spec_flattened_indices,
            prev_draft_token_indices, bool(common_indices_match), max_flattened_index,
            total_num_spec_tokens)


def _as_lists(result):
    common, spec, match, max_flattened = result
    for rows in (common, spec):
        assert rows.dtype == np.int64 and rows.ndim == 2 and rows.shape[0] == 2
        assert rows.flags.c_contiguous and rows.flags.writeable
    return (common[0].tolist(), common[1].tolist(), spec[0].tolist(), spec[1].tolist(),
            match, max_flattened, spec.shape[1])


@st.composite
def steps(draw):
    """One step's inputs: decodes kept in place or moved, new requests, holes,
    draft tokens for some (lists, tuples, empty), cu_num_tokens int32 or int64,
    the unchanged batch, a strided prev_positions column."""
    num_reqs = draw(st.integers(0, 10))
    num_prev = draw(st.integers(0, 12))
    unchanged = draw(st.booleans())
    if unchanged:
        prev = list(range(num_reqs))
        num_scheduled = [1] * num_reqs
    else:
        prev = draw(st.lists(st.one_of(st.just(-1), st.integers(-3, num_prev + 2)),
                             min_size=num_reqs, max_size=num_reqs))
        num_scheduled = draw(st.lists(st.integers(0, 5), min_size=num_reqs,
                                      max_size=num_reqs))
    req_ids = draw(st.lists(st.sampled_from([*NAMES, None]), min_size=num_reqs,
                            max_size=num_reqs + 2))
    spec = draw(st.dictionaries(st.sampled_from(NAMES), st.one_of(
        st.lists(st.just(-1), max_size=4), st.tuples(st.just(-1))), max_size=6))
    if unchanged and draw(st.booleans()):
        spec = {}
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    cu = np.cumsum(np.asarray(num_scheduled, dtype=dtype), dtype=dtype)
    stride = draw(st.sampled_from([1, 2]))
    column = np.full((num_reqs + draw(st.integers(0, 2))) * stride, 77, dtype=np.int64)
    column = column[::stride]
    column[:num_reqs] = prev
    k = draw(st.integers(0, 4))
    return req_ids, column, cu, spec, k, num_reqs


@given(step=steps())
def test_matches_vllm_loop(implementation, step):
    note(repr(step))
    assert _as_lists(implementation.prepare_input_ids_indices(*step)) == vllm_loop(*step)


@given(step=steps())
def test_compiled_and_reference_agree_on_results_and_stats(step):
    results, stats = [], []
    for module in (fastbatch._kernels, _reference):
        module.reset_stats()
        results.append(_as_lists(module.prepare_input_ids_indices(*step)))
        stats.append({key: value for key, value in module.stats().items()
                      if key.startswith("input_ids")})
    assert results[0] == results[1]
    assert stats[0] == stats[1] == {"input_ids_calls": 1,
                                    "input_ids_common_requests": len(results[0][1]),
                                    "input_ids_spec_tokens": results[0][6]}


def test_worked_example(implementation):
    """vLLM's comment: cu_num_tokens [2, 5, 8], drafts [1, 2, 2]; and a new request."""
    step = (["a", "b", "new", "c"], np.array([0, 1, -1, 2], dtype=np.int64),
            np.array([2, 5, 6, 9]), {"a": [-1], "b": [-1, -1], "c": [-1, -1]}, 2, 4)
    common, spec, match, max_flattened = implementation.prepare_input_ids_indices(*step)
    assert common.tolist() == [[0, 2, 6], [0, 1, 2]]
    assert spec.tolist() == [[1, 3, 4, 7, 8], [0, 2, 3, 4, 5]]
    assert (match, max_flattened) == (False, 8)


def test_unchanged_batch_matches(implementation):
    common, spec, match, max_flattened = implementation.prepare_input_ids_indices(
        ["a", "b", "c"], np.arange(3, dtype=np.int64), np.array([1, 2, 3]), {}, 3, 3)
    assert common.tolist() == [[0, 1, 2], [0, 1, 2]] and spec.shape == (2, 0)
    assert (match, max_flattened) == (True, 2)


def test_no_common_request(implementation):
    common, spec, match, max_flattened = implementation.prepare_input_ids_indices(
        ["a"], np.array([-1], dtype=np.int64), np.array([4]), {"a": [-1]}, 2, 1)
    assert common.shape == spec.shape == (2, 0) and (match, max_flattened) == (True, -1)


# --- bad input: a clear exception ---------------------------------------------

def _good():
    return [["a", "b", "c"], np.array([1, -1, 0], dtype=np.int64), np.array([2, 3, 5]),
            {"a": [-1], "c": [-1, -1]}, 2, 3]


def _bad_cases():
    """(name, mutate(args), exception, message) for each kind of bad input."""
    def at(position, value):
        def mutate(args):
            args[position] = value
        return mutate

    return [
        ("req_ids not a list", at(0, ("a", "b", "c")), TypeError, "req_ids"),
        ("spec not a dict", at(3, [("a", [-1])]), TypeError, "scheduled_spec_tokens"),
        ("positions int32", at(1, np.array([1, -1, 0], dtype=np.int32)), TypeError,
         "prev_positions"),
        ("positions a list", at(1, [1, -1, 0]), TypeError, "prev_positions"),
        ("cu float", at(2, np.array([2.0, 3.0, 5.0])), TypeError, "cu_num_tokens"),
        ("cu 2-D", at(2, np.array([[2, 3, 5]])), TypeError, "cu_num_tokens"),
        ("k not an int", at(4, 2.0), TypeError, "prev_num_spec_tokens"),
        ("k too big", at(4, 2**63), OverflowError, "prev_num_spec_tokens"),
        ("negative num_reqs", at(5, -1), ValueError, "num_reqs"),
        ("too few positions", at(5, 4), IndexError, "prev_positions"),
        ("too few req_ids", at(0, ["a"]), IndexError, "req_ids"),
        ("too few cu entries", at(2, np.array([2, 3])), IndexError, "cu_num_tokens"),
        ("draft without len", at(3, {"a": 5}), TypeError, "len"),
        ("unhashable id", at(0, [["a"], "b", "c"]), TypeError, "unhashable"),
        ("index overflow", at(4, 2**63 - 1), OverflowError, "do not fit in int64"),
    ]


@pytest.mark.parametrize(("name", "mutate", "exception", "message"), _bad_cases(),
                         ids=[case[0] for case in _bad_cases()])
def test_bad_input_raises(implementation, name, mutate, exception, message):
    args = _good()
    mutate(args)
    before = repr(args)
    with pytest.raises(exception, match=message):
        implementation.prepare_input_ids_indices(*args)
    assert repr(args) == before


def test_vllm_raises_too_where_a_common_request_is_out_of_range():
    """Where fastbatch raises IndexError for a missing req_id or cu_num_tokens
    entry of a common request, vLLM's loop raises IndexError as well."""
    for mutate in (lambda args: args.__setitem__(0, ["a"]),
                   lambda args: args.__setitem__(2, np.array([2, 3]))):
        args = _good()
        mutate(args)
        with pytest.raises(IndexError):
            vllm_loop(*args)


# --- references and memory ---------------------------------------------------

def test_no_leak_on_success_or_error():
    kernel = fastbatch._kernels
    req_ids = [f"r{i}" for i in range(64)]
    column = np.arange(64, dtype=np.int64)[::-1].copy()
    column[::7] = -1
    cu = np.cumsum(np.full(64, 3))
    spec = {req_id: [-1, -1] for req_id in req_ids[::2]}
    bad_spec = {**spec, "r9": 5}

    def step():
        kernel.prepare_input_ids_indices(req_ids, column, cu, spec, 2, 64)
        with pytest.raises(TypeError):
            kernel.prepare_input_ids_indices(req_ids, column, cu, bad_spec, 2, 64)
        with pytest.raises(IndexError):
            kernel.prepare_input_ids_indices(req_ids, column, cu[:3], spec, 2, 64)

    for _ in range(100):
        step()
    assert_no_leak(step, [req_ids, column, cu, spec, bad_spec, *req_ids], 2000)
