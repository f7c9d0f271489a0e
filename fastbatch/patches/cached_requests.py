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
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import fastbatch
from fastbatch.patches._patch import Patch

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


PATCH = Patch(f"{MODULE}:Scheduler._make_cached_request_data", _make_cached_request_data,
              fingerprints=VERIFIED_FINGERPRINTS, activation_check=activation_check,
              companions=COMPANION_FINGERPRINTS)
