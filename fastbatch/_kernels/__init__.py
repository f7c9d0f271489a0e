"""The compiled pieces: one extension module per piece, named like its patch
in ``fastbatch.patches`` (and its pure-Python twin in ``fastbatch._reference``).
``_common`` holds what they share (the small-int helpers, the token table)."""

from fastbatch._counters import combined
from fastbatch._kernels import (
    async_output_token_ids,
    async_spec_token_ids,
    decode_slots,
    penalty_output_tokens,
)
from fastbatch._kernels.async_output_token_ids import update_async_output_token_ids
from fastbatch._kernels.async_spec_token_ids import update_async_spec_token_ids
from fastbatch._kernels.decode_slots import allocate_slots_is_noop
from fastbatch._kernels.penalty_output_tokens import output_tokens_tensor

stats, reset_stats = combined(async_output_token_ids, async_spec_token_ids,
                              decode_slots, penalty_output_tokens)

__all__ = ["allocate_slots_is_noop", "output_tokens_tensor", "reset_stats", "stats",
           "update_async_output_token_ids", "update_async_spec_token_ids"]
