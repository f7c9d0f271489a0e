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


# Set by bind(): vLLM's own method, the detokenizer type taken, and the
# namespace vLLM's check_stop_strings is read from.
_BOUND: tuple[Callable[..., str | None], type, dict[str, Any]] | None = None


def bind(stock: Callable[..., str | None], taken: type, namespace: dict[str, Any]) -> None:
    """Make ``update`` answer for this vLLM: ``stock`` is vLLM's own
    ``BaseIncrementalDetokenizer.update`` (it answers every call
    ``update_detokenizer`` does not take), ``taken`` the detokenizer type
    ``update_detokenizer`` takes, ``namespace`` the globals of vLLM's module,
    from which ``check_stop_strings`` is read at every call."""
    global _BOUND
    if not callable(stock):
        raise TypeError(f"stock must be callable, got {type(stock).__name__}")
    if not isinstance(taken, type):
        raise TypeError(f"taken must be a type, got {type(taken).__name__}")
    if type(namespace) is not dict:
        raise TypeError(f"namespace must be a dict, got {type(namespace).__name__}")
    _BOUND = (stock, taken, namespace)


def update(self: Any, new_token_ids: list[int], stop_terminated: bool) -> str | None:
    """fastbatch's ``BaseIncrementalDetokenizer.update`` (vLLM's signature):
    ``update_detokenizer`` with vLLM's ``check_stop_strings`` for a
    detokenizer of exactly the type taken and ids in a list; vLLM's method
    (``bind``) with the same arguments for every other call."""
    if _BOUND is None:
        raise RuntimeError("fastbatch's detokenizer update is not bound to vLLM's method "
                           "(fastbatch.patches.detokenizer_update.bind() does it)")
    stock, taken, namespace = _BOUND
    if type(self) is taken and type(new_token_ids) is list:
        return update_detokenizer(self, new_token_ids, stop_terminated,
                                  namespace["check_stop_strings"])
    return stock(self, new_token_ids, stop_terminated)


def update_detokenizer(detokenizer: Any, new_token_ids: list[int], stop_terminated: bool,
                       check_stop_strings: Callable[..., tuple[str, int] | None]
                       ) -> str | None:
    """vLLM's ``BaseIncrementalDetokenizer.update(new_token_ids,
    stop_terminated)`` (vLLM 0.32.0 on) for a ``FastIncrementalDetokenizer``
    (whose ``num_output_tokens()`` is ``len(token_ids)``): each new token
    appended to ``token_ids`` and its text, ``detokenizer.decode_next(token_id)``
    (vLLM's own), to ``output_text``, while the detokenizer does not hold the
    text, so that CPython grows the string in place when nothing else holds it
    either; the last one not decoded when ``stop_terminated`` and the stop
    string is not kept; then, with stop strings, vLLM's ``check_stop_strings``
    (passed in) from the first token past ``min_tokens``, and the tokens after
    the match dropped and the text truncated as vLLM does.  Returns the stop
    string matched, or None.

    Its attributes are read as attributes (not through ``__dict__``, which
    would turn the instance's inline values into a dict and slow vLLM's own
    accesses to them), all before anything is written: ``token_ids``,
    ``output_text`` and ``stop``; with stop strings or ``stop_terminated``,
    ``include_stop_str_in_output``; with stop strings, ``min_tokens`` (where
    vLLM's method reads them).  AttributeError naming a missing one.  An
    exception from ``decode_next`` or ``check_stop_strings`` propagates with
    the detokenizer as vLLM's method leaves it (the token appended, the text
    up to the one before).
    """
    if not isinstance(new_token_ids, list):
        raise TypeError(f"new_token_ids must be a list, got {type(new_token_ids).__name__}")
    token_ids = detokenizer.token_ids
    output_text = detokenizer.output_text
    stop = detokenizer.stop
    stopping, terminated = bool(stop), bool(stop_terminated)
    # read where vLLM reads them (but before anything is written)
    include_stop = min_tokens = None
    if terminated or stopping:
        include_stop = detokenizer.include_stop_str_in_output
    if stopping:
        min_tokens = detokenizer.min_tokens
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
        detokenizer.output_text = None  # so that the text can grow in place
        try:
            output_text += piece
        finally:
            detokenizer.output_text = output_text
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
        detokenizer.output_text = output_text[:truncate_to]
    _stats["stops"] += 1
    return stop_string
