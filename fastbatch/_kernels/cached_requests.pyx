# Compiler directives are set in setup.py (one place, with a debug switch).
"""Compiled piece ``cached_requests``: the loop of vLLM's
``Scheduler._make_cached_request_data`` (outside pipeline parallelism; on
vLLM 0.34.0 called with no resumed requests and no token ids to send).

The same lists, set and dict, in the same order, with the same errors and
counter, as ``fastbatch._reference.cached_requests`` (see its module note);
it only builds new objects.
"""

__all__ = ["cached_request_lists"]

from libc.stdint cimport uint64_t

from fastbatch._kernels._common cimport RequestPrefetch

cdef uint64_t _requests = 0


def stats():
    """This piece's counters since import or the last ``reset_stats()``."""
    return {"requests": _requests}


def reset_stats():
    """Set every counter of ``stats()`` back to zero."""
    global _requests
    _requests = 0


cdef object _block_ids(object new_blocks, object blocks_type):
    """``new_blocks.get_block_ids(allow_none=True)``."""
    cdef Py_ssize_t index, count
    if type(new_blocks) is blocks_type:
        groups = new_blocks.blocks
        if type(groups) is tuple:
            count = len(<tuple>groups)
            for index in range(count):
                if len((<tuple>groups)[index]) != 0:
                    break
            else:
                return None
            result = []
            for group in <tuple>groups:
                result.append([block.block_id for block in group])
            return tuple(result)
    return new_blocks.get_block_ids(allow_none=True)


cdef object _token_ids_copy(object request, object constant_list_type):
    """``request.all_token_ids.copy()``."""
    token_ids = request.all_token_ids
    if type(token_ids) is constant_list_type:
        items = token_ids._x
        if type(items) is list:
            return (<list>items)[:]
    return token_ids.copy()


def cached_request_lists(list running_reqs, list resumed_reqs, dict req_to_new_blocks,
                         prev_step_scheduled_req_ids, tuple kinds):
    """``(req_ids, resumed_req_ids, all_token_ids, new_block_ids,
    num_computed_tokens, num_output_tokens)`` of vLLM's ``CachedRequestData``
    (``new_token_ids`` is an empty list outside pipeline parallelism).

    ``kinds`` is ``(Request, KVCacheBlocks, ConstantList)`` of the vLLM in use.
    """
    global _requests
    if prev_step_scheduled_req_ids is not None and not isinstance(
            prev_step_scheduled_req_ids, set):
        raise TypeError("prev_step_scheduled_req_ids must be a set, "
                        f"got {type(prev_step_scheduled_req_ids).__name__}")
    if len(kinds) != 3:
        raise ValueError(f"kinds must have 3 items, got {len(kinds)}")
    request_type, blocks_type, constant_list_type = kinds
    cdef bint send_token_ids = prev_step_scheduled_req_ids is not None
    cdef list req_ids = []
    cdef set resumed_req_ids = set()
    cdef dict all_token_ids = {}
    cdef list new_block_ids = []
    cdef list num_computed_tokens = []
    cdef list num_output_tokens = []
    cdef Py_ssize_t num_running = len(running_reqs)
    cdef Py_ssize_t index = 0
    cdef list requests = running_reqs + resumed_reqs
    # The requests ahead of the loop, prefetched (RequestPrefetch).
    cdef RequestPrefetch prefetch = RequestPrefetch(request_type)
    prefetch.start_in_list(requests, 0)
    for request in requests:
        prefetch.advance_in_list(requests, index)
        req_id = request.request_id
        req_ids.append(req_id)
        if index >= num_running:
            resumed_req_ids.add(req_id)
        if send_token_ids and req_id not in prev_step_scheduled_req_ids:
            all_token_ids[req_id] = _token_ids_copy(request, constant_list_type)
        new_block_ids.append(_block_ids(req_to_new_blocks[req_id], blocks_type))
        num_computed_tokens.append(request.num_computed_tokens)
        if type(request) is request_type:
            num_output = len(request._output_token_ids)
        else:
            num_output = request.num_output_tokens
        num_output_tokens.append(num_output + request.num_output_placeholders)
        index += 1
    _requests += index
    return (req_ids, resumed_req_ids, all_token_ids, new_block_ids, num_computed_tokens,
            num_output_tokens)
