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
pieces stock while the others are on:
  ``output``     ``InputBatch.update_async_output_token_ids``
  ``spec``       ``InputBatch.update_async_spec_token_ids``
  ``penalties``  ``penalties._convert_to_tensors``
  ``scheduler``  ``KVCacheManager.allocate_slots`` (the scheduler's decode fast path)
Unknown names are reported in a warning and ignored.

The switches are deliberately not named ``VLLM_*``: vLLM warns about unknown
``VLLM_`` variables.  Ray workers get them because vLLM's Ray executor copies
the driver's environment to them.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

ENV_VAR = "FASTBATCH"
DISABLE_VAR = "FASTBATCH_DISABLE"
# FASTBATCH_DISABLE name -> the module of that patch (fastbatch.patches).
PATCHES = {
    "output": "fastbatch.patches.async_output_token_ids",
    "spec": "fastbatch.patches.async_spec_token_ids",
    "penalties": "fastbatch.patches.penalty_output_tokens",
    "scheduler": "fastbatch.patches.decode_slots",
}
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
    """The patch names listed in ``FASTBATCH_DISABLE`` (unknown ones: a warning)."""
    raw = os.environ.get(DISABLE_VAR, "")
    names = {name.lower() for name in raw.replace(",", " ").split()}
    unknown = names - PATCHES.keys()
    if unknown:
        logger.warning("fastbatch: ignoring unknown %s entries %s (known: %s)",
                       DISABLE_VAR, sorted(unknown), ", ".join(PATCHES))
    return names & PATCHES.keys()


def register() -> None:
    """Entry point of ``vllm.general_plugins``: apply the patches if switched on."""
    current = mode()
    if current == "off":
        return
    skipped = disabled()
    for name, module in PATCHES.items():
        patch = importlib.import_module(module)
        if name in skipped:
            if not patch.is_applied():
                logger.info("fastbatch: %s left stock (%s=%s)", patch.TARGET,
                            DISABLE_VAR, os.environ[DISABLE_VAR])
            continue
        patch.apply(force=current == "force")


def status(worker: Any = None) -> dict[str, Any]:
    """What fastbatch does in this process, for ``llm.collective_rpc(status)``.

    ``installed`` is true if any patch is applied, ``patches`` says which
    (by ``FASTBATCH_DISABLE`` name).  ``worker`` is what ``collective_rpc``
    passes in (the worker, or its wrapper); when given, ``async_scheduling``
    says whether its model runner runs with async scheduling, without which
    the two ``update_async_*`` methods have nothing to do.
    """
    import fastbatch

    worker = getattr(worker, "worker", worker)  # unwrap a WorkerWrapperBase
    runner = getattr(worker, "model_runner", None)
    patches = {name: bool(importlib.import_module(module).is_applied())
               for name, module in PATCHES.items()}
    return {
        "pid": os.getpid(),
        "mode": mode(),
        "installed": any(patches.values()),
        "patches": patches,
        "compiled": fastbatch.COMPILED,
        "async_scheduling": getattr(runner, "use_async_scheduling", None),
        "stats": fastbatch.stats(),
    }
