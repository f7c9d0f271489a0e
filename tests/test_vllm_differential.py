"""Differential tests against the REAL vLLM 0.33.0 ``InputBatch`` (tox -e vllm).

Each generated batch is built twice as a real ``InputBatch`` on the CPU: with
``add_request`` for every request and ``remove_request`` for the holes, so the
request ids, output lists (shared with each ``CachedRequestState``) and
sampling metadata are vLLM's own.  vLLM's method runs on one copy, fastbatch
on the other copy's state; every list must come out the same.
"""

import os

import pytest
from hypothesis import given, note, settings

from batches import INT32_OUTPUT_ITEMS, Batch, CountingEvent, batches

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM is imported
pytestmark = pytest.mark.vllm

import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch  # noqa: E402

import fastbatch  # noqa: E402
from fastbatch.patches import gpu_input_batch as patch  # noqa: E402

MAX_REQS = 10
vllm_batches = batches(max_reqs=MAX_REQS, torch_allowed=False, output_items=INT32_OUTPUT_ITEMS)


def _real_input_batch(batch: Batch):
    """A real vLLM InputBatch holding ``batch``, and its CachedRequestStates."""
    input_batch = InputBatch(
        max_num_reqs=MAX_REQS,
        max_model_len=64,
        max_num_batched_tokens=64,
        device=torch.device("cpu"),
        vocab_size=2**31 - 1,
        block_sizes=[16],
        max_num_blocks_per_req=[4],
        # Makes vLLM keep output_token_ids in its sampling metadata, as
        # penalties, bad words or a thinking budget would.
        logitsprocs_need_output_token_ids=True,
    )
    states = {}
    pairs = zip(batch.req_ids, batch.output_token_ids, strict=True)
    for index, (req_id, output) in enumerate(pairs):
        state = CachedRequestState(
            req_id=req_id if req_id is not None else f"removed-{index}",
            prompt_token_ids=[1, 2, 3],
            mm_features=[],
            sampling_params=SamplingParams(temperature=0.0),
            generator=None,
            block_ids=([],),
            num_computed_tokens=3,
            output_token_ids=list(output) if output is not None else [5],
        )
        states[state.req_id] = state
        assert input_batch.add_request(state) == index
    input_batch.refresh_metadata()
    for index, req_id in enumerate(batch.req_ids):
        if req_id is None:
            input_batch.remove_request(f"removed-{index}")  # leaves a hole
    input_batch.prev_req_id_to_index = dict(batch.prev_req_id_to_index)
    input_batch.sampled_token_ids_cpu = torch.from_numpy(batch.sampled.copy())
    input_batch.async_copy_ready_event = CountingEvent()
    return input_batch, states


def _outputs(input_batch, states):
    return (list(input_batch.req_output_token_ids),
            {req_id: state.output_token_ids for req_id, state in states.items()})


EXAMPLES = int(os.environ.get("FASTBATCH_VLLM_EXAMPLES", 1000))


@pytest.fixture(scope="module")
def patched_method():
    """fastbatch's replacement method, installed on the real class as the plugin does."""
    assert patch.apply()
    yield InputBatch.update_async_output_token_ids
    patch.revert()


def _check_against_stock(batch, update_ours):
    note(repr(batch))
    stock, stock_states = _real_input_batch(batch)
    ours, our_states = _real_input_batch(batch)
    assert stock.req_ids == batch.req_ids  # holes really are None
    assert stock.sampling_metadata.output_token_ids is stock.req_output_token_ids

    vllm_method = patch.original() or InputBatch.update_async_output_token_ids
    assert not getattr(vllm_method, "__fastbatch__", False)
    vllm_method(stock)
    update_ours(ours)

    assert _outputs(ours, our_states) == _outputs(stock, stock_states)
    assert ours.async_copy_ready_event.count == stock.async_copy_ready_event.count
    # The lists are still the very ones the CachedRequestStates hold.
    for req_id, index in ours.req_id_to_index.items():
        assert ours.req_output_token_ids[index] is our_states[req_id].output_token_ids


@settings(max_examples=EXAMPLES)
@given(batch=vllm_batches)
def test_kernel_matches_real_input_batch(implementation, batch):
    _check_against_stock(batch, lambda ours: implementation.update_async_output_token_ids(
        ours.req_ids, ours.prev_req_id_to_index, ours.sampling_metadata.output_token_ids,
        ours.sampled_token_ids_cpu, ours.async_copy_ready_event))


@settings(max_examples=EXAMPLES)
@given(batch=vllm_batches)
def test_patched_method_matches_real_input_batch(patched_method, batch):
    _check_against_stock(batch, patched_method)


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


def test_sampled_ids_read_only_after_synchronize(implementation):
    """Values written while synchronising are the ones used: the ids are read
    in place, after the copy-ready event, never earlier."""
    sampled = torch.tensor([[1], [2]], dtype=torch.int32)
    outputs = [[-1], [-1]]

    def synchronize():  # the async copy "lands" only now
        sampled[0, 0], sampled[1, 0] = 41, 42

    implementation.update_async_output_token_ids(["a", "b"], {"a": 1, "b": 0}, outputs,
                                                 sampled, synchronize)
    assert outputs == [[42], [41]]


@pytest.mark.parametrize(
    ("make_tensor", "message"),
    [
        (lambda: torch.zeros((3, 2), dtype=torch.float32), "int32 or int64"),
        (lambda: torch.zeros((3, 2), dtype=torch.int16), "int32 or int64"),
        (lambda: torch.zeros(3, dtype=torch.int64), "2-D"),
        (lambda: torch.zeros((3, 2, 1), dtype=torch.int32), "2-D"),
        (lambda: torch.zeros((3, 2), dtype=torch.int64, device="meta"), "CPU"),
        (lambda: torch.zeros((3, 2), dtype=torch.int64).to_sparse(), "sparse"),
    ],
    ids=["float32", "int16", "1-D", "3-D", "meta device", "sparse"],
)
def test_bad_tensor_raises_before_any_change(implementation, make_tensor, message):
    outputs = [[1, -1], [2, -1]]
    event = CountingEvent()
    with pytest.raises(TypeError, match=message):
        implementation.update_async_output_token_ids(["a", "b"], {"a": 0, "b": 1}, outputs,
                                                     make_tensor(), event)
    assert outputs == [[1, -1], [2, -1]]
    assert event.count == 0
