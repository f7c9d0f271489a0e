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

The switch is deliberately not named ``VLLM_*``: vLLM warns about unknown
``VLLM_`` variables.  Ray workers get it because vLLM's Ray executor copies
the driver's environment to them.
"""

from __future__ import annotations

import logging
import os
from typing import Any

ENV_VAR = "FASTBATCH"
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


def register() -> None:
    """Entry point of ``vllm.general_plugins``: apply the patches if switched on."""
    current = mode()
    if current == "off":
        return
    from fastbatch.patches import gpu_input_batch

    gpu_input_batch.apply(force=current == "force")


def status(worker: Any = None) -> dict[str, Any]:
    """What fastbatch does in this process, for ``llm.collective_rpc(status)``.

    ``worker`` is what ``collective_rpc`` passes in (the worker, or its
    wrapper); when given, ``async_scheduling`` says whether its model runner
    runs with async scheduling, without which the method has nothing to do.
    """
    import fastbatch
    from fastbatch.patches import gpu_input_batch

    worker = getattr(worker, "worker", worker)  # unwrap a WorkerWrapperBase
    runner = getattr(worker, "model_runner", None)
    return {
        "pid": os.getpid(),
        "mode": mode(),
        "installed": bool(gpu_input_batch.is_applied()),
        "compiled": fastbatch.COMPILED,
        "async_scheduling": getattr(runner, "use_async_scheduling", None),
        "stats": fastbatch.stats(),
    }
