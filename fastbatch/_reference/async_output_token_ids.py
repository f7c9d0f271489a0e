"""Pure-Python twin of the compiled piece ``async_output_token_ids``: the test oracle.

Same signature, rules, errors and counters as
``fastbatch._kernels.async_output_token_ids``; written for reading, not for
speed.  ``update_async_output_token_ids`` has the semantics of vLLM 0.33.0's
``InputBatch.update_async_output_token_ids`` (0.22.0 and later behave the
same), with the input contract tightened so that bad input raises before any
list is changed:

* ``req_ids`` and ``output_token_ids`` are lists of the same length;
  ``prev_req_id_to_index`` is a dict.  A request whose id is not in the dict,
  or whose output entry is ``None`` (a hole left by ``remove_request``), is
  skipped, as vLLM does.
* Each examined output entry is a list; the items the placeholder scan reads
  (the last one, the trailing run of -1 and the item before it) are ints.
* ``prev_index`` is an int in ``range(len(sampled_token_ids))`` (vLLM would
  wrap a negative one around; that is never what the caller meant).
* ``sampled_token_ids`` is a 2-D int32 or int64 array or CPU tensor; it is
  only looked at, and ``copy_ready`` only synchronised (once), when some
  request has a placeholder to fill.
"""

from __future__ import annotations

__all__ = ["update_async_output_token_ids"]

from collections.abc import Callable
from typing import Any

from fastbatch._reference._common import Counters, as_row, check_types, checked_ids

_counters = Counters(("calls", "syncs", "requests_updated", "tokens_written",
                      "placeholders_dropped"))
stats, reset_stats = _counters.stats, _counters.reset_stats
_stats = _counters.values


def _is_placeholder(item: object, request: int, position: int) -> bool:
    if not isinstance(item, int):
        raise TypeError(f"output_token_ids[{request}][{position}] must be an "
                        f"int, got {type(item).__name__}")
    return item == -1


def _resolve_sync(copy_ready: Any) -> Callable[[], object] | None:
    if copy_ready is None:
        return None
    synchronize = getattr(copy_ready, "synchronize", None)
    if synchronize is not None:
        return synchronize
    if callable(copy_ready):
        return copy_ready
    raise TypeError("copy_ready must be None, an event with .synchronize() or "
                    f"a callable, got {type(copy_ready).__name__}")


def update_async_output_token_ids(
    req_ids: list[str | None],
    prev_req_id_to_index: dict[str, int],
    output_token_ids: list[list[int] | None],
    sampled_token_ids: Any,
    copy_ready: Any = None,
) -> int:
    """Replace every request's trailing ``-1`` placeholders with its sampled ids.

    The batch-wide equivalent of vLLM's
    ``InputBatch.update_async_output_token_ids`` (vLLM 0.22.0 to 0.33.0).
    Returns the number of requests whose output list was updated.
    """
    check_types(req_ids=(req_ids, list), prev_req_id_to_index=(prev_req_id_to_index, dict),
                 output_token_ids=(output_token_ids, list))
    if len(output_token_ids) != len(req_ids):
        raise IndexError(f"output_token_ids has {len(output_token_ids)} entries "
                         f"but req_ids has {len(req_ids)}")
    synchronize = _resolve_sync(copy_ready)
    _stats["calls"] += 1

    # Pass 1: plan. Nothing is changed and no sampled value is read.
    plans = []  # (index, row, first_placeholder)
    for index, req_id in enumerate(req_ids):
        prev_index = prev_req_id_to_index.get(req_id)
        token_ids = output_token_ids[index]
        if prev_index is None or token_ids is None:
            continue
        if not isinstance(token_ids, list):
            raise TypeError(f"output_token_ids[{index}] must be a list of ints "
                            f"or None, got {type(token_ids).__name__}")
        size = len(token_ids)
        if not size or not _is_placeholder(token_ids[-1], index, size - 1):
            continue
        first_placeholder = size - 1
        while first_placeholder > 0 and _is_placeholder(
                token_ids[first_placeholder - 1], index, first_placeholder - 1):
            first_placeholder -= 1
        plans.append((index, as_row(req_id, prev_index), first_placeholder))
    if not plans:
        return 0

    num_rows, _, read_rows = checked_ids(sampled_token_ids, "sampled_token_ids")
    for index, row, _ in plans:
        if row >= num_rows:
            raise IndexError(f"prev_req_id_to_index[{req_ids[index]!r}] = {row} "
                             f"is out of range for {num_rows} sampled rows")
    if synchronize is not None:
        synchronize()
        _stats["syncs"] += 1
    rows = read_rows()  # only now: the copy may have been in flight until here

    # Pass 2: apply, as vLLM's loop body does.  ``del new_ids[...]`` truncates
    # the row for any later request that maps to the same row, as in vLLM.
    updated = 0
    for index, row, first_placeholder in plans:
        new_ids = rows[row]
        if not new_ids:
            continue
        num_sampled = len(new_ids) if new_ids[-1] != -1 else new_ids.index(-1)
        token_ids = output_token_ids[index]
        num_placeholders = len(token_ids) - first_placeholder
        num_to_write = min(num_sampled, num_placeholders)
        del new_ids[num_to_write:]
        token_ids[first_placeholder:] = new_ids
        updated += 1
        _stats["requests_updated"] += 1
        _stats["tokens_written"] += num_to_write
        _stats["placeholders_dropped"] += num_placeholders - num_to_write
    return updated
