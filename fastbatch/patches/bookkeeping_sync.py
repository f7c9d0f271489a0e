"""Patch: ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._bookkeeping_sync``.

What is replaced: the per-request loop of the method that, after sampling,
records each request's new tokens on the CPU side: ``token_ids_cpu``,
``is_token_ids`` and ``num_tokens_no_spec`` of the input batch, and the
request's ``output_token_ids`` list (the same list object that the input
batch and the sampling metadata hold).  Under async scheduling each request
not discarded gets one ``-1`` placeholder (replaced by the real id next step,
see the ``output`` patch); without it, its ``valid_sampled_token_ids`` row.
``execute_model``/``sample_tokens`` call it once per step, on every step,
plain greedy decode included.

Why: that loop indexes numpy arrays with scalars and assigns slices, a few
microseconds per request on every step (about 1 ms at 256 requests, 2-4 ms
at 1024 here).  fastbatch runs it as one compiled call
(``fastbatch.append_sampled_token_ids``) that writes the arrays through their
buffers.  The rest of the method is vLLM's own code, unchanged: the method
below is vLLM 0.31.0-0.33.0's, with only the loop swapped, so the guard pins
that exact variant.

Exactness: the compiled call checks everything before it changes anything.
If it refuses the input (an assertion vLLM would raise, a missing request
state, arrays that are not the batch's int32/bool arrays, rows that are not
lists of ints...), vLLM's own loop (the copy in ``_vllm_loop``, pinned by the
same fingerprint) runs instead, so errors and partial updates are vLLM's.

When it can go: with Model Runner V2 (it keeps this state on the GPU), or if
vLLM moves the loop into compiled or vectorised code.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import fastbatch
from fastbatch.patches._patch import Patch

try:  # the names vLLM's method uses, from where vLLM's module takes them
    import numpy as np
    import vllm.envs as envs
    from vllm.utils.gpu_sync_debug import gpu_sync_allowed
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.worker.gpu_model_runner import count_nans_per_row
except ImportError:  # another vLLM: its method is not the verified variant,
    np = envs = gpu_sync_allowed = RejectionSampler = count_nans_per_row = None

VERIFIED_FINGERPRINTS = {
    "e1369eeed7e9567dfcdb18b2dc48400554a0967e9286d10cc7d7c27723c70a1d":
        "vLLM 0.31.0-0.33.0",
}

# What the compiled call refuses without changing anything; vLLM's loop then
# runs and raises (or not) exactly as stock does.
_REFUSED = (AssertionError, AttributeError, IndexError, KeyError, OverflowError,
            RuntimeError, TypeError, ValueError)


def _vllm_loop(self: Any, req_ids: list[str], num_sampled_tokens: int,
               valid_sampled_token_ids: list[list[int]],
               invalid_req_indices_set: set[int] | None) -> None:
    """vLLM's loop, verbatim, for the inputs the compiled call refuses."""
    for req_idx in range(num_sampled_tokens):
        if self.use_async_scheduling:
            sampled_ids = [-1] if req_idx not in invalid_req_indices_set else None
        else:
            sampled_ids = valid_sampled_token_ids[req_idx]

        num_sampled_ids: int = len(sampled_ids) if sampled_ids else 0

        if not sampled_ids:
            continue

        start_idx = self.input_batch.num_tokens_no_spec[req_idx]
        end_idx = start_idx + num_sampled_ids
        assert end_idx <= self.max_model_len, (
            "Sampled token IDs exceed the max model length. "
            f"Total number of tokens: {end_idx} > max_model_len: "
            f"{self.max_model_len}"
        )

        self.input_batch.token_ids_cpu[req_idx, start_idx:end_idx] = sampled_ids
        self.input_batch.is_token_ids[req_idx, start_idx:end_idx] = True
        self.input_batch.num_tokens_no_spec[req_idx] = end_idx

        req_id = req_ids[req_idx]
        req_state = self.requests[req_id]
        req_state.output_token_ids.extend(sampled_ids)


def _bookkeeping_sync(
    self: Any,
    scheduler_output: Any,
    sampler_output: Any,
    logits: Any,
    hidden_states: Any,
    num_scheduled_tokens: int,
) -> tuple[Any, ...]:
    """fastbatch's drop-in for ``GPUModelRunner._bookkeeping_sync``: vLLM
    0.31.0-0.33.0's method with its per-request loop as one compiled call."""
    num_nans: Any = None
    num_nans_in_logits: dict[str, int] = {}
    if envs.VLLM_COMPUTE_NANS_IN_LOGITS:
        if self.use_async_scheduling:
            # Keep the counts on device; they ride the async output copy
            # stream rather than blocking here.
            num_nans = None if logits is None else count_nans_per_row(logits)
        else:
            num_nans_in_logits = self._get_nans_in_logits(logits)

    num_reqs = self.input_batch.num_reqs
    discard_sampled_tokens_req_indices = np.nonzero(
        self.discard_request_mask.np[:num_reqs]
    )[0]
    for i in discard_sampled_tokens_req_indices:
        gen = self.input_batch.generators.get(int(i))
        if gen is not None:
            gen.set_offset(gen.get_offset() - 4)

    # Copy some objects so they don't get modified after returning.
    # This is important when using async scheduling.
    req_ids_output_copy = self.input_batch.req_ids.copy()
    req_id_to_index_output_copy = self.input_batch.req_id_to_index.copy()

    num_sampled_tokens = sampler_output.sampled_token_ids.shape[0]
    sampled_token_ids = sampler_output.sampled_token_ids
    logprobs_tensors = sampler_output.logprobs_tensors
    invalid_req_indices = []
    invalid_req_indices_set = None
    logprobs_lists = None
    if not self.use_async_scheduling:
        with gpu_sync_allowed():
            # Get the valid generated tokens.
            max_gen_len = sampled_token_ids.shape[-1]
            if max_gen_len == 1:
                # No spec decode tokens.
                valid_sampled_token_ids = self._to_list(sampled_token_ids)
                # Mask out the sampled tokens that should not be sampled.
                for i in discard_sampled_tokens_req_indices:
                    valid_sampled_token_ids[int(i)].clear()

                if logprobs_tensors is not None:
                    logprobs_lists = logprobs_tensors.tolists()
            else:
                # Includes spec decode tokens.
                valid_sampled_token_ids, logprobs_lists = (
                    RejectionSampler.parse_output(
                        sampled_token_ids,
                        self.input_batch.vocab_size,
                        discard_sampled_tokens_req_indices,
                        logprobs_tensors=logprobs_tensors,
                    )
                )
    else:
        valid_sampled_token_ids = []
        invalid_req_indices = discard_sampled_tokens_req_indices.tolist()
        invalid_req_indices_set = set(invalid_req_indices)

        # Cache the sampled tokens on the GPU and avoid CPU sync.
        # These will be copied into input_ids in the next step
        # when preparing inputs.
        # With spec decoding, this is done in propose_draft_token_ids().
        if self.input_batch.prev_sampled_token_ids is None:
            assert sampled_token_ids.shape[-1] == 1
            self.input_batch.prev_sampled_token_ids = sampled_token_ids
        self.input_batch.prev_req_id_to_index = {
            req_id: i
            for i, req_id in enumerate(self.input_batch.req_ids)
            if i not in invalid_req_indices_set
        }

    # Cache the sampled tokens in the model runner, so that the scheduler
    # doesn't need to send them back.  (fastbatch: vLLM's loop, compiled.)
    req_ids = self.input_batch.req_ids
    try:
        fastbatch.append_sampled_token_ids(
            req_ids, self.requests, num_sampled_tokens,
            None if self.use_async_scheduling else valid_sampled_token_ids,
            invalid_req_indices_set, self.input_batch.num_tokens_no_spec,
            self.input_batch.token_ids_cpu, self.input_batch.is_token_ids,
            self.max_model_len)
        refused = False
    except _REFUSED:
        refused = True
    if refused:  # nothing changed: vLLM's loop, with vLLM's errors (and tracebacks)
        _vllm_loop(self, req_ids, num_sampled_tokens, valid_sampled_token_ids,
                   invalid_req_indices_set)

    # Compute prompt logprobs if needed.
    prompt_logprobs_dict = self._get_prompt_logprobs_dict(
        hidden_states[:num_scheduled_tokens],
        scheduler_output.num_scheduled_tokens,
    )

    return (
        num_nans_in_logits,
        num_nans,
        logprobs_lists,
        valid_sampled_token_ids,
        prompt_logprobs_dict,
        req_ids_output_copy,
        req_id_to_index_output_copy,
        invalid_req_indices,
    )




def _synthetic_step(use_async: bool,
                    max_model_len: int = 8) -> tuple[SimpleNamespace, tuple[Any, ...]]:
    """A GPUModelRunner stand-in after a step of four requests, one of them
    discarded (a partial prefill), and the arguments of ``_bookkeeping_sync``;
    with ``max_model_len`` 7 the last request hits vLLM's assertion."""
    req_ids = ["a", "b", "partial", "d"]
    input_batch = SimpleNamespace(
        num_reqs=4, req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        generators={}, vocab_size=100, prev_sampled_token_ids=None,
        prev_req_id_to_index=None,
        num_tokens_no_spec=np.array([3, 5, 2, 7, 0], dtype=np.int32),
        token_ids_cpu=np.zeros((5, 8), dtype=np.int32),
        is_token_ids=np.zeros((5, 8), dtype=bool),
    )
    requests = {req_id: SimpleNamespace(output_token_ids=[7] * (i % 2))
                for i, req_id in enumerate(req_ids)}
    runner = SimpleNamespace(
        use_async_scheduling=use_async, max_model_len=max_model_len,
        input_batch=input_batch,
        requests=requests,
        discard_request_mask=SimpleNamespace(np=np.array([0, 0, 1, 0, 0], dtype=bool)),
        _to_list=lambda sampled: sampled.tolist(),
        _get_prompt_logprobs_dict=lambda hidden, scheduled: {},
        _get_nans_in_logits=lambda logits: {},
    )
    sampler_output = SimpleNamespace(
        sampled_token_ids=np.array([[11], [12], [13], [2**18 + 5]], dtype=np.int64),
        logprobs_tensors=None)
    return runner, (SimpleNamespace(num_scheduled_tokens={}), sampler_output, None,
                    [0.0] * 4, 4)


def _state(runner: SimpleNamespace, result: tuple[Any, ...]) -> list[Any]:
    batch = runner.input_batch
    return [result, {r: s.output_token_ids for r, s in runner.requests.items()},
            batch.num_tokens_no_spec.tolist(), batch.token_ids_cpu.tolist(),
            batch.is_token_ids.tolist(), batch.prev_req_id_to_index]


def _outcome(method: Any, runner: SimpleNamespace, arguments: tuple[Any, ...]) -> list[Any]:
    try:
        result: Any = method(runner, *arguments)
    except AssertionError as exc:  # vLLM's max_model_len check
        result = ("AssertionError", str(exc))
    return _state(runner, result)


def activation_check(method: Any, replacement: Any) -> str | None:
    """Run both on the synthetic steps, async and not, and one that hits
    vLLM's assertion; why they disagree, or None."""
    for use_async, max_model_len in ((True, 8), (False, 8), (False, 7)):
        stock = _synthetic_step(use_async, max_model_len)
        ours = copy.deepcopy(stock)
        expected = _outcome(method, *stock)
        got = _outcome(replacement, *ours)
        if repr(got) != repr(expected):
            return (f"fastbatch gave {got}, vLLM gave {expected} (async: {use_async}, "
                    f"max_model_len: {max_model_len})")
    return None


PATCH = Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner._bookkeeping_sync",
              _bookkeeping_sync, fingerprints=VERIFIED_FINGERPRINTS,
              activation_check=activation_check)
