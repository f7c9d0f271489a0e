"""Generic comparison for the pieces' shadows (``FASTBATCH_VERIFY``), their
activation checks and the tests: any value as comparable, picklable data
(``plain``), and where two values first differ (``first_difference``)."""

from __future__ import annotations

import collections
import collections.abc
import copy
import dataclasses
import enum
import itertools
from array import array
from typing import Any


def plain(value: Any, depth: int = 0) -> Any:
    """``value`` as comparable, picklable data (KV blocks by id, requests by id)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, enum.Enum)):
        return value
    if isinstance(value, array):  # vLLM 0.34's TokenBuffer
        return (type(value).__qualname__, value.typecode, value.tolist())
    if depth > 24:
        return ("too deep", type(value).__qualname__)
    depth += 1
    if type(value) is list:
        if all(type(item) is int for item in value):
            return list(value)
        return [plain(item, depth) for item in value]
    if isinstance(value, (list, tuple, collections.deque)):
        return (type(value).__qualname__, [plain(item, depth) for item in value])
    if isinstance(value, dict):
        return (type(value).__qualname__,
                [(plain(key, depth), plain(item, depth)) for key, item in value.items()])
    if isinstance(value, (set, frozenset)):
        return ("set", sorted(repr(plain(item, depth)) for item in value))
    block_id = getattr(value, "block_id", None)
    if type(block_id) is int:
        return ("block", block_id)
    request_id = getattr(value, "request_id", None)
    if type(request_id) is str and hasattr(value, "_all_token_ids"):
        return ("request", request_id)
    fields = getattr(type(value), "__struct_fields__", None)
    if fields is not None:
        return (type(value).__qualname__,
                {name: plain(getattr(value, name), depth) for name in fields})
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__qualname__,
                {field.name: plain(getattr(value, field.name), depth)
                 for field in dataclasses.fields(value)})
    if (hasattr(value, "tobytes") and hasattr(value, "strides")
            and not getattr(getattr(value, "dtype", None), "hasobject", True)):
        # numpy, exactly: dtype, shape, strides and bytes (a NaN equals itself)
        return (type(value).__qualname__, value.dtype.str, value.shape, value.strides,
                value.tobytes())
    if hasattr(value, "tolist") and hasattr(value, "dtype"):
        return (type(value).__qualname__, str(value.dtype), value.tolist())
    if isinstance(value, collections.abc.Iterator):
        return ("iterator", [plain(item, depth) for item in value])
    if hasattr(value, "__dict__") and not callable(value):
        return (type(value).__qualname__,
                {name: plain(item, depth) for name, item in vars(value).items()})
    return (type(value).__qualname__, repr(value))


def equal(ours: Any, stock: Any) -> bool:
    """``ours == stock`` and of one type (containers holding arrays, where
    ``==`` is elementwise or ambiguous: as plain data)."""
    if type(ours) is not type(stock):
        return False
    try:
        return bool(ours == stock)
    except Exception:  # arrays inside: compare as plain data
        return plain(ours) == plain(stock)


def first_difference(ours: Any, stock: Any, path: str = "") -> str | None:
    """Where fastbatch's ``ours`` and vLLM's ``stock`` first differ (a path
    into them, and both values there), or None where they are ``equal``.
    A dict's string keys extend the path as ``.key``, other keys and list
    indices as subscripts; a difference is always reported, at the
    outermost place if no part differs on its own."""
    if equal(ours, stock):
        return None
    where = path or "outcome"
    if type(ours) is not type(stock):
        return f"{where}: fastbatch {ours!r:.300}, vLLM {stock!r:.300}"
    if hasattr(type(ours), "__struct_fields__"):
        found = first_difference(plain(ours)[1], plain(stock)[1], path)
    elif isinstance(ours, dict):
        found = _first_in_dict(ours, stock, path)
    elif isinstance(ours, (list, tuple)):
        found = _first_in_list(ours, stock, path)
    else:
        found = None
    return found or f"{where}: fastbatch {ours!r:.300}, vLLM {stock!r:.300}"


def _first_in_list(ours: Any, stock: Any, path: str) -> str | None:
    """Item by item; a sequence of (key, value) pairs with distinct keys (a
    mapping, in order, as ``plain`` gives it) by key."""
    pairs = all(type(item) is tuple and len(item) == 2 for item in (*ours, *stock)) and all(
        len({repr(key) for key, _ in items}) == len(items) for items in (ours, stock))
    for index, (left, right) in enumerate(zip(ours, stock, strict=False)):
        if pairs and equal(left[0], right[0]):
            found = first_difference(left[1], right[1], f"{path}[{left[0]!r}]")
        else:
            found = first_difference(left, right, f"{path}[{index}]")
        if found is not None:
            return found
    if len(ours) != len(stock):
        return f"{path or 'outcome'}: {len(ours)} items in fastbatch's, {len(stock)} in vLLM's"
    return None


def _first_in_dict(ours: dict[Any, Any], stock: dict[Any, Any], path: str) -> str | None:
    for key in [*ours, *(key for key in stock if key not in ours)]:
        where = f"{path}.{key}" if type(key) is str else f"{path}[{key!r}]"
        if key not in ours or key not in stock:
            return f"{where}: only in {'fastbatch' if key in ours else 'vLLM'}'s"
        found = first_difference(ours[key], stock[key], where)
        if found is not None:
            return found
    if list(ours) != list(stock):
        return f"{path or 'outcome'} keys: fastbatch {list(ours)!r:.300}, vLLM {list(stock)!r:.300}"
    return None


def rows_problem(ours: Any, stock: list[list[int]]) -> str | None:
    """Why ``ours`` is not exactly vLLM's ``stock`` rows (``tolist()``
    rows), or None: the same values, as a plain ``list`` of distinct plain
    ``list``s of plain ``int``s.  Distinct, because vLLM's callers change
    rows in place (``clear()``, truncation)."""
    if (type(ours) is list and ours == stock and set(map(type, ours)) <= {list}
            and set(map(type, itertools.chain.from_iterable(ours))) <= {int}
            and len(set(map(id, ours))) == len(ours)):
        return None  # the common case, at C speed
    if type(ours) is not list:
        return f"fastbatch gave a {type(ours).__name__}, not a list"
    if len(ours) != len(stock):
        return f"fastbatch gave {len(ours)} rows, vLLM {len(stock)}"
    for index, (got, expected) in enumerate(zip(ours, stock, strict=True)):
        if type(got) is not list or got != expected or any(
                type(item) is not int for item in got):
            return f"row {index}: fastbatch gave {got!r}, vLLM {expected!r}"
    return "fastbatch gave two rows that are one list object"


def tensor_copy(tensor: Any) -> Any:
    """A copy of an ids tensor (or array) that later writes to it do not reach."""
    return tensor.clone() if hasattr(tensor, "clone") else copy.deepcopy(tensor)


def unchanged(live: Any, saved: Any) -> bool:
    """Whether the ids tensor (or array) ``live`` still holds ``saved``'s values."""
    import numpy as np
    import torch

    if isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor):
        return (live.shape == saved.shape and live.dtype == saved.dtype
                and bool(torch.equal(live, saved.to(live.device))))
    return bool(np.array_equal(live, saved))


class NoWait:
    """The copy-ready event of a replayed reproducer: the data are already there."""

    def synchronize(self) -> None:
        pass
