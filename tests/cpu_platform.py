"""Test tooling: vLLM's CPU platform configuring without triton-cpu.

vLLM 0.34.0's ``CpuPlatform.check_and_update_config`` refuses, first thing
and before it changes anything, to configure on x86 without triton-cpu,
which no registry here has.  The tests and tools that use this build configs
for the scheduler, the output processor or a stand-in model (pure Python),
never a kernel.  Used by ``tests/conftest.py``, ``tests/standin_executor.py``
and ``tools/vllm_unit_plugin.py`` (which loads this file by its path); nothing
of the kind is in fastbatch.
"""

from __future__ import annotations


def lift_triton_refusal() -> None:
    """In this process, where triton is absent: the CPU platform's check runs
    as vLLM's; where it refuses for triton alone, it runs again with
    ``vllm.triton_utils.HAS_TRITON`` (which it reads at call time) true during
    that call, and false again after it.  Any other exception is vLLM's.
    Nothing is changed where triton is present.  Idempotent."""
    import vllm.triton_utils
    from vllm.platforms.cpu import CpuPlatform

    if vllm.triton_utils.HAS_TRITON:
        return
    stock_check = CpuPlatform.__dict__["check_and_update_config"].__func__
    if getattr(stock_check, "lifts_triton_refusal", False):
        return

    def check_and_update_config(cls, vllm_config):
        try:
            return stock_check(cls, vllm_config)
        except RuntimeError as exc:
            if "triton" not in str(exc).lower() or vllm.triton_utils.HAS_TRITON:
                raise
        vllm.triton_utils.HAS_TRITON = True
        try:
            return stock_check(cls, vllm_config)
        finally:
            vllm.triton_utils.HAS_TRITON = False

    check_and_update_config.lifts_triton_refusal = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
