"""Patch: ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._get_draft_token_ids_cpu``.

What is replaced: the method that hands the drafter's proposals to the
scheduler (``take_draft_token_ids``) and, under async scheduling, to
``InputBatch.update_async_spec_token_ids``, as
``draft_token_ids_cpu[:num_reqs, :num_spec_tokens].tolist()``.  The
replacement is vLLM's method (0.24.0 to 0.33.0) with only that expression
swapped for one compiled call, ``fastbatch.draft_token_lists``, which builds
the same plain lists of plain ints (the shared token-id objects) from the
tensor's memory, without the sliced view.  Where the call refuses the tensor,
vLLM's own expression runs.

Why: the ``tolist()`` makes a fresh int object per draft id every
spec-decode step; it cost more than fastbatch's whole spec update.

When it can go: with Model Runner V2, or if vLLM builds these lists in
compiled code.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

import fastbatch
from fastbatch.patches._patch import Patch

VERIFIED_FINGERPRINTS = {
    "6edab22cb7838f88ab9d0c6b6b464dd987d20db3adf3f4c37392a498b47aad40":
        "vLLM 0.24.0-0.33.0",
}


def _get_draft_token_ids_cpu(self: Any) -> tuple[list[list[int]], list[str]]:
    """fastbatch's drop-in for ``GPUModelRunner._get_draft_token_ids_cpu``:
    vLLM's method, the lists from one compiled call."""
    if isinstance(self._draft_token_ids, list):
        return self._draft_token_ids, self.input_batch.req_ids
    req_ids = self._draft_token_req_ids
    if req_ids is None:
        return [], []
    assert self.draft_token_ids_event is not None
    assert self.draft_token_ids_cpu is not None
    self.draft_token_ids_event.synchronize()
    assert isinstance(self._draft_token_ids, torch.Tensor)
    num_spec_tokens = self._draft_token_ids.shape[1]
    try:
        return fastbatch.draft_token_lists(
            self.draft_token_ids_cpu, len(req_ids), num_spec_tokens), req_ids
    except TypeError:  # vLLM's expression: its lists, or its error
        return self.draft_token_ids_cpu[: len(req_ids), :num_spec_tokens].tolist(), req_ids




def synthetic_runner(draft_token_ids: Any, draft_token_ids_cpu: Any,
                     req_ids: list[str] | None) -> SimpleNamespace:
    """A stand-in ``GPUModelRunner`` with the attributes the method reads."""
    return SimpleNamespace(
        _draft_token_ids=draft_token_ids, _draft_token_req_ids=req_ids,
        draft_token_ids_cpu=draft_token_ids_cpu,
        draft_token_ids_event=SimpleNamespace(synchronize=lambda: None),
        input_batch=SimpleNamespace(req_ids=["list-drafts"]),
    )


def activation_check(method: Any, replacement: Any) -> str | None:
    """Run both on stand-ins (fewer requests and drafts than the buffer
    holds, the whole buffer, drafts as lists, no drafts); why they disagree,
    or None."""
    buffer = torch.arange(-2, 22, dtype=torch.int64).view(6, 4)
    cases = [
        (torch.zeros((3, 3), dtype=torch.int32), buffer, ["a", "b", "c"]),
        (torch.zeros((6, 4), dtype=torch.int32), buffer, list("abcdef")),
        (torch.zeros((0, 2), dtype=torch.int32), buffer, []),
        ([[1, 2]], buffer, ["a"]),
        (None, buffer, None),
    ]
    for drafts, cpu, req_ids in cases:
        expected = method(synthetic_runner(drafts, cpu, req_ids))
        got = replacement(synthetic_runner(drafts, cpu, req_ids))
        if got != expected or type(got) is not tuple:
            return f"fastbatch gave {got}, vLLM gave {expected}"
        if not all(type(row) is list and all(type(token) is int for token in row)
                   for row in got[0]):
            return f"fastbatch gave {got[0]!r}, not lists of ints"
    return None


PATCH = Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_draft_token_ids_cpu",
              _get_draft_token_ids_cpu, fingerprints=VERIFIED_FINGERPRINTS,
              activation_check=activation_check)
