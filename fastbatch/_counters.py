"""``stats()`` and ``reset_stats()`` over several pieces, each of which counts
its own calls (compiled pieces in C globals, their twins in a dict)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType


def combined(*pieces: ModuleType) -> tuple[Callable[[], dict[str, int]], Callable[[], None]]:
    """``(stats, reset_stats)`` of all ``pieces`` together (their keys are distinct)."""

    def stats() -> dict[str, int]:
        """Every piece's counters since import or the last ``reset_stats()``."""
        merged: dict[str, int] = {}
        for piece in pieces:
            merged.update(piece.stats())
        return merged

    def reset_stats() -> None:
        """Set every counter of ``stats()`` back to zero."""
        for piece in pieces:
            piece.reset_stats()

    return stats, reset_stats
