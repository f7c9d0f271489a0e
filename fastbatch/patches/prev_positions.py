"""Patch: ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._compute_prev_positions``.

What is replaced: the method that, every step of ``_prepare_inputs``, maps
each request of the batch to its row in the previous step (``-1`` for a
request new this step) in ``self.prev_positions.np``, the int64 column that
``_prepare_input_ids``, the accepted-token counts and the async spec-decode
correction read. One compiled call (``fastbatch.compute_prev_positions``)
fills the column; vLLM's early return is kept. vLLM 0.21.0 to 0.33.0 (the V1
runner).

Guard: the method's fingerprint; the activation check on runner stand-ins; the
shadow runs vLLM's method on a copy of the column.

When it can go: when fastbatch no longer supports a vLLM with Model Runner V1
(0.33.0 is the last), or if vLLM vectorises the loop.

Upstream: vllm-project/vllm#41286 (the migration to Model Runner V2); vLLM
0.34.0 removed Model Runner V1, so nothing is left to propose upstream.

Story and numbers: ``docs/pieces/prev_positions.md``.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import fastbatch
from fastbatch.patches._patch import Patch, Shadow

GROUP = "runner"  # fastbatch.registry.GROUPS

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




def stand_in_runner(req_ids: list[str | None], prev_req_id_to_index: dict[str, int] | None,
                    column: Any) -> SimpleNamespace:
    """What the method reads and writes of a ``GPUModelRunner``: the batch's
    request ids and previous-step map, and the ``prev_positions`` column."""
    return SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=req_ids, prev_req_id_to_index=prev_req_id_to_index),
        prev_positions=SimpleNamespace(np=column))


def _synthetic_runners() -> list[tuple[SimpleNamespace, int]]:
    """Small runner stand-ins: kept, moved, new and finished requests, a hole,
    fewer requests than ids, more slots than requests, no previous step."""
    import numpy as np

    def runner(req_ids: list[str | None], prev: dict[str, int]) -> SimpleNamespace:
        return stand_in_runner(req_ids, prev, np.full(8, 7, dtype=np.int64))

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


def _snapshot(runner: Any, num_reqs: int) -> dict[str, Any]:
    """The call's inputs: the ids and the whole column copied, the map shared
    (only read)."""
    batch = runner.input_batch
    return {"req_ids": list(batch.req_ids), "prev_req_id_to_index": batch.prev_req_id_to_index,
            "column": runner.prev_positions.np.copy(), "num_reqs": num_reqs}


def _run(method: Any, inputs: dict[str, Any]) -> tuple[Any, Any]:
    """``method`` on a stand-in with a fresh copy of the column: (its return
    value, the column after)."""
    runner = stand_in_runner(list(inputs["req_ids"]), inputs["prev_req_id_to_index"],
                             inputs["column"].copy())
    result = method(runner, inputs["num_reqs"])
    return result, runner.prev_positions.np


def _outcome(inputs: dict[str, Any], result: Any, runner: Any, num_reqs: int) -> tuple[Any, Any]:
    return result, runner.prev_positions.np.copy()


def _compare(ours: tuple[Any, Any], stock: tuple[Any, Any]) -> str | None:
    import numpy as np

    if ours[0] is not stock[0] and ours[0] != stock[0]:
        return f"fastbatch returned {ours[0]!r}, vLLM {stock[0]!r}"
    got, expected = ours[1], stock[1]
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return (f"fastbatch left a column of {got.dtype} {got.shape}, vLLM "
                f"{expected.dtype} {expected.shape}")
    if not np.array_equal(got, expected):
        index = int(np.flatnonzero(got != expected)[0])
        return (f"prev_positions[{index}]: fastbatch wrote {int(got[index])}, vLLM "
                f"{int(expected[index])}")
    return None


def _restore(inputs: dict[str, Any], stock: tuple[Any, Any], result: Any, runner: Any,
             num_reqs: int) -> Any:
    """vLLM's column written into the runner's own buffer."""
    runner.prev_positions.np[...] = stock[1]
    return stock[0]


SHADOW = Shadow(snapshot=_snapshot, run=_run, outcome=_outcome, restore=_restore,
                compare=_compare)

PATCH = Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner._compute_prev_positions",
              _compute_prev_positions, fingerprints=VERIFIED_FINGERPRINTS,
              activation_check=activation_check, shadow=SHADOW)
