"""Differential tests against the REAL vLLM 0.33.0 code (tox -e vllm).

Each generated batch is built twice as a real ``InputBatch`` on the CPU: with
``add_request`` for every request and ``remove_request`` for the holes, so the
request ids, output lists (shared with each ``CachedRequestState``), spec
lists (filled by vLLM's ``update_req_spec_token_ids``) and sampling metadata
are vLLM's own.  vLLM's method runs on one copy, fastbatch on the other;
every list must come out the same.  The penalties' tensor is compared with
vLLM's ``_convert_to_tensors`` and, through ``apply_all_penalties``, with the
penalised logits themselves.
"""

import contextlib
import functools
import os
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from batches import INT32_OUTPUT_ITEMS, Batch, CountingEvent, batches
from token_lists import SpecBatch, penalty_rows, spec_batches, vllm_0_33_penalty_array

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM is imported
pytestmark = pytest.mark.vllm

import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.sample import rejection_sampler, sampler  # noqa: E402
from vllm.v1.sample.ops import penalties  # noqa: E402
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch  # noqa: E402

import fastbatch  # noqa: E402
from fastbatch.patches import async_output_token_ids as patch  # noqa: E402
from fastbatch.patches import async_spec_token_ids as spec_patch  # noqa: E402
from fastbatch.patches import penalty_output_tokens as penalty_patch  # noqa: E402

MAX_REQS = 10
STOCK_APPLY_ALL = penalties.apply_all_penalties
BINDINGS = (penalties, sampler, rejection_sampler)  # the names apply_all_penalties has
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


# --- update_async_spec_token_ids ---------------------------------------------

def _real_spec_batch(batch: SpecBatch):
    """A real InputBatch with ``batch``'s requests; each spec list filled by
    vLLM's own ``update_req_spec_token_ids`` with as many placeholders as
    ``batch`` has (a real batch has no shared or ``None`` spec lists)."""
    num_reqs = len(batch.req_ids)
    outputs = Batch(batch.req_ids, {}, [None if r is None else [1] for r in batch.req_ids],
                    sampled=np.zeros((0, 0), dtype=np.int64))
    input_batch, states = _real_input_batch(outputs)
    scheduled = {req_id: [-1] * len(spec or ())
                 for req_id, spec in zip(batch.req_ids, batch.spec_token_ids, strict=False)
                 if req_id is not None}
    for req_id in scheduled:
        input_batch.update_req_spec_token_ids(states[req_id], scheduled)
    input_batch.prev_req_id_to_index = dict(batch.prev_req_id_to_index)
    assert input_batch.sampling_metadata.spec_token_ids is input_batch.spec_token_ids
    assert len(input_batch.req_ids) == num_reqs
    return input_batch


@pytest.fixture(scope="module")
def stock_spec_method():
    """vLLM's own ``update_async_spec_token_ids``, whatever is installed now."""
    method = spec_patch.original() or InputBatch.update_async_spec_token_ids
    assert not getattr(method, "__fastbatch__", False)
    return method


@settings(max_examples=EXAMPLES)
@given(batch=spec_batches(max_reqs=MAX_REQS))
def test_spec_update_matches_real_input_batch(stock_spec_method, implementation, batch):
    note(repr(batch))
    stock, ours = _real_spec_batch(batch), _real_spec_batch(batch)
    stock_drafts, our_drafts = batch.clone().draft_token_ids, batch.clone().draft_token_ids
    stock_spec_method(stock, stock_drafts)
    if our_drafts and ours.prev_req_id_to_index:  # the method's early returns
        implementation.update_async_spec_token_ids(
            ours.req_ids, ours.prev_req_id_to_index, ours.sampling_metadata.spec_token_ids,
            our_drafts)
    assert ours.spec_token_ids == stock.spec_token_ids
    assert our_drafts == stock_drafts


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


@settings(max_examples=EXAMPLES // 4)
@given(batch=spec_batches(max_reqs=MAX_REQS))
def test_patched_spec_method_matches_real_input_batch(stock_spec_method, batch):
    stock, ours = _real_spec_batch(batch), _real_spec_batch(batch)
    stock_drafts, our_drafts = batch.clone().draft_token_ids, batch.clone().draft_token_ids
    stock_spec_method(stock, stock_drafts)
    assert spec_patch.apply()
    try:
        InputBatch.update_async_spec_token_ids(ours, our_drafts)
    finally:
        spec_patch.revert()
    assert ours.spec_token_ids == stock.spec_token_ids
    assert our_drafts == stock_drafts


# --- penalties: _convert_to_tensors and apply_all_penalties -------------------

@pytest.fixture(scope="module")
def unpinned():
    """vLLM 0.33.0's GPU wheel on a machine without a GPU still says
    PIN_MEMORY=True, and stock's ``tensor.pin_memory()`` then fails; pinning
    is checked in test_plugin.py, the values here."""
    saved, penalties.PIN_MEMORY = penalties.PIN_MEMORY, False
    yield
    penalties.PIN_MEMORY = saved


VOCAB = 64
PENALISED_ROWS = st.lists(st.lists(st.one_of(st.integers(0, VOCAB - 1), st.just(-1)),
                                   max_size=30), max_size=MAX_REQS)


@settings(max_examples=EXAMPLES)
@given(rows=penalty_rows(), vocab_size=st.sampled_from([1, 64, 151_936]))
def test_penalty_tensor_matches_real_convert_to_tensors(unpinned, implementation, rows,
                                                        vocab_size):
    note(repr(rows))
    original = penalty_patch.original() or penalties._convert_to_tensors
    expected = original(rows, vocab_size, torch.device("cpu"))
    expected.masked_fill_(expected == -1, vocab_size)  # as apply_all_penalties does
    got = implementation.output_tokens_tensor(rows, vocab_size)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got, expected)
    np.testing.assert_array_equal(got.numpy(), vllm_0_33_penalty_array(rows, vocab_size))


@settings(max_examples=EXAMPLES // 4)
@given(rows=PENALISED_ROWS, seed=st.integers(0, 2**16))
def test_apply_all_penalties_gives_the_same_logits_patched(unpinned, rows, seed):
    """The whole of vLLM's penalties, stock and with the patch installed."""
    generator = torch.Generator().manual_seed(seed)
    num_reqs = len(rows)
    logits = torch.randn((num_reqs, VOCAB), generator=generator)
    prompt = torch.randint(0, VOCAB + 1, (num_reqs, 7), generator=generator)
    presence = torch.rand(num_reqs, generator=generator)
    frequency = torch.rand(num_reqs, generator=generator)
    repetition = 1 + torch.rand(num_reqs, generator=generator)

    def penalised(binding):
        return binding.apply_all_penalties(logits.clone(), prompt, presence, frequency,
                                           repetition, rows)

    stock = penalised(penalties)
    assert penalty_patch.apply()
    try:
        assert all(penalty_patch.masking_skipped().values())
        for binding in BINDINGS:  # each caller's own name for the function
            assert binding.apply_all_penalties is penalty_patch.apply_all_penalties
            fastbatch.reset_stats()
            assert torch.equal(penalised(binding), stock)
            assert fastbatch.stats()["penalty_output_tokens"]["tensors"] == 1
    finally:
        penalty_patch.revert()
    assert not any(penalty_patch.masking_skipped().values())
    assert all(binding.apply_all_penalties is STOCK_APPLY_ALL for binding in BINDINGS)


def _penalty_inputs(rows, seed):
    generator = torch.Generator().manual_seed(seed)
    num_reqs = len(rows)
    logits = torch.randn((num_reqs, VOCAB), generator=generator)
    prompt = torch.randint(0, VOCAB + 1, (num_reqs, 7), generator=generator)
    penalty_values = (torch.rand(num_reqs, generator=generator),
                      torch.rand(num_reqs, generator=generator),
                      1 + torch.rand(num_reqs, generator=generator))
    return logits, prompt, penalty_values


@contextlib.contextmanager
def masked_fill_calls():
    """The shapes ``Tensor.masked_fill_`` ran on, in the block (apply_penalties
    itself never calls it: only apply_all_penalties' masking does)."""
    calls = []
    real = torch.Tensor.masked_fill_

    def counted(self, *args, **kwargs):
        calls.append(tuple(self.shape))
        return real(self, *args, **kwargs)

    torch.Tensor.masked_fill_ = counted
    try:
        yield calls
    finally:
        torch.Tensor.masked_fill_ = real


def _wrapped(function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):  # a profiler's timer, say
        return function(*args, **kwargs)
    return wrapper


@settings(max_examples=EXAMPLES // 4)
@given(rows=PENALISED_ROWS, seed=st.integers(0, 2**16),
       conversion=st.sampled_from(["fastbatch", "stock", "wrapped fastbatch"]))
def test_no_masking_only_after_fastbatchs_conversion(unpinned, rows, seed, conversion):
    """fastbatch's apply_all_penalties skips the masking exactly when the
    conversion it called is fastbatch's; after stock's conversion (the piece
    reverted, or its function wrapped) it masks as vLLM does, so the
    penalised logits are vLLM's with and without -1 in the rows."""
    logits, prompt, penalty_values = _penalty_inputs(rows, seed)
    stock = STOCK_APPLY_ALL(logits.clone(), prompt, *penalty_values, rows)
    installed = {"fastbatch": penalty_patch._convert_to_tensors,
                 "stock": penalty_patch.original() or penalties._convert_to_tensors,
                 "wrapped fastbatch": _wrapped(penalty_patch._convert_to_tensors)}
    saved, penalties._convert_to_tensors = penalties._convert_to_tensors, installed[conversion]
    try:
        with masked_fill_calls() as masked:
            got = penalty_patch.apply_all_penalties(logits.clone(), prompt, *penalty_values,
                                                    rows)
    finally:
        penalties._convert_to_tensors = saved
    assert torch.equal(got, stock)
    assert len(masked) == (conversion != "fastbatch")


def test_no_masking_with_the_piece_applied(unpinned):
    rows = [[5, -1, 7], [], [-1, -1], [3, 2, 1]]
    logits, prompt, penalty_values = _penalty_inputs(rows, 0)
    with masked_fill_calls() as masked:
        stock = STOCK_APPLY_ALL(logits.clone(), prompt, *penalty_values, rows)
    assert masked == [(4, 3)]
    assert penalty_patch.apply()
    try:
        for binding in BINDINGS:
            with masked_fill_calls() as masked:
                got = binding.apply_all_penalties(logits.clone(), prompt, *penalty_values,
                                                  rows)
            assert torch.equal(got, stock) and masked == []
    finally:
        penalty_patch.revert()
