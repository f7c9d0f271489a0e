"""Piece ``process_outputs``: a turn of ``OutputProcessor.process_outputs``' loop, compiled.

Against the REAL vLLM 0.33.0 output processor (tox -e vllm): two real
``OutputProcessor`` instances given the same engine outputs, step by step,
one through vLLM's method and one through fastbatch's (vLLM's method
compiled from its source with the compiled turn's call added at the top of
its loop), compared on every request output, queue, request to abort and
request state: without a tokenizer, and with two tokenizers made here
(a byte-level BPE whose lone bytes decode to U+FFFD, a SentencePiece-style
one), stop strings, stats on and off, ``FINAL_ONLY``, ``CUMULATIVE`` and
``DELTA`` requests, queues, sample logprobs, weight versions, finished
requests; the compiled turn and the twin alike.

Also: the source transform and vLLM's loop body taken from the source; the
outputs the turn leaves to vLLM's body (and that it changes nothing then);
the guard, the activation check (it refuses a planted bug), bad input,
leaks; the plugin; ``FASTBATCH_VERIFY`` (no false divergence, a planted bug
caught).
"""

from __future__ import annotations

import functools
import logging
import sys

import pytest
from vllm.v1.engine import EngineCoreOutput, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor

from fastbatch import _names, _reference, registry
from fastbatch._kernels import process_outputs as compiled_piece
from fastbatch._reference import process_outputs as twin_piece
from fastbatch.patches import process_outputs as patch
from leaks import assert_no_leak

pytestmark = pytest.mark.vllm
NAME = "process_outputs"
PIECE = registry.piece(NAME)
STOCK = patch.PATCH.original() or OutputProcessor.process_outputs


@pytest.fixture(autouse=True)
def _bound_to_vllm():
    """The piece built from vLLM's own method, its turns bound to vLLM's classes."""
    patch.bind(STOCK)
    twin_piece.bind(*patch.kinds())
    yield
    patch.bind(STOCK)


@pytest.fixture(params=["compiled", "reference"])
def piece(request):
    return compiled_piece if request.param == "compiled" else twin_piece


def method_of(piece_module):
    """vLLM's ``process_outputs`` with ``piece_module``'s turn."""
    return patch.transformed(STOCK, piece_module.process_output)


@functools.cache
def tokenizers():
    """vLLM-wrapped tokenizers made at test time (test_update_sample_logprobs')."""
    from test_update_sample_logprobs import tokenizers as made

    return made()


def tokens_and_stop(tokenizer):
    """Six ids of real text, and a stop string that the fourth makes."""
    ids = tuple(tokenizer.encode("The scheduler decides which requests run",
                                 add_special_tokens=False))[:6]
    return ids, [tokenizer.decode([ids[3]]).strip()[:3] or "e"]


@pytest.mark.parametrize("log_stats", [False, True], ids=["no-stats", "stats"])
def test_matches_vllms_method_without_a_tokenizer(piece, log_stats):
    piece.reset_stats()
    assert patch.run_scenario(method_of(piece), log_stats=log_stats) == \
        patch.run_scenario(STOCK, log_stats=log_stats)
    counted = piece.stats()
    assert counted["handled"] > 0 and counted["finished"] > 0
    assert counted["calls"] > counted["handled"]  # the prefill and the request gone


@pytest.mark.parametrize("log_stats", [False, True], ids=["no-stats", "stats"])
@pytest.mark.parametrize("tokenizer_name", ["byte-level", "metaspace"])
def test_matches_vllms_method_with_real_tokenizers(piece, tokenizer_name, log_stats):
    tokenizer = tokenizers()[tokenizer_name]
    tokens, stop = tokens_and_stop(tokenizer)
    expected = patch.run_scenario(STOCK, tokenizer, log_stats, stop, tokens)
    assert patch.run_scenario(method_of(piece), tokenizer, log_stats, stop, tokens) == expected
    # The stop string is matched by the detokenizer, and the request aborted.
    assert any("stop_string" in step[1] for step in expected)
    # Decoded text and logprobs texts are there to compare.
    assert any(state[2] for step in expected for state in step[3])


def test_lone_bytes_and_every_token_of_a_small_vocabulary(piece):
    tokenizer = tokenizers()["byte-level"]
    for start in range(0, 300, 6):
        tokens = tuple(range(start, start + 6))
        assert patch.run_scenario(method_of(piece), tokenizer, False, ["\ufffd"], tokens) == \
            patch.run_scenario(STOCK, tokenizer, False, ["\ufffd"], tokens)


def test_source_transform_adds_one_call_at_the_top_of_the_loop():
    import inspect

    built = patch.transformed(STOCK, lambda *args: False)
    assert built.__qualname__ == "OutputProcessor.process_outputs"
    assert built.__doc__ == STOCK.__doc__
    assert built.__globals__ is vars(inspect.getmodule(STOCK))  # vLLM's names, live
    assert inspect.signature(built) == inspect.signature(STOCK)
    assert built.__code__.co_freevars == (patch._HELPER,)
    assert built.__code__.co_firstlineno == STOCK.__code__.co_firstlineno
    assert built.__code__.co_filename == STOCK.__code__.co_filename
    # A helper that takes nothing leaves vLLM's method as it is.
    assert patch.run_scenario(built) == patch.run_scenario(STOCK)
    # One that takes everything leaves vLLM's body unrun.
    skipped = patch.transformed(STOCK, lambda *args: True)
    assert all(step[0] == "[]" for step in patch.run_scenario(skipped))
    # vLLM's body alone: its continue statements return.
    body = patch.vllm_loop_body(STOCK)
    processor = OutputProcessor(None, log_stats=False)
    assert body(processor, EngineCoreOutput(request_id="gone", new_token_ids=[1]),
                None, None, None, [], []) is None

    def without_loop(self, engine_core_outputs):
        return [output.request_id for output in engine_core_outputs]

    with pytest.raises(ValueError, match="loops"):
        patch.transformed(without_loop, lambda *args: False)


def _one_request(output_kind_name="FINAL_ONLY", **params):
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    processor = OutputProcessor(None, log_stats=False)
    request = EngineCoreRequest(
        request_id="r", prompt_token_ids=[1, 2], mm_features=None,
        sampling_params=SamplingParams(
            max_tokens=8, output_kind=getattr(RequestOutputKind, output_kind_name), **params),
        pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None,
        data_parallel_rank=None, external_req_id="r")
    processor.add_request(request, None)
    processor.request_states["r"].is_prefilling = False
    return processor


def _state_of(processor):
    return {rid: (list(getattr(state.detokenizer, "token_ids", [])),
                  {name: list(value) if isinstance(value, list) else value
                   for name, value in vars(state).items()})
            for rid, state in processor.request_states.items()}


@pytest.mark.parametrize("odd", ["prefilling", "error", "routed_experts", "pooling",
                                 "streaming", "no_detokenizer", "subclass_state",
                                 "subclass_processor", "unknown", "lists"])
def test_leaves_an_output_it_does_not_take_to_vllm_unchanged(piece, odd):
    import numpy as np
    import torch

    processor = _one_request()
    state = processor.request_states["r"]
    output = EngineCoreOutput(request_id="r", new_token_ids=[3])
    request_outputs, reqs_to_abort = [], []
    if odd == "prefilling":
        state.is_prefilling = True
    elif odd == "error":
        from vllm.v1.engine import RequestError

        output.error = RequestError(code="x", message="y", retryable=False)
    elif odd == "routed_experts":
        output.routed_experts = np.zeros((1, 1), dtype=np.int32)
    elif odd == "pooling":
        output.pooling_output = torch.zeros(1)
    elif odd == "streaming":
        state.streaming_input = True
    elif odd == "no_detokenizer":
        state.detokenizer = None
    elif odd == "subclass_state":
        state.__class__ = type("State", (type(state),), {})
    elif odd == "subclass_processor":
        processor.__class__ = type("Processor", (OutputProcessor,), {})
    elif odd == "unknown":
        output = EngineCoreOutput(request_id="other", new_token_ids=[3])
    elif odd == "lists":
        request_outputs = ()
    before = _state_of(processor)
    assert piece.process_output(processor, output, None, None, "v", request_outputs,
                                reqs_to_abort) is False
    assert _state_of(processor) == before and not request_outputs and not reqs_to_abort


def test_bind_refuses_bad_input(piece):
    kinds = patch.kinds()
    for position, bad in ((0, "EngineCoreOutput"), (1, "OutputProcessor"), (2, None), (3, 3),
                          (4, [object])):
        wrong = list(kinds)
        wrong[position] = bad
        with pytest.raises(TypeError, match="must be a"):
            piece.bind(*wrong)
    class Property(EngineCoreOutput):
        request_id = property(lambda output: "r")

    class Reading(EngineCoreOutput):
        def __getattribute__(self, name):
            return object.__getattribute__(self, name)

    for output_type, why in ((Property, "request_id is not an object slot"),
                             (Reading, "its own __getattribute__")):
        with pytest.raises(TypeError, match=why):
            piece.bind(output_type, *kinds[1:])
    piece.bind(*kinds)  # the binding kept works
    assert patch.run_scenario(method_of(piece)) == patch.run_scenario(STOCK)


def test_an_output_class_without_an_error_field_reads_none(piece):
    """vLLM 0.32.0's EngineCoreOutput has no ``error``: the turn takes its outputs."""
    import msgspec

    fields = [(field.name, field.type, field.default)
              for field in msgspec.structs.fields(EngineCoreOutput) if field.name != "error"]
    older = msgspec.defstruct("EngineCoreOutput", fields, array_like=True,
                              omit_defaults=True, gc=False)
    assert not hasattr(older, "error")
    kinds = patch.kinds()
    piece.bind(older, *kinds[1:])
    processor = _one_request("CUMULATIVE")
    request_outputs = []
    assert piece.process_output(processor, older(request_id="r", new_token_ids=[3]), None,
                                None, None, request_outputs, []) is True
    assert processor.request_states["r"].detokenizer.token_ids == [3]
    assert len(request_outputs) == 1


def test_an_exception_from_vllms_code_propagates_as_in_vllm(piece, monkeypatch):
    processor = _one_request("CUMULATIVE")

    def fails(self, new_token_ids, stop_terminated):
        raise RuntimeError("detokenizer failed")

    detokenizer_type = type(processor.request_states["r"].detokenizer)
    monkeypatch.setattr(detokenizer_type, "update", fails)
    output = EngineCoreOutput(request_id="r", new_token_ids=[3])
    with pytest.raises(RuntimeError, match="detokenizer failed"):
        piece.process_output(processor, output, None, None, None, [], [])
    with pytest.raises(RuntimeError, match="detokenizer failed"):
        STOCK(processor, [output])


def test_no_leaks():
    processor = _one_request("CUMULATIVE", logprobs=1)
    outputs = []

    def call():
        output = EngineCoreOutput(request_id="r", new_token_ids=[3],
                                  new_logprobs=patch._logprobs(1, 3, 1))
        compiled_piece.process_output(processor, output, None, None, "v1", outputs, [])
        outputs.clear()
        state = processor.request_states["r"]
        state.detokenizer.token_ids.clear()
        state.logprobs_processor.logprobs.clear()

    for _ in range(20):
        call()
    assert_no_leak(call, [processor], 200)


# The prefetch of the states ahead (compiled only: hints) -----------------------

_LONG = 100  # requests: longer than the prefetch pipeline (24 outputs ahead)


def _long_processor(tokenizer=None, decoding=False):
    """A processor with ``_LONG`` requests of every output kind, every third
    with ``logprobs=1``; ``decoding``: past their prefill already."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    processor = OutputProcessor(tokenizer, log_stats=False)
    kinds = (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA,
             RequestOutputKind.FINAL_ONLY)
    for i in range(_LONG):
        params = SamplingParams(max_tokens=8, logprobs=1 if i % 3 == 0 else None,
                                output_kind=kinds[i % 3])
        processor.add_request(EngineCoreRequest(
            request_id=f"r{i}", prompt_token_ids=[1, 2], mm_features=None,
            sampling_params=params, pooling_params=None, arrival_time=0.0, lora_request=None,
            cache_salt=None, data_parallel_rank=None, external_req_id=f"r{i}"), None)
        processor.request_states[f"r{i}"].is_prefilling = not decoding
    return processor


def _long_step(step, tokens=patch._TOKENS):
    """The outputs of ``step``: request ``i`` finishes by length at step
    ``i % 6`` (its state leaves the processor while the states ahead are in
    flight), and an output of a request gone sits in the middle."""
    outputs = []
    for i in range(_LONG):
        if i % 6 < step:
            continue
        token = tokens[(i + step) % len(tokens)]
        outputs.append(EngineCoreOutput(
            request_id=f"r{i}", new_token_ids=[token],
            new_logprobs=patch._logprobs(1, token, step) if i % 3 == 0 else None,
            finish_reason=FinishReason.LENGTH if i % 6 == step else None))
        if i == _LONG // 2:
            outputs.append(EngineCoreOutput(request_id="gone", new_token_ids=[token]))
    return outputs


def _long_run(method, tokenizer=None):
    processor = _long_processor(tokenizer)
    steps = []
    for step in range(6):
        result = method(processor, _long_step(step), None, None, f"v{step // 2}")
        steps.append((repr(result.request_outputs), list(result.reqs_to_abort),
                      [patch._state(state) for state in processor.request_states.values()]))
    return steps


@pytest.mark.parametrize("tokenizer_name", [None, "byte-level"])
def test_batches_longer_than_the_prefetch_pipeline(piece, tokenizer_name):
    tokenizer = tokenizers()[tokenizer_name] if tokenizer_name else None
    piece.reset_stats()
    assert _long_run(method_of(piece), tokenizer) == _long_run(STOCK, tokenizer)
    assert piece.stats()["handled"] > 2 * _LONG and piece.stats()["finished"] > _LONG // 2


@pytest.mark.parametrize("given", ["the loop's", "reversed", "empty", "none", "not outputs"])
def test_the_list_only_steers_the_prefetch(given):
    """The list passed beside each output changes no result, whatever it holds."""
    expected = _long_processor(decoding=True)
    processor = _long_processor(decoding=True)
    for step in range(1, 4):
        outputs = _long_step(step)
        listed = {"the loop's": outputs, "reversed": outputs[::-1], "empty": [],
                  "none": None, "not outputs": ["r1"] * len(outputs)}[given]
        ours, stock = [], []
        for output in outputs:
            compiled_piece.process_output(processor, output, None, None, None, ours, [],
                                          listed)
            twin_piece.process_output(expected, output, None, None, None, stock, [])
        assert repr(ours) == repr(stock)
    assert [patch._state(state) for state in processor.request_states.values()] == \
        [patch._state(state) for state in expected.request_states.values()]


def _held(states):
    """The references to each state and to its attribute dict (the
    prefetch holds the one, then the other)."""
    return [(sys.getrefcount(state), sys.getrefcount(vars(state))) for state in states]


def test_prefetch_holds_no_state_after_the_loop_or_after_a_loop_left_half_way():
    processor = _long_processor(decoding=True)
    states = list(processor.request_states.values())
    held = _held(states)
    outputs = [EngineCoreOutput(request_id=f"r{i}", new_token_ids=[3]) for i in range(_LONG)]
    method_of(compiled_piece)(processor, outputs)
    assert _held(states) == held
    # A loop left after 10 outputs (vLLM's code raised, say): the states in
    # flight are held (the pipeline is running) until the next loop is done.
    for output in outputs[:10]:
        compiled_piece.process_output(processor, output, None, None, None, [], [], outputs)
    assert [now[0] for now in _held(states)] != [then[0] for then in held]
    assert [now[1] for now in _held(states)] != [then[1] for then in held]
    method_of(compiled_piece)(processor, outputs)
    assert _held(states) == held


def test_no_leaks_over_a_batch_longer_than_the_prefetch_pipeline():
    processor = _long_processor(decoding=True)
    outputs = [EngineCoreOutput(request_id=f"r{i}", new_token_ids=[3],
                                new_logprobs=patch._logprobs(1, 3, 1) if i % 3 == 0 else None)
               for i in range(_LONG)]
    method = method_of(compiled_piece)

    def call():
        method(processor, outputs)
        for state in processor.request_states.values():
            state.detokenizer.token_ids.clear()
            if state.logprobs_processor.logprobs is not None:
                state.logprobs_processor.logprobs.clear()

    for _ in range(5):
        call()
    states = list(processor.request_states.values())
    assert_no_leak(call, [processor, *states, *map(vars, states)], 20)


# The plugin side -------------------------------------------------------------

def test_guard_accepts_this_vllm_and_refuses_a_changed_method():
    import vllm

    assert patch.PATCH.check_target(vllm.__version__, STOCK) is None

    def process_outputs(self, engine_core_outputs, engine_core_timestamp=None,
                        iteration_stats=None, weight_version=None):
        return None

    assert "not a verified variant" in patch.PATCH.check_target(vllm.__version__,
                                                                process_outputs)


def test_activation_check_passes_and_refuses_a_planted_bug(monkeypatch):
    assert patch.activation_check(STOCK, patch.process_outputs) is None
    real = compiled_piece.process_output

    def forgets_the_queue(processor, output, *args):
        state = processor.request_states.get(output.request_id)
        if state is not None and state.queue is not None:
            state.queue = None
            taken = real(processor, output, *args)
            return taken
        return real(processor, output, *args)

    monkeypatch.setattr(compiled_piece, "process_output", forgets_the_queue)
    problem = patch.activation_check(STOCK, patch.process_outputs)
    assert problem is not None and "fastbatch gave" in problem


def test_plugin_applies_and_reverts():
    assert PIECE.targets == ("vllm.v1.engine.output_processor.OutputProcessor.process_outputs",)
    try:
        assert PIECE.apply()
        assert OutputProcessor.process_outputs is patch.process_outputs
        assert PIECE.apply()  # idempotent
        assert patch.run_scenario(OutputProcessor.process_outputs) == \
            patch.run_scenario(STOCK)
    finally:
        PIECE.revert()
    assert OutputProcessor.process_outputs is STOCK


def test_each_call_is_one_step_of_the_sample_logprobs_texts(monkeypatch):
    """The installed method runs vLLM's loop inside ``_texts.STEP``
    (its first-sight texts then borrow a tokenizer pool's copy once for the
    call), left when the loop returns or raises."""
    from fastbatch.patches import _texts

    depths = []

    def loop(*arguments):
        depths.append(_texts.STEP.depth)
        if len(depths) == 2:
            raise RuntimeError("vLLM's loop failed")
        return "outputs"

    monkeypatch.setattr(patch, "_FAST", loop)
    assert patch.process_outputs(None, []) == "outputs"
    with pytest.raises(RuntimeError, match="loop failed"):
        patch.process_outputs(None, [])
    assert depths == [1, 1] and _texts.STEP.depth == 0


def test_disable_leaves_it_stock(monkeypatch):
    from fastbatch import vllm_plugin

    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setenv("FASTBATCH_DISABLE", NAME)
    vllm_plugin.register()
    try:
        assert OutputProcessor.process_outputs is STOCK
        assert vllm_plugin.status()["patches"][NAME] is False
    finally:
        vllm_plugin.revert()


# FASTBATCH_VERIFY ------------------------------------------------------------

@pytest.mark.parametrize("log_stats", [False, True], ids=["no-stats", "stats"])
@pytest.mark.parametrize("tokenizer_name", [None, "byte-level", "metaspace"])
def test_verify_no_false_divergence(checks_every_call, tokenizer_name, log_stats):
    if tokenizer_name is None:
        tokenizer, stop, tokens = None, None, patch._TOKENS
    else:
        tokenizer = tokenizers()[tokenizer_name]
        tokens, stop = tokens_and_stop(tokenizer)
    expected = patch.run_scenario(STOCK, tokenizer, log_stats, stop, tokens)
    assert patch.run_scenario(patch.process_outputs, tokenizer, log_stats, stop,
                              tokens) == expected
    assert patch.PATCH.checked > 0
    assert patch.PATCH.divergences == 0 and patch.PATCH.reproducers == []


def _drops_the_weight_version(monkeypatch):
    real = compiled_piece.process_output

    def planted(processor, output, timestamp, stats, weight_version, *rest):
        return real(processor, output, timestamp, stats, None, *rest)

    monkeypatch.setattr(patch._piece, "process_output", planted)


def _length_taken_for_stop(monkeypatch):
    """The compiled turn bound with LENGTH for STOP: the detokenizer is told
    a request finished by length was stop-terminated, and a stop string
    becomes a LENGTH finish."""
    kinds = list(patch.kinds())
    kinds[5] = FinishReason.LENGTH
    compiled_piece.bind(*kinds)


@pytest.mark.parametrize("plant", [_drops_the_weight_version, _length_taken_for_stop])
def test_verify_catches_a_planted_bug(checks_every_call, monkeypatch, logs, plant):
    plant(monkeypatch)
    tokenizer = tokenizers()["byte-level"]
    tokens, stop = tokens_and_stop(tokenizer)
    checked = patch.run_scenario(patch.process_outputs, tokenizer, False, stop, tokens)
    if plant is _drops_the_weight_version:
        # vLLM's writes put in place: every step as stock's.
        assert checked == patch.run_scenario(STOCK, tokenizer, False, stop, tokens)
    # The first divergence is the last: vLLM's body takes every later output.
    assert patch.PATCH.divergences == 1 and len(patch.PATCH.reproducers) == 1
    (error, *_) = [line for line in logs.at(logging.ERROR) if "FASTBATCH_VERIFY" in line]
    assert "'process_outputs'" in error
    assert "for reading" in patch.PATCH.replay({"request_id": "r"})


def test_twin_is_the_reference_module():
    assert _names.twin_modules()[NAME] is _reference.process_outputs
