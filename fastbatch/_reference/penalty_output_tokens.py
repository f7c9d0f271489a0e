"""Pure-Python twin of the compiled piece ``penalty_output_tokens``: the test oracle.

Same signature, rules, errors and counters as
``fastbatch._kernels.penalty_output_tokens``; written for reading, not for
speed.
"""

from __future__ import annotations

__all__ = ["output_tokens_tensor"]

import operator
from typing import Any

from fastbatch._reference._common import Counters, check_types

_counters = Counters(("tensors", "tokens"))
stats, reset_stats = _counters.stats, _counters.reset_stats
_stats = _counters.values


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

    check_types(output_token_ids=(output_token_ids, list))
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
    _stats["tensors"] += 1
    _stats["tokens"] += sum(map(len, output_token_ids))
    return tensor.pin_memory() if pin_memory else tensor
