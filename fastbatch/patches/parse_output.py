"""Patch: ``vllm.v1.sample.rejection_sampler.RejectionSampler.parse_output``.

What is replaced: the static method that turns the rejection sampler's output
(``[num_reqs, num_spec_tokens + 1]`` ids, rejected slots ``-1``) into one list
of accepted ids per request, with the discarded requests' lists empty. One
compiled pass (``fastbatch.rejection_output_lists``) builds the lists; with
logprobs, or input it refuses, vLLM's method runs. vLLM 0.21.0 to 0.33.0 (the
V1 runner's rejection sampler).

Guard: the method's fingerprint; the activation check on synthetic tensors;
the shadow runs vLLM's method on a copy of the ids.

When it can go: when fastbatch no longer supports a vLLM with Model Runner V1
(0.33.0 is the last), or if vLLM builds these lists in compiled code.

Upstream: vllm-project/vllm#41286 (the migration to Model Runner V2); vLLM
0.34.0 removed Model Runner V1, so nothing is left to propose upstream.

Story and numbers: ``docs/pieces/parse_output.md``.
"""

from __future__ import annotations

import copy
from typing import Any

import fastbatch
from fastbatch.patches._compare import rows_problem, tensor_copy, unchanged
from fastbatch.patches._patch import Patch, Shadow

GROUP = "runner"  # fastbatch.registry.GROUPS

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


def _snapshot(output_token_ids: Any, vocab_size: Any, discard_req_indices: Any = (),
              logprobs_tensors: Any = None) -> dict[str, Any] | None:
    """Copies of the ids and the discarded indices; None with logprobs or ids
    on a device (the compiled call takes CPU ids only: the replacement is
    vLLM's method then, nothing to check, and it must not run twice)."""
    if logprobs_tensors is not None or getattr(
            getattr(output_token_ids, "device", None), "type", "cpu") != "cpu":
        return None
    return {"output_token_ids": tensor_copy(output_token_ids), "vocab_size": vocab_size,
            "discard_req_indices": copy.copy(discard_req_indices)}


def _outcome_of(result: Any, ids: Any, saved_ids: Any) -> dict[str, Any]:
    return {"result": result, "ids_unchanged": unchanged(ids, saved_ids)}


def _run(function: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """``function`` on fresh copies of the ids and indices; its result, and
    whether it left the ids alone."""
    ids = tensor_copy(inputs["output_token_ids"])
    result = function(ids, inputs["vocab_size"], copy.copy(inputs["discard_req_indices"]))
    return _outcome_of(result, ids, inputs["output_token_ids"])


def _ids_argument(*args: Any, **kwargs: Any) -> Any:
    """The call's ``output_token_ids`` (its first argument)."""
    return args[0] if args else kwargs["output_token_ids"]


def _outcome(inputs: dict[str, Any], result: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return _outcome_of(result, _ids_argument(*args, **kwargs), inputs["output_token_ids"])


def _compare(ours: dict[str, Any], stock: dict[str, Any]) -> str | None:
    """The lists exactly (``rows_problem``), no logprobs, the ids left alone."""
    got, expected = ours["result"], stock["result"]
    if type(got) is not tuple or len(got) != 2:
        return f"fastbatch gave {got!r}, not a (lists, logprobs) tuple"
    problem = rows_problem(got[0], expected[0])
    if problem is not None:
        return problem
    if (got[1] is None) != (expected[1] is None):
        return f"fastbatch gave logprobs {got[1]!r}, vLLM {expected[1]!r}"
    if ours["ids_unchanged"] != stock["ids_unchanged"]:
        return "fastbatch's call changed the output_token_ids tensor"
    return None


def _restore(inputs: dict[str, Any], stock: dict[str, Any], result: Any,
             *args: Any, **kwargs: Any) -> Any:
    """The ids tensor's values back (if fastbatch's call changed them); vLLM's result."""
    output_token_ids = _ids_argument(*args, **kwargs)
    if not unchanged(output_token_ids, inputs["output_token_ids"]):
        output_token_ids[...] = inputs["output_token_ids"]
    return stock["result"]


def _for_reproducer(inputs: dict[str, Any]) -> dict[str, Any]:
    """The ids on the CPU (a device tensor would not load without one)."""
    ids = inputs["output_token_ids"]
    return {**inputs, "output_token_ids": ids.cpu() if hasattr(ids, "cpu") else ids}


SHADOW = Shadow(snapshot=_snapshot, run=_run, outcome=_outcome, restore=_restore,
                compare=_compare, for_reproducer=_for_reproducer)


PATCH = Patch("vllm.v1.sample.rejection_sampler:RejectionSampler.parse_output",
              staticmethod(parse_output), fingerprints=VERIFIED_FINGERPRINTS,
              activation_check=activation_check, shadow=SHADOW)
