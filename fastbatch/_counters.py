"""``stats()`` and ``reset_stats()`` over the pieces, each of which counts its
own calls (compiled pieces in C globals, their twins in a dict)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType


def combined(pieces: dict[str, ModuleType]) -> tuple[Callable[[], dict[str, dict[str, int]]],
                                                      Callable[[], None]]:
    """``(stats, reset_stats)`` of all ``pieces`` (name -> module) together."""

    def stats() -> dict[str, dict[str, int]]:
        """Every piece's counters since import or the last ``reset_stats()``,
        by piece name."""
        return {name: piece.stats() for name, piece in pieces.items()}

    def reset_stats(*names: str) -> None:
        """Set every counter of ``stats()`` back to zero (only those of the
        pieces ``names``, where given)."""
        unknown = sorted(set(names) - pieces.keys())
        if unknown:
            raise KeyError(f"no fastbatch piece {unknown} (pieces: {', '.join(pieces)})")
        for name in names or pieces:
            pieces[name].reset_stats()

    return stats, reset_stats
