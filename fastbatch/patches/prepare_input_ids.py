"""Patch: ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_input_ids``.

What is replaced: the method that, every step of ``_prepare_inputs``, puts the
step's input token ids on the device. The replacement is vLLM's method with
its index loop done by one compiled call
(``fastbatch.prepare_input_ids_indices``). vLLM 0.31.0 to 0.33.0 (the V1
runner).

Guard: the fingerprint of the whole method; the activation check on runner
stand-ins; the shadow runs vLLM's method on copies of what it writes.

When it can go: when fastbatch no longer supports a vLLM with Model Runner V1
(0.33.0 is the last), or if vLLM vectorises the loop.

Upstream: vllm-project/vllm#41286 (the migration to Model Runner V2); vLLM
0.34.0 removed Model Runner V1, so nothing is left to propose upstream.

Story and numbers: ``docs/pieces/prepare_input_ids.md``.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import fastbatch
from fastbatch.patches._patch import Patch, Shadow

GROUP = "runner"  # fastbatch.registry.GROUPS

MODULE = "vllm.v1.worker.gpu_model_runner"
VERIFIED_FINGERPRINTS = {
    "8acebd554ae724f6e9bed24d4409725ef841db91037cf61903059b96ea227058":
        "vLLM 0.31.0-0.33.0",
}


def _index_tensor(indices: Any) -> Any:
    """``torch.tensor(indices, dtype=torch.int64, pin_memory=PIN_MEMORY)`` for
    an int64 numpy row, ``PIN_MEMORY`` read at call time from vLLM's module as
    stock reads it: a new tensor (pinned: a pinned copy) every call."""
    import torch

    tensor = torch.from_numpy(indices)
    return tensor.pin_memory() if sys.modules[MODULE].PIN_MEMORY else tensor


def _prepare_input_ids(self: Any, scheduler_output: Any, num_reqs: int,
                       total_num_scheduled_tokens: int, cu_num_tokens: Any) -> None:
    """fastbatch's drop-in for ``GPUModelRunner._prepare_input_ids`` (0.31-0.33):
    vLLM's code, its per-request loop one compiled call."""
    import torch

    # Sync the async PP broadcast before reading sampled tokens.
    if self._pp_recv_work is not None:
        self._pp_recv_work.wait()
        self._pp_recv_work = None

    if self.input_batch.prev_sampled_token_ids is None:
        # Normal scheduling case
        self.input_ids.copy_to_gpu(total_num_scheduled_tokens)
        if self.enable_prompt_embeds:
            self.inputs_embeds.copy_to_gpu(total_num_scheduled_tokens)
            self.is_token_ids.copy_to_gpu(total_num_scheduled_tokens)
        return

    # vLLM's loop: rows of (sample_flattened_indices, prev_indices) and
    # (spec_flattened_indices, prev_draft_token_indices).
    common, spec, common_indices_match, max_flattened_index = (
        fastbatch.prepare_input_ids_indices(
            self.input_batch.req_ids, self.prev_positions.np, cu_num_tokens,
            scheduler_output.scheduled_spec_decode_tokens, self.prev_num_spec_tokens,
            num_reqs))
    sample_flattened_indices, prev_indices = common
    spec_flattened_indices, prev_draft_token_indices = spec
    total_num_spec_tokens = len(spec_flattened_indices)

    num_common_tokens = len(sample_flattened_indices)
    total_without_spec = total_num_scheduled_tokens - total_num_spec_tokens
    if self.enable_prompt_embeds:
        if total_num_spec_tokens:
            self.is_token_ids.np[spec_flattened_indices] = True
        self.is_token_ids.copy_to_gpu(total_num_scheduled_tokens)
    if num_common_tokens < total_without_spec:
        self.input_ids.copy_to_gpu(total_num_scheduled_tokens)
        if self.enable_prompt_embeds:
            self.inputs_embeds.copy_to_gpu(total_num_scheduled_tokens)
    if num_common_tokens == 0:
        return
    if common_indices_match and max_flattened_index == (num_common_tokens - 1):
        self.input_ids.gpu[:num_common_tokens].copy_(
            self.input_batch.prev_sampled_token_ids[:num_common_tokens, 0],
            non_blocking=True,
        )
        return
    sampled_tokens_index_tensor = _index_tensor(sample_flattened_indices).to(
        self.device, non_blocking=True)
    prev_common_req_indices_tensor = _index_tensor(prev_indices).to(
        self.device, non_blocking=True)
    self.input_ids.gpu.scatter_(
        dim=0,
        index=sampled_tokens_index_tensor,
        src=self.input_batch.prev_sampled_token_ids[prev_common_req_indices_tensor, 0],
    )

    if self._draft_token_ids is None or not total_num_spec_tokens:
        return

    assert isinstance(self._draft_token_ids, torch.Tensor)
    draft_tokens_index_tensor = _index_tensor(spec_flattened_indices).to(
        self.device, non_blocking=True)
    prev_draft_token_indices_tensor = _index_tensor(prev_draft_token_indices).to(
        self.device, non_blocking=True)
    draft_token_ids = self._draft_token_ids.to(dtype=torch.int32)
    self.input_ids.gpu.scatter_(
        dim=0,
        index=draft_tokens_index_tensor,
        src=draft_token_ids.flatten()[prev_draft_token_indices_tensor],
    )




class PipelineWork:
    """A stand-in for the PP broadcast's ``torch.distributed.Work``: counts waits."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> bool:
        self.waits += 1
        return True


def stand_in_call(*, req_ids: list[str | None], prev_positions: list[int],
                  num_scheduled: list[int], scheduled_spec_tokens: dict[str, list[int]],
                  num_prev_reqs: int, prev_num_spec_tokens: int,
                  draft_tokens: bool = True, prompt_embeds: bool = False,
                  pp_work: bool = False, prev_sampled: bool = True,
                  spare_slots: int = 4) -> SimpleNamespace:
    """A call of the method on a runner stand-in on the CPU: ``runner`` (with
    vLLM's own ``CpuGpuBuffer``s, the ``gpu`` side a second CPU tensor),
    ``arguments`` (after ``self``) and ``pp_work`` (the PP broadcast to wait
    for, or None).  The same keywords build an identical call.

    Every buffer starts with distinct values (the ``gpu`` sides with ``-7``), so
    a missed or extra copy or scatter shows.  Used by the activation check, the
    tests and the benchmarks.
    """
    import numpy as np
    import torch
    from vllm.v1.utils import CpuGpuBuffer

    num_reqs = len(prev_positions)
    cu_num_tokens = np.cumsum(np.asarray(num_scheduled, dtype=np.int32))
    total = int(cu_num_tokens[-1]) if num_reqs else 0
    slots = total + spare_slots
    device = torch.device("cpu")

    def buffer(*size: int, dtype: Any) -> Any:
        made = CpuGpuBuffer(*size, dtype=dtype, device=device, pin_memory=False)
        made.gpu.fill_(-7)
        return made

    input_ids = buffer(slots, dtype=torch.int32)
    input_ids.cpu.copy_(torch.arange(1000, 1000 + slots, dtype=torch.int32))
    is_token_ids = buffer(slots, dtype=torch.bool)
    is_token_ids.cpu.copy_(torch.arange(slots) % 3 == 0)
    inputs_embeds = buffer(slots, 2, dtype=torch.float32)
    inputs_embeds.cpu.copy_(torch.arange(2 * slots, dtype=torch.float32).view(slots, 2))
    positions = buffer(num_reqs + spare_slots, dtype=torch.int64)
    positions.np[:] = 99
    positions.np[:num_reqs] = prev_positions
    width = 1 + prev_num_spec_tokens
    work = PipelineWork() if pp_work else None
    runner = stand_in_runner(
        pp_recv_work=work, req_ids=list(req_ids),
        prev_sampled_token_ids=torch.arange(
            5000, 5000 + num_prev_reqs * width, dtype=torch.int32).view(
                num_prev_reqs, width) if prev_sampled else None,
        input_ids=input_ids, is_token_ids=is_token_ids, inputs_embeds=inputs_embeds,
        prev_positions=positions, enable_prompt_embeds=prompt_embeds,
        prev_num_spec_tokens=prev_num_spec_tokens, device=device,
        draft_token_ids=torch.arange(
            9000, 9000 + num_prev_reqs * prev_num_spec_tokens, dtype=torch.int64).view(
                num_prev_reqs, prev_num_spec_tokens) if draft_tokens else None,
    )
    scheduler_output = SimpleNamespace(scheduled_spec_decode_tokens=scheduled_spec_tokens)
    return SimpleNamespace(runner=runner, pp_work=work,
                           arguments=(scheduler_output, num_reqs, total, cu_num_tokens))


def stand_in_runner(*, pp_recv_work: Any, req_ids: list[str | None],
                    prev_sampled_token_ids: Any, input_ids: Any, is_token_ids: Any,
                    inputs_embeds: Any, prev_positions: Any, enable_prompt_embeds: bool,
                    prev_num_spec_tokens: int, device: Any,
                    draft_token_ids: Any) -> SimpleNamespace:
    """What the method reads and writes of a ``GPUModelRunner`` (the buffers
    are ``CpuGpuBuffer``s, or anything with their ``cpu``/``gpu``/``np`` and
    ``copy_to_gpu``)."""
    return SimpleNamespace(
        _pp_recv_work=pp_recv_work,
        input_batch=SimpleNamespace(req_ids=req_ids,
                                    prev_sampled_token_ids=prev_sampled_token_ids),
        input_ids=input_ids, is_token_ids=is_token_ids, inputs_embeds=inputs_embeds,
        prev_positions=prev_positions, enable_prompt_embeds=enable_prompt_embeds,
        prev_num_spec_tokens=prev_num_spec_tokens, device=device,
        _draft_token_ids=draft_token_ids,
    )


def call_state(call: SimpleNamespace) -> dict[str, Any]:
    """Everything the method may write, as plain values, for comparison."""
    runner = call.runner
    return {
        "input_ids.gpu": runner.input_ids.gpu.tolist(),
        "input_ids.cpu": runner.input_ids.cpu.tolist(),
        "is_token_ids.cpu": runner.is_token_ids.cpu.tolist(),
        "is_token_ids.gpu": runner.is_token_ids.gpu.tolist(),
        "inputs_embeds.gpu": runner.inputs_embeds.gpu.tolist(),
        "prev_positions": runner.prev_positions.np.tolist(),
        "_pp_recv_work": runner._pp_recv_work,
        "pp_waits": None if call.pp_work is None else call.pp_work.waits,
        "attributes": sorted(vars(runner)),
        "input_batch": sorted(vars(runner.input_batch)),
    }


def _synthetic_calls() -> list[dict[str, Any]]:
    """Every path: no previous step; the unchanged batch; moved, new and
    finished requests with draft tokens and prompt embeds; drafts scheduled but
    none kept; only new requests; a PP broadcast to wait for."""
    moved = dict(req_ids=["moved", "new", "kept", "drafted"], prev_positions=[2, -1, 0, 1],
                 num_scheduled=[1, 3, 2, 3], scheduled_spec_tokens={
                     "kept": [-1], "drafted": [-1, -1], "new": [-1]},
                 num_prev_reqs=4, prev_num_spec_tokens=2)
    return [
        dict(moved, prompt_embeds=True, pp_work=True),
        dict(moved, draft_tokens=False),
        dict(req_ids=["a", "b", "c"], prev_positions=[0, 1, 2], num_scheduled=[1, 1, 1],
             scheduled_spec_tokens={}, num_prev_reqs=3, prev_num_spec_tokens=0),
        dict(req_ids=["a", "b"], prev_positions=[-1, -1], num_scheduled=[2, 1],
             scheduled_spec_tokens={}, num_prev_reqs=1, prev_num_spec_tokens=0,
             prompt_embeds=True),
        dict(req_ids=["a"], prev_positions=[0], num_scheduled=[1], scheduled_spec_tokens={},
             num_prev_reqs=1, prev_num_spec_tokens=0, prev_sampled=False,
             prompt_embeds=True, pp_work=True),
    ]


def activation_check(method: Any, replacement: Any) -> str | None:
    """Run both on identical stand-in calls; why the runners differ, or None."""
    for keywords in _synthetic_calls():
        stock, ours = stand_in_call(**keywords), stand_in_call(**keywords)
        method(stock.runner, *stock.arguments)
        replacement(ours.runner, *ours.arguments)
        expected, got = call_state(stock), call_state(ours)
        if got != expected:
            differing = sorted(key for key in expected if got[key] != expected[key])
            return (f"fastbatch and vLLM differ in {differing}: fastbatch gave "
                    f"{[got[key] for key in differing]}, vLLM gave "
                    f"{[expected[key] for key in differing]}")
    return None


# --- the shadow check (FASTBATCH_VERIFY) -------------------------------------

def _buffer(cpu: Any, gpu: Any) -> Any:
    """A ``CpuGpuBuffer`` (vLLM's class, so ``copy_to_gpu`` is vLLM's) made of
    the given tensors; ``np`` is the CPU side's numpy view where it has one."""
    import torch
    from vllm.v1.utils import CpuGpuBuffer

    made = CpuGpuBuffer.__new__(CpuGpuBuffer)
    made.cpu, made.gpu = cpu, gpu
    if cpu is not None and cpu.dtype != torch.bfloat16:
        made.np = cpu.numpy()
    return made


def _copy(tensor: Any) -> Any:
    """A copy on the CPU (a comparable, picklable outcome)."""
    return None if tensor is None else tensor.detach().to("cpu", copy=True)


def _snapshot(runner: Any, scheduler_output: Any, num_reqs: int,
              total_num_scheduled_tokens: int, cu_num_tokens: Any) -> dict[str, Any] | None:
    """Copies of what the method writes, what it reads shared; None on the
    normal scheduling path (no previous sampled ids: no loop to check)."""
    batch = runner.input_batch
    if batch.prev_sampled_token_ids is None:
        return None
    embeds = bool(runner.enable_prompt_embeds)
    total = total_num_scheduled_tokens
    return {
        "pp_recv_work": runner._pp_recv_work is not None,
        "req_ids": list(batch.req_ids),
        "prev_sampled_token_ids": batch.prev_sampled_token_ids,
        "input_ids.cpu": runner.input_ids.cpu,
        "input_ids.gpu": runner.input_ids.gpu.clone(),
        "is_token_ids.cpu": runner.is_token_ids.cpu.clone() if embeds else None,
        "is_token_ids.gpu": runner.is_token_ids.gpu.clone() if embeds else None,
        "inputs_embeds.cpu": runner.inputs_embeds.cpu[:total] if embeds else None,
        "inputs_embeds.gpu": runner.inputs_embeds.gpu[:total].clone() if embeds else None,
        "prev_positions": runner.prev_positions.np[:num_reqs].copy(),
        "enable_prompt_embeds": embeds,
        "prev_num_spec_tokens": runner.prev_num_spec_tokens,
        "device": runner.device,
        "draft_token_ids": runner._draft_token_ids,
        "scheduled_spec_decode_tokens": scheduler_output.scheduled_spec_decode_tokens,
        "num_reqs": num_reqs, "total": total, "cu_num_tokens": cu_num_tokens,
    }


def _written(runner: Any, result: Any, embeds: bool, total: int) -> dict[str, Any]:
    """What the method wrote (copied to the CPU), and its return value."""
    return {
        "result": result,
        "pp_recv_work consumed": runner._pp_recv_work is None,
        "input_ids.gpu": _copy(runner.input_ids.gpu),
        "is_token_ids.cpu": _copy(runner.is_token_ids.cpu) if embeds else None,
        "is_token_ids.gpu": _copy(runner.is_token_ids.gpu) if embeds else None,
        "inputs_embeds.gpu": _copy(runner.inputs_embeds.gpu[:total]) if embeds else None,
    }


def _run(method: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """``method`` on a stand-in with fresh copies of the written buffers."""
    embeds = inputs["enable_prompt_embeds"]

    def fresh(name: str) -> Any:
        return None if inputs[name] is None else inputs[name].clone()

    runner = stand_in_runner(
        pp_recv_work=PipelineWork() if inputs["pp_recv_work"] else None,
        req_ids=list(inputs["req_ids"]),
        prev_sampled_token_ids=inputs["prev_sampled_token_ids"],
        input_ids=_buffer(inputs["input_ids.cpu"], fresh("input_ids.gpu")),
        is_token_ids=_buffer(fresh("is_token_ids.cpu"), fresh("is_token_ids.gpu")),
        inputs_embeds=_buffer(inputs["inputs_embeds.cpu"], fresh("inputs_embeds.gpu")),
        prev_positions=SimpleNamespace(np=inputs["prev_positions"].copy()),
        enable_prompt_embeds=embeds, prev_num_spec_tokens=inputs["prev_num_spec_tokens"],
        device=inputs["device"], draft_token_ids=inputs["draft_token_ids"])
    result = method(runner, SimpleNamespace(
        scheduled_spec_decode_tokens=inputs["scheduled_spec_decode_tokens"]),
        inputs["num_reqs"], inputs["total"], inputs["cu_num_tokens"])
    return _written(runner, result, embeds, inputs["total"])


def _outcome(inputs: dict[str, Any], result: Any, runner: Any, *args: Any) -> dict[str, Any]:
    return _written(runner, result, inputs["enable_prompt_embeds"], inputs["total"])


def _compare(ours: dict[str, Any], stock: dict[str, Any]) -> str | None:
    import torch

    for name, expected in stock.items():
        got = ours[name]
        if not isinstance(expected, torch.Tensor) or not isinstance(got, torch.Tensor):
            if got is not expected and got != expected:
                return f"{name}: fastbatch gave {got!r}, vLLM {expected!r}"
        elif (got.dtype, got.shape) != (expected.dtype, expected.shape):
            return (f"{name}: fastbatch left {got.dtype} {tuple(got.shape)}, vLLM "
                    f"{expected.dtype} {tuple(expected.shape)}")
        elif not torch.equal(got, expected):
            where = tuple((got != expected).nonzero()[0].tolist())
            return (f"{name}{list(where)}: fastbatch wrote {got[where].tolist()}, "
                    f"vLLM {expected[where].tolist()}")
    return None


def _restore(inputs: dict[str, Any], stock: dict[str, Any], result: Any, runner: Any,
             *args: Any) -> Any:
    """vLLM's buffers copied into the runner's own."""
    runner.input_ids.gpu.copy_(stock["input_ids.gpu"])
    if inputs["enable_prompt_embeds"]:
        runner.is_token_ids.cpu.copy_(stock["is_token_ids.cpu"])
        runner.is_token_ids.gpu.copy_(stock["is_token_ids.gpu"])
        runner.inputs_embeds.gpu[:inputs["total"]].copy_(stock["inputs_embeds.gpu"])
    if stock["pp_recv_work consumed"]:
        runner._pp_recv_work = None
    return stock["result"]


def _for_reproducer(inputs: dict[str, Any]) -> dict[str, Any]:
    """The inputs on the CPU (a device tensor may not load elsewhere)."""
    import torch

    moved = {name: value.detach().cpu() if isinstance(value, torch.Tensor) else value
             for name, value in inputs.items()}
    moved["device"] = torch.device("cpu")
    return moved


SHADOW = Shadow(snapshot=_snapshot, run=_run, outcome=_outcome, restore=_restore,
                compare=_compare, for_reproducer=_for_reproducer)

PATCH = Patch(f"{MODULE}:GPUModelRunner._prepare_input_ids", _prepare_input_ids,
              fingerprints=VERIFIED_FINGERPRINTS, activation_check=activation_check,
              shadow=SHADOW, needs_async_scheduling=True)
