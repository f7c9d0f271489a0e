"""Pure-Python twin of the compiled piece ``cached_requests``
(``fastbatch._kernels.cached_requests``).

``cached_request_lists`` builds the fields of vLLM's ``CachedRequestData`` as
``Scheduler._make_cached_request_data`` does outside its pipeline-parallel
branch (there ``new_token_ids`` gets a slice per request; the patch runs
vLLM's method for that case): for the running requests, then the resumed
ones, in that order.  vLLM 0.34.0's method is this loop with no resumed
requests and no token ids sent (``resumed_reqs`` empty,
``prev_step_scheduled_req_ids`` None; its ``CachedRequestData`` has no
``resumed_req_ids`` or ``all_token_ids``, and the patch drops them):

- ``req_ids``: each ``request.request_id``; the resumed ones also in
  ``resumed_req_ids``;
- ``all_token_ids[req_id] = request.all_token_ids.copy()`` for each request
  not scheduled in the previous step (``prev_step_scheduled_req_ids``; None
  under Model Runner V2, which vLLM does not send these to);
- ``new_block_ids``: ``req_to_new_blocks[req_id].get_block_ids(allow_none=True)``;
- ``num_computed_tokens``: each ``request.num_computed_tokens`` (the object);
- ``num_output_tokens``: ``request.num_output_tokens +
  request.num_output_placeholders``.

A plain ``Request`` (exact type) has its ``num_output_tokens`` read as
``len(request._output_token_ids)``, as the property does; a plain
``KVCacheBlocks`` (exact type, a tuple of groups) has its block ids read as
``get_block_ids`` reads them; ``ConstantList.copy`` is ``_x.copy()`` of a
list (a ``ConstantList`` of anything else, 0.34.0's ``TokenBuffer`` say, is
copied by its own ``copy()``, which gives a list there).  Any other object
goes through its own property or method.  Both bodies are
pinned by the patch's guard.  Nothing is changed, so an error (vLLM's
``KeyError`` for a request without blocks, say) leaves no trace.
"""

from __future__ import annotations

__all__ = ["cached_request_lists"]

from typing import Any

from fastbatch._reference._common import Counters, check_types

_COUNTERS = Counters(("requests",))
stats, reset_stats = _COUNTERS.stats, _COUNTERS.reset_stats


def _block_ids(new_blocks: Any, blocks_type: type) -> Any:
    """``new_blocks.get_block_ids(allow_none=True)``."""
    if type(new_blocks) is blocks_type:
        groups = new_blocks.blocks
        if type(groups) is tuple:
            if all(len(group) == 0 for group in groups):
                return None
            return tuple([block.block_id for block in group] for group in groups)
    return new_blocks.get_block_ids(allow_none=True)


def _token_ids_copy(request: Any, constant_list_type: type) -> Any:
    """``request.all_token_ids.copy()``."""
    token_ids = request.all_token_ids
    if type(token_ids) is constant_list_type and type(token_ids._x) is list:
        return token_ids._x.copy()
    return token_ids.copy()


def cached_request_lists(running_reqs: list[Any], resumed_reqs: list[Any],
                         req_to_new_blocks: dict[str, Any],
                         prev_step_scheduled_req_ids: set[str] | None,
                         kinds: tuple[type, type, type]) -> tuple[Any, ...]:
    """``(req_ids, resumed_req_ids, all_token_ids, new_block_ids,
    num_computed_tokens, num_output_tokens)`` of vLLM's ``CachedRequestData``
    (``new_token_ids`` is an empty list outside pipeline parallelism).

    ``kinds`` is ``(Request, KVCacheBlocks, ConstantList)`` of the vLLM in use.
    """
    check_types(running_reqs=(running_reqs, list), resumed_reqs=(resumed_reqs, list),
                req_to_new_blocks=(req_to_new_blocks, dict), kinds=(kinds, tuple))
    if prev_step_scheduled_req_ids is not None:
        check_types(prev_step_scheduled_req_ids=(prev_step_scheduled_req_ids, set))
    if len(kinds) != 3:
        raise ValueError(f"kinds must have 3 items, got {len(kinds)}")
    request_type, blocks_type, constant_list_type = kinds
    req_ids: list[str] = []
    resumed_req_ids: set[str] = set()
    all_token_ids: dict[str, list[int]] = {}
    new_block_ids: list[Any] = []
    num_computed_tokens: list[int] = []
    num_output_tokens: list[int] = []
    num_running = len(running_reqs)
    for index, request in enumerate(running_reqs + resumed_reqs):
        req_id = request.request_id
        req_ids.append(req_id)
        if index >= num_running:
            resumed_req_ids.add(req_id)
        if (prev_step_scheduled_req_ids is not None
                and req_id not in prev_step_scheduled_req_ids):
            all_token_ids[req_id] = _token_ids_copy(request, constant_list_type)
        new_block_ids.append(_block_ids(req_to_new_blocks[req_id], blocks_type))
        num_computed_tokens.append(request.num_computed_tokens)
        num_output = (len(request._output_token_ids) if type(request) is request_type
                      else request.num_output_tokens)
        num_output_tokens.append(num_output + request.num_output_placeholders)
    _COUNTERS.values["requests"] += len(req_ids)
    return (req_ids, resumed_req_ids, all_token_ids, new_block_ids, num_computed_tokens,
            num_output_tokens)
