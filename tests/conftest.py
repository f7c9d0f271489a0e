"""Shared fixtures and hypothesis profiles.

Profiles (``HYPOTHESIS_PROFILE``): ``ci`` (default, thousands of batches in
total), ``quick`` for fast local runs, ``asan`` for the sanitizer build.
"""

import importlib.util
import logging
import os
import warnings

import pytest
from hypothesis import HealthCheck, settings

import fastbatch
from fastbatch import _reference

# Modules that import vLLM are not even collected where vLLM is not installed;
# the tox environments that need them select them with -m, and pytest exits
# non-zero there if nothing was collected.
VLLM_MODULES = ["test_vllm_differential.py", "test_plugin.py", "test_e2e.py",
                "test_vllm_bookkeeping_sync.py", "test_vllm_prev_positions.py",
                "test_vllm_prepare_input_ids.py", "test_verify.py", "test_model_runner.py",
                "test_plugin_fallback.py", "test_decode_slots.py",
                "test_decode_outputs.py", "test_after_schedule.py", "test_cached_requests.py"]
collect_ignore = [] if importlib.util.find_spec("vllm") else VLLM_MODULES
# The penalties' tensor is a torch tensor, and the rows-to-lists pieces read
# torch tensors: their tests need torch (the default tox environment installs
# the CPU build; the other interpreters' may not).
if not importlib.util.find_spec("torch"):
    collect_ignore += ["test_penalty_tokens.py", "test_sampled_lists.py",
                       "test_rejection_lists.py", "test_draft_lists.py"]

if not collect_ignore:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM is imported
    # Warnings are errors in this suite, but the import-time deprecation noise
    # of torch, transformers and vLLM is not ours to fix: import them quietly.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import vllm.v1.worker.gpu_input_batch
        import vllm.v1.worker.gpu_model_runner  # noqa: F401

settings.register_profile("ci", max_examples=2000, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("quick", max_examples=100, deadline=None)
settings.register_profile("asan", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module", params=["compiled", "reference"])
def implementation(request):
    """Each implementation: the compiled kernel and the pure-Python fallback."""
    if request.param == "compiled":
        assert fastbatch.COMPILED, "the compiled kernel is not importable"
        return fastbatch._kernels
    return _reference


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def at(self, level):
        return [r.getMessage() for r in self.records if r.levelno == level]


@pytest.fixture
def logs():
    """Records of the 'vllm.fastbatch' logger (vLLM's 'vllm' logger does not
    propagate to the root logger, so caplog would not see them)."""
    logger = logging.getLogger("vllm.fastbatch")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)
