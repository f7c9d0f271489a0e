"""The pure-Python twins of the compiled pieces (``fastbatch._kernels``): the
test oracle, one module per piece, named like its patch in ``fastbatch.patches``.
``_common`` holds what they share."""

from fastbatch._counters import combined
from fastbatch._reference import (
    async_output_token_ids,
    async_spec_token_ids,
    decode_slots,
    penalty_output_tokens,
)
from fastbatch._reference.async_output_token_ids import update_async_output_token_ids
from fastbatch._reference.async_spec_token_ids import update_async_spec_token_ids
from fastbatch._reference.decode_slots import allocate_slots_is_noop
from fastbatch._reference.penalty_output_tokens import output_tokens_tensor

stats, reset_stats = combined(async_output_token_ids, async_spec_token_ids,
                              decode_slots, penalty_output_tokens)

__all__ = ["allocate_slots_is_noop", "output_tokens_tensor", "reset_stats", "stats",
           "update_async_output_token_ids", "update_async_spec_token_ids"]
