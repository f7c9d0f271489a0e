"""Test-only vLLM plugin: lets the end-to-end tests run vLLM's CPU backend on
the paths fastbatch serves.

Async scheduling.  vLLM's ``CpuPlatform.check_and_update_config`` switches
``scheduler_config.async_scheduling`` off silently; with it off,
``InputBatch.update_async_output_token_ids`` returns at once and the end-to-end
tests would prove nothing.  With ``FASTBATCH_E2E_FORCE_ASYNC=1`` this plugin
wraps that hook and puts back the value vLLM had resolved and validated
before it, in every process vLLM loads general plugins in (the driver before
its config is built, EngineCore, each worker).  Greedy outputs with async
scheduling on are token for token those with it off (the tests check that).

Ray.  vLLM's CPU platform has no Ray device key (``CpuPlatform.ray_device_key``
is ``""``), so ``distributed_executor_backend="ray"`` stops at once with
"ValueError: current platform cpu does not support ray."
(``vllm/v1/executor/ray_utils.py::initialize_ray_cluster``).  ``ray_on_cpu``
gives it the key ``"GPU"``: Ray then places each vLLM worker on one logical
GPU that the local Ray instance declares (``ray.init(num_gpus=...)``) and the
worker, a CPU worker still, ignores.  It must run in the driver before the
engine is built and in every Ray worker process before vLLM's actor asks Ray
for its device ids, which is before the worker loads any plugin: hence a Ray
``worker_process_setup_hook`` (tools/vllm_generate.py ``--executor ray``), not
``register``.
"""

import os


def register() -> None:
    if os.environ.get("FASTBATCH_E2E_FORCE_ASYNC") != "1":
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.platforms.cpu import CpuPlatform

    hook = CpuPlatform.__dict__["check_and_update_config"].__func__
    if getattr(hook, "keeps_async_scheduling", False):
        return  # already wrapped in this process

    def check_and_update_config(cls, vllm_config):
        wanted = vllm_config.scheduler_config.async_scheduling
        hook(cls, vllm_config)
        if wanted:
            vllm_config.scheduler_config.async_scheduling = True

    check_and_update_config.keeps_async_scheduling = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def ray_on_cpu() -> None:
    """Give vLLM's CPU platform a Ray device key (see the module docstring)."""
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.ray_device_key = "GPU"
