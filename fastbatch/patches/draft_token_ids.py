"""Patch: ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._get_draft_token_ids_cpu``.

What is replaced: the method that hands the drafter's proposals to the
scheduler (``take_draft_token_ids``) and, under async scheduling, to
``InputBatch.update_async_spec_token_ids``, as
``draft_token_ids_cpu[:num_reqs, :num_spec_tokens].tolist()``. The replacement
is vLLM's method with only that expression swapped for one compiled call
(``fastbatch.draft_token_lists``); a tensor it refuses runs vLLM's expression.
vLLM 0.24.0 to 0.33.0 (the V1 runner).

Guard: the fingerprint of the whole method; the activation check on runner
stand-ins; the shadow runs vLLM's method on a copy of the buffer's rows.

When it can go: when fastbatch no longer supports a vLLM with Model Runner V1
(0.33.0 is the last), or if vLLM builds these lists in compiled code.

Upstream: vllm-project/vllm#41286 (the migration to Model Runner V2); vLLM
0.34.0 removed Model Runner V1, so nothing is left to propose upstream.

Story and numbers: ``docs/pieces/draft_token_ids.md``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

import fastbatch
from fastbatch.patches._compare import NoWait, rows_problem, tensor_copy, unchanged
from fastbatch.patches._patch import Patch, Shadow

GROUP = "runner"  # fastbatch.registry.GROUPS

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



def _snapshot(runner: Any) -> dict[str, Any] | None:
    """A copy of the buffer's rows in use and of the request ids, once the
    device-to-host copy is done (the method waits for it too, before reading
    them); None on the branches that build no lists (vLLM's own lines there)."""
    req_ids = runner._draft_token_req_ids
    buffer = runner.draft_token_ids_cpu
    drafts = runner._draft_token_ids
    if (isinstance(drafts, list) or req_ids is None or runner.draft_token_ids_event is None
            or buffer is None or not isinstance(drafts, torch.Tensor)):
        return None
    runner.draft_token_ids_event.synchronize()
    return {"rows": tensor_copy(buffer[:len(req_ids)]), "num_spec_tokens": drafts.shape[1],
            "req_ids": list(req_ids), "draft_token_ids_event": runner.draft_token_ids_event}


def _state(result: Any, req_ids: Any, buffer: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """The outcome: the lists, whether the request ids returned are the
    runner's own list, whether the buffer's rows in use are unchanged."""
    pair = type(result) is tuple and len(result) == 2
    return {"result_kind": "pair" if pair else repr(result),
            "lists": result[0] if pair else None,
            "own_req_ids": pair and result[1] is req_ids,
            "rows_unchanged": unchanged(buffer[:len(inputs["rows"])], inputs["rows"])}


def _run(method: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """``method`` on a stand-in runner made of copies of the rows and ids."""
    runner = SimpleNamespace(
        _draft_token_ids=torch.empty((0, inputs["num_spec_tokens"]), dtype=torch.int64),
        _draft_token_req_ids=list(inputs["req_ids"]),
        draft_token_ids_cpu=tensor_copy(inputs["rows"]),
        draft_token_ids_event=inputs.get("draft_token_ids_event") or NoWait(),
        input_batch=SimpleNamespace(req_ids=[]))
    return _state(method(runner), runner._draft_token_req_ids, runner.draft_token_ids_cpu,
                  inputs)


def _outcome(inputs: dict[str, Any], result: Any, runner: Any) -> dict[str, Any]:
    return _state(result, runner._draft_token_req_ids, runner.draft_token_ids_cpu, inputs)


def _compare(ours: dict[str, Any], stock: dict[str, Any]) -> str | None:
    if ours["result_kind"] != stock["result_kind"]:
        return f"fastbatch returned {ours['result_kind']}, vLLM {stock['result_kind']}"
    problem = rows_problem(ours["lists"], stock["lists"])
    if problem is not None:
        return problem
    for key in ("own_req_ids", "rows_unchanged"):
        if ours[key] != stock[key]:
            return f"{key}: fastbatch {ours[key]!r}, vLLM {stock[key]!r}"
    return None


def _restore(inputs: dict[str, Any], stock: dict[str, Any], result: Any, runner: Any) -> Any:
    """The buffer's rows back (if fastbatch's call changed them); vLLM's lists
    with the runner's own request-id list, as vLLM's method returns them."""
    rows = runner.draft_token_ids_cpu[:len(inputs["rows"])]
    if not unchanged(rows, inputs["rows"]):
        rows.copy_(inputs["rows"])
    return stock["lists"], runner._draft_token_req_ids


def _for_reproducer(inputs: dict[str, Any]) -> dict[str, Any]:
    """The inputs without the event (a device event cannot be pickled)."""
    return {key: value for key, value in inputs.items() if key != "draft_token_ids_event"}


SHADOW = Shadow(snapshot=_snapshot, run=_run, outcome=_outcome, restore=_restore,
                compare=_compare, for_reproducer=_for_reproducer)

PATCH = Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_draft_token_ids_cpu",
              _get_draft_token_ids_cpu, fingerprints=VERIFIED_FINGERPRINTS,
              activation_check=activation_check, shadow=SHADOW)
