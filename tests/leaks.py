"""The leak check the kernel's tests share.

A leaked reference to a freshly created object keeps it alive for ever, so it
shows up as traced memory (and as live objects) that grow with the number of
calls; a leaked reference to an argument shows up in ``sys.getrefcount``.
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
from collections.abc import Callable


def assert_no_leak(step: Callable[[], object], watched: list, calls: int) -> None:
    """Run ``step`` ``calls`` times (after the caller's warm-up): the
    refcounts of ``watched``, the live objects and the traced memory stay flat."""
    refcounts = [sys.getrefcount(obj) for obj in watched]
    gc.collect()
    objects = len(gc.get_objects())
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        for _ in range(calls):
            step()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    assert [sys.getrefcount(obj) for obj in watched] == refcounts
    assert len(gc.get_objects()) - objects < 50
    # A leak of one object per request per call would be megabytes here.
    assert grown < 64 * 1024, f"traced memory grew by {grown} bytes"
