"""Pure-Python twin of the compiled piece ``detokenizer_update``: the test oracle.

Same signature, rules, errors and counters as
``fastbatch._kernels.detokenizer_update``; written for reading, not for speed.
"""

from __future__ import annotations

__all__ = ["update_detokenizer"]

from bisect import bisect_left
from collections.abc import Callable
from typing import Any

from fastbatch._reference._common import Counters

_counters = Counters(("calls", "tokens", "stops"))
stats, reset_stats = _counters.stats, _counters.reset_stats
_stats = _counters.values


def _attribute(attrs: dict[str, Any], name: str, detokenizer: Any) -> Any:
    try:
        return attrs[name]
    except KeyError:
        raise AttributeError(f"{type(detokenizer).__name__} object has no attribute "
                             f"{name!r}") from None


def update_detokenizer(detokenizer: Any, new_token_ids: list[int], stop_terminated: bool,
                       check_stop_strings: Callable[..., tuple[str, int] | None]
                       ) -> str | None:
    """vLLM's ``BaseIncrementalDetokenizer.update`` (0.30.0 to 0.33.0) for a
    ``FastIncrementalDetokenizer``, its attributes read through the instance
    dict before anything is written; each token's text appended to the text
    while the instance dict does not hold it, so that CPython grows the
    string in place when nothing else holds it either."""
    if not isinstance(new_token_ids, list):
        raise TypeError(f"new_token_ids must be a list, got {type(new_token_ids).__name__}")
    attrs = getattr(detokenizer, "__dict__", None)
    if type(attrs) is not dict:
        raise TypeError(f"detokenizer must have an instance dict, got "
                        f"{type(detokenizer).__name__}")
    token_ids = _attribute(attrs, "token_ids", detokenizer)
    output_text = _attribute(attrs, "output_text", detokenizer)
    stop = _attribute(attrs, "stop", detokenizer)
    stopping, terminated = bool(stop), bool(stop_terminated)
    # read where vLLM reads them (but before anything is written)
    include_stop = min_tokens = None
    if terminated or stopping:
        include_stop = _attribute(attrs, "include_stop_str_in_output", detokenizer)
    if stopping:
        min_tokens = _attribute(attrs, "min_tokens", detokenizer)
    _stats["calls"] += 1
    count = len(new_token_ids)
    if count == 0:
        return None
    skipped = None
    if terminated and not include_stop:
        skipped = new_token_ids[count - 1]
        count -= 1
    num_prev_tokens = len(token_ids)
    token_offsets = [len(output_text)] if stopping else None
    for index in range(count):
        if index >= len(new_token_ids):  # only if decode_next shortened the list
            break
        token_id = new_token_ids[index]
        token_ids.append(token_id)
        piece = detokenizer.decode_next(token_id)
        attrs["output_text"] = None  # so that the text can grow in place
        try:
            output_text += piece
        finally:
            attrs["output_text"] = output_text
        if token_offsets is not None:
            token_offsets.append(len(output_text))
        _stats["tokens"] += 1
    if skipped is not None:
        token_ids.append(skipped)
        if token_offsets is not None:
            token_offsets.append(len(output_text))
    if token_offsets is None or not len(token_ids) > min_tokens:
        return None
    stop_check_offset = token_offsets[max(min_tokens - num_prev_tokens, 0)]
    found = check_stop_strings(output_text=output_text,
                               new_char_count=len(output_text) - stop_check_offset,
                               stop=stop, include_in_output=include_stop)
    if found is None:
        return None
    stop_string, truncate_to = found
    stop_end = len(output_text) if truncate_to == -1 else truncate_to
    if not include_stop:
        stop_end += len(stop_string)
    num_kept = bisect_left(token_offsets, stop_end, lo=1)
    del token_ids[num_prev_tokens + num_kept:]
    if truncate_to != -1:
        attrs["output_text"] = output_text[:truncate_to]
    _stats["stops"] += 1
    return stop_string
