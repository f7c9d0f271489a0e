"""Test-only vLLM plugin: async scheduling stays on with the CPU backend.

vLLM's ``CpuPlatform.check_and_update_config`` switches
``scheduler_config.async_scheduling`` off silently; with it off,
``InputBatch.update_async_output_token_ids`` returns at once and the end-to-end
tests would prove nothing.  With ``FASTBATCH_E2E_FORCE_ASYNC=1`` this plugin
wraps that hook and puts back the value vLLM had resolved and validated
before it, in every process vLLM loads general plugins in (the driver before
its config is built, EngineCore, each worker).  Greedy outputs with async
scheduling on are token for token those with it off (the tests check that).
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
