"""Patch: ``vllm.v1.core.sched.scheduler.Scheduler._make_cached_request_data``.

What is replaced: the method with which ``Scheduler.schedule()`` packs, every
step, the requests that were scheduled before (running and resumed ones)
into a ``CachedRequestData``: their ids, block ids, computed and output
token counts, and for requests not scheduled in the previous step a copy of
their token ids.  The replacement is vLLM's method with its per-request loop
done by one compiled call (``fastbatch.cached_request_lists``), which builds
the same lists, set and dict, in the same order.  With pipeline parallelism
and no async scheduling (the one case that also sends each request's new
token ids) the whole call runs vLLM's method.

Why: a Python loop over every running request per step, with six list
appends, ``KVCacheBlocks.get_block_ids`` (a generator and a comprehension
even for a decode's empty blocks) and two ``Request`` properties; 0.57 s of
the 6.2 s cProfile of ``schedule`` at 1024 running requests (issue 12).

The scheduler is the same code under Model Runner V1 and V2 (it runs in
EngineCore, not in the worker), so this piece acts under both runners.

When it can go: if vLLM builds this per-step payload from arrays.

Safety: see ``fastbatch.patches._patch``.  The guard pins the method and
what the compiled loop reads in place of calling it: ``KVCacheBlocks
.get_block_ids``, ``ConstantList.copy`` and ``Request.num_output_tokens``.
The activation check also refuses a ``CachedRequestData`` whose fields are
not the seven it fills, and runs stock and fastbatch side by side on small
real requests and KV-cache blocks (running and resumed requests, new and
empty blocks, two KV-cache groups, both model runners' branches).

Shadow check (``FASTBATCH_VERIFY``): vLLM's method only reads, so only the
two request lists are copied; it runs right after fastbatch's call on the same
requests and blocks.  Compared: every field of the two ``CachedRequestData``
in order (dicts by their items, in order), and that no token list sent is a
request's own list.  On a divergence the call returns vLLM's.  The reproducer
holds the fields the method reads of each request, and the blocks as ids.
With pipeline parallelism and no async scheduling the call is vLLM's method
itself: not checked.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import fastbatch
from fastbatch.patches._patch import Patch, Shadow

MODULE = "vllm.v1.core.sched.scheduler"

VERIFIED_FINGERPRINTS = {
    "06d16f126e559b761fc93c637e875dfb573b2957f6017304f455c07f8a8a68ae": "vLLM 0.27.0-0.33.0",
}
COMPANION_FINGERPRINTS = {
    "vllm.v1.core.kv_cache_manager:KVCacheBlocks.get_block_ids": {
        "2ad0a22dc7d487e15941f3ffec417685c71f75400bcc21697dec50958031f186": "vLLM 0.30.0-0.33.0"},
    "vllm.v1.utils:ConstantList.copy": {
        "973c82b058b491bcadeedea4869f3bf14b9d772537d03a4ae1d1359c6fc39460": "vLLM 0.31.0-0.33.0"},
    "vllm.v1.request:Request.num_output_tokens.fget": {
        "6cf9ce95b8215fda4e8026120186cbe096dc989dc56f01fc2e61cfabafe20d0f": "vLLM 0.31.0-0.33.0"},
}
CACHED_REQUEST_FIELDS = ("req_ids", "resumed_req_ids", "new_token_ids", "all_token_ids",
                         "new_block_ids", "num_computed_tokens", "num_output_tokens")

# Bound on first use (this module imports no vLLM until then):
# (Request, KVCacheBlocks, ConstantList), CachedRequestData and vLLM's own method.
_KINDS: tuple[Any, Any, Any] | None = None
_CACHED_REQUEST_DATA: Any = None
_STOCK: Any = None


def _bind() -> None:
    global _KINDS, _CACHED_REQUEST_DATA, _STOCK
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import CachedRequestData
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request
    from vllm.v1.utils import ConstantList

    _KINDS = (Request, KVCacheBlocks, ConstantList)
    _CACHED_REQUEST_DATA = CachedRequestData
    _STOCK = PATCH.original() or Scheduler._make_cached_request_data


def _make_cached_request_data(self: Any, running_reqs: list[Any], resumed_reqs: list[Any],
                              num_scheduled_tokens: dict[str, int],
                              spec_decode_tokens: dict[str, list[int]],
                              req_to_new_blocks: dict[str, Any]) -> Any:
    """fastbatch's drop-in for ``Scheduler._make_cached_request_data`` (same
    signature): vLLM's method with its per-request loop compiled."""
    if _KINDS is None:
        _bind()
    if self.use_pp and not self.scheduler_config.async_scheduling:
        return _STOCK(self, running_reqs, resumed_reqs, num_scheduled_tokens,
                      spec_decode_tokens, req_to_new_blocks)
    (req_ids, resumed_req_ids, all_token_ids, new_block_ids, num_computed_tokens,
     num_output_tokens) = fastbatch.cached_request_lists(
        running_reqs, resumed_reqs, req_to_new_blocks,
        None if self.use_v2_model_runner else self.prev_step_scheduled_req_ids, _KINDS)
    return _CACHED_REQUEST_DATA(
        req_ids=req_ids,
        resumed_req_ids=resumed_req_ids,
        new_token_ids=[],
        all_token_ids=all_token_ids,
        new_block_ids=new_block_ids,
        num_computed_tokens=num_computed_tokens,
        num_output_tokens=num_output_tokens,
    )




def cached_request_state(data: Any) -> Any:
    """A ``CachedRequestData`` as plain data: every field in order (dicts as
    their items, in order), and whether each token list is a list of its own."""
    return ([(name, list(value.items()) if isinstance(value, dict) else value)
             for name, value in vars(data).items()],
            [type(ids) is list for ids in data.all_token_ids.values()])


def _small_batch() -> tuple[list[Any], list[Any], dict[str, Any]]:
    """Running and resumed real requests, and their new blocks (none, one
    group's, two groups', one of them empty)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

    requests = []
    for index in range(5):
        request = Request(request_id=f"r{index}", prompt_token_ids=list(range(3, 9 + index)),
                          sampling_params=SamplingParams(max_tokens=64), pooling_params=None,
                          arrival_time=0.0)
        request.append_output_token_ids(list(range(20, 20 + index)))
        request.num_computed_tokens = 300 + index
        request.num_output_placeholders = index % 2
        requests.append(request)
    blocks = [KVCacheBlock(block_id) for block_id in range(6)]
    new_blocks = {
        "r0": KVCacheBlocks(((),)),
        "r1": KVCacheBlocks(([blocks[0]],)),
        "r2": KVCacheBlocks(([], [])),
        "r3": KVCacheBlocks(([blocks[1], blocks[2]], [])),
        "r4": KVCacheBlocks(([blocks[3]], [blocks[4], blocks[5]])),
    }
    return requests[:3], requests[3:], new_blocks


def activation_check(method: Any, replacement: Any) -> str | None:
    """Why fastbatch must stay off, or None: ``CachedRequestData`` has other
    fields, or stock and fastbatch differ on a small real batch."""
    import dataclasses

    from vllm.v1.core.sched.output import CachedRequestData

    global _STOCK
    _bind()
    _STOCK = method
    fields = tuple(field.name for field in dataclasses.fields(CachedRequestData))
    if fields != CACHED_REQUEST_FIELDS:
        return f"CachedRequestData has fields {fields}, not {CACHED_REQUEST_FIELDS}"
    running, resumed, new_blocks = _small_batch()
    for use_v2 in (False, True):
        scheduler = SimpleNamespace(
            use_pp=False, scheduler_config=SimpleNamespace(async_scheduling=False),
            use_v2_model_runner=use_v2, prev_step_scheduled_req_ids={"r1", "r4"})
        results = [function(scheduler, running, resumed, {}, {}, new_blocks)
                   for function in (method, replacement)]
        states = [cached_request_state(result) for result in results]
        if states[0] != states[1]:
            return f"use_v2={use_v2}: fastbatch gave {states[1]}, vLLM {states[0]}"
        own_lists = {id(request._all_token_ids) for request in running + resumed}
        if any(id(ids) in own_lists for ids in results[1].all_token_ids.values()):
            return f"use_v2={use_v2}: fastbatch gave a request's own token list, not a copy"
    return None


# The shadow check (FASTBATCH_VERIFY) ---------------------------------------
# vLLM's method changes nothing: it reads the requests, the blocks and four
# scheduler fields, and builds a new CachedRequestData.  So the snapshot
# keeps the live objects (the request lists copied: the caller's), vLLM's
# method runs on them after fastbatch's call, and the two results are
# compared; on a divergence the call returns vLLM's.


def _snapshot(scheduler: Any, running_reqs: list[Any], resumed_reqs: list[Any],
              num_scheduled_tokens: dict[str, int], spec_decode_tokens: dict[str, list[int]],
              req_to_new_blocks: dict[str, Any]) -> dict[str, Any] | None:
    """The live inputs (read only, kept), the request lists copied; None with
    pipeline parallelism and no async scheduling, where fastbatch's call is
    vLLM's method itself (nothing to check)."""
    if scheduler.use_pp and not scheduler.scheduler_config.async_scheduling:
        return None
    return {
        "scheduler": {"use_pp": scheduler.use_pp,
                      "async_scheduling": scheduler.scheduler_config.async_scheduling,
                      "use_v2_model_runner": scheduler.use_v2_model_runner,
                      "prev_step_scheduled_req_ids": scheduler.prev_step_scheduled_req_ids},
        "running_reqs": list(running_reqs), "resumed_reqs": list(resumed_reqs),
        "num_scheduled_tokens": num_scheduled_tokens, "spec_decode_tokens": spec_decode_tokens,
        "req_to_new_blocks": req_to_new_blocks,
    }


def _result_outcome(data: Any, requests: list[Any]) -> tuple[Any, list[bool]]:
    """The ``CachedRequestData`` as plain data (``cached_request_state``), and
    per token list sent whether it is a request's own list (it must be a copy)."""
    own = {}
    if data.all_token_ids:
        own = {request.request_id: request._all_token_ids for request in requests}
    return (cached_request_state(data),
            [ids is own.get(req_id) for req_id, ids in data.all_token_ids.items()])


def _outcome(inputs: dict[str, Any], result: Any, *args: Any) -> tuple[Any, list[bool]]:
    return _result_outcome(result, inputs["running_reqs"] + inputs["resumed_reqs"])


def _stand_in_requests(recorded: list[dict[str, Any]]) -> list[Any]:
    """Real ``Request`` objects (built without ``__init__``) with the fields
    the method reads, from a reproducer."""
    from vllm.v1.request import Request
    from vllm.v1.utils import ConstantList

    requests = []
    for fields in recorded:
        request = Request.__new__(Request)
        vars(request).update(fields)
        request._all_token_ids = list(fields["_all_token_ids"])
        request._output_token_ids = list(fields["_output_token_ids"])
        request.all_token_ids = ConstantList(request._all_token_ids)
        request.output_token_ids = ConstantList(request._output_token_ids)
        requests.append(request)
    return requests


def _run(function: Any, inputs: dict[str, Any]) -> tuple[Any, list[bool]]:
    """``function`` on a stand-in scheduler of the four fields it reads and
    the live requests and blocks (it only reads them), or on stand-ins
    rebuilt from a reproducer."""
    fields = inputs["scheduler"]
    scheduler = SimpleNamespace(
        use_pp=fields["use_pp"],
        scheduler_config=SimpleNamespace(async_scheduling=fields["async_scheduling"]),
        use_v2_model_runner=fields["use_v2_model_runner"],
        prev_step_scheduled_req_ids=fields["prev_step_scheduled_req_ids"])
    running, resumed, blocks = (inputs["running_reqs"], inputs["resumed_reqs"],
                                inputs["req_to_new_blocks"])
    if inputs.get("reproducer"):
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        running, resumed = _stand_in_requests(running), _stand_in_requests(resumed)
        blocks = {req_id: KVCacheBlocks(tuple([KVCacheBlock(block_id) for block_id in group]
                                              for group in groups))
                  for req_id, groups in blocks.items()}
    data = function(scheduler, running, resumed, inputs["num_scheduled_tokens"],
                    inputs["spec_decode_tokens"], blocks)
    return _result_outcome(data, running + resumed)


def _compare(ours: tuple[Any, list[bool]], stock: tuple[Any, list[bool]]) -> str | None:
    for (name, got), (_, expected) in zip(ours[0][0], stock[0][0], strict=True):
        if got != expected:
            return f"{name}: fastbatch gave {got!r}, vLLM {expected!r}"
    if ours != stock:
        return (f"a request's own token list sent (fastbatch {ours[1]}, vLLM {stock[1]}), "
                f"or a field's type differs: fastbatch {ours[0]!r}, vLLM {stock[0]!r}")
    return None


def _restore(inputs: dict[str, Any], stock: tuple[Any, list[bool]], result: Any,
             *args: Any) -> Any:
    """vLLM's ``CachedRequestData``, rebuilt from its outcome (its lists are
    vLLM's own: the outcome holds them)."""
    if _CACHED_REQUEST_DATA is None:
        _bind()
    return _CACHED_REQUEST_DATA(**{name: dict(value) if name == "all_token_ids" else value
                                   for name, value in stock[0][0]})


def _for_reproducer(inputs: dict[str, Any]) -> dict[str, Any]:
    """The requests as the fields the method reads (copied), the blocks as
    block ids per group."""
    def recorded(requests: list[Any]) -> list[dict[str, Any]]:
        return [{"request_id": request.request_id,
                 "_all_token_ids": list(request._all_token_ids),
                 "_output_token_ids": list(request._output_token_ids),
                 "num_computed_tokens": request.num_computed_tokens,
                 "num_output_placeholders": request.num_output_placeholders}
                for request in requests]

    return {**inputs, "reproducer": True,
            "running_reqs": recorded(inputs["running_reqs"]),
            "resumed_reqs": recorded(inputs["resumed_reqs"]),
            "req_to_new_blocks": {req_id: tuple([block.block_id for block in group]
                                                for group in blocks.blocks)
                                  for req_id, blocks in inputs["req_to_new_blocks"].items()}}


SHADOW = Shadow(snapshot=_snapshot, run=_run, outcome=_outcome, restore=_restore,
                compare=_compare, for_reproducer=_for_reproducer)

PATCH = Patch(f"{MODULE}:Scheduler._make_cached_request_data", _make_cached_request_data,
              fingerprints=VERIFIED_FINGERPRINTS, activation_check=activation_check,
              companions=COMPANION_FINGERPRINTS, shadow=SHADOW)
