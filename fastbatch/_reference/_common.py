"""What the pure-Python twins share: the argument checks of the compiled
pieces, and the reading of a 2-D int tensor or buffer as the kernels'
``SampledIds`` view reads it."""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Iterable
from typing import Any


def check_types(**arguments: tuple[object, type]) -> None:
    """The kernel's ``list``/``dict`` argument types: TypeError naming the argument."""
    for name, (value, kind) in arguments.items():
        if not isinstance(value, kind):
            raise TypeError(f"{name} must be a {kind.__name__}, "
                            f"got {type(value).__name__}")


def as_row(req_id: object, prev_index: object) -> int:
    try:
        row = operator.index(prev_index)
    except TypeError:
        raise TypeError(f"prev_req_id_to_index[{req_id!r}] must be an int, "
                        f"got {type(prev_index).__name__}") from None
    if row < 0:
        raise IndexError(f"prev_req_id_to_index[{req_id!r}] = {row} is negative")
    return row


class Counters:
    """A piece's counters: ``stats()`` and ``reset_stats()``, as the compiled piece has."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = tuple(keys)
        self.values = dict.fromkeys(self._keys, 0)

    def stats(self) -> dict[str, int]:
        """Counters since import or the last ``reset_stats()``, as a dict."""
        return dict(self.values)

    def reset_stats(self) -> None:
        """Set every counter of ``stats()`` back to zero."""
        self.values.update(dict.fromkeys(self._keys, 0))


def int_column(array: Any, name: str, *, writable: bool, int32_too: bool) -> memoryview:
    """``array`` as a 1-D memoryview of int64 (or, with ``int32_too``, int32)
    items, as the compiled pieces take it: TypeError naming ``name`` otherwise."""
    kinds = "int32 or int64" if int32_too else "int64"
    try:
        view = memoryview(array)
    except TypeError as exc:
        raise TypeError(f"{name} must be a {'writable ' if writable else ''}1-D int "
                        f"array, got {type(array).__name__} ({exc})") from None
    form = view.format.lstrip("@=" + ("<" if sys.byteorder == "little" else ""))
    if not (view.ndim == 1 and ((view.itemsize == 8 and form in ("l", "q"))
                                or (int32_too and view.itemsize == 4 and form in ("i", "l")))):
        raise TypeError(f"{name} must be a 1-D {kinds} array, got a {view.ndim}-D "
                        f"array of format {view.format!r}")
    if writable and view.readonly:
        raise TypeError(f"{name} must be a writable 1-D int array, got "
                        f"{type(array).__name__} (read-only)")
    return view
def _checked_tensor(tensor: Any, name: str) -> tuple[int, int, Callable[[], list[list[int]]]]:
    """A torch tensor's shape and reader, after the kernel's checks, in its order."""
    dtype = getattr(tensor, "dtype", None)
    if dtype is None or not hasattr(tensor, "data_ptr"):
        raise TypeError(f"{name} must be a 2-D int32 or int64 array or CPU "
                        f"tensor, got {type(tensor).__name__}")
    torch = sys.modules.get("torch")
    if torch is None or dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {dtype}")
    if not tensor.is_cpu:
        raise TypeError(f"{name} must be on the CPU, got {tensor.device}")
    if tensor.layout is not torch.strided:
        raise TypeError(f"{name} must be a dense tensor, got {tensor.layout}")
    if tensor.dim() != 2:
        raise TypeError(f"{name} must be 2-D, got a {tensor.dim()}-D tensor")
    return tensor.shape[0], tensor.shape[1], tensor.tolist


def checked_ids(source: Any, name: str) -> tuple[int, int, Callable[[], list[list[int]]]]:
    """The rows and width of a 2-D int32/int64 CPU tensor or buffer, and a
    reader of its values as nested lists (called only when they are needed).

    Checked as the kernels' ``view_ids`` checks; ``name`` is the argument's
    name in the TypeError.
    """
    try:
        view = memoryview(source)
    except TypeError:
        return _checked_tensor(source, name)
    fmt = view.format
    if fmt[:1] in ("@", "=") or (fmt[:1] == "<" and sys.byteorder == "little"):
        fmt = fmt[1:]
    if not (view.ndim == 2 and fmt in ("q", "l", "i") and view.itemsize in (4, 8)):
        raise TypeError(f"{name} must be a 2-D int32 or int64 array, "
                        f"got a {view.ndim}-D array of format {view.format!r}")
    return view.shape[0], view.shape[1], view.tolist


def _row_index(index: int, num_rows: int, name: str) -> int:
    row = index + num_rows if index < 0 else index
    if not 0 <= row < num_rows:
        raise IndexError(f"{name}: index {index} is out of range for {num_rows} rows")
    return row


def flagged_rows(indices: Any, num_rows: int, name: str, numpy_rules: bool) -> set[int]:
    """The row numbers in ``indices``, as the kernels' ``flag_rows`` reads them:
    a list's indexing, or with ``numpy_rules`` only what numpy's fancy indexing
    reads the same way (a list of exact ints, an empty sequence, a 1-D integer
    buffer)."""
    if numpy_rules:
        if type(indices) is list:
            for item in indices:
                if type(item) is not int:
                    raise TypeError(f"{name} must be a list of ints, got an item "
                                    f"of type {type(item).__name__}")
            values: Iterable[int] = indices
        else:
            try:
                view = memoryview(indices)
            except TypeError:
                if isinstance(indices, tuple) and not indices:
                    return set()
                raise TypeError(f"{name} must be a list of ints or a 1-D integer array, "
                                f"got {type(indices).__name__}") from None
            fmt = view.format
            if fmt[:1] in ("@", "=") or (fmt[:1] == "<" and sys.byteorder == "little"):
                fmt = fmt[1:]
            if view.ndim != 1 or len(fmt) != 1 or fmt not in "bhilqBHILQ":
                raise TypeError(f"{name} must be a list of ints or a 1-D integer array, "
                                f"got a {view.ndim}-D array of format {view.format!r}")
            values = view.tolist()
        return {_row_index(value, num_rows, name) for value in values}
    rows = set()
    for value in indices:
        try:
            index = operator.index(value)
        except TypeError:
            raise TypeError(f"{name} must hold ints, got {type(value).__name__}") from None
        rows.add(_row_index(index, num_rows, name))
    return rows
