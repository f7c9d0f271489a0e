"""What every fastbatch patch shares: the guard, the activation check, apply, revert.

A ``Patch`` is one attribute of vLLM (a method or a module-level function)
that fastbatch replaces.  It is applied only if the installed vLLM is a
release it accepts (``fastbatch/patches/_releases.py``, written by
``tools/fingerprint_releases.py``) AND the target's code is a verified
variant (a fingerprint of its syntax tree, see ``fastbatch._fingerprint``),
and so is the code the replacement relies on besides the target
(``companions``); then only if the original and fastbatch agree on small
synthetic inputs.  Anything else logs why and leaves vLLM stock.  Applying
twice is a no-op, and ``revert`` puts the original back.  Under
``FASTBATCH_VERIFY`` the installed replacement is the checked one of
``fastbatch._verify``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import fastbatch
from fastbatch import _verify
from fastbatch._fingerprint import fingerprint
from fastbatch._verify import Shadow
from fastbatch.patches._releases import RELEASES

__all__ = ["Judgement", "Patch", "Shadow", "instance_dict_problem"]

logger = logging.getLogger("vllm.fastbatch")


def instance_dict_problem(instance: Any, read: tuple[str, ...],
                          written: tuple[str, ...] = ()) -> str | None:
    """Why a compiled piece may not read ``read`` and write ``written`` of
    objects like ``instance`` through their instance dict, or None.

    Reading ``obj.__dict__[name]`` is ``obj.name``, and writing it is
    ``obj.name = value``, for a plain instance attribute: no class attribute
    of that name (a property, a slot, a default would be bypassed), and, for
    what is read, set on every instance (checked on a freshly built one).
    """
    cls = type(instance)
    shadowed = sorted(name for name in {*read, *written} if hasattr(cls, name))
    if shadowed:
        return f"{cls.__name__} class attributes {shadowed} would be bypassed"
    missing = [name for name in read if name not in vars(instance)]
    if missing:
        return f"{cls.__name__} instances lack {missing}"
    return None


def _lookup(module: str, qualname: str) -> tuple[Any, str, Any]:
    """(owner, attribute name, current value or None) of ``module.qualname``."""
    owner = importlib.import_module(module)
    *parents, name = qualname.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, name, getattr(owner, name, None)


PASSED = "passed"


@dataclasses.dataclass(frozen=True)
class Judgement:
    """``Patch.judge``'s answer.  ``method``: vLLM's code at the target (None
    where there is none); ``problem``: why the guard refuses the target (None:
    a verified target); ``check``: the activation check's outcome, ``PASSED``
    or ``"failed: <why>"``, or why it was not run; ``unimportable``: the
    target's module cannot be imported here (said in ``problem``)."""

    owner: Any
    attribute: str
    method: Any
    problem: str | None
    check: str
    unimportable: bool = False

    @property
    def accepted(self) -> bool:
        """``FASTBATCH=1`` would install the patch (``FASTBATCH=force``: also
        where only ``problem`` stands in the way)."""
        return self.problem is None and self.check == PASSED


class Patch:
    """One replaced vLLM attribute: ``target`` (``"module:qualname"``, as
    ``companions`` name code too) becomes ``replacement``.

    ``activation_check(original, replacement)`` runs both on synthetic input
    and returns why they disagree, or None.  ``companions`` maps
    the ``"module:qualname"`` of other vLLM code the replacement relies on to its
    verified fingerprints.  ``shadow`` tells ``FASTBATCH_VERIFY`` how to check
    a call (a piece without one stays stock while verification is on).
    ``needs_async_scheduling``: the piece has work only under async
    scheduling (the worker's runner report says so).  ``requires``: a patch
    whose replacement this one relies on (it is applied only after that one;
    where that one is checked by ``FASTBATCH_VERIFY``, only if this one has a
    ``shadow``).  ``versions``: the accepted releases, by default the
    generated ones of the target.  ``acts_under_v2``: the target is the
    scheduler's (``vllm.v1.core``), the engine's (``vllm.v1.engine``: the
    output processor) or the API server's (``vllm.entrypoints``), code that
    Model Runner V2 runs too.
    ``name`` is the piece's (set by ``fastbatch.registry``).
    """

    def __init__(self, target: str, replacement: Callable[..., Any], *,
                 fingerprints: Mapping[str, str],
                 activation_check: Callable[[Any, Any], str | None],
                 companions: Mapping[str, Mapping[str, str]] | None = None,
                 shadow: Shadow | None = None, needs_async_scheduling: bool = False,
                 requires: Patch | None = None,
                 versions: tuple[str, ...] | None = None) -> None:
        self.module, self.qualname = target.split(":")
        self.target = f"{self.module}.{self.qualname}"
        self.name = self.qualname.rsplit(".", 1)[-1]
        self.replacement = replacement
        # what tests and tools look for (on the function a staticmethod holds too)
        getattr(replacement, "__func__", replacement).__fastbatch__ = True
        self.versions = RELEASES.get(self.target, ()) if versions is None else versions
        self.fingerprints = fingerprints
        self.activation_check = activation_check
        self.companions = companions or {}
        self.shadow = shadow
        self.needs_async_scheduling = needs_async_scheduling
        self.requires = requires
        self.acts_under_v2 = self.module.startswith(
            ("vllm.v1.core.", "vllm.v1.engine.", "vllm.entrypoints."))
        # FASTBATCH_VERIFY's state, which fastbatch._verify writes
        self.verification = _verify.Verification()
        self._siblings: tuple[Patch, ...] = (self,)
        self._original: Any = None
        self._stored: Any = None  # the attribute as stored (a staticmethod, say)

    @property
    def siblings(self) -> tuple[Patch, ...]:
        """The patches of the same piece, this one included (set by
        ``fastbatch.registry``): a divergence in one sends all to vLLM's code."""
        return self._siblings

    @siblings.setter
    def siblings(self, patches: tuple[Patch, ...]) -> None:
        self._siblings = tuple(patches)
        self.verification.siblings = tuple(patch.verification for patch in self._siblings)

    # ``verification``'s fields, read (and set, by tests) through the patch
    verify_rate = property(lambda self: self.verification.rate,
                           lambda self, value: setattr(self.verification, "rate", value),
                           doc="The share of calls ``FASTBATCH_VERIFY`` checks.")
    checked = property(lambda self: self.verification.checked,
                       lambda self, value: setattr(self.verification, "checked", value),
                       doc="The calls compared with vLLM's code.")
    divergences = property(lambda self: self.verification.divergences,
                           lambda self, value: setattr(self.verification, "divergences", value),
                           doc="The calls found different from vLLM's.")
    reproducers = property(lambda self: self.verification.reproducers,
                           lambda self, value: setattr(self.verification, "reproducers", value),
                           doc="The reproducers written for them.")
    piece_diverged = property(lambda self: self.verification.piece_diverged,
                              doc="A patch of the piece diverged: all run vLLM's code.")

    def original(self) -> Any:
        """vLLM's own code while the patch is applied, else None."""
        return self._original

    def current(self) -> Any:
        """What stands at the target now (None where it does not exist)."""
        return _lookup(self.module, self.qualname)[2]

    def is_applied(self) -> bool:
        """True while the patch is applied in this process (even if something
        else, a profiler say, has wrapped the attribute since)."""
        return self._original is not None

    def check_target(self, vllm_version: str, method: Any) -> str | None:
        """Why ``method`` of vLLM ``vllm_version`` is not a verified target, or None."""
        base_version = vllm_version.split("+")[0]
        if base_version not in self.versions:
            accepted = (f"{self.versions[0]} to {self.versions[-1]}" if self.versions
                        else "none listed in fastbatch/patches/_releases.py")
            return f"vLLM {vllm_version} is not a verified version ({accepted})"
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

    def judge(self, force: bool = False, *, standalone: bool = False) -> Judgement:
        """Whether the installed vLLM takes this patch, and why: the guard on
        its target (``check_target``), then, where the guard accepts it (or
        ``force``, ``FASTBATCH=force``) and there is code at the target, the
        activation check (``standalone``, for a process that applies nothing:
        not for a patch that ``requires`` another).  What ``apply`` decides
        by, and ``python -m fastbatch`` prints."""
        import vllm

        try:
            owner, attribute, method = _lookup(self.module, self.qualname)
        except ImportError as exc:  # a module this vLLM cannot import here
            return Judgement(None, "", None, f"{self.module} cannot be imported ({exc})",
                             "not run (nothing to check)", unimportable=True)
        problem = self.check_target(vllm.__version__, method)
        if method is None:
            return Judgement(owner, attribute, None, problem, "not run (nothing to check)")
        if problem is not None and not force:
            return Judgement(owner, attribute, method, problem, "not run (target refused)")
        if standalone and self.requires is not None:
            return Judgement(owner, attribute, method, problem,
                             f"run once {self.requires.target} is replaced")
        try:
            with _verify.suspended():  # other pieces' checked calls are not traffic
                disagreement = self.activation_check(method, self.replacement)
        except Exception as exc:  # any failure at all means: stay stock
            disagreement = f"the check raised {type(exc).__name__}: {exc}"
        return Judgement(owner, attribute, method, problem,
                         PASSED if disagreement is None else f"failed: {disagreement}")

    def apply(self, force: bool = False, verify: float = 0.0) -> bool:
        """Install the replacement, once per process.  Returns True if installed.

        With ``force``, a failed version/shape guard only warns; the activation
        check still has to pass.  ``verify`` (0 to 1, ``FASTBATCH_VERIFY``):
        the share of calls checked against vLLM's code (``checked``).
        """
        import vllm

        started = time.perf_counter()
        if self._original is not None:
            return True  # already applied in this process
        if verify > 0 and self.shadow is None:
            logger.warning("fastbatch: %s left stock: FASTBATCH_VERIFY is on and this piece "
                           "has no shadow check", self.target)
            return False
        counts = fastbatch.stats()
        verdict = self.judge(force)
        if verdict.unimportable:
            logger.warning("fastbatch: %s; leaving it stock", verdict.problem)
            return False
        if verdict.problem is not None:
            if not force:
                logger.warning("fastbatch: %s; leaving vLLM stock (FASTBATCH=force "
                               "patches anyway)", verdict.problem)
                return False
            if verdict.method is None:
                logger.warning("fastbatch: %s; nothing to patch", verdict.problem)
                return False
            logger.warning("fastbatch: %s; patching anyway because FASTBATCH=force",
                           verdict.problem)
        if verdict.check != PASSED:
            logger.error("fastbatch: activation check failed for %s (%s); leaving "
                         "vLLM stock", self.target, verdict.check.removeprefix("failed: "))
            return False
        # count vLLM's calls only, not the check's: the pieces it ran start at zero
        moved = [name for name, counters in fastbatch.stats().items() if counters != counts[name]]
        if moved:
            fastbatch.reset_stats(*moved)
        method, owner, attribute = verdict.method, verdict.owner, verdict.attribute
        self._original = method
        self._stored = inspect.getattr_static(owner, attribute)
        self.verification.reset(verify)
        installed = self.replacement
        if verify > 0:
            installed = _verify.checked_replacement(self, method, verify)
            if isinstance(self._stored, staticmethod):  # calls through an instance stay static
                installed = staticmethod(installed)
        setattr(owner, attribute, installed)
        logger.info("fastbatch %s: replaced %s of vLLM %s with the %s%s (checks took "
                    "%.1f ms)", fastbatch.__version__, self.target, vllm.__version__,
                    "compiled kernel" if fastbatch.COMPILED else "pure-Python fallback",
                    "" if verify <= 0 else ", every call checked against vLLM's"
                    if verify >= 1 else f", {verify:g} of calls checked against vLLM's",
                    (time.perf_counter() - started) * 1e3)
        return True

    def revert(self) -> None:
        """Put vLLM's own code back (tests; a process that wants stock again)."""
        if self._original is None:
            return
        owner, name, _ = _lookup(self.module, self.qualname)
        setattr(owner, name, self._stored)
        self._original = self._stored = None
        self.verification.reset()

    def replay(self, inputs: Any, original: Callable[..., Any] | None = None) -> str | None:
        """``fastbatch._verify.replay`` of a reproducer's ``inputs`` for this patch."""
        return _verify.replay(self, inputs, original)
