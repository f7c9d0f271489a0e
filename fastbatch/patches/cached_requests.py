"""Patch: ``vllm.v1.core.sched.scheduler.Scheduler._make_cached_request_data``.

What is replaced: the method with which ``Scheduler.schedule()`` packs, every
step, the requests that were scheduled before into a ``CachedRequestData``:
their ids, block ids, computed and output token counts. Either of vLLM's two
shapes (0.30.0 to 0.33.0, 0.34.0) becomes vLLM's method with its per-request
loop done by one compiled call (``fastbatch.cached_request_lists``); with
pipeline parallelism and no async scheduling the call is vLLM's. vLLM 0.30.0
to 0.34.0.

Guard: one fingerprint per shape, and the functions the loop reads in place of
calling (the companions); the activation check on small real requests and
blocks, by position and by keyword; the shadow compares every field.

When it can go: if vLLM builds this per-step payload from arrays.

Upstream: none found in vLLM's issues and PRs for this method; the nearest is
vllm-project/vllm#42131 (an open decode fast path for the scheduler).

Story and numbers: ``docs/pieces/cached_requests.md``.
"""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace
from typing import Any

import fastbatch
from fastbatch import registry
from fastbatch.patches._patch import Patch, Shadow

GROUP = "scheduler"  # fastbatch.registry.GROUPS

MODULE = "vllm.v1.core.sched.scheduler"

VERIFIED_FINGERPRINTS = {
    "06d16f126e559b761fc93c637e875dfb573b2957f6017304f455c07f8a8a68ae": "vLLM 0.27.0-0.33.0",
    "8222cc2e6b518a73b66e40fb0b3cab9dab2df53ee64470f9b91cb5689daef3a4":
        "vLLM 0.34.0: running requests only (resumed ones are sent again as new), "
        "no resumed_req_ids or all_token_ids",
}
COMPANION_FINGERPRINTS = {
    "vllm.v1.core.kv_cache_manager:KVCacheBlocks.get_block_ids": {
        "2ad0a22dc7d487e15941f3ffec417685c71f75400bcc21697dec50958031f186": "vLLM 0.30.0-0.34.0"},
    "vllm.v1.utils:ConstantList.copy": {
        "973c82b058b491bcadeedea4869f3bf14b9d772537d03a4ae1d1359c6fc39460": "vLLM 0.31.0-0.34.0"},
    "vllm.v1.request:Request.num_output_tokens.fget": {
        "6cf9ce95b8215fda4e8026120186cbe096dc989dc56f01fc2e61cfabafe20d0f": "vLLM 0.31.0-0.34.0"},
}

# The two shapes of vLLM's method: its parameters, and the fields of the
# CachedRequestData it fills.
WITH_RESUMED = "with resumed requests (vLLM 0.30.0-0.33.0)"
RUNNING_ONLY = "running requests only (vLLM 0.34.0)"
SHAPES = {
    WITH_RESUMED: (("self", "running_reqs", "resumed_reqs", "num_scheduled_tokens",
                    "spec_decode_tokens", "req_to_new_blocks"),
                   ("req_ids", "resumed_req_ids", "new_token_ids", "all_token_ids",
                    "new_block_ids", "num_computed_tokens", "num_output_tokens")),
    RUNNING_ONLY: (("self", "running_reqs", "num_scheduled_tokens", "spec_decode_tokens",
                    "req_to_new_blocks"),
                   ("req_ids", "new_token_ids", "new_block_ids", "num_computed_tokens",
                    "num_output_tokens")),
}
CACHED_REQUEST_FIELDS = SHAPES[WITH_RESUMED][1]  # 0.30.0-0.33.0's (before the 0.34.0 port)

# Bound on first use (this module imports no vLLM until then), or by the
# activation check: (Request, KVCacheBlocks, ConstantList), CachedRequestData,
# vLLM's own method, the shape it has (None: neither), and the replacement of
# that shape (vLLM's method where neither).
_KINDS: tuple[Any, Any, Any] | None = None
_CACHED_REQUEST_DATA: Any = None
_STOCK: Any = None
_SHAPE: str | None = None
_IMPL: Any = None
_SIGNATURE: inspect.Signature | None = None  # _IMPL's (the shadow binds calls to it)


def shape_of(method: Any, data_type: Any) -> str | None:
    """Which of ``SHAPES`` vLLM's ``method`` and its ``CachedRequestData``
    (``data_type``) have, or None."""
    try:
        parameters = tuple(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        return None
    fields = tuple(field.name for field in dataclasses.fields(data_type))
    for shape, expected in SHAPES.items():
        if (parameters, fields) == expected:
            return shape
    return None


def _bind(method: Any = None) -> None:
    """Bind to the installed vLLM, once: its classes, its method (``method``,
    else the one the patch replaced, else the class's) and that method's
    shape, which picks the replacement every later call runs."""
    global _KINDS, _CACHED_REQUEST_DATA, _STOCK, _SHAPE, _IMPL, _SIGNATURE
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import CachedRequestData
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request
    from vllm.v1.utils import ConstantList

    _KINDS = (Request, KVCacheBlocks, ConstantList)
    _CACHED_REQUEST_DATA = CachedRequestData
    _STOCK = method or PATCH.original() or Scheduler._make_cached_request_data
    _SHAPE = shape_of(_STOCK, CachedRequestData)
    _IMPL = {WITH_RESUMED: _make_with_resumed,
             RUNNING_ONLY: _make_running_only}.get(_SHAPE, _STOCK)
    _SIGNATURE = inspect.signature(_IMPL)


def _make_cached_request_data(self: Any, *args: Any, **kwargs: Any) -> Any:
    """fastbatch's drop-in for ``Scheduler._make_cached_request_data``: the
    replacement of the installed vLLM's shape (bound once), which takes the
    arguments as vLLM's method does, by position or keyword."""
    if _IMPL is None:
        _bind()
    return _IMPL(self, *args, **kwargs)


def _make_with_resumed(self: Any, running_reqs: list[Any], resumed_reqs: list[Any],
                       num_scheduled_tokens: dict[str, int],
                       spec_decode_tokens: dict[str, list[int]],
                       req_to_new_blocks: dict[str, Any]) -> Any:
    """vLLM 0.30.0 to 0.33.0's method with its per-request loop compiled."""
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


def _make_running_only(self: Any, running_reqs: list[Any],
                       num_scheduled_tokens: dict[str, int],
                       spec_decode_tokens: dict[str, list[int]],
                       req_to_new_blocks: dict[str, Any]) -> Any:
    """vLLM 0.34.0's method with its per-request loop compiled: the loop of
    0.33.0 with no resumed requests and no token ids to send."""
    if self.use_pp and not self.scheduler_config.async_scheduling:
        return _STOCK(self, running_reqs, num_scheduled_tokens, spec_decode_tokens,
                      req_to_new_blocks)
    req_ids, _, _, new_block_ids, num_computed_tokens, num_output_tokens = (
        fastbatch.cached_request_lists(running_reqs, [], req_to_new_blocks, None, _KINDS))
    return _CACHED_REQUEST_DATA(
        req_ids=req_ids,
        new_token_ids=[],
        new_block_ids=new_block_ids,
        num_computed_tokens=num_computed_tokens,
        num_output_tokens=num_output_tokens,
    )


def _token_lists(data: Any) -> dict[str, Any]:
    """``data.all_token_ids`` (0.30.0 to 0.33.0), or no token lists (0.34.0)."""
    return vars(data).get("all_token_ids", {})


def cached_request_state(data: Any) -> Any:
    """A ``CachedRequestData`` as plain data: every field in order (dicts as
    their items, in order), and whether each token list is a list of its own."""
    return ([(name, list(value.items()) if isinstance(value, dict) else value)
             for name, value in vars(data).items()],
            [type(ids) is list for ids in _token_lists(data).values()])


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


def scheduler_with(shape: str, fields: dict[str, Any]) -> Any:
    """A real ``Scheduler`` instance (built without ``__init__``) carrying
    only what the method of ``shape`` reads: ``use_pp``,
    ``scheduler_config.async_scheduling``, and before 0.34.0
    ``use_v2_model_runner`` and ``prev_step_scheduled_req_ids``."""
    from vllm.v1.core.sched.scheduler import Scheduler

    scheduler = Scheduler.__new__(Scheduler)
    scheduler.use_pp = fields["use_pp"]
    scheduler.scheduler_config = SimpleNamespace(async_scheduling=fields["async_scheduling"])
    if shape == WITH_RESUMED:
        scheduler.use_v2_model_runner = fields["use_v2_model_runner"]
        scheduler.prev_step_scheduled_req_ids = fields["prev_step_scheduled_req_ids"]
    return scheduler


def arguments_of(shape: str, running: list[Any], resumed: list[Any],
                 num_scheduled_tokens: dict[str, int], spec_decode_tokens: dict[str, Any],
                 new_blocks: dict[str, Any]) -> dict[str, Any]:
    """The arguments of the method of ``shape``, by name (0.34.0 has no
    resumed requests: ``resumed`` must be empty there)."""
    if shape == RUNNING_ONLY:
        if resumed:
            raise ValueError("vLLM 0.34.0's method takes no resumed requests")
        return {"running_reqs": running, "num_scheduled_tokens": num_scheduled_tokens,
                "spec_decode_tokens": spec_decode_tokens, "req_to_new_blocks": new_blocks}
    return {"running_reqs": running, "resumed_reqs": resumed,
            "num_scheduled_tokens": num_scheduled_tokens,
            "spec_decode_tokens": spec_decode_tokens, "req_to_new_blocks": new_blocks}


def _counted() -> int:
    """The ``requests`` counter of the piece in use (compiled, or its twin)."""
    return registry.implementation("cached_requests").stats()["requests"]


def activation_check(method: Any, replacement: Any) -> str | None:
    """Why fastbatch must stay off, or None: vLLM's method and
    ``CachedRequestData`` are of neither shape, stock and fastbatch differ on
    a small real batch, or fastbatch's compiled loop did not take its
    requests."""
    from vllm.v1.core.sched.output import CachedRequestData

    _bind(method)
    if _SHAPE is None:
        fields = tuple(field.name for field in dataclasses.fields(CachedRequestData))
        return (f"vLLM's method {inspect.signature(method)} and CachedRequestData's fields "
                f"{fields} are of neither verified shape: {SHAPES}")
    running, resumed, new_blocks = _small_batch()
    if _SHAPE == RUNNING_ONLY:
        running, resumed = running + resumed, []
        cases = [{"use_pp": use_pp, "async_scheduling": use_pp} for use_pp in (False, True)]
    else:
        cases = [{"use_pp": use_pp, "async_scheduling": use_pp, "use_v2_model_runner": use_v2,
                  "prev_step_scheduled_req_ids": {"r1", "r4"}}
                 for use_pp in (False, True) for use_v2 in (False, True)]
    requests = running + resumed
    own_lists = {id(request._all_token_ids) for request in requests}
    for number, fields in enumerate(cases):
        scheduler = scheduler_with(_SHAPE, fields)
        arguments = arguments_of(_SHAPE, running, resumed, {}, {}, new_blocks)
        expected = method(scheduler, **arguments)
        before = _counted()
        if number % 2:  # by keyword, as some callers pass them
            got = replacement(scheduler, **arguments)
        else:
            got = replacement(scheduler, *arguments.values())
        took = _counted() - before
        states = [cached_request_state(result) for result in (expected, got)]
        if states[0] != states[1]:
            return f"{fields}: fastbatch gave {states[1]}, vLLM {states[0]}"
        if any(id(ids) in own_lists for ids in _token_lists(got).values()):
            return f"{fields}: fastbatch gave a request's own token list, not a copy"
        if took != len(requests):
            return (f"{fields}: fastbatch's compiled loop took {took} of the "
                    f"{len(requests)} requests (the call was not fastbatch's)")
    return None


# The shadow check (FASTBATCH_VERIFY) ---------------------------------------
# vLLM's method changes nothing: it reads the requests, the blocks and the
# scheduler's fields, and builds a new CachedRequestData.  So the snapshot
# keeps the live objects (the request lists copied: the caller's), vLLM's
# method runs on them after fastbatch's call, and the two results are
# compared; on a divergence the call returns vLLM's.

_REQUEST_LISTS = ("running_reqs", "resumed_reqs")


def _snapshot(scheduler: Any, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
    """The live inputs by name (read only, kept), the request lists copied;
    None with pipeline parallelism and no async scheduling, where fastbatch's
    call is vLLM's method itself (nothing to check)."""
    if _IMPL is None:
        _bind()
    if scheduler.use_pp and not scheduler.scheduler_config.async_scheduling:
        return None
    assert _SIGNATURE is not None
    arguments = _SIGNATURE.bind(scheduler, *args, **kwargs).arguments
    del arguments["self"]
    fields = {"use_pp": scheduler.use_pp,
              "async_scheduling": scheduler.scheduler_config.async_scheduling}
    if _SHAPE == WITH_RESUMED:
        fields["use_v2_model_runner"] = scheduler.use_v2_model_runner
        fields["prev_step_scheduled_req_ids"] = scheduler.prev_step_scheduled_req_ids
    return {"shape": _SHAPE, "scheduler": fields,
            **{name: list(value) if name in _REQUEST_LISTS else value
               for name, value in arguments.items()}}


def _requests_of(inputs: dict[str, Any]) -> list[Any]:
    return [request for name in _REQUEST_LISTS for request in inputs.get(name, ())]


def _result_outcome(data: Any, requests: list[Any]) -> tuple[Any, list[bool]]:
    """The ``CachedRequestData`` as plain data (``cached_request_state``), and
    per token list sent whether it is a request's own list (it must be a copy)."""
    token_lists = _token_lists(data)
    own = {}
    if token_lists:
        own = {request.request_id: request._all_token_ids for request in requests}
    return (cached_request_state(data),
            [ids is own.get(req_id) for req_id, ids in token_lists.items()])


def _outcome(inputs: dict[str, Any], result: Any, *args: Any,
             **kwargs: Any) -> tuple[Any, list[bool]]:
    return _result_outcome(result, _requests_of(inputs))


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
    """``function`` on a ``Scheduler`` carrying the fields it reads
    (``scheduler_with``) and the live requests and blocks (it only reads
    them), or on stand-ins rebuilt from a reproducer; called by keyword."""
    scheduler = scheduler_with(inputs.get("shape", WITH_RESUMED),  # older reproducers
                               inputs["scheduler"])
    arguments = {name: value for name, value in inputs.items()
                 if name not in ("shape", "scheduler", "reproducer")}
    if inputs.get("reproducer"):
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        for name in _REQUEST_LISTS:
            if name in arguments:
                arguments[name] = _stand_in_requests(arguments[name])
        arguments["req_to_new_blocks"] = {
            req_id: KVCacheBlocks(tuple([KVCacheBlock(block_id) for block_id in group]
                                        for group in groups))
            for req_id, groups in arguments["req_to_new_blocks"].items()}
    data = function(scheduler, **arguments)
    return _result_outcome(data, _requests_of(arguments))


def _compare(ours: tuple[Any, list[bool]], stock: tuple[Any, list[bool]]) -> str | None:
    for (name, got), (_, expected) in zip(ours[0][0], stock[0][0], strict=True):
        if got != expected:
            return f"{name}: fastbatch gave {got!r}, vLLM {expected!r}"
    if ours != stock:
        return (f"a request's own token list sent (fastbatch {ours[1]}, vLLM {stock[1]}), "
                f"or a field's type differs: fastbatch {ours[0]!r}, vLLM {stock[0]!r}")
    return None


def _restore(inputs: dict[str, Any], stock: tuple[Any, list[bool]], result: Any,
             *args: Any, **kwargs: Any) -> Any:
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
            **{name: recorded(inputs[name]) for name in _REQUEST_LISTS if name in inputs},
            "req_to_new_blocks": {req_id: tuple([block.block_id for block in group]
                                                for group in blocks.blocks)
                                  for req_id, blocks in inputs["req_to_new_blocks"].items()}}


SHADOW = Shadow(snapshot=_snapshot, run=_run, outcome=_outcome, restore=_restore,
                compare=_compare, for_reproducer=_for_reproducer)

PATCH = Patch(f"{MODULE}:Scheduler._make_cached_request_data", _make_cached_request_data,
              fingerprints=VERIFIED_FINGERPRINTS, activation_check=activation_check,
              companions=COMPANION_FINGERPRINTS, shadow=SHADOW)
