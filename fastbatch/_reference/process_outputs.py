"""Pure-Python twin of the compiled piece ``process_outputs``: the test oracle.

Same signature, rules and counters as ``fastbatch._kernels.process_outputs``;
written for reading, not for speed.
"""

from __future__ import annotations

__all__ = ["process_output"]

import types
from typing import Any

from fastbatch._reference._common import Counters

_counters = Counters(("calls", "handled", "finished"))
stats, reset_stats = _counters.stats, _counters.reset_stats
_stats = _counters.values

# The EngineCoreOutput fields the turn reads (``error`` is vLLM 0.33.0's:
# where the class has none, it reads None).
OUTPUT_FIELDS = ("request_id", "new_token_ids", "new_logprobs", "new_prompt_logprobs_tensors",
                 "pooling_output", "finish_reason", "stop_reason", "kv_transfer_params",
                 "ec_transfer_params", "routed_experts", "new_sampling_mask",
                 "spec_decode_metrics", "prompt_token_id_logprobs", "error")

# Set by bind(): (EngineCoreOutput, whether it has an error field,
# OutputProcessor, RequestState, LogprobsProcessor, the detokenizer types
# whose num_output_tokens is len(token_ids), FinishReason.STOP,
# RequestOutputKind.FINAL_ONLY).
_BOUND: tuple[type, bool, type, type, type, tuple[type, ...], Any, Any] | None = None


def bind(output_type: type, processor_type: type, state_type: type, logprobs_type: type,
         detokenizer_types: tuple[type, ...], stop: Any, final_only: Any) -> None:
    """Make ``process_output`` answer for this vLLM: the exact types it
    takes (any other is vLLM's loop body's), ``FinishReason.STOP`` and
    ``RequestOutputKind.FINAL_ONLY``.  Each of ``OUTPUT_FIELDS`` must be an
    object slot of ``output_type`` (``error`` may be missing: vLLM 0.32.0
    has none), read through ``object.__getattribute__`` (the compiled turn
    reads the slots themselves)."""
    global _BOUND
    for name, value in (("output_type", output_type), ("processor_type", processor_type),
                        ("state_type", state_type), ("logprobs_type", logprobs_type)):
        if not isinstance(value, type):
            raise TypeError(f"{name} must be a type, got {type(value).__name__}")
    if type(detokenizer_types) is not tuple or not all(
            isinstance(kind, type) for kind in detokenizer_types):
        raise TypeError("detokenizer_types must be a tuple of types")
    if output_type.__getattribute__ is not object.__getattribute__:
        raise TypeError(f"{output_type.__name__} has its own __getattribute__")
    for name in OUTPUT_FIELDS:
        descriptor = next((vars(klass)[name] for klass in output_type.__mro__
                           if name in vars(klass)), None)
        if descriptor is None and name == "error":
            continue
        if type(descriptor) is not types.MemberDescriptorType:
            raise TypeError(f"{output_type.__name__}.{name} is not an object slot "
                            f"({type(descriptor).__name__})")
    _BOUND = (output_type, hasattr(output_type, "error"), processor_type, state_type,
              logprobs_type, detokenizer_types, stop, final_only)


def process_output(processor: Any, output: Any, engine_core_timestamp: Any,
                   iteration_stats: Any, weight_version: Any, request_outputs: list[Any],
                   reqs_to_abort: list[Any], outputs: Any = None) -> bool:
    """One turn of vLLM's loop in ``OutputProcessor.process_outputs`` (vLLM
    0.32.0 on) for ``output``, when it is a generated (not pooling)
    output of a known request in decode (not prefilling, no error, no
    routed experts, no streaming input): True when done.  False, with
    nothing read but the conditions and nothing changed, for every other
    output: vLLM's own loop body then runs.  vLLM's calls, in vLLM's order,
    except where vLLM's code is a known function of what it reads
    (``_update_stats_from_output`` without stats, ``track_weight_version``,
    ``num_output_tokens``, ``LogprobsProcessor.update_from_output``, and
    ``make_request_output`` for an unfinished ``FINAL_ONLY`` request).
    ``outputs``, the list the loop runs over, only steers the compiled
    piece's prefetch of the request states of the outputs ahead (the twin
    ignores it).
    """
    if _BOUND is None:
        raise RuntimeError("fastbatch's process_output is not bound to vLLM's classes "
                           "(fastbatch.patches.process_outputs.bind() does it)")
    (output_type, output_has_error, processor_type, state_type, logprobs_type,
     detokenizer_types, stop, final_only) = _BOUND
    _stats["calls"] += 1
    if type(output) is not output_type or type(processor) is not processor_type \
            or type(request_outputs) is not list or type(reqs_to_abort) is not list:
        return False
    request_states = processor.request_states
    req_id = output.request_id
    if type(request_states) is not dict or type(req_id) is not str:
        return False
    req_state = request_states.get(req_id)
    if type(req_state) is not state_type:
        return False  # None (an aborted request) too: vLLM's body skips it
    detokenizer = req_state.detokenizer
    logprobs_processor = req_state.logprobs_processor
    if ((output_has_error and output.error is not None) or req_state.is_prefilling
            or output.routed_experts is not None or output.pooling_output is not None
            or type(detokenizer) not in detokenizer_types
            or type(logprobs_processor) is not logprobs_type or req_state.streaming_input):
        return False
    _stats["handled"] += 1
    # 1) stats
    if iteration_stats is not None:
        processor._update_stats_from_output(req_state, output, engine_core_timestamp,
                                            iteration_stats)
    new_token_ids = output.new_token_ids
    finish_reason = output.finish_reason
    stop_reason = output.stop_reason
    kv_transfer_params = output.kv_transfer_params
    ec_transfer_params = output.ec_transfer_params
    spec_decode_metrics = output.spec_decode_metrics
    if spec_decode_metrics is not None:
        req_state.spec_decode_metrics = spec_decode_metrics
    # 2) detokenize, stop strings (track_weight_version and num_output_tokens inlined)
    # num_output_tokens(), before the update (track_weight_version's too)
    num_prev_tokens = len(detokenizer.token_ids)
    if new_token_ids and weight_version is not None:
        starts = req_state.weight_version_starts
        if not starts or starts[-1][0] != weight_version:
            starts.append((weight_version, num_prev_tokens))
    # None == FinishReason.STOP is False (neither side knows the other)
    stop_string = detokenizer.update(
        new_token_ids, False if finish_reason is None else finish_reason == stop)
    if stop_string:
        finish_reason = stop
        stop_reason = stop_string
        processor._trim_surplus_tokens(req_state, output, num_prev_tokens)
    new_sampling_mask = output.new_sampling_mask
    if new_sampling_mask is not None:
        req_state.sampling_mask_chunks.append(new_sampling_mask)
    # 3) logprobs (LogprobsProcessor.update_from_output inlined)
    new_logprobs = output.new_logprobs
    if new_logprobs is not None:
        logprobs_processor._update_sample_logprobs(new_logprobs)
    new_prompt_logprobs_tensors = output.new_prompt_logprobs_tensors
    if new_prompt_logprobs_tensors is not None:
        logprobs_processor._update_prompt_logprobs(new_prompt_logprobs_tensors)
    prompt_token_id_logprobs = output.prompt_token_id_logprobs
    if prompt_token_id_logprobs is not None:
        logprobs_processor.prompt_token_id_logprobs = prompt_token_id_logprobs.numpy()
    # 4) the RequestOutput (none for an unfinished FINAL_ONLY request)
    if finish_reason is None and req_state.output_kind is final_only:
        request_output = None
    else:
        request_output = req_state.make_request_output(
            new_token_ids, None, finish_reason, stop_reason, kv_transfer_params,
            ec_transfer_params, error=None)
    if request_output:
        queue = req_state.queue
        if queue is not None:
            queue.put(request_output)
        else:
            request_outputs.append(request_output)
    # free a finished request
    if finish_reason is not None:
        _stats["finished"] += 1
        processor._finish_request(req_state)
        if req_state.streaming_input or not output.finished:
            reqs_to_abort.append(req_id)
        processor._update_stats_from_finished(req_state, finish_reason, iteration_stats)
        if processor.tracing_enabled:
            processor.do_tracing(output, req_state, iteration_stats)
    return True
