"""Pure-Python twin of the compiled piece ``get_output``: the test oracle.

Same signature, rules, errors and counters as
``fastbatch._kernels.get_output``; written for reading, not for speed.
"""

from __future__ import annotations

__all__ = ["sampled_token_lists"]

from collections.abc import Iterable
from typing import Any, SupportsIndex

from fastbatch._reference._common import Counters, checked_ids, flagged_rows

_counters = Counters(("calls", "rows"))
stats, reset_stats = _counters.stats, _counters.reset_stats
_stats = _counters.values


def sampled_token_lists(sampled_token_ids: Any,
                        invalid_req_indices: Iterable[SupportsIndex] = ()) -> list[list[int]]:
    """vLLM's ``sampled_token_ids_cpu.tolist()`` followed by
    ``valid_sampled_token_ids[i].clear()`` for each ``i`` in
    ``invalid_req_indices`` (``AsyncGPUModelRunnerOutput.get_output``, one id
    per request); indices checked before the lists are built.
    """
    num_rows, _, read_rows = checked_ids(sampled_token_ids, "sampled_token_ids")
    cleared = flagged_rows(invalid_req_indices, num_rows, "invalid_req_indices", False)
    rows = read_rows()
    for row in cleared:
        rows[row].clear()
    _stats["calls"] += 1
    _stats["rows"] += num_rows
    return rows
