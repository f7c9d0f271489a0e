"""Which vLLM model runner a worker uses, and so whether fastbatch's pieces act there.

fastbatch's pieces replace code of vLLM's V1 model runner
(``vllm/v1/worker/gpu_model_runner.py::GPUModelRunner`` and the runners that
subclass it, such as the CPU one).  Model Runner V2
(``vllm/v1/worker/gpu/model_runner.py::GPUModelRunner`` and its subclasses)
keeps that state on the device and never calls them.  vLLM picks one per
worker from ``VllmConfig.use_v2_model_runner`` (the worker keeps the answer
as ``worker.use_v2_model_runner`` and builds the runner from it, in
``Worker._make_model_runner`` or ``CPUWorker.init_device``).

Nothing here imports vLLM's runner modules: a runner's class is looked up
among the modules already loaded (a runner built from a module means that
module is loaded).
"""

from __future__ import annotations

import sys
from typing import Any

V1_RUNNER = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner")
V2_RUNNER = ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner")
RUNNERS = ("v1", "v2", "unknown")


def _is_instance(runner: Any, module_and_class: tuple[str, str]) -> bool:
    module = sys.modules.get(module_and_class[0])
    cls = getattr(module, module_and_class[1], None)
    return isinstance(cls, type) and isinstance(runner, cls)


def runner_kind(worker: Any) -> str:
    """``"v1"``, ``"v2"`` or ``"unknown"``: the model runner of ``worker`` (a
    vLLM worker, or its ``WorkerWrapperBase``).

    A built runner is judged by its class; before it is built (or for a
    runner of neither family), by the worker's own decision
    (``use_v2_model_runner``, from ``VllmConfig.use_v2_model_runner``).
    """
    worker = getattr(worker, "worker", worker)  # unwrap a WorkerWrapperBase
    runner = getattr(worker, "model_runner", None)
    if runner is not None:
        if _is_instance(runner, V1_RUNNER):
            return "v1"
        if _is_instance(runner, V2_RUNNER):
            return "v2"
    decided = getattr(worker, "use_v2_model_runner", None)
    if decided is True:
        return "v2"
    if decided is False and runner is None:
        return "v1"  # the worker will build the V1 runner
    return "unknown"


def default_runner() -> tuple[str, str]:
    """The runner this vLLM picks here for a plain model, by vLLM's own
    ``VllmConfig.use_v2_model_runner`` on a default config (the current
    platform and environment, ``VLLM_USE_V2_MODEL_RUNNER`` included), and why.
    Imports vLLM's config, starts nothing."""
    import vllm.envs as envs
    from vllm.config import VllmConfig

    use_v2 = VllmConfig().use_v2_model_runner
    explicit = envs.VLLM_USE_V2_MODEL_RUNNER
    if explicit is not None:
        why = f"VLLM_USE_V2_MODEL_RUNNER={int(explicit)} is set"
    elif use_v2:
        why = "vLLM's default where it supports the configuration"
    else:
        why = "Model Runner V2 needs Triton, which this platform does not have"
        triton = getattr(sys.modules.get("vllm.config.vllm"), "HAS_TRITON", None)
        if triton:
            why = "vLLM chose it for this platform"
    return ("v2" if use_v2 else "v1"), why
