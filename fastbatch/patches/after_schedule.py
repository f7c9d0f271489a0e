"""Patch: ``Scheduler._update_after_schedule`` and ``AsyncScheduler._update_after_schedule``.

What is replaced: the method that ends every ``Scheduler.schedule()`` call
(vllm/v1/core/sched/scheduler.py), and its async-scheduling override
(async_scheduler.py), which calls it and then loops over the batch again. Each
becomes vLLM's method with its loops done by one compiled call
(``fastbatch.update_after_schedule``). vLLM 0.31.0 to 0.34.0.

Guard: both methods' fingerprints and the ``Request`` properties read; the
activation check on small real requests, the compiled call taking every one; a
shadow on each patch.

When it can go: if vLLM keeps these per-request counters in arrays, or folds
the two loops into one.

Upstream: none found in vLLM's issues and PRs for this method; the nearest is
vllm-project/vllm#42131 (an open decode fast path for the scheduler).

Story and numbers: ``docs/pieces/after_schedule.md``.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import fastbatch
from fastbatch.patches._patch import Patch, Shadow, instance_dict_problem
from fastbatch.patches._stand_ins import running_request, scheduler_attributes, use_v2_values

GROUP = "scheduler"  # fastbatch.registry.GROUPS

MODULE = "vllm.v1.core.sched.scheduler"
ASYNC_MODULE = "vllm.v1.core.sched.async_scheduler"

VERIFIED_FINGERPRINTS = {
    "d5a56f538750cd1e1dcd1c6cd053f31827ab9e03e481bcc6d427da2229839717": "vLLM 0.31.0-0.33.0",
}
ASYNC_FINGERPRINTS = {
    "60faeadbc775ed7c26f5dd3a46a4cdf99ca0a53c30fa20d2aed24ba8578fb823": "vLLM 0.31.0-0.33.0",
    "5696549a54d03cbb9adaa50238f2e54fde09f662b01022264bc9f1372b7411d8":
        "vLLM 0.34.0: the placeholder list is a local, next_decode_eligible_step always set",
}
# Per verified async variant: (keeps the list as ``_spec_token_placeholders``,
# sets ``next_decode_eligible_step`` on every decoding request).
ASYNC_VARIANTS = {
    "60faeadbc775ed7c26f5dd3a46a4cdf99ca0a53c30fa20d2aed24ba8578fb823": (True, False),
    "5696549a54d03cbb9adaa50238f2e54fde09f662b01022264bc9f1372b7411d8": (False, True),
}
REQUEST_FINGERPRINTS = {
    "vllm.v1.request:Request.num_tokens.fget": {
        "d70392fb2938c5c907af6d7176b8ccb116027a931998fea6f5a0ebff08f41a63": "vLLM 0.31.0-0.33.0"},
    "vllm.v1.request:Request.use_structured_output.fget": {
        "46930fb1083ff21e933088fcfd39125a2048178273f9849ba2e3567bb608a01b": "vLLM 0.31.0-0.33.0"},
}
COMPANION_FINGERPRINTS = REQUEST_FINGERPRINTS
ASYNC_COMPANION_FINGERPRINTS = {
    f"{MODULE}:Scheduler._update_after_schedule": VERIFIED_FINGERPRINTS,
    **REQUEST_FINGERPRINTS,
}

# Bound on first use (this module imports no vLLM until then): vLLM's Request
# class and vLLM's own two methods, and what the async one's variant does.
_REQUEST: Any = None
_STOCK: Any = None
_ASYNC_STOCK: Any = None
_KEEPS_PLACEHOLDERS = True  # the async method stores the list on the scheduler
_ALWAYS_ELIGIBLE = False  # it sets next_decode_eligible_step on every decoding request


def async_variant(method: Any) -> tuple[bool, bool]:
    """(keeps ``_spec_token_placeholders``, always sets the eligible step) for
    vLLM's async method ``method``: from its fingerprint where it is a verified
    variant, else (``FASTBATCH=force`` on unknown code) from the names it
    reads; the activation check then judges the result."""
    from fastbatch._fingerprint import fingerprint

    try:
        variant = ASYNC_VARIANTS.get(fingerprint(method))
    except (OSError, TypeError, ValueError, SyntaxError):
        variant = None
    if variant is not None:
        return variant
    names = getattr(getattr(method, "__code__", None), "co_names", ())
    return "_spec_token_placeholders" in names, "use_v2_model_runner" not in names


def _bind_async(method: Any) -> None:
    global _ASYNC_STOCK, _KEEPS_PLACEHOLDERS, _ALWAYS_ELIGIBLE
    _ASYNC_STOCK = method
    _KEEPS_PLACEHOLDERS, _ALWAYS_ELIGIBLE = async_variant(method)


def _bind() -> None:
    global _REQUEST, _STOCK
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    _REQUEST = Request
    _STOCK = PATCH.original() or Scheduler._update_after_schedule
    _bind_async(ASYNC_PATCH.original() or AsyncScheduler._update_after_schedule)


def _update_after_schedule(self: Any, scheduler_output: Any) -> None:
    """fastbatch's drop-in for ``Scheduler._update_after_schedule``: vLLM's
    method with its per-request loop compiled."""
    if _REQUEST is None:
        _bind()
    if not fastbatch.update_after_schedule(self, scheduler_output, None, _REQUEST,
                                           always_eligible=False):
        _STOCK(self, scheduler_output)
        return
    # Clear the finished and preempted request IDs.
    # NOTE: We shouldn't just clear() here because it will also affect
    # the scheduler output.
    self.finished_req_ids = set()
    self.reset_preempted_req_ids = set()




def _update_after_schedule_async(self: Any, scheduler_output: Any) -> None:
    """fastbatch's drop-in for ``AsyncScheduler._update_after_schedule``:
    vLLM's method (and the base method it calls) with both per-request loops
    done in one compiled pass."""
    if _REQUEST is None:
        _bind()
    # Use the latest num of scheduled draft tokens in next step as placeholder.
    spec_token_placeholders = [-1] * scheduler_output.num_spec_tokens_to_schedule
    if not fastbatch.update_after_schedule(self, scheduler_output, spec_token_placeholders,
                                           _REQUEST, always_eligible=_ALWAYS_ELIGIBLE):
        _ASYNC_STOCK(self, scheduler_output)
        return
    self.finished_req_ids = set()
    self.reset_preempted_req_ids = set()
    if _KEEPS_PLACEHOLDERS:  # vLLM 0.31.0 to 0.33.0
        self._spec_token_placeholders = spec_token_placeholders




# The activation check -------------------------------------------------------

# (request id, prompt, outputs, computed, placeholders, structured, scheduled, spec)
_BATCH = (
    ("prefill-chunk", 40, 0, 0, 0, True, 16, None),
    ("last-chunk", 20, 0, 16, 0, True, 4, None),
    ("decode", 8, 3, 10, 1, False, 1, None),
    ("decode-structured", 8, 2, 9, 0, True, 1, [7, 8]),
    ("decode-spec", 6, 4, 9, 1, False, 3, [9, 10]),
    ("preempted-resume", 12, 5, 0, 0, False, 16, None),
)


def _small_scheduler(cls: Any, defer_block_free: bool,
                     use_v2: bool | None) -> tuple[Any, Any]:
    """A scheduler of class ``cls`` (built without ``__init__``: only the
    attributes the method reads, each one that the release's ``__init__``
    sets; ``use_v2`` None: no ``use_v2_model_runner``) and a real
    ``SchedulerOutput`` for ``_BATCH``.  LookupError if the release's
    scheduler or output has no such attribute."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.output import SchedulerOutput

    scheduler = cls.__new__(cls)
    requests = [running_request(rid, *rest[:5]) for rid, *rest in _BATCH]
    values = {
        "requests": {request.request_id: request for request in requests},
        "defer_block_free": defer_block_free, "sched_step_seq": 1000,
        "_inflight_prefills": {requests[0], requests[1], requests[5]},
        "finished_req_ids": {"gone"}, "reset_preempted_req_ids": {"p"},
        "num_sampled_tokens_per_step": 1, "current_step": 700,
        **({} if use_v2 is None else {"use_v2_model_runner": use_v2}),
    }
    if issubclass(cls, AsyncScheduler):
        values["decode_stagger"] = 2
    known = scheduler_attributes(cls)
    for name, value in values.items():
        if name not in known:
            raise LookupError(f"vLLM's {cls.__name__}.__init__ sets no {name!r}")
        setattr(scheduler, name, value)
    output = SchedulerOutput.make_empty()
    for name, value in (
            ("num_scheduled_tokens", {rid: scheduled for rid, *_, scheduled, _ in _BATCH}),
            ("scheduled_spec_decode_tokens", {rid: spec for rid, *_, spec in _BATCH if spec}),
            ("num_spec_tokens_to_schedule", 2), ("has_structured_output_requests", False),
            ("pending_structured_output_tokens", False)):
        if not hasattr(output, name):
            raise LookupError(f"vLLM's SchedulerOutput has no {name!r}")
        setattr(output, name, value)
    return scheduler, output


_REQUEST_FIELDS = ("num_computed_tokens", "num_in_flight_tokens", "last_sched_seq",
                   "is_prefill_chunk", "num_output_placeholders", "spec_token_ids",
                   "next_decode_eligible_step")


def spec_lists(requests: Any, placeholders: Any, old: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    """Which spec-token list each request of ``requests`` (id, request pairs,
    in order) holds: ``"scheduler"`` (the scheduler's ``placeholders``, up to
    vLLM 0.33.0), ``"kept"`` (the object ``old`` has for it), else the id of
    the first request that holds the same object (requests that share one)."""
    first: dict[int, str] = {}
    held = {}
    for req_id, request in requests:
        spec = getattr(request, "spec_token_ids", _MISSING)
        if spec is placeholders and not _missing(placeholders):
            held[req_id] = "scheduler"
        elif old is not None and spec is old.get(req_id, _MISSING):
            held[req_id] = "kept"
        else:
            held[req_id] = first.setdefault(id(spec), req_id)
    return held


def scheduler_state(scheduler: Any, output: Any) -> Any:
    """What the method may change, as plain data (values, and which requests
    share a spec-token list: the scheduler's, or one of this step's)."""
    placeholders = getattr(scheduler, "_spec_token_placeholders", _MISSING)
    return (
        {rid: [(name, type(value := getattr(request, name)), value) for name in _REQUEST_FIELDS]
         for rid, request in scheduler.requests.items()},
        spec_lists(scheduler.requests.items(), placeholders),
        sorted(request.request_id for request in scheduler._inflight_prefills),
        scheduler.finished_req_ids, scheduler.reset_preempted_req_ids, placeholders,
        [(name, type(value := getattr(output, name)), value) for name in (
            "has_structured_output_requests", "pending_structured_output_tokens")],
    )


# What the compiled call reads of a scheduled request through its instance
# dict (it writes ``_WRITTEN``, below, the same way).
REQUEST_READ = ("request_id", "num_computed_tokens", "num_in_flight_tokens",
                "num_output_placeholders", "_all_token_ids", "structured_output_request")


def _taken() -> tuple[int, int]:
    """The piece's counters (requests the fast path took, batches it handed
    back to vLLM), of the implementation in use."""
    counters = fastbatch.stats()["after_schedule"]
    return counters["requests"], counters["stock_calls"]


def _check(cls: Any, method: Any, replacement: Any) -> str | None:
    problem = instance_dict_problem(running_request("check", 4, 0, 0, 0, False),
                                    REQUEST_READ, _WRITTEN)
    if problem is not None:
        return problem
    for defer_block_free in (False, True):
        for use_v2 in use_v2_values(cls):
            case = f"defer_block_free={defer_block_free}" + (
                "" if use_v2 is None else f", use_v2={use_v2}")
            states = []
            for function in (method, replacement):
                try:
                    scheduler, output = _small_scheduler(cls, defer_block_free, use_v2)
                except LookupError as exc:
                    return f"cannot build the check's scheduler: {exc}"
                before = _taken()
                function(scheduler, output)
                taken = [now - then for now, then in zip(_taken(), before, strict=True)]
                states.append(scheduler_state(scheduler, output))
            if states[0] != states[1]:
                return f"{case}: fastbatch left {states[1]}, vLLM {states[0]}"
            if taken != [len(_BATCH), 0]:
                return (f"{case}: the compiled call took {taken[0]} of {len(_BATCH)} "
                        f"requests and handed {taken[1]} batch(es) back to vLLM's method: "
                        "it would not act on this vLLM")
    return None


def activation_check(method: Any, replacement: Any) -> str | None:
    """Why fastbatch must stay off, or None: a difference between stock and
    fastbatch on a small batch of real requests (prefill chunks, the last
    chunk, decodes with and without spec tokens and structured output), or a
    compiled call that did not take the whole batch itself."""
    from vllm.v1.core.sched.scheduler import Scheduler

    global _STOCK
    _bind()
    _STOCK = method
    return _check(Scheduler, method, replacement)


def async_activation_check(method: Any, replacement: Any) -> str | None:
    """``activation_check`` for ``AsyncScheduler`` (the variant of vLLM's
    method, ``async_variant``, bound from ``method``)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    _bind()
    _bind_async(method)
    return _check(AsyncScheduler, method, replacement)


# The shadow check (FASTBATCH_VERIFY) ---------------------------------------

# What the methods read of a scheduled request (besides its id), and what they write.
_READ = ("num_computed_tokens", "num_in_flight_tokens", "num_output_placeholders",
         "is_prefill_chunk", "last_sched_seq", "spec_token_ids", "next_decode_eligible_step",
         "_all_token_ids", "structured_output_request")
_WRITTEN = ("num_computed_tokens", "num_in_flight_tokens", "last_sched_seq", "is_prefill_chunk",
            "num_output_placeholders", "spec_token_ids", "next_decode_eligible_step")
_SCHEDULER_READ = ("defer_block_free", "sched_step_seq", "num_sampled_tokens_per_step",
                   "use_v2_model_runner", "current_step", "decode_stagger",
                   "_spec_token_placeholders")
_OUTPUT_READ = ("num_scheduled_tokens", "scheduled_spec_decode_tokens",
                "num_spec_tokens_to_schedule", "has_structured_output_requests",
                "pending_structured_output_tokens")
_MISSING = "<missing>"  # an attribute the object does not have (compared by value)


def _missing(value: Any) -> bool:
    return type(value) is str and value == _MISSING


def _snapshot(scheduler: Any, scheduler_output: Any, *, is_async: bool) -> dict[str, Any]:
    """What the method reads and writes, as values: per scheduled request its
    fields (its token list is shared: only its length is read), the
    scheduler's and the output's fields, the ids in ``_inflight_prefills``
    and the two id sets the method replaces (copied); and, kept for
    ``_restore`` only, the live set objects and the in-flight requests."""
    requests = scheduler.requests
    scheduled = {}
    for req_id in scheduler_output.num_scheduled_tokens:
        request = requests.get(req_id)
        if request is not None:
            scheduled[req_id] = {name: getattr(request, name, _MISSING) for name in _READ}
    inflight = list(scheduler._inflight_prefills)
    return {
        "is_async": is_async, "requests": scheduled,
        "scheduler": {name: getattr(scheduler, name, _MISSING) for name in _SCHEDULER_READ},
        "output": {name: getattr(scheduler_output, name, _MISSING) for name in _OUTPUT_READ},
        # (request id, whether it is the scheduler's request of that id)
        "inflight_prefills": [(request.request_id, requests.get(request.request_id) is request)
                              for request in inflight],
        "finished_req_ids": set(scheduler.finished_req_ids),
        "reset_preempted_req_ids": set(scheduler.reset_preempted_req_ids),
        "live": {"inflight": inflight, "finished_req_ids": scheduler.finished_req_ids,
                 "reset_preempted_req_ids": scheduler.reset_preempted_req_ids},
    }


def _snapshot_sync(scheduler: Any, scheduler_output: Any) -> dict[str, Any]:
    return _snapshot(scheduler, scheduler_output, is_async=False)


def _snapshot_async(scheduler: Any, scheduler_output: Any) -> dict[str, Any]:
    return _snapshot(scheduler, scheduler_output, is_async=True)


def _stand_in_request(fields: dict[str, Any], req_id: str) -> Any:
    """A real ``Request`` (built without ``__init__``) with the fields the
    methods read, copied: what the compiled pass and vLLM's methods see."""
    request = _REQUEST.__new__(_REQUEST)
    values = {name: value for name, value in fields.items() if not _missing(value)}
    values["request_id"] = req_id
    vars(request).update(values)
    return request


def _outcome_of(scheduler: Any, output: Any, scheduled: list[str], old_sets: dict[str, Any],
                saved_sets: dict[str, set[str]], old_spec: dict[str, Any]) -> dict[str, Any]:
    """What the method changed, as plain data: per scheduled request its
    written fields (value and type) and which spec-token list it holds
    (``spec_lists``: the scheduler's, the one it had, or a new one shared with
    which requests); the in-flight prefills' ids; the two id sets (their
    content, whether they are new objects, and whether the old objects kept
    their content, which the scheduler output still holds); the scheduler's
    placeholder list (where the release keeps one); the output's two flags."""
    placeholders = getattr(scheduler, "_spec_token_placeholders", _MISSING)
    live = [(req_id, request) for req_id in scheduled
            if (request := scheduler.requests.get(req_id)) is not None]
    held = spec_lists(live, placeholders, old_spec)
    requests = {req_id: ([(name, type(value := getattr(request, name, _MISSING)), value)
                          for name in _WRITTEN], held[req_id])
                for req_id, request in live}
    return {
        "requests": requests,
        "inflight_prefills": sorted(request if isinstance(request, str) else request.request_id
                                    for request in scheduler._inflight_prefills),
        **{name: (sorted(new := getattr(scheduler, name)), new is not old_sets[name],
                  old_sets[name] == saved_sets[name])
           for name in ("finished_req_ids", "reset_preempted_req_ids")},
        "spec_token_placeholders": placeholders if _missing(placeholders)
        else (type(placeholders), list(placeholders)),
        "flags": [(name, type(value := getattr(output, name, _MISSING)), value)
                  for name in ("has_structured_output_requests",
                               "pending_structured_output_tokens")],
    }


def _old_spec(inputs: dict[str, Any]) -> dict[str, Any]:
    """Each scheduled request's spec-token list before the call (the object)."""
    return {req_id: fields["spec_token_ids"] for req_id, fields in inputs["requests"].items()}


def _outcome(inputs: dict[str, Any], result: None, scheduler: Any,
             scheduler_output: Any) -> dict[str, Any]:
    live = inputs["live"]
    return _outcome_of(scheduler, scheduler_output, list(inputs["requests"]),
                       {name: live[name] for name in ("finished_req_ids",
                                                      "reset_preempted_req_ids")},
                       {name: inputs[name] for name in ("finished_req_ids",
                                                        "reset_preempted_req_ids")},
                       _old_spec(inputs))


def _run(function: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """``function`` on a stand-in scheduler (vLLM's class, built without
    ``__init__``) of stand-in requests, a copy of the in-flight set and of
    the two id sets, and a stand-in scheduler output.  vLLM's async method
    calls the base method through ``super()``: while it runs here, the base
    class holds vLLM's own base method (the scheduler runs in one thread)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    if _REQUEST is None:
        _bind()
    cls = AsyncScheduler if inputs["is_async"] else Scheduler
    scheduler = cls.__new__(cls)
    stand_ins = {req_id: _stand_in_request(fields, req_id)
                 for req_id, fields in inputs["requests"].items()}
    scheduler.requests = stand_ins
    for name, value in inputs["scheduler"].items():
        if not _missing(value):
            setattr(scheduler, name, value)
    # Requests that are not the scheduler's stand-ins enter as their ids (the
    # method never finds them: it discards only the scheduled requests).
    scheduler._inflight_prefills = {stand_ins[req_id] if own and req_id in stand_ins else req_id
                                    for req_id, own in inputs["inflight_prefills"]}
    saved = {name: set(inputs[name]) for name in ("finished_req_ids", "reset_preempted_req_ids")}
    old = {name: set(value) for name, value in saved.items()}
    scheduler.finished_req_ids = old["finished_req_ids"]
    scheduler.reset_preempted_req_ids = old["reset_preempted_req_ids"]
    output = SimpleNamespace(**{name: value for name, value in inputs["output"].items()
                                if not _missing(value)})
    base = PATCH.original()
    stored = Scheduler.__dict__["_update_after_schedule"]
    if inputs["is_async"] and base is not None:
        Scheduler._update_after_schedule = base
    try:
        function(scheduler, output)
    finally:
        Scheduler._update_after_schedule = stored
    return _outcome_of(scheduler, output, list(inputs["requests"]), old, saved,
                       _old_spec(inputs))


def _compare(ours: dict[str, Any], stock: dict[str, Any]) -> str | None:
    for key, expected in stock.items():
        got = ours[key]
        if key == "requests":
            for req_id, request in expected.items():
                if got.get(req_id) != request:
                    return (f"request {req_id!r}: fastbatch left (field, type, value) and "
                            f"'holds the placeholder list' {got.get(req_id)}, vLLM {request}")
        if got != expected:
            return f"{key}: fastbatch left {got!r}, vLLM {expected!r}"
    return None


def _restore(inputs: dict[str, Any], stock: dict[str, Any], result: None, scheduler: Any,
             scheduler_output: Any) -> None:
    """vLLM's outcome put in the live objects: the requests' fields (each
    spec-token list the scheduler's, the request's own, or one new list per
    group that vLLM's method left sharing one), the in-flight set (the same
    set object), new id sets (the old objects get their content back), the
    placeholder list, the output's flags."""
    live = inputs["live"]
    placeholders = stock["spec_token_placeholders"]
    if not _missing(placeholders):
        scheduler._spec_token_placeholders = placeholders[0](placeholders[1])
    new_lists: dict[str, Any] = {}
    for req_id, (fields, held) in stock["requests"].items():
        request = scheduler.requests[req_id]
        for name, kind, value in fields:
            if name == "spec_token_ids" and held == "scheduler":
                value = scheduler._spec_token_placeholders
            elif name == "spec_token_ids" and held == "kept":
                value = inputs["requests"][req_id]["spec_token_ids"]
            elif name == "spec_token_ids" and not _missing(value):
                value = new_lists.setdefault(held, kind(value))
            if _missing(value):
                vars(request).pop(name, None)
            else:
                setattr(request, name, value)
    inflight = scheduler._inflight_prefills
    keep = set(stock["inflight_prefills"])
    inflight.clear()
    inflight.update(request for request in live["inflight"] if request.request_id in keep)
    for name in ("finished_req_ids", "reset_preempted_req_ids"):
        old = live[name]
        old.clear()
        old.update(inputs[name])
        content, is_new, _ = stock[name]
        setattr(scheduler, name, set(content) if is_new else old)
    for name, _, value in stock["flags"]:
        if not _missing(value):
            setattr(scheduler_output, name, value)


def _for_reproducer(inputs: dict[str, Any]) -> dict[str, Any]:
    """The inputs without the live objects, the token stores copied (of their
    own type: a ``TokenBuffer`` stays one), and a structured-output request
    as a stand-in (only ``is not None`` is read)."""
    requests = {}
    for req_id, fields in inputs["requests"].items():
        fields = dict(fields)
        tokens = fields["_all_token_ids"]
        fields["_all_token_ids"] = list(tokens) if type(tokens) is list else copy.deepcopy(tokens)
        if not (fields["structured_output_request"] is None
                or _missing(fields["structured_output_request"])):
            fields["structured_output_request"] = SimpleNamespace()
        requests[req_id] = fields
    return {**{key: value for key, value in inputs.items() if key != "live"},
            "requests": requests}


SHADOW = Shadow(snapshot=_snapshot_sync, run=_run, outcome=_outcome, restore=_restore,
                compare=_compare, for_reproducer=_for_reproducer)
ASYNC_SHADOW = Shadow(snapshot=_snapshot_async, run=_run, outcome=_outcome, restore=_restore,
                      compare=_compare, for_reproducer=_for_reproducer)

PATCH = Patch(f"{MODULE}:Scheduler._update_after_schedule", _update_after_schedule,
              fingerprints=VERIFIED_FINGERPRINTS, activation_check=activation_check,
              companions=COMPANION_FINGERPRINTS, shadow=SHADOW)
ASYNC_PATCH = Patch(f"{ASYNC_MODULE}:AsyncScheduler._update_after_schedule",
                    _update_after_schedule_async, fingerprints=ASYNC_FINGERPRINTS,
                    activation_check=async_activation_check,
                    companions=ASYNC_COMPANION_FINGERPRINTS, shadow=ASYNC_SHADOW)

# The async one first: its guard fingerprints the base method, which must
# still be vLLM's then.
PATCHES = (ASYNC_PATCH, PATCH)
