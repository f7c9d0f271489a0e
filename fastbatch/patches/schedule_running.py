"""Patch: ``vllm.v1.core.sched.scheduler.Scheduler.schedule`` (its running-request loop).

What is replaced: the loop of ``Scheduler.schedule`` that schedules the
RUNNING requests, once per step (budgets, the async ``max_tokens`` skip,
``num_new_tokens``, ``_reserve_prefill_lookahead``, a profiling scope and
``allocate_slots`` per request, the drafts to verify). vLLM's method with that
loop done by one compiled call (``fastbatch.schedule_running_requests``) for
the requests it can take. vLLM 0.32.0 to 0.34.0.

Guard: ``schedule``'s fingerprints (a variant per release) and the companions;
the activation check runs vLLM's loop and the compiled one on real requests;
the shadow runs vLLM's loop on copies.

When it can go: if vLLM gives ``schedule()`` a decode fast path of its own.

Upstream: vllm-project/vllm#42131 (open: a decode fast path for the scheduler,
in Python).

Story and numbers: ``docs/pieces/schedule_running.md``.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import random
import sys
from typing import Any

import fastbatch
from fastbatch import _verify, registry
from fastbatch.patches._patch import Patch, Shadow, instance_dict_problem
from fastbatch.patches._source import assigned, compile_in_module, function_tree
from fastbatch.patches._stand_ins import kv_manager_state, running_scheduler, scheduled_request

GROUP = "scheduler"  # fastbatch.registry.GROUPS

MODULE = "vllm.v1.core.sched.scheduler"
TARGET = f"{MODULE}:Scheduler.schedule"
VERIFIED_FINGERPRINTS = {
    "6625adf8f31be3abc465e7a5d891cf9266445fa2e6dc45aa87a79918e185838f": "vLLM 0.32.0",
    "e772cd22747586cfa366bb0ac0d819d8829f391d3cb8fc353ea87bf4093ff044":
        "vLLM 0.33.0: drafts_needed",
    "11d053fe9babdc52461c9ab0fb206daf3a7fbda084df692049587ab8386e9e35":
        "vLLM 0.34.0: the running loop as 0.33.0's (a comment changed); around it "
        "long_prefill_token_threshold also needs enable_chunked_prefill, async KV loads, "
        "resumed requests sent as new ones",
}
COMPANION_FINGERPRINTS = {
    f"{MODULE}:Scheduler._reserve_prefill_lookahead": {
        "13e55aaec7cfef4736301e92d3b85ebabedccfb7120e1790a3132f4ec29fbfa9": "vLLM 0.32.0-0.33.0"},
    "vllm.v1.utils:record_function_or_nullcontext": {
        "10c8f44eecffea3692542694fe4303865600218041b60e3a7ccf0ff2057c4f45": "vLLM 0.32.0-0.33.0"},
    # Properties: their getters (the compiled loop reads what they return).
    "vllm.v1.request:Request.num_tokens.fget": {
        "d70392fb2938c5c907af6d7176b8ccb116027a931998fea6f5a0ebff08f41a63": "vLLM 0.32.0-0.33.0"},
    "vllm.v1.request:Request.num_tokens_with_spec.fget": {
        "d14b1735139591153efca53f114e204c7db3c602261e6254fb4603485b42ef1e": "vLLM 0.32.0-0.33.0"},
    "vllm.v1.request:Request.num_output_tokens.fget": {
        "6cf9ce95b8215fda4e8026120186cbe096dc989dc56f01fc2e61cfabafe20d0f": "vLLM 0.32.0-0.33.0"},
    "vllm.v1.request:Request.has_encoder_inputs.fget": {
        "dc855c418aed9878c6831105a4c068e0a2c87adb411522437b6aa14f5a621407": "vLLM 0.32.0-0.33.0"},
    "vllm.v1.request:Request.num_encoder_inputs.fget": {
        "cc214c565f5996307f5a5be6cbeff35cd00d56cc4a8287c07eceba7bb34ad811": "vLLM 0.32.0-0.33.0"},
}
# Scheduler._drafts_unused exists only where the loop has drafts_needed (0.33.0).
DRAFTS_UNUSED_FINGERPRINTS = {
    "21856b4235d796a6fbc2b21bbe3bd87d625874e66df5db385e366f0795d6cacb": "vLLM 0.33.0",
}

# The loop's locals that the added call passes (in this order), and those it
# returns; drafts_needed is 0.33.0's (None is passed for 0.32.0's loop).
LOOP_ARGUMENTS = ("req_index", "token_budget", "input_budget", "draft_slots",
                  "long_prefill_token_threshold", "defer_prefills", "prefill_scheduled",
                  "drafts_needed", "scheduled_running_reqs", "req_to_new_blocks",
                  "num_scheduled_tokens", "scheduled_spec_decode_tokens")
LOOP_RESULTS = ("req_index", "token_budget", "input_budget", "prefill_scheduled",
                "drafts_needed")
CONTAINERS = ("scheduled_running_reqs", "req_to_new_blocks", "num_scheduled_tokens",
              "scheduled_spec_decode_tokens")
_LOOP_TEST = "req_index < len(self.running) and token_budget > 0"
_HELPER = "_fastbatch_schedule_running"

# allocate_slots' piece in use (the compiled loop calls its plan), and its patch
_allocate_piece = registry.implementation("allocate_slots")


def _allocate_slots_patch() -> Any:
    """``allocate_slots``' patch module (its guard, its binding)."""
    return registry.piece("allocate_slots").module


# ---------------------------------------------------------------------------
# The source transform.

def _function_tree(schedule: Any) -> tuple[ast.Module, ast.FunctionDef, int, str]:
    """(module tree, the def, index of the running loop in its body, source file)."""
    tree, function, filename = function_tree(schedule)
    loops = [position for position, statement in enumerate(function.body)
             if isinstance(statement, ast.While) and ast.unparse(statement.test) == _LOOP_TEST]
    if len(loops) != 1:
        raise ValueError(f"Scheduler.schedule has {len(loops)} loops `while {_LOOP_TEST}`")
    return tree, function, loops[0], filename


def transformed(schedule: Any, helper: Any) -> Any:
    """vLLM's ``schedule`` compiled from its own source with ``helper``'s
    call added before the running loop::

        req_index, token_budget, input_budget, prefill_scheduled, drafts_needed = \\
            _fastbatch_schedule_running(self, req_index, ..., scheduled_spec_decode_tokens)

    (for vLLM 0.32.0's loop, ``None`` stands for ``drafts_needed`` and the
    result goes to an unused name).  ValueError where the source is not as
    expected."""
    tree, function, position, filename = _function_tree(schedule)
    before = assigned(function.body[:position])
    has_drafts = "drafts_needed" in before
    missing = [name for name in LOOP_ARGUMENTS
               if name not in before and not (name == "drafts_needed" and not has_drafts)]
    if missing:
        raise ValueError(f"Scheduler.schedule assigns no {missing} before its running loop")
    arguments = ", ".join(name if name != "drafts_needed" or has_drafts else "None"
                          for name in LOOP_ARGUMENTS)
    targets = ", ".join(name if name != "drafts_needed" or has_drafts
                        else "_fastbatch_no_drafts_needed" for name in LOOP_RESULTS)
    (call,) = ast.parse(f"{targets} = {_HELPER}(self, {arguments})").body
    loop = function.body[position]
    for node in ast.walk(call):
        ast.copy_location(node, loop)
    function.body.insert(position, call)
    built = compile_in_module(tree, filename, schedule, {_HELPER: helper})
    built.__qualname__, built.__module__ = schedule.__qualname__, schedule.__module__
    built.__doc__ = schedule.__doc__
    return built


def vllm_running_loop(schedule: Any) -> Any:
    """vLLM's running loop itself, as a function: ``loop(self, **locals)`` of
    the locals the loop reads that ``schedule`` assigns before it; it returns
    the locals the loop assigns (a dict, ``drafts_needed`` included where the
    loop has it).  Compiled from ``schedule``'s own source (vLLM's code)."""
    tree, function, position, filename = _function_tree(schedule)
    loop = function.body[position]
    before = assigned(function.body[:position])
    read = sorted({node.id for node in ast.walk(loop) if isinstance(node, ast.Name)} & before)
    written = sorted(assigned([loop]) & before)
    returned = ast.parse("return {" + ", ".join(f"{name!r}: {name}" for name in written)
                         + "}").body[0]
    for node in ast.walk(returned):
        ast.copy_location(node, loop)
    function.body = [loop, returned]
    function.name = "vllm_running_loop"
    function.args = ast.arguments(posonlyargs=[], args=[ast.arg(arg="self")],
                                  kwonlyargs=[ast.arg(arg=name) for name in read],
                                  kw_defaults=[None] * len(read), defaults=[])
    function.decorator_list, function.returns = [], None
    loop_function = compile_in_module(tree, filename, schedule, {})
    loop_function.reads = tuple(read)
    return loop_function


# ---------------------------------------------------------------------------
# The installed method and the added call.

_SCHEDULE: Any = None  # vLLM's schedule with the call added (bind())
_VLLM_LOOP: Any = None  # vLLM's loop alone (bind())
# (Request, allocate_slots' compiled method, the token store of
# Request._all_token_ids besides list, vLLM's verified allocate_slots) (bind())
_KINDS: tuple[Any, Any, type, tuple[Any, ...]] | None = None
_utils: Any = None  # vllm.v1.utils, for its profiling-scope switch
_scheduler_module: Any = None


def _scopes_off() -> bool:
    """vLLM's profiling scopes are nullcontext (set at their first use) and
    the scheduler's module calls vLLM's own ``record_function_or_nullcontext``."""
    return (_utils._PROFILER_FUNC is contextlib.nullcontext
            and _scheduler_module.record_function_or_nullcontext
            is _utils.record_function_or_nullcontext)


def _schedule_running(self: Any, *loop_arguments: Any) -> tuple[Any, ...]:
    """The call added before vLLM's running loop: the compiled loop (checked
    under ``FASTBATCH_VERIFY``), or the locals unchanged (vLLM's loop does it
    all) where scopes are on or the piece went stock."""
    if not _scopes_off():
        return _unchanged(loop_arguments)
    if PATCH.verify_rate > 0:
        return _checked(self, loop_arguments)
    return fastbatch.schedule_running_requests(self, *loop_arguments, _KINDS)


def _unchanged(loop_arguments: tuple[Any, ...]) -> tuple[Any, ...]:
    values = dict(zip(LOOP_ARGUMENTS, loop_arguments, strict=True))
    return tuple(values[name] for name in LOOP_RESULTS)


def token_store() -> type:
    """The type of ``Request._all_token_ids`` besides ``list`` that the loop
    reads: vLLM 0.34.0's ``TokenBuffer`` (an ``array('i')``) where vLLM has
    one, else ``list`` (decided when the patch binds)."""
    try:
        from vllm.v1.token_buffer import TokenBuffer
    except ImportError:
        return list
    return TokenBuffer


def verified_allocate_slots() -> tuple[Any, ...]:
    """vLLM's own ``KVCacheManager.allocate_slots`` (the original while
    ``allocate_slots``' patch is applied, else the class's), where its
    fingerprint is one ``allocate_slots``' guard verified: the method the
    compiled loop may call as vLLM calls it (a None from it changes nothing,
    so vLLM's loop can ask again).  Empty where the class holds anything
    else (a wrapper, another plugin's method)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from fastbatch._fingerprint import fingerprint

    stock = _allocate_slots_patch().PATCH.original() or KVCacheManager.allocate_slots
    try:
        found = fingerprint(stock)
    except (TypeError, OSError, SyntaxError, ValueError):
        return ()
    return (stock,) if found in _allocate_slots_patch().VERIFIED_FINGERPRINTS else ()


def bind(method: Any = None) -> None:
    """Build vLLM's ``schedule`` with the added call, and vLLM's loop alone,
    from ``method`` (by default vLLM's: the original while the patch is
    applied, else the class's), and bind ``allocate_slots``' plan, the
    release's token store and vLLM's verified ``allocate_slots``."""
    global _SCHEDULE, _VLLM_LOOP, _KINDS, _utils, _scheduler_module
    import vllm.v1.utils
    from vllm.v1.request import Request

    if method is None:
        method = PATCH.original() or sys.modules[MODULE].Scheduler.schedule
    _utils, _scheduler_module = vllm.v1.utils, sys.modules[MODULE]
    _SCHEDULE = transformed(method, _schedule_running)
    _VLLM_LOOP = vllm_running_loop(method)
    _KINDS = (Request, _allocate_piece.allocate_slots, token_store(), verified_allocate_slots())
    if not _allocate_slots_patch().PATCH.is_applied():
        _allocate_slots_patch().bind()


def schedule(self: Any, throttle_prefills: bool = False) -> Any:
    """fastbatch's ``Scheduler.schedule``: vLLM's, with the compiled running loop."""
    return _SCHEDULE(self, throttle_prefills)


# ---------------------------------------------------------------------------
# The activation check: real requests and a real KV-cache manager.

# What the compiled loop reads of a running request through its instance dict
# (it writes ``spec_token_ids`` the same way).
REQUEST_READ = ("num_output_placeholders", "num_computed_tokens", "num_prompt_tokens",
                "max_tokens", "next_decode_eligible_step", "is_prefill_chunk",
                "_all_token_ids", "spec_token_ids", "mm_features", "_output_token_ids",
                "request_id")
# What the compiled loop reads of the scheduler: each one vLLM's loop reads
# too (``self.<name>`` in its source: checked on activation), so that the
# check's scheduler, built without ``__init__``, carries nothing vLLM dropped.
SCHEDULER_READ = ("running", "ec_connector", "need_mamba_block_aligned_split",
                  "current_step", "max_model_len", "num_sampled_tokens_per_step",
                  "num_prefill_lookahead", "num_lookahead_tokens", "kv_cache_manager")


# (request id, prompt, outputs, computed, placeholders, spec, max_tokens,
#  prefill chunk, eligible step)
_BATCH = (
    ("decode", 8, 3, 10, 0, (), 64, False, 0),
    ("async-decode", 8, 3, 10, 1, (), 64, False, 0),
    ("at-max-tokens", 8, 3, 12, 2, (), 4, False, 0),
    ("not-eligible", 8, 3, 10, 0, (), 64, False, 99),
    ("spec", 6, 4, 9, 0, (7, 8, 9), 64, False, 0),
    ("spec-async", 6, 4, 10, 1, (-1, -1, -1), 64, False, 0),
    ("block-boundary", 12, 3, 14, 0, (7, 8), 64, False, 0),
    ("last-tokens", 8, 61, 68, 0, (4,), 64, False, 0),
    ("prefill-chunk", 40, 0, 16, 0, (), 64, True, 0),
    ("after-prefill", 8, 3, 10, 0, (), 64, False, 0),
)


_BLOCK_SIZE, _MAX_MODEL_LEN = 4, 128


def _small_scheduler(cls: Any, allocate: Any, *, batch: tuple[tuple[Any, ...], ...] = _BATCH,
                     **settings: Any) -> Any:
    """``_stand_ins.running_scheduler`` of ``batch`` (rows as ``_BATCH``'s)."""
    return running_scheduler(cls, allocate, batch, block_size=_BLOCK_SIZE,
                             max_model_len=_MAX_MODEL_LEN, **settings)


def _loop_state(scheduler: Any, locals_: dict[str, Any]) -> Any:
    """What the loop changes, as plain data."""
    def blocks(value: Any) -> Any:
        return value.get_block_ids() if hasattr(value, "get_block_ids") else value

    return (
        {name: locals_[name] for name in LOOP_RESULTS if name in locals_},
        [request.request_id for request in locals_["scheduled_running_reqs"]],
        {rid: blocks(value) for rid, value in locals_["req_to_new_blocks"].items()},
        dict(locals_["num_scheduled_tokens"]), dict(locals_["scheduled_spec_decode_tokens"]),
        [(request.request_id, request.spec_token_ids) for request in scheduler.running],
        kv_manager_state(scheduler.kv_cache_manager),
    )


def run_loops(function: Any, scheduler: Any, state: dict[str, Any], has_drafts: bool) -> Any:
    """``function`` (fastbatch's loop; None: none) from the locals ``state``,
    then vLLM's loop from where it stopped, as the installed ``schedule``
    runs them; what they changed (``_loop_state``)."""
    locals_ = dict(state, scheduled_running_reqs=[], req_to_new_blocks={},
                   num_scheduled_tokens={}, scheduled_spec_decode_tokens={})
    if not has_drafts:
        locals_["drafts_needed"] = None
    if function is not None:
        results = function(scheduler, *(locals_[name] for name in LOOP_ARGUMENTS), _KINDS)
        locals_.update(zip(LOOP_RESULTS, results, strict=True))
    if not has_drafts:
        locals_.pop("drafts_needed")
    reads = {name: locals_.get(name) for name in _VLLM_LOOP.reads}
    locals_.update(_VLLM_LOOP(scheduler, **reads))
    return _loop_state(scheduler, locals_)


def scheduler_reads(schedule: Any) -> set[str]:
    """The scheduler attributes vLLM's running loop reads (``self.<name>``)."""
    _tree, function, position, _filename = _function_tree(schedule)
    return {node.attr for node in ast.walk(function.body[position])
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "self"}


def activation_check(method: Any, replacement: Any) -> str | None:
    """Why fastbatch must stay off, or None: the source is not as expected,
    ``_drafts_unused`` (0.33.0) is not a verified variant, a scheduler class
    overrides what the loop calls, the compiled loop reads a scheduler
    attribute vLLM's loop does not, or vLLM's loop and fastbatch's differ on
    small batches of real requests (see ``_BATCH``: lookahead 0 and 3,
    prefill lookahead 0 and 2, prefills deferred, a budget that runs out),
    or the compiled loop scheduled none of a batch's requests itself (it
    would hand every request back to vLLM's loop)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from fastbatch._fingerprint import fingerprint

    try:
        bind(method)
    except (ValueError, SyntaxError, OSError, TypeError) as exc:
        return f"the running loop cannot be taken from Scheduler.schedule ({exc})"
    has_drafts = "drafts_needed" in _VLLM_LOOP.reads
    if has_drafts:
        found = fingerprint(Scheduler._drafts_unused)
        if found not in DRAFTS_UNUSED_FINGERPRINTS:
            return f"Scheduler._drafts_unused is not a verified variant ({found[:12]})"
    for name in ("_reserve_prefill_lookahead", "_drafts_unused"):
        if getattr(AsyncScheduler, name, None) is not getattr(Scheduler, name, None):
            return f"AsyncScheduler.{name} overrides Scheduler's"
    unread = sorted(set(SCHEDULER_READ) - scheduler_reads(method))
    if unread:
        return f"vLLM's running loop reads no scheduler attribute {unread}"
    problem = instance_dict_problem(scheduled_request("check", 4, 0, 0, block_size=_BLOCK_SIZE),
                                    REQUEST_READ, ("spec_token_ids",))
    if problem is not None:
        return problem
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    stock_allocate = _allocate_slots_patch().PATCH.original() or KVCacheManager.allocate_slots
    for lookahead, prefill_lookahead, budget, defer in ((0, 0, 400, False), (3, 2, 400, True),
                                                        (3, 0, 21, False)):
        states = []
        taken = _taken()
        for function, allocate in ((None, stock_allocate),
                                   (fastbatch.schedule_running_requests,
                                    _allocate_piece.allocate_slots)):
            scheduler, state = _small_scheduler(Scheduler, allocate, lookahead=lookahead,
                                                prefill_lookahead=prefill_lookahead,
                                                budget=budget, defer_prefills=defer)
            with contextlib.suppress(Exception):  # a real exception is a difference
                states.append(run_loops(function, scheduler, state, has_drafts))
        setting = (f"lookahead {lookahead}, prefill lookahead {prefill_lookahead}, budget "
                   f"{budget}, defer prefills {defer}")
        if len(states) != 2 or states[0] != states[1]:
            return f"{setting}: fastbatch left {states[1:]}, vLLM {states[:1]}"
        if _taken() == taken:
            return (f"{setting}: the compiled loop scheduled no request itself (it handed "
                    "every one to vLLM's loop)")
    return None


def _taken() -> int:
    """Requests the compiled loop (or its twin, where it is in use) scheduled."""
    return fastbatch.stats()["schedule_running"]["requests"]


# ---------------------------------------------------------------------------
# The shadow check (FASTBATCH_VERIFY), inside schedule().

_sample = random.Random().random


class _Replay:
    """``allocate_slots`` for vLLM's loop in the shadow check: the blocks the
    compiled loop got, by request id; every call recorded."""

    def __init__(self, blocks: dict[str, Any]) -> None:
        self.blocks, self.calls = blocks, []

    def allocate_slots(self, request: Any, num_new_tokens: Any, **kwargs: Any) -> Any:
        self.calls.append((request.request_id, num_new_tokens, kwargs))
        return self.blocks.get(request.request_id, "<not allocated by fastbatch>")


def _checked(self: Any, loop_arguments: tuple[Any, ...]) -> tuple[Any, ...]:
    """The compiled loop, then vLLM's on copies, compared (see the module note)."""
    if _verify._suspended or (PATCH.verify_rate < 1 and _sample() >= PATCH.verify_rate):
        return fastbatch.schedule_running_requests(self, *loop_arguments, _KINDS)
    arguments = dict(zip(LOOP_ARGUMENTS, loop_arguments, strict=True))
    start = arguments["req_index"]
    copies = [copy.copy(request) for request in self.running[start:]]
    before = {name: copy.copy(arguments[name]) for name in CONTAINERS}
    results = fastbatch.schedule_running_requests(self, *loop_arguments, _KINDS)
    ours_locals = dict(zip(LOOP_RESULTS, results, strict=True))
    stop = ours_locals["req_index"]
    scheduled = arguments["scheduled_running_reqs"][len(before["scheduled_running_reqs"]):]
    # Read only where the compiled loop scheduled a request (and so read it).
    lookahead = self.num_lookahead_tokens if scheduled else None
    ours = _shadow_outcome(ours_locals, arguments, self.running[start:stop], [
        (request.request_id, arguments["num_scheduled_tokens"][request.request_id],
         {"num_lookahead_tokens": lookahead})
        for request in scheduled])
    stand_in = copy.copy(self)
    stand_in.running = [None] * start + copies[:stop - start]
    replay = _Replay(dict(arguments["req_to_new_blocks"]))
    stand_in.kv_cache_manager = replay
    stock_locals = {name: copy.copy(value) for name, value in before.items()}
    stock_locals.update((name, arguments[name]) for name in LOOP_ARGUMENTS
                        if name not in CONTAINERS)
    inputs = {"locals": {name: stock_locals[name] for name in LOOP_ARGUMENTS},
              "requests": copies[:stop - start]}
    try:
        reads = {name: stock_locals.get(name) for name in _VLLM_LOOP.reads}
        stock_locals.update(_VLLM_LOOP(stand_in, **reads))
        stock = _shadow_outcome(stock_locals, stock_locals, copies[:stop - start],
                                replay.calls)
    except Exception as exc:  # vLLM's loop on the same requests failed: a difference
        stock = (f"vLLM's loop raised {type(exc).__name__}: {exc}",)
    PATCH.checked += 1
    if ours == stock:
        return results
    problem = f"fastbatch {ours!r}; vLLM {stock!r}"
    _verify._report_divergence(PATCH, problem, inputs, ours, stock)
    if len(stock) == 1:
        return results  # nothing of vLLM's to put in place
    for name in CONTAINERS:  # vLLM's containers, in the objects schedule() holds
        container = arguments[name]
        container.clear()
        if isinstance(container, list):
            container.extend(stock_locals[name])
        else:
            container.update(stock_locals[name])
    for live, copied in zip(self.running[start:stop], copies, strict=False):
        live.spec_token_ids = copied.spec_token_ids
    return tuple(stock_locals.get(name, ours_locals[name]) for name in LOOP_RESULTS)


def _shadow_outcome(locals_: dict[str, Any], containers: dict[str, Any], requests: list[Any],
                    calls: list[Any]) -> tuple[Any, ...]:
    """The loop's outcome, comparable: the locals it returns, the containers
    (requests and blocks by identity), the requests' drafts, the
    ``allocate_slots`` calls."""
    return (
        tuple(locals_.get(name) for name in LOOP_RESULTS),
        [request.request_id for request in containers["scheduled_running_reqs"]],
        {rid: id(blocks) for rid, blocks in containers["req_to_new_blocks"].items()},
        dict(containers["num_scheduled_tokens"]),
        dict(containers["scheduled_spec_decode_tokens"]),
        [(request.request_id, request.spec_token_ids) for request in requests],
        calls,
    )


def _for_reproducer(inputs: dict[str, Any]) -> dict[str, Any]:
    """The loop's locals and the requests' fields, as plain data."""
    fields = ("request_id", "num_computed_tokens", "num_output_placeholders",
              "num_prompt_tokens", "max_tokens", "next_decode_eligible_step",
              "is_prefill_chunk", "spec_token_ids", "num_encoder_inputs")
    return {"locals": {name: (value if name not in CONTAINERS else repr(value))
                       for name, value in inputs["locals"].items()},
            "requests": [{name: getattr(request, name, None) for name in fields}
                         | {"num_tokens": len(request._all_token_ids)}
                         for request in inputs["requests"]]}


def _no_replay(function: Any, inputs: Any) -> str:
    """A reproducer of this piece is for reading: each side's outcome says
    so (they differ, so ``replay`` reports it, rather than "no divergence")."""
    side = "fastbatch's" if function is PATCH.replacement else "vLLM's"
    return (f"{side} loop cannot be replayed: a schedule_running reproducer is for "
            "reading (the loop's allocations need the live KV-cache manager)")


# The outer check passes every call through (snapshot None): the checks are
# made inside schedule(), around the compiled loop (``_checked``).
SHADOW = Shadow(snapshot=lambda *args, **kwargs: None, run=_no_replay,
                outcome=lambda *args, **kwargs: None, restore=lambda *args, **kwargs: None,
                for_reproducer=_for_reproducer)

PATCH = Patch(TARGET, schedule, fingerprints=VERIFIED_FINGERPRINTS,
              companions=COMPANION_FINGERPRINTS, activation_check=activation_check,
              shadow=SHADOW)
