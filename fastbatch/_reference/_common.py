"""What the pure-Python twins share: the argument checks of the compiled pieces."""

from __future__ import annotations

import operator
from collections.abc import Iterable


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
