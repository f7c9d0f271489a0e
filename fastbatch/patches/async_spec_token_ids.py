"""Patch: ``vllm.v1.worker.gpu_input_batch.InputBatch.update_async_spec_token_ids``.

What is replaced: the method that, with speculative decoding under async
scheduling, swaps each request's scheduled draft tokens (placeholders in
``sampling_metadata.spec_token_ids``) for the real draft ids proposed one step
earlier. One compiled call (``fastbatch.update_async_spec_token_ids``) does
the loop. vLLM 0.21.0 to 0.33.0 (the V1 runner).

Guard: the method's fingerprint; the activation check on synthetic batches;
the shadow runs vLLM's method on copies of the spec lists and draft rows.

When it can go: when fastbatch no longer supports a vLLM with Model Runner V1
(0.33.0 is the last), or if vLLM moves the loop into compiled code.

Upstream: vllm-project/vllm#41286 (the migration to Model Runner V2); vLLM
0.34.0 removed Model Runner V1, so nothing is left to propose upstream.

Story and numbers: ``docs/pieces/async_spec_token_ids.md``.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import fastbatch
from fastbatch.patches._patch import Patch, Shadow

GROUP = "runner"  # fastbatch.registry.GROUPS

VERIFIED_FINGERPRINTS = {
    "a06449b72018712e2310918469fdcbd9b61b8d0ba3a9db6cc9b8a7bf84313bf4":
        "vLLM 0.21.0-0.33.0",
}


def update_async_spec_token_ids(self: Any, draft_token_ids: list[list[int]]) -> None:
    """fastbatch's drop-in for ``InputBatch.update_async_spec_token_ids``.

    The same early returns as vLLM's, then one compiled call for the batch.
    """
    if not draft_token_ids or not self.prev_req_id_to_index:
        return
    if (spec_token_ids := self.sampling_metadata.spec_token_ids) is not None:
        fastbatch.update_async_spec_token_ids(
            self.req_ids, self.prev_req_id_to_index, spec_token_ids, draft_token_ids)




def _synthetic_batches() -> list[tuple[SimpleNamespace, list[list[int]]]]:
    """Small InputBatch stand-ins and draft rows with every case: equal, shorter
    and longer draft rows, empty spec lists and draft rows, holes, requests
    new this step, and no spec tokens at all."""
    return [
        (SimpleNamespace(
            req_ids=["equal", "short-draft", "long-draft", "no-spec", None, "new",
                     "empty-draft"],
            prev_req_id_to_index={"equal": 2, "short-draft": 0, "long-draft": 1,
                                  "no-spec": 3, "empty-draft": 4, "finished": 0},
            sampling_metadata=SimpleNamespace(spec_token_ids=[
                [-1, -1], [-1, -1, -1], [-1], [], [-1], [-1, -1], [-1]]),
        ), [[11, 12], [21, 22, 23], [31, 32], [41], []]),
        (SimpleNamespace(
            req_ids=["a"], prev_req_id_to_index={"a": 0},
            sampling_metadata=SimpleNamespace(spec_token_ids=None),
        ), [[1]]),
    ]


def activation_check(method: Any, replacement: Any) -> str | None:
    """Run both on the synthetic batches; why they disagree, or None."""
    for batch, draft_token_ids in _synthetic_batches():
        stock, ours = (batch, draft_token_ids), copy.deepcopy((batch, draft_token_ids))
        method(*stock)
        replacement(*ours)
        expected = (stock[0].sampling_metadata.spec_token_ids, stock[1])
        got = (ours[0].sampling_metadata.spec_token_ids, ours[1])
        if got != expected:
            return f"fastbatch gave {got}, vLLM gave {expected}"
    return None


def _copy_lists(spec_token_ids: list[Any], draft_token_ids: list[Any]) -> tuple[Any, Any]:
    """Copies of the spec lists and draft rows."""
    return ([None if row is None else row[:] for row in spec_token_ids],
            [None if row is None else row[:] for row in draft_token_ids])


def _snapshot(batch: Any, draft_token_ids: list[list[int]]) -> dict[str, Any] | None:
    """Copies of the spec lists and draft rows (both are changed in place);
    None when vLLM's method returns at once.  The rest is only read: shared."""
    spec_token_ids = batch.sampling_metadata.spec_token_ids
    if not draft_token_ids or not batch.prev_req_id_to_index or spec_token_ids is None:
        return None
    spec_copy, draft_copy = _copy_lists(spec_token_ids, draft_token_ids)
    return {"req_ids": list(batch.req_ids),
            "prev_req_id_to_index": batch.prev_req_id_to_index,
            "spec_token_ids": spec_copy, "draft_token_ids": draft_copy}


def _run(method: Any, inputs: dict[str, Any]) -> tuple[Any, Any]:
    """``method`` on fresh copies; the spec lists and draft rows after it."""
    spec_token_ids, draft_token_ids = _copy_lists(inputs["spec_token_ids"],
                                                  inputs["draft_token_ids"])
    method(SimpleNamespace(req_ids=inputs["req_ids"],
                           prev_req_id_to_index=inputs["prev_req_id_to_index"],
                           sampling_metadata=SimpleNamespace(spec_token_ids=spec_token_ids)),
           draft_token_ids)
    return spec_token_ids, draft_token_ids


def _outcome(inputs: dict[str, Any], result: None, batch: Any,
             draft_token_ids: list[list[int]]) -> tuple[Any, Any]:
    """The live lists themselves (compared, and pickled on a divergence, before
    ``_restore`` changes them)."""
    return batch.sampling_metadata.spec_token_ids, draft_token_ids


def _restore(inputs: dict[str, Any], stock: tuple[Any, Any], result: None, batch: Any,
             draft_token_ids: list[list[int]]) -> None:
    """vLLM's spec lists and draft rows written back into the same lists."""
    for live, expected in ((batch.sampling_metadata.spec_token_ids, stock[0]),
                           (draft_token_ids, stock[1])):
        for row, wanted in zip(live, expected, strict=True):
            if row is not None:
                row[:] = wanted


SHADOW = Shadow(snapshot=_snapshot, run=_run, outcome=_outcome, restore=_restore)

PATCH = Patch("vllm.v1.worker.gpu_input_batch:InputBatch.update_async_spec_token_ids",
              update_async_spec_token_ids, fingerprints=VERIFIED_FINGERPRINTS,
              activation_check=activation_check, shadow=SHADOW, needs_async_scheduling=True)
