"""The compiled pieces: one extension module per piece, named like its patch
in ``fastbatch.patches`` (and its pure-Python twin in ``fastbatch._reference``).
``_common`` holds what they share (the small-int helpers, the token table)."""

from fastbatch._counters import combined
from fastbatch._kernels import (
    after_schedule,
    async_output_token_ids,
    async_spec_token_ids,
    bookkeeping_sync,
    cached_requests,
    decode_outputs,
    decode_slots,
    draft_lists,
    penalty_output_tokens,
    prepare_input_ids,
    prev_positions,
    rejection_lists,
    sampled_lists,
)
from fastbatch._kernels.after_schedule import update_after_schedule
from fastbatch._kernels.async_output_token_ids import update_async_output_token_ids
from fastbatch._kernels.async_spec_token_ids import update_async_spec_token_ids
from fastbatch._kernels.bookkeeping_sync import append_sampled_token_ids
from fastbatch._kernels.cached_requests import cached_request_lists
from fastbatch._kernels.decode_outputs import merge_decode_outputs, take_decode_outputs
from fastbatch._kernels.decode_slots import allocate_slots_is_noop
from fastbatch._kernels.draft_lists import draft_token_lists
from fastbatch._kernels.penalty_output_tokens import output_tokens_tensor
from fastbatch._kernels.prepare_input_ids import prepare_input_ids_indices
from fastbatch._kernels.prev_positions import compute_prev_positions
from fastbatch._kernels.rejection_lists import rejection_output_lists
from fastbatch._kernels.sampled_lists import sampled_token_lists

# Every piece, one a line (their counters make up stats()).
PIECES = (
    after_schedule,
    async_output_token_ids,
    async_spec_token_ids,
    bookkeeping_sync,
    decode_outputs,
    cached_requests,
    decode_slots,
    draft_lists,
    penalty_output_tokens,
    prepare_input_ids,
    prev_positions,
    rejection_lists,
    sampled_lists,
)
stats, reset_stats = combined(*PIECES)

__all__ = [
    "allocate_slots_is_noop",
    "append_sampled_token_ids",
    "cached_request_lists",
    "compute_prev_positions",
    "draft_token_lists",
    "merge_decode_outputs",
    "output_tokens_tensor",
    "prepare_input_ids_indices",
    "rejection_output_lists",
    "reset_stats",
    "sampled_token_lists",
    "stats",
    "take_decode_outputs",
    "update_after_schedule",
    "update_async_output_token_ids",
    "update_async_spec_token_ids",
]
