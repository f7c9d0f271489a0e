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
vLLM's loop body.  The fields of vLLM's ``EngineCoreOutput`` (a
``msgspec.Struct``: each field a slot) are read at their slots' offsets,
found by ``bind`` from the class's member descriptors, which is what
reading them as attributes does; everything else is read as attributes
(properties and all).  ``fastbatch._reference`` holds the same behaviour in
plain Python.
"""

__all__ = ["process_output"]

cimport cython
from cpython.object cimport PyObject
from libc.stdint cimport uint64_t

from fastbatch._kernels._common cimport PREFETCH_DISTANCE, RequestPrefetch
from fastbatch._kernels._common cimport PyErr_Clear, PyMemberDef, PyMemberDescrObject, dict_get_hint

import types


# PyMemberDef types of an object slot: T_OBJECT (NULL reads None) and
# T_OBJECT_EX (NULL raises AttributeError); the same numbers in 3.10 to 3.13.
cdef enum:
    MEMBER_OBJECT = 6
    MEMBER_OBJECT_EX = 16

# The EngineCoreOutput fields the turn reads, in this order (``error`` is
# vLLM 0.33.0's: where the class has none, it reads None).
OUTPUT_FIELDS = ("request_id", "new_token_ids", "new_logprobs", "new_prompt_logprobs_tensors",
                 "pooling_output", "finish_reason", "stop_reason", "kv_transfer_params",
                 "ec_transfer_params", "routed_experts", "new_sampling_mask",
                 "spec_decode_metrics", "prompt_token_id_logprobs", "error")
cdef enum Field:
    REQUEST_ID, NEW_TOKEN_IDS, NEW_LOGPROBS, NEW_PROMPT_LOGPROBS_TENSORS, POOLING_OUTPUT,
    FINISH_REASON, STOP_REASON, KV_TRANSFER_PARAMS, EC_TRANSFER_PARAMS, ROUTED_EXPERTS,
    NEW_SAMPLING_MASK, SPEC_DECODE_METRICS, PROMPT_TOKEN_ID_LOGPROBS, ERROR, FIELD_COUNT

# Process-wide counters, read with stats().
cdef uint64_t _calls = 0
cdef uint64_t _handled = 0
cdef uint64_t _finished = 0

# Set by bind().
cdef object _output_type = None
cdef Py_ssize_t _offsets[<int>FIELD_COUNT]  # -1: not a field of the class (reads None)
cdef bint _raises[<int>FIELD_COUNT]  # an unset slot raises AttributeError (T_OBJECT_EX)
cdef object _processor_type = None
cdef object _state_type = None
cdef object _logprobs_type = None
cdef tuple _detokenizer_types = ()
cdef object _stop = None
cdef object _final_only = None
cdef bint _bound = False

# The request states of the outputs ahead, prefetched (see _follow): the
# list of outputs being followed (only compared, never read through) and the
# index in it of the output expected next.
cdef RequestPrefetch _prefetch = None
cdef PyObject* _followed = NULL
cdef Py_ssize_t _next = 0


def stats():
    """This piece's counters since import or the last ``reset_stats()``."""
    return {"calls": _calls, "handled": _handled, "finished": _finished}


def reset_stats():
    """Set every counter of ``stats()`` back to zero."""
    global _calls, _handled, _finished
    _calls = _handled = _finished = 0


cdef object _member(object kind, str name):
    """The descriptor ``kind``'s attribute lookup finds for ``name``, or None."""
    for klass in kind.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return None


def bind(output_type, processor_type, state_type, logprobs_type, detokenizer_types, stop,
         final_only):
    """Make ``process_output`` answer for this vLLM: the exact types it
    takes (any other is vLLM's loop body's), ``FinishReason.STOP`` and
    ``RequestOutputKind.FINAL_ONLY``.  Each of ``OUTPUT_FIELDS`` must be an
    object slot of ``output_type`` (``error`` may be missing: vLLM 0.32.0
    has none), read through ``object.__getattribute__``."""
    global _output_type, _processor_type, _state_type, _logprobs_type
    global _detokenizer_types, _stop, _final_only, _bound, _prefetch, _followed
    cdef Py_ssize_t offsets[<int>FIELD_COUNT]
    cdef bint raises[<int>FIELD_COUNT]
    cdef PyMemberDef* member
    for name, value in (("output_type", output_type), ("processor_type", processor_type),
                        ("state_type", state_type), ("logprobs_type", logprobs_type)):
        if not isinstance(value, type):
            raise TypeError(f"{name} must be a type, got {type(value).__name__}")
    if type(detokenizer_types) is not tuple or not all(
            isinstance(kind, type) for kind in detokenizer_types):
        raise TypeError("detokenizer_types must be a tuple of types")
    if output_type.__getattribute__ is not object.__getattribute__:
        raise TypeError(f"{output_type.__name__} has its own __getattribute__")
    for index, name in enumerate(OUTPUT_FIELDS):
        descriptor = _member(output_type, name)
        if descriptor is None and name == "error":
            offsets[index], raises[index] = -1, False
            continue
        if type(descriptor) is not types.MemberDescriptorType:
            raise TypeError(f"{output_type.__name__}.{name} is not an object slot "
                            f"({type(descriptor).__name__})")
        member = (<PyMemberDescrObject*><PyObject*>descriptor).d_member
        if member.type != MEMBER_OBJECT and member.type != MEMBER_OBJECT_EX:
            raise TypeError(f"{output_type.__name__}.{name} is not an object slot "
                            f"(member type {member.type})")
        offsets[index], raises[index] = member.offset, member.type == MEMBER_OBJECT_EX
    for index in range(<int>FIELD_COUNT):
        _offsets[index], _raises[index] = offsets[index], raises[index]
    _output_type = output_type
    _processor_type, _state_type, _logprobs_type = processor_type, state_type, logprobs_type
    _detokenizer_types, _stop, _final_only = detokenizer_types, stop, final_only
    _prefetch, _followed = RequestPrefetch(state_type), NULL
    _bound = True


cdef inline PyObject* _slot(PyObject* output, Field field) noexcept:
    """``output``'s slot of ``field`` (borrowed; ``output`` of the bound
    type), NULL where unset or not a field of the class."""
    cdef Py_ssize_t offset = _offsets[<int>field]
    if offset < 0:
        return NULL
    return (<PyObject**>((<char*>output) + offset))[0]


cdef inline object _field(object output, Field field):
    """``output.<field>``, from its slot (``output`` of the bound type)."""
    cdef PyObject* value = _slot(<PyObject*>output, field)
    if value is NULL:
        if _raises[<int>field]:
            raise AttributeError(OUTPUT_FIELDS[<int>field])
        return None
    return <object>value


cdef inline object _last_start(object starts):
    """``starts[-1]`` of a non-empty list (anything else: Python's indexing)."""
    if type(starts) is list:
        return (<list>starts)[len(<list>starts) - 1]
    return _last(starts)


cdef inline bint _taken_detokenizer(object detokenizer):
    cdef object kind = type(detokenizer)
    for taken in _detokenizer_types:
        if kind is taken:
            return True
    return False


cdef PyObject* _state_at(list outputs, Py_ssize_t j, object request_states) noexcept:
    """The request state ``outputs[j]``'s turn will read (borrowed), or NULL."""
    cdef PyObject* output
    cdef PyObject* req_id
    cdef PyObject* state
    if j < 0 or j >= len(outputs):
        return NULL
    output = <PyObject*>outputs[j]
    if type(<object>output) is not _output_type:
        return NULL
    req_id = _slot(output, REQUEST_ID)
    if req_id == NULL or type(<object>req_id) is not str:
        return NULL
    state = dict_get_hint(<PyObject*>request_states, req_id)
    if state == NULL:
        PyErr_Clear()
    return state


cdef void _follow(list outputs, object output, object request_states) noexcept:
    """Advance the prefetch of request states as vLLM's loop over
    ``outputs`` comes to ``output``: each state (its object, its dict, the
    dict's keys table) is pulled into the caches ``3 * PREFETCH_DISTANCE``
    outputs before its turn, while the turns between run.  Only hints: a
    loop this cannot follow (another list, an output out of order) is simply
    not prefetched (its states in flight are let go as the next loop runs),
    and after the list's last output no state is held."""
    global _followed, _next
    cdef Py_ssize_t i = _next
    cdef Py_ssize_t n = len(outputs)
    cdef Py_ssize_t k
    if not (<PyObject*>outputs == _followed and i < n and outputs[i] is output):
        if n == 0 or outputs[0] is not output:
            return
        i = 0
        _followed = <PyObject*>outputs
        for k in range(-3 * PREFETCH_DISTANCE, 0):
            _prefetch.advance(k, _state_at(outputs, k + 3 * PREFETCH_DISTANCE, request_states))
    _prefetch.advance(i, _state_at(outputs, i + 3 * PREFETCH_DISTANCE, request_states))
    _next = i + 1


@cython.wraparound(True)
cdef object _last(object sequence):
    """``sequence[-1]``, as Python indexes."""
    return sequence[-1]


def process_output(object processor, object output, object engine_core_timestamp,
                   object iteration_stats, object weight_version, object request_outputs,
                   object reqs_to_abort, object outputs=None):
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
    global _calls, _handled, _finished
    if not _bound:
        raise RuntimeError("fastbatch's process_output is not bound to vLLM's classes "
                           "(fastbatch.patches.process_outputs.bind() does it)")
    _calls += 1
    if (type(output) is not _output_type or type(processor) is not _processor_type
            or type(request_outputs) is not list or type(reqs_to_abort) is not list):
        return False
    request_states = processor.request_states
    req_id = _field(output, REQUEST_ID)
    if type(request_states) is not dict or type(req_id) is not str:
        return False
    if type(outputs) is list:
        _follow(<list>outputs, output, request_states)
    req_state = (<dict>request_states).get(req_id)
    if type(req_state) is not _state_type:
        return False
    detokenizer = req_state.detokenizer
    logprobs_processor = req_state.logprobs_processor
    if (_field(output, ERROR) is not None or req_state.is_prefilling
            or _field(output, ROUTED_EXPERTS) is not None
            or _field(output, POOLING_OUTPUT) is not None
            or not _taken_detokenizer(detokenizer)
            or type(logprobs_processor) is not _logprobs_type or req_state.streaming_input):
        return False
    _handled += 1
    if iteration_stats is not None:
        processor._update_stats_from_output(req_state, output, engine_core_timestamp,
                                            iteration_stats)
    new_token_ids = _field(output, NEW_TOKEN_IDS)
    finish_reason = _field(output, FINISH_REASON)
    stop_reason = _field(output, STOP_REASON)
    kv_transfer_params = _field(output, KV_TRANSFER_PARAMS)
    ec_transfer_params = _field(output, EC_TRANSFER_PARAMS)
    spec_decode_metrics = _field(output, SPEC_DECODE_METRICS)
    if spec_decode_metrics is not None:
        req_state.spec_decode_metrics = spec_decode_metrics
    # num_output_tokens(), before the update (track_weight_version's too)
    num_prev_tokens = len(detokenizer.token_ids)
    if new_token_ids and weight_version is not None:
        starts = req_state.weight_version_starts
        if not starts or _last_start(starts)[0] != weight_version:
            starts.append((weight_version, num_prev_tokens))
    # None == FinishReason.STOP is False (neither side knows the other)
    stop_string = detokenizer.update(
        new_token_ids, False if finish_reason is None else finish_reason == _stop)
    if stop_string:
        finish_reason = _stop
        stop_reason = stop_string
        processor._trim_surplus_tokens(req_state, output, num_prev_tokens)
    new_sampling_mask = _field(output, NEW_SAMPLING_MASK)
    if new_sampling_mask is not None:
        req_state.sampling_mask_chunks.append(new_sampling_mask)
    new_logprobs = _field(output, NEW_LOGPROBS)
    if new_logprobs is not None:
        logprobs_processor._update_sample_logprobs(new_logprobs)
    new_prompt_logprobs_tensors = _field(output, NEW_PROMPT_LOGPROBS_TENSORS)
    if new_prompt_logprobs_tensors is not None:
        logprobs_processor._update_prompt_logprobs(new_prompt_logprobs_tensors)
    prompt_token_id_logprobs = _field(output, PROMPT_TOKEN_ID_LOGPROBS)
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
