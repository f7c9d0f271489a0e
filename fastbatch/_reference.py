"""Pure-Python reference of the kernel: the test oracle and the fallback.

Same signatures, rules, errors and counters as ``fastbatch._kernel``; written
for reading, not for speed.  ``update_async_spec_token_ids`` and
``output_tokens_tensor`` are described at their definitions below.

``update_async_output_token_ids`` has the semantics of vLLM 0.33.0's
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

import operator
import sys
from collections.abc import Callable
from typing import Any

_STATS_KEYS = ("calls", "syncs", "requests_updated", "tokens_written",
               "placeholders_dropped", "spec_calls", "spec_requests_updated",
               "penalty_tensors", "penalty_tokens")
_stats = dict.fromkeys(_STATS_KEYS, 0)


def stats() -> dict[str, int]:
    """Counters since import or the last ``reset_stats()``, as a dict."""
    return dict(_stats)


def reset_stats() -> None:
    """Set every counter of ``stats()`` back to zero."""
    _stats.update(dict.fromkeys(_STATS_KEYS, 0))


def _check_types(**arguments: tuple[object, type]) -> None:
    """The kernel's ``list``/``dict`` argument types: TypeError naming the argument."""
    for name, (value, kind) in arguments.items():
        if not isinstance(value, kind):
            raise TypeError(f"{name} must be a {kind.__name__}, "
                            f"got {type(value).__name__}")


def _is_placeholder(item: object, request: int, position: int) -> bool:
    if not isinstance(item, int):
        raise TypeError(f"output_token_ids[{request}][{position}] must be an "
                        f"int, got {type(item).__name__}")
    return item == -1


def _as_row(req_id: object, prev_index: object) -> int:
    try:
        row = operator.index(prev_index)
    except TypeError:
        raise TypeError(f"prev_req_id_to_index[{req_id!r}] must be an int, "
                        f"got {type(prev_index).__name__}") from None
    if row < 0:
        raise IndexError(f"prev_req_id_to_index[{req_id!r}] = {row} is negative")
    return row


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


def _checked_tensor(tensor: Any) -> tuple[int, Callable[[], list[list[int]]]]:
    """A torch tensor's row count and reader, after the kernel's checks, in its order."""
    dtype = getattr(tensor, "dtype", None)
    if dtype is None or not hasattr(tensor, "data_ptr"):
        raise TypeError("sampled_token_ids must be a 2-D int32 or int64 array or CPU "
                        f"tensor, got {type(tensor).__name__}")
    torch = sys.modules.get("torch")
    if torch is None or dtype not in (torch.int32, torch.int64):
        raise TypeError(f"sampled_token_ids must be int32 or int64, got {dtype}")
    if not tensor.is_cpu:
        raise TypeError(f"sampled_token_ids must be on the CPU, got {tensor.device}")
    if tensor.layout is not torch.strided:
        raise TypeError(f"sampled_token_ids must be a dense tensor, got {tensor.layout}")
    if tensor.dim() != 2:
        raise TypeError(f"sampled_token_ids must be 2-D, got a {tensor.dim()}-D tensor")
    return tensor.shape[0], tensor.tolist


def _checked_sampled(sampled_token_ids: Any) -> tuple[int, Callable[[], list[list[int]]]]:
    """The sampled ids' row count, and a reader of their values as nested lists.

    Checked as the kernel checks them; the values are read only when the
    reader is called, after the copy-ready synchronisation.
    """
    try:
        view = memoryview(sampled_token_ids)
    except TypeError:
        return _checked_tensor(sampled_token_ids)
    fmt = view.format
    if fmt[:1] in ("@", "=") or (fmt[:1] == "<" and sys.byteorder == "little"):
        fmt = fmt[1:]
    if not (view.ndim == 2 and fmt in ("q", "l", "i") and view.itemsize in (4, 8)):
        raise TypeError("sampled_token_ids must be a 2-D int32 or int64 array, "
                        f"got a {view.ndim}-D array of format {view.format!r}")
    return view.shape[0], view.tolist


def update_async_output_token_ids(
    req_ids: list[str | None],
    prev_req_id_to_index: dict[str, int],
    output_token_ids: list[list[int] | None],
    sampled_token_ids: Any,
    copy_ready: Any = None,
) -> int:
    """Replace every request's trailing -1 placeholders with its sampled ids.

    Returns the number of requests whose output list was updated.
    """
    _check_types(req_ids=(req_ids, list), prev_req_id_to_index=(prev_req_id_to_index, dict),
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
        plans.append((index, _as_row(req_id, prev_index), first_placeholder))
    if not plans:
        return 0

    num_rows, read_rows = _checked_sampled(sampled_token_ids)
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
    _check_types(req_ids=(req_ids, list), prev_req_id_to_index=(prev_req_id_to_index, dict),
                 spec_token_ids=(spec_token_ids, list), draft_token_ids=(draft_token_ids, list))
    _stats["spec_calls"] += 1

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
        row = _as_row(req_id, prev_index)
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
    _stats["spec_requests_updated"] += updated
    return updated


def _token_value(item: object, row: int, position: int) -> int:
    if not hasattr(type(item), "__index__"):  # floats and strings have none
        raise TypeError(f"output_token_ids[{row}][{position}] must be an int, "
                        f"got {type(item).__name__}")
    value = operator.index(item)
    if not -2**63 <= value < 2**63:
        raise OverflowError(f"output_token_ids[{row}][{position}] = {value} does "
                            "not fit in int64")
    return value


def output_tokens_tensor(output_token_ids: list[list[int]], vocab_size: int,
                         pin_memory: bool = False) -> Any:
    """The int64 ``[num_reqs, max_len]`` CPU tensor of vLLM's penalties.

    ``make_tensor_with_pad(output_token_ids, pad=vocab_size, dtype=int64)``
    with every -1 replaced by ``vocab_size`` (``apply_all_penalties``'
    ``masked_fill_``), pinned if ``pin_memory``.  Stricter than numpy: items
    must be ints (or have ``__index__``); floats and strings raise TypeError.
    """
    import torch

    _check_types(output_token_ids=(output_token_ids, list))
    try:
        pad = operator.index(vocab_size)
    except TypeError:
        raise TypeError(f"vocab_size must be an int64, got {vocab_size!r}") from None
    if not -2**63 <= pad < 2**63:
        raise TypeError(f"vocab_size must be an int64, got {vocab_size!r}")
    if pad < 0:
        raise ValueError(f"vocab_size must not be negative, got {pad}")
    for index, row_ids in enumerate(output_token_ids):
        if not isinstance(row_ids, (list, tuple)):
            raise TypeError(f"output_token_ids[{index}] must be a list of ints, "
                            f"got {type(row_ids).__name__}")
    max_len = max(map(len, output_token_ids), default=0)
    rows = [[pad if value == -1 else value
             for value in (_token_value(item, index, position)
                           for position, item in enumerate(row_ids))]
            + [pad] * (max_len - len(row_ids))
            for index, row_ids in enumerate(output_token_ids)]
    tensor = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), max_len)
    _stats["penalty_tensors"] += 1
    _stats["penalty_tokens"] += sum(map(len, output_token_ids))
    return tensor.pin_memory() if pin_memory else tensor
