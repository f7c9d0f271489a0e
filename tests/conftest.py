"""Shared fixtures and hypothesis profiles.

Profiles (``HYPOTHESIS_PROFILE``): ``ci`` (default, thousands of batches in
total), ``quick`` for fast local runs, ``asan`` for the sanitizer build.
"""

import os

import pytest
from hypothesis import HealthCheck, settings

import fastbatch
from fastbatch import _reference

settings.register_profile("ci", max_examples=2000, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("quick", max_examples=100, deadline=None)
settings.register_profile("asan", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module", params=["compiled", "reference"])
def implementation(request):
    """Each implementation of the update: the compiled kernel and the fallback."""
    if request.param == "compiled":
        assert fastbatch.COMPILED, "the compiled kernel is not importable"
        return fastbatch._kernel
    return _reference
