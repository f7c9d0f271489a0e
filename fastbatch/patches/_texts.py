"""The texts of token ids that vLLM's logprobs processing reads: per
tokenizer, the text of each id as its own calls gave it (read ahead by
``prewarm``), its memo of U+FFFD corrections, and one borrow from vLLM's
tokenizer pool per output-processor step (``STEP``, ``PoolLender``).  The
``update_sample_logprobs`` piece reads them; ``process_outputs`` enters
``STEP`` around each call; ``ByteTokenizer`` is the small byte-level
tokenizer of the front end's activation checks."""

from __future__ import annotations

import importlib
import inspect
import sys
import threading
import weakref
from typing import Any, ClassVar

MODULE = "vllm.v1.engine.logprobs"
# A tokenizer whose ``max_token_id`` is above this is not read ahead (at about
# 4.5 us and 145 bytes an id, the 262,144 ids of the largest vocabularies
# served today take about 1.2 s and 38 MB).
PREWARM_LIMIT = 1 << 19
# vLLM's tokenizer pool, and the methods it answers with a borrowed copy's
# that the texts and corrections call (see ``PoolLender``).
POOL_FACTORY = "vllm.tokenizers.hf:maybe_make_thread_pool"
POOL_METHODS = ("decode", "convert_ids_to_tokens")
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


def convert(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """vLLM's ``convert_ids_list_to_tokens`` (read from its module at each
    call) with ``tokenizer`` as ``lent`` gives it."""
    return sys.modules[MODULE].convert_ids_list_to_tokens(lent(tokenizer), token_ids)


def _correct_decoded_token() -> Any:
    return sys.modules[MODULE].LogprobsProcessor._correct_decoded_token


def tokenizer_entry(tokenizer: Any) -> tuple[dict[int, str], Any] | None:
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
    entry = tokenizer_entry(tokenizer)
    return None if entry is None else entry[0]


# ---------------------------------------------------------------------------
# The texts read ahead, at the output processor's construction.

# The tokenizers whose texts ``prewarm`` read (for ``forget``).
_PREWARMED: weakref.WeakSet[Any] = weakref.WeakSet()


def prewarm(tokenizer: Any) -> int:
    """Put in ``tokenizer``'s table the text of every id from 0 to its
    ``max_token_id`` not there yet, each from vLLM's
    ``convert_ids_list_to_tokens(tokenizer, [id])``, the call that gives a
    text on first sight (``convert``, one copy of vLLM's tokenizer pool
    borrowed for them all); returns how many were read.

    An id whose call raises, or does not give a list of one str, is left
    out: it is met on first sight as before, where the same call raises or is
    refused as it would be.  Nothing is read for no tokenizer, one that
    cannot key a table, or one without an int ``max_token_id`` from 0 to
    ``PREWARM_LIMIT``."""
    entry = None if tokenizer is None else tokenizer_entry(tokenizer)
    last = getattr(tokenizer, "max_token_id", None)
    if entry is None or type(last) is not int or not 0 <= last <= PREWARM_LIMIT:
        return 0
    texts, read = entry[0], 0
    with STEP:
        for token_id in range(last + 1):
            if token_id in texts:
                continue
            try:
                found = convert(tokenizer, [token_id])
            except Exception:  # met on first sight, where the same call raises
                continue
            if type(found) is list and len(found) == 1 and type(found[0]) is str:
                texts[token_id] = found[0]
                read += 1
    _PREWARMED.add(tokenizer)
    return read


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
