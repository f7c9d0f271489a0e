"""The bookkeeping patch against the REAL vLLM 0.33.0 ``_bookkeeping_sync``.

Each generated step is built twice as a real ``InputBatch`` (``add_request``
for every request, ``remove_request`` for some, ``condense`` or holes left),
with the real ``CachedRequestState`` objects, and a stand-in runner carrying
what the method reads (the real ``_get_prompt_logprobs_dict`` and the CPU
runner's ``_to_list``).  vLLM's own method runs on one copy, fastbatch's on
the other: the return values, every array the batch holds, every output list
(values and identity: still the very list the state and the batch share),
``prev_req_id_to_index`` and ``prev_sampled_token_ids`` must come out the
same, and so must any exception.  Spec decoding runs the real
``RejectionSampler.parse_output`` on rows with rejections.
"""

from __future__ import annotations

import os
from types import MethodType, SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM is imported
pytestmark = pytest.mark.vllm

import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.worker.cpu_model_runner import CPUModelRunner  # noqa: E402
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

import fastbatch  # noqa: E402
from fastbatch.patches import bookkeeping_sync as patch  # noqa: E402

MAX_REQS = 12
WIDTH = 48  # the InputBatch's max_model_len (columns of token_ids_cpu)
VOCAB = 1000
EXAMPLES = int(os.environ.get("FASTBATCH_VLLM_EXAMPLES", 1000))


@st.composite
def steps(draw):
    """What a step looks like when ``_bookkeeping_sync`` runs."""
    num_added = draw(st.integers(0, MAX_REQS))
    prompt_lens = draw(st.lists(st.integers(1, 8), min_size=num_added, max_size=num_added))
    outputs = draw(st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=6),
                            min_size=num_added, max_size=num_added))
    removed = draw(st.sets(st.integers(0, max(num_added - 1, 0)), max_size=3)
                   ) if num_added else set()
    num_reqs = num_added - len(removed)
    use_async = draw(st.booleans())
    num_spec = draw(st.sampled_from([0, 0, 1, 3]))
    # Tokens per row: the first always sampled, then accepted drafts, then -1.
    accepted = draw(st.lists(st.integers(0, num_spec), min_size=num_reqs, max_size=num_reqs))
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=num_reqs * (num_spec + 1),
                           max_size=num_reqs * (num_spec + 1)))
    return SimpleNamespace(
        prompt_lens=prompt_lens, outputs=outputs, removed=removed,
        condense=draw(st.booleans()) if removed else True,
        use_async=use_async, num_spec=num_spec, accepted=accepted, tokens=tokens,
        discarded=draw(st.lists(st.booleans(), min_size=num_reqs, max_size=num_reqs)),
        prev_sampled=use_async and (num_spec > 0 or draw(st.booleans())),
        max_model_len=draw(st.sampled_from([WIDTH, WIDTH, 14, 12])),
    )


def _runner(step):
    """A real InputBatch holding ``step`` and a stand-in GPUModelRunner around it."""
    input_batch = InputBatch(
        max_num_reqs=MAX_REQS, max_model_len=WIDTH, max_num_batched_tokens=WIDTH,
        device=torch.device("cpu"), vocab_size=VOCAB, block_sizes=[16],
        max_num_blocks_per_req=[WIDTH // 16],
        # The batch and the sampling metadata then share the output lists.
        logitsprocs_need_output_token_ids=True,
    )
    requests = {}
    for index, (prompt_len, output) in enumerate(zip(step.prompt_lens, step.outputs,
                                                     strict=True)):
        state = CachedRequestState(
            req_id=f"req-{index}", prompt_token_ids=list(range(1, prompt_len + 1)),
            mm_features=[], sampling_params=SamplingParams(temperature=0.0),
            generator=None, block_ids=([],), num_computed_tokens=prompt_len,
            output_token_ids=list(output))
        requests[state.req_id] = state
        input_batch.add_request(state)
    for index in sorted(step.removed):
        input_batch.remove_request(f"req-{index}")
        del requests[f"req-{index}"]
    if step.condense:
        input_batch.condense()
    input_batch.refresh_metadata()
    num_reqs = input_batch.num_reqs

    columns = step.num_spec + 1
    sampled = np.array(step.tokens, dtype=np.int32).reshape(num_reqs, columns)
    for row, accepted in enumerate(step.accepted):
        sampled[row, accepted + 1:] = -1  # rejected drafts
    discard = np.zeros(MAX_REQS, dtype=bool)
    discard[:num_reqs] = step.discarded
    if step.prev_sampled:  # with spec decoding, propose_draft_token_ids set it
        input_batch.prev_sampled_token_ids = torch.zeros((num_reqs, 1), dtype=torch.int32)
    runner = SimpleNamespace(
        use_async_scheduling=step.use_async, max_model_len=step.max_model_len,
        input_batch=input_batch, requests=requests, num_prompt_logprobs={},
        discard_request_mask=SimpleNamespace(np=discard),
    )
    runner._to_list = MethodType(CPUModelRunner._to_list, runner)
    runner._get_prompt_logprobs_dict = MethodType(GPUModelRunner._get_prompt_logprobs_dict,
                                                  runner)
    sampler_output = SimpleNamespace(sampled_token_ids=torch.from_numpy(sampled),
                                     logprobs_tensors=None)
    arguments = (SimpleNamespace(num_scheduled_tokens={}), sampler_output, None,
                 torch.zeros(num_reqs), num_reqs)
    return runner, arguments


def _run(method, runner, arguments):
    try:
        return ("returned", method(runner, *arguments))
    except Exception as exc:  # the exception is the outcome
        return ("raised", type(exc), str(exc))


def _state(runner, arguments):
    batch = runner.input_batch
    return [
        batch.num_tokens_no_spec.tolist(), batch.token_ids_cpu.tolist(),
        batch.is_token_ids.tolist(), list(batch.req_output_token_ids),
        {req_id: state.output_token_ids for req_id, state in runner.requests.items()},
        batch.prev_req_id_to_index,
        batch.prev_sampled_token_ids is arguments[1].sampled_token_ids,
        None if batch.prev_sampled_token_ids is None else batch.prev_sampled_token_ids.shape,
    ]


def _check_identities(runner):
    """The batch, its sampling metadata and the states still share each list."""
    batch = runner.input_batch
    assert batch.sampling_metadata.output_token_ids is batch.req_output_token_ids
    for req_id, index in batch.req_id_to_index.items():
        assert batch.req_output_token_ids[index] is runner.requests[req_id].output_token_ids


def vllm_method():
    method = patch.original() or GPUModelRunner._bookkeeping_sync
    assert not getattr(method, "__fastbatch__", False)
    return method


@settings(max_examples=EXAMPLES)
@given(step=steps())
def test_patched_method_matches_real_vllm(step):
    note(repr(step))
    stock, ours = _runner(step), _runner(step)
    fastbatch.reset_stats()
    expected = _run(vllm_method(), *stock)
    got = _run(patch._bookkeeping_sync, *ours)
    assert got == expected
    assert _state(*ours) == _state(*stock)
    _check_identities(ours[0])
    if got[0] == "returned":  # and the compiled call did it, vLLM's loop did not
        valid_sampled_token_ids = got[1][3]
        updated = (len(step.discarded) - sum(step.discarded) if step.use_async
                   else sum(1 for ids in valid_sampled_token_ids if ids))
        assert fastbatch.stats()["bookkeeping_sync"]["calls"] == 1
        assert fastbatch.stats()["bookkeeping_sync"]["requests_updated"] == updated


def test_examples_cover_every_path():
    """The cases the strategy must reach: async and sync, spec rows, discards,
    the assertion, holes (vLLM raises KeyError: fastbatch runs its loop)."""
    seen = set()

    @settings(max_examples=300, database=None)
    @given(step=steps())
    def collect(step):
        stock = _runner(step)
        outcome = _run(vllm_method(), *stock)
        seen.add(("async" if step.use_async else "sync", step.num_spec > 0,
                  any(step.discarded), outcome[0] == "raised" and outcome[1].__name__))

    collect()
    kinds = {(mode, spec) for mode, spec, _, _ in seen}
    assert kinds == {("async", False), ("async", True), ("sync", False), ("sync", True)}
    assert {raised for *_, raised in seen} >= {False, "AssertionError", "KeyError"}
    assert any(discarded for _, _, discarded, _ in seen)


def test_the_plugin_installs_it_on_the_class():
    assert patch.apply()
    try:
        assert GPUModelRunner._bookkeeping_sync is patch._bookkeeping_sync
        step = SimpleNamespace(
            prompt_lens=[3, 4, 5], outputs=[[7], [], [8, 9]], removed={1}, condense=True,
            use_async=True, num_spec=0, accepted=[0, 0], tokens=[11, 12],
            discarded=[False, True], prev_sampled=False, max_model_len=WIDTH)
        stock, ours = _runner(step), _runner(step)
        assert _run(GPUModelRunner._bookkeeping_sync, *ours) == _run(vllm_method(), *stock)
        assert _state(*ours) == _state(*stock)
    finally:
        patch.revert()
    assert not getattr(GPUModelRunner._bookkeeping_sync, "__fastbatch__", False)


def test_guard_accepts_033_and_refuses_a_changed_method():
    import vllm

    assert patch.check_target(vllm.__version__, vllm_method()) is None
    assert "not a verified version" in patch.check_target("0.30.0", vllm_method())

    def changed(self, *args):  # any other code: refused
        return vllm_method()(self, *args)

    assert "not a verified variant" in patch.check_target(vllm.__version__, changed)


def test_activation_check_passes_and_refuses_a_wrong_kernel(monkeypatch):
    assert patch.activation_check(vllm_method(), patch._bookkeeping_sync) is None

    def forgets_the_counts(req_ids, requests, num_sampled, valid, discarded, num_tokens,
                           *rest):
        for index in range(num_sampled):
            if valid is None:
                requests[req_ids[index]].output_token_ids.append(-1)
            else:
                requests[req_ids[index]].output_token_ids.extend(valid[index])

    monkeypatch.setattr(fastbatch, "append_sampled_token_ids", forgets_the_counts)
    assert patch.activation_check(vllm_method(), patch._bookkeeping_sync) is not None
