"""Bad input: a clear exception, raised before any list is changed.

Each case puts one bad request (or argument) into an otherwise valid batch
whose other requests all need their placeholders replaced, so a kernel that
mutated before validating would be caught.  Where vLLM's own loop raises on
the same input, the exception type must be the same.
"""

import copy

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batches import CountingEvent, vllm_0_33_loop


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
    import fastbatch._kernels as kernel

    req_ids, prev, outputs, sampled = _good_batch(2)

    def shrink_batch():
        outputs[1].clear()

    with pytest.raises(RuntimeError, match="changed while waiting"):
        kernel.update_async_output_token_ids(req_ids, prev, outputs, sampled, shrink_batch)
