"""What every fastbatch patch shares: the guard, the activation check, apply, revert.

A ``Patch`` is one attribute of vLLM (a method or a module-level function)
that fastbatch replaces.  It is applied only if the installed vLLM is a
verified version AND the target's code is a verified variant (a fingerprint
of its syntax tree, see ``fastbatch._fingerprint``), and so is the code the
replacement relies on besides the target (``companions``); then only if the
original and fastbatch agree on small synthetic inputs.  Anything else logs
why and leaves vLLM stock.  Applying twice is a no-op, and ``revert`` puts
the original back.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import fastbatch
from fastbatch._fingerprint import fingerprint

logger = logging.getLogger("vllm.fastbatch")


def _lookup(module: str, qualname: str) -> tuple[Any, str, Any]:
    """(owner, attribute name, current value or None) of ``module.qualname``."""
    owner = importlib.import_module(module)
    *parents, name = qualname.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, name, getattr(owner, name, None)


class Patch:
    """One replaced vLLM attribute.

    ``activation_check(original, replacement)`` runs both on synthetic input
    and returns why they disagree, or None.  ``companions`` maps
    ``"module:qualname"`` of other vLLM code the replacement relies on to its
    verified fingerprints.
    """

    def __init__(self, *, module: str, qualname: str, replacement: Callable[..., Any],
                 versions: tuple[str, ...], fingerprints: Mapping[str, str],
                 activation_check: Callable[[Any, Any], str | None],
                 companions: Mapping[str, Mapping[str, str]] | None = None) -> None:
        self.module, self.qualname = module, qualname
        self.target = f"{module}.{qualname}"
        self.replacement = replacement
        self.versions = versions
        self.fingerprints = fingerprints
        self.activation_check = activation_check
        self.companions = companions or {}
        self._original: Any = None
        self._stored: Any = None  # the attribute as stored (a staticmethod, say)

    def original(self) -> Any:
        """vLLM's own code while the patch is applied, else None."""
        return self._original

    def is_applied(self) -> bool:
        """True while the patch is applied in this process (even if something
        else, a profiler say, has wrapped the attribute since)."""
        return self._original is not None

    def check_target(self, vllm_version: str, method: Any) -> str | None:
        """Why ``method`` of vLLM ``vllm_version`` is not a verified target, or None."""
        base_version = vllm_version.split("+")[0]
        if base_version not in self.versions:
            return (f"vLLM {vllm_version} is not a verified version "
                    f"({self.versions[0]} to {self.versions[-1]})")
        problem = self._check_code(self.target, method, self.fingerprints)
        if problem is not None:
            return problem
        for name, fingerprints in self.companions.items():
            module, qualname = name.split(":")
            problem = self._check_code(f"{module}.{qualname}",
                                       _lookup(module, qualname)[2], fingerprints)
            if problem is not None:
                return f"{problem}, and {self.target}'s replacement relies on it"
        return None

    @staticmethod
    def _check_code(name: str, function: Any, fingerprints: Mapping[str, str]) -> str | None:
        if function is None:
            return f"{name} does not exist"
        if getattr(function, "__wrapped__", None) is not None:
            return f"{name} is already wrapped by {function.__module__}.{function.__qualname__}"
        try:
            found = fingerprint(function)
        except (OSError, TypeError, ValueError, SyntaxError) as exc:
            return f"the source of {name} cannot be read ({exc})"
        if found not in fingerprints:
            return f"the code of {name} is not a verified variant (fingerprint {found[:12]})"
        return None

    def apply(self, force: bool = False) -> bool:
        """Install the replacement, once per process.  Returns True if installed.

        With ``force``, a failed version/shape guard only warns; the activation
        check still has to pass.
        """
        import vllm

        started = time.perf_counter()
        if self._original is not None:
            return True  # already applied in this process
        owner, name, method = _lookup(self.module, self.qualname)
        problem = self.check_target(vllm.__version__, method)
        if problem is not None:
            if not force:
                logger.warning("fastbatch: %s; leaving vLLM stock (FASTBATCH=force "
                               "patches anyway)", problem)
                return False
            if method is None:
                logger.warning("fastbatch: %s; nothing to patch", problem)
                return False
            logger.warning("fastbatch: %s; patching anyway because FASTBATCH=force",
                           problem)
        try:
            disagreement = self.activation_check(method, self.replacement)
        except Exception as exc:  # any failure at all means: stay stock
            disagreement = f"the check raised {type(exc).__name__}: {exc}"
        if disagreement is not None:
            logger.error("fastbatch: activation check failed for %s (%s); leaving "
                         "vLLM stock", self.target, disagreement)
            return False
        fastbatch.reset_stats()  # count vLLM's calls only, not the checks'
        self._original = method
        self._stored = inspect.getattr_static(owner, name)
        setattr(owner, name, self.replacement)
        logger.info("fastbatch %s: replaced %s of vLLM %s with the %s (checks took "
                    "%.1f ms)", fastbatch.__version__, self.target, vllm.__version__,
                    "compiled kernel" if fastbatch.COMPILED else "pure-Python fallback",
                    (time.perf_counter() - started) * 1e3)
        return True

    def revert(self) -> None:
        """Put vLLM's own code back (tests; a process that wants stock again)."""
        if self._original is None:
            return
        owner, name, _ = _lookup(self.module, self.qualname)
        setattr(owner, name, self._stored)
        self._original = self._stored = None
