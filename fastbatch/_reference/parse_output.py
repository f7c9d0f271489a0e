"""Pure-Python twin of the compiled piece ``parse_output``: the test oracle.

Same signature, rules, errors and counters as
``fastbatch._kernels.parse_output``; written for reading, not for
speed.
"""

from __future__ import annotations

__all__ = ["rejection_output_lists"]

import operator
from typing import Any, SupportsIndex

from fastbatch._reference._common import Counters, checked_ids, flagged_rows

_counters = Counters(("calls", "rows", "tokens"))
stats, reset_stats = _counters.stats, _counters.reset_stats
_stats = _counters.values

PLACEHOLDER_TOKEN_ID = -1  # vLLM's rejection_sampler.PLACEHOLDER_TOKEN_ID


def rejection_output_lists(output_token_ids: Any, vocab_size: SupportsIndex,
                           discard_req_indices: Any = ()) -> list[list[int]]:
    """The token lists of vLLM's ``RejectionSampler.parse_output``: per row,
    the ids that are not -1 and are below ``vocab_size``, in order; the rows
    ``discard_req_indices`` (read as numpy's fancy indexing reads a list of
    ints or a 1-D integer array) empty.
    """
    try:
        bound = operator.index(vocab_size)
    except TypeError:
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}") from None
    num_rows, _, read_rows = checked_ids(output_token_ids, "output_token_ids")
    discarded = flagged_rows(discard_req_indices, num_rows, "discard_req_indices", True)
    rows = [[] if row in discarded else
            [token for token in ids if token != PLACEHOLDER_TOKEN_ID and token < bound]
            for row, ids in enumerate(read_rows())]
    _stats["calls"] += 1
    _stats["rows"] += num_rows
    _stats["tokens"] += sum(map(len, rows))
    return rows
