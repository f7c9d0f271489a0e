"""Patch: ``vllm.v1.worker.gpu_model_runner.AsyncGPUModelRunnerOutput.get_output``.

What is replaced: the method that, under async scheduling, hands the step's
sampled token ids to the scheduler as lists.  On a plain decode step (one id
per request) vLLM does ``sampled_token_ids_cpu.tolist()`` and then clears the
discarded requests' rows one by one.  The replacement is vLLM's method
(0.31.0 to 0.33.0) with only those lines swapped for one compiled call,
``fastbatch.sampled_token_lists``, which builds the same plain lists of plain
ints (the shared token-id objects) straight from the tensor's memory.  With
spec tokens (more than one id per row) it calls ``RejectionSampler.parse_output``
as vLLM does (see ``fastbatch.patches.parse_output``).  Where the call
refuses its input, vLLM's own two lines run instead.

Why: ``tolist()`` makes a fresh int object per id and the clear loop is
Python; it is paid every step of every async V1 run.

When it can go: with Model Runner V2 (its output path is different), or if
vLLM builds these lists in compiled code.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import fastbatch
from fastbatch.patches._patch import Patch

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
VERIFIED_FINGERPRINTS = {
    "c74abd9cc9cf4b1c8ed3f85d61a2ebf8e153f4b6467074904643d1a00d36cfeb":
        "vLLM 0.31.0-0.33.0",
}
# What the method uses from its module besides the tensors; the activation
# check makes sure they are all there.
RUNNER_NAMES = ("RejectionSampler", "envs", "get_ep_all2all_manager", "nans_to_dict",
                "raise_if_nan_logits")


def get_output(self: Any) -> Any:
    """fastbatch's drop-in for ``AsyncGPUModelRunnerOutput.get_output``:
    vLLM's method, the plain-decode lists from one compiled call."""
    runner = sys.modules[RUNNER_MODULE]
    max_gen_len = self.sampled_token_ids_cpu.shape[-1]
    self.async_copy_ready_event.synchronize()

    # Release the device tensors once the copy has completed.
    del self._logprobs_tensors
    del self._sampled_token_ids
    if max_gen_len == 1:
        try:
            valid_sampled_token_ids = fastbatch.sampled_token_lists(
                self.sampled_token_ids_cpu, self._invalid_req_indices)
        except (TypeError, IndexError):  # vLLM's lines: its lists, or its error
            valid_sampled_token_ids = self.sampled_token_ids_cpu.tolist()
            for i in self._invalid_req_indices:
                valid_sampled_token_ids[i].clear()
        logprobs_lists = None
        if self._logprobs_tensors_cpu is not None:
            logprobs_lists = self._logprobs_tensors_cpu.tolists()
    else:
        valid_sampled_token_ids, logprobs_lists = runner.RejectionSampler.parse_output(
            self.sampled_token_ids_cpu,
            self.vocab_size,
            self._invalid_req_indices,
            logprobs_tensors=self._logprobs_tensors_cpu,
        )

    output = self._model_runner_output
    output.sampled_token_ids = valid_sampled_token_ids
    output.logprobs = logprobs_lists

    if self._num_nans_cpu is not None:
        output.num_nans_in_logits = runner.nans_to_dict(
            self._num_nans_cpu.tolist(), output.req_id_to_index
        )
        if runner.envs.VLLM_RAISE_ON_LOGIT_NANS:
            runner.raise_if_nan_logits(output.num_nans_in_logits)
    del self._num_nans

    if self._has_fault is not None and self._has_fault.item():
        mask = runner.get_ep_all2all_manager().query_active_mask()
        raise RuntimeError(
            "Fault detected in EP all2all communication: "
            "one or more ranks timed out during dispatch/combine. "
            f"Mask: {mask.cpu().tolist()}"
        )

    return output




def synthetic_output(sampled_token_ids: Any, invalid_req_indices: list[int],
                     vocab_size: int = 512, num_nans: Any = None) -> SimpleNamespace:
    """A stand-in ``AsyncGPUModelRunnerOutput`` on CPU tensors, with the
    attributes ``get_output`` reads (as its ``__init__`` leaves them)."""
    return SimpleNamespace(
        _model_runner_output=SimpleNamespace(
            sampled_token_ids=None, logprobs=None,
            req_id_to_index={f"req-{i}": i for i in range(len(sampled_token_ids))}),
        _invalid_req_indices=invalid_req_indices,
        async_copy_ready_event=SimpleNamespace(synchronize=lambda: None),
        _sampled_token_ids=sampled_token_ids, vocab_size=vocab_size,
        _logprobs_tensors=None, _num_nans=num_nans, _has_fault=None,
        sampled_token_ids_cpu=sampled_token_ids, _logprobs_tensors_cpu=None,
        _num_nans_cpu=num_nans,
    )


def activation_check(method: Any, replacement: Any) -> str | None:
    """Run both on stand-ins (decode rows with discarded requests, int32 and
    int64, an empty batch, spec rows with -1); why they disagree, or None."""
    import torch

    runner = sys.modules[RUNNER_MODULE]
    missing = [name for name in RUNNER_NAMES if not hasattr(runner, name)]
    if missing:
        return f"{RUNNER_MODULE} has no {', '.join(missing)}"
    cases = [
        (torch.tensor([[5], [-1], [7], [511], [3]], dtype=torch.int32), [1, -1]),
        (torch.tensor([[9], [100000]], dtype=torch.int64), []),
        (torch.zeros((0, 1), dtype=torch.int32), []),
        (torch.tensor([[1, 2, -1], [4, -1, -1], [600, 6, 7]], dtype=torch.int32), [1]),
    ]
    for sampled, invalid in cases:
        expected = method(synthetic_output(sampled, list(invalid)))
        got = replacement(synthetic_output(sampled, list(invalid)))
        if (got.sampled_token_ids, got.logprobs) != (expected.sampled_token_ids,
                                                     expected.logprobs):
            return (f"fastbatch gave {got.sampled_token_ids}, vLLM gave "
                    f"{expected.sampled_token_ids}")
        if type(got.sampled_token_ids) is not list or not all(
                type(row) is list and all(type(token) is int for token in row)
                for row in got.sampled_token_ids):
            return f"fastbatch gave {got.sampled_token_ids!r}, not lists of ints"
    return None


PATCH = Patch(f"{RUNNER_MODULE}:AsyncGPUModelRunnerOutput.get_output", get_output,
              fingerprints=VERIFIED_FINGERPRINTS, activation_check=activation_check,
              needs_async_scheduling=True)
