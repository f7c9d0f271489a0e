"""The pure-Python twins of the compiled pieces (``fastbatch._kernels``): the
test oracle, one module per piece, named like its patch in ``fastbatch.patches``.
``_common`` holds what they share."""

from fastbatch._counters import combined
from fastbatch._reference import (
    async_output_token_ids,
    async_spec_token_ids,
    draft_lists,
    penalty_output_tokens,
    rejection_lists,
    sampled_lists,
)
from fastbatch._reference.async_output_token_ids import update_async_output_token_ids
from fastbatch._reference.async_spec_token_ids import update_async_spec_token_ids
from fastbatch._reference.draft_lists import draft_token_lists
from fastbatch._reference.penalty_output_tokens import output_tokens_tensor
from fastbatch._reference.rejection_lists import rejection_output_lists
from fastbatch._reference.sampled_lists import sampled_token_lists

stats, reset_stats = combined(async_output_token_ids, async_spec_token_ids,
                              penalty_output_tokens, sampled_lists,
                              rejection_lists, draft_lists)

__all__ = ["draft_token_lists", "output_tokens_tensor", "rejection_output_lists",
           "reset_stats", "sampled_token_lists", "stats", "update_async_output_token_ids",
           "update_async_spec_token_ids"]
