"""``FASTBATCH_VERIFY``: every piece's calls, or a sampled share of them,
checked against vLLM's own code at run time.

A piece whose ``Patch`` has a ``Shadow`` (how to copy the call's inputs, run
vLLM's code on the copy, and put vLLM's result in place) gets its installed
replacement wrapped by ``checked_replacement``.  On a divergence the call
returns vLLM's result, a reproducer is written (``replay`` runs it again),
and the piece runs vLLM's code for the rest of the process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import pickle
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import fastbatch

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
    ``check(inputs, result, *args, **kwargs)`` (optional): right after
    fastbatch's call (``result`` is None where it raised), whether this call
    is compared at all; False leaves its result (or exception) as it is,
    uncounted, and vLLM's code is not run.  For a piece that hands some calls
    to vLLM's own method itself: those have nothing to check, and vLLM's
    method must not run twice.  (``run`` may act on live objects that
    ``snapshot`` kept, after fastbatch's call: where fastbatch's answer, when
    right, changes nothing, running vLLM's code on the live state is the
    check, and its effect is vLLM's result in place.)
    """

    snapshot: Callable[..., Any]
    run: Callable[[Callable[..., Any], Any], Any]
    outcome: Callable[..., Any]
    restore: Callable[..., Any]
    compare: Callable[[Any, Any], str | None] = _equal
    for_reproducer: Callable[[Any], Any] = lambda inputs: inputs
    check: Callable[..., bool] | None = None


class Verification:
    """One patch's ``FASTBATCH_VERIFY`` state, written by this module only:
    ``rate`` (the share of calls checked), ``checked`` (calls compared with
    vLLM's code), ``divergences`` (those found different), ``reproducers``
    (the files written) and ``piece_diverged``.  After a divergence in any
    patch of the piece (``siblings``, this one included), all of them run
    vLLM's code: ``piece_diverged`` is kept for the checked calls to read as
    one attribute."""

    def __init__(self) -> None:
        self._siblings: tuple[Verification, ...] = (self,)
        self.piece_diverged = False
        self.reset()

    def reset(self, rate: float = 0.0) -> None:
        """Counters at zero, ``rate`` of the calls to be checked."""
        self.rate = rate
        self.checked = 0
        self.divergences = 0
        self.reproducers: list[str] = []

    @property
    def divergences(self) -> int:
        return self._divergences

    @divergences.setter
    def divergences(self, value: int) -> None:
        self._divergences = value
        self._share_divergence()

    @property
    def siblings(self) -> tuple[Verification, ...]:
        return self._siblings

    @siblings.setter
    def siblings(self, verifications: tuple[Verification, ...]) -> None:
        self._siblings = tuple(verifications)
        self._share_divergence()

    def _share_divergence(self) -> None:
        diverged = any(sibling._divergences for sibling in self._siblings)
        for sibling in self._siblings:
            sibling.piece_diverged = diverged


class Checked(Protocol):
    """What this module reads of a patch (``fastbatch.patches._patch.Patch``)."""

    name: str
    target: str
    replacement: Callable[..., Any]
    shadow: Shadow | None
    verification: Verification

    def original(self) -> Any: ...

    def current(self) -> Any: ...


_suspended = 0  # > 0 while ``suspended()`` is active


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """While active, checked replacements call fastbatch's replacement
    unchecked and uncounted (for code that is not the user's traffic: other
    pieces' activation checks, which run real vLLM objects through the
    installed methods)."""
    global _suspended
    _suspended += 1
    try:
        yield
    finally:
        _suspended -= 1


class _Raised:
    """An outcome that is an exception (compared by type and message)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __repr__(self) -> str:
        return f"raised {type(self.exc).__name__}: {self.exc}"


def checked_replacement(patch: Checked, original: Callable[..., Any],
                        rate: float) -> Callable[..., Any]:
    """The replacement, with ``rate`` (0 to 1) of its calls also run through
    ``original`` on a copy of their inputs and compared (``Shadow``); after
    a divergence every call goes to ``original``."""
    shadow, replacement = patch.shadow, patch.replacement
    if shadow is None:
        raise ValueError(f"{patch.target} has no shadow check")
    sample = random.Random().random
    signature = _signature(original)
    verification = patch.verification

    def checked(*args: Any, **kwargs: Any) -> Any:
        if verification.piece_diverged:  # the piece went stock
            return original(*args, **kwargs)
        if _suspended or (rate < 1 and sample() >= rate):
            return replacement(*args, **kwargs)
        if kwargs and signature is not None:
            # The shadow sees the call as vLLM's signature binds it: an argument
            # passed by keyword comes positionally, as vLLM's own callers pass it.
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:  # vLLM's function raises on this call too
                return replacement(*args, **kwargs)
            args, kwargs = bound.args, bound.kwargs
        inputs = shadow.snapshot(*args, **kwargs)
        if inputs is None:
            return replacement(*args, **kwargs)
        return _compare_call(patch, original, inputs, args, kwargs)

    checked.__fastbatch__ = True  # type: ignore[attr-defined]
    checked.__doc__ = replacement.__doc__
    return checked


def _signature(function: Callable[..., Any]) -> inspect.Signature | None:
    """``function``'s signature, or None where it has none to read."""
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):
        return None


def _compare_call(patch: Checked, original: Callable[..., Any], inputs: Any,
                  args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    shadow = patch.shadow
    assert shadow is not None
    result = None
    try:
        result = patch.replacement(*args, **kwargs)
    except Exception as exc:
        if shadow.check is not None and not shadow.check(inputs, None, *args, **kwargs):
            raise
        ours: Any = _Raised(exc)
    else:
        if shadow.check is not None and not shadow.check(inputs, result, *args, **kwargs):
            return result
        ours = shadow.outcome(inputs, result, *args, **kwargs)
    try:
        stock: Any = shadow.run(original, inputs)
    except Exception as exc:
        stock = _Raised(exc)
    patch.verification.checked += 1
    if isinstance(ours, _Raised) and isinstance(stock, _Raised):
        raise ours.exc  # vLLM's code fails on this input too
    if isinstance(ours, _Raised) or isinstance(stock, _Raised):
        problem: str | None = f"fastbatch {ours!r}, vLLM {stock!r}"
    else:
        problem = shadow.compare(ours, stock)
    if problem is None:
        return result
    _report_divergence(patch, problem, inputs, ours, stock)
    if isinstance(stock, _Raised):
        raise stock.exc  # what vLLM's own code would have done
    return shadow.restore(inputs, stock, result, *args, **kwargs)


def _report_divergence(patch: Checked, problem: str, inputs: Any, ours: Any, stock: Any) -> None:
    """Count it, switch the piece to stock, write a reproducer, log an error."""
    import vllm

    assert patch.shadow is not None
    patch.verification.divergences += 1
    record = {
        "piece": patch.name, "target": patch.target, "why": problem,
        "vllm_version": vllm.__version__, "fastbatch_version": fastbatch.__version__,
        "compiled": fastbatch.COMPILED, "inputs": patch.shadow.for_reproducer(inputs),
        "fastbatch_outcome": ours, "stock_outcome": stock,
    }
    folder = verify_dir()
    path = os.path.join(folder, f"{patch.name}-{os.getpid()}-{time.time_ns()}.pkl")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(path, "wb") as out:
            pickle.dump(record, out)
    except Exception as exc:  # the divergence still counts; say why no file
        where = f"no reproducer written ({type(exc).__name__}: {exc})"
    else:
        patch.verification.reproducers.append(path)
        where = f"reproducer: {path}"
    logger.error("fastbatch: FASTBATCH_VERIFY: piece %r (%s) diverged from vLLM: %s; "
                 "vLLM's result was kept, and %r runs vLLM's code for the rest of this "
                 "process; %s", patch.name, patch.target, problem[:2000], patch.name, where)


def replay(patch: Checked, inputs: Any, original: Callable[..., Any] | None = None) -> str | None:
    """Run fastbatch's replacement and vLLM's code (``original``, by default
    the one this patch stands in for) on ``inputs`` of a reproducer; why
    their outcomes differ, or None."""
    shadow = patch.shadow
    if shadow is None:
        raise ValueError(f"{patch.target} has no shadow check")
    if original is None:
        original = patch.original() or patch.current()
    outcomes = []
    for function in (patch.replacement, original):
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
