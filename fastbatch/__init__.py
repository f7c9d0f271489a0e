"""fastbatch: vLLM's per-step async output-token update as one compiled call.

``update_async_output_token_ids(req_ids, prev_req_id_to_index,
output_token_ids, sampled_token_ids, copy_ready=None)`` is the batch-wide
version of vLLM's ``InputBatch.update_async_output_token_ids``.  ``COMPILED``
says whether the Cython kernel is in use; if it cannot be imported, the
pure-Python reference takes its place and one ``RuntimeWarning`` says so.
"""

import warnings

__version__ = "0.1.0"

try:
    from fastbatch._kernel import reset_stats, stats, update_async_output_token_ids
except ImportError as exc:  # no compiled module for this platform/interpreter
    warnings.warn(
        f"fastbatch: compiled kernel unavailable ({exc}); using the slower "
        "pure-Python fallback",
        RuntimeWarning,
        stacklevel=2,
    )
    from fastbatch._reference import reset_stats, stats, update_async_output_token_ids

    COMPILED = False
else:
    COMPILED = True

__all__ = [
    "COMPILED",
    "__version__",
    "reset_stats",
    "stats",
    "update_async_output_token_ids",
]
