"""fastbatch: vLLM's per-step token bookkeeping as one compiled call per step.

* ``update_async_output_token_ids(req_ids, prev_req_id_to_index,
  output_token_ids, sampled_token_ids, copy_ready=None)``: the batch-wide
  version of vLLM's ``InputBatch.update_async_output_token_ids``.
* ``update_async_spec_token_ids(req_ids, prev_req_id_to_index,
  spec_token_ids, draft_token_ids)``: the loop of
  ``InputBatch.update_async_spec_token_ids``.
* ``output_tokens_tensor(output_token_ids, vocab_size, pin_memory=False)``:
  the penalties' padded output-token tensor, ``-1`` already masked.
* ``append_sampled_token_ids(req_ids, requests, num_sampled_tokens,
  valid_sampled_token_ids, discarded, num_tokens_no_spec, token_ids_cpu,
  is_token_ids, max_model_len)``: the per-request loop of vLLM's
  ``GPUModelRunner._bookkeeping_sync``.
* ``compute_prev_positions(req_ids, prev_req_id_to_index, prev_positions,
  num_reqs)``: the loop of ``GPUModelRunner._compute_prev_positions``.
* ``prepare_input_ids_indices(req_ids, prev_positions, cu_num_tokens,
  scheduled_spec_tokens, prev_num_spec_tokens, num_reqs)``: the loop of
  ``GPUModelRunner._prepare_input_ids``, its index lists as int64 arrays.
* ``sampled_token_lists(sampled_token_ids, invalid_req_indices=())``,
  ``rejection_output_lists(output_token_ids, vocab_size,
  discard_req_indices=())`` and ``draft_token_lists(draft_token_ids,
  num_reqs, num_spec_tokens)``: a step's rows of ids as plain lists, as
  ``AsyncGPUModelRunnerOutput.get_output``, ``RejectionSampler.parse_output``
  and ``GPUModelRunner._get_draft_token_ids_cpu`` build them.
* ``allocate_slots_is_noop(manager, request, num_new_tokens, reserved_blocks,
  kinds)``: whether vLLM's ``KVCacheManager.allocate_slots`` would change
  nothing and return the empty blocks (a plain decode step of the scheduler).
* ``take_decode_outputs(scheduler, scheduler_output, model_runner_output,
  kinds, variant)`` and ``merge_decode_outputs(slots, stock_outputs)``: the
  plain decodes of vLLM's ``Scheduler.update_from_output`` in one call, and
  their outputs merged with vLLM's for the other requests.
* ``update_after_schedule(scheduler, scheduler_output, spec_token_placeholders,
  request_type)``: the per-request loops of ``Scheduler._update_after_schedule``
  and ``AsyncScheduler._update_after_schedule``, in one pass.
* ``cached_request_lists(running_reqs, resumed_reqs, req_to_new_blocks,
  prev_step_scheduled_req_ids, kinds)``: the loop of
  ``Scheduler._make_cached_request_data``.

Each is a compiled piece (``fastbatch._kernels``, one module per piece) with a
pure-Python twin (``fastbatch._reference``).  ``COMPILED`` says whether the
compiled pieces are in use; if they cannot be imported, the twins take their
place and one ``RuntimeWarning`` says so.
"""

import warnings

__version__ = "0.1.0"

try:
    from fastbatch._kernels import (
        allocate_slots_is_noop,
        append_sampled_token_ids,
        cached_request_lists,
        compute_prev_positions,
        draft_token_lists,
        merge_decode_outputs,
        output_tokens_tensor,
        prepare_input_ids_indices,
        rejection_output_lists,
        reset_stats,
        sampled_token_lists,
        stats,
        take_decode_outputs,
        update_after_schedule,
        update_async_output_token_ids,
        update_async_spec_token_ids,
    )
except ImportError as exc:  # no compiled module for this platform/interpreter
    warnings.warn(
        f"fastbatch: compiled kernel unavailable ({exc}); using the slower "
        "pure-Python fallback",
        RuntimeWarning,
        stacklevel=2,
    )
    from fastbatch._reference import (
        allocate_slots_is_noop,
        append_sampled_token_ids,
        cached_request_lists,
        compute_prev_positions,
        draft_token_lists,
        merge_decode_outputs,
        output_tokens_tensor,
        prepare_input_ids_indices,
        rejection_output_lists,
        reset_stats,
        sampled_token_lists,
        stats,
        take_decode_outputs,
        update_after_schedule,
        update_async_output_token_ids,
        update_async_spec_token_ids,
    )

    COMPILED = False
else:
    COMPILED = True

__all__ = [
    "COMPILED",
    "__version__",
    "allocate_slots_is_noop",
    "append_sampled_token_ids",
    "cached_request_lists",
    "compute_prev_positions",
    "draft_token_lists",
    "merge_decode_outputs",
    "output_tokens_tensor",
    "prepare_input_ids_indices",
    "rejection_output_lists",
    "reset_stats",
    "sampled_token_lists",
    "stats",
    "take_decode_outputs",
    "update_after_schedule",
    "update_async_output_token_ids",
    "update_async_spec_token_ids",
]
