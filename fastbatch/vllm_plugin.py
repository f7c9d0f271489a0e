"""vLLM general plugin: ``FASTBATCH=1`` turns fastbatch on in every vLLM process.

vLLM calls ``register()`` (entry point group ``vllm.general_plugins``) once in
each process it starts: the API server or driver, EngineCore, and every
worker, for the uniproc, multiprocessing and Ray executors.  With the switch
off (unset, empty, ``0``) nothing of vLLM is imported or touched.

``FASTBATCH``:
  ``1``/``true``/``yes``/``on`` (any case)  patch, if vLLM is a verified target
  ``force``                                patch even if the guard does not
                                           recognise vLLM (the activation
                                           check still has to pass)
  unset, empty, ``0``/``false``/``no``/``off``  stock vLLM
  anything else                            a warning, stock vLLM

``FASTBATCH_DISABLE`` (comma- or space-separated, any case) leaves single
pieces stock while the others are on, by their names
(``fastbatch.registry.NAMES``; ``python -m fastbatch`` lists them with what
each replaces).  The names of fastbatch 0.1 (``output``, ``scheduler``, ...)
still work, with a deprecation warning.  Unknown names are reported in a
warning and ignored.

``FASTBATCH_VERIFY`` checks fastbatch against vLLM's own code at run time:
  unset, empty, ``0``/``false``/``no``/``off``  off
  ``1``/``true``/``yes``/``on``            every replaced call also runs vLLM's
                                           code on a copy of its inputs
  a number between 0 and 1 (``0.01``)      that share of the calls, sampled
  anything else                            a warning, off
A divergence is logged as an error with a reproducer in
``FASTBATCH_VERIFY_DIR`` (default: ``fastbatch-verify`` in the temp dir);
the call returns vLLM's result and that piece runs vLLM's code from then on.

Without the compiled kernel (``fastbatch.COMPILED`` false) nothing is
patched: the pure-Python reference would be slower than vLLM's own code.

Each worker logs once which model runner it built and whether the pieces act
there (``fastbatch.model_runner``).

The switches are deliberately not named ``VLLM_*``: vLLM warns about unknown
``VLLM_`` variables.  Ray workers get them because vLLM's Ray executor copies
the driver's environment to them.
"""

from __future__ import annotations

import importlib.machinery
import logging
import math
import os
import pickle
import sys
from typing import Any

from fastbatch import model_runner, registry

ENV_VAR = "FASTBATCH"
DISABLE_VAR = "FASTBATCH_DISABLE"
VERIFY_VAR = "FASTBATCH_VERIFY"
_ON = {"1", "true", "yes", "on"}
_OFF = {"", "0", "false", "no", "off"}

logger = logging.getLogger("vllm.fastbatch")


def mode() -> str:
    """``"on"``, ``"force"`` or ``"off"``, from the ``FASTBATCH`` variable."""
    raw = os.environ.get(ENV_VAR, "").strip().lower()
    if raw in _ON:
        return "on"
    if raw == "force":
        return "force"
    if raw not in _OFF:
        logger.warning("fastbatch: ignoring %s=%r (expected 1, true, yes, force or 0); "
                       "leaving vLLM stock", ENV_VAR, os.environ[ENV_VAR])
    return "off"


def disabled() -> set[str]:
    """The piece names listed in ``FASTBATCH_DISABLE`` (a deprecated name: its
    piece, with a warning; an unknown one: a warning)."""
    raw = os.environ.get(DISABLE_VAR, "")
    names = {name.lower() for name in raw.replace(",", " ").split()}
    for old in sorted(names & registry.DEPRECATED_NAMES.keys()):
        logger.warning("fastbatch: %s=%s is deprecated: the piece is now called %r",
                       DISABLE_VAR, old, registry.DEPRECATED_NAMES[old])
        names.add(registry.DEPRECATED_NAMES[old])
    names -= registry.DEPRECATED_NAMES.keys()
    unknown = names - set(registry.NAMES)
    if unknown:
        logger.warning("fastbatch: ignoring unknown %s entries %s (known: %s)",
                       DISABLE_VAR, sorted(unknown), ", ".join(registry.NAMES))
    return names & set(registry.NAMES)


def verify_rate() -> float:
    """The share of replaced calls ``FASTBATCH_VERIFY`` checks: 0 (off) to 1."""
    raw = os.environ.get(VERIFY_VAR, "").strip().lower()
    if raw in _ON:
        return 1.0
    if raw in _OFF:
        return 0.0
    try:
        rate = float(raw)
    except ValueError:
        rate = math.nan
    if 0 <= rate <= 1:
        return rate
    logger.warning("fastbatch: ignoring %s=%r (expected 1, 0, or a share of calls between "
                   "0 and 1 such as 0.01); not verifying", VERIFY_VAR, os.environ[VERIFY_VAR])
    return 0.0


def kernel_missing_reason() -> str:
    """Why the compiled kernel is not in use, from what the package folder holds."""
    import fastbatch

    folder = os.path.dirname(fastbatch.__file__)
    built = sorted(os.path.relpath(os.path.join(where, name), folder)
                   for where, _, names in os.walk(folder) for name in names
                   if name.endswith((".so", ".pyd")))
    if not built:
        return f"no compiled module in {folder} (a source tree without a build?)"
    loadable = importlib.machinery.EXTENSION_SUFFIXES
    return (f"the compiled modules in {folder} ({', '.join(built)}) do not load in this "
            f"interpreter (Python {sys.version.split()[0]}, which loads "
            f"{', '.join(loadable)}; see the RuntimeWarning at import)")


_warned_no_kernel = False


def register() -> None:
    """Entry point of ``vllm.general_plugins``: apply the patches if switched on."""
    global _warned_no_kernel

    current = mode()
    if current == "off":
        return
    import fastbatch  # not before: off, importing it would only warn about a missing build

    if not fastbatch.COMPILED:
        if not _warned_no_kernel:
            _warned_no_kernel = True
            logger.warning("fastbatch: leaving vLLM stock: the compiled kernel is not "
                           "available, and the pure-Python fallback is slower than vLLM's "
                           "own code; %s. Install a fastbatch wheel built for this "
                           "interpreter.", kernel_missing_reason())
        return
    skipped = disabled()
    rate = verify_rate()
    removed = model_runner.v1_removed()
    for piece in registry.pieces():
        if piece.name in skipped:
            if not piece.is_applied():
                logger.info("fastbatch: %s left stock (%s=%s)", piece.name, DISABLE_VAR,
                            os.environ[DISABLE_VAR])
            continue
        if removed is not None and not piece.main.acts_under_v2:
            continue  # said once for the group, below
        piece.apply(force=current == "force", verify=rate)
    _report_without_target(removed)
    from fastbatch import _runner_report

    _runner_report.PATCH.apply(force=current == "force")


_reported_without_target = False


def without_target() -> dict[str, str]:
    """The pieces that have nothing to replace in the installed vLLM, with
    why: the V1 runner's pieces where vLLM has no Model Runner V1."""
    removed = model_runner.v1_removed()
    if removed is None:
        return {}
    return {piece.name: removed for piece in registry.pieces() if not piece.main.acts_under_v2}


def _report_without_target(removed: str | None) -> None:
    """One line per process for the pieces without a target, as a group."""
    global _reported_without_target
    if removed is None or _reported_without_target:
        return
    _reported_without_target = True
    names = [piece.name for piece in registry.pieces() if not piece.main.acts_under_v2]
    logger.info("fastbatch: %d pieces have %s (%s); the scheduler's, the output "
                "processor's and the API server's pieces act", len(names), removed,
                ", ".join(names))


def revert() -> None:
    """Put vLLM's own code back everywhere fastbatch replaced it in this
    process: every piece, and the runner report's hook."""
    for piece in registry.pieces():
        piece.revert()
    from fastbatch import _runner_report

    _runner_report.PATCH.revert()


def replay(path: str) -> str | None:
    """Replay a ``FASTBATCH_VERIFY`` reproducer: run fastbatch's piece and vLLM's
    code (the one installed here) on its inputs; why they differ, or None."""
    with open(path, "rb") as source:
        record = pickle.load(source)
    piece = registry.piece(record["piece"])
    patch = next(patch for patch in piece.patches if patch.target == record["target"])
    return patch.replay(record["inputs"])


def status(worker: Any = None) -> dict[str, Any]:
    """What fastbatch does in this process, for ``llm.collective_rpc(status)``.

    ``installed`` is true if any patch is applied, ``patches`` says which
    (by ``FASTBATCH_DISABLE`` name), ``without_target`` which pieces have
    nothing to replace in this vLLM, and why (the V1 runner's, on a vLLM
    without Model Runner V1).  ``worker`` is what ``collective_rpc``
    passes in (the worker, or its wrapper); when given, ``async_scheduling``
    says whether its model runner runs with async scheduling, without which
    the two ``update_async_*`` methods have nothing to do, and ``runner``
    which model runner it built (``"v1"``, ``"v2"``, ``"unknown"``; without a
    worker, the last one this process reported).  ``verify``: the
    ``FASTBATCH_VERIFY`` share of calls checked, and per piece the calls
    checked and the divergences found (a piece with one runs vLLM's code).
    ``penalty_masking_skipped`` lists the modules whose ``apply_all_penalties``
    is fastbatch's (no masking after fastbatch's conversion).
    """
    import fastbatch
    from fastbatch import _runner_report

    worker = getattr(worker, "worker", worker)  # unwrap a WorkerWrapperBase
    runner = getattr(worker, "model_runner", None)
    pieces = list(registry.pieces())
    return {
        "pid": os.getpid(),
        "mode": mode(),
        "installed": any(piece.is_applied() for piece in pieces),
        "patches": {piece.name: piece.is_applied() for piece in pieces},
        "without_target": without_target(),
        "penalty_masking_skipped": sorted(
            module for module, skipped in registry.piece("penalty_output_tokens")
            .module.masking_skipped().items() if skipped),
        "compiled": fastbatch.COMPILED,
        "async_scheduling": getattr(runner, "use_async_scheduling", None),
        "runner": (_runner_report.last_seen() if worker is None
                   else model_runner.runner_kind(worker)),
        "verify": {
            "rate": max((piece.main.verify_rate for piece in pieces), default=0.0),
            "checked": {piece.name: sum(p.checked for p in piece.patches) for piece in pieces},
            "divergences": {piece.name: sum(p.divergences for p in piece.patches)
                            for piece in pieces},
        },
        "stats": fastbatch.stats(),
    }
