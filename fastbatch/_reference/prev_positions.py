"""Pure-Python twin of the compiled piece ``prev_positions``: the test oracle.

Same signature, rules, errors and counters as
``fastbatch._kernels.prev_positions``; written for reading, not for speed.
"""

from __future__ import annotations

__all__ = ["compute_prev_positions"]

import operator
from typing import Any

from fastbatch._reference._common import Counters, check_types, int_column

_counters = Counters(("calls", "found"))
stats, reset_stats = _counters.stats, _counters.reset_stats
_stats = _counters.values


def _as_position(req_id: object, value: object) -> int:
    try:
        position = operator.index(value)
    except TypeError:
        raise TypeError(f"prev_req_id_to_index[{req_id!r}] must be an int, "
                        f"got {type(value).__name__}") from None
    if not -2**63 <= position < 2**63:
        raise OverflowError(f"prev_req_id_to_index[{req_id!r}] = {value} "
                            "does not fit in int64")
    return position


def compute_prev_positions(req_ids: list[str | None], prev_req_id_to_index: dict[str, int],
                           prev_positions: Any, num_reqs: int) -> int:
    """vLLM's ``GPUModelRunner._compute_prev_positions`` loop (0.21.0 to 0.33.0):
    ``prev_positions[i] = prev_req_id_to_index.get(req_id, -1)`` for each
    ``i, req_id`` of ``enumerate(req_ids[:num_reqs])``, written only once
    every request is valid.  Returns the number of requests found in the map.
    """
    check_types(req_ids=(req_ids, list), prev_req_id_to_index=(prev_req_id_to_index, dict))
    num_reqs = operator.index(num_reqs)
    if num_reqs < 0:
        raise ValueError(f"num_reqs must be >= 0, got {num_reqs}")
    column = int_column(prev_positions, "prev_positions", writable=True, int32_too=False)
    count = min(num_reqs, len(req_ids))
    if count > len(column):
        raise IndexError(f"prev_positions has {len(column)} slots for {count} requests")
    _stats["calls"] += 1
    missing = object()
    values, found = [], 0
    for req_id in req_ids[:count]:
        value = prev_req_id_to_index.get(req_id, missing)
        if value is missing:
            values.append(-1)
        else:
            values.append(_as_position(req_id, value))
            found += 1
    for index, value in enumerate(values):  # every request is valid: now write
        column[index] = value
    _stats["found"] += found
    return found
