"""What every fastbatch patch shares: the guard, the activation check, apply, revert.

A ``Patch`` is one attribute of vLLM (a method or a module-level function)
that fastbatch replaces.  It is applied only if the installed vLLM is a
verified version AND the target's code is a verified variant (a fingerprint
of its syntax tree, see ``fastbatch._fingerprint``), and so is the code the
replacement relies on besides the target (``companions``); then only if the
original and fastbatch agree on small synthetic inputs.  Anything else logs
why and leaves vLLM stock.  Applying twice is a no-op, and ``revert`` puts
the original back.

``FASTBATCH_VERIFY`` (the shadow check) is built here once for every piece:
a piece that gives its ``Patch`` a ``Shadow`` (how to copy the call's
inputs, run vLLM's code on the copy, and put vLLM's result in place) gets
each of its calls, or a sampled share of them, checked against vLLM's own
code at run time.  On a divergence the call returns vLLM's result, a
reproducer is written, and the piece runs vLLM's code for the rest of the
process.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import os
import pickle
import random
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import fastbatch
from fastbatch._fingerprint import fingerprint

logger = logging.getLogger("vllm.fastbatch")
VERIFY_DIR_VAR = "FASTBATCH_VERIFY_DIR"


def verify_dir() -> str:
    """Where FASTBATCH_VERIFY writes reproducers: ``FASTBATCH_VERIFY_DIR``, or
    ``fastbatch-verify`` in the temp dir."""
    return (os.environ.get(VERIFY_DIR_VAR)
            or os.path.join(tempfile.gettempdir(), "fastbatch-verify"))


def _equal(ours: Any, stock: Any) -> str | None:
    return None if ours == stock else f"fastbatch gave {ours!r}, vLLM gave {stock!r}"


@dataclasses.dataclass(frozen=True)
class Shadow:
    """How ``FASTBATCH_VERIFY`` checks one piece's calls against vLLM's code.

    ``snapshot(*args, **kwargs)``: before the call, a copy of what it reads
    and writes (the objects vLLM's code would change are copied, read-only
    ones may be shared), or None when this call has nothing to check (an
    early return).
    ``run(function, inputs)``: ``function`` (vLLM's original; fastbatch's
    replacement on replay) run on a fresh copy of ``inputs``; returns what it
    produced, in a comparable, picklable form (its *outcome*).
    ``outcome(inputs, result, *args, **kwargs)``: the live call's outcome, in
    the same form, read from the objects the call changed or returned.
    ``restore(inputs, stock_outcome, result, *args, **kwargs)``: puts vLLM's
    outcome in place of fastbatch's, in the very objects vLLM holds, and
    returns what the call must return.
    ``compare(ours, stock)``: why the outcomes differ, or None (default: ``==``).
    ``for_reproducer(inputs)``: ``inputs`` without what cannot be pickled
    (default: as they are); ``run`` must accept the result.
    """

    snapshot: Callable[..., Any]
    run: Callable[[Callable[..., Any], Any], Any]
    outcome: Callable[..., Any]
    restore: Callable[..., Any]
    compare: Callable[[Any, Any], str | None] = _equal
    for_reproducer: Callable[[Any], Any] = lambda inputs: inputs


class _Raised:
    """An outcome that is an exception (compared by type and message)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __repr__(self) -> str:
        return f"raised {type(self.exc).__name__}: {self.exc}"


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


class Patch:
    """One replaced vLLM attribute.

    ``activation_check(original, replacement)`` runs both on synthetic input
    and returns why they disagree, or None.  ``companions`` maps
    ``"module:qualname"`` of other vLLM code the replacement relies on to its
    verified fingerprints.  ``shadow`` tells ``FASTBATCH_VERIFY`` how to check
    a call (a piece without one stays stock while verification is on).
    ``needs_async_scheduling``: the piece has work only under async
    scheduling (the worker's runner report says so).  ``acts_under_v2``: the
    piece replaces code that Model Runner V2 uses too (the scheduler's).
    """

    def __init__(self, *, module: str, qualname: str, replacement: Callable[..., Any],
                 versions: tuple[str, ...], fingerprints: Mapping[str, str],
                 activation_check: Callable[[Any, Any], str | None],
                 companions: Mapping[str, Mapping[str, str]] | None = None,
                 shadow: Shadow | None = None,
                 needs_async_scheduling: bool = False, acts_under_v2: bool = False) -> None:
        self.module, self.qualname = module, qualname
        self.target = f"{module}.{qualname}"
        self.name = qualname.rsplit(".", 1)[-1]  # apply(name=...) sets the short name
        self.replacement = replacement
        self.versions = versions
        self.fingerprints = fingerprints
        self.activation_check = activation_check
        self.companions = companions or {}
        self.shadow = shadow
        self.needs_async_scheduling = needs_async_scheduling
        self.acts_under_v2 = acts_under_v2
        self._original: Any = None
        self._stored: Any = None  # the attribute as stored (a staticmethod, say)
        self._reset_verification()

    def _reset_verification(self) -> None:
        self.verify_rate = 0.0
        self.checked = 0  # calls compared with vLLM's code
        self.divergences = 0
        self.reproducers: list[str] = []

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

    def apply(self, force: bool = False, verify: float = 0.0, name: str | None = None) -> bool:
        """Install the replacement, once per process.  Returns True if installed.

        With ``force``, a failed version/shape guard only warns; the activation
        check still has to pass.  ``verify`` (0 to 1, ``FASTBATCH_VERIFY``):
        the share of calls checked against vLLM's code (``checked``); ``name``
        is the piece's ``FASTBATCH_DISABLE`` name, for the logs.
        """
        import vllm

        started = time.perf_counter()
        if self._original is not None:
            return True  # already applied in this process
        if name is not None:
            self.name = name
        if verify > 0 and self.shadow is None:
            logger.warning("fastbatch: %s left stock: FASTBATCH_VERIFY is on and this piece "
                           "has no shadow check", self.target)
            return False
        try:
            owner, attribute, method = _lookup(self.module, self.qualname)
        except ImportError as exc:  # a module this vLLM cannot import here
            logger.warning("fastbatch: %s cannot be imported (%s); leaving it stock",
                           self.module, exc)
            return False
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
        self._stored = inspect.getattr_static(owner, attribute)
        self._reset_verification()
        self.verify_rate = verify
        setattr(owner, attribute, self.checked_replacement(method, verify) if verify > 0
                else self.replacement)
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
        self._reset_verification()

    # FASTBATCH_VERIFY ---------------------------------------------------------

    def checked_replacement(self, original: Callable[..., Any],
                            rate: float) -> Callable[..., Any]:
        """The replacement, with ``rate`` (0 to 1) of its calls also run through
        ``original`` on a copy of their inputs and compared (``Shadow``); after
        a divergence every call goes to ``original``."""
        shadow, replacement = self.shadow, self.replacement
        if shadow is None:
            raise ValueError(f"{self.target} has no shadow check")
        sample = random.Random().random
        patch = self

        def checked(*args: Any, **kwargs: Any) -> Any:
            if patch.divergences:
                return original(*args, **kwargs)
            if rate < 1 and sample() >= rate:
                return replacement(*args, **kwargs)
            inputs = shadow.snapshot(*args, **kwargs)
            if inputs is None:
                return replacement(*args, **kwargs)
            return patch._compare_call(original, inputs, args, kwargs)

        checked.__fastbatch__ = True  # type: ignore[attr-defined]
        checked.__doc__ = replacement.__doc__
        return checked

    def _compare_call(self, original: Callable[..., Any], inputs: Any,
                      args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        shadow = self.shadow
        assert shadow is not None
        result = None
        try:
            result = self.replacement(*args, **kwargs)
        except Exception as exc:
            ours: Any = _Raised(exc)
        else:
            ours = shadow.outcome(inputs, result, *args, **kwargs)
        try:
            stock: Any = shadow.run(original, inputs)
        except Exception as exc:
            stock = _Raised(exc)
        self.checked += 1
        if isinstance(ours, _Raised) and isinstance(stock, _Raised):
            raise ours.exc  # vLLM's code fails on this input too
        if isinstance(ours, _Raised) or isinstance(stock, _Raised):
            problem: str | None = f"fastbatch {ours!r}, vLLM {stock!r}"
        else:
            problem = shadow.compare(ours, stock)
        if problem is None:
            return result
        self._report_divergence(problem, inputs, ours, stock)
        if isinstance(stock, _Raised):
            raise stock.exc  # what vLLM's own code would have done
        return shadow.restore(inputs, stock, result, *args, **kwargs)

    def _report_divergence(self, problem: str, inputs: Any, ours: Any, stock: Any) -> None:
        """Count it, switch the piece to stock, write a reproducer, log an error."""
        import vllm

        assert self.shadow is not None
        self.divergences += 1
        record = {
            "piece": self.name, "target": self.target, "why": problem,
            "vllm_version": vllm.__version__, "fastbatch_version": fastbatch.__version__,
            "compiled": fastbatch.COMPILED, "inputs": self.shadow.for_reproducer(inputs),
            "fastbatch_outcome": ours, "stock_outcome": stock,
        }
        folder = verify_dir()
        path = os.path.join(folder, f"{self.name}-{os.getpid()}-{time.time_ns()}.pkl")
        try:
            os.makedirs(folder, exist_ok=True)
            with open(path, "wb") as out:
                pickle.dump(record, out)
        except Exception as exc:  # the divergence still counts; say why no file
            where = f"no reproducer written ({type(exc).__name__}: {exc})"
        else:
            self.reproducers.append(path)
            where = f"reproducer: {path}"
        logger.error("fastbatch: FASTBATCH_VERIFY: piece %r (%s) diverged from vLLM: %s; "
                     "vLLM's result was kept, and %r runs vLLM's code for the rest of this "
                     "process; %s", self.name, self.target, problem[:2000], self.name, where)

    def replay(self, inputs: Any, original: Callable[..., Any] | None = None) -> str | None:
        """Run fastbatch's replacement and vLLM's code (``original``, by default
        the one this patch stands in for) on ``inputs`` of a reproducer; why
        their outcomes differ, or None."""
        shadow = self.shadow
        if shadow is None:
            raise ValueError(f"{self.target} has no shadow check")
        if original is None:
            original = self._original or _lookup(self.module, self.qualname)[2]
        outcomes = []
        for function in (self.replacement, original):
            try:
                outcomes.append(shadow.run(function, inputs))
            except Exception as exc:
                outcomes.append(_Raised(exc))
        ours, stock = outcomes
        if isinstance(ours, _Raised) or isinstance(stock, _Raised):
            same = (type(ours) is type(stock) and isinstance(ours, _Raised)
                    and type(ours.exc) is type(stock.exc))
            return None if same else f"fastbatch {ours!r}, vLLM {stock!r}"
        return shadow.compare(ours, stock)
