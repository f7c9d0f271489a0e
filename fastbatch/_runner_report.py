"""Patch: ``vllm.v1.worker.worker_base.WorkerWrapperBase.init_device``, the
seam of the runner report.

The uniproc, multiprocessing and Ray executors all initialise a worker
through it (the model runner is built inside it).  The replacement calls
vLLM's method unchanged, then logs once which model runner the worker built
and which of fastbatch's pieces act there (``runner_report``).
Not a piece: it replaces no work, and is applied whenever ``FASTBATCH`` is on.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from fastbatch import model_runner, registry
from fastbatch.patches._patch import Patch

logger = logging.getLogger("vllm.fastbatch")


def init_device_and_report(self: Any, *args: Any, **kwargs: Any) -> Any:
    """vLLM's ``WorkerWrapperBase.init_device``, unchanged, then
    ``runner_report`` logged once for the worker it built."""
    global _seen
    result = PATCH.original()(self, *args, **kwargs)
    try:
        _seen = model_runner.runner_kind(self)
        level, line = runner_report(self)
    except Exception as exc:  # a report must never break the worker
        level, line = logging.WARNING, f"fastbatch: cannot tell the model runner ({exc})"
    logger.log(level, line)
    return result


_seen = "unknown"  # the kind of the last runner reported in this process


def last_seen() -> str:
    """The model runner (``"v1"``, ``"v2"``, ``"unknown"``) of the last
    worker reported in this process."""
    return _seen


def _pieces_in(runner_kind: str, async_scheduling: Any) -> tuple[list[str], list[str]]:
    """The installed pieces that act with this runner, and those that stay idle."""
    acting, idle = [], []
    for piece in registry.pieces():
        if not piece.is_applied():
            continue
        patch = piece.main
        acts_in_v1 = async_scheduling or not patch.needs_async_scheduling
        if patch.acts_under_v2 if runner_kind == "v2" else runner_kind == "v1" and acts_in_v1:
            acting.append(piece.name)
        else:
            idle.append(piece.name)
    return acting, idle


def runner_report(worker: Any) -> tuple[int, str]:
    """The log level and line that say which runner ``worker`` built and what
    fastbatch's pieces do there."""
    worker = getattr(worker, "worker", worker)
    kind = model_runner.runner_kind(worker)
    runner = getattr(worker, "model_runner", None)
    name = type(runner).__name__ if runner is not None else "not built yet"
    if kind == "v2":
        acting, _ = _pieces_in(kind, None)
        removed = model_runner.v1_removed()
        line = (f"fastbatch: Model Runner V2 in use ({name}): fastbatch's runner pieces "
                "serve the V1 runner and stay idle here; VLLM_USE_V2_MODEL_RUNNER=0 selects V1"
                if removed is None else
                f"fastbatch: Model Runner V2 in use ({name}): fastbatch's runner pieces have "
                f"{removed}")
        if acting:
            line += (f"; {', '.join(acting)} still act{'s' if len(acting) == 1 else ''} "
                     "(vLLM's scheduler, output processor and API server are the same under "
                     "both runners)")
        return logging.WARNING, line
    if kind == "unknown":
        return logging.WARNING, (
            f"fastbatch: this worker's model runner ({name}) is neither vLLM's V1 runner "
            "nor Model Runner V2; fastbatch's pieces may stay idle here")
    async_scheduling = getattr(runner, "use_async_scheduling", None)
    acting, idle = _pieces_in(kind, async_scheduling)
    line = (f"fastbatch: V1 model runner in use ({name}, async scheduling "
            f"{'on' if async_scheduling else 'off'})")
    if not acting and not idle:
        return logging.WARNING, f"{line}: no fastbatch piece is installed in this process"
    line += f": {', '.join(acting) or 'no piece'} can act here"
    if idle:
        line += f"; {', '.join(idle)} stay idle (they need async scheduling)"
    return logging.INFO, line


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
