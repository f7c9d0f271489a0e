"""Pure-Python twin of the compiled piece ``draft_token_ids``: the test oracle.

Same signature, rules, errors and counters as
``fastbatch._kernels.draft_token_ids``; written for reading, not for speed.
"""

from __future__ import annotations

__all__ = ["draft_token_lists"]

import operator
from typing import Any

from fastbatch._reference._common import Counters, checked_ids

_counters = Counters(("calls", "rows"))
stats, reset_stats = _counters.stats, _counters.reset_stats
_stats = _counters.values


def draft_token_lists(draft_token_ids: Any, num_reqs: int,
                      num_spec_tokens: int) -> list[list[int]]:
    """vLLM's ``draft_token_ids_cpu[:num_reqs, :num_spec_tokens].tolist()``
    (``GPUModelRunner._get_draft_token_ids_cpu``), the counts ints >= 0.
    """
    num_reqs, num_spec_tokens = operator.index(num_reqs), operator.index(num_spec_tokens)
    if num_reqs < 0 or num_spec_tokens < 0:
        raise ValueError(f"num_reqs and num_spec_tokens must be >= 0, got "
                         f"{num_reqs} and {num_spec_tokens}")
    _, _, read_rows = checked_ids(draft_token_ids, "draft_token_ids")
    rows = [row[:num_spec_tokens] for row in read_rows()[:num_reqs]]
    _stats["calls"] += 1
    _stats["rows"] += len(rows)
    return rows
