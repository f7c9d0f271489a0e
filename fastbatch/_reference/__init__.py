"""The pure-Python twins of the compiled pieces (``fastbatch._kernels``): the
test oracle, one module per piece, named like its patch in ``fastbatch.patches``.
``_common`` holds what they share."""

from fastbatch._counters import combined
from fastbatch._reference import (
    async_output_token_ids,
    async_spec_token_ids,
    bookkeeping_sync,
    penalty_output_tokens,
    prepare_input_ids,
    prev_positions,
)
from fastbatch._reference.async_output_token_ids import update_async_output_token_ids
from fastbatch._reference.async_spec_token_ids import update_async_spec_token_ids
from fastbatch._reference.bookkeeping_sync import append_sampled_token_ids
from fastbatch._reference.penalty_output_tokens import output_tokens_tensor
from fastbatch._reference.prepare_input_ids import prepare_input_ids_indices
from fastbatch._reference.prev_positions import compute_prev_positions

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
