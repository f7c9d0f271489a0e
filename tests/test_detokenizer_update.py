"""detokenizer_update: ``BaseIncrementalDetokenizer.update``.

* compiled kernel == pure-Python twin == vLLM 0.33's method (no vLLM needed:
  the oracle is ``vllm_update``, the method transcribed, on a detokenizer
  whose ``decode_next`` answers scripted texts); texts a caller holds never
  change while the text grows in place; bad input; an exception from
  ``decode_next``; leaks;
* against the REAL vLLM 0.33.0 method (``vllm``-marked): real
  ``FastIncrementalDetokenizer`` instances of real tokenizers (a byte-level
  BPE whose lone bytes decode to U+FFFD, with special tokens), every stop
  setting, several tokens an update;
* the plugin side: the guard, the activation check, ``FASTBATCH_DISABLE``,
  ``FASTBATCH_VERIFY``.

vLLM is imported only inside the ``vllm``-marked tests, so that the others
run where vLLM is not installed.
"""

import bisect
import functools
import inspect
import logging
import sys

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import fastbatch
from fastbatch import _reference, registry, vllm_plugin
from fastbatch.patches import detokenizer_update as patch
from leaks import assert_no_leak

NAME = "detokenizer_update"
PIECE = registry.piece(NAME)
TEXTS = {**patch.TEXTS, 13: "\u00ff", 14: "\u0100", 15: "a" * 40}


def check_stop_strings(output_text, new_char_count, stop, include_in_output):
    """vLLM 0.33.0's ``check_stop_strings``, transcribed."""
    if not new_char_count or not stop:
        return None
    best_stop_str, best_stop_index, best_end = None, 0, sys.maxsize
    for stop_str in stop:
        stop_index = output_text.find(stop_str, 1 - new_char_count - len(stop_str))
        if stop_index == -1:
            continue
        end = stop_index + len(stop_str)
        if end < best_end:
            best_stop_str, best_stop_index, best_end = stop_str, stop_index, end
    if best_stop_str is None:
        return None
    if include_in_output:
        if best_end >= len(output_text):
            return best_stop_str, -1
        return best_stop_str, best_end
    return best_stop_str, best_stop_index


class Detokenizer:
    """What the method reads and writes of a ``FastIncrementalDetokenizer``,
    with a ``decode_next`` that answers ``TEXTS`` (or raises for id 99)."""

    def __init__(self, stop=(), min_tokens=0, include=False):
        self.token_ids = []
        self.output_text = ""
        self.stop = list(stop)
        self.min_tokens = min_tokens
        self.include_stop_str_in_output = include
        self.asked = []

    def decode_next(self, token_id):
        self.asked.append(token_id)
        if token_id == 99:
            raise ValueError("the stream broke")
        return TEXTS.get(token_id, "?")

    def num_output_tokens(self):
        return len(self.token_ids)


def vllm_update(self, new_token_ids, stop_terminated):
    """vLLM 0.32.0-0.33.0's ``BaseIncrementalDetokenizer.update``, transcribed."""
    if not new_token_ids:
        return None
    if stop_terminated and not self.include_stop_str_in_output:
        skipped_stop_token_id = new_token_ids[-1]
        new_token_ids = new_token_ids[:-1]
    else:
        skipped_stop_token_id = None
    num_prev_tokens = self.num_output_tokens()
    first_new_token_index = len(self.token_ids)
    token_offsets = [len(self.output_text)] if self.stop else None
    for new_token_id in new_token_ids:
        self.token_ids.append(new_token_id)
        self.output_text += self.decode_next(new_token_id)
        if token_offsets is not None:
            token_offsets.append(len(self.output_text))
    if skipped_stop_token_id is not None:
        self.token_ids.append(skipped_stop_token_id)
        if token_offsets is not None:
            token_offsets.append(len(self.output_text))
    stop_string = None
    if token_offsets is not None and self.num_output_tokens() > self.min_tokens:
        stop_check_offset = token_offsets[max(self.min_tokens - num_prev_tokens, 0)]
        stop = check_stop_strings(
            output_text=self.output_text,
            new_char_count=len(self.output_text) - stop_check_offset,
            stop=self.stop, include_in_output=self.include_stop_str_in_output)
        if stop is not None:
            stop_string, truncate_to = stop
            stop_end = len(self.output_text) if truncate_to == -1 else truncate_to
            if not self.include_stop_str_in_output:
                stop_end += len(stop_string)
            num_kept = bisect.bisect_left(token_offsets, stop_end, lo=1)
            del self.token_ids[first_new_token_index + num_kept:]
            if truncate_to != -1:
                self.output_text = self.output_text[:truncate_to]
    return stop_string


def state(detokenizer):
    return (detokenizer.token_ids, detokenizer.output_text, detokenizer.asked)


@st.composite
def scripts(draw):
    """(stop, min_tokens, include, updates): stop strings made of the texts'
    pieces, several tokens an update, stop-terminated updates, and which
    texts a caller keeps."""
    ids = st.sampled_from([*sorted(TEXTS), 50])
    stop = draw(st.lists(st.sampled_from(["STOP", "lo", "\n", "\u00e9", "!", "a" * 3,
                                          "\U0001f642", "zz", "d\u4e2d"]), max_size=3))
    updates = draw(st.lists(st.tuples(st.lists(ids, max_size=4), st.booleans(),
                                      st.booleans()), max_size=12))
    return stop, draw(st.integers(0, 6)), draw(st.booleans()), updates


def run_script(update, script):
    """Each update through ``update``: the return values, the final state,
    and every text a caller kept, with what it read when it kept it."""
    stop, min_tokens, include, updates = script
    detokenizer = Detokenizer(stop, min_tokens, include)
    results, kept = [], []
    for new_token_ids, stop_terminated, keep in updates:
        results.append(update(detokenizer, list(new_token_ids), stop_terminated))
        if keep:
            kept.append((detokenizer.output_text, [ord(c) for c in detokenizer.output_text]))
    return results, state(detokenizer), kept


def kernel_update(implementation):
    def update(detokenizer, new_token_ids, stop_terminated):
        return implementation.update_detokenizer(detokenizer, new_token_ids, stop_terminated,
                                                 check_stop_strings)
    return update


@given(script=scripts())
def test_matches_vllm_method(implementation, script):
    note(repr(script))
    expected = run_script(vllm_update, script)
    got = run_script(kernel_update(implementation), script)
    assert got[:2] == expected[:2]
    for text, code_points in got[2]:  # what a caller kept is as it was
        assert [ord(c) for c in text] == code_points


@given(script=scripts())
def test_compiled_and_reference_agree_on_results_and_stats(script):
    outcomes = []
    for module in (fastbatch._kernels, _reference):
        module.reset_stats()
        outcomes.append((run_script(kernel_update(module), script)[:2], module.stats()[NAME]))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][1]["calls"] == len(script[3])


def test_worked_example(implementation):
    update = kernel_update(implementation)
    detokenizer = Detokenizer(stop=["STOP"])
    assert update(detokenizer, [1, 2], False) is None
    held = detokenizer.output_text
    assert update(detokenizer, [9, 10, 2, 12], False) == "STOP"  # stops mid-update
    assert held == "Hello world"
    assert detokenizer.token_ids == [1, 2, 9, 10]  # the tokens after the match dropped
    assert detokenizer.output_text == "Hello world"  # the stop string cut off
    assert implementation.stats()[NAME]["stops"] >= 1


def test_texts_a_caller_holds_never_change(implementation):
    """Thousands of appends to one text, which the compiled call may grow in
    place while nothing else holds it; now and then a caller keeps it: what
    the caller kept never changes, and every kind of str (ASCII, Latin-1,
    UCS-2, UCS-4) is met on the way.  (That the text does grow in place is
    measured, not tested: benchmarks/detokenizer.py.)"""
    update = kernel_update(implementation)
    detokenizer, expected = Detokenizer(), Detokenizer()
    held = []
    for step in range(3000):
        token_id = (1, 2, 15, 13, 14, 5, 6, 12, 3)[step % 9] if step > 1000 else step % 3 + 1
        update(detokenizer, [token_id], False)
        vllm_update(expected, [token_id], False)
        if step % 250 == 0:
            held.append((detokenizer.output_text, expected.output_text[:]))
    assert state(detokenizer) == state(expected)
    assert all(text == copy for text, copy in held)
    assert {ord(max(text)) > 0xFFFF for text, _ in held} == {False, True}


def test_decode_next_raising_leaves_vllms_state(implementation):
    """vLLM's method has appended the token, and the text of the ones before."""
    stock, ours = Detokenizer(stop=["x"]), Detokenizer(stop=["x"])
    for detokenizer, update in ((stock, vllm_update), (ours, kernel_update(implementation))):
        update(detokenizer, [1], False)
        with pytest.raises(ValueError, match="the stream broke"):
            update(detokenizer, [2, 99, 1], False)
    assert state(ours) == state(stock) == ([1, 2, 99], "Hello world", [1, 2, 99])


def test_vllms_plus_equals_for_a_text_that_is_not_a_str(implementation):
    class Text(str):
        pass

    stock, ours = Detokenizer(), Detokenizer()
    stock.output_text = ours.output_text = Text("a")
    vllm_update(stock, [1, 2], False)
    kernel_update(implementation)(ours, [1, 2], False)
    assert type(ours.output_text) is type(stock.output_text) is str
    assert state(ours) == state(stock)


# --- bad input: a clear exception, and nothing changed ----------------------

def _bad_cases():
    class Slotted:
        __slots__ = ("token_ids",)

    def missing(name):
        detokenizer = Detokenizer(stop=["x"])
        delattr(detokenizer, name)
        return detokenizer

    return [
        ("ids a tuple", Detokenizer(), (1, 2), TypeError, "new_token_ids"),
        ("ids None", Detokenizer(), None, TypeError, "new_token_ids"),
        ("slots left unset", Slotted(), [1], AttributeError, "token_ids"),
        *[(f"no {name}", missing(name), [1], AttributeError, name)
          for name in patch.STATE],
    ]


@pytest.mark.parametrize(("name", "detokenizer", "new_token_ids", "exception", "message"),
                         _bad_cases(), ids=[case[0] for case in _bad_cases()])
def test_bad_input_raises_before_any_change(implementation, name, detokenizer, new_token_ids,
                                            exception, message):
    before = dict(getattr(detokenizer, "__dict__", {}))
    with pytest.raises(exception, match=message):
        implementation.update_detokenizer(detokenizer, new_token_ids, False,
                                          check_stop_strings)
    assert dict(getattr(detokenizer, "__dict__", {})) == before
    assert before.get("asked", []) == []


# --- update: the method as installed (bind) ---------------------------------

def vllm_update_signature(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
    """vLLM 0.33.0's ``BaseIncrementalDetokenizer.update`` signature."""


def recording_stock(calls):
    def stock(self, new_token_ids, stop_terminated):
        calls.append((self, new_token_ids, stop_terminated))
        return "stock"
    return stock


def test_update_has_vllms_signature(implementation):
    def shape(function):
        return [(p.name, p.kind, p.default)
                for p in inspect.signature(function).parameters.values()]

    assert shape(implementation.PIECES[NAME].update) == shape(vllm_update_signature)


def test_update_takes_only_the_bound_type_and_a_list(implementation):
    """The bound type with ids in a list: the compiled call, with the bound
    namespace's check_stop_strings read at the call; anything else (a
    subclass, a tuple of ids): the bound stock method, with the arguments
    as they came."""
    piece, calls = implementation.PIECES[NAME], []
    namespace = {"check_stop_strings": check_stop_strings}
    piece.bind(recording_stock(calls), Detokenizer, namespace)

    class Subclass(Detokenizer):
        pass

    ours, expected = Detokenizer(stop=["STOP"]), Detokenizer(stop=["STOP"])
    assert piece.update(ours, [1, 9, 10, 2], False) == vllm_update(expected, [1, 9, 10, 2],
                                                                   False) == "STOP"
    assert state(ours) == state(expected) and calls == []
    namespace["check_stop_strings"] = lambda **kwargs: None  # read at every call
    assert piece.update(Detokenizer(stop=["STOP"]), [9, 10], False) is None
    other, ids = Subclass(), (1, 2)
    assert piece.update(other, [1], True) == piece.update(ours, ids, False) == "stock"
    assert calls == [(other, [1], True), (ours, ids, False)]
    assert other.token_ids == [] and ours.token_ids == [1, 9, 10]


def test_bind_refuses_bad_input_and_keeps_the_binding(implementation):
    piece, calls = implementation.PIECES[NAME], []
    namespace = {"check_stop_strings": check_stop_strings}
    piece.bind(recording_stock(calls), Detokenizer, namespace)
    for args, message in (((None, Detokenizer, namespace), "stock must be callable"),
                          ((print, Detokenizer(), namespace), "taken must be a type"),
                          ((print, Detokenizer, list(namespace.items())),
                           "namespace must be a dict")):
        with pytest.raises(TypeError, match=message):
            piece.bind(*args)
    assert piece.update(object(), [1], False) == "stock" and len(calls) == 1
    assert piece.update(Detokenizer(), [1], False) is None and len(calls) == 1


# --- references and memory ---------------------------------------------------

def test_no_leak_on_success_or_error():
    kernel = fastbatch._kernels
    detokenizers = [Detokenizer(stop=["STOP", "!"], include=bool(i % 2)) for i in range(4)]
    ids = [[1, 2], [9, 10, 12], [4], [5, 6, 13]]

    def step():
        for detokenizer, new in zip(detokenizers, ids, strict=True):
            kernel.update_detokenizer(detokenizer, new, True, check_stop_strings)
            del detokenizer.token_ids[:], detokenizer.asked[:]
            detokenizer.output_text = ""
        with pytest.raises(ValueError):
            kernel.update_detokenizer(detokenizers[0], [1, 99], False, check_stop_strings)
        del detokenizers[0].token_ids[:], detokenizers[0].asked[:]
        detokenizers[0].output_text = ""
        # the method as installed: the compiled call, vLLM's method, an error
        assert method(detokenizers[1], [1, 9, 10], False) == "STOP"
        assert method(detokenizers[1], (1,), False) == "stock"
        with pytest.raises(ValueError):
            method(detokenizers[2], [99], False)
        for detokenizer in detokenizers[1:3]:
            del detokenizer.token_ids[:], detokenizer.asked[:]
            detokenizer.output_text = ""

    def stock(self, new_token_ids, stop_terminated):
        return "stock"

    namespace = {"check_stop_strings": check_stop_strings}
    kernel.PIECES[NAME].bind(stock, Detokenizer, namespace)
    method = kernel.PIECES[NAME].update
    for _ in range(100):
        step()
    assert_no_leak(step, [*detokenizers, *ids, check_stop_strings, stock, namespace,
                          Detokenizer], 2000)


# --- against the real vLLM 0.33.0 method ---------------------------------------

@functools.cache
def vllm_method():
    """vLLM's own ``update`` (the first one seen, checked)."""
    from vllm.v1.engine.detokenizer import BaseIncrementalDetokenizer

    method = PIECE.main.original() or BaseIncrementalDetokenizer.update
    assert not getattr(method, "__fastbatch__", False)
    return method


@pytest.fixture
def stock_vllm():
    """The test starts and ends with vLLM's own method in place."""
    from vllm.v1.engine.detokenizer import BaseIncrementalDetokenizer

    PIECE.revert()
    assert BaseIncrementalDetokenizer.update is vllm_method()
    yield
    PIECE.revert()


TRAINING = ["The quick brown fox jumps over the lazy dog. " * 3,
            "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, na\u00efve fa\u00e7ade.",
            "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0 emoji \U0001f600 \U0001f680 done.\n\n"] * 10
SPECIAL = ["<|im_start|>", "<|im_end|>"]


@functools.cache
def tokenizer():
    """A byte-level BPE of 300 tokens (lone bytes of a longer character decode
    to U+FFFD) with two special tokens, as vLLM wraps a Hugging Face one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from vllm.tokenizers.hf import get_cached_tokenizer

    byte_level = Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    byte_level.train_from_iterator(TRAINING, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL, show_progress=False))
    return get_cached_tokenizer(PreTrainedTokenizerFast(tokenizer_object=byte_level))


def real_detokenizer(params, prompt):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer, IncrementalDetokenizer

    request = EngineCoreRequest(
        request_id="r", prompt_token_ids=prompt, mm_features=None,
        sampling_params=SamplingParams(max_tokens=1000, **params), pooling_params=None,
        arrival_time=0.0, lora_request=None, cache_salt=None, data_parallel_rank=None)
    detokenizer = IncrementalDetokenizer.from_new_request(tokenizer(), request)
    assert type(detokenizer) is FastIncrementalDetokenizer
    return detokenizer


def bind_to_vllm(piece):
    """``piece.update`` bound as the patch binds it: vLLM's method, its
    ``FastIncrementalDetokenizer`` and its module's namespace."""
    from vllm.v1.engine import detokenizer

    piece.bind(vllm_method(), detokenizer.FastIncrementalDetokenizer, vars(detokenizer))


def real_state(detokenizer):
    return {name: getattr(detokenizer, name) for name in (*patch.STATE, "stop_buffer_length")}


@st.composite
def real_scripts(draw):
    """Sampling settings, a prompt and updates of real token ids: text,
    special tokens, lone bytes; stop strings cut from the text they make."""
    vocab = len(tokenizer())
    ids = st.one_of(st.integers(0, vocab - 1), st.sampled_from(
        tokenizer().encode(TRAINING[2] + TRAINING[1], add_special_tokens=False)))
    updates = draw(st.lists(st.tuples(st.lists(ids, max_size=4), st.booleans()),
                            min_size=1, max_size=10))
    text = tokenizer().decode([i for new, _ in updates for i in new])
    stop = []
    for _ in range(draw(st.integers(0, 2))):
        if len(text) > 2:
            start = draw(st.integers(0, len(text) - 2))
            stop.append(text[start:start + draw(st.integers(1, 3))])
    params = {"stop": stop, "min_tokens": draw(st.integers(0, 5)),
              "include_stop_str_in_output": draw(st.booleans()),
              "skip_special_tokens": draw(st.booleans()),
              "spaces_between_special_tokens": draw(st.booleans())}
    prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6))
    return params, prompt, updates


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
@pytest.mark.parametrize("kernel", ["compiled", "reference"])
@given(script=real_scripts())
def test_matches_the_real_method(kernel, script):
    note(repr(script))
    params, prompt, updates = script
    stock, ours = real_detokenizer(params, prompt), real_detokenizer(params, prompt)
    piece = (fastbatch._kernels if kernel == "compiled" else _reference).PIECES[NAME]
    bind_to_vllm(piece)
    for new_token_ids, stop_terminated in updates:
        expected = vllm_method()(stock, list(new_token_ids), stop_terminated)
        got = piece.update(ours, list(new_token_ids), stop_terminated)
        assert got == expected
        assert real_state(ours) == real_state(stock)
        if expected is not None:
            break  # vLLM's output processor stops a request here


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_a_long_output_is_stock():
    """4,000 tokens of real text, one a step, the text kept by a caller now
    and then (a streaming RequestOutput): vLLM's text and ids."""
    ids = tokenizer().encode("".join(TRAINING) * 5, add_special_tokens=False)[:4000]
    stock, ours = real_detokenizer({}, [1]), real_detokenizer({}, [1])
    assert patch.bind() is None
    held = []
    for step, token_id in enumerate(ids):
        vllm_method()(stock, [token_id], False)
        patch.update(ours, [token_id], False)
        if step % 500 == 0:
            held.append((ours.output_text, stock.output_text))
    assert real_state(ours) == real_state(stock)
    assert ours.output_text == tokenizer().decode(ids) and len(ids) == 4000
    assert all(text == copy for text, copy in held)


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_other_detokenizers_run_vllms_method():
    """A subclass (its own decode_next, say) and ids in a tuple go to vLLM's
    method; the compiled call is not made."""
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    class Shouting(FastIncrementalDetokenizer):
        def decode_next(self, next_token_id):
            return super().decode_next(next_token_id).upper()

    assert patch.bind() is None
    fastbatch.reset_stats()
    shouting = real_detokenizer({}, [1])
    shouting.__class__ = Shouting
    patch.update(shouting, [65, 66], False)
    plain = real_detokenizer({}, [1])
    patch.update(plain, (65, 66), False)
    assert shouting.output_text == plain.output_text.upper() != ""
    assert fastbatch.stats()[NAME]["calls"] == 0


# --- the plugin: the guard, the activation check, FASTBATCH_DISABLE -------------

@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_guard_accepts_the_installed_vllm():
    import vllm
    from vllm.v1.engine.detokenizer import BaseIncrementalDetokenizer, FastIncrementalDetokenizer

    assert PIECE.main.check_target(vllm.__version__, vllm_method()) is None
    assert PIECE.apply() is True
    assert BaseIncrementalDetokenizer.update is patch.update  # the compiled function itself
    assert FastIncrementalDetokenizer.update is patch.update
    assert PIECE.main.original() is vllm_method()


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_guard_refuses_a_changed_method(monkeypatch, logs):
    from vllm.v1.engine.detokenizer import BaseIncrementalDetokenizer

    def changed(self, new_token_ids, stop_terminated):
        self.token_ids.extend(new_token_ids)

    monkeypatch.setattr(BaseIncrementalDetokenizer, "update", changed)
    assert PIECE.apply() is False
    assert BaseIncrementalDetokenizer.update is changed
    (warning,) = logs.at(logging.WARNING)
    assert PIECE.main.target in warning and "not a verified variant" in warning


def wrong_at_the_stop(detokenizer, new_token_ids, stop_terminated):
    result = patch.update(detokenizer, new_token_ids, stop_terminated)
    if result is not None:
        detokenizer.token_ids.append(0)  # the token after the match kept
    return result


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
@pytest.mark.parametrize("broken", ["raises", "stop"])
def test_activation_check_refuses_a_wrong_kernel(monkeypatch, logs, broken):
    from vllm.v1.engine.detokenizer import BaseIncrementalDetokenizer

    def raises(*args):
        raise ValueError("boom")

    wrong = {"raises": raises, "stop": wrong_at_the_stop}[broken]
    monkeypatch.setattr(PIECE.main, "replacement", wrong)
    assert PIECE.apply() is False
    assert BaseIncrementalDetokenizer.update is vllm_method()
    (error,) = logs.at(logging.ERROR)
    assert "activation check failed" in error and PIECE.main.target in error


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
@pytest.mark.parametrize(("attribute", "why"), [
    ("__setattr__", "has its own __setattr__"),
    ("num_output_tokens", "overrides num_output_tokens"),
    ("token_ids", "class attributes ['token_ids'] would be bypassed")])
def test_a_class_the_compiled_call_cannot_take_stays_stock(monkeypatch, logs, attribute, why):
    from vllm.v1.engine.detokenizer import BaseIncrementalDetokenizer, FastIncrementalDetokenizer

    def own_setattr(self, name, value):
        object.__setattr__(self, name, value)

    value = {"__setattr__": own_setattr, "num_output_tokens": len,
             "token_ids": property(len)}[attribute]
    monkeypatch.setattr(FastIncrementalDetokenizer, attribute, value, raising=False)
    assert PIECE.apply() is False
    assert BaseIncrementalDetokenizer.update is vllm_method()
    (error,) = logs.at(logging.ERROR)
    assert "activation check failed" in error and why in error


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_disable_leaves_it_stock(monkeypatch):
    from vllm.v1.engine.detokenizer import BaseIncrementalDetokenizer

    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setenv("FASTBATCH_DISABLE", NAME)
    vllm_plugin.register()
    try:
        assert BaseIncrementalDetokenizer.update is vllm_method()
        assert vllm_plugin.status()["patches"][NAME] is False
    finally:
        vllm_plugin.revert()


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_patched_method_counts_its_work():
    PIECE.apply()
    fastbatch.reset_stats()
    detokenizer = real_detokenizer({"stop": ["o"]}, [1])
    detokenizer.update(tokenizer().encode("Hello world", add_special_tokens=False), False)
    stats = fastbatch.stats()[NAME]
    assert (stats["calls"], stats["stops"]) == (1, 1) and stats["tokens"] >= 1
    assert detokenizer.output_text == "Hell"


# --- FASTBATCH_VERIFY: the shadow check -----------------------------------------

def wrong_for_long_updates(detokenizer, new_token_ids, stop_terminated):
    """The real method, then the last token dropped, for updates of five or
    more tokens (the activation check's have at most four)."""
    result = patch.update(detokenizer, new_token_ids, stop_terminated)
    if len(new_token_ids) >= 5:
        detokenizer.token_ids.pop()
    return result


@pytest.mark.vllm
@pytest.mark.usefixtures("verified_piece")
@given(script=real_scripts())
def test_verify_finds_no_divergence_on_real_updates(script, checked_method):
    """Every call checked against the real method, which never decodes a
    token twice: no divergence, vLLM's state."""
    note(repr(script))
    method = checked_method()
    params, prompt, updates = script
    stock, ours = real_detokenizer(params, prompt), real_detokenizer(params, prompt)
    for new_token_ids, stop_terminated in updates:
        expected = vllm_method()(stock, list(new_token_ids), stop_terminated)
        assert method(ours, list(new_token_ids), stop_terminated) == expected
        assert real_state(ours) == real_state(stock)
        assert "decode_next" not in vars(ours)
        if expected is not None:
            break
    assert PIECE.main.divergences == 0


@pytest.mark.vllm
def test_verify_catches_a_bug_the_activation_check_cannot_see(verify_dir, monkeypatch, logs,
                                                              checked_method):
    method = checked_method()  # the activation check passed with the real kernel
    monkeypatch.setattr(PIECE.main, "replacement", wrong_for_long_updates)
    ids = tokenizer().encode("Hello world, caf\u00e9 \U0001f600 done", add_special_tokens=False)
    assert len(ids) >= 6
    stock, ours = real_detokenizer({}, [1]), real_detokenizer({}, [1])
    for new in ([ids[0]], ids[1:3]):
        vllm_method()(stock, list(new), False)
        method(ours, list(new), False)
    assert (PIECE.main.checked, PIECE.main.divergences) == (2, 0)
    vllm_method()(stock, ids[3:], False)

    assert method(ours, ids[3:], False) is None

    assert real_state(ours) == real_state(stock)  # vLLM's ids, in the same list
    assert (PIECE.main.checked, PIECE.main.divergences) == (3, 1)
    assert vllm_plugin.status()["verify"]["divergences"][NAME] == 1
    (error,) = logs.at(logging.ERROR)
    assert f"'{NAME}'" in error

    # The reproducer replays the divergence, and no longer with the real kernel.
    (path,) = verify_dir.iterdir()
    assert path.name.startswith(f"{NAME}-") and str(path) in error
    assert vllm_plugin.replay(str(path)) is not None
    monkeypatch.setattr(PIECE.main, "replacement", patch.update)
    assert vllm_plugin.replay(str(path)) is None

    # From now on the piece runs vLLM's code: the kernel is not called again.
    monkeypatch.setattr(PIECE.main, "replacement", wrong_for_long_updates)
    fastbatch.reset_stats()
    vllm_method()(stock, ids[:6], False)
    method(ours, ids[:6], False)
    assert real_state(ours) == real_state(stock)
    assert fastbatch.stats()[NAME]["calls"] == 0
