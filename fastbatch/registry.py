"""The registry of fastbatch's pieces: each is declared once, by its name.

A piece is one name (``FASTBATCH_DISABLE``, ``stats()``, the logs) and four
files that carry it:

* ``fastbatch/patches/<name>.py``: what it replaces in vLLM (its ``PATCH``,
  and ``PATCHES`` when it replaces more than one attribute, in the order they
  are applied), with the guard's fingerprints and the activation check;
* ``fastbatch/_kernels/<name>.pyx`` (and ``.pyi``): the compiled function(s),
  listed in the module's ``__all__``;
* ``fastbatch/_reference/<name>.py``: the pure-Python twin, the same
  ``__all__`` with the same signatures;
* ``tests/test_<name>.py``: its tests.

The pieces are the public modules of ``fastbatch.patches``; everything that
lists them (the plugin, ``python -m fastbatch``, ``status()``, ``stats()``, the
package's exports, the tests' parametrisation, the docs' tables) reads this
module.  The releases each patch accepts come from
``fastbatch/patches/_releases.py``, written by
``tools/fingerprint_releases.py``.  Importing this module imports no vLLM.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from fastbatch._names import NAMES

# Where a piece's target runs (its patch module's ``GROUP``): vLLM's scheduler
# (EngineCore), its model runner (the worker), or its front end (the output
# processor and the API server).
GROUPS = ("scheduler", "runner", "front end")

# FASTBATCH_DISABLE names of fastbatch 0.1 that became the pieces' names;
# they still work, with a deprecation warning.
DEPRECATED_NAMES = {
    "output": "async_output_token_ids",
    "spec": "async_spec_token_ids",
    "penalties": "penalty_output_tokens",
    "bookkeeping": "bookkeeping_sync",
    "input_ids": "prepare_input_ids",
    "drafts": "draft_token_ids",
    "scheduler": "allocate_slots",
    "scheduler_outputs": "update_from_output",
}


class Piece:
    """One piece, as the plugin drives it: its patches applied, reverted and
    reported together."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.module = importlib.import_module(f"fastbatch.patches.{name}")
        # fastbatch.patches._patch.Patch objects (not imported: that module
        # imports the package, which imports this one)
        self.main: Any = self.module.PATCH
        self.patches: tuple[Any, ...] = getattr(self.module, "PATCHES", (self.main,))
        self.group: str = self.module.GROUP
        if self.group not in GROUPS:
            raise ValueError(f"piece {name}: GROUP {self.group!r} is none of {GROUPS}")
        for patch in self.patches:
            patch.name, patch.siblings = name, self.patches

    def __repr__(self) -> str:
        return f"<fastbatch piece {self.name}: {', '.join(p.target for p in self.patches)}>"

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(patch.target for patch in self.patches)

    def apply(self, force: bool = False, verify: float = 0.0) -> bool:
        """Apply every patch of the piece, in order (a patch that ``requires``
        another is applied only after that one, and, where that one is
        checked by ``FASTBATCH_VERIFY``, only if it has a shadow check of its
        own); returns whether the main one is installed."""
        for patch in self.patches:
            required = patch.requires
            if required is not None and not (required.is_applied() and (
                    required.verify_rate == 0 or patch.shadow is not None)):
                continue
            patch.apply(force, verify)
        return self.main.is_applied()

    def revert(self) -> None:
        """vLLM's own code back at every target, in the reverse order."""
        for patch in reversed(self.patches):
            patch.revert()

    def is_applied(self) -> bool:
        """True while any patch of the piece is applied in this process."""
        return any(patch.is_applied() for patch in self.patches)


@functools.cache
def piece(name: str) -> Piece:
    """The piece called ``name`` (imports its patch module)."""
    if name not in NAMES:
        raise KeyError(f"no fastbatch piece {name!r} (pieces: {', '.join(NAMES)})")
    return Piece(name)


def pieces() -> Iterator[Piece]:
    """Every piece, in the order of ``NAMES``."""
    return (piece(name) for name in NAMES)


def group(name: str) -> tuple[str, ...]:
    """The pieces of group ``name`` (one of ``GROUPS``), in the order of
    ``NAMES`` (imports every patch module)."""
    if name not in GROUPS:
        raise KeyError(f"no group {name!r} of fastbatch pieces (groups: {', '.join(GROUPS)})")
    return tuple(piece.name for piece in pieces() if piece.group == name)


def implementation(name: str) -> ModuleType:
    """The module of piece ``name`` in use: the compiled one, or its twin
    where the compiled pieces cannot be imported (``fastbatch.COMPILED``;
    the plugin then leaves vLLM stock)."""
    import fastbatch

    if name not in NAMES:
        raise KeyError(f"no fastbatch piece {name!r} (pieces: {', '.join(NAMES)})")
    return importlib.import_module(
        f"fastbatch.{'_kernels' if fastbatch.COMPILED else '_reference'}.{name}")
