"""Pure-Python twin of the compiled piece ``prepare_input_ids``: the test oracle.

Same signature, rules, errors and counters as
``fastbatch._kernels.prepare_input_ids``; written for reading, not for speed.
"""

from __future__ import annotations

__all__ = ["prepare_input_ids_indices"]

import operator
from typing import Any

from fastbatch._reference._common import Counters, check_types, int_column

_counters = Counters(("calls", "common_requests",
                      "spec_tokens"))
stats, reset_stats = _counters.stats, _counters.reset_stats
_stats = _counters.values

INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


def _as_int64(value: object, name: str) -> int:
    try:
        result = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if not INT64_MIN <= result <= INT64_MAX:
        raise OverflowError(f"{name} = {value} does not fit in int64")
    return result


def prepare_input_ids_indices(
    req_ids: list[str | None],
    prev_positions: Any,
    cu_num_tokens: Any,
    scheduled_spec_tokens: dict[str, list[int]],
    prev_num_spec_tokens: int,
    num_reqs: int,
) -> tuple[Any, Any, bool, int]:
    """vLLM's ``GPUModelRunner._prepare_input_ids`` loop (0.31.0 to 0.33.0),
    its lists returned as two new (2, n) int64 numpy arrays:
    ``(common, spec, common_indices_match, max_flattened_index)`` with
    ``common = [sample_flattened_indices, prev_indices]`` and
    ``spec = [spec_flattened_indices, prev_draft_token_indices]``.
    """
    import numpy

    check_types(req_ids=(req_ids, list),
                scheduled_spec_tokens=(scheduled_spec_tokens, dict))
    spec_tokens = _as_int64(prev_num_spec_tokens, "prev_num_spec_tokens")
    num_reqs = operator.index(num_reqs)
    if num_reqs < 0:
        raise ValueError(f"num_reqs must be >= 0, got {num_reqs}")
    positions = int_column(prev_positions, "prev_positions", writable=False,
                           int32_too=False)
    cu = int_column(cu_num_tokens, "cu_num_tokens", writable=False, int32_too=True)

    # vLLM's loop, word for word where it can be.
    sample_flattened_indices: list[int] = []
    spec_flattened_indices: list[int] = []
    prev_draft_token_indices: list[int] = []
    prev_indices: list[int] = []
    common_indices_match = True
    max_flattened_index = -1
    for cur_index in range(num_reqs):
        if cur_index >= len(positions):
            raise IndexError(f"prev_positions has {len(positions)} entries for "
                             f"{num_reqs} requests")
        prev_index = positions[cur_index]
        if prev_index < 0:
            continue
        if cur_index >= len(req_ids):
            raise IndexError(f"req_ids has {len(req_ids)} entries, request "
                             f"{cur_index} has a previous row")
        req_id = req_ids[cur_index]
        draft_len = len(scheduled_spec_tokens.get(req_id, ()))
        if cur_index >= len(cu):
            raise IndexError(f"cu_num_tokens has {len(cu)} entries, request "
                             f"{cur_index} has a previous row")
        flattened_index = cu[cur_index] - 1
        start = prev_index * spec_tokens
        if not all(INT64_MIN <= value <= INT64_MAX for value in (
                flattened_index, flattened_index - draft_len, start, start + draft_len)):
            raise OverflowError(f"the input ids indices of request {cur_index} do not "
                                "fit in int64")
        prev_indices.append(prev_index)
        sample_flattened_indices.append(flattened_index - draft_len)
        spec_flattened_indices.extend(
            range(flattened_index - draft_len + 1, flattened_index + 1))
        prev_draft_token_indices.extend(range(start, start + draft_len))
        common_indices_match &= prev_index == flattened_index
        max_flattened_index = max(max_flattened_index, flattened_index)

    common = numpy.array([sample_flattened_indices, prev_indices],
                         dtype=numpy.int64).reshape(2, len(prev_indices))
    spec = numpy.array([spec_flattened_indices, prev_draft_token_indices],
                       dtype=numpy.int64).reshape(2, len(spec_flattened_indices))
    _stats["calls"] += 1
    _stats["common_requests"] += len(prev_indices)
    _stats["spec_tokens"] += len(spec_flattened_indices)
    return common, spec, bool(common_indices_match), max_flattened_index
