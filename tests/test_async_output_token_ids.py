"""async_output_token_ids: ``InputBatch.update_async_output_token_ids``.

* compiled kernel == pure-Python twin == vLLM 0.33's loop, on generated
  batches (no vLLM needed: the oracle is ``batches.vllm_0_33_loop``, vLLM's
  loop body transcribed);
* the same against the REAL vLLM 0.33.0 code (``vllm``-marked): each batch is
  built twice as a real ``InputBatch`` on the CPU (``batches.real_input_batch``:
  ``add_request`` for every request, ``remove_request`` for the holes, so the
  request ids, output lists and sampling metadata are vLLM's own); vLLM's
  method runs on one copy, fastbatch (the kernel, or the patched method) on
  the other, and every list must come out the same;
* bad input: a clear exception, raised before any list is changed (each case
  puts one bad request or argument into an otherwise valid batch whose other
  requests all need their placeholders replaced, so a kernel that mutated
  before validating would be caught; where vLLM's own loop raises on the same
  input, the exception type must be the same);
* references and memory: the compiled update neither leaks references nor
  memory, on success or error (the check itself: ``leaks.assert_no_leak``).

vLLM is imported only inside the ``vllm``-marked tests, so that the others
run where vLLM is not installed.
"""

import copy
import os

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

import fastbatch
import fastbatch._kernels.async_output_token_ids as kernel
from batches import (
    Batch,
    CountingEvent,
    batches,
    real_input_batch,
    vllm_0_33_loop,
    vllm_batches,
)
from fastbatch import _reference, registry
from leaks import assert_no_leak

NAME = "async_output_token_ids"
PIECE = registry.piece(NAME)
EXAMPLES = int(os.environ.get("FASTBATCH_VLLM_EXAMPLES", 1000))


# --- compiled == reference == vLLM 0.33's loop (transcribed) ------------------

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
    assert stats[0][NAME]["calls"] == 1
    assert stats[0][NAME]["syncs"] == results[0][1]


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


# --- against the real vLLM 0.33.0 InputBatch ----------------------------------

def _outputs(input_batch, states):
    return (list(input_batch.req_output_token_ids),
            {req_id: state.output_token_ids for req_id, state in states.items()})


@pytest.fixture(scope="module")
def patched_method():
    """fastbatch's replacement method, installed on the real class as the plugin does."""
    from vllm.v1.worker.gpu_input_batch import InputBatch

    assert PIECE.apply()
    yield InputBatch.update_async_output_token_ids
    PIECE.revert()


def _check_against_stock(batch, update_ours):
    from vllm.v1.worker.gpu_input_batch import InputBatch

    note(repr(batch))
    stock, stock_states = real_input_batch(batch)
    ours, our_states = real_input_batch(batch)
    assert stock.req_ids == batch.req_ids  # holes really are None
    assert stock.sampling_metadata.output_token_ids is stock.req_output_token_ids

    vllm_method = PIECE.main.original() or InputBatch.update_async_output_token_ids
    assert not getattr(vllm_method, "__fastbatch__", False)
    vllm_method(stock)
    update_ours(ours)

    assert _outputs(ours, our_states) == _outputs(stock, stock_states)
    assert ours.async_copy_ready_event.count == stock.async_copy_ready_event.count
    # The lists are still the very ones the CachedRequestStates hold.
    for req_id, index in ours.req_id_to_index.items():
        assert ours.req_output_token_ids[index] is our_states[req_id].output_token_ids


@pytest.mark.vllm
@settings(max_examples=EXAMPLES)
@given(batch=vllm_batches)
def test_kernel_matches_real_input_batch(implementation, batch):
    _check_against_stock(batch, lambda ours: implementation.update_async_output_token_ids(
        ours.req_ids, ours.prev_req_id_to_index, ours.sampling_metadata.output_token_ids,
        ours.sampled_token_ids_cpu, ours.async_copy_ready_event))


@pytest.mark.vllm
@settings(max_examples=EXAMPLES)
@given(batch=vllm_batches)
def test_patched_method_matches_real_input_batch(patched_method, batch):
    _check_against_stock(batch, patched_method)


@pytest.mark.vllm
@given(batch=vllm_batches)
def test_kernel_reads_int32_and_int64_torch_tensors_zero_copy(batch):
    """The kernel views torch CPU tensors in place, strided ones included."""
    for layout in ("C", "F", "strided"):
        tensor_batch = batch.clone()
        tensor_batch.layout, tensor_batch.use_torch = layout, True
        array_batch = batch.clone()
        fastbatch.update_async_output_token_ids(
            tensor_batch.req_ids, tensor_batch.prev_req_id_to_index,
            tensor_batch.output_token_ids, tensor_batch.sampled_as_given())
        fastbatch.update_async_output_token_ids(
            array_batch.req_ids, array_batch.prev_req_id_to_index,
            array_batch.output_token_ids, array_batch.sampled)
        assert tensor_batch.output_token_ids == array_batch.output_token_ids


@pytest.mark.vllm
def test_sampled_ids_read_only_after_synchronize(implementation):
    """Values written while synchronising are the ones used: the ids are read
    in place, after the copy-ready event, never earlier."""
    import torch

    sampled = torch.tensor([[1], [2]], dtype=torch.int32)
    outputs = [[-1], [-1]]

    def synchronize():  # the async copy "lands" only now
        sampled[0, 0], sampled[1, 0] = 41, 42

    implementation.update_async_output_token_ids(["a", "b"], {"a": 1, "b": 0}, outputs,
                                                 sampled, synchronize)
    assert outputs == [[42], [41]]


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("make_tensor", "message"),
    [
        (lambda torch: torch.zeros((3, 2), dtype=torch.float32), "int32 or int64"),
        (lambda torch: torch.zeros((3, 2), dtype=torch.int16), "int32 or int64"),
        (lambda torch: torch.zeros(3, dtype=torch.int64), "2-D"),
        (lambda torch: torch.zeros((3, 2, 1), dtype=torch.int32), "2-D"),
        (lambda torch: torch.zeros((3, 2), dtype=torch.int64, device="meta"), "CPU"),
        (lambda torch: torch.zeros((3, 2), dtype=torch.int64).to_sparse(), "sparse"),
    ],
    ids=["float32", "int16", "1-D", "3-D", "meta device", "sparse"],
)
def test_bad_tensor_raises_before_any_change(implementation, make_tensor, message):
    import torch

    outputs = [[1, -1], [2, -1]]
    event = CountingEvent()
    with pytest.raises(TypeError, match=message):
        implementation.update_async_output_token_ids(["a", "b"], {"a": 0, "b": 1}, outputs,
                                                     make_tensor(torch), event)
    assert outputs == [[1, -1], [2, -1]]
    assert event.count == 0


# --- bad input: a clear exception, raised before any list is changed ----------

def _good_batch(num_good: int):
    req_ids = [f"good-{i}" for i in range(num_good)]
    prev = {req_id: i for i, req_id in enumerate(req_ids)}
    outputs = [[7, -1] for _ in req_ids]
    sampled = np.arange(100, 100 + 2 * (num_good + 1), dtype=np.int64)
    return req_ids, prev, outputs, sampled.reshape(num_good + 1, 2)


def _bad_request(kind: str, row: int):
    """(req_id, prev_index, output entry) of one bad request."""
    return {
        "row out of range": ("bad", row + 5, [1, -1]),
        "negative row": ("bad", -1, [1, -1]),
        "row not an int": ("bad", "0", [1, -1]),
        "row a float": ("bad", 0.0, [1, -1]),
        "output a tuple": ("bad", row, (1, -1)),
        "output an int": ("bad", row, 5),
        "output a str": ("bad", row, "x-1"),
        "last item not an int": ("bad", row, [1, "-1"]),
        "placeholder run item not an int": ("bad", row, [1, 2.5, -1]),
        "unhashable req_id": (["bad"], row, [1, -1]),
    }[kind]


BAD_REQUESTS = ["row out of range", "negative row", "row not an int", "row a float",
                "output a tuple", "output an int", "output a str", "last item not an int",
                "placeholder run item not an int", "unhashable req_id"]
EXPECTED = {
    "row out of range": IndexError,
    "negative row": IndexError,
    "row not an int": TypeError,
    "row a float": TypeError,
    "output a tuple": TypeError,
    "output an int": TypeError,
    "output a str": TypeError,
    "last item not an int": TypeError,
    "placeholder run item not an int": TypeError,
    "unhashable req_id": TypeError,
}


def _assert_raises_unchanged(implementation, expected, args, copy_ready=None):
    event = CountingEvent()
    req_ids, prev, outputs, sampled = args
    snapshot = copy.deepcopy((req_ids, prev, outputs))
    with pytest.raises(expected) as excinfo:
        implementation.update_async_output_token_ids(
            req_ids, prev, outputs, sampled, event if copy_ready is None else copy_ready)
    assert (req_ids, prev, outputs) == snapshot, "input changed before the error"
    assert event.count == 0, "synchronised although the input was rejected"
    assert str(excinfo.value), "the error says nothing"
    return excinfo.value


def _vllm_error(args):
    """The exception type vLLM's loop raises on ``args``, or None.

    Only TypeError, ValueError and IndexError count: an AttributeError from
    vLLM calling ``.tolist()`` on something that is not a tensor is an
    accident of its code, and a TypeError says better what is wrong.
    """
    req_ids, prev, outputs, sampled = copy.deepcopy(args)
    try:
        vllm_0_33_loop(req_ids, prev, outputs, sampled, CountingEvent())
    except (TypeError, ValueError, IndexError) as exc:
        return type(exc)
    except AttributeError:
        return None
    return None


@pytest.mark.parametrize("kind", BAD_REQUESTS)
@given(num_good=st.integers(0, 6), position=st.integers(0, 6))
def test_bad_request_raises_before_any_change(implementation, kind, num_good, position):
    req_ids, prev, outputs, sampled = _good_batch(num_good)
    position = min(position, num_good)
    req_id, row, output = _bad_request(kind, num_good)
    req_ids.insert(position, req_id)
    if kind == "unhashable req_id":
        pass  # cannot be a key; the lookup itself fails
    else:
        prev[req_id] = row
    outputs.insert(position, output)
    args = (req_ids, prev, outputs, sampled)
    vllm_error = _vllm_error(args)
    error = _assert_raises_unchanged(implementation, EXPECTED[kind], args)
    if vllm_error is not None:
        assert isinstance(error, vllm_error), f"vLLM raises {vllm_error.__name__}"


@pytest.mark.parametrize(
    ("sampled", "message"),
    [
        (np.array([1, 2, 3], dtype=np.int64), "2-D"),
        (np.zeros((2, 2, 2), dtype=np.int64), "2-D"),
        (np.zeros((3, 2), dtype=np.float32), "int32 or int64"),
        (np.zeros((3, 2), dtype=np.float64), "int32 or int64"),
        (np.zeros((3, 2), dtype=np.int16), "int32 or int64"),
        (np.zeros((3, 2), dtype=np.uint64), "int32 or int64"),
        (np.zeros((3, 2), dtype=">i8"), "int32 or int64"),
        (None, "got NoneType"),
        ([[1, 2], [3, 4], [5, 6]], "got list"),
    ],
    ids=["1-D", "3-D", "float32", "float64", "int16", "uint64", "big-endian", "None",
         "nested list"],
)
def test_bad_sampled_array(implementation, sampled, message):
    req_ids, prev, outputs, _ = _good_batch(2)
    error = _assert_raises_unchanged(implementation, TypeError,
                                     (req_ids, prev, outputs, sampled))
    assert message in str(error)
    vllm_error = _vllm_error((req_ids, prev, outputs, sampled))
    if vllm_error is not None:
        assert isinstance(error, vllm_error)


@pytest.mark.parametrize("argument", ["req_ids", "prev_req_id_to_index", "output_token_ids"])
@pytest.mark.parametrize("bad_value", [None, (), "abc"], ids=["None", "tuple", "str"])
def test_bad_container(implementation, argument, bad_value):
    req_ids, prev, outputs, sampled = _good_batch(2)
    args = {"req_ids": req_ids, "prev_req_id_to_index": prev, "output_token_ids": outputs}
    args[argument] = bad_value
    error = _assert_raises_unchanged(
        implementation, TypeError,
        (args["req_ids"], args["prev_req_id_to_index"], args["output_token_ids"], sampled))
    assert argument in str(error)


@pytest.mark.parametrize("extra", [-1, 1], ids=["outputs shorter", "outputs longer"])
def test_mismatched_lengths(implementation, extra):
    req_ids, prev, outputs, sampled = _good_batch(3)
    if extra < 0:
        outputs.pop()
    else:
        outputs.append([1, -1])
    error = _assert_raises_unchanged(implementation, IndexError,
                                     (req_ids, prev, outputs, sampled))
    assert "output_token_ids has" in str(error)


def test_bad_copy_ready(implementation):
    args = _good_batch(2)
    error = _assert_raises_unchanged(implementation, TypeError, args, copy_ready=42)
    assert "copy_ready" in str(error)


def test_failing_synchronize_changes_nothing(implementation):
    req_ids, prev, outputs, sampled = _good_batch(3)
    snapshot = copy.deepcopy(outputs)

    def synchronize():
        raise RuntimeError("copy stream failed")

    with pytest.raises(RuntimeError, match="copy stream failed"):
        implementation.update_async_output_token_ids(req_ids, prev, outputs, sampled,
                                                     synchronize)
    assert outputs == snapshot


def test_none_output_entry_is_a_hole_not_an_error(implementation):
    """vLLM skips a None entry (its map never holds the id): so do we."""
    req_ids, prev, outputs, sampled = _good_batch(2)
    outputs[0] = None
    implementation.update_async_output_token_ids(req_ids, prev, outputs, sampled)
    assert outputs == [None, [7, 102]]


def test_batch_changed_during_synchronize_is_caught_by_compiled():
    """The compiled kernel re-checks each list after the callback: no stale index."""
    req_ids, prev, outputs, sampled = _good_batch(2)

    def shrink_batch():
        outputs[1].clear()

    with pytest.raises(RuntimeError, match="changed while waiting"):
        kernel.update_async_output_token_ids(req_ids, prev, outputs, sampled, shrink_batch)


# --- references and memory ---------------------------------------------------

NUM_REQS = 64
CALLS = 3000


def _leak_state(spec_decode: bool, first_id: int = 100_000):
    req_ids = [f"r{i}" for i in range(NUM_REQS)]
    prev = {req_id: NUM_REQS - 1 - i for i, req_id in enumerate(req_ids)}
    width = 5 if spec_decode else 1
    # Ids above CPython's small ints: below 2**18 the kernel hands out shared
    # int objects, above it every written id is a new int object.
    sampled = np.arange(first_id, first_id + NUM_REQS * width, dtype=np.int64)
    sampled = sampled.reshape(NUM_REQS, width).copy()
    if spec_decode:
        sampled[::2, 3:] = -1  # rejected drafts on every other row
    outputs = [[1, 2, 3] for _ in req_ids]
    return req_ids, prev, outputs, sampled


def _reset_placeholders(outputs, placeholders):
    for ids in outputs:
        del ids[3:]
        ids.extend([-1] * placeholders)


@pytest.mark.parametrize("first_id", [100_000, 2**18 + 1], ids=["shared-ids", "new-ids"])
@pytest.mark.parametrize("spec_decode", [False, True], ids=["decode", "spec-decode"])
def test_no_leak_on_success(spec_decode, first_id):
    req_ids, prev, outputs, sampled = _leak_state(spec_decode, first_id)
    event = CountingEvent()
    placeholders = 5 if spec_decode else 1

    def step():
        _reset_placeholders(outputs, placeholders)
        kernel.update_async_output_token_ids(req_ids, prev, outputs, sampled, event)

    for _ in range(200):  # warm up caches and free lists
        step()
    token = outputs[0][3]  # a written id: shared ones must not gain references
    step()  # the list now holds the same shared id again, or a new one
    assert_no_leak(step, [req_ids, prev, sampled, event, token, *req_ids, *outputs],
                   CALLS)
    assert outputs[0][3] == sampled[prev["r0"], 0]  # it really wrote ids


def test_no_leak_on_errors():
    req_ids, prev, outputs, sampled = _leak_state(False)
    _reset_placeholders(outputs, 1)
    bad_cases = [
        (req_ids, {**prev, "r5": -3}, outputs, sampled),
        (req_ids, {**prev, "r5": "x"}, outputs, sampled),
        (req_ids, prev, outputs, sampled.astype(np.float64)),
        (req_ids, prev, outputs, sampled[0]),
        (req_ids, prev, outputs[:-1], sampled),
        (req_ids, {**prev, "r5": 10**30}, outputs, sampled),
    ]

    def step():
        for args in bad_cases:
            with pytest.raises((TypeError, IndexError)):
                kernel.update_async_output_token_ids(*args)

    step()  # warm up
    assert_no_leak(step, [req_ids, prev, outputs, sampled, *outputs], CALLS // 10)


def test_buffer_released_after_each_call():
    """The sampled array's buffer is released: numpy may resize it afterwards."""
    req_ids, prev, outputs, sampled = _leak_state(False)
    _reset_placeholders(outputs, 1)
    kernel.update_async_output_token_ids(req_ids, prev, outputs, sampled)
    sampled.resize((NUM_REQS + 1, 1), refcheck=False)  # raises if still exported
