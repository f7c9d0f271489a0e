"""Pure-Python twin of the compiled piece ``async_spec_token_ids``: the test oracle.

Same signature, rules, errors and counters as
``fastbatch._kernels.async_spec_token_ids``; written for reading, not for speed.
"""

from __future__ import annotations

__all__ = ["update_async_spec_token_ids"]

from fastbatch._reference._common import Counters, as_row, check_types

_counters = Counters(("calls", "requests_updated"))
stats, reset_stats = _counters.stats, _counters.reset_stats
_stats = _counters.values


def update_async_spec_token_ids(
    req_ids: list[str | None],
    prev_req_id_to_index: dict[str, int],
    spec_token_ids: list[list[int] | None],
    draft_token_ids: list[list[int] | None],
) -> int:
    """vLLM's ``InputBatch.update_async_spec_token_ids`` loop, after its early
    returns (vLLM 0.21.0 to 0.33.0).

    For each request in order (``zip`` of ``req_ids`` and ``spec_token_ids``)
    whose spec list is non-empty and whose id maps to a non-empty draft row:
    ``del draft[len(spec):]`` and ``spec[:] = draft``.  Contract, checked
    before any list changes: the three containers are lists and the dict a
    dict; examined spec entries and draft rows are lists or ``None`` (skipped);
    ``prev_index`` is an int in ``range(len(draft_token_ids))``.  Returns the
    number of requests updated.
    """
    check_types(req_ids=(req_ids, list), prev_req_id_to_index=(prev_req_id_to_index, dict),
                 spec_token_ids=(spec_token_ids, list), draft_token_ids=(draft_token_ids, list))
    _stats["calls"] += 1

    # Pass 1: plan.  An empty list is never made non-empty by the loop (it
    # only shortens lists), so skipping empties here is exact.
    plans = []  # (spec list, draft list)
    for index, (req_id, spec_ids) in enumerate(zip(req_ids, spec_token_ids, strict=False)):
        if spec_ids is None:
            continue
        if not isinstance(spec_ids, list):
            raise TypeError(f"spec_token_ids[{index}] must be a list or None, "
                            f"got {type(spec_ids).__name__}")
        if not spec_ids:
            continue
        prev_index = prev_req_id_to_index.get(req_id)
        if prev_index is None:
            continue
        row = as_row(req_id, prev_index)
        if row >= len(draft_token_ids):
            raise IndexError(f"prev_req_id_to_index[{req_id!r}] = {row} is out of "
                             f"range for {len(draft_token_ids)} draft rows")
        draft_ids = draft_token_ids[row]
        if draft_ids is None:
            continue
        if not isinstance(draft_ids, list):
            raise TypeError(f"draft_token_ids[{row}] must be a list or None, "
                            f"got {type(draft_ids).__name__}")
        if draft_ids:
            plans.append((spec_ids, draft_ids))

    # Pass 2: vLLM's loop body, in order (lists may be shared between requests).
    updated = 0
    for spec_ids, draft_ids in plans:
        if spec_ids and draft_ids:
            del draft_ids[len(spec_ids):]
            spec_ids.clear()
            spec_ids.extend(draft_ids)
            updated += 1
    _stats["requests_updated"] += updated
    return updated
