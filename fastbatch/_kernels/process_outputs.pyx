# Compiler directives are set in setup.py (one place, with a debug switch).
"""Compiled piece ``process_outputs``: one turn of vLLM's loop in
``OutputProcessor.process_outputs`` for a generated output of a request in
decode.

Every condition is read before anything is written; then vLLM's calls in
vLLM's order, with the few steps that are known functions of what they read
done here (``_update_stats_from_output`` without stats, ``track_weight_version``,
``num_output_tokens``, ``LogprobsProcessor.update_from_output``, and
``make_request_output`` for an unfinished ``FINAL_ONLY`` request).  The patch
calls it at the top of vLLM's own loop; False sends the output on to
vLLM's loop body.  Attributes are read as attributes (properties and all).
``fastbatch._reference`` holds the same behaviour in plain Python.
"""

__all__ = ["process_output"]

cimport cython
from libc.stdint cimport uint64_t

# Process-wide counters, read with stats().
cdef uint64_t _calls = 0
cdef uint64_t _handled = 0
cdef uint64_t _finished = 0

# Set by bind().
cdef object _output_type = None
cdef bint _output_has_error = False
cdef object _processor_type = None
cdef object _state_type = None
cdef object _logprobs_type = None
cdef tuple _detokenizer_types = ()
cdef object _stop = None
cdef object _final_only = None
cdef bint _bound = False


def stats():
    """This piece's counters since import or the last ``reset_stats()``."""
    return {"calls": _calls, "handled": _handled, "finished": _finished}


def reset_stats():
    """Set every counter of ``stats()`` back to zero."""
    global _calls, _handled, _finished
    _calls = _handled = _finished = 0


def bind(output_type, processor_type, state_type, logprobs_type, detokenizer_types, stop,
         final_only):
    """Make ``process_output`` answer for this vLLM: the exact types it
    takes (any other is vLLM's loop body's), ``FinishReason.STOP`` and
    ``RequestOutputKind.FINAL_ONLY``.  An ``output_type`` without an
    ``error`` field (vLLM 0.32.0) has no error to look for."""
    global _output_type, _output_has_error, _processor_type, _state_type, _logprobs_type
    global _detokenizer_types, _stop, _final_only, _bound
    for name, value in (("output_type", output_type), ("processor_type", processor_type),
                        ("state_type", state_type), ("logprobs_type", logprobs_type)):
        if not isinstance(value, type):
            raise TypeError(f"{name} must be a type, got {type(value).__name__}")
    if type(detokenizer_types) is not tuple or not all(
            isinstance(kind, type) for kind in detokenizer_types):
        raise TypeError("detokenizer_types must be a tuple of types")
    _output_type, _output_has_error = output_type, hasattr(output_type, "error")
    _processor_type, _state_type, _logprobs_type = processor_type, state_type, logprobs_type
    _detokenizer_types, _stop, _final_only = detokenizer_types, stop, final_only
    _bound = True


cdef inline bint _taken_detokenizer(object detokenizer):
    cdef object kind = type(detokenizer)
    for taken in _detokenizer_types:
        if kind is taken:
            return True
    return False


@cython.wraparound(True)
cdef object _last(object sequence):
    """``sequence[-1]``, as Python indexes."""
    return sequence[-1]


def process_output(object processor, object output, object engine_core_timestamp,
                   object iteration_stats, object weight_version, object request_outputs,
                   object reqs_to_abort):
    """One turn of vLLM's loop in ``OutputProcessor.process_outputs`` for
    ``output``: True when done; False, with nothing changed, for an output
    vLLM's own loop body must take (see the twin)."""
    global _calls, _handled, _finished
    if not _bound:
        raise RuntimeError("fastbatch's process_output is not bound to vLLM's classes "
                           "(fastbatch.patches.process_outputs.bind() does it)")
    _calls += 1
    if (type(output) is not _output_type or type(processor) is not _processor_type
            or type(request_outputs) is not list or type(reqs_to_abort) is not list):
        return False
    request_states = processor.request_states
    req_id = output.request_id
    if type(request_states) is not dict or type(req_id) is not str:
        return False
    req_state = (<dict>request_states).get(req_id)
    if type(req_state) is not _state_type:
        return False
    detokenizer = req_state.detokenizer
    logprobs_processor = req_state.logprobs_processor
    if ((_output_has_error and output.error is not None) or req_state.is_prefilling
            or output.routed_experts is not None or output.pooling_output is not None
            or not _taken_detokenizer(detokenizer)
            or type(logprobs_processor) is not _logprobs_type or req_state.streaming_input):
        return False
    _handled += 1
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
    if new_token_ids and weight_version is not None:
        starts = req_state.weight_version_starts
        if not starts or _last(starts)[0] != weight_version:
            starts.append((weight_version, len(detokenizer.token_ids)))
    num_prev_tokens = len(detokenizer.token_ids)
    # None == FinishReason.STOP is False (neither side knows the other)
    stop_string = detokenizer.update(
        new_token_ids, False if finish_reason is None else finish_reason == _stop)
    if stop_string:
        finish_reason = _stop
        stop_reason = stop_string
        processor._trim_surplus_tokens(req_state, output, num_prev_tokens)
    new_sampling_mask = output.new_sampling_mask
    if new_sampling_mask is not None:
        req_state.sampling_mask_chunks.append(new_sampling_mask)
    new_logprobs = output.new_logprobs
    if new_logprobs is not None:
        logprobs_processor._update_sample_logprobs(new_logprobs)
    new_prompt_logprobs_tensors = output.new_prompt_logprobs_tensors
    if new_prompt_logprobs_tensors is not None:
        logprobs_processor._update_prompt_logprobs(new_prompt_logprobs_tensors)
    prompt_token_id_logprobs = output.prompt_token_id_logprobs
    if prompt_token_id_logprobs is not None:
        logprobs_processor.prompt_token_id_logprobs = prompt_token_id_logprobs.numpy()
    if finish_reason is None and req_state.output_kind is _final_only:
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
            (<list>request_outputs).append(request_output)
    if finish_reason is not None:
        _finished += 1
        processor._finish_request(req_state)
        if req_state.streaming_input or not output.finished:
            (<list>reqs_to_abort).append(req_id)
        processor._update_stats_from_finished(req_state, finish_reason, iteration_stats)
        if processor.tracing_enabled:
            processor.do_tracing(output, req_state, iteration_stats)
    return True
