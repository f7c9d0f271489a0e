"""The compiled output-token update neither leaks references nor memory, on
success or error (the check itself: ``leaks.assert_no_leak``)."""

import numpy as np
import pytest

import fastbatch._kernels.async_output_token_ids as kernel
from batches import CountingEvent
from leaks import assert_no_leak

NUM_REQS = 64
CALLS = 3000


def _state(spec_decode: bool, first_id: int = 100_000):
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


def _reset(outputs, placeholders):
    for ids in outputs:
        del ids[3:]
        ids.extend([-1] * placeholders)



@pytest.mark.parametrize("first_id", [100_000, 2**18 + 1], ids=["shared-ids", "new-ids"])
@pytest.mark.parametrize("spec_decode", [False, True], ids=["decode", "spec-decode"])
def test_no_leak_on_success(spec_decode, first_id):
    req_ids, prev, outputs, sampled = _state(spec_decode, first_id)
    event = CountingEvent()
    placeholders = 5 if spec_decode else 1

    def step():
        _reset(outputs, placeholders)
        kernel.update_async_output_token_ids(req_ids, prev, outputs, sampled, event)

    for _ in range(200):  # warm up caches and free lists
        step()
    token = outputs[0][3]  # a written id: shared ones must not gain references
    step()  # the list now holds the same shared id again, or a new one
    assert_no_leak(step, [req_ids, prev, sampled, event, token, *req_ids, *outputs],
                   CALLS)
    assert outputs[0][3] == sampled[prev["r0"], 0]  # it really wrote ids


def test_no_leak_on_errors():
    req_ids, prev, outputs, sampled = _state(False)
    _reset(outputs, 1)
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
    req_ids, prev, outputs, sampled = _state(False)
    _reset(outputs, 1)
    kernel.update_async_output_token_ids(req_ids, prev, outputs, sampled)
    sampled.resize((NUM_REQS + 1, 1), refcheck=False)  # raises if still exported
