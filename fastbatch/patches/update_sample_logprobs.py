"""Patch: ``vllm.v1.engine.logprobs.LogprobsProcessor._update_sample_logprobs``.

What is replaced: the output processor's method that appends a request's
sample logprobs of one step (token ids, logprobs, ranks and decoded texts) to
its logprobs. One compiled method (``fastbatch.update_sample_logprobs``) with
a table of texts read ahead in ``OutputProcessor.__init__``. vLLM 0.32.0 to
0.34.0.

Guard: the fingerprints of the method and its companions; the activation check
on processors of a byte-level tokenizer with U+FFFD; the shadow runs vLLM's
method on a copy.

When it can go: if vLLM caches the per-id texts itself and builds the entries
without a Python loop per logprob.

Upstream: vllm-project/vllm#57442 (open: a sampled-token logprob fast path)
and #14300 (open: logprobs' cost).

Story and numbers: ``docs/pieces/update_sample_logprobs.md``.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import logging
import sys
import threading
import time
import weakref
from typing import Any, ClassVar

import fastbatch
from fastbatch.patches._patch import Patch, Shadow

logger = logging.getLogger("vllm.fastbatch")

MODULE = "vllm.v1.engine.logprobs"
TARGET = f"{MODULE}:LogprobsProcessor._update_sample_logprobs"
# Where the texts are read ahead (``prewarm``): the output processor's
# construction, at the engine's start.
PREWARM_TARGET = "vllm.v1.engine.output_processor:OutputProcessor.__init__"
PREWARM_FINGERPRINTS = {
    "adb0c9b5d13052495190cefd172642c44ffcfdab5195a429e63d03e3aee7ea0b":
        "vLLM 0.32.0-0.33.0",
}
# A tokenizer whose ``max_token_id`` is above this is not read ahead (at about
# 4.5 us and 145 bytes an id, the 262,144 ids of the largest vocabularies
# served today take about 1.2 s and 38 MB).
PREWARM_LIMIT = 1 << 19
# vLLM's tokenizer pool, and the methods it answers with a borrowed copy's
# that the texts and corrections call (see ``PoolLender``).
POOL_FACTORY = "vllm.tokenizers.hf:maybe_make_thread_pool"
POOL_METHODS = ("decode", "convert_ids_to_tokens")
VERIFIED_FINGERPRINTS = {
    "d4450b8bd306cd3377da71bb0573b7a911541d18e6dda48af88be2cafd88fe69":
        "vLLM 0.32.0-0.33.0",
}
COMPANION_FINGERPRINTS = {
    f"{MODULE}:LogprobsProcessor._verify_tokens": {
        "bc6c287ff14be31b981113ce655654886cb87d65d5e978dc3a41defdc0748a52":
            "vLLM 0.32.0-0.33.0"},
    f"{MODULE}:LogprobsProcessor._get_sampled_context_ids": {
        "f5862e97e97df96df21add90ace78b80bf40e8e468e3a7300ae86ffb345d822e":
            "vLLM 0.32.0-0.33.0"},
    "vllm.logprobs:append_logprobs_for_next_position": {
        "38b9b7c5119c251bbd5dcb0a8a8492bedbd035e42e4ae146340d8290656afe54":
            "vLLM 0.32.0-0.33.0"},
    "vllm.logprobs:FlatLogprobs.append_fast": {
        "d56e82b3697564f5e49144640d3813611d07a494cd7b90a32c0d6120bb406f2c":
            "vLLM 0.32.0-0.33.0"},
    "vllm.tokenizers.detokenizer_utils:convert_ids_list_to_tokens": {
        "fed8da48c1494b30d707c9fd55e217e2f8cc484faae1de31c90ca11cb52f4f9b":
            "vLLM 0.32.0-0.33.0"},
    f"{MODULE}:LogprobsProcessor._correct_decoded_token": {
        "dad9ddbe0945fb4ba0668e3c1d32797725e841d491c49ded680eb1a4947e2db3":
            "vLLM 0.32.0-0.33.0"},
    POOL_FACTORY: {
        "5951034387bbf8d5a4427402a1139fe597eaf616888abb90f19cfadf69857f1d":
            "vLLM 0.32.0-0.33.0"},
}
FLAT_LISTS = ("start_indices", "end_indices", "token_ids", "logprobs", "ranks",
              "decoded_tokens")

# Per tokenizer: the texts of its ids, as its own calls gave them, and its
# U+FFFD corrector (``MemoCorrector``); the last tokenizer's are kept at hand
# (weakly: they go with their tokenizers).
_TABLES: weakref.WeakKeyDictionary[Any, tuple[dict[int, str], Any]] = \
    weakref.WeakKeyDictionary()
_last: tuple[Any, dict[int, str], Any] = (lambda: None, {}, None)
_NO_TEXTS: dict[int, str] = {}  # without a tokenizer no text is looked up
# Per tokenizer, at most this many texts of the id lists its U+FFFD
# corrections decoded, and as many corrected texts (each memo is emptied
# when full): up to about 8 MB.
MEMO_LIMIT = 1 << 14


class Lent:
    """The ``self`` of vLLM's ``LogprobsProcessor._correct_decoded_token`` for
    one correction: that method reads nothing of ``self`` but
    ``self.tokenizer`` and calls nothing of it but ``decode(ids)`` (pinned by
    the guard); here that is a ``MemoTokenizer``."""

    __slots__ = ("tokenizer",)

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer


def _remember(memo: dict[tuple[int, ...], str], key: tuple[int, ...], text: str) -> None:
    """``memo[key] = text``, the memo emptied first when it holds ``MEMO_LIMIT``."""
    if len(memo) >= MEMO_LIMIT:
        memo.clear()
    memo[key] = text


class MemoTokenizer:
    """``decode(ids)`` of ``tokenizer``, answered from ``decodes`` (a
    tokenizer's memo: the tuple of ids -> what its own ``decode`` returned
    for them) where the same ids were decoded before.

    A correction decodes up to four short id lists with context (each
    through vLLM's tokenizer pool a borrow, a context manager and a queue
    get and put), and the same multi-byte characters bring the same lists
    back.  A tokenizer's decoding of a list of ids does not change over its
    life, as the per-id table already relies on.
    """

    __slots__ = ("decodes", "tokenizer")

    def __init__(self, decodes: dict[tuple[int, ...], str], tokenizer: Any) -> None:
        self.decodes, self.tokenizer = decodes, tokenizer

    def decode(self, ids: list[int]) -> str:
        key = tuple(ids)
        text = self.decodes.get(key)
        if text is None:
            text = self.tokenizer.decode(ids)
            _remember(self.decodes, key, text)
        return text


class MemoCorrector:
    """``correct(processor, token, context)`` for one tokenizer's U+FFFD
    corrections: vLLM's ``_correct_decoded_token`` with the processor's
    tokenizer behind this corrector's memo of its decodes (``decodes``, see
    ``MemoTokenizer``), its texts kept by token and context (``corrected``:
    that method is a function of the two and of ``decode``'s answers); a
    processor whose class has its own correction gets that one called."""

    __slots__ = ("corrected", "decodes")

    def __init__(self) -> None:
        self.decodes: dict[tuple[int, ...], str] = {}
        self.corrected: dict[tuple[int, ...], str] = {}

    def __call__(self, processor: Any, token_id: int, context_token_ids: list[int]) -> str:
        vllm_correct = _correct_decoded_token()
        if type(processor)._correct_decoded_token is not vllm_correct:
            return processor._correct_decoded_token(token_id, context_token_ids)
        key = (token_id, *context_token_ids)
        text = self.corrected.get(key)
        if text is None:
            text = vllm_correct(Lent(MemoTokenizer(self.decodes, lent(processor.tokenizer))),
                                token_id, context_token_ids)
            _remember(self.corrected, key, text)
        return text


# ---------------------------------------------------------------------------
# One borrow from vLLM's tokenizer pool per step.

class PoolLender:
    """A tokenizer of vLLM's pool (``maybe_make_thread_pool``) with one copy
    borrowed from its pool: ``decode`` and ``convert_ids_to_tokens`` are that
    copy's; every other attribute, read or written, is the pool tokenizer's
    own.

    The pool answers each of those two calls by borrowing a copy (a context
    manager, a queue get and put) and calling the copy's method; any copy
    may answer ("adjacent method calls could happen on different deep
    copies").  Here one borrowed copy answers them all for a step of the
    output processor (``STEP``).  While a step holds it the pool has one copy
    fewer to lend: a borrow of vLLM's in the same step (prompt logprobs) or
    from the renderer's threads takes another, or, with every copy out,
    makes one more, as the pool does.
    """

    __slots__ = ("_copy", "_pool")

    def __init__(self, pool: Any, borrowed: Any) -> None:
        object.__setattr__(self, "_pool", pool)
        object.__setattr__(self, "_copy", borrowed)

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        return self._copy.decode(*args, **kwargs)

    def convert_ids_to_tokens(self, *args: Any, **kwargs: Any) -> Any:
        return self._copy.convert_ids_to_tokens(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._pool, name, value)


def _pool_methods() -> dict[str, Any]:
    """The code of ``POOL_METHODS`` in the class that vLLM's pool factory makes."""
    module, _, name = POOL_FACTORY.partition(":")
    factory = getattr(importlib.import_module(module), name)
    return {code.co_name: code for pool_class in factory.__code__.co_consts
            if inspect.iscode(pool_class) and pool_class.co_name == "TokenizerPool"
            for code in pool_class.co_consts
            if inspect.iscode(code) and code.co_name in POOL_METHODS}


def _factory_borrow(kind: type) -> Any:
    """The borrow of a class that vLLM's pool factory made (its
    ``POOL_METHODS`` that factory's code, all with one borrow), or None."""
    codes, borrows = _pool_methods(), set()
    for name in POOL_METHODS:
        method = vars(kind).get(name)
        code = getattr(method, "__code__", None)
        if code is None or code is not codes.get(name):
            return None
        cells = dict(zip(code.co_freevars, method.__closure__, strict=True))
        borrows.add(cells["_borrow_from_pool"].cell_contents)
    return borrows.pop() if len(borrows) == 1 else None


_BORROWS: weakref.WeakKeyDictionary[type, Any] = weakref.WeakKeyDictionary()


def pool_borrow(tokenizer: Any) -> Any:
    """The borrow of ``tokenizer``'s pool (a context manager that gives a copy
    and puts it back), for a tokenizer whose class vLLM's pool factory made
    (``_factory_borrow``); else None.  Kept per class: each pool has its own."""
    kind = type(tokenizer)
    try:
        return _BORROWS[kind]
    except KeyError:
        borrow = _BORROWS[kind] = _factory_borrow(kind)
        return borrow
    except TypeError:  # a class without weak references: not a pool's
        return None


class Step(threading.local):
    """The output processor's step on this thread (``with STEP:``, entered by
    the ``process_outputs`` piece around each call): within it, ``lent`` gives
    each vLLM pool tokenizer's ``PoolLender``, its copy borrowed at the first
    text or correction that needs one and put back when the step ends."""

    def __init__(self) -> None:
        self.depth = 0
        self.lent: dict[int, tuple[Any, PoolLender]] = {}

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc_info: Any) -> None:
        self.depth -= 1
        if self.depth == 0 and self.lent:
            lent, self.lent = self.lent, {}
            for borrowed, _ in lent.values():
                borrowed.__exit__(None, None, None)


STEP = Step()


def lent(tokenizer: Any) -> Any:
    """``tokenizer``, or within a ``STEP`` on this thread, for a tokenizer of
    vLLM's pool, its ``PoolLender`` (the copy borrowed once for the step)."""
    if not STEP.depth:
        return tokenizer
    found = STEP.lent.get(id(tokenizer))  # the lender keeps it alive: ids stay unique
    if found is None:
        borrow = pool_borrow(tokenizer)
        if borrow is None:
            return tokenizer
        borrowed = borrow()
        found = STEP.lent[id(tokenizer)] = (borrowed, PoolLender(tokenizer, borrowed.__enter__()))
    return found[1]


def _convert(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """vLLM's ``convert_ids_list_to_tokens`` (read from its module at each
    call) with ``tokenizer`` as ``lent`` gives it."""
    return sys.modules[MODULE].convert_ids_list_to_tokens(lent(tokenizer), token_ids)


def _correct_decoded_token() -> Any:
    return sys.modules[MODULE].LogprobsProcessor._correct_decoded_token


def _tokenizer_entry(tokenizer: Any) -> tuple[dict[int, str], Any] | None:
    """``(texts, correct)`` of ``tokenizer``, or None where a tokenizer cannot
    key them (unhashable, no weak reference)."""
    global _last
    if tokenizer is None:
        return _NO_TEXTS, None
    ref, table, correct = _last
    if ref() is tokenizer:
        return table, correct
    try:
        entry = _TABLES.get(tokenizer)
        if entry is None:
            entry = _TABLES[tokenizer] = ({}, MemoCorrector())
        _last = (weakref.ref(tokenizer), *entry)
    except TypeError:
        return None
    return entry


def forget() -> None:
    """Empty every tokenizer's table of texts and memos of corrections, as
    in a new process (benchmarks' cold runs: every run then meets its ids
    and U+FFFD contexts for the first time); the texts of a tokenizer that
    an output processor's construction read ahead (``prewarm``) are read
    again, as that construction in a new process would."""
    for texts, corrector in _TABLES.values():
        texts.clear()
        corrector.decodes.clear()
        corrector.corrected.clear()
    for tokenizer in list(_PREWARMED):
        prewarm(tokenizer)


def texts_of(tokenizer: Any) -> dict[int, str] | None:
    """The table of ``tokenizer``'s texts (``{}`` for no tokenizer), or None
    where a tokenizer cannot key one (unhashable, no weak reference)."""
    entry = _tokenizer_entry(tokenizer)
    return None if entry is None else entry[0]


# ---------------------------------------------------------------------------
# The texts read ahead, at the output processor's construction.

# The tokenizers whose texts ``prewarm`` read (for ``forget``).
_PREWARMED: weakref.WeakSet[Any] = weakref.WeakSet()


def prewarm(tokenizer: Any) -> int:
    """Put in ``tokenizer``'s table the text of every id from 0 to its
    ``max_token_id`` not there yet, each from vLLM's
    ``convert_ids_list_to_tokens(tokenizer, [id])``, the call that gives a
    text on first sight (``_convert``, one copy of vLLM's tokenizer pool
    borrowed for them all); returns how many were read.

    An id whose call raises, or does not give a list of one str, is left
    out: it is met on first sight as before, where the same call raises or is
    refused as it would be.  Nothing is read for no tokenizer, one that
    cannot key a table, or one without an int ``max_token_id`` from 0 to
    ``PREWARM_LIMIT``."""
    entry = None if tokenizer is None else _tokenizer_entry(tokenizer)
    last = getattr(tokenizer, "max_token_id", None)
    if entry is None or type(last) is not int or not 0 <= last <= PREWARM_LIMIT:
        return 0
    texts, read = entry[0], 0
    with STEP:
        for token_id in range(last + 1):
            if token_id in texts:
                continue
            try:
                found = _convert(tokenizer, [token_id])
            except Exception:  # met on first sight, where the same call raises
                continue
            if type(found) is list and len(found) == 1 and type(found[0]) is str:
                texts[token_id] = found[0]
                read += 1
    _PREWARMED.add(tokenizer)
    return read


def _output_processor_type() -> type:
    return sys.modules[PREWARM_TARGET.partition(":")[0]].OutputProcessor


def _stock_init() -> Any:
    """vLLM's ``OutputProcessor.__init__``: the patch's original while
    applied, else the class's (the activation check runs before)."""
    return PREWARM_PATCH.original() or _output_processor_type().__init__


def _output_processor_init(self: Any, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
    """vLLM's ``OutputProcessor.__init__``, then the texts of the processor's
    tokenizer read ahead (``prewarm``): at the engine's start, not on the
    first steps.  (Installed only with ``PATCH``; after a divergence that
    ``FASTBATCH_VERIFY`` found, the piece runs vLLM's code, and nothing is
    read.)"""
    _stock_init()(self, tokenizer, *args, **kwargs)
    if not PATCH.piece_diverged:
        started = time.perf_counter()
        read = prewarm(self.tokenizer)
        if read:
            logger.info("fastbatch: read the texts of %d token ids ahead in %.0f ms "
                        "(update_sample_logprobs)", read,
                        (time.perf_counter() - started) * 1e3)


def _kinds() -> tuple[type, type]:
    """(Logprob, FlatLogprobs) of this vLLM."""
    logprobs = sys.modules["vllm.logprobs"]
    return logprobs.Logprob, logprobs.FlatLogprobs


def _stock_method() -> Any:
    """vLLM's method: the patch's original while applied, else the class's."""
    original = PATCH.original()
    if original is not None:
        return original
    return sys.modules[MODULE].LogprobsProcessor._update_sample_logprobs


# The piece in use: the compiled one, or its twin where it cannot be imported
# (then the plugin leaves vLLM stock anyway): its module, by this module's
# name (the package exports the function of the same name).
_piece = importlib.import_module(
    f"fastbatch.{'_kernels' if fastbatch.COMPILED else '_reference'}.{__name__.rpartition('.')[2]}")

# fastbatch's drop-in for ``LogprobsProcessor._update_sample_logprobs``: the
# compiled function itself, bound on vLLM's class (no Python frame before the
# compiled call), with vLLM's signature.  ``bind()`` gives it vLLM's method,
# the tables (``_tokenizer_entry``), vLLM's module and the kinds.
_update_sample_logprobs = _piece.update


def bind(stock: Any = None) -> None:
    """Bind ``_update_sample_logprobs`` to ``stock`` (by default vLLM's own
    method), the per-tokenizer tables, the first-sight texts (``_convert``)
    and ``(Logprob, FlatLogprobs)``."""
    _piece.bind(stock or _stock_method(), _tokenizer_entry, _convert, _kinds())


# ---------------------------------------------------------------------------
# The activation check: a small byte-level tokenizer that makes U+FFFD.

class ByteTokenizer:
    """Ids 0-255 are single bytes, 256-258 short words, the rest unknown:
    ``decode`` joins the bytes and decodes them with replacement, as a
    byte-level BPE does, so that a lone lead byte ends in U+FFFD."""

    WORDS: ClassVar[dict[int, bytes]] = {256: b" the", 257: b"\xc3\xa9t\xc3\xa9", 258: b"\xe2\x82"}
    max_token_id = 258

    def decode(self, ids: list[int], **_: Any) -> str:
        data = b"".join(self.WORDS.get(i, bytes([i % 256])) for i in ids)
        return data.decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: list[int], **_: Any) -> list[str]:
        return [self.decode([i]) for i in ids]


def _processors(flat: bool, num_logprobs: int, tokenizer: Any) -> Any:
    processor_type = sys.modules[MODULE].LogprobsProcessor
    logprobs = sys.modules["vllm.logprobs"]
    return processor_type(tokenizer=tokenizer, logprobs=logprobs.create_sample_logprobs(flat),
                          prompt_logprobs=None, cumulative_logprob=0.0,
                          num_logprobs=num_logprobs, num_prompt_logprobs=None)


def _synthetic_steps() -> list[tuple[bool, int, bool, list[tuple[Any, ...]]]]:
    """(flat, num_logprobs, with a tokenizer, steps): each step the arrays of
    one call: U+FFFD texts with and without context, the sampled token among
    the top ones, a batch wider than the request, several positions, -inf."""
    import numpy as np

    def step(ids: list[list[int]], values: list[list[float]], ranks: list[int],
             id_type: Any = np.int32) -> tuple[Any, ...]:
        return (np.array(ids, dtype=id_type), np.array(values, dtype=np.float32),
                np.array(ranks, dtype=np.int64), None)

    steps = [
        step([[0xC3, 0xC3, 65]], [[-0.5, -0.5, -1.25]], [1]),
        step([[0xA9, 256, 0xE2]], [[-0.1, -2.0, -3.0]], [2]),
        step([[258, 0x82, 257], [0xAC, 0xAC, 66]], [[-1.0, -0.2, -0.3], [-0.01, -0.01, -np.inf]],
             [3, 1], np.int64),
        step([[0xF0, 0x9F, 0x98]], [[-7.5, -0.5, -0.75]], [40]),
        step([[0x80, 0x41, 0x42], [0x41, 0x80, 0x42], [300, 0x42, 0x41]],
             [[-0.3, -0.2, -0.9], [-0.2, -0.3, -0.9], [-1.5, -0.1, -0.2]], [2, 1, 5]),
        step(np.zeros((0, 3), dtype=np.int32), np.zeros((0, 3), dtype=np.float32),
             []),
    ]
    return [(flat, num_logprobs, with_tokenizer, steps)
            for flat in (False, True) for num_logprobs in (0, 1, 2, -1)
            for with_tokenizer in (True, False)]


def logprobs_outcome(processor: Any, start: tuple[int, int]) -> tuple[Any, ...]:
    """The positions appended since ``start`` (positions, flat entries) and
    the cumulative logprob, in a comparable, picklable form (floats as
    their hex, so that equal means bit for bit, NaN and -0.0 included)."""
    def exact(value: Any) -> Any:
        return (type(value).__name__, value.hex() if type(value) is float else value)

    container = processor.logprobs
    positions, entries = start
    if type(container) is list:
        appended = [(type(entry).__name__, [
            (exact(token), type(logprob).__name__, exact(logprob.logprob),
             exact(logprob.rank), exact(logprob.decoded_token))
            for token, logprob in entry.items()]) for entry in container[positions:]]
    else:
        appended = [(name, [exact(value) for value in getattr(container, name)[
            positions if name.endswith("_indices") else entries:]]) for name in FLAT_LISTS]
    return type(container).__name__, appended, exact(processor.cumulative_logprob)


def _start(container: Any) -> tuple[int, int]:
    if type(container) is list:
        return len(container), 0
    return len(container.start_indices), len(container.logprobs)


def activation_check(method: Any, replacement: Any) -> str | None:
    """Run both on the synthetic processors; why the logprobs differ, or None."""
    bind(method)
    for flat, num_logprobs, with_tokenizer, steps in _synthetic_steps():
        tokenizer = ByteTokenizer() if with_tokenizer else None
        stock = _processors(flat, num_logprobs, tokenizer)
        ours = _processors(flat, num_logprobs, ByteTokenizer() if with_tokenizer else None)
        for arrays in steps:
            expected_start, got_start = _start(stock.logprobs), _start(ours.logprobs)
            method(stock, arrays)
            replacement(ours, arrays)
            expected = logprobs_outcome(stock, expected_start)
            got = logprobs_outcome(ours, got_start)
            if got != expected:
                return (f"flat={flat} num_logprobs={num_logprobs} tokenizer="
                        f"{with_tokenizer}: fastbatch gave {got}, vLLM gave {expected}")
    return None


# ---------------------------------------------------------------------------
# The shadow check.

def copy_container(container: Any) -> Any:
    """A container vLLM's method can append to without touching ``container``
    (its entries already there are only read: shared)."""
    if type(container) is list:
        return list(container)
    duplicate = copy.copy(container)
    for name in FLAT_LISTS:
        setattr(duplicate, name, list(getattr(container, name)))
    return duplicate


def _snapshot(processor: Any, logprobs_lists: Any) -> dict[str, Any]:
    stand_in = copy.copy(processor)
    stand_in.logprobs = copy_container(processor.logprobs)
    return {"processor": stand_in, "logprobs_lists": logprobs_lists,
            "start": _start(processor.logprobs)}


def _run(method: Any, inputs: dict[str, Any]) -> tuple[Any, ...]:
    """``method`` on a fresh copy of the snapshot's processor: its outcome."""
    processor = copy.copy(inputs["processor"])
    processor.logprobs = copy_container(processor.logprobs)
    result = method(processor, inputs["logprobs_lists"])
    return result, logprobs_outcome(processor, inputs["start"])


def _outcome(inputs: dict[str, Any], result: Any, processor: Any,
             logprobs_lists: Any) -> tuple[Any, ...]:
    return result, logprobs_outcome(processor, inputs["start"])


def _compare(ours: tuple[Any, ...], stock: tuple[Any, ...]) -> str | None:
    if ours[0] != stock[0]:
        return f"fastbatch returned {ours[0]!r}, vLLM {stock[0]!r}"
    if ours[1] != stock[1]:
        return f"fastbatch appended {ours[1]!r}, vLLM {stock[1]!r}"
    return None


def _restore(inputs: dict[str, Any], stock: tuple[Any, ...], result: Any, processor: Any,
             logprobs_lists: Any) -> Any:
    """fastbatch's positions taken out again, then vLLM's method on the processor."""
    container = processor.logprobs
    positions, entries = inputs["start"]
    if type(container) is list:
        del container[positions:]
    else:
        for name in FLAT_LISTS:
            del getattr(container, name)[positions if name.endswith("_indices") else entries:]
    processor.cumulative_logprob = inputs["processor"].cumulative_logprob
    return _stock_method()(processor, logprobs_lists)


SHADOW = Shadow(snapshot=_snapshot, run=_run, outcome=_outcome, restore=_restore,
                compare=_compare)

PATCH = Patch(TARGET, _update_sample_logprobs, fingerprints=VERIFIED_FINGERPRINTS,
              companions=COMPANION_FINGERPRINTS, activation_check=activation_check,
              shadow=SHADOW)


# ---------------------------------------------------------------------------
# The texts read ahead: the activation check and the patch.

def _state(processor: Any) -> dict[str, Any]:
    """An output processor's attributes, comparable: the tokenizer by
    identity (vLLM's calls may cache things on it), each other object that
    compares by identity by its type and attributes."""
    def comparable(value: Any) -> Any:
        if type(value).__eq__ is object.__eq__ and hasattr(value, "__dict__"):
            return type(value), {name: comparable(item) for name, item in vars(value).items()}
        return value
    return {name: id(value) if name == "tokenizer" else comparable(value)
            for name, value in vars(processor).items()}


def prewarm_activation_check(method: Any, replacement: Any) -> str | None:
    """vLLM's ``OutputProcessor.__init__`` and fastbatch's build the same
    processor (with and without a tokenizer; one with nothing to read ahead,
    so that the check logs nothing), and ``prewarm`` puts vLLM's first-sight
    text of every id up to ``max_token_id`` in a new tokenizer's table (the
    ids above it left to first sight); why not, or None."""
    processor_type = _output_processor_type()
    convert = sys.modules[MODULE].convert_ids_list_to_tokens
    unread = ByteTokenizer()
    unread.max_token_id = None
    for tokenizer in (unread, None):
        built = []
        for init in (method, replacement):
            processor = object.__new__(processor_type)
            init(processor, tokenizer, log_stats=False, stream_interval=2)
            built.append(_state(processor))
        if built[0] != built[1]:
            return f"fastbatch built {built[1]}, vLLM built {built[0]}"
    tokenizer = ByteTokenizer()
    read = prewarm(tokenizer)
    expected = {token_id: convert(tokenizer, [token_id])[0]
                for token_id in range(tokenizer.max_token_id + 1)}
    texts = texts_of(tokenizer)
    if read != len(expected) or texts != expected:
        return f"prewarm read {read} texts {texts}, vLLM's first-sight texts are {expected}"
    return None


# Nothing of the construction to check (snapshot None): the texts read ahead
# are compared on each checked call of ``update_sample_logprobs`` (SHADOW),
# whose vLLM method decodes through the tokenizer itself.
PREWARM_SHADOW = Shadow(snapshot=lambda *args, **kwargs: None,
                        run=lambda function, inputs: None,
                        outcome=lambda *args, **kwargs: None,
                        restore=lambda *args, **kwargs: None)

# The texts are read ahead with the code the piece's method relies on
# (``convert_ids_list_to_tokens``, the pool): its companions.  (Not the method:
# installed, it is the compiled one.)
PREWARM_PATCH = Patch(PREWARM_TARGET, _output_processor_init,
                      fingerprints=PREWARM_FINGERPRINTS, companions=COMPANION_FINGERPRINTS,
                      activation_check=prewarm_activation_check, shadow=PREWARM_SHADOW,
                      requires=PATCH)

PATCHES = (PATCH, PREWARM_PATCH)
