"""Benchmark states for the penalties' output-token tensor, and its variants.

Every step in which a request has a presence, frequency or repetition
penalty, vLLM 0.33.0's ``apply_all_penalties`` turns the batch's output token
lists into a padded int64 tensor (``penalties._convert_to_tensors``) and then
masks the async -1 placeholders to ``vocab_size``; with ``FASTBATCH=1``
fastbatch's conversion masks them in its single pass and the masking after it
does not run.  A ``PenaltyCell`` is
(requests, longest output); its rows are what vLLM keeps: lists of Python
ints (fresh objects, as ``.tolist()`` makes them), ids below 151,936 (Qwen's
vocabulary), lengths spread over [L/2, L] with one row of exactly L, and a
trailing -1 placeholder on a quarter of the rows.  No variant changes its
input, so the rows are built once per cell.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM is imported

import numpy as np
import torch
from vllm.v1.sample.ops import penalties

from fastbatch import _reference
from fastbatch.patches import penalty_output_tokens as patch

REQUESTS = (256, 1024)
OUTPUT_LENGTHS = (100, 4000, 16000)
VOCAB_SIZE = 151_936
# The pure-Python fallback takes about 0.25 us per token: seconds per call
# beyond this many tokens (1024 x 16000 would be ~4 s a call), so it is
# skipped there.
FALLBACK_MAX_TOKENS = 1024 * 4000
UNMASKED = frozenset({"stock_convert"})  # variants that leave the -1 placeholders
STOCK_CONVERT = penalties._convert_to_tensors
assert not getattr(STOCK_CONVERT, "__fastbatch__", False), "benchmarks need stock vLLM"


@dataclasses.dataclass(frozen=True)
class PenaltyCell:
    requests: int
    output_len: int  # the longest row

    @property
    def label(self) -> str:
        return f"penalties-{self.requests}x{self.output_len}"


PENALTY_GRID = [PenaltyCell(n, length) for n in REQUESTS for length in OUTPUT_LENGTHS]


def output_token_rows(cell: PenaltyCell, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(cell.output_len // 2, cell.output_len + 1, cell.requests)
    lengths[rng.integers(cell.requests)] = cell.output_len
    placeholder = rng.random(cell.requests) < 0.25
    rows = []
    for length, pending in zip(lengths.tolist(), placeholder.tolist(), strict=True):
        row = rng.integers(0, VOCAB_SIZE, length).tolist()
        if pending:
            row[-1] = -1
        rows.append(row)
    return rows


def stock(output_token_ids: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """What ``apply_all_penalties`` does: vLLM's ``_convert_to_tensors``, then the
    masking of the -1 placeholders."""
    tokens = STOCK_CONVERT(output_token_ids, vocab_size, device)
    tokens.masked_fill_(tokens == -1, vocab_size)
    return tokens


def fallback(output_token_ids: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """fastbatch's drop-in with the pure-Python fallback in place of the kernel."""
    tokens = _reference.output_tokens_tensor(output_token_ids, vocab_size, patch.pin_memory())
    return tokens.to(device, non_blocking=True)


def fastbatch(output_token_ids: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """What the ``apply_all_penalties`` that ``FASTBATCH=1`` installs does before
    the penalty arithmetic: the conversion installed in penalties.py, masked
    unless it is fastbatch's.  Timed with the penalties piece applied (see
    test_penalty_benchmarks.py), so it is fastbatch's conversion and no
    masking: like for like with ``stock``."""
    return patch.output_tokens_masked(output_token_ids, vocab_size, device)


VARIANTS = {
    "stock": stock,
    # vLLM's conversion alone: on a GPU, stock's masking runs on the device,
    # so this is stock's CPU cost there (the check masks it afterwards).
    "stock_convert": STOCK_CONVERT,
    "fastbatch": fastbatch,
    "fallback": fallback,
}
