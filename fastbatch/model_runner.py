"""Which vLLM model runner a worker uses, and so which of fastbatch's pieces act there.

Nine of fastbatch's pieces replace code of vLLM's V1 model runner and its
sampler (``vllm/v1/worker/gpu_model_runner.py::GPUModelRunner`` and the
runners that subclass it, such as the CPU one); the others replace code of
the scheduler, the output processor and the API server, which every runner
shares.  Model Runner V2 (``vllm/v1/worker/gpu/model_runner.py::GPUModelRunner``
and its subclasses) keeps the runner's state on the device and never calls
the V1 runner's code.  Up to vLLM 0.33.0 vLLM picks one per worker from
``VllmConfig.use_v2_model_runner`` (the worker keeps the answer as
``worker.use_v2_model_runner`` and builds the runner from it, in
``Worker._make_model_runner`` or ``CPUWorker.init_device``).  vLLM 0.34.0
removed Model Runner V1: every worker builds V2, and the V1 runner's pieces
have no target there (``v1_removed``).

Nothing here imports vLLM's runner modules: a runner's class is looked up
among the modules already loaded (a runner built from a module means that
module is loaded).
"""

from __future__ import annotations

import importlib.util
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


def v1_removed() -> str | None:
    """Why the V1 runner's pieces have no target in the installed vLLM (it has
    no Model Runner V1: 0.34.0 and later), or None where it has one.  Looks
    for the runner's module without importing it."""
    try:
        found = importlib.util.find_spec(V1_RUNNER[0]) is not None
    except ImportError:  # no vLLM at all
        return None
    if found:
        return None
    import vllm

    return f"no target in vLLM {vllm.__version__}: Model Runner V1 was removed"


def default_runner() -> tuple[str, str]:
    """The runner this vLLM picks here for a plain model, by vLLM's own
    ``VllmConfig.use_v2_model_runner`` on a default config (the current
    platform and environment, ``VLLM_USE_V2_MODEL_RUNNER`` included), and why;
    V2 where this vLLM has no other runner.  Imports vLLM's config, starts
    nothing."""
    import vllm.envs as envs
    from vllm.config import VllmConfig

    if v1_removed() is not None:
        import vllm

        return "v2", f"the only runner of vLLM {vllm.__version__}: Model Runner V1 was removed"
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
