"""Patch: ``vllm.v1.engine.output_processor.OutputProcessor.process_outputs`` (its loop).

What is replaced: the turn of ``process_outputs``' loop for each generated
output of a request in decode, once per request and step. vLLM's method,
compiled from its own source with one call added at the top of the loop
(``fastbatch.process_output``), which does the turn for a decode output of a
known request and leaves every other output to vLLM's body. vLLM 0.32.0 to
0.34.0.

Guard: the fingerprints of ``process_outputs`` and of the four methods the
turn does (the companions); the activation check on two real output
processors; the shadow replays vLLM's body on a copy of each request's state.

When it can go: if vLLM's output processor loop becomes compiled or
vectorised.

Upstream: vllm-project/vllm#57442 (open: a sampled-token logprob fast path,
the same per-request path for ``/inference/v1/generate``).

Story and numbers: ``docs/pieces/process_outputs.md``.
"""

from __future__ import annotations

import ast
import copy
import random
from typing import Any

from fastbatch import _verify, registry
from fastbatch.patches import _texts
from fastbatch.patches._patch import Patch, Shadow
from fastbatch.patches._source import assigned, compile_in_module, function_tree

GROUP = "front end"  # fastbatch.registry.GROUPS

MODULE = "vllm.v1.engine.output_processor"
TARGET = f"{MODULE}:OutputProcessor.process_outputs"
VERIFIED_FINGERPRINTS = {
    "385cd28a1eec590731d0b821b9136a46abfaedfab5cfe2984dd5c2fe9180a8fa": "vLLM 0.32.0",
    "39912fa638ca49ac6e7562a1bca657d9722d120d54d02b33aa75ff047a7b618f":
        "vLLM 0.33.0: outputs with an error, streaming-input chunk boundaries",
}
COMPANION_FINGERPRINTS = {
    f"{MODULE}:OutputProcessor._update_stats_from_output": {
        "2309455241f2f966734796163af556b4487dc164d6ea7fb5e8cf92911880e447":
            "vLLM 0.32.0-0.33.0"},
    f"{MODULE}:RequestState.track_weight_version": {
        "2de89e7763d4b095da347cb45e24262c96ca63557761f3b6ee64a8dc0326e6a5":
            "vLLM 0.32.0-0.33.0"},
    f"{MODULE}:RequestState.make_request_output": {
        "d624f749d30edcd8c189fdacb3413395c50badc8d1f5cdfce700ec8ae27135f5": "vLLM 0.32.0",
        "0f9b2ac9b53dee01405295ff93924f8e0c4cb63eba3686e1e7b489819b339038":
            "vLLM 0.33.0: a pooling output returned before the stream interval"},
    "vllm.v1.engine.detokenizer:IncrementalDetokenizer.num_output_tokens": {
        "c1c630e64248bd26da9c7164360fa1b13b2fd555e3f91c036001a4fbd150a91b":
            "vLLM 0.32.0-0.33.0"},
    "vllm.v1.engine.logprobs:LogprobsProcessor.update_from_output": {
        "b4ac461ff27e943664a73b1ba5fb7a752b079bf03abddda0ea50e1bde75e37ce":
            "vLLM 0.32.0-0.33.0"},
}

# The locals and parameters the added call passes, in this order (then the
# list the loop runs over, for the prefetch).
LOOP_ARGUMENTS = ("self", "engine_core_output", "engine_core_timestamp", "iteration_stats",
                  "weight_version", "request_outputs", "reqs_to_abort")
_LOOP_LIST = "engine_core_outputs"
_LOOP = f"for engine_core_output in {_LOOP_LIST}:"
_HELPER = "_fastbatch_process_output"

# The piece in use: the compiled one, or its twin (then the plugin leaves
# vLLM stock anyway).
_piece = registry.implementation("process_outputs")


# ---------------------------------------------------------------------------
# The source transform.

def _loop_tree(method: Any) -> tuple[ast.Module, ast.FunctionDef, ast.For, str]:
    """(module tree, the def, the loop over the outputs, source file)."""
    tree, function, filename = function_tree(method)
    loops = [statement for statement in function.body if isinstance(statement, ast.For)
             and ast.unparse(statement).splitlines()[0] == _LOOP]
    if len(loops) != 1:
        raise ValueError(f"OutputProcessor.process_outputs has {len(loops)} loops `{_LOOP}`")
    before = assigned(function.body[:function.body.index(loops[0])])
    before |= {argument.arg for argument in function.args.args}
    missing = [name for name in LOOP_ARGUMENTS
               if name not in before and name != "engine_core_output"]
    if missing:
        raise ValueError(f"OutputProcessor.process_outputs assigns no {missing} before its loop")
    return tree, function, loops[0], filename


def transformed(method: Any, helper: Any) -> Any:
    """vLLM's ``process_outputs`` compiled from its own source with
    ``helper``'s call added at the top of the loop's body (see the module
    note).  ValueError where the source is not as expected."""
    tree, _, loop, filename = _loop_tree(method)
    (call,) = ast.parse(
        f"if {_HELPER}({', '.join(LOOP_ARGUMENTS)}, {_LOOP_LIST}):\n    continue").body
    for node in ast.walk(call):
        ast.copy_location(node, loop.body[0])
    loop.body.insert(0, call)
    built = compile_in_module(tree, filename, method, {_HELPER: helper})
    built.__qualname__, built.__module__ = method.__qualname__, method.__module__
    built.__doc__ = method.__doc__
    return built


class _Continue(ast.NodeTransformer):
    """``continue`` of the loop itself (not of a loop inside it) as ``return``."""

    def visit_Continue(self, node: ast.Continue) -> ast.Return:
        return ast.copy_location(ast.Return(value=None), node)

    def visit_For(self, node: ast.For) -> ast.For:
        return node  # an inner loop's continue is its own

    visit_While = visit_For
    visit_AsyncFor = visit_For


def vllm_loop_body(method: Any) -> Any:
    """vLLM's loop body itself, as a function of ``LOOP_ARGUMENTS``: one
    turn for one output (its ``continue`` a ``return``).  Compiled from
    ``method``'s own source (vLLM's code)."""
    tree, function, loop, filename = _loop_tree(method)
    body = [_Continue().visit(statement) for statement in loop.body]
    function.body = body
    function.name = "vllm_loop_body"
    function.args = ast.arguments(posonlyargs=[], args=[ast.arg(arg=name)
                                                         for name in LOOP_ARGUMENTS],
                                  kwonlyargs=[], kw_defaults=[], defaults=[])
    function.decorator_list, function.returns = [], None
    return compile_in_module(tree, filename, method, {})


# ---------------------------------------------------------------------------
# The installed method.

_FAST: Any = None  # vLLM's process_outputs with the compiled turn (bind())
_CHECKED: Any = None  # the same with the checked turn (FASTBATCH_VERIFY)
_VLLM_BODY: Any = None  # vLLM's loop body alone (bind())


def kinds() -> tuple[Any, ...]:
    """What the compiled turn is bound to (its ``bind``'s arguments): vLLM's
    ``EngineCoreOutput``, ``OutputProcessor``, ``RequestState`` and ``LogprobsProcessor``, the
    detokenizer classes whose ``num_output_tokens`` is vLLM's
    ``len(token_ids)``, ``FinishReason.STOP``, ``RequestOutputKind.FINAL_ONLY``."""
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine import EngineCoreOutput, FinishReason, detokenizer
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.engine.output_processor import OutputProcessor, RequestState

    base = detokenizer.IncrementalDetokenizer
    detokenizers = tuple(kind for kind in (base, detokenizer.FastIncrementalDetokenizer,
                                           detokenizer.SlowIncrementalDetokenizer)
                         if kind.num_output_tokens is base.num_output_tokens)
    return (EngineCoreOutput, OutputProcessor, RequestState, LogprobsProcessor, detokenizers,
            FinishReason.STOP, RequestOutputKind.FINAL_ONLY)


def bind(method: Any = None) -> None:
    """Build vLLM's ``process_outputs`` with the added call, and vLLM's loop
    body alone, from ``method`` (by default vLLM's: the original while the
    patch is applied, else the class's), and bind the compiled turn to
    vLLM's classes (``kinds``)."""
    global _FAST, _CHECKED, _VLLM_BODY
    from vllm.v1.engine.output_processor import OutputProcessor

    if method is None:
        method = PATCH.original() or OutputProcessor.process_outputs
    _piece.bind(*kinds())
    _FAST = transformed(method, _piece.process_output)
    _CHECKED = transformed(method, _checked)
    _VLLM_BODY = vllm_loop_body(method)


def process_outputs(self: Any, engine_core_outputs: Any, engine_core_timestamp: Any = None,
                    iteration_stats: Any = None, weight_version: Any = None) -> Any:
    """fastbatch's ``OutputProcessor.process_outputs``: vLLM's, with the
    compiled turn for each output it takes, in one ``STEP`` of the
    ``update_sample_logprobs`` piece (a vLLM tokenizer pool borrowed from
    once for the step's first-sight texts)."""
    built = _CHECKED if PATCH.verify_rate > 0 else _FAST
    with _texts.STEP:
        return built(self, engine_core_outputs, engine_core_timestamp, iteration_stats,
                     weight_version)


# ---------------------------------------------------------------------------
# The activation check: two real output processors, the same outputs.

_TOKENS = (5, 9, 2, 7, 11, 3)


def _requests(tokenizer: Any, stop: list[str] | None) -> list[tuple[str, Any, bool]]:
    """(request id, sampling params, has a queue) of the scenario."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    final, cumulative, delta = (RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE,
                                RequestOutputKind.DELTA)
    return [
        ("final", SamplingParams(max_tokens=5, output_kind=final), False),
        ("cumulative", SamplingParams(max_tokens=5, output_kind=cumulative), False),
        ("delta", SamplingParams(max_tokens=5, output_kind=delta), True),
        ("logprobs", SamplingParams(max_tokens=5, logprobs=1, output_kind=final), False),
        ("logprobs2", SamplingParams(max_tokens=5, logprobs=2, output_kind=delta), False),
        ("stop_token", SamplingParams(max_tokens=5, output_kind=cumulative), True),
        ("stop_string", SamplingParams(max_tokens=5, output_kind=cumulative,
                                       stop=stop or []), False),
    ]


def _logprobs(num: int, token: int, step: int) -> Any:
    import numpy as np
    from vllm.v1.outputs import LogprobsLists

    ids = np.array([[token] + [(token + column) % 13 for column in range(1, num + 1)]],
                   dtype=np.int64)
    values = np.array([[-0.25 * (column + 1) - step / 8 for column in range(num + 1)]],
                      dtype=np.float32)
    return LogprobsLists(ids, values, np.array([1 + step % 2], dtype=np.int64))


def _outputs(step: int, tokens: tuple[int, ...]) -> list[Any]:
    """The engine's outputs of ``step`` (0: the prefill)."""
    from vllm.v1.engine import EngineCoreOutput, FinishReason

    outputs = []
    token = tokens[step % len(tokens)]
    for index, (req_id, num) in enumerate((("final", 0), ("cumulative", 0), ("delta", 0),
                                           ("logprobs", 1), ("logprobs2", 2),
                                           ("stop_token", 0), ("stop_string", 0))):
        finish = stop_reason = None
        if req_id == "stop_token" and step == 3:
            finish, stop_reason = FinishReason.STOP, token
        elif step == 4:
            finish = FinishReason.LENGTH
        if req_id == "stop_token" and step > 3:
            continue
        outputs.append(EngineCoreOutput(
            request_id=req_id, new_token_ids=[tokens[(step + index) % len(tokens)]],
            new_logprobs=_logprobs(num, token, step) if num else None,
            finish_reason=finish, stop_reason=stop_reason))
    outputs.append(EngineCoreOutput(request_id="gone", new_token_ids=[token]))
    return outputs


def _state(req_state: Any) -> tuple[Any, ...]:
    detokenizer, logprobs = req_state.detokenizer, req_state.logprobs_processor
    return (req_state.request_id, list(detokenizer.output_token_ids),
            getattr(detokenizer, "output_text", None), repr(logprobs.logprobs),
            logprobs.cumulative_logprob, list(req_state.weight_version_starts),
            req_state.sent_tokens_offset, req_state.is_prefilling)


def run_scenario(process_outputs_method: Any, tokenizer: Any = None, log_stats: bool = False,
                 stop: list[str] | None = None,
                 tokens: tuple[int, ...] = _TOKENS) -> list[Any]:
    """A real ``OutputProcessor`` (``tokenizer``; with stats or not) given
    the same outputs, step by step, through ``process_outputs_method``:
    what each step returned and queued, and every request's state after it."""
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
    from vllm.v1.metrics.stats import IterationStats

    processor = OutputProcessor(tokenizer, log_stats=log_stats)
    queues = {}
    for req_id, params, queued in _requests(tokenizer, stop):
        request = EngineCoreRequest(
            request_id=req_id, prompt_token_ids=[1, 2, 3], mm_features=None,
            sampling_params=params, pooling_params=None, arrival_time=0.0,
            lora_request=None, cache_salt=None, data_parallel_rank=None,
            external_req_id=req_id)
        queue = RequestOutputCollector(params.output_kind, req_id) if queued else None
        if queue is not None:
            queues[req_id] = queue
        processor.add_request(request, None, queue=queue)
    steps = []
    for step in range(5):
        stats = None
        if log_stats:
            stats = IterationStats()
            stats.iteration_timestamp = 100.0 + step
        result = process_outputs_method(processor, _outputs(step, tokens),
                                        50.0 + step if log_stats else None, stats,
                                        None if step == 2 else f"v{step // 3}")
        queued = {req_id: repr(queue.output) for req_id, queue in queues.items()}
        for queue in queues.values():
            queue.output = None
        steps.append((repr(result.request_outputs), list(result.reqs_to_abort), queued,
                      [_state(state) for state in processor.request_states.values()]))
    return steps


def activation_check(method: Any, replacement: Any) -> str | None:
    """Why fastbatch must stay off: the source is not as expected, or vLLM's
    method and fastbatch's differ on the scenario (``run_scenario``), with
    stats and without."""
    try:
        bind(method)
    except (ValueError, SyntaxError, OSError, TypeError) as exc:
        return f"the loop cannot be taken from OutputProcessor.process_outputs ({exc})"
    for log_stats in (False, True):
        stock = run_scenario(method, log_stats=log_stats)
        ours = run_scenario(replacement, log_stats=log_stats)
        if ours != stock:
            return f"with stats {log_stats}: fastbatch gave {ours}, vLLM {stock}"
    return None


# ---------------------------------------------------------------------------
# The shadow check (FASTBATCH_VERIFY), inside process_outputs().

_sample = random.Random().random

# The calls of a turn to vLLM's code, by the object they are made on.
_CALLED = {"processor": ("_update_stats_from_output", "_trim_surplus_tokens",
                         "_finish_request", "_update_stats_from_finished", "do_tracing"),
           "detokenizer": ("update",),
           "logprobs": ("_update_sample_logprobs", "_update_prompt_logprobs"),
           "state": ("make_request_output",),
           "queue": ("put",)}
# What the compiled turn does itself where vLLM calls: these calls of vLLM's
# body, answered None by vLLM's own method, are not compared.
_DONE_HERE = ("processor._update_stats_from_output", "state.make_request_output")


class _Record:
    """A turn's calls to vLLM's code: made on the live objects (each answered
    by vLLM's method, the answer kept), then replayed to vLLM's body, whose
    calls get the same answers in the same order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.answers: list[Any] = []
        self.replayed: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def recording(self, name: str, method: Any) -> Any:
        def record(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            answer = method(*args, **kwargs)
            self.answers.append(answer)
            return answer
        return record

    def replaying(self, name: str, own: Any = None) -> Any:
        """``name`` for vLLM's body: the next answer recorded, if that call
        was ``name``; else ``own`` (vLLM's method on the copies; for a call
        the compiled turn does itself) or None."""
        def replay(*args: Any, **kwargs: Any) -> Any:
            index = len([call for call in self.replayed if call[0] != "own"])
            if index < len(self.calls) and self.calls[index][0] == name:
                self.replayed.append((name, args, kwargs))
                return self.answers[index]
            answer = own(*args, **kwargs) if own is not None else None
            if name in _DONE_HERE and answer is None:
                self.replayed.append(("own", (name,), {}))
            else:
                self.replayed.append((name, args, kwargs))
            return answer
        return replay


def _comparable(calls: list[Any], same: dict[int, Any]) -> list[Any]:
    """Calls as names and arguments: objects by identity (the copies vLLM's
    body ran on as the live objects they stand for), plain values as they are."""
    return [(name, [arg if arg is None or isinstance(arg, (bool, int, str))
                     else id(same.get(id(arg), arg)) for arg in args], sorted(kwargs.items(),
                                                                            key=str))
            for name, args, kwargs in calls if name != "own"]


def _written(req_state: Any, logprobs: Any) -> tuple[Any, ...]:
    prompt_token_id_logprobs = getattr(logprobs, "prompt_token_id_logprobs", None)
    return (list(req_state.weight_version_starts), list(map(id, req_state.sampling_mask_chunks)),
            req_state.spec_decode_metrics,
            None if prompt_token_id_logprobs is None else prompt_token_id_logprobs.tolist())


def _checked(self: Any, output: Any, engine_core_timestamp: Any, iteration_stats: Any,
             weight_version: Any, request_outputs: list[Any], reqs_to_abort: list[Any],
             outputs: Any = None) -> bool:
    """The compiled turn; for a sampled output, compared with vLLM's body
    (see the module note)."""
    if PATCH.piece_diverged:
        return False  # the piece went stock: vLLM's body from now on
    if _verify._suspended or (PATCH.verify_rate < 1 and _sample() >= PATCH.verify_rate):
        return _piece.process_output(self, output, engine_core_timestamp, iteration_stats,
                                     weight_version, request_outputs, reqs_to_abort, outputs)
    arguments = (self, output, engine_core_timestamp, iteration_stats, weight_version,
                 request_outputs, reqs_to_abort, outputs)
    states = self.request_states
    req_state = states.get(output.request_id) if isinstance(states, dict) else None
    if req_state is None:
        return _piece.process_output(*arguments)
    # The request's state as the turn finds it, for vLLM's body.
    state = copy.copy(req_state)
    state.weight_version_starts = list(req_state.weight_version_starts)
    state.sampling_mask_chunks = list(req_state.sampling_mask_chunks)
    state.logprobs_processor = copy.copy(req_state.logprobs_processor)
    detokenizer = req_state.detokenizer
    length = len(detokenizer.output_token_ids) if detokenizer is not None else 0
    outputs_before, abort_before = len(request_outputs), len(reqs_to_abort)
    record = _Record()
    live = {"processor": self, "detokenizer": detokenizer,
            "logprobs": req_state.logprobs_processor, "state": req_state,
            "queue": req_state.queue}
    installed = [(target, name) for owner, names in _CALLED.items()
                 if (target := live[owner]) is not None for name in names
                 if name not in vars(target)]
    for target, name in installed:
        owner = next(owner for owner, value in live.items() if value is target)
        setattr(target, name, record.recording(f"{owner}.{name}", getattr(target, name)))
    try:
        taken = _piece.process_output(*arguments)
    finally:
        for target, name in installed:
            delattr(target, name)
    if not taken:
        return False  # vLLM's body runs: nothing to check
    ours = (_comparable(record.calls, {}), list(map(id, request_outputs[outputs_before:])),
            list(reqs_to_abort[abort_before:]), _written(req_state, req_state.logprobs_processor))
    stock, stock_outputs, stock_aborts = _vllm_turn(arguments, req_state, state, length, record)
    PATCH.checked += 1
    if ours != stock:
        _verify._report_divergence(PATCH, f"fastbatch {ours!r}; vLLM {stock!r}",
                                   {"request_id": output.request_id}, ours, stock)
        if stock_outputs is not None:  # vLLM's writes in place of the turn's own
            request_outputs[outputs_before:] = stock_outputs
            reqs_to_abort[abort_before:] = stock_aborts
            req_state.weight_version_starts[:] = state.weight_version_starts
            req_state.sampling_mask_chunks[:] = state.sampling_mask_chunks
            req_state.spec_decode_metrics = state.spec_decode_metrics
            if "prompt_token_id_logprobs" in vars(state.logprobs_processor):
                req_state.logprobs_processor.prompt_token_id_logprobs = \
                    state.logprobs_processor.prompt_token_id_logprobs
    return True


class _Detokenizer:
    """vLLM's body's detokenizer: the live one's length, ``update`` answered
    from the record."""

    def __init__(self, length: int, update: Any) -> None:
        self.token_ids: list[Any] = [None] * length
        self.replayed_update = update

    @property
    def output_token_ids(self) -> list[Any]:
        return self.token_ids

    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> Any:
        self.token_ids.extend(new_token_ids)
        return self.replayed_update(new_token_ids, stop_terminated)


def _vllm_turn(arguments: tuple[Any, ...], live_state: Any, state: Any, length: int,
               record: _Record) -> tuple[Any, Any, Any]:
    """vLLM's body on ``state`` (a copy of ``live_state`` as the turn found
    it) whose calls answer what the compiled turn's got: its outcome, as the
    turn's is compared, and the request outputs and requests to abort it
    appended (None where it raised)."""
    processor, output, timestamp, stats, weight_version = arguments[:5]
    stand_in = copy.copy(processor)
    stand_in.request_states = {output.request_id: state}
    for name in _CALLED["processor"]:
        setattr(stand_in, name, record.replaying(
            f"processor.{name}", getattr(type(processor), name).__get__(stand_in)))
    state.detokenizer = _Detokenizer(length, record.replaying("detokenizer.update"))
    for name in _CALLED["logprobs"]:
        setattr(state.logprobs_processor, name, record.replaying(f"logprobs.{name}"))
    state.make_request_output = record.replaying(
        "state.make_request_output", type(state).make_request_output.__get__(state))
    if state.queue is not None:
        state.queue = copy.copy(state.queue)
        state.queue.put = record.replaying("queue.put")
    request_outputs: list[Any] = []
    reqs_to_abort: list[Any] = []
    try:
        _VLLM_BODY(stand_in, output, timestamp, stats, weight_version, request_outputs,
                   reqs_to_abort)
    except Exception as exc:  # vLLM's body on the same answers failed: a difference
        return (f"vLLM's loop body raised {type(exc).__name__}: {exc}",), None, None
    same = {id(state): live_state, id(stand_in): processor}
    return ((_comparable(record.replayed, same), list(map(id, request_outputs)),
             list(reqs_to_abort), _written(state, state.logprobs_processor)),
            request_outputs, reqs_to_abort)


def _no_replay(function: Any, inputs: Any) -> str:
    side = "fastbatch's" if function is PATCH.replacement else "vLLM's"
    return (f"{side} turn cannot be replayed: a process_outputs reproducer is for reading "
            "(the turn's calls need the live detokenizer and processors)")


# The outer check passes every call through (snapshot None): the checks are
# made inside process_outputs(), for each output (``_checked``).
SHADOW = Shadow(snapshot=lambda *args, **kwargs: None, run=_no_replay,
                outcome=lambda *args, **kwargs: None, restore=lambda *args, **kwargs: None)

PATCH = Patch(TARGET, process_outputs, fingerprints=VERIFIED_FINGERPRINTS,
              companions=COMPANION_FINGERPRINTS, activation_check=activation_check,
              shadow=SHADOW)
