"""The compiled pieces: one extension module per piece, named like its patch
in ``fastbatch.patches`` (and its pure-Python twin in ``fastbatch._reference``).
``_common`` holds what they share (the small-int helpers, the token table)."""

from fastbatch._counters import combined
from fastbatch._kernels import (
    async_output_token_ids,
    async_spec_token_ids,
    bookkeeping_sync,
    penalty_output_tokens,
    prepare_input_ids,
    prev_positions,
)
from fastbatch._kernels.async_output_token_ids import update_async_output_token_ids
from fastbatch._kernels.async_spec_token_ids import update_async_spec_token_ids
from fastbatch._kernels.bookkeeping_sync import append_sampled_token_ids
from fastbatch._kernels.penalty_output_tokens import output_tokens_tensor
from fastbatch._kernels.prepare_input_ids import prepare_input_ids_indices
from fastbatch._kernels.prev_positions import compute_prev_positions

# Every piece, one a line (their counters make up stats()).
PIECES = (
    async_output_token_ids,
    async_spec_token_ids,
    bookkeeping_sync,
    penalty_output_tokens,
    prepare_input_ids,
    prev_positions,
)
stats, reset_stats = combined(*PIECES)

__all__ = [
    "append_sampled_token_ids",
    "compute_prev_positions",
    "output_tokens_tensor",
    "prepare_input_ids_indices",
    "reset_stats",
    "stats",
    "update_async_output_token_ids",
    "update_async_spec_token_ids",
]
