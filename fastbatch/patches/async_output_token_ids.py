"""Patch: ``vllm.v1.worker.gpu_input_batch.InputBatch.update_async_output_token_ids``.

What is replaced: the method that, under async scheduling, swaps each
request's trailing -1 placeholders for the token ids sampled one step earlier.
One compiled call (``fastbatch.update_async_output_token_ids``) does the loop.
vLLM 0.22.0 to 0.33.0 (the V1 runner).

Guard: the method's fingerprint; the activation check on synthetic batches;
the shadow runs vLLM's method on a copy of each list's tail.

When it can go: when fastbatch no longer supports a vLLM with Model Runner V1
(0.33.0 is the last), or if vLLM moves the loop into compiled code.

Upstream: vllm-project/vllm#41286 (the migration to Model Runner V2); vLLM
0.34.0 removed Model Runner V1, so nothing is left to propose upstream.

Story and numbers: ``docs/pieces/async_output_token_ids.md``.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import fastbatch
from fastbatch.patches._compare import NoWait
from fastbatch.patches._patch import Patch, Shadow

GROUP = "runner"  # fastbatch.registry.GROUPS

VERIFIED_FINGERPRINTS = {
    "750912c3409c1ae39bfb6e08f3193b19c693959dbe06dc10f4fa0216dc8e7d4e":
        "vLLM 0.22.0-0.33.0 reverse scan",
}


def update_async_output_token_ids(self: Any) -> None:
    """fastbatch's drop-in for ``InputBatch.update_async_output_token_ids``.

    The same early return as vLLM's, then one compiled call for the batch.
    """
    output_token_ids = self.sampling_metadata.output_token_ids
    if self.sampled_token_ids_cpu is None or not output_token_ids:
        return  # output ids not needed, or not async scheduling
    fastbatch.update_async_output_token_ids(
        self.req_ids, self.prev_req_id_to_index, output_token_ids,
        self.sampled_token_ids_cpu, self.async_copy_ready_event)




def _synthetic_batches(torch: Any) -> list[SimpleNamespace]:
    """Small InputBatch stand-ins with every case: decode, spec decode with
    rejections, holes, discarded tokens, new requests, padded and empty rows,
    int32 and int64 sampled ids."""
    batches = []
    for dtype in (torch.int32, torch.int64):
        sampled = torch.tensor([[11, 12, -1], [21, -1, -1], [31, 32, 33], [-1, -1, -1],
                                [51, 52, 53]], dtype=dtype)
        batches.append(SimpleNamespace(
            req_ids=["decode", "spec", None, "discarded", "new", "none-kept", "short"],
            prev_req_id_to_index={"decode": 1, "spec": 0, "discarded": 2,
                                  "none-kept": 3, "short": 4, "finished": 2},
            sampling_metadata=SimpleNamespace(output_token_ids=[
                [7, -1], [1, -1, 2, -1, -1, -1], None, [8, 9], [4, -1], [3, -1, -1],
                [6, -1]]),
            sampled_token_ids_cpu=sampled,
            async_copy_ready_event=SimpleNamespace(synchronize=lambda: None),
        ))
    return batches


def activation_check(method: Any, replacement: Any) -> str | None:
    """Run both on the synthetic batches; why they disagree, or None."""
    import torch

    for batch in _synthetic_batches(torch):
        stock, ours = batch, copy.deepcopy(batch)
        method(stock)
        replacement(ours)
        expected = stock.sampling_metadata.output_token_ids
        got = ours.sampling_metadata.output_token_ids
        if got != expected:
            return f"fastbatch gave {got}, vLLM gave {expected}"
    return None



def _tail_start(token_ids: list[int]) -> int:
    """Where the part of ``token_ids`` that vLLM's loop can touch begins: the
    item before the trailing placeholders (the whole list if it is all
    placeholders; the last item if there are none)."""
    start = len(token_ids)
    while start > 0 and token_ids[start - 1] == -1:
        start -= 1
    return max(start - 1, 0)


def _snapshot(batch: Any) -> dict[str, Any] | None:
    """The call's inputs, each output list cut to its tail (copied); None when
    vLLM's method returns at once.  The other inputs are only read: shared."""
    output_token_ids = batch.sampling_metadata.output_token_ids
    if batch.sampled_token_ids_cpu is None or not output_token_ids:
        return None
    offsets = [None if ids is None else _tail_start(ids) for ids in output_token_ids]
    return {
        "req_ids": list(batch.req_ids),
        "prev_req_id_to_index": batch.prev_req_id_to_index,
        "offsets": offsets,
        "tails": [None if ids is None else ids[start:]
                  for ids, start in zip(output_token_ids, offsets, strict=True)],
        "sampled_token_ids_cpu": batch.sampled_token_ids_cpu,
        "async_copy_ready_event": batch.async_copy_ready_event,
    }


def _run(method: Any, inputs: dict[str, Any]) -> list[tuple[int, list[int]] | None]:
    """``method`` on a batch made of copies of the tails; each list's new
    length and tail."""
    tails = [None if tail is None else list(tail) for tail in inputs["tails"]]
    method(SimpleNamespace(
        req_ids=inputs["req_ids"], prev_req_id_to_index=inputs["prev_req_id_to_index"],
        sampling_metadata=SimpleNamespace(output_token_ids=tails),
        sampled_token_ids_cpu=inputs["sampled_token_ids_cpu"],
        async_copy_ready_event=inputs.get("async_copy_ready_event") or NoWait()))
    return [None if tail is None else (start + len(tail), tail)
            for tail, start in zip(tails, inputs["offsets"], strict=True)]


def _outcome(inputs: dict[str, Any], result: None,
             batch: Any) -> list[tuple[int, list[int]] | None]:
    """The live lists after fastbatch's call: each one's length and tail."""
    return [None if ids is None else (len(ids), ids[start:]) for ids, start in zip(
        batch.sampling_metadata.output_token_ids, inputs["offsets"], strict=True)]


def _restore(inputs: dict[str, Any], stock: list[tuple[int, list[int]] | None],
             result: None, batch: Any) -> None:
    """vLLM's tails written back into the same list objects."""
    for ids, start, expected in zip(batch.sampling_metadata.output_token_ids,
                                    inputs["offsets"], stock, strict=True):
        if ids is not None and expected is not None:
            ids[start:] = expected[1]


def _compare(ours: list[Any], stock: list[Any]) -> str | None:
    for index, (got, expected) in enumerate(zip(ours, stock, strict=True)):
        if got != expected:
            return (f"request at index {index}: fastbatch left (length, tail) {got}, "
                    f"vLLM {expected}")
    return None


def _for_reproducer(inputs: dict[str, Any]) -> dict[str, Any]:
    """The inputs without the copy-ready event (a device event cannot be pickled)."""
    return {key: value for key, value in inputs.items() if key != "async_copy_ready_event"}


SHADOW = Shadow(snapshot=_snapshot, run=_run, outcome=_outcome, restore=_restore,
                compare=_compare, for_reproducer=_for_reproducer)

PATCH = Patch("vllm.v1.worker.gpu_input_batch:InputBatch.update_async_output_token_ids",
              update_async_output_token_ids, fingerprints=VERIFIED_FINGERPRINTS,
              activation_check=activation_check, shadow=SHADOW, needs_async_scheduling=True)
