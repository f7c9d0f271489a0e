"""fastbatch: vLLM's per-step token bookkeeping as one compiled call per step.

* ``update_async_output_token_ids(req_ids, prev_req_id_to_index,
  output_token_ids, sampled_token_ids, copy_ready=None)``: the batch-wide
  version of vLLM's ``InputBatch.update_async_output_token_ids``.
* ``update_async_spec_token_ids(req_ids, prev_req_id_to_index,
  spec_token_ids, draft_token_ids)``: the loop of
  ``InputBatch.update_async_spec_token_ids``.
* ``output_tokens_tensor(output_token_ids, vocab_size, pin_memory=False)``:
  the penalties' padded output-token tensor, ``-1`` already masked.
* ``allocate_slots_is_noop(manager, request, num_new_tokens, reserved_blocks,
  kinds)``: whether vLLM's ``KVCacheManager.allocate_slots`` would change
  nothing and return the empty blocks (a plain decode step of the scheduler).

Each is a compiled piece (``fastbatch._kernels``, one module per piece) with a
pure-Python twin (``fastbatch._reference``).  ``COMPILED`` says whether the
compiled pieces are in use; if they cannot be imported, the twins take their
place and one ``RuntimeWarning`` says so.
"""

import warnings

__version__ = "0.1.0"

try:
    from fastbatch._kernels import (
        allocate_slots_is_noop,
        output_tokens_tensor,
        reset_stats,
        stats,
        update_async_output_token_ids,
        update_async_spec_token_ids,
    )
except ImportError as exc:  # no compiled module for this platform/interpreter
    warnings.warn(
        f"fastbatch: compiled kernel unavailable ({exc}); using the slower "
        "pure-Python fallback",
        RuntimeWarning,
        stacklevel=2,
    )
    from fastbatch._reference import (
        allocate_slots_is_noop,
        output_tokens_tensor,
        reset_stats,
        stats,
        update_async_output_token_ids,
        update_async_spec_token_ids,
    )

    COMPILED = False
else:
    COMPILED = True

__all__ = [
    "COMPILED",
    "__version__",
    "allocate_slots_is_noop",
    "output_tokens_tensor",
    "reset_stats",
    "stats",
    "update_async_output_token_ids",
    "update_async_spec_token_ids",
]
