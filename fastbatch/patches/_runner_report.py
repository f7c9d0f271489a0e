"""Patch: ``vllm.v1.worker.worker_base.WorkerWrapperBase.init_device``, the
seam of the runner report.

The uniproc, multiprocessing and Ray executors all initialise a worker
through it (the model runner is built inside it).  The replacement calls
vLLM's method unchanged, then logs once which model runner the worker built
and which of fastbatch's pieces act there (``vllm_plugin.runner_report``).
Not a piece: it replaces no work, and is applied whenever ``FASTBATCH`` is on.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from fastbatch import model_runner, vllm_plugin
from fastbatch.patches._patch import Patch

logger = logging.getLogger("vllm.fastbatch")


def init_device_and_report(self: Any, *args: Any, **kwargs: Any) -> Any:
    """vLLM's ``WorkerWrapperBase.init_device``, unchanged, then
    ``runner_report`` logged once for the worker it built."""
    result = PATCH.original()(self, *args, **kwargs)
    try:
        vllm_plugin._runner_seen = model_runner.runner_kind(self)
        level, line = vllm_plugin.runner_report(self)
    except Exception as exc:  # a report must never break the worker
        level, line = logging.WARNING, f"fastbatch: cannot tell the model runner ({exc})"
    logger.log(level, line)
    return result


def _takes_the_worker_alone(method: Any, replacement: Any) -> str | None:
    """The executors call ``init_device()`` with no argument but the wrapper;
    the report passes every argument through, so that call must bind."""
    try:
        inspect.signature(method).bind(object())
    except TypeError as exc:
        return f"vLLM's init_device does not take the wrapper alone ({exc})"
    return None


PATCH = Patch(
    "vllm.v1.worker.worker_base:WorkerWrapperBase.init_device", init_device_and_report,
    fingerprints={
        "e6a7a6ef436a3e655be9297f609c3013f8bd8d92a29790a354dae37c682683de":
            "vLLM 0.21.0-0.32.0: self.worker.init_device() under the config context",
        "5e25fd87d47510926b062a634aff9acc23e61f7ab2d377784a46ed0327f9fe0b":
            "vLLM 0.33.0: the same, then the worker extension's init_worker_extension hook",
    },
    activation_check=_takes_the_worker_alone)
