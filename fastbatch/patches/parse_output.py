"""Patch: ``vllm.v1.sample.rejection_sampler.RejectionSampler.parse_output``.

What is replaced: the static method that turns the rejection sampler's output
(``[num_reqs, num_spec_tokens + 1]`` ids, rejected slots ``-1``) into one list
of accepted ids per request, with the discarded requests' lists empty.  vLLM
makes a numpy mask ``(ids != -1) & (ids < vocab_size)`` and does
``row[mask[i]].tolist()`` per row; ``fastbatch.rejection_output_lists`` builds
the same plain lists of plain ints (the shared token-id objects) in one
compiled pass over the tensor's memory.  With logprobs, or where the call
refuses its input (a GPU tensor, another dtype, discarded indices numpy would
read differently), vLLM's own method runs.

Why: a numpy mask, a boolean index and a ``tolist()`` per request, every
spec-decode step (``get_output`` under async scheduling, ``_bookkeeping_sync``
without it).

When it can go: with Model Runner V2, or if vLLM builds these lists in
compiled code.
"""

from __future__ import annotations

from typing import Any

import fastbatch
from fastbatch.patches._patch import Patch

VERIFIED_FINGERPRINTS = {
    "11df69ad2ab931ef90dcd16217b683f0468e28fe2e1bcf2ce3d0b22ee42703a9":
        "vLLM 0.21.0-0.33.0",
}


def parse_output(output_token_ids: Any, vocab_size: int, discard_req_indices: Any = (),
                 logprobs_tensors: Any = None) -> tuple[list[list[int]], Any]:
    """fastbatch's drop-in for ``RejectionSampler.parse_output``: the lists
    from one compiled call; with logprobs, vLLM's own method."""
    if logprobs_tensors is None:
        try:
            return fastbatch.rejection_output_lists(
                output_token_ids, vocab_size, discard_req_indices), None
        except (TypeError, IndexError):
            pass  # vLLM's method below: its lists, or its error
    return PATCH.original()(output_token_ids, vocab_size, discard_req_indices,
                            logprobs_tensors=logprobs_tensors)




def activation_check(method: Any, replacement: Any) -> str | None:
    """Run both on small outputs (rejections, ids at and past the vocabulary,
    discarded rows as a list and as a numpy array, int32 and int64, an empty
    batch); why they disagree, or None.  ``replacement`` is what is installed
    (a staticmethod); until then its fallback cannot reach vLLM's method, so
    only inputs the compiled call takes are used."""
    import numpy as np
    import torch

    rows = [[1, 2, -1, -1], [5, 511, 512, -1], [-1, -1, -1, -1], [7, 8, 9, 10]]
    cases = [
        (torch.tensor(rows, dtype=torch.int32), 512, [2, -1]),
        (torch.tensor(rows, dtype=torch.int64), 512, np.array([0], dtype=np.int64)),
        (torch.tensor(rows, dtype=torch.int32), 9, ()),
        (torch.zeros((0, 4), dtype=torch.int32), 512, []),
    ]
    for ids, vocab_size, discard in cases:
        expected = method(ids, vocab_size, discard)
        got = replacement.__func__(ids, vocab_size, discard) if isinstance(
            replacement, staticmethod) else replacement(ids, vocab_size, discard)
        if got != expected:
            return f"fastbatch gave {got}, vLLM gave {expected}"
        if not all(type(row) is list and all(type(token) is int for token in row)
                   for row in got[0]):
            return f"fastbatch gave {got[0]!r}, not lists of ints"
    return None


PATCH = Patch("vllm.v1.sample.rejection_sampler:RejectionSampler.parse_output",
              staticmethod(parse_output), fingerprints=VERIFIED_FINGERPRINTS,
              activation_check=activation_check)
