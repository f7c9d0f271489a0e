"""update_sample_logprobs: ``LogprobsProcessor._update_sample_logprobs``.

* compiled kernel == pure-Python twin == vLLM 0.33's method transcribed
  (``VllmProcessor``: no vLLM needed) on stand-in processors; bad input
  raises before any change; leaks;
* against the REAL vLLM 0.33.0 method (``vllm``-marked): real
  ``LogprobsProcessor``s with real tokenizers made at test time (a byte-level
  BPE whose lone bytes decode to U+FFFD, and a SentencePiece-style one with
  byte fallback, whose leading-space marker takes vLLM's other path), list
  and flat containers, ``num_logprobs`` 0, 1, 5, -1, batches wider than the
  request, several positions; the whole outcome must be the same, floats bit
  for bit;
* the plugin side: the guard accepts this vLLM, the activation check refuses
  a wrong kernel, input the kernel does not take runs vLLM's method,
  ``FASTBATCH_DISABLE=update_sample_logprobs`` leaves it stock;
* ``FASTBATCH_VERIFY``: no divergence on real steps, and a bug the
  activation check cannot see is caught, undone, and replayed.
"""

import copy
import dataclasses
import functools
import gc
import itertools
import logging
import sys

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import fastbatch
from fastbatch import _reference, registry, vllm_plugin
from fastbatch.patches import _texts
from fastbatch.patches import update_sample_logprobs as patch
from leaks import assert_no_leak

NAME = "update_sample_logprobs"
PIECE = registry.piece(NAME)
REPLACEMENT = "\ufffd"


# --- stand-ins: vLLM's classes and method transcribed (no vLLM needed) ---------

@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class Flat:
    start_indices: list = dataclasses.field(default_factory=list)
    end_indices: list = dataclasses.field(default_factory=list)
    token_ids: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    ranks: list = dataclasses.field(default_factory=list)
    decoded_tokens: list = dataclasses.field(default_factory=list)

    def __len__(self):
        return len(self.start_indices)


KINDS = (Logprob, Flat)
# A tokenizer stand-in: id -> text (ids 0x80-0xff end in U+FFFD, as lone bytes do).
TEXTS = {i: (chr(i) if i < 0x80 else REPLACEMENT) for i in range(256)}
TEXTS.update({256: " the", 257: "\u00e9t\u00e9", 258: "\u20ac" + REPLACEMENT, 259: ""})


def convert(tokenizer, ids):
    return [tokenizer[i] for i in ids]


class VllmProcessor:
    """vLLM 0.33's ``LogprobsProcessor`` sample path, transcribed; its
    correction is a stand-in that shows the id and the context it was given."""

    def __init__(self, tokenizer, flat, num_logprobs, cumulative=0.0):
        self.tokenizer = tokenizer
        self.logprobs = Flat() if flat else []
        self.num_logprobs = num_logprobs
        self.cumulative_logprob = cumulative

    @staticmethod
    def _get_sampled_context_ids(logprobs_source, max_context=4):
        if not logprobs_source:
            return []
        n = len(logprobs_source)
        start = max(0, n - max_context)
        if isinstance(logprobs_source, Flat):
            return [logprobs_source.token_ids[logprobs_source.start_indices[i]]
                    for i in range(start, n)
                    if logprobs_source.start_indices[i] < logprobs_source.end_indices[i]]
        return [next(iter(logprobs_source[i])) for i in range(start, n)
                if logprobs_source[i] is not None]

    def _correct_decoded_token(self, token_id, context_token_ids):
        return f"<{token_id}|{','.join(map(str, context_token_ids[-4:]))}>"

    def vllm_update(self, logprobs_lists):
        token_ids_lst, logprobs_lst, ranks_lst, _ = logprobs_lists
        for rank_np, logprobs_np, token_ids_np in zip(ranks_lst, logprobs_lst, token_ids_lst,
                                                          strict=False):
            rank, logprobs, token_ids = (rank_np.tolist(), logprobs_np.tolist(),
                                         token_ids_np.tolist())
            if self.tokenizer is None:
                decoded = itertools.repeat(None)
            else:
                decoded = convert(self.tokenizer, token_ids)
                context = self._get_sampled_context_ids(self.logprobs)
                fixed = {idx: self._correct_decoded_token(token_ids[idx], context)
                         for idx, text in enumerate(decoded) if text.endswith(REPLACEMENT)}
                for idx, text in fixed.items():
                    decoded[idx] = text
            self.cumulative_logprob += logprobs[0]
            num_logprobs = len(logprobs) if self.num_logprobs == -1 else self.num_logprobs
            ranks = itertools.chain((rank,), range(1, num_logprobs + 1))
            if isinstance(self.logprobs, Flat):
                self.logprobs.start_indices.append(len(self.logprobs.logprobs))
                for token_id, logprob, rank_, token in zip(token_ids, logprobs, ranks, decoded,
                                                           strict=False):
                    self.logprobs.token_ids.append(token_id)
                    self.logprobs.logprobs.append(logprob)
                    self.logprobs.ranks.append(rank_)
                    self.logprobs.decoded_tokens.append(token)
                self.logprobs.end_indices.append(len(self.logprobs.logprobs))
            else:
                self.logprobs.append({token_id: Logprob(logprob, rank_, token)
                                      for token_id, logprob, rank_, token
                                      in zip(token_ids, logprobs, ranks, decoded,
                                             strict=False)})


def outcome(processor):
    return patch.logprobs_outcome(processor, (0, 0))


@st.composite
def steps(draw, max_id=260):
    """(flat, num_logprobs, tokenizer?, [logprobs_lists...]): positions 0-3 per
    call, 1-5 columns, ids with U+FFFD texts and repeats, int32/int64 ids,
    float32/float64 values with -inf, strided views."""
    flat = draw(st.booleans())
    num_logprobs = draw(st.sampled_from([-1, 0, 1, 2, 4]))
    with_tokenizer = draw(st.booleans())
    width = draw(st.integers(1, 5))
    calls = []
    for _ in range(draw(st.integers(1, 4))):
        positions = draw(st.integers(0, 3))
        ids = np.array(draw(st.lists(st.lists(st.integers(0, max_id - 1), min_size=width,
                                              max_size=width),
                                     min_size=positions, max_size=positions)) or
                       np.zeros((0, width)), dtype=draw(st.sampled_from([np.int32, np.int64])))
        values = np.array(draw(st.lists(st.lists(st.sampled_from(
            [-0.0, -0.5, -1.25, -3.0e-8, -np.inf, -20.75]), min_size=width, max_size=width),
            min_size=positions, max_size=positions)) or np.zeros((0, width)),
            dtype=draw(st.sampled_from([np.float32, np.float64])))
        ranks = np.array(draw(st.lists(st.integers(1, 5000), min_size=positions,
                                       max_size=positions)), dtype=np.int64)
        # Arrays of their own (read through the buffer protocol), rows sliced
        # from a larger array as vLLM's ``slice_request`` makes them, or views
        # with strides (both read in place).
        layout = draw(st.sampled_from(["own", "slice", "strided"]))
        if layout == "slice":
            ids, values, ranks = (np.concatenate([array[:1], array, array[:1]])[1:-1]
                                  for array in (ids, values, ranks))
        elif layout == "strided" and positions:
            ids = np.repeat(ids, 2, axis=0)[::2]
            values = np.repeat(values, 2, axis=0)[::2]
            ranks = np.repeat(ranks, 2)[::2]
        calls.append((ids, values, ranks, None))
    return flat, num_logprobs, with_tokenizer, calls


@given(case=steps())
def test_matches_vllm_method(implementation, case):
    note(repr(case))
    flat, num_logprobs, with_tokenizer, calls = case
    tokenizer = TEXTS if with_tokenizer else None
    stock = VllmProcessor(tokenizer, flat, num_logprobs)
    ours = VllmProcessor(tokenizer, flat, num_logprobs)
    texts = {}
    for logprobs_lists in calls:
        stock.vllm_update(logprobs_lists)
        assert implementation.update_sample_logprobs(
            ours, logprobs_lists, texts, convert, KINDS) == len(logprobs_lists[0])
        assert outcome(ours) == outcome(stock)


@given(case=steps())
def test_compiled_and_reference_agree_on_results_and_stats(case):
    flat, num_logprobs, with_tokenizer, calls = case
    tokenizer = TEXTS if with_tokenizer else None
    results = []
    for implementation in (fastbatch._kernels, _reference):
        processor = VllmProcessor(tokenizer, flat, num_logprobs)
        implementation.reset_stats()
        texts = {}
        for logprobs_lists in calls:
            implementation.update_sample_logprobs(processor, logprobs_lists, texts, convert,
                                                  KINDS)
        results.append((outcome(processor), texts, implementation.stats()[NAME]))
    assert results[0] == results[1]


def test_worked_example(implementation):
    """Two calls, list container: the sampled token among the top ones (the
    dict keeps its first place, the top entry's values), a lone byte
    corrected with the sampled context, a narrower request than the batch."""
    processor = VllmProcessor(TEXTS, False, 1)
    texts = {}
    first = (np.array([[65, 65, 66]], dtype=np.int32),
             np.array([[-0.5, -0.5, -2.0]], dtype=np.float32), np.array([2]), None)
    second = (np.array([[0xC3, 256, 0xC3], [66, 0xA9, 65]], dtype=np.int64),
              np.array([[-1.0, -0.25, -1.0], [-0.125, -3.0, -0.125]], dtype=np.float32),
              np.array([3, 1]), None)
    implementation.reset_stats()
    assert implementation.update_sample_logprobs(processor, first, texts, convert, KINDS) == 1
    assert implementation.update_sample_logprobs(processor, second, texts, convert, KINDS) == 2
    assert processor.logprobs == [
        {65: Logprob(-0.5, 1, "A")},
        {0xC3: Logprob(-1.0, 3, "<195|65>"), 256: Logprob(-0.25, 1, " the")},
        {66: Logprob(-0.125, 1, "B"), 0xA9: Logprob(-3.0, 1, "<169|65,195>")},
    ]
    assert processor.cumulative_logprob == -0.5 - 1.0 - 0.125
    assert texts == {65: "A", 0xC3: REPLACEMENT, 256: " the", 66: "B", 0xA9: REPLACEMENT}
    assert implementation.stats()[NAME] == {"calls": 2, "positions": 3, "decoded": 5,
                                            "corrected": 2}


def test_a_repeated_sampled_token_is_corrected_once_in_a_dict(implementation):
    """A lone byte sampled and also the top token (greedy): in a dict only the
    top column's text is kept, so it alone is corrected; in a flat container
    both entries are kept and both corrected.  Either way the outcome is
    vLLM's."""
    lists = (np.array([[0xC3, 0xC3]], dtype=np.int32),
             np.array([[-0.5, -0.5]], dtype=np.float32), np.array([1]), None)
    for flat, corrections in ((False, 1), (True, 2)):
        stock, ours = (VllmProcessor(TEXTS, flat, 1) for _ in range(2))
        stock.vllm_update(lists)
        implementation.reset_stats()
        implementation.update_sample_logprobs(ours, lists, {}, convert, KINDS)
        assert outcome(ours) == outcome(stock)
        assert implementation.stats()[NAME]["corrected"] == corrections


def test_a_given_correction_is_called_instead_of_the_processors(implementation):
    """With ``correct``, each U+FFFD text kept is ``correct(processor, token,
    context)``, given what the processor's own method would be given; that
    one is not called."""
    stock = VllmProcessor(TEXTS, False, 1)
    ours = VllmProcessor(TEXTS, False, 1)
    ours._correct_decoded_token = None  # calling it would be a TypeError
    calls = []

    def correct(processor, token, context):
        assert processor is ours
        calls.append((token, list(context)))
        return stock._correct_decoded_token(token, context)

    lists = [(np.array([[65, 0xC3, 66]], dtype=np.int32),
              np.array([[-0.5, -1.0, -2.0]], dtype=np.float32), np.array([2]), None),
             (np.array([[0xC3, 256], [0xA9, 0xA9]], dtype=np.int64),
              np.array([[-1.0, -0.25], [-0.125, -0.125]], dtype=np.float32),
              np.array([3, 1]), None)]
    for logprobs_lists in lists:
        stock.vllm_update(logprobs_lists)
        implementation.update_sample_logprobs(ours, logprobs_lists, {}, convert, KINDS,
                                              correct)
    assert outcome(ours) == outcome(stock)
    # the last position's sampled 0xA9 is also its top one: its text is that one's
    assert calls == [(0xC3, []), (0xC3, [65]), (0xA9, [65, 0xC3])]


def test_the_compiled_logprobs_are_left_to_the_collector_untracked():
    """The compiled call's ``Logprob`` objects hold a float, an int and a
    str, and each position's dict int keys and those: neither is tracked by
    the garbage collector, so its full collections do not walk the history
    (the twin's and vLLM's are tracked); a dict tracks itself again when a
    container is stored in it."""
    processor = VllmProcessor(TEXTS, False, 1)
    lists = (np.array([[65, 66], [67, 0xC3]], dtype=np.int32),
             np.zeros((2, 2), dtype=np.float32), np.array([1, 2]), None)
    fastbatch._kernels.update_sample_logprobs(processor, lists, {}, convert, KINDS)
    made = [logprob for entry in processor.logprobs for logprob in entry.values()]
    assert len(made) == 4 and not any(gc.is_tracked(logprob) for logprob in made)
    assert not any(gc.is_tracked(entry) for entry in processor.logprobs)
    processor.logprobs[0]["added"] = []
    assert gc.is_tracked(processor.logprobs[0])
    stock = VllmProcessor(TEXTS, False, 1)
    stock.vllm_update(lists)
    del processor.logprobs[0]["added"]
    assert outcome(processor) == outcome(stock)
    assert all(gc.is_tracked(logprob) for entry in stock.logprobs for logprob in entry.values())


def init_calls(make):
    """The ``__init__`` calls Python sees while ``make()`` runs."""
    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "__init__":
            calls.append(frame.f_code)

    sys.setprofile(profile)
    try:
        make()
    finally:
        sys.setprofile(None)
    return calls


PLAIN_LISTS = (np.array([[65, 66], [67, 0xC3]], dtype=np.int32),
               np.array([[-0.5, -1.0], [-2.0, -0.25]], dtype=np.float32), np.array([3, 2]),
               None)


def test_a_plain_dataclass_logprob_is_made_as_its_init_makes_it():
    """vLLM's ``Logprob`` is a dataclass of three fields: the compiled call
    makes each as its ``__init__`` does (``object.__new__``, the attributes
    stored in the fields' order) without calling it; the same attributes, in
    the same order, equal objects."""
    ours = VllmProcessor(TEXTS, False, 1)
    calls = init_calls(lambda: fastbatch._kernels.update_sample_logprobs(
        ours, PLAIN_LISTS, {}, convert, KINDS))
    assert calls == []
    stock = VllmProcessor(TEXTS, False, 1)
    stock.vllm_update(PLAIN_LISTS)
    assert outcome(ours) == outcome(stock)
    pairs = [(mine, theirs) for entry, expected in zip(ours.logprobs, stock.logprobs,
                                                       strict=True)
             for mine, theirs in zip(entry.values(), expected.values(), strict=True)]
    assert len(pairs) == 4
    for mine, theirs in pairs:
        assert type(mine) is Logprob and mine == theirs
        assert list(vars(mine).items()) == list(vars(theirs).items())


@dataclasses.dataclass
class Reordered:
    rank: int | None = None
    logprob: float = 0.0
    decoded_token: str | None = None


class OwnSetattr(Logprob):
    def __setattr__(self, name, value):
        object.__setattr__(self, name, value if name != "decoded_token" else f"<{value}>")


@pytest.mark.parametrize("kind", [Reordered, OwnSetattr], ids=["reordered", "own-setattr"])
def test_a_logprob_type_that_is_not_the_plain_dataclass_is_called(kind):
    """Any other ``Logprob`` type (other fields or order, its own
    ``__setattr__``) is called, as vLLM calls it."""
    ours = VllmProcessor(TEXTS, False, 1)
    fastbatch._kernels.update_sample_logprobs(ours, PLAIN_LISTS, {}, convert, (kind, Flat))
    stock = VllmProcessor(TEXTS, False, 1)
    stock.vllm_update(PLAIN_LISTS)
    made = [logprob for entry in ours.logprobs for logprob in entry.values()]
    expected = [logprob for entry in stock.logprobs for logprob in entry.values()]
    assert [vars(logprob) for logprob in made] == [
        vars(kind(*dataclasses.astuple(logprob))) for logprob in expected]


def test_a_logprob_type_changed_after_a_call_is_checked_again():
    """The answer for a type is kept only while the type is unchanged: an
    ``__init__`` set on it later is called."""
    @dataclasses.dataclass
    class Changed:
        logprob: float
        rank: int | None = None
        decoded_token: str | None = None

    processor = VllmProcessor(TEXTS, False, 1)
    run = functools.partial(fastbatch._kernels.update_sample_logprobs, processor, PLAIN_LISTS,
                            {}, convert, (Changed, Flat))
    assert init_calls(run) == []
    plain_init = Changed.__init__

    def __init__(self, logprob, rank=None, decoded_token=None):
        plain_init(self, logprob, rank, decoded_token)
        self.seen = True

    Changed.__init__ = __init__
    calls = init_calls(run)
    made = [logprob for entry in processor.logprobs[-2:] for logprob in entry.values()]
    # this __init__ and the dataclass's it calls, for each Logprob made
    assert len(made) == 4 and calls == [__init__.__code__, plain_init.__code__] * 4
    assert all(logprob.seen for logprob in made)


def test_a_sampled_token_among_the_top_ones_gets_one_logprob():
    """With greedy sampling the sampled id is also the top one: vLLM makes a
    ``Logprob`` for each column, and its dict keeps the sampled token's place
    with the later column's; the compiled call makes only that one."""
    made = []

    @dataclasses.dataclass
    class Counted(Logprob):
        def __post_init__(self):
            made.append(self)

    lists = (np.array([[66, 65, 66], [67, 67, 68], [69, 70, 71]], dtype=np.int32),
             np.array([[-1.0, -0.5, -1.0], [-0.25, -0.25, -3.0], [-4.0, -0.5, -1.5]],
                      dtype=np.float32), np.array([2, 1, 9]), None)
    processor = VllmProcessor(TEXTS, False, 2)
    fastbatch._kernels.update_sample_logprobs(processor, lists, {}, convert, (Counted, Flat))
    assert [[(token, dataclasses.astuple(logprob)) for token, logprob in entry.items()]
            for entry in processor.logprobs] == [
        [(66, (-1.0, 2, "B")), (65, (-0.5, 1, "A"))],
        [(67, (-0.25, 1, "C")), (68, (-3.0, 2, "D"))],
        [(69, (-4.0, 9, "E")), (70, (-0.5, 1, "F")), (71, (-1.5, 2, "G"))]]
    assert len(made) == 7  # vLLM's: 9
    stock = VllmProcessor(TEXTS, False, 2)
    stock.vllm_update(lists)
    ours = VllmProcessor(TEXTS, False, 2)
    fastbatch._kernels.update_sample_logprobs(ours, lists, {}, convert, KINDS)
    assert outcome(ours) == outcome(stock)


def test_flat_container_and_every_logprob(implementation):
    processor = VllmProcessor(None, True, -1, cumulative=-1.5)
    lists = (np.array([[7, 8, 9]], dtype=np.int32),
             np.array([[-0.25, -1.0, -np.inf]], dtype=np.float32), np.array([4]), None)
    implementation.update_sample_logprobs(processor, lists, {}, convert, KINDS)
    assert processor.logprobs == Flat([0], [3], [7, 8, 9], [-0.25, -1.0, -np.inf], [4, 1, 2],
                                      [None, None, None])
    assert processor.cumulative_logprob == -1.75


def _bad_cases():
    ids = np.array([[1, 2]], dtype=np.int32)
    values = np.array([[-0.5, -1.0]], dtype=np.float32)
    ranks = np.array([1])

    def lists(**changes):
        items = {"ids": ids, "values": values, "ranks": ranks, **changes}
        return (items["ids"], items["values"], items["ranks"], None)

    def processor(**changes):
        made = VllmProcessor(TEXTS, False, 1, cumulative=-2.0)
        made.logprobs.append({5: Logprob(-2.0, 1, "x")})
        vars(made).update(changes)
        return made

    return [
        ("not a 4-tuple", processor(), lists()[:3], TypeError, "4-tuple"),
        ("a list of arrays", processor(), list(lists()), TypeError, "4-tuple"),
        ("1-D token ids", processor(), lists(ids=ids[0]), TypeError, "2-D int32 or int64"),
        ("float token ids", processor(), lists(ids=values), TypeError, "token ids"),
        ("int logprobs", processor(), lists(values=ids), TypeError, "float32 or float64"),
        ("float16 logprobs", processor(), lists(values=values.astype(np.float16)), TypeError,
         "float32 or float64"),
        ("a view of float16 logprobs", processor(),
         lists(values=values.astype(np.float16)[:1]), TypeError, "float32 or float64"),
        ("a view of big-endian token ids", processor(), lists(ids=ids.astype(">i8")[:1]),
         TypeError, "2-D int32 or int64"),
        ("a view of unsigned token ids", processor(), lists(ids=ids.astype(np.uint32)[:1]),
         TypeError, "2-D int32 or int64"),
        ("a view of 2-D ranks", processor(), lists(ranks=np.array([[1]])[:1]),
         TypeError, "sampled ranks"),
        ("a list of ranks", processor(), lists(ranks=[1]), TypeError, "sampled ranks"),
        ("no column", processor(), lists(ids=ids[:, :0]), ValueError, "no column"),
        ("num_logprobs None", processor(num_logprobs=None), lists(), TypeError,
         "num_logprobs must be an int"),
        ("num_logprobs bool", processor(num_logprobs=True), lists(), TypeError,
         "num_logprobs must be an int"),
        ("int cumulative", processor(cumulative_logprob=0), lists(), TypeError,
         "cumulative_logprob must be a float"),
        ("a tuple container", processor(logprobs=()), lists(), TypeError,
         "list or FlatLogprobs"),
        ("a text that is not a str", processor(tokenizer={1: b"x", 2: "y"}), lists(),
         TypeError, "must be a str"),
    ]


@pytest.mark.parametrize(("name", "processor", "lists", "exception", "message"), _bad_cases(),
                         ids=[case[0] for case in _bad_cases()])
def test_bad_input_raises_before_any_change(implementation, name, processor, lists, exception,
                                            message):
    processor = copy.deepcopy(processor)
    before = repr(vars(processor))
    with pytest.raises(exception, match=message):
        implementation.update_sample_logprobs(processor, lists, {}, convert, KINDS)
    assert repr(vars(processor)) == before


@pytest.mark.parametrize("argument", ["texts", "kinds"])
def test_a_missing_table_or_kinds_is_a_type_error(implementation, argument):
    processor = VllmProcessor(TEXTS, False, 1)
    arguments = {"texts": {}, "kinds": KINDS, argument: None}
    lists = (np.array([[65, 66]], dtype=np.int32), np.zeros((1, 2), dtype=np.float32),
             np.array([1]), None)
    with pytest.raises(TypeError):
        implementation.update_sample_logprobs(processor, lists, arguments["texts"], convert,
                                              arguments["kinds"])
    assert processor.logprobs == [] and processor.cumulative_logprob == 0.0


def test_a_correction_that_raises_writes_nothing(implementation):
    class Failing(VllmProcessor):
        def _correct_decoded_token(self, token_id, context):
            raise RuntimeError("tokenizer broke")

    processor = Failing(TEXTS, True, 1)
    lists = (np.array([[65, 66], [0xC3, 66]], dtype=np.int32),
             np.zeros((2, 2), dtype=np.float32), np.array([1, 1]), None)
    with pytest.raises(RuntimeError, match="tokenizer broke"):
        implementation.update_sample_logprobs(processor, lists, {}, convert, KINDS)
    assert processor.logprobs == Flat() and processor.cumulative_logprob == 0.0


def test_no_leak_on_success_or_error():
    kernel = fastbatch._kernels
    texts = {}
    ids = np.array([[0xC3, 44, 257], [66, 65, 0xA9]], dtype=np.int64)
    values = np.array([[-0.5, -1.0, -2.0], [-0.25, -3.0, -4.0]], dtype=np.float32)
    good = (ids, values, np.array([3, 1]), None)
    bad = (ids, values.astype(np.float16), np.array([3, 1]), None)

    def step():
        for flat in (False, True):
            processor = VllmProcessor(TEXTS, flat, 2)
            kernel.update_sample_logprobs(processor, good, texts, convert, KINDS)
            kernel.update_sample_logprobs(processor, good, texts, convert, KINDS,
                                          VllmProcessor._correct_decoded_token)
            with pytest.raises(TypeError):
                kernel.update_sample_logprobs(processor, bad, texts, convert, KINDS)

    for _ in range(100):
        step()
    assert_no_leak(step, [texts, ids, values, good, bad, TEXTS], 1000)


# --- against the real vLLM 0.33.0 method ---------------------------------------

@functools.cache
def vllm_method():
    """vLLM's own ``_update_sample_logprobs`` (the first one seen, checked)."""
    from vllm.v1.engine.logprobs import LogprobsProcessor

    method = PIECE.main.original() or LogprobsProcessor._update_sample_logprobs
    assert not getattr(method, "__fastbatch__", False)
    return method


@pytest.fixture(autouse=True)
def _bound_to_vllm(request):
    """The installed method (the compiled ``update``) bound to vLLM's own, for
    the tests that run real vLLM."""
    if request.node.get_closest_marker("vllm") is not None:
        patch.bind(vllm_method())
    yield


@pytest.fixture
def stock_vllm():
    """The test starts and ends with vLLM's own method in place."""
    from vllm.v1.engine.logprobs import LogprobsProcessor

    PIECE.revert()
    assert LogprobsProcessor._update_sample_logprobs is vllm_method()
    yield
    PIECE.revert()


TRAINING = ["Caf\u00e9 cr\u00e8me, na\u00efve \u00fcber r\u00e9sum\u00e9 \u2014 10 \u20ac.",
            "The scheduler decides which requests run in each step.",
            "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3068 emoji \U0001f600 \U0001f680."] * 10


@functools.cache
def tokenizers():
    """vLLM-wrapped tokenizers made here: a byte-level BPE of 300 tokens
    (lone bytes of a longer character decode to U+FFFD) and a
    SentencePiece-style BPE with byte fallback and a Metaspace marker."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from vllm.tokenizers.hf import get_cached_tokenizer, maybe_make_thread_pool

    byte_level = Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    byte_level.train_from_iterator(TRAINING, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))

    pieces = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    pieces.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                              normalizers.Replace(" ", "\u2581")])
    pieces.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                    prepend_scheme="never")
    pieces.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                        decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    pieces.train_from_iterator(TRAINING, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>"] + [f"<0x{b:02X}>" for b in range(256)],
        show_progress=False))
    made = {}
    for name, tokenizer in (("byte-level", byte_level), ("metaspace", pieces)):
        wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")
        made[name] = maybe_make_thread_pool(get_cached_tokenizer(wrapped), 1)
    return made


def real_processor(tokenizer, flat, num_logprobs):
    from vllm.logprobs import create_sample_logprobs
    from vllm.v1.engine.logprobs import LogprobsProcessor

    return LogprobsProcessor(tokenizer=tokenizer, logprobs=create_sample_logprobs(flat),
                             prompt_logprobs=None, cumulative_logprob=0.0,
                             num_logprobs=num_logprobs, num_prompt_logprobs=None)


def as_logprobs_lists(lists):
    from vllm.v1.outputs import LogprobsLists

    return LogprobsLists(*lists)


def bound(implementation):
    """The implementation's module, its installed method (``update``) bound
    as the patch binds the compiled one."""
    module = implementation.PIECES[NAME]
    module.bind(vllm_method(), _texts.tokenizer_entry, _texts.convert, patch._kinds())
    return module


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
@pytest.mark.parametrize("tokenizer_name", ["byte-level", "metaspace", "none"])
@given(case=steps(max_id=300))
def test_matches_the_real_method(implementation, tokenizer_name, case):
    note(repr(case))
    flat, num_logprobs, _, calls = case
    tokenizer = None if tokenizer_name == "none" else tokenizers()[tokenizer_name]
    stock = real_processor(tokenizer, flat, num_logprobs)
    ours = real_processor(tokenizer, flat, num_logprobs)
    implementation.reset_stats()
    update = bound(implementation).update
    for lists in calls:
        lists = as_logprobs_lists(lists)
        vllm_method()(stock, lists)
        assert update(ours, lists) is None
        assert outcome(ours) == outcome(stock)
    # every call was the implementation's (none handed to vLLM's method)
    assert implementation.stats()[NAME]["calls"] == len(calls)


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_the_real_tokenizers_make_both_paths():
    """The test tokenizers reach what they are for: U+FFFD texts corrected
    with context, and the leading-space marker path."""
    from vllm.tokenizers.detokenizer_utils import get_leading_space_marker

    made = tokenizers()
    assert get_leading_space_marker(made["metaspace"]) == "\u2581"
    assert get_leading_space_marker(made["byte-level"]) is None
    for tokenizer in made.values():
        ids = tokenizer.encode("\u0436\u0449 \U0001f41d \u2713", add_special_tokens=False)  # unseen
        texts = [tokenizer.decode([i]) for i in ids]
        assert any(text.endswith(REPLACEMENT) for text in texts), texts
        processor = real_processor(tokenizer, False, 0)
        ours = real_processor(tokenizer, False, 0)
        fastbatch.reset_stats()
        for token in ids:
            lists = as_logprobs_lists((np.array([[token]], dtype=np.int32),
                                       np.array([[-1.0]], dtype=np.float32), np.array([1]),
                                       None))
            vllm_method()(processor, lists)
            patch._update_sample_logprobs(ours, lists)
        assert outcome(ours) == outcome(processor)
        assert fastbatch.stats()[NAME]["corrected"] > 0


@pytest.mark.vllm
def test_the_installed_method_has_vllms_signature_and_no_python_frame(implementation):
    import inspect

    def shape(function):
        return [(p.name, p.kind, p.default)
                for p in inspect.signature(function).parameters.values()]

    update = bound(implementation).update
    assert shape(update) == shape(vllm_method())
    if implementation is fastbatch._kernels:
        assert patch._update_sample_logprobs is update
        assert not inspect.isfunction(update)  # compiled: no Python frame around the call


@pytest.mark.vllm
def test_the_installed_method_follows_the_processors_tokenizer(implementation):
    """Processors of two tokenizers and of none, in turn: each its own
    table (the last tokenizer's is kept at hand)."""
    update = bound(implementation).update
    made = [tokenizers()["byte-level"], tokenizers()["metaspace"], None]
    pairs = [(real_processor(tokenizer, False, 2), real_processor(tokenizer, False, 2))
             for tokenizer in made * 2]
    for step in range(3):
        for index, (stock, ours) in enumerate(pairs):
            ids = np.array([[40 + step + index, 60 + index, 250 - step]], dtype=np.int32)
            lists = as_logprobs_lists((ids, np.array([[-0.5, -1.0, -2.0]], dtype=np.float32),
                                       np.array([1 + step]), None))
            vllm_method()(stock, lists)
            update(ours, lists)
            assert outcome(ours) == outcome(stock)


@pytest.mark.vllm
def test_bind_refuses_bad_input_and_keeps_the_binding(implementation):
    module = bound(implementation)
    update = module.update
    good = (vllm_method(), _texts.tokenizer_entry, _texts.convert, patch._kinds())
    for position, bad, error in ((0, None, TypeError), (1, "entry", TypeError),
                                 (2, "convert", TypeError), (3, (Logprob,), ValueError)):
        arguments = list(good)
        arguments[position] = bad
        with pytest.raises(error):
            module.bind(*arguments)
    stock, ours = real_processor(None, False, 1), real_processor(None, False, 1)
    lists = as_logprobs_lists((np.array([[3, 4]], dtype=np.int32),
                               np.array([[-0.5, -1.0]], dtype=np.float32), np.array([1]), None))
    vllm_method()(stock, lists)
    update(ours, lists)
    assert outcome(ours) == outcome(stock)


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_input_the_kernel_does_not_take_runs_vllm_method():
    """float16 logprobs (the kernel reads float32/64 only) and an unhashable
    tokenizer: vLLM's method runs, with its result."""
    tokenizer = tokenizers()["byte-level"]
    lists = as_logprobs_lists((np.array([[70, 71]], dtype=np.int32),
                               np.array([[-0.5, -1.0]], dtype=np.float16), np.array([1]), None))
    stock, ours = real_processor(tokenizer, False, 1), real_processor(tokenizer, False, 1)
    fastbatch.reset_stats()
    vllm_method()(stock, lists)
    patch._update_sample_logprobs(ours, lists)
    assert outcome(ours) == outcome(stock)
    assert fastbatch.stats()[NAME]["calls"] == 0

    class Unhashable(dict):
        def decode(self, ids, **_):
            return "".join(chr(65 + i % 26) for i in ids)

    assert _texts.texts_of(Unhashable()) is None
    stock, ours = real_processor(Unhashable(), True, 1), real_processor(Unhashable(), True, 1)
    lists = as_logprobs_lists((np.array([[3, 4]], dtype=np.int32),
                               np.array([[-0.5, -1.0]], dtype=np.float32), np.array([1]), None))
    vllm_method()(stock, lists)
    patch._update_sample_logprobs(ours, lists)
    assert outcome(ours) == outcome(stock)
    assert fastbatch.stats()[NAME]["calls"] == 0


def pool_queue(tokenizer):
    """The queue of a vLLM tokenizer pool (``maybe_make_thread_pool``)."""
    borrow = type(tokenizer).decode.__closure__[0].cell_contents.__wrapped__
    cells = dict(zip(borrow.__code__.co_freevars, borrow.__closure__, strict=True))
    return cells["tokenizer_pool"].cell_contents


def counted_borrows(tokenizer):
    """A fresh copy of a vLLM pool tokenizer (its pool of one copy: its
    ``__reduce__``), its queue, and the list its borrows are appended to."""
    tokenizer = copy.deepcopy(tokenizer)
    queue = pool_queue(tokenizer)
    borrows = []
    get_nowait = queue.get_nowait
    queue.get_nowait = lambda: borrows.append(1) or get_nowait()
    return tokenizer, queue, borrows


def corrected_steps(tokenizer, text):
    """One step per token of ``text``, each the token and the text's first
    token as its top logprob (multi-byte characters: U+FFFD corrections)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [as_logprobs_lists((np.array([[token, ids[0]]], dtype=np.int32),
                               np.array([[-1.0, -2.0]], dtype=np.float32), np.array([1]), None))
            for token in ids]


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_corrections_decode_each_id_list_once():
    """A tokenizer's U+FFFD corrections are vLLM's own ``_correct_decoded_token``,
    whose ``decode`` calls are answered from the tokenizer's memo where the same
    ids were decoded before: the same steps again decode nothing (no borrow from
    vLLM's tokenizer pool), and the texts are vLLM's each time."""
    tokenizer, queue, borrows = counted_borrows(tokenizers()["byte-level"])
    steps = corrected_steps(tokenizer, "\u0436\u0449 \U0001f41d \u2713")
    first, second, stock = (real_processor(tokenizer, False, 1) for _ in range(3))
    for lists in steps:
        vllm_method()(stock, lists)
        patch._update_sample_logprobs(first, lists)  # fills the table and the memo
    assert borrows
    del borrows[:]
    fastbatch.reset_stats()
    for lists in steps:
        patch._update_sample_logprobs(second, lists)
    assert fastbatch.stats()[NAME]["corrected"] > 0 and not borrows
    assert queue.qsize() == 1
    assert outcome(first) == outcome(second) == outcome(stock)
    count = len(_texts._TABLES)  # the memo does not keep its tokenizer alive
    del tokenizer, first, second, stock
    gc.collect()
    assert len(_texts._TABLES) == count - 1


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_a_correction_is_made_once_per_token_and_context(monkeypatch):
    """vLLM's ``_correct_decoded_token`` runs once for a token and a context:
    the same steps again take every correction from the tokenizer's memo,
    and the texts are vLLM's each time."""
    tokenizer = copy.deepcopy(tokenizers()["byte-level"])
    steps = corrected_steps(tokenizer, "\u0436\u0449 \U0001f41d \u2713")
    processor_type = sys.modules["vllm.v1.engine.logprobs"].LogprobsProcessor
    vllm_correct = processor_type._correct_decoded_token
    made = []

    def counted(self, token_id, context_token_ids):
        made.append((token_id, tuple(context_token_ids)))
        return vllm_correct(self, token_id, context_token_ids)

    stock = [real_processor(tokenizer, False, 1) for _ in range(2)]
    for processor in stock:
        for lists in steps:
            vllm_method()(processor, lists)
    monkeypatch.setattr(processor_type, "_correct_decoded_token", counted)
    first, second = real_processor(tokenizer, False, 1), real_processor(tokenizer, False, 1)
    for lists in steps:
        patch._update_sample_logprobs(first, lists)
    assert made and len(made) == len(set(made))
    assert len(_texts.tokenizer_entry(tokenizer)[1].corrected) == len(made)
    del made[:]
    fastbatch.reset_stats()
    for lists in steps:
        patch._update_sample_logprobs(second, lists)
    assert fastbatch.stats()[NAME]["corrected"] > 0 and not made
    assert outcome(first) == outcome(second) == outcome(stock[0]) == outcome(stock[1])


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
@pytest.mark.parametrize("tokenizer_name", ["byte-level", "metaspace"])
def test_a_step_borrows_from_each_pool_once(tokenizer_name):
    """Within a ``STEP`` (the ``process_outputs`` piece's call) the texts and
    the corrections of every processor of a pool tokenizer come from one copy,
    borrowed at the first text met and put back when the step ends; the
    texts are vLLM's, which borrows once per text.  Outside a step each
    first sight borrows, as vLLM does."""
    tokenizer, queue, borrows = counted_borrows(tokenizers()[tokenizer_name])
    steps = corrected_steps(tokenizer, "\u0436\u0449 \U0001f41d \u2713 caf\u00e9")
    ours = [real_processor(tokenizer, flat, 1) for flat in (False, True)]
    stock = [real_processor(tokenizer, flat, 1) for flat in (False, True)]
    del borrows[:]  # the encoding's
    with _texts.STEP:
        assert not borrows  # borrowed when needed, not before
        for lists in steps:
            for processor in ours:
                patch._update_sample_logprobs(processor, lists)
        assert len(borrows) == 1 and queue.qsize() == 0  # held for the step
    assert queue.qsize() == 1 and not _texts.STEP.lent
    del borrows[:]
    for lists in steps:
        for processor in stock:
            vllm_method()(processor, lists)
    assert len(borrows) > len(steps)
    assert [outcome(processor) for processor in ours] == [outcome(p) for p in stock]
    fastbatch.reset_stats()
    _texts.forget()
    del borrows[:]
    for lists in steps:  # no step: a borrow per text met, as vLLM's
        patch._update_sample_logprobs(real_processor(tokenizer, False, 1), lists)
    assert len(borrows) >= fastbatch.stats()[NAME]["decoded"] > 1


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_a_step_puts_its_copy_back_when_the_step_raises():
    tokenizer, queue, borrows = counted_borrows(tokenizers()["byte-level"])
    lists = corrected_steps(tokenizer, "\u0436")[0]
    del borrows[:]  # the encoding's
    with pytest.raises(RuntimeError, match="the step failed"), _texts.STEP:
        with _texts.STEP:  # nested: the outer step keeps the copy
            patch._update_sample_logprobs(real_processor(tokenizer, False, 1), lists)
        assert queue.qsize() == 0
        raise RuntimeError("the step failed")
    assert len(borrows) == 1 and queue.qsize() == 1
    assert _texts.STEP.depth == 0 and not _texts.STEP.lent


@pytest.mark.vllm
def test_a_step_lends_on_its_own_thread_only():
    import threading

    tokenizer = copy.deepcopy(tokenizers()["byte-level"])
    seen = []
    with _texts.STEP:
        lender = _texts.lent(tokenizer)
        assert isinstance(lender, _texts.PoolLender) and _texts.lent(tokenizer) is lender
        thread = threading.Thread(target=lambda: seen.append(_texts.lent(tokenizer)))
        thread.start()
        thread.join()
    assert seen == [tokenizer]
    assert _texts.lent(tokenizer) is tokenizer  # after the step


@pytest.mark.vllm
def test_a_lender_is_its_pool_tokenizer_but_for_the_two_borrowed_methods():
    """Its ``decode`` and ``convert_ids_to_tokens`` are the borrowed copy's;
    any other attribute read or written is the pool tokenizer's."""
    tokenizer = copy.deepcopy(tokenizers()["metaspace"])
    ids = tokenizer.encode("caf\u00e9 cr\u00e8me", add_special_tokens=False)
    with _texts.STEP:
        lender = _texts.lent(tokenizer)
        borrowed = lender._copy
        assert borrowed is not tokenizer and type(borrowed) is not type(tokenizer)
        assert lender.decode(ids) == tokenizer.decode(ids)
        assert lender.convert_ids_to_tokens(ids) == tokenizer.convert_ids_to_tokens(ids)
        assert lender.backend_tokenizer is tokenizer.backend_tokenizer
        lender.fastbatch_test_mark = 7
    assert tokenizer.fastbatch_test_mark == 7
    assert not hasattr(borrowed, "fastbatch_test_mark")


@pytest.mark.vllm
def test_only_a_tokenizer_of_vllms_pool_is_lent():
    """``pool_borrow`` takes a class made by vLLM's ``maybe_make_thread_pool``
    (its methods that factory's code) and nothing else."""
    pooled = tokenizers()["byte-level"]
    assert _texts.pool_borrow(pooled) is not None
    assert _texts.pool_borrow(copy.deepcopy(pooled)) is not _texts.pool_borrow(pooled)

    class OwnDecode(type(pooled)):
        def decode(self, *args, **kwargs):
            return super().decode(*args, **kwargs)

    unpooled = copy.copy(pooled)
    unpooled.__class__ = type(pooled).__mro__[1]  # the tokenizer the pool wraps
    for tokenizer in (_texts.ByteTokenizer(), None, unpooled, OwnDecode.__new__(OwnDecode)):
        assert _texts.pool_borrow(tokenizer) is None
        with _texts.STEP:
            assert _texts.lent(tokenizer) is tokenizer


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_forget_empties_every_table_as_in_a_new_process():
    """``forget()`` (the benchmarks' cold runs) empties each tokenizer's texts
    and memos in place: the same steps then decode and correct again, as the
    first time, and every text is still vLLM's."""
    tokenizer = copy.deepcopy(tokenizers()["byte-level"])
    steps = corrected_steps(tokenizer, "\u0436\u0449 \U0001f41d \u2713")
    runs = []
    for forget in (False, True):
        if forget:
            _texts.forget()
            texts, corrector = _texts.tokenizer_entry(tokenizer)
            assert not texts and not corrector.decodes and not corrector.corrected
        fastbatch.reset_stats()
        ours, stock = real_processor(tokenizer, False, 1), real_processor(tokenizer, False, 1)
        for lists in steps:
            vllm_method()(stock, lists)
            patch._update_sample_logprobs(ours, lists)
        assert outcome(ours) == outcome(stock)
        runs.append(fastbatch.stats()[NAME])
    assert runs[0]["decoded"] > 0 and runs[0] == runs[1]


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_a_full_memo_is_emptied_and_corrections_stay_vllms(monkeypatch):
    """The memo holds at most ``MEMO_LIMIT`` id lists: when full it is emptied
    before the next is kept, and every text is still vLLM's."""
    monkeypatch.setattr(_texts, "MEMO_LIMIT", 3)
    tokenizer = copy.deepcopy(tokenizers()["byte-level"])
    steps = corrected_steps(tokenizer, "\u0436\u0449\u0436\u0449 \U0001f41d\U0001f41d \u2713")
    ours, stock = real_processor(tokenizer, False, 1), real_processor(tokenizer, False, 1)
    memo = _texts.tokenizer_entry(tokenizer)[1].decodes
    sizes = []
    for lists in steps:
        vllm_method()(stock, lists)
        patch._update_sample_logprobs(ours, lists)
        sizes.append(len(memo))
    assert outcome(ours) == outcome(stock)
    assert max(sizes) == 3 and any(later < size for size, later in itertools.pairwise(sizes))


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_a_subclass_correction_is_called_on_the_processor():
    """A processor whose class has its own ``_correct_decoded_token`` gets it
    called, pooled tokenizer or not."""
    from vllm.logprobs import create_sample_logprobs
    from vllm.v1.engine.logprobs import LogprobsProcessor

    class Marking(LogprobsProcessor):
        def _correct_decoded_token(self, token_id, context_token_ids):
            return f"<{token_id}>"

    tokenizer = tokenizers()["byte-level"]
    ids = tokenizer.encode("\u0436\u0449", add_special_tokens=False)
    made = [Marking(tokenizer=tokenizer, logprobs=create_sample_logprobs(False),
                    prompt_logprobs=None, cumulative_logprob=0.0, num_logprobs=0,
                    num_prompt_logprobs=None) for _ in range(2)]
    for token in ids:
        lists = as_logprobs_lists((np.array([[token]], dtype=np.int32),
                                   np.array([[-1.0]], dtype=np.float32), np.array([1]), None))
        vllm_method()(made[0], lists)
        patch._update_sample_logprobs(made[1], lists)
    assert outcome(made[1]) == outcome(made[0])
    assert any(text.startswith("<") for entry in made[1].logprobs
               for text in (logprob.decoded_token for logprob in entry.values()))


@pytest.mark.vllm
def test_a_table_per_tokenizer_that_goes_with_it():
    first, second = _texts.ByteTokenizer(), _texts.ByteTokenizer()
    table = _texts.texts_of(first)
    assert _texts.texts_of(first) is table and _texts.texts_of(second) is not table
    assert _texts.texts_of(None) == {}
    gc.collect()  # earlier tests' tokenizers in reference cycles
    count = len(_texts._TABLES)
    del first
    gc.collect()
    assert len(_texts._TABLES) == count - 1


# --- the texts read ahead, at the output processor's construction ---------------

@pytest.mark.vllm
@pytest.mark.parametrize("tokenizer_name", ["byte-level", "metaspace"])
def test_prewarm_reads_vllms_first_sight_text_of_every_id(tokenizer_name):
    """``prewarm`` puts in a tokenizer's table, for every id from 0 to its
    ``max_token_id``, the text vLLM's ``convert_ids_list_to_tokens`` gives
    that id alone, with one borrow from the tokenizer's pool for them all;
    a second time it reads nothing."""
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

    tokenizer, queue, borrows = counted_borrows(tokenizers()[tokenizer_name])
    ids = range(tokenizer.max_token_id + 1)
    assert len(ids) == len(tokenizer)  # every id the tokenizer has
    assert _texts.prewarm(tokenizer) == len(ids)
    assert len(borrows) == 1 and queue.qsize() == 1
    expected = {token_id: convert_ids_list_to_tokens(tokenizer, [token_id])[0]
                for token_id in ids}
    assert _texts.texts_of(tokenizer) == expected
    assert any(text.endswith(REPLACEMENT) for text in expected.values())  # lone bytes
    del borrows[:]
    assert _texts.prewarm(tokenizer) == 0 and not borrows


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_texts_read_ahead_give_vllms_logprobs_without_a_decode():
    """After ``prewarm`` the steps decode no text on first sight (``decoded``
    stays 0); the U+FFFD corrections are made as before, and every entry is
    vLLM's."""
    tokenizer = copy.deepcopy(tokenizers()["byte-level"])
    steps = corrected_steps(tokenizer, "\u0436\u0449 \U0001f41d caf\u00e9 the scheduler")
    _texts.prewarm(tokenizer)
    fastbatch.reset_stats()
    for flat in (False, True):
        ours, stock = real_processor(tokenizer, flat, 1), real_processor(tokenizer, flat, 1)
        for lists in steps:
            vllm_method()(stock, lists)
            patch._update_sample_logprobs(ours, lists)
        assert outcome(ours) == outcome(stock)
    counts = fastbatch.stats()[NAME]
    assert counts["decoded"] == 0 and counts["corrected"] > 0 and counts["positions"] > 0


class RefusingTokenizer(_texts.ByteTokenizer):
    """Id 7's text raises, id 9's is not a str."""

    def decode(self, ids, **kwargs):
        if ids == [7]:
            raise ValueError("no text for id 7")
        return 5 if ids == [9] else super().decode(ids)


@pytest.mark.vllm
def test_prewarm_leaves_to_first_sight_what_it_cannot_read(monkeypatch):
    """An id whose call raises or gives no str is left out (first sight then
    raises or refuses it, as before); nothing is read without a tokenizer,
    without an int ``max_token_id`` from 0 to ``PREWARM_LIMIT``, or for a
    tokenizer that cannot key a table."""
    import vllm.v1.engine.logprobs  # noqa: F401 - the module ``_convert`` reads

    tokenizer = RefusingTokenizer()
    assert _texts.prewarm(tokenizer) == tokenizer.max_token_id + 1 - 2
    texts = _texts.texts_of(tokenizer)
    assert 7 not in texts and 9 not in texts and texts[8] == "\x08"
    for last in (None, -1, 2.0, True, _texts.PREWARM_LIMIT + 1):
        other = _texts.ByteTokenizer()
        other.max_token_id = last
        assert _texts.prewarm(other) == 0 and _texts.texts_of(other) == {}
    monkeypatch.setattr(_texts.ByteTokenizer, "__hash__", None)
    assert _texts.prewarm(_texts.ByteTokenizer()) == 0
    assert _texts.prewarm(None) == 0


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_an_output_processor_reads_its_tokenizers_texts_ahead(logs):
    """Installed, vLLM's ``OutputProcessor`` reads its tokenizer's texts as it
    is built (logged), and is otherwise built as vLLM builds it; reverted,
    vLLM's own ``__init__`` is back."""
    from vllm.v1.engine.output_processor import OutputProcessor

    stock_init = OutputProcessor.__init__
    tokenizer = copy.deepcopy(tokenizers()["metaspace"])
    stock = OutputProcessor(tokenizer, log_stats=True, stream_interval=3)
    assert _texts.texts_of(tokenizer) == {}
    assert PIECE.apply() is True
    assert OutputProcessor.__init__ is patch._output_processor_init
    ours = OutputProcessor(tokenizer, log_stats=True, stream_interval=3)
    assert patch._state(ours) == patch._state(stock) and ours.tokenizer is tokenizer
    assert len(_texts.texts_of(tokenizer)) == len(tokenizer)
    infos = logs.at(logging.INFO)
    assert any(f"read the texts of {len(tokenizer)} token ids ahead" in line for line in infos)
    OutputProcessor(None, log_stats=False)  # no tokenizer: nothing read, nothing logged
    assert logs.at(logging.INFO) == infos
    PIECE.revert()
    assert OutputProcessor.__init__ is stock_init


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_forget_reads_a_prewarmed_tokenizers_texts_again():
    """``forget()`` is a new process: the memos empty, and the texts that an
    output processor's construction read ahead read again."""
    tokenizer = copy.deepcopy(tokenizers()["byte-level"])
    _texts.prewarm(tokenizer)
    texts, corrector = _texts.tokenizer_entry(tokenizer)
    full = dict(texts)
    processor = real_processor(tokenizer, False, 1)
    for lists in corrected_steps(tokenizer, "\u0436\u0449"):
        patch._update_sample_logprobs(processor, lists)
    assert corrector.decodes and corrector.corrected
    _texts.forget()
    assert texts == full and not corrector.decodes and not corrector.corrected


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_texts_are_read_ahead_under_verify_and_checked_in_use():
    """With ``FASTBATCH_VERIFY`` the construction is installed too (its shadow
    passes every call through: nothing of it to compare); the texts it read
    are compared with vLLM's on each checked call of the piece."""
    from vllm.v1.engine.output_processor import OutputProcessor

    assert PIECE.apply(verify=1.0) is True
    assert patch.PREWARM_PATCH.is_applied() and patch.PREWARM_PATCH.verify_rate == 1.0
    tokenizer = copy.deepcopy(tokenizers()["byte-level"])
    OutputProcessor(tokenizer, log_stats=False)
    assert len(_texts.texts_of(tokenizer)) == len(tokenizer)
    from vllm.v1.engine.logprobs import LogprobsProcessor

    processor = real_processor(tokenizer, False, 1)
    for lists in corrected_steps(tokenizer, "caf\u00e9 \u0436"):
        LogprobsProcessor._update_sample_logprobs(processor, lists)
    assert PIECE.main.checked > 0 and PIECE.main.divergences == 0
    assert patch.PREWARM_PATCH.checked == 0


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
@pytest.mark.parametrize("broken", ["construction", "texts"])
def test_prewarm_activation_check_refuses_a_wrong_one(monkeypatch, logs, broken):
    """A construction that builds another processor, or a ``prewarm`` whose
    texts are not vLLM's, is refused: the construction stays vLLM's, the
    piece's method is installed."""
    from vllm.v1.engine.output_processor import OutputProcessor

    stock_init = OutputProcessor.__init__
    if broken == "construction":
        def wrong(self, tokenizer, *args, **kwargs):
            patch._output_processor_init(self, tokenizer, *args, **kwargs)
            self.stream_interval += 1

        monkeypatch.setattr(patch.PREWARM_PATCH, "replacement", wrong)
    else:
        real = _texts.prewarm

        def wrong(tokenizer):
            read = real(tokenizer)
            _texts.texts_of(tokenizer)[0] += "!"
            return read

        monkeypatch.setattr(_texts, "prewarm", wrong)
    assert PIECE.apply() is True
    assert OutputProcessor.__init__ is stock_init
    (error,) = logs.at(logging.ERROR)
    assert "activation check failed" in error and patch.PREWARM_TARGET.replace(":", ".") in error


# --- the plugin: the guard, the activation check, FASTBATCH_DISABLE -------------

@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_guard_accepts_the_installed_vllm():
    import vllm
    from vllm.v1.engine.logprobs import LogprobsProcessor

    assert PIECE.main.check_target(vllm.__version__, vllm_method()) is None
    assert PIECE.apply() is True
    assert LogprobsProcessor._update_sample_logprobs is patch._update_sample_logprobs
    assert PIECE.main.original() is vllm_method()


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
@pytest.mark.parametrize("broken", ["wrong rank", "raises"])
def test_activation_check_refuses_a_wrong_kernel(monkeypatch, logs, broken):
    from vllm.v1.engine.logprobs import LogprobsProcessor

    real = patch._update_sample_logprobs

    def wrong(processor, lists):
        if broken == "raises":
            raise RuntimeError("boom")
        lists = (lists[0], lists[1], lists[2] + 1, None)  # every sampled rank one off
        return real(processor, lists)

    monkeypatch.setattr(PIECE.main, "replacement", wrong)
    assert PIECE.apply() is False
    assert LogprobsProcessor._update_sample_logprobs is vllm_method()
    assert not PIECE.is_applied()  # nor the construction that reads the texts ahead
    (error,) = logs.at(logging.ERROR)
    assert "activation check failed" in error and PIECE.main.target in error


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_disable_leaves_it_stock(monkeypatch):
    from vllm.v1.engine.logprobs import LogprobsProcessor

    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setenv("FASTBATCH_DISABLE", NAME)
    vllm_plugin.register()
    try:
        assert LogprobsProcessor._update_sample_logprobs is vllm_method()
        assert vllm_plugin.status()["patches"][NAME] is False
    finally:
        vllm_plugin.revert()


# --- FASTBATCH_VERIFY: the shadow check -----------------------------------------

def update_wrong_for_wide_requests(processor, lists):
    """The real method, then the last entry's text changed, for requests with
    more than three logprobs (the activation check's have at most two)."""
    found = patch._update_sample_logprobs(processor, lists)
    if processor.num_logprobs > 3 and type(processor.logprobs) is list:
        last = processor.logprobs[-1]
        token = list(last)[-1]
        last[token].decoded_token += "!"
    return found


def real_steps(num_logprobs, count=3):
    rng = np.random.default_rng(num_logprobs + 7)
    for _ in range(count):
        ids = rng.integers(0, 300, (1, num_logprobs + 1)).astype(np.int32)
        values = -rng.random((1, num_logprobs + 1)).astype(np.float32)
        yield as_logprobs_lists((ids, values, rng.integers(1, 50, 1), None))


@pytest.mark.vllm
@pytest.mark.usefixtures("verified_piece")
@pytest.mark.parametrize(("flat", "num_logprobs"), [(False, 1), (True, 5), (False, 0)])
def test_verify_finds_no_divergence_on_real_steps(checked_method, flat, num_logprobs):
    method = checked_method()
    tokenizer = tokenizers()["byte-level"]
    stock = real_processor(tokenizer, flat, num_logprobs)
    ours = real_processor(tokenizer, flat, num_logprobs)
    checked = PIECE.main.checked
    for lists in real_steps(num_logprobs):
        vllm_method()(stock, lists)
        assert method(ours, lists) is None
    assert outcome(ours) == outcome(stock)
    assert PIECE.main.divergences == 0 and PIECE.main.checked == checked + 3


@pytest.mark.vllm
def test_verify_catches_a_bug_the_activation_check_cannot_see(verify_dir, monkeypatch, logs,
                                                              checked_method):
    method = checked_method()  # the activation check passed with the real kernel
    monkeypatch.setattr(PIECE.main, "replacement", update_wrong_for_wide_requests)
    tokenizer = tokenizers()["byte-level"]
    narrow = real_processor(tokenizer, False, 1)
    for lists in real_steps(1, 2):
        method(narrow, lists)
    assert PIECE.main.divergences == 0
    stock, ours = real_processor(tokenizer, False, 5), real_processor(tokenizer, False, 5)
    (lists,) = real_steps(5, 1)
    vllm_method()(stock, lists)

    assert method(ours, lists) is None

    assert outcome(ours) == outcome(stock)  # vLLM's position, in the processor's own list
    assert (PIECE.main.checked, PIECE.main.divergences) == (3, 1)
    assert vllm_plugin.status()["verify"]["divergences"][NAME] == 1
    (error,) = logs.at(logging.ERROR)
    assert f"'{NAME}'" in error and "fastbatch appended" in error

    # The reproducer replays the divergence, and no longer with the real kernel.
    (path,) = verify_dir.iterdir()
    assert path.name.startswith(f"{NAME}-") and str(path) in error
    assert "fastbatch appended" in vllm_plugin.replay(str(path))
    monkeypatch.setattr(PIECE.main, "replacement", patch._update_sample_logprobs)
    assert vllm_plugin.replay(str(path)) is None

    # From now on the piece runs vLLM's code: the kernel is not called again.
    monkeypatch.setattr(PIECE.main, "replacement", update_wrong_for_wide_requests)
    fastbatch.reset_stats()
    (lists,) = real_steps(5, 1)
    vllm_method()(stock, lists)
    method(ours, lists)
    assert outcome(ours) == outcome(stock)
    assert fastbatch.stats()[NAME]["calls"] == 0
