"""The pieces' names, listed from ``fastbatch/patches/`` without importing
anything, and their compiled and twin modules: what ``fastbatch._kernels``
and ``fastbatch._reference`` are built from, below ``fastbatch.registry``
(which reads the patch modules, and the package)."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from types import ModuleType
from typing import Any

# Listed from the folder, without importing the package: the plugin, switched
# off, imports nothing of fastbatch.patches.
NAMES: tuple[str, ...] = tuple(sorted(
    module.name for module in pkgutil.iter_modules([str(Path(__file__).parent / "patches")])
    if not module.name.startswith("_")))


def kernel_modules() -> dict[str, ModuleType]:
    """Every piece's compiled module (ImportError where one is not built)."""
    return {name: importlib.import_module(f"fastbatch._kernels.{name}") for name in NAMES}


def twin_modules() -> dict[str, ModuleType]:
    """Every piece's pure-Python twin."""
    return {name: importlib.import_module(f"fastbatch._reference.{name}") for name in NAMES}


def exports(modules: dict[str, ModuleType]) -> dict[str, Any]:
    """The public functions of the pieces' modules (their ``__all__``), by name."""
    found: dict[str, Any] = {}
    for module in modules.values():
        for attribute in module.__all__:
            if attribute in found:
                raise RuntimeError(f"{attribute} is exported by two pieces")
            found[attribute] = getattr(module, attribute)
    return found
