"""chat_logprobs: ``OpenAIServingChat._create_chat_logprobs``.

* compiled kernel == pure-Python twin on stand-in model classes (no vLLM or
  pydantic needed): the objects built, field by field, and the counters;
  bad input raises a TypeError or ValueError naming it; leaks;
* against the REAL vLLM 0.33.0 method (``vllm``-marked): a stand-in of the
  serving class (built without ``__init__``) with real tokenizers made at
  test time (``test_update_sample_logprobs.tokenizers``), ``Logprob`` dicts
  as the output processor makes them (texts that end in U+FFFD, none, lone
  surrogates; NaN, -inf, below -9999),
  positions with no entry or none at all, list and flat containers,
  ``top_logprobs`` None, 0, 1, 2, 5, -1 and ``logprob_token_ids``, token ids
  as texts; every object of the result must be the same: type, field values
  (floats bit for bit), fields set, extra and private state, JSON;
* the plugin side: the guard accepts this vLLM, the activation check refuses
  a wrong kernel, input the kernel does not take runs vLLM's method,
  ``FASTBATCH_DISABLE=chat_logprobs`` leaves it stock;
* ``FASTBATCH_VERIFY``: no divergence on real calls, and a bug the
  activation check cannot see is caught, vLLM's result returned, replayed.
"""

import functools
import logging
import math

import pytest
from hypothesis import given, note
from hypothesis import strategies as st
from test_update_sample_logprobs import tokenizers as real_tokenizers

import fastbatch
from fastbatch import _reference, registry, vllm_plugin
from fastbatch.patches import chat_logprobs as patch
from leaks import assert_no_leak

NAME = "chat_logprobs"
PIECE = registry.piece(NAME)
REAL_KERNEL = fastbatch.create_chat_logprobs


# --- stand-ins: what the kernel needs of pydantic models and Logprob -----------

class Model:
    """Where a pydantic model keeps its state: these four slots."""

    __slots__ = (
        "__dict__",
        "__pydantic_extra__",
        "__pydantic_fields_set__",
        "__pydantic_private__",
    )


class Top(Model):
    __slots__ = ()


class Content(Model):
    __slots__ = ()


class Logprobs(Model):
    __slots__ = ()


KINDS = (Top, Content, Logprobs)


class Logprob:
    def __init__(self, logprob, rank=None, decoded_token=None):
        self.logprob, self.rank, self.decoded_token = logprob, rank, decoded_token


class Tokenizer:
    """Decodes an id (or a list of ids) as letters."""

    def decode(self, ids, **_):
        ids = [ids] if type(ids) is int else ids
        return "".join(chr(0x61 + i % 26) for i in ids)


def state(value):
    """A model tree as comparable data: type, fields in order, the other three slots."""
    if isinstance(value, Model):
        return (type(value).__name__, [(k, state(v)) for k, v in value.__dict__.items()],
                sorted(value.__pydantic_fields_set__), value.__pydantic_extra__,
                value.__pydantic_private__)
    if type(value) is list:
        return [state(item) for item in value]
    if type(value) is float:
        return value.hex()
    return (type(value).__name__, value)


TEXTS = st.one_of(st.none(), st.text(max_size=4),
                  st.sampled_from(["\ufffd", "\u00e9\ufffd", "\ud800", " the"]))
VALUES = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([-9999.0, -9999.5, -0.0, -math.inf]))


@st.composite
def calls(draw, max_id=60):
    """(token_ids, positions as (id, value, text) lists or None, limit, as_token_id)."""
    n = draw(st.integers(0, 6))
    token_ids = draw(st.lists(st.integers(0, max_id), min_size=n, max_size=n))
    positions = []
    for token in token_ids:
        if draw(st.integers(0, 5)) == 0:
            positions.append(None)
            continue
        others = draw(st.lists(st.tuples(st.integers(0, max_id), VALUES, TEXTS), max_size=4))
        sampled = [] if draw(st.integers(0, 5)) == 0 else [(token, draw(VALUES), draw(TEXTS))]
        positions.append(sampled + others)
    limit = draw(st.sampled_from([None, 0, 1, 2, 5]))
    return token_ids, positions, limit, draw(st.booleans())


def as_dicts(positions, logprob_type=Logprob):
    """Each position's entries as vLLM's dict (a repeated id keeps its first place)."""
    made = []
    for entries in positions:
        if entries is None:
            made.append(None)
            continue
        step = {}
        for rank, (token, value, text) in enumerate(entries):
            step.setdefault(token, logprob_type(value, rank, text))
        made.append(step)
    return made


# --- compiled == twin -----------------------------------------------------------

@given(case=calls())
def test_compiled_and_reference_agree_on_results_and_stats(case):
    token_ids, positions, limit, as_ids = case
    note(repr(case))
    results = []
    for implementation in (fastbatch._kernels, _reference):
        implementation.reset_stats()
        try:
            result = state(implementation.create_chat_logprobs(
                token_ids, as_dicts(positions), Tokenizer(), limit, as_ids, KINDS))
        except (TypeError, ValueError) as exc:
            result = (type(exc).__name__, str(exc))
        results.append((result, implementation.stats()[NAME]))
    assert results[0] == results[1]


@pytest.mark.parametrize("implementation", ["compiled", "reference"], indirect=True)
def test_worked_example(implementation):
    """Two positions: the sampled token's entry with two more (one kept),
    then no entry for the sampled token."""
    step = {7: Logprob(-0.5, 1, "h\u00e9"), 8: Logprob(-20000.0, 2, None),
            9: Logprob(-1.0, 3, "x")}
    implementation.reset_stats()
    result = implementation.create_chat_logprobs([7, 3], [step, {8: Logprob(-2.0)}],
                                                 Tokenizer(), 2, False, KINDS)
    assert state(result) == state(_build(Logprobs, {"content": [
        _build(Content, {"token": "h\u00e9", "logprob": -0.5, "bytes": [104, 195, 169],
                         "top_logprobs": [
                             _build(Top, {"token": "h\u00e9", "logprob": -0.5,
                                          "bytes": [104, 195, 169]}, 3),
                             _build(Top, {"token": "i", "logprob": -9999.0,  # floored
                                          "bytes": [105]}, 3)]}, 4),
        _build(Content, {"token": "d", "logprob": -9999.0, "bytes": [100],
                         "top_logprobs": []}, 2)]}, 1))
    assert implementation.stats()[NAME] == {"calls": 1, "positions": 2, "decoded": 2}


def _build(cls, values, given_count):
    """A stand-in model as validation leaves it, given the first ``given_count``
    names of vLLM's call (token, logprob, bytes, top_logprobs; or bytes second)."""
    names = {1: ["content"], 2: ["token", "bytes"], 3: ["token", "logprob", "bytes"],
             4: ["token", "logprob", "bytes", "top_logprobs"]}[given_count]
    instance = object.__new__(cls)
    object.__setattr__(instance, "__dict__", values)
    object.__setattr__(instance, "__pydantic_fields_set__", set(names))
    object.__setattr__(instance, "__pydantic_extra__", {})
    object.__setattr__(instance, "__pydantic_private__", None)
    return instance


@pytest.mark.parametrize("implementation", ["compiled", "reference"], indirect=True)
def test_token_ids_as_texts_and_lone_surrogates(implementation):
    step = {5: Logprob(float("nan"), 1, "\ud800a"), 6: Logprob(-math.inf, 2, None)}
    result = implementation.create_chat_logprobs((5,), [step], None, None, True, KINDS)
    (content,) = result.content
    assert content.token == "token_id:5" and math.isnan(content.logprob)
    assert content.bytes == [63, 97]  # the surrogate replaced by "?"
    assert [(top.token, top.logprob) for top in content.top_logprobs] == [
        ("token_id:5", content.logprob), ("token_id:6", -9999.0)]


def _bad_cases():
    good = [{1: Logprob(-1.0, 1, "a")}]
    return [
        ("token ids of a generator", (iter([1]), good, None, None, False, KINDS), TypeError,
         "token_ids must be a list or tuple"),
        ("a token id of float", ([1.0], good, None, None, False, KINDS), TypeError,
         r"token_ids\[0\] must be an int"),
        ("a bool token id", ([True], good, None, None, False, KINDS), TypeError,
         r"token_ids\[0\] must be an int"),
        ("a position of a list", ([1], [[1]], None, None, False, KINDS), TypeError,
         r"top_logprobs\[0\] must be a dict or None"),
        ("fewer positions than tokens", ([1, 1], good, None, None, False, KINDS), TypeError,
         "top_logprobs has 1 positions, token_ids 2"),
        ("an int logprob", ([1], [{1: Logprob(-1, 1, "a")}], None, None, False, KINDS),
         TypeError, "Logprob.logprob must be a float, got int"),
        ("a text of bytes", ([1], [{1: Logprob(-1.0, 1, b"a")}], None, None, False, KINDS),
         TypeError, "Logprob.decoded_token must be a str, got bytes"),
        ("a negative limit", ([1], good, None, -1, False, KINDS), TypeError,
         "limit must be None or an int >= 0"),
        ("no tokenizer for a token without entry", ([2], good, None, None, False, KINDS),
         ValueError, "no tokenizer to decode with"),
        ("two kinds", ([1], good, None, None, False, KINDS[:2]), ValueError,
         "kinds must be"),
        ("no kinds", ([1], good, None, None, False, None), TypeError, "NoneType"),
    ]


@pytest.mark.parametrize("implementation", ["compiled", "reference"], indirect=True)
@pytest.mark.parametrize(("name", "arguments", "exception", "message"),
                         _bad_cases(),
                         ids=[case[0] for case in _bad_cases()])
def test_bad_input_is_a_clear_error(implementation, name, arguments, exception, message):
    implementation.reset_stats()
    with pytest.raises(exception, match=message):
        implementation.create_chat_logprobs(*arguments)
    assert implementation.stats()[NAME]["calls"] == 0


def test_no_leak_on_success_or_error():
    kernel = fastbatch._kernels
    positions = as_dicts([[(1, -0.5, "a\u00e9"), (2, -1.5, None)], None,
                          [(4, -2.0, "\ud800")]])
    tokenizer = Tokenizer()

    def step():
        kernel.create_chat_logprobs([1, 3, 4], positions, tokenizer, None, False, KINDS)
        kernel.create_chat_logprobs((1, 3, 4), positions, tokenizer, 1, True, KINDS)
        with pytest.raises(TypeError):
            kernel.create_chat_logprobs([1, 3, 4.0], positions, tokenizer, None, False, KINDS)
        with pytest.raises(ValueError):
            kernel.create_chat_logprobs([1, 3], positions, None, None, False, KINDS)

    for _ in range(100):
        step()
    assert_no_leak(step, [positions, tokenizer], 1000)


# --- against the real vLLM 0.33.0 method ---------------------------------------

@functools.cache
def vllm_method():
    """vLLM's own ``_create_chat_logprobs`` (the first one seen, checked)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    method = PIECE.main.original() or OpenAIServingChat._create_chat_logprobs
    assert not getattr(method, "__fastbatch__", False)
    return method


@pytest.fixture
def stock_vllm():
    """The test starts and ends with vLLM's own method in place."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    PIECE.revert()
    assert OpenAIServingChat._create_chat_logprobs is vllm_method()
    yield
    PIECE.revert()


def real_positions(positions, tokenizer):
    """``positions`` as the output processor leaves them: vLLM's ``Logprob``s,
    each text the tokenizer's (where the case has one)."""
    from vllm.logprobs import Logprob as VllmLogprob

    made = []
    for entries in positions:
        made.append(None if entries is None else [
            (token, value, text if text is None or tokenizer is None
             else tokenizer.decode([token])) for token, value, text in entries])
    return as_dicts(made, VllmLogprob)


def flat(positions):
    from vllm.logprobs import FlatLogprobs

    container = FlatLogprobs()
    for step in positions:
        container.append(step)
    return container


def serving(as_ids=False):
    return patch._stand_in(as_ids)


def run(method, as_ids, **call):
    """``method``'s result on a fresh stand-in as comparable data, or the
    exception it raised."""
    try:
        return patch.model_outcome(method(serving(as_ids), **call))
    except Exception as exc:
        return (type(exc).__name__, str(exc))


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
@pytest.mark.parametrize("tokenizer_name", ["byte-level", "metaspace", "none"])
@pytest.mark.parametrize("container", ["list", "flat"])
@given(case=calls(max_id=299), top=st.sampled_from([None, 0, 1, 2, 5, -1]),
       logprob_token_ids=st.sampled_from([None, [], [3, 4]]),
       as_ids=st.sampled_from([None, False, True]), served_as_ids=st.booleans())
def test_matches_the_real_method(implementation, tokenizer_name, container, case, top,
                                 logprob_token_ids, as_ids, served_as_ids):
    token_ids, positions, _, _ = case
    note(repr(case))
    tokenizer = None if tokenizer_name == "none" else real_tokenizers()[tokenizer_name]
    steps = real_positions(positions, tokenizer)
    top_logprobs = steps if container == "list" else flat(steps)
    call = {"token_ids": token_ids, "top_logprobs": top_logprobs, "tokenizer": tokenizer,
            "num_output_top_logprobs": top, "logprob_token_ids": logprob_token_ids,
            "return_as_token_id": as_ids}
    implementation.reset_stats()
    fastbatch.create_chat_logprobs = implementation.create_chat_logprobs
    try:
        assert run(patch._create_chat_logprobs, served_as_ids, **call) == run(
            vllm_method(), served_as_ids, **call)
    finally:
        fastbatch.create_chat_logprobs = REAL_KERNEL


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_real_outputs_of_the_output_processor_are_taken_whole():
    """Positions made by vLLM's LogprobsProcessor (U+FFFD corrections
    included), through the compiled call only (none handed to vLLM)."""
    import numpy as np
    from vllm.logprobs import create_sample_logprobs
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists

    tokenizer = real_tokenizers()["byte-level"]
    ids = tokenizer.encode("\u0436\u0449 \U0001f41d caf\u00e9 \u2713", add_special_tokens=False)
    for flat_container in (False, True):
        processor = LogprobsProcessor(
            tokenizer=tokenizer, logprobs=create_sample_logprobs(flat_container),
            prompt_logprobs=None, cumulative_logprob=0.0, num_logprobs=2,
            num_prompt_logprobs=None)
        for i, token in enumerate(ids):
            processor._update_sample_logprobs(LogprobsLists(
                np.array([[token, (token + 1) % 300, (token + 7) % 300]], dtype=np.int32),
                np.array([[-0.5 * i, -1.0, -30000.0]], dtype=np.float32), np.array([1]),
                None))
        assert any(processor.logprobs[i][token].decoded_token.endswith("\ufffd")
                   or processor.logprobs[i][token].decoded_token == ""
                   for i, token in enumerate(ids))
        fastbatch.reset_stats()
        for top in (1, 2, -1):
            call = {"token_ids": ids, "top_logprobs": processor.logprobs,
                    "tokenizer": tokenizer, "num_output_top_logprobs": top}
            assert run(patch._create_chat_logprobs, False, **call) == run(
                vllm_method(), False, **call)
        assert fastbatch.stats()[NAME]["calls"] == 3


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_input_the_kernel_does_not_take_runs_vllm_method():
    """An int logprob, top_logprobs of -2, a subclass with its own
    _get_decoded_token, a generator of token ids, no tokenizer where one is
    needed: vLLM's method runs, with its result or its error."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.logprobs import Logprob as VllmLogprob

    good = [{65: VllmLogprob(-1.0, 1, "A"), 66: VllmLogprob(-2.0, 2, "B")}]

    class Shouting(OpenAIServingChat):
        def _get_decoded_token(self, logprob, token_id, tokenizer, return_as_token_id=False):
            return super()._get_decoded_token(logprob, token_id, tokenizer,
                                              return_as_token_id).upper()

    shouting = object.__new__(Shouting)
    shouting.return_tokens_as_token_ids = False
    cases = [
        ({"token_ids": [65], "top_logprobs": [{65: VllmLogprob(-1, 1, "A")}]}, serving()),
        ({"token_ids": [65], "top_logprobs": good, "num_output_top_logprobs": -2},
         serving()),
        ({"token_ids": [65], "top_logprobs": [{65: VllmLogprob(-1.0, 1, "a")}],
          "num_output_top_logprobs": 1}, shouting),
        ({"token_ids": range(65, 66), "top_logprobs": good}, serving()),
        ({"token_ids": [67], "top_logprobs": good}, serving()),  # ValueError: no tokenizer
    ]
    for call, instance in cases:
        fastbatch.reset_stats()
        call = {"tokenizer": None, **call}

        def outcome(method, call=call, instance=instance):
            try:
                return patch.model_outcome(method(instance, **call))
            except Exception as exc:
                return (type(exc).__name__, str(exc))

        assert outcome(patch._create_chat_logprobs) == outcome(vllm_method()), call
        assert fastbatch.stats()[NAME]["calls"] == 0


# --- the plugin: the guard, the activation check, FASTBATCH_DISABLE -------------

@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_guard_accepts_the_installed_vllm():
    import vllm
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    assert PIECE.main.check_target(vllm.__version__, vllm_method()) is None
    assert PIECE.apply() is True
    assert OpenAIServingChat._create_chat_logprobs is patch._create_chat_logprobs
    assert PIECE.main.original() is vllm_method()


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
@pytest.mark.parametrize("broken", ["floor", "raises"])
def test_activation_check_refuses_a_wrong_kernel(monkeypatch, logs, broken):
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    def wrong(token_ids, top_logprobs, tokenizer, limit, as_token_id, kinds):
        if broken == "raises":
            raise RuntimeError("boom")
        result = REAL_KERNEL(token_ids, top_logprobs, tokenizer, limit, as_token_id, kinds)
        for content in result.content:  # the floor of -9999 not applied to the top entries
            for top in content.top_logprobs:
                if top.logprob == -9999.0:
                    top.__dict__["logprob"] = -20000.0
        return result

    monkeypatch.setattr(fastbatch, "create_chat_logprobs", wrong)
    assert PIECE.apply() is False
    assert OpenAIServingChat._create_chat_logprobs is vllm_method()
    (error,) = logs.at(logging.ERROR)
    assert "activation check failed" in error and PIECE.main.target in error


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_disable_leaves_it_stock(monkeypatch):
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setenv("FASTBATCH_DISABLE", NAME)
    vllm_plugin.register()
    try:
        assert OpenAIServingChat._create_chat_logprobs is vllm_method()
        assert vllm_plugin.status()["patches"][NAME] is False
    finally:
        vllm_plugin.revert()


# --- FASTBATCH_VERIFY: the shadow check -----------------------------------------

def kernel_wrong_for_long_completions(token_ids, top_logprobs, tokenizer, limit, as_token_id,
                                      kinds):
    """The real kernel, then the last token's text changed, for completions of
    more than eight tokens (the activation check's have six)."""
    result = REAL_KERNEL(token_ids, top_logprobs, tokenizer, limit, as_token_id, kinds)
    if len(result.content) > 8:
        result.content[-1].__dict__["token"] += "!"
    return result


def real_call(length, top=2):
    from vllm.logprobs import Logprob as VllmLogprob

    tokenizer = real_tokenizers()["byte-level"]
    token_ids = [(17 * i) % 300 for i in range(length)]
    positions = [{token: VllmLogprob(-0.25 * i, 1, tokenizer.decode([token])),
                  (token + 1) % 300: VllmLogprob(-3.0, 2, None)}
                 for i, token in enumerate(token_ids)]
    return {"token_ids": token_ids, "top_logprobs": positions, "tokenizer": tokenizer,
            "num_output_top_logprobs": top}


@pytest.mark.vllm
@pytest.mark.usefixtures("verified_piece")
@pytest.mark.parametrize("top", [0, 2, -1])
def test_verify_finds_no_divergence_on_real_calls(checked_method, top):
    method = checked_method()
    checked = PIECE.main.checked
    call = real_call(12, top)
    assert patch.model_outcome(method(serving(), **call)) == patch.model_outcome(
        vllm_method()(serving(), **call))
    assert PIECE.main.divergences == 0 and PIECE.main.checked == checked + 1


@pytest.mark.vllm
def test_verify_catches_a_bug_the_activation_check_cannot_see(verify_dir, monkeypatch, logs,
                                                              checked_method):
    method = checked_method()  # the activation check passed with the real kernel
    monkeypatch.setattr(fastbatch, "create_chat_logprobs", kernel_wrong_for_long_completions)
    method(serving(), **real_call(4))
    assert PIECE.main.divergences == 0
    call = real_call(12)
    stock = patch.model_outcome(vllm_method()(serving(), **call))

    assert patch.model_outcome(method(serving(), **call)) == stock  # vLLM's result returned

    assert (PIECE.main.checked, PIECE.main.divergences) == (2, 1)
    assert vllm_plugin.status()["verify"]["divergences"][NAME] == 1
    (error,) = logs.at(logging.ERROR)
    assert f"'{NAME}'" in error

    # The reproducer replays the divergence, and no longer with the real kernel.
    (path,) = verify_dir.iterdir()
    assert path.name.startswith(f"{NAME}-") and str(path) in error
    assert vllm_plugin.replay(str(path)) is not None
    monkeypatch.setattr(fastbatch, "create_chat_logprobs", REAL_KERNEL)
    assert vllm_plugin.replay(str(path)) is None

    # From now on the piece runs vLLM's code: the kernel is not called again.
    monkeypatch.setattr(fastbatch, "create_chat_logprobs", kernel_wrong_for_long_completions)
    fastbatch.reset_stats()
    assert patch.model_outcome(method(serving(), **call)) == stock
    assert fastbatch.stats()[NAME]["calls"] == 0
