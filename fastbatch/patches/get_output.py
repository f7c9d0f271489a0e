"""Patch: ``vllm.v1.worker.gpu_model_runner.AsyncGPUModelRunnerOutput.get_output``.

What is replaced: the method that, under async scheduling, hands the step's
sampled token ids to the scheduler as lists. The replacement is vLLM's method
with the plain decode step's ``tolist()`` and clear loop swapped for one
compiled call (``fastbatch.sampled_token_lists``); input it refuses runs
vLLM's lines. vLLM 0.31.0 to 0.33.0 (the V1 runner).

Guard: the fingerprint of the whole method; the activation check on output
stand-ins; the shadow runs vLLM's method on a copy of the sampled ids.

When it can go: when fastbatch no longer supports a vLLM with Model Runner V1
(0.33.0 is the last), or if vLLM builds these lists in compiled code.

Upstream: vllm-project/vllm#41286 (the migration to Model Runner V2); vLLM
0.34.0 removed Model Runner V1, so nothing is left to propose upstream.

Story and numbers: ``docs/pieces/get_output.md``.
"""

from __future__ import annotations

import copy
import sys
from types import SimpleNamespace
from typing import Any

import fastbatch
from fastbatch.patches._compare import NoWait, rows_problem, tensor_copy, unchanged
from fastbatch.patches._patch import Patch, Shadow

GROUP = "runner"  # fastbatch.registry.GROUPS

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


# What the method writes on the runner output, and the attributes of its own
# that it deletes (the device tensors).
WRITTEN = ("sampled_token_ids", "logprobs", "num_nans_in_logits")
RELEASED = ("_logprobs_tensors", "_sampled_token_ids", "_num_nans")
UNSET = "<unset>"  # an attribute the object does not have (picklable)



def _snapshot(output: Any) -> dict[str, Any] | None:
    """What the method reads, the ids and indices copied (the method, or a
    wrong kernel, could change them), once the device-to-host copy is done
    (the method waits for it first thing too); None with spec tokens (vLLM's
    code around ``parse_output``: nothing of this piece's to check)."""
    if output.sampled_token_ids_cpu.shape[-1] != 1:
        return None
    output.async_copy_ready_event.synchronize()
    runner_output = output._model_runner_output
    return {
        "sampled_token_ids_cpu": tensor_copy(output.sampled_token_ids_cpu),
        "invalid_req_indices": copy.copy(output._invalid_req_indices),
        "vocab_size": output.vocab_size,
        "logprobs_tensors_cpu": output._logprobs_tensors_cpu,
        "num_nans_cpu": output._num_nans_cpu,
        "has_fault": output._has_fault,
        "req_id_to_index": runner_output.req_id_to_index,
        "written_before": {name: getattr(runner_output, name) for name in WRITTEN
                           if hasattr(runner_output, name)},
        "released_names": [name for name in RELEASED if hasattr(output, name)],
        # to put back what vLLM's method would have kept (not in reproducers)
        "released": {name: getattr(output, name) for name in RELEASED if hasattr(output, name)},
        "async_copy_ready_event": output.async_copy_ready_event,
    }


def _state(output: Any, result: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """The call's outcome, read from the output object after it."""
    runner_output = output._model_runner_output
    return {
        "returned_runner_output": result is runner_output,
        **{name: getattr(runner_output, name, UNSET) for name in WRITTEN},
        "released": [name for name in RELEASED if not hasattr(output, name)],
        "ids_unchanged": unchanged(output.sampled_token_ids_cpu,
                                   inputs["sampled_token_ids_cpu"]),
        "indices_unchanged": list(output._invalid_req_indices)
        == list(inputs["invalid_req_indices"]),
    }


def _run(method: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """``method`` on a stand-in output made of copies of the ids and indices."""
    output = SimpleNamespace(
        _model_runner_output=SimpleNamespace(req_id_to_index=inputs["req_id_to_index"],
                                             **inputs["written_before"]),
        _invalid_req_indices=copy.copy(inputs["invalid_req_indices"]),
        async_copy_ready_event=inputs.get("async_copy_ready_event") or NoWait(),
        vocab_size=inputs["vocab_size"],
        sampled_token_ids_cpu=tensor_copy(inputs["sampled_token_ids_cpu"]),
        _logprobs_tensors_cpu=inputs["logprobs_tensors_cpu"],
        _num_nans_cpu=inputs["num_nans_cpu"], _has_fault=inputs["has_fault"],
        **dict.fromkeys(inputs["released_names"]))
    return _state(output, method(output), inputs)


def _outcome(inputs: dict[str, Any], result: Any, output: Any) -> dict[str, Any]:
    return _state(output, result, inputs)


def _logprobs_problem(ours: Any, stock: Any) -> str | None:
    """Why fastbatch's ``LogprobsLists`` (or None) is not vLLM's: the same
    type, and field by field the same arrays (dtype, shape, bytes) or values."""
    import numpy as np

    if type(ours) is not type(stock):
        return f"fastbatch gave logprobs {ours!r}, vLLM {stock!r}"
    if stock is None or stock == UNSET:
        return None
    for index, (got, expected) in enumerate(zip(ours, stock, strict=True)):
        if isinstance(expected, np.ndarray):
            same = (type(got) is np.ndarray and got.dtype == expected.dtype
                    and got.shape == expected.shape and got.tobytes() == expected.tobytes())
        else:
            same = type(got) is type(expected) and got == expected
        if not same:
            return f"logprobs field {index}: fastbatch gave {got!r}, vLLM {expected!r}"
    return None


def _compare(ours: dict[str, Any], stock: dict[str, Any]) -> str | None:
    problem = rows_problem(ours["sampled_token_ids"], stock["sampled_token_ids"])
    if problem is not None:
        return f"sampled_token_ids: {problem}"
    problem = _logprobs_problem(ours["logprobs"], stock["logprobs"])
    if problem is not None:
        return problem
    for key in ("num_nans_in_logits", "returned_runner_output", "released", "ids_unchanged",
                "indices_unchanged"):
        if ours[key] != stock[key]:
            return f"{key}: fastbatch left {ours[key]!r}, vLLM {stock[key]!r}"
    return None


def _restore(inputs: dict[str, Any], stock: dict[str, Any], result: Any, output: Any) -> Any:
    """vLLM's values on the runner output vLLM holds, the released attributes
    as vLLM's method leaves them, the ids and indices back; that runner output."""
    runner_output = output._model_runner_output
    for name in WRITTEN:
        if stock[name] != UNSET:
            setattr(runner_output, name, stock[name])
        elif hasattr(runner_output, name):
            delattr(runner_output, name)
    for name in RELEASED:
        if name in stock["released"]:
            if hasattr(output, name):
                delattr(output, name)
        elif name in inputs["released"]:
            setattr(output, name, inputs["released"][name])
    if not unchanged(output.sampled_token_ids_cpu, inputs["sampled_token_ids_cpu"]):
        output.sampled_token_ids_cpu[...] = inputs["sampled_token_ids_cpu"]
    if list(output._invalid_req_indices) != list(inputs["invalid_req_indices"]):
        output._invalid_req_indices[:] = inputs["invalid_req_indices"]
    return runner_output if stock["returned_runner_output"] else result


def _for_reproducer(inputs: dict[str, Any]) -> dict[str, Any]:
    """Without the event and the device tensors (neither can be pickled for
    use elsewhere; the method only lets the tensors go)."""
    return {key: value for key, value in inputs.items()
            if key not in ("async_copy_ready_event", "released")}


SHADOW = Shadow(snapshot=_snapshot, run=_run, outcome=_outcome, restore=_restore,
                compare=_compare, for_reproducer=_for_reproducer)

PATCH = Patch(f"{RUNNER_MODULE}:AsyncGPUModelRunnerOutput.get_output", get_output,
              fingerprints=VERIFIED_FINGERPRINTS, activation_check=activation_check,
              shadow=SHADOW, needs_async_scheduling=True)
