"""Patch: ``vllm.v1.core.sched.scheduler.Scheduler.update_from_output``.

What is replaced: the per-request loop of the scheduler's step update, for the
requests that are plain decodes (with their drafts, under spec decoding) and
do not stop this step. One compiled pass (``fastbatch.take_decode_outputs``)
takes those requests, with their logprobs slices and grammar tokens; vLLM's
loop runs for the rest. vLLM 0.32.0 to 0.34.0.

Guard: the fingerprints of the method and of everything the pass stands in for
(the companions); the activation check on stand-ins of both scheduler classes
over real requests, outputs and KV-cache managers; the shadow runs vLLM's
method on a copy of each request's state.

When it can go: if vLLM gives the loop its own fast path for a request that
gains one token and does not stop.

Upstream: vllm-project/vllm#26114 (the loop's cost, closed as stale) and
#46112 (a decode fast path, closed unmerged).

Story and numbers: ``docs/pieces/update_from_output.md``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from array import array
from types import SimpleNamespace
from typing import Any

import fastbatch
from fastbatch import registry
from fastbatch.patches._compare import (
    COPIED_LISTS,
    copy_request,
    first_difference,
    hasher_description,
    kv_calls,
    kv_probe,
    kv_view,
    plain,
    request_state,
)
from fastbatch.patches._patch import Patch, Shadow, instance_dict_problem
from fastbatch.patches._stand_ins import (
    planted_refusals_unlogged,
    side_state,
    stand_in_logprobs,
    stand_in_requests,
    stand_in_scheduler,
    with_stand_in_grammars,
)

GROUP = "scheduler"  # fastbatch.registry.GROUPS

logger = logging.getLogger("vllm.fastbatch")

MODULE = "vllm.v1.core.sched.scheduler"

VERIFIED_FINGERPRINTS = {
    "d285784b0bfeee092567fadc217beed9540d76395961e94f4d180e7c769461d5": "vLLM 0.32.0",
    "277436550f4f03acec9007f3af0e39ef1331d04073698b4e582c794f202f5887": "vLLM 0.33.0",
    "03ac75b9a1ad9b7e004b0b74912367ba2053a1c2d40046f94459f83c8c02a451":
        "vLLM 0.34.0: rows from req_ids (no req_id_to_index), watermarking, the Mamba "
        "cache_blocks rule, async_kv_waiting",
}
# The base _update_request_with_output: which rule resolves the placeholder.
_BASE_032 = "ffcaec8de9837fe0846d964463a5bdd779490bee660b4a9c227da2268a83693e"
_BASE_033 = "d7f0ff1e416d76419cd8a61033c97699dbd5a64326a32714e3cc76f56d249a51"
_ASYNC_OVERRIDE_032 = "8ba2a99bc67741eb142ef08d3c24c754eba80c1e4b80090bb8ecb0a242701614"
COMPANION_FINGERPRINTS = {
    # The drafts of the requests taken are counted after vLLM's loop: the
    # counts are sums, whatever the order (_count_drafts).
    "vllm.v1.spec_decode.metrics:SpecDecodingStats.observe_draft": {
        "dd1646346925452a680eca2b62f380d28287ffd6df6173db46b2ea56daa4013a":
            "vLLM 0.32.0-0.33.0"},
    f"{MODULE}:Scheduler.make_spec_decoding_stats": {
        "ffc43c0e9e09af48a2dabcf581aa5979871a7c0704bedee7d1abf6b7f42e7f46":
            "vLLM 0.32.0-0.33.0"},
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
            "vLLM 0.33.0: hashes wait for num_hash_lookahead_tokens",
        "1846592eacc85fcc8c2b4e65e8aab62dd6ce1050a079064966f553caeb0ab8d3":
            "vLLM 0.34.0: slices _all_token_ids with token_slice"},
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
    # Its slicing is done in place of calling it (the NamedTuple's fields are
    # checked when bound).
    "vllm.v1.outputs:LogprobsLists.slice_request": {
        "e612f3e8355caf95a82f725342a3e2a735ce255d9b9bf711c2a5ced7c0ef8588":
            "vLLM 0.32.0-0.33.0"},
    # The coordinator's and the full-attention manager's caching, as pinned
    # for the allocation fast path.
    **{name: fingerprints for name, fingerprints
       in registry.piece("allocate_slots").module.COMPANION_FINGERPRINTS.items()
       if name.endswith(("cache_blocks", "get_num_cacheable_tokens", ":replay_boundaries"))},
}
# What the compiled call reads or writes of a Request (plain instance attributes).
REQUEST_ATTRIBUTES = (
    "status", "num_stale_output_tokens", "num_in_flight_tokens", "mm_features",
    "pooling_params", "structured_output_request", "prefill_stats", "sampling_params",
    "_output_token_ids", "_all_token_ids", "max_tokens", "_block_hasher", "block_hashes",
    "num_output_placeholders", "num_computed_tokens", "request_id", "events", "stop_reason",
    "trace_headers", "num_nans_in_logits", "spec_decode_metrics", "client_index")

# Bound on first use (this module imports no vLLM until then).
_KINDS: tuple[Any, ...] | None = None
_STOCK: Any = None
_SCHEDULERS: tuple[Any, Any] | None = None  # (Scheduler, AsyncScheduler)
_PLACEHOLDERS_IN_BASE = True  # vLLM 0.33's rule (else 0.32's)
# vLLM 0.34: no ModelRunnerOutput.req_id_to_index (vLLM indexes req_ids),
# and the Mamba cache_blocks rule (the kernel's variant 3).
_ROWS_FROM_REQ_IDS = False
_ENGINE_CORE_OUTPUTS: Any = None
_GRAMMARS: Any = None  # StructuredOutputManager
# FASTBATCH_VERIFY: the snapshot of the call about to run (see the shadow below).
_PENDING: dict[str, Any] | None = None


def _output_template(output_type: Any) -> tuple[Any, ...]:
    """``EngineCoreOutput``'s positional arguments up to the last one the
    fast path sets, the others at their defaults, and where those seven go."""
    fields = output_type.__struct_fields__
    defaults = output_type.__struct_defaults__
    first_default = len(fields) - len(defaults)
    names = ("request_id", "new_token_ids", "stop_reason", "events", "trace_headers",
             "num_nans_in_logits", "new_logprobs")
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
    global _KINDS, _STOCK, _SCHEDULERS, _PLACEHOLDERS_IN_BASE, _ENGINE_CORE_OUTPUTS, _GRAMMARS
    global _ROWS_FROM_REQ_IDS
    import numpy
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
    from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

    from fastbatch._fingerprint import fingerprint

    _STOCK = PATCH.original() or Scheduler.update_from_output
    _SCHEDULERS = (Scheduler, AsyncScheduler)
    _PLACEHOLDERS_IN_BASE = fingerprint(Scheduler._update_request_with_output) == _BASE_033
    _ROWS_FROM_REQ_IDS = "req_id_to_index" not in ModelRunnerOutput.__dataclass_fields__
    _ENGINE_CORE_OUTPUTS = EngineCoreOutputs
    _GRAMMARS = StructuredOutputManager
    _KINDS = (Request, RequestStatus.RUNNING, KVCacheManager,
              (UnitaryKVCacheCoordinator, KVCacheCoordinatorNoPrefixCache),
              FullAttentionManager, get_request_block_hasher(16, sha256).__code__,
              EngineCoreOutput, _output_template(EngineCoreOutput),
              LogprobsLists if _is_plain_logprobs_lists(LogprobsLists) else None,
              numpy.ndarray)


_LOGPROBS_FIELDS = ("logprob_token_ids", "logprobs", "sampled_token_ranks",
                    "cu_num_generated_tokens")


def _is_plain_logprobs_lists(cls: Any) -> bool:
    """``LogprobsLists`` is the NamedTuple the compiled call builds with
    ``tuple.__new__`` (as its ``slice_request`` does) and reads as a tuple:
    exactly these four fields, read as its items, a plain tuple subclass
    otherwise.  Else requests with logprobs go to vLLM."""
    namespace = vars(cls)
    return (getattr(cls, "_fields", None) == _LOGPROBS_FIELDS
            and cls.__bases__ == (tuple,) and namespace.get("__slots__") == ()
            and cls.__new__.__defaults__ == (None,)
            and all(type(namespace.get(name)).__name__ == "_tuplegetter"
                    for name in _LOGPROBS_FIELDS)
            and not any(name in namespace for name in ("__bool__", "__len__", "__getitem__",
                                                       "__iter__")))


def _variant(scheduler: Any) -> int | None:
    """The placeholder rule of ``scheduler`` (see the kernel's twin), or None
    if it is not one of vLLM's two plain scheduler classes."""
    assert _SCHEDULERS is not None
    scheduler_type = type(scheduler)
    if _PLACEHOLDERS_IN_BASE:
        if scheduler_type not in _SCHEDULERS:
            return None
        return 3 if _ROWS_FROM_REQ_IDS else 0
    if scheduler_type is _SCHEDULERS[1]:
        return 1
    return 2 if scheduler_type is _SCHEDULERS[0] else None


_MISSING = object()


def _step_isplain(scheduler: Any, model_runner_output: Any) -> bool:
    """Nothing in this step that vLLM's loop handles around the requests.
    Scheduler state that vLLM reads only on some path (a stand-in scheduler
    may lack it) is read with a default: missing, the step is vLLM's."""
    state = [getattr(scheduler, name, _MISSING) for name in (
        "perf_metrics", "connector", "ec_connector", "aux_output_connector",
        "return_sampling_mask", "defer_block_free", "grammar_compile_error_reqs",
        "encoder_cache_mismatch_reqs", "structured_output_manager")]
    if _MISSING in state:
        return False
    (perf_metrics, connector, ec_connector, aux_output_connector, return_sampling_mask,
     defer_block_free, grammar_errors, mismatches, _) = state
    return (model_runner_output.kv_connector_output is None
            and model_runner_output.ec_connector_output is None
            and not model_runner_output.pooler_output
            and bool(model_runner_output.sampled_token_ids)
            and connector is None and ec_connector is None
            and aux_output_connector is None
            and not return_sampling_mask
            and not defer_block_free
            and not grammar_errors
            and not mismatches
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


def _takes_drafts(scheduler: Any, scheduler_output: Any) -> bool:
    """Requests with drafts can be taken: the scheduler samples one token per
    step (the token after the accepted drafts), and either keeps no
    statistics or keeps them with no draft invalidated by a grammar (the
    drafts of the requests taken are then counted by vLLM's own
    ``make_spec_decoding_stats``, ``_count_drafts``).  A step without drafts
    reads nothing (vLLM reads these only for a request with drafts), and a
    scheduler that lacks them leaves requests with drafts to vLLM."""
    if not getattr(scheduler_output, "scheduled_spec_decode_tokens", None):
        return False
    if getattr(scheduler, "num_sampled_tokens_per_step", None) != 1:
        return False
    log_stats = getattr(scheduler, "log_stats", None)
    return log_stats is False or (
        log_stats is True and not getattr(scheduler_output, "num_invalid_spec_tokens", True))


def drafts_counted(scheduler_output: Any, model_runner_output: Any,
                   taken: list[str]) -> list[tuple[str, int, int]]:
    """What vLLM's loop hands ``make_spec_decoding_stats`` for the requests
    ``taken`` (in scheduling order): ``(request id, num_draft_tokens,
    num_accepted_tokens)`` for each with drafts scheduled and tokens sampled
    (one token sampled per step: the accepted drafts are the rest)."""
    spec = scheduler_output.scheduled_spec_decode_tokens
    if not spec:
        return []
    sampled = model_runner_output.sampled_token_ids
    index = (_rows(model_runner_output.req_ids) if _ROWS_FROM_REQ_IDS
             else model_runner_output.req_id_to_index)
    counted = []
    for rid in taken:
        drafts = spec.get(rid)
        row = sampled[index[rid]] if sampled else []
        if drafts and row:
            counted.append((rid, len(drafts), max(len(row) - 1, 0)))
    return counted


def _rows(req_ids: list[str]) -> dict[str, int]:
    """vLLM 0.34's index of the runner's rows (the last position of an id)."""
    return {req_id: i for i, req_id in enumerate(req_ids)}


def _count_drafts(scheduler: Any, scheduler_output: Any, outputs: dict[int, Any],
                  counted: list[tuple[str, int, int]]) -> None:
    """The drafts of the requests taken, counted into the step's
    ``SpecDecodingStats`` by vLLM's own ``make_spec_decoding_stats``, as vLLM's
    loop counts them (the counts are sums: the order of the requests does not
    change them; the stats object is created at the first request with drafts
    either way)."""
    stats = next((eco.scheduler_stats for eco in outputs.values()
                  if eco.scheduler_stats is not None), None)
    if stats is None or not counted:
        return
    spec_stats = stats.spec_decoding_stats
    for rid, num_drafts, num_accepted in counted:
        spec_stats = scheduler.make_spec_decoding_stats(
            spec_stats, num_draft_tokens=num_drafts, num_accepted_tokens=num_accepted,
            num_invalid_spec_tokens=scheduler_output.num_invalid_spec_tokens, request_id=rid)
    stats.spec_decoding_stats = spec_stats


def _fast_variant(scheduler: Any, scheduler_output: Any, model_runner_output: Any,
                  drafts: bool) -> int | None:
    """The placeholder rule to hand the compiled call, or None when the step
    goes to vLLM's method whole."""
    if _KINDS is None:
        _bind()
    variant = _variant(scheduler)
    if (variant is None or not _step_isplain(scheduler, model_runner_output)
            # Spec decoding with drafts for every request, none taken: nothing to take.
            or (not drafts and len(scheduler_output.scheduled_spec_decode_tokens)
                >= len(scheduler_output.num_scheduled_tokens))):
        return None
    return variant


class _Answered:
    """vLLM's structured-output manager, except that a request whose grammar
    has already answered this step (in the compiled call) gets that answer
    again without asking the grammar: a grammar is advanced once a step.
    vLLM's loop stops a request refused, as it would have on that answer."""

    def __init__(self, manager: Any, answers: dict[str, bool]) -> None:
        self._manager, self._answers = manager, answers

    def accept_tokens(self, request: Any, new_token_ids: list[int]) -> bool:
        answer = self._answers.get(request.request_id)
        if answer is None:
            return self._manager.accept_tokens(request, new_token_ids)
        return answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)


def _stock_answered(scheduler: Any, scheduler_output: Any, model_runner_output: Any,
                    answers: dict[str, bool]) -> Any:
    """vLLM's method, its grammars answering as in ``answers`` where given."""
    if not answers:
        return _STOCK(scheduler, scheduler_output, model_runner_output)
    grammars = scheduler.structured_output_manager
    scheduler.structured_output_manager = _Answered(grammars, answers)
    try:
        return _STOCK(scheduler, scheduler_output, model_runner_output)
    finally:
        scheduler.structured_output_manager = grammars


def _answers(check: dict[str, Any]) -> dict[str, bool]:
    """What the grammars answered the compiled call (FASTBATCH_VERIFY records it)."""
    return {rid: answer for rid, _, answer in check.get("accepted", ())}


def _recording(accept: Any, calls: list[tuple[str, list[int], bool]]) -> Any:
    """``accept`` that also records each call and its answer (FASTBATCH_VERIFY)."""

    def accept_tokens(request: Any, new_token_ids: list[int]) -> Any:
        answer = accept(request, new_token_ids)
        calls.append((request.request_id, list(new_token_ids), bool(answer)))
        return answer

    return accept_tokens


def update_from_output(self: Any, scheduler_output: Any,
                       model_runner_output: Any) -> dict[int, Any]:
    """fastbatch's drop-in for ``Scheduler.update_from_output`` (same signature)."""
    global _PENDING
    check, _PENDING = _PENDING, None  # the shadow's snapshot of this very call, if any
    drafts = _takes_drafts(self, scheduler_output)
    variant = _fast_variant(self, scheduler_output, model_runner_output, drafts)
    if variant is None:
        return _STOCK(self, scheduler_output, model_runner_output)
    # Requests with a grammar are taken when it is advanced by vLLM's own manager.
    grammars = self.structured_output_manager
    accept = grammars.accept_tokens if type(grammars) is _GRAMMARS else None
    if check is not None and accept is not None:
        accept = _recording(accept, check.setdefault("accepted", []))
    refused: list[str] = []
    taken = fastbatch.take_decode_outputs(self, scheduler_output, model_runner_output,
                                          _KINDS, variant, drafts, accept, refused)
    if taken is None:
        return _STOCK(self, scheduler_output, model_runner_output)
    slots, rest = taken
    if (check is not None and check["live"][1] is scheduler_output
            and not _check_taken(check, slots, rest)):
        _undo_take(check)  # vLLM's method then runs on the untouched step
        check["undone"] = True
        return _stock_answered(self, scheduler_output, model_runner_output, _answers(check))
    remaining = copy.copy(scheduler_output)
    remaining.num_scheduled_tokens = rest
    stock_runner = model_runner_output
    if not rest and variant == 3:
        # vLLM 0.34's loop indexes req_ids (a dict over the batch) for the
        # requests it takes: none here (and the compiled call read the ids).
        stock_runner = copy.copy(model_runner_output)
        stock_runner.req_ids = []
    stock_part = _stock_answered(self, remaining, stock_runner,
                                 dict.fromkeys(refused, False))
    if check is not None:
        own = stock_part.get(0)
        check["rest_outputs"] = list(own.outputs) if own is not None else []
    merged = _merged(stock_part, slots)
    if drafts and self.log_stats:
        taken_ids = [rid for rid in scheduler_output.num_scheduled_tokens if rid not in rest]
        _count_drafts(self, scheduler_output, merged,
                      drafts_counted(scheduler_output, model_runner_output, taken_ids))
    return merged


# ---------------------------------------------------------------------------
# Shadow check (FASTBATCH_VERIFY).  The snapshot copies every scheduled
# request before the call; right after the compiled call has taken its
# requests, and before vLLM's method runs on the others, ``_check_taken``
# runs vLLM's own ``update_from_output`` on a stand-in scheduler holding
# copies of the requests taken (and a copy of the KV-cache manager that
# records, and does not do, what the block pool would be asked) and compares.
# On a difference the compiled call's writes are undone and vLLM's method
# runs on the whole step, so the state after the call is exactly stock's.

_SCHEDULER_SETTINGS = ("max_model_len", "num_spec_tokens", "num_sampled_tokens_per_step",
                       "is_mm_encoder_only", "spec_decode_metrics_level",
                       "recompute_kv_load_failures", "has_mamba_layers")
def _exact_output(output: Any) -> Any:
    """An ``EngineCoreOutput`` as compared: as is, or as plain data if it
    holds arrays (its sample logprobs)."""
    return output if getattr(output, "new_logprobs", None) is None else plain(output)


def _outcome_of(scheduler: Any, taken: list[str], requests: dict[str, Any],
                results: dict[int, Any], kv_calls: list[Any]) -> dict[str, Any]:
    """What a call did to the requests ``taken``: each one's state, queue and
    registration, its output (per front-end, in order), the finished sets,
    and the KV cache's part of it."""
    running = {id(request) for request in scheduler.running}
    finished, registered = scheduler.finished_req_ids, scheduler.requests
    wanted = set(taken)
    outputs = {}
    for client, engine_core_outputs in results.items():
        own = [output for output in engine_core_outputs.outputs
               if output.request_id in wanted]
        done = sorted(wanted & set(engine_core_outputs.finished_requests or ()))
        if own or done:
            outputs[client] = {"order": [output.request_id for output in own],
                               # EngineCoreOutput structs (compared field by field);
                               # with sample logprobs as plain data (arrays exactly:
                               # ``==`` on them is elementwise, or ambiguous)
                               "outputs": {output.request_id: _exact_output(output)
                                           for output in own},
                               "finished": done}
    return {
        "requests": {rid: (request_state(requests[rid]), id(requests[rid]) in running,
                           registered.get(rid) is requests[rid], rid in finished)
                     for rid in taken},
        "outputs": outputs,
        "kv": kv_view(scheduler.kv_cache_manager, taken),
        "kv_calls": kv_calls,
    }


def _snapshot(scheduler: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
    """Before the call: every scheduled request (its attributes, and a copy),
    the sampled rows, the scheduler's settings; None where the step goes to
    vLLM's method whole (nothing to check)."""
    global _PENDING
    _PENDING = None
    if _fast_variant(scheduler, scheduler_output, model_runner_output,
                     _takes_drafts(scheduler, scheduler_output)) is None:
        return None
    requests = scheduler.requests
    saved = {}
    for rid in scheduler_output.num_scheduled_tokens:
        request = requests.get(rid)
        if request is not None and hasattr(request, "__dict__"):
            saved[rid] = (request, dict(vars(request)), copy_request(request))
    rows = model_runner_output.sampled_token_ids
    runner = copy.copy(model_runner_output)
    runner.sampled_token_ids = [list(row) if type(row) is list else row for row in rows]
    settings = {name: getattr(scheduler, name) for name in _SCHEDULER_SETTINGS
                if hasattr(scheduler, name)}
    if settings.get("has_mamba_layers"):  # vLLM 0.34's Mamba rule reads these too
        with contextlib.suppress(Exception):  # else those requests were left to vLLM
            settings["scheduler_config"] = SimpleNamespace(
                async_scheduling=scheduler.scheduler_config.async_scheduling)
            settings["cache_config"] = SimpleNamespace(
                enable_prefix_caching=scheduler.cache_config.enable_prefix_caching)
    inputs = {
        "cls": type(scheduler),
        "settings": settings,
        "scheduled": dict(scheduler_output.num_scheduled_tokens),
        "spec": dict(scheduler_output.scheduled_spec_decode_tokens),
        "runner": runner,
        "requests": {rid: entry[2] for rid, entry in saved.items()},
        "live": (scheduler, scheduler_output, model_runner_output, saved, list(rows)),
    }
    _PENDING = inputs
    return inputs


def _run(function: Any, inputs: dict[str, Any]) -> Any:
    """``function`` (vLLM's method, or fastbatch's on replay) on a stand-in
    scheduler holding fresh copies of the requests taken; its outcome."""
    taken = inputs.get("taken")
    if not taken:
        return None  # nothing was taken: vLLM's method ran on the whole step
    memo = inputs.get("memo")
    if memo is not None and memo[0] is function:
        return memo[1]
    requests = [copy_request(inputs["requests"][rid]) for rid in taken]
    scheduler = stand_in_scheduler(inputs["cls"], True, requests,
                                    manager=kv_probe(inputs["kv"]))
    scheduler.__dict__.update(inputs["settings"])
    scheduled = {rid: inputs["scheduled"][rid] for rid in taken}
    scheduler_output = SimpleNamespace(
        num_scheduled_tokens=scheduled,
        scheduled_spec_decode_tokens={rid: inputs["spec"][rid] for rid in taken
                                      if rid in inputs["spec"]},
        total_num_scheduled_tokens=sum(scheduled.values()), num_invalid_spec_tokens=None)
    runner = copy.copy(inputs["runner"])
    runner.sampled_token_ids = [list(row) if type(row) is list else row
                                for row in runner.sampled_token_ids]
    # The grammars of the requests taken answer as they answered the compiled
    # call (asked again, they would advance twice); the calls are recorded.
    # On replay, fastbatch's method hands the same answers to the compiled call.
    answers, grammar_calls = inputs.get("answers", {}), []

    def accept_tokens(request: Any, new_token_ids: list[int]) -> bool:
        if request.structured_output_request is None or not new_token_ids:
            return True  # vLLM's early return
        grammar_calls.append((request.request_id, list(new_token_ids)))
        return answers.get(request.request_id, True)

    if _GRAMMARS is None:
        _bind()
    # vLLM's manager type (fastbatch's method hands it to the compiled call),
    # its accept_tokens this probe.
    probe = object.__new__(_GRAMMARS)
    probe.accept_tokens = accept_tokens
    scheduler.structured_output_manager = probe
    counted: list[tuple[str, int, int]] = []
    if function is _STOCK:  # what vLLM's loop hands make_spec_decoding_stats (log_stats off)

        def count(stats: Any, *, num_draft_tokens: int, num_accepted_tokens: int,
                  request_id: str, **_: Any) -> None:
            counted.append((request_id, num_draft_tokens, num_accepted_tokens))

        scheduler.make_spec_decoding_stats = count
    try:
        results = function(scheduler, scheduler_output, runner)
    except Exception as exc:  # a plain outcome: FASTBATCH_VERIFY must not raise it
        return {"raised": f"{type(exc).__name__}: {exc}"}
    outcome = _outcome_of(scheduler, taken, {request.request_id: request for request in requests},
                          results, kv_calls(scheduler.kv_cache_manager))
    outcome["grammar"] = grammar_calls
    if function is _STOCK:
        outcome["drafts_counted"] = counted
    return outcome


def _check_taken(check: dict[str, Any], slots: list[Any], rest: dict[str, Any]) -> bool:
    """Right after the compiled call: vLLM's method on copies of the requests
    it took, compared with what it did to them; True if they agree."""
    scheduler, scheduler_output, _, saved, _ = check["live"]
    try:
        taken = [rid for rid in scheduler_output.num_scheduled_tokens if rid not in rest]
        outputs = [slot for slot in slots if type(slot) is not str]
        check["taken"], check["slot_outputs"] = taken, outputs
        check["kv"] = kv_probe(scheduler.kv_cache_manager, taken)
        ours = _outcome_of(scheduler, taken, {rid: saved[rid][0] for rid in taken},
                           {0: SimpleNamespace(outputs=outputs, finished_requests=None)}, [])
        ours["untouched"] = [rid for rid, (request, _, clone) in saved.items()
                             if rid not in ours["requests"]
                             and request_state(request) != request_state(clone)]
        ours["drafts_counted"] = drafts_counted(scheduler_output, check["live"][2], taken)
        wanted = set(taken)
        ours["grammar"] = [(rid, tokens) for rid, tokens, _ in check.get("accepted", ())
                           if rid in wanted]
        check["answers"] = {rid: answer for rid, answer in _answers(check).items()
                            if rid in wanted}
        stock = _run(_STOCK, check)
    except Exception:  # the shadow's own failure: vLLM's method takes the step, unchecked
        logger.exception("fastbatch: FASTBATCH_VERIFY could not check update_from_output; "
                         "vLLM's method runs this step")
        check["taken"] = None
        return False
    stock["untouched"] = []
    check["ours"], check["memo"] = ours, (_STOCK, stock)
    return _compare(ours, stock) is None


def _undo_take(check: dict[str, Any]) -> None:
    """Put back every scheduled request and sampled row as they were before
    the compiled call (the same objects, their contents as snapshotted)."""
    _, _, model_runner_output, saved, rows = check["live"]
    for request, attributes, clone in saved.values():
        state = vars(request)
        state.clear()
        state.update(attributes)
        copied = vars(clone)
        for name in COPIED_LISTS:
            if type(attributes.get(name)) is list or isinstance(attributes.get(name), array):
                attributes[name][:] = copied[name]
        table = attributes.get("_prompt_embeds_per_block_hashes")
        if type(table) is dict:
            table.clear()
            table.update(copied["_prompt_embeds_per_block_hashes"])
    model_runner_output.sampled_token_ids[:] = rows
    for row, copied_row in zip(rows, check["runner"].sampled_token_ids, strict=True):
        if type(row) is list:
            row[:] = copied_row


def _expected_outputs(inputs: dict[str, Any]) -> list[Any]:
    """Front-end 0's outputs as vLLM's single loop orders them: by scheduling
    order (a plain step has no output from outside the loop)."""
    order = {rid: index for index, rid in enumerate(inputs["scheduled"])}
    return sorted(inputs["rest_outputs"] + inputs["slot_outputs"],
                  key=lambda output: order.get(output.request_id, len(order)))


def _outcome(inputs: dict[str, Any], result: Any, *args: Any) -> Any:
    ours = inputs.get("ours")
    if ours is None or "rest_outputs" not in inputs:
        return ours  # nothing taken, or the check failed before vLLM's method ran
    own = result.get(0)
    got = own.outputs if own is not None else []
    expected = _expected_outputs(inputs)
    merged = len(got) == len(expected) and all(
        left is right for left, right in zip(got, expected, strict=False))
    return {**ours, "merged": merged}


def _compare(ours: Any, stock: Any) -> str | None:
    if ours is None or stock is None:
        return None if ours is stock else f"fastbatch {ours!r:.300}, vLLM {stock!r:.300}"
    ours, stock = dict(ours), dict(stock)
    untouched = ours.pop("untouched", [])
    stock.pop("untouched", None)
    if untouched:
        return f"the compiled call changed requests it left to vLLM: {untouched[:20]}"
    if not ours.pop("merged", True):
        return "fastbatch's outputs are not merged in vLLM's order"
    stock.pop("merged", None)
    if "drafts_counted" not in ours or "drafts_counted" not in stock:
        # (a replay runs fastbatch's method on a scheduler without statistics)
        ours.pop("drafts_counted", None)
        stock.pop("drafts_counted", None)
    return first_difference(ours, stock)


def _restore(inputs: dict[str, Any], stock: Any, result: Any, *args: Any) -> Any:
    """vLLM's result, in the objects vLLM holds: after a difference in the
    requests taken, the call has already undone the compiled call's writes
    and run vLLM's method on the whole step; after a wrong merge, front-end
    0's outputs are put in vLLM's order; if fastbatch raised, the writes are
    undone and vLLM's method runs."""
    if inputs.get("undone"):
        return result
    if "rest_outputs" in inputs and result is not None:
        result[0].outputs = _expected_outputs(inputs)
        return result
    scheduler, scheduler_output, model_runner_output = inputs["live"][:3]
    _undo_take(inputs)
    return _stock_answered(scheduler, scheduler_output, model_runner_output,
                           _answers(inputs))


def _for_reproducer(inputs: dict[str, Any]) -> dict[str, Any]:
    """The inputs of the requests taken, without the live objects; vLLM's
    block hasher as data."""
    kept = {key: value for key, value in inputs.items()
            if key not in ("live", "memo", "ours", "rest_outputs", "slot_outputs",
                           "requests", "undone", "accepted")}
    requests = {}
    for rid in inputs.get("taken") or ():
        clone = copy.copy(inputs["requests"][rid])
        grammar = vars(clone).get("structured_output_request")
        if dataclasses.is_dataclass(grammar):
            # The replay's grammars answer as recorded: only the request's
            # constraint is kept (a compiled grammar need not pickle).
            clone.structured_output_request = dataclasses.replace(
                grammar, _grammar=None, reasoner=None)
        hasher = vars(clone).get("_block_hasher")
        if hasher is not None:
            with contextlib.suppress(Exception):  # else as is: it may not pickle
                clone._block_hasher = hasher_description(hasher)
        requests[rid] = clone
    kept["requests"] = requests
    if kept.get("kv") is not None:
        kept["kv"] = kv_probe(kept["kv"], detach=True)
    return kept


SHADOW = Shadow(snapshot=_snapshot, run=_run, outcome=_outcome, restore=_restore,
                compare=_compare, for_reproducer=_for_reproducer)


def _fast_outputs() -> int:
    """The requests the fast path (compiled, or its twin) has taken."""
    return registry.implementation("update_from_output").stats()["fast_outputs"]


def _runner_output(model_runner_output: Any, req_ids: list[str], sampled: list[list[int]],
                   logprobs: Any) -> Any:
    """vLLM's ``ModelRunnerOutput`` (with ``req_id_to_index`` where this vLLM has it)."""
    indices = ({} if _ROWS_FROM_REQ_IDS else
               {"req_id_to_index": {rid: i for i, rid in enumerate(req_ids)}})
    return model_runner_output(req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs,
                               **indices)


def activation_check(method: Any, replacement: Any) -> str | None:
    """Why fastbatch must stay off, or None: a difference between stock and
    fastbatch on stand-in schedulers of both classes (sync and async), prefix
    caching on and off, over prefills, decodes across block boundaries and
    stops by length, stop token, EOS and after min_tokens, requests with
    sample logprobs (runner logprobs None, by row, through
    ``cu_num_generated_tokens``), the runner's rows in scheduling order and
    reversed; or the fast path took no request (all handed to vLLM)."""
    from types import SimpleNamespace

    import numpy
    from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput
    from vllm.v1.request import RequestStatus

    global _STOCK
    _bind()
    _STOCK = method
    taken_before = _fast_outputs()
    assert _SCHEDULERS is not None
    # The compiled call reads and writes these through the request's dict.
    problem = instance_dict_problem(stand_in_requests()[0], REQUEST_ATTRIBUTES)
    if problem is not None:
        return problem
    # Request i samples tokens[(step + 3 * i) % 24]: a stop token (31) and EOS (2)
    # come by after several block boundaries (blocks of 4).
    tokens = [7 + index for index in range(24)]
    tokens[10], tokens[17] = 31, 2
    for cls in _SCHEDULERS:
        asynchronous = cls is _SCHEDULERS[1]
        for enable_caching in (True, False):
            sides = [stand_in_scheduler(cls, enable_caching, stand_in_requests())
                     for _ in range(2)]
            for scheduler in sides:
                with_stand_in_grammars(scheduler)
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
                    # The runner's rows: in scheduling order, or (odd steps) reversed.
                    req_ids = list(scheduled)[::-1 if step % 2 else 1]
                    runner_output = _runner_output(
                        ModelRunnerOutput, req_ids,
                        [[tokens[(step + 3 * int(rid[1:])) % len(tokens)]] for rid in req_ids],
                        stand_in_logprobs(numpy, LogprobsLists, step, len(req_ids)))
                    scheduler_output = SimpleNamespace(
                        num_scheduled_tokens=scheduled, scheduled_spec_decode_tokens={},
                        total_num_scheduled_tokens=sum(scheduled.values()),
                        num_invalid_spec_tokens=None)
                    with planted_refusals_unlogged(MODULE):
                        result = update(scheduler, scheduler_output, runner_output)
                    states.append(side_state(scheduler, result))
                if states and states[0] != states[1]:
                    return (f"{cls.__name__}, caching {enable_caching}, step {step}: "
                            f"fastbatch gave {states[1]}, vLLM {states[0]}")
    if _fast_outputs() == taken_before:
        return "the fast path took no request in the check (every one went to vLLM's loop)"
    return None


PATCH = Patch(f"{MODULE}:Scheduler.update_from_output", update_from_output,
              fingerprints=VERIFIED_FINGERPRINTS, activation_check=activation_check,
              companions=COMPANION_FINGERPRINTS, shadow=SHADOW)
