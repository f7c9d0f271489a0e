"""Pure-Python twin of the compiled piece ``bookkeeping_sync``: the test oracle.

Same signature, rules, errors and counters as
``fastbatch._kernels.bookkeeping_sync``; written for reading, not for speed.
"""

from __future__ import annotations

__all__ = ["append_sampled_token_ids"]

import operator
from typing import Any

from fastbatch._reference._common import Counters, check_types

_counters = Counters(("calls", "requests_updated",
                      "tokens_added"))
stats, reset_stats = _counters.stats, _counters.reset_stats
_stats = _counters.values

_INT32 = range(-2**31, 2**31)


def _check_array(array: Any, name: str, ndim: int, kind: str) -> None:
    """The batch arrays: writable numpy-style arrays of int32 (``"i"``) or bool (``"?"``)."""
    wanted = f"{name} must be a writable {ndim}-D array of " + (
        "bool" if kind == "?" else "int32")
    try:
        view = memoryview(array)
    except TypeError:
        raise TypeError(f"{wanted}, got {type(array).__name__}") from None
    with view:
        if view.readonly:
            raise TypeError(f"{wanted} (read-only)")
        found = view.format.lstrip("@=<")
        if view.ndim != ndim or view.itemsize != (1 if kind == "?" else 4) or found != kind:
            raise TypeError(f"{wanted}, got {view.ndim}-D, format {found!r}")


def append_sampled_token_ids(
    req_ids: list[str | None],
    requests: dict[str, Any],
    num_sampled_tokens: int,
    valid_sampled_token_ids: list[list[int]] | None,
    discarded: set[int] | frozenset[int] | None,
    num_tokens_no_spec: Any,
    token_ids_cpu: Any,
    is_token_ids: Any,
    max_model_len: int,
) -> int:
    """Append this step's sampled tokens to each request's state.

    The per-request loop of vLLM's ``GPUModelRunner._bookkeeping_sync`` (vLLM
    0.31.0 to 0.33.0), for requests ``0 .. num_sampled_tokens - 1``.  With
    ``valid_sampled_token_ids`` None (async scheduling) each request not in the
    set ``discarded`` gets one placeholder ``-1``; otherwise request ``i`` gets
    the ints of the list ``valid_sampled_token_ids[i]`` (skipped if empty).
    For each: the tokens go to ``token_ids_cpu[i, start:end]``,
    ``is_token_ids[i, start:end] = True``, ``num_tokens_no_spec[i] = end``
    (``start`` its old value) and ``requests[req_ids[i]].output_token_ids`` is
    extended in place (the same list object as the input batch's).

    Everything is checked before anything changes; then a clear exception:
    AssertionError (vLLM's, ``end > max_model_len``), KeyError (no state for a
    request), IndexError, TypeError (not lists/ints, arrays that are not the
    batch's int32/bool arrays), OverflowError (a token id beyond int32).
    Returns the number of requests updated.
    """
    num_sampled_tokens, max_model_len = (operator.index(num_sampled_tokens),
                                         operator.index(max_model_len))
    check_types(req_ids=(req_ids, list), requests=(requests, dict))
    if valid_sampled_token_ids is not None:
        check_types(valid_sampled_token_ids=(valid_sampled_token_ids, list))
    if discarded is not None and not isinstance(discarded, (set, frozenset)):
        raise TypeError(f"discarded must be a set or None, got {type(discarded).__name__}")
    if num_sampled_tokens < 0:
        raise ValueError(f"num_sampled_tokens must be >= 0, got {num_sampled_tokens}")
    _stats["calls"] += 1
    _check_array(num_tokens_no_spec, "num_tokens_no_spec", 1, "i")
    _check_array(token_ids_cpu, "token_ids_cpu", 2, "i")
    _check_array(is_token_ids, "is_token_ids", 2, "?")

    # Pass 1: plan.  First the lookups, then the rows' items and the bounds.
    plans = []  # (row of the arrays, output list, sampled list or None, count)
    for index in range(num_sampled_tokens):
        if valid_sampled_token_ids is None:
            if discarded and index in discarded:
                continue
            sampled_ids = None
        else:
            if index >= len(valid_sampled_token_ids):
                raise IndexError(f"valid_sampled_token_ids has "
                                 f"{len(valid_sampled_token_ids)} rows, fewer than "
                                 f"the {num_sampled_tokens} sampled")
            sampled_ids = valid_sampled_token_ids[index]
            if not isinstance(sampled_ids, list):
                raise TypeError(f"valid_sampled_token_ids[{index}] must be a list, "
                                f"got {type(sampled_ids).__name__}")
            if not sampled_ids:
                continue
        if index >= len(req_ids):
            raise IndexError(f"req_ids has {len(req_ids)} entries, fewer than the "
                             f"{num_sampled_tokens} sampled")
        req_id = req_ids[index]
        output_ids = requests[req_id].output_token_ids
        if not isinstance(output_ids, list):
            raise TypeError(f"requests[{req_id!r}].output_token_ids must be a list, "
                            f"got {type(output_ids).__name__}")
        plans.append((index, output_ids, sampled_ids,
                      1 if sampled_ids is None else len(sampled_ids)))
    num_rows = min(len(num_tokens_no_spec), len(token_ids_cpu), len(is_token_ids))
    width = min(token_ids_cpu.shape[1], is_token_ids.shape[1])
    starts = []
    for index, _, sampled_ids, count in plans:
        for j, token in enumerate(sampled_ids or ()):
            if type(token) is not int:
                raise TypeError(f"valid_sampled_token_ids[{index}][{j}] must be an "
                                f"int, got {type(token).__name__}")
            if token not in _INT32:
                raise OverflowError(f"valid_sampled_token_ids[{index}][{j}] = {token} "
                                    "does not fit token_ids_cpu (int32)")
        if index >= num_rows:
            raise IndexError(f"request {index} is beyond the {num_rows} rows of the "
                             "batch arrays")
        start = int(num_tokens_no_spec[index])
        if start + count > max_model_len:
            raise AssertionError(
                "Sampled token IDs exceed the max model length. Total number of "
                f"tokens: {start + count} > max_model_len: {max_model_len}")
        if start < 0 or start + count > width:
            raise IndexError(f"num_tokens_no_spec[{index}] = {start} is out of range "
                             f"for token_ids_cpu's {width} columns")
        starts.append(start)

    # Pass 2: vLLM's loop body, in order.
    added = 0
    for (index, output_ids, sampled_ids, count), start in zip(plans, starts, strict=True):
        tokens = [-1] if sampled_ids is None else sampled_ids
        token_ids_cpu[index, start:start + count] = tokens
        is_token_ids[index, start:start + count] = True
        num_tokens_no_spec[index] = start + count
        output_ids.extend(tokens)
        added += count
    _stats["requests_updated"] += len(plans)
    _stats["tokens_added"] += added
    return len(plans)
