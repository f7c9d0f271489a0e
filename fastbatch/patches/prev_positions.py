"""Patch: ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._compute_prev_positions``.

What is replaced: the method that, every step of ``_prepare_inputs``, maps
each request of the batch to its row in the previous step (``-1`` for a
request new this step) in ``self.prev_positions.np``, the int64 column that
``_prepare_input_ids``, the accepted-token counts and the async spec-decode
correction read.  The CPU runner inherits it.

Why: a per-request Python loop (a dict lookup and a numpy item store per
request) on the CPU critical path of every step; fastbatch fills the column in
one compiled call (``fastbatch.compute_prev_positions``) with exactly vLLM's
values.  The method keeps vLLM's early return (no previous step: all ``-1``).

When it can go: with the V1 runner (Model Runner V2 has its own input
preparation), or if vLLM vectorises the loop.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import fastbatch
from fastbatch.patches._patch import Patch

VERIFIED_FINGERPRINTS = {
    "893294565635b3d165e588f7fc95aeb9a9748c0a4620b0f7882778dc6f86948f":
        "vLLM 0.21.0-0.33.0",
}


def _compute_prev_positions(self: Any, num_reqs: int) -> None:
    """fastbatch's drop-in for ``GPUModelRunner._compute_prev_positions``."""
    prev_req_id_to_index = self.input_batch.prev_req_id_to_index
    prev_positions = self.prev_positions.np[:num_reqs]
    if not prev_req_id_to_index:
        prev_positions.fill(-1)
        return
    fastbatch.compute_prev_positions(self.input_batch.req_ids, prev_req_id_to_index,
                                     prev_positions, num_reqs)




def _synthetic_runners() -> list[tuple[SimpleNamespace, int]]:
    """Small runner stand-ins: kept, moved, new and finished requests, a hole,
    fewer requests than ids, more slots than requests, no previous step."""
    import numpy as np

    def runner(req_ids: list[str | None], prev: dict[str, int]) -> SimpleNamespace:
        return SimpleNamespace(
            input_batch=SimpleNamespace(req_ids=req_ids, prev_req_id_to_index=prev),
            prev_positions=SimpleNamespace(np=np.full(8, 7, dtype=np.int64)))

    moved = runner(["kept", "moved", "new", None, "last"],
                   {"kept": 0, "moved": 3, "finished": 1, "last": 2})
    return [(moved, 5), (copy.deepcopy(moved), 3), (runner(["a", "b"], {}), 4),
            (runner([], {"gone": 0}), 0)]


def activation_check(method: Any, replacement: Any) -> str | None:
    """Run both on the synthetic runners; why the columns differ, or None."""
    for runner, num_reqs in _synthetic_runners():
        ours = copy.deepcopy(runner)
        method(runner, num_reqs)
        replacement(ours, num_reqs)
        expected, got = runner.prev_positions.np.tolist(), ours.prev_positions.np.tolist()
        if got != expected:
            return f"fastbatch gave {got}, vLLM gave {expected}"
    return None


PATCH = Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner._compute_prev_positions",
              _compute_prev_positions, fingerprints=VERIFIED_FINGERPRINTS,
              activation_check=activation_check)
